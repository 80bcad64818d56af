"""The driver-side ``DistModel``: Paddle's DistModel API, run by a group of Ray ranks.

What users hold. It reads like Paddle's class and delegates each job to one part:

- `raydist.driver.model.validation`: every argument check, before any rank starts;
- `raydist.driver.lifecycle.lifecycle.Lifecycle`: the live group of ranks, its restart,
  resize and shutdown, spare ranks (and `raydist.driver.lifecycle.recovery` after a death);
- `raydist.driver.model.modes.Modes`: the mode, the programs built, a call's step message;
- `raydist.driver.model.rates.LearningRate`: the learning rate the ranks run with;
- `raydist.driver.model.results`: the ranks' answers made into a step's loss or outputs;
- `raydist.driver.model.state.ModelState`: state and checkpoints;
- `raydist.driver.api.evaluation` and `raydist.driver.api.fit`: ``evaluate`` and ``fit``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import pickling
from ...data.loader import ShardDataloader
from ...options import DispatchConfig, PlacementConfig, RecoveryConfig, merged
from ...strategy import micro_batch_size, micro_batches
from ...weights import Weights
from ..cluster.config import GroupConfig
from ..cluster.connect import init_ray, ray_started_here
from ..dispatch.client import LiveGroup, RankClient
from ..lifecycle.lifecycle import Lifecycle
from ..model.changes import Changes
from ..model.inputs import InputSpecs, leaves
from ..model.modes import MODES, Modes
from ..model.rates import LearningRate
from ..model.results import combine
from ..model.state import ModelState
from ..model.validation import check_arguments, group_sizes, input_specs
from .loss import Loss
from .status import RankStatus, rank_status

if TYPE_CHECKING:
    from ..lifecycle.detached import Claim, Hold
    from ..model.schedule import RankScheduler

log = logging.getLogger("raydist")


class DistModel:
    """Paddle's static auto-parallel ``DistModel``, one Ray actor per rank.

    Takes Paddle's arguments in Paddle's order, except that what would live on
    the ranks is given as something that makes it there:

    Args:
        layer: a picklable callable returning the ``paddle.nn.Layer``; it runs
            on every rank after the process group exists, so it can use
            ``dist.ProcessMesh`` and ``dist.shard_tensor``.
        loader: a `raydist.ShardDataloader` (the ranks read their own rows), a
            ``paddle.io.DataLoader`` (as in Paddle, the input specs come from its
            first batch; iterate it and pass its batches: they are global batches
            from the driver), or None (batches come from the driver).
        loss: a ``paddle.nn.Layer`` or callable ``(outputs..., labels...) -> loss``.
        optimizer: a callable ``parameters -> paddle.optimizer.Optimizer``
            (e.g. ``lambda p: paddle.optimizer.AdamW(1e-3, parameters=p)``).
        strategy: a ``paddle.distributed.Strategy``, passed to every rank.
        metrics: ``paddle.metric.Metric`` objects, as in Paddle (whose 3.3.1 static
            engine ignores them): `evaluate` reports them; the ranks that hold the
            outputs compute each step's values (``Metric.compute`` in the eval
            program), the driver updates and accumulates them.
        input_spec: as in Paddle, ``[[inputs...], [labels...]]`` of ``InputSpec``
            or ``DistributedInputSpec`` with GLOBAL shapes; None infers them from
            the first batch.
        num_workers: number of ranks; default: the processes of ``input_spec``'s mesh.
            ``(min, max)``: an elastic model (see `raydist.driver.cluster.sizes`): it starts
            at the largest accepted size the cluster holds now, ``fit`` goes on at a
            smaller size when a node is lost and grows when room returns, and
            ``restart()`` comes back at the size that fits. The layer builder makes
            its mesh from ``dist.get_world_size()``; a loader is made with the mesh
            of size ``max``, and the global batch is the same at every size.
        use_gpu: one GPU per rank and NCCL (otherwise CPU and gloo).
        shard_dims: the mesh dim along which batches are split across ranks
            (data parallel). The default "dp" splits along the mesh dim named
            "dp" if the model's mesh has one, else every rank gets the whole batch.
        placement_config: where the ranks run, a `raydist.PlacementConfig`:
            ``resources_per_rank``, ``placement_strategy``, ``placement_timeout_s``,
            ``master_port``, ``spare_ranks`` and ``runtime_env``, each also a keyword
            of its own (shorthand for the field; a keyword and the config that set
            one field differently are refused).
        dispatch_config: how steps reach the ranks, a `raydist.DispatchConfig`:
            ``dispatch`` ("auto", "calls", "tree", "compiled"), ``max_in_flight``,
            ``steps_per_message`` and ``step_timeout_s`` (a rank in one step for
            this long plus 5 s is a `RankError` naming it), keywords too.
        recovery_config: what the model keeps to come back from failures, a
            `raydist.RecoveryConfig`: ``peer_memory`` (copies of every rank's
            shards in host memory on another node, every this many train steps),
            ``check_replicas`` (the data-parallel replicas compared every this
            many train steps) and ``replica_mismatch``, keywords too.
        name: prefix of the ranks' actor names (and the model's name in events,
            metrics and ``raydist status``); default a random one.
        paddle_logs: show Paddle's INFO logs from the ranks (quiet by default).
        detached: the ranks and their placement group outlive this driver (a
            killed script, a notebook's kernel restart): `raydist.attach(name)` in
            a later driver returns this model, in its mode, at its step; only
            `shutdown` ends it. Needs a ``name`` and a Ray cluster (``ray start
            --head``, or ``RAY_ADDRESS``): a local Ray this process starts ends
            with it. See `raydist.driver.lifecycle.detached`.
        dynamic: the ranks run the layer eagerly, in Paddle's dynamic auto-parallel
            (dist tensors, ``loss.backward()``, ``optimizer.step()``), instead of a
            program dy2static converts: for layers it cannot convert (Python on a
            tensor's value, objects it refuses). The same driver API, state and
            checkpoints (a static model's load into a dynamic one and back);
            ``strategy.sharding`` through ``dist.shard_optimizer``. Pipelines and
            gradient merge run in the static mode only. See `raydist.worker.eager`.
        weights: start from these weights instead of the builder's initial values: a
            safetensors file or directory (``model.safetensors``, or shards and their
            index, as ``save_pretrained`` and `export` write them), a ``paddle.save``
            state dict (``model_state.pdparams``, or shards and their index), or a
            directory of Paddle's ``dist.save_state_dict`` (``*.metadata``,
            ``*.distcp``), on any mesh: each rank reads its own shards (see
            `raydist.weights`). Names are the Layer's structured ones; a tensor the
            layer has and the weights lack is an error. `raydist.Weights(path,
            prefix="lm.")`: weights of a sublayer (a model wrapped in a Layer of
            yours). Every group starts from them, a restart from the start too. A
            raydist checkpoint is `load`'s.

    Default mode follows Paddle: loss and optimizer -> "train"; loss only ->
    "eval"; neither -> "predict".
    """

    def __init__(
        self,
        layer: Callable[[], Any],
        loader: Any = None,
        loss: Any = None,
        optimizer: Callable[[Sequence[Any]], Any] | None = None,
        strategy: Any = None,
        metrics: Sequence[Any] | None = None,
        input_spec: Sequence[Sequence[Any]] | None = None,
        *,
        num_workers: int | tuple[int, int] | None = None,
        use_gpu: bool = False,
        shard_dims: str | None = "dp",
        resources_per_rank: Mapping[str, float] | None = None,
        placement_strategy: str = "PACK",
        master_port: int | None = None,
        placement_timeout_s: float | None = 300.0,
        name: str | None = None,
        paddle_logs: bool = False,
        runtime_env: Mapping[str, Any] | None = None,
        max_in_flight: int = 2,
        steps_per_message: int | str = "auto",
        dispatch: str = "auto",
        step_timeout_s: float | None = 900.0,
        spare_ranks: int = 0,
        detached: bool = False,
        peer_memory: int | None = None,
        check_replicas: int | None = None,
        replica_mismatch: str = "raise",
        dynamic: bool = False,
        weights: str | Weights | None = None,
        placement_config: PlacementConfig | None = None,
        dispatch_config: DispatchConfig | None = None,
        recovery_config: RecoveryConfig | None = None,
    ) -> None:
        placement = merged(PlacementConfig, placement_config, "placement_config",
                           resources_per_rank=resources_per_rank, placement_strategy=placement_strategy,
                           master_port=master_port, placement_timeout_s=placement_timeout_s,
                           spare_ranks=spare_ranks, runtime_env=runtime_env)  # fmt: skip
        sending = merged(DispatchConfig, dispatch_config, "dispatch_config", dispatch=dispatch,
                         max_in_flight=max_in_flight, steps_per_message=steps_per_message,
                         step_timeout_s=step_timeout_s)  # fmt: skip
        recovery = merged(RecoveryConfig, recovery_config, "recovery_config", peer_memory=peer_memory,
                          check_replicas=check_replicas, replica_mismatch=replica_mismatch)  # fmt: skip
        check_arguments(layer, loader, loss, optimizer, strategy, metrics, use_gpu=use_gpu, placement=placement,
                        dispatch=sending, name=name, detached=detached, dynamic=dynamic, weights=weights)  # fmt: skip
        inputs, labels = input_specs(input_spec, loader)
        sizes = group_sizes(num_workers, (inputs or []) + (labels or []), loader, placement.spare_ranks)
        if weights is not None and not isinstance(weights, Weights):
            weights = Weights(weights)
        payload = pickling.dumps((layer, loss, optimizer, strategy, list(metrics or []), dynamic, weights),
                                 "the layer builder, loss, optimizer or strategy")  # fmt: skip
        specs = InputSpecs(inputs, labels, shard_dims, {m: micro_batches(strategy, m) for m in MODES},
                           micro_batch_size(strategy))  # fmt: skip
        shard_loader = loader if isinstance(loader, ShardDataloader) else None  # read by the ranks
        config = GroupConfig(sizes.max, use_gpu, placement, sending.resolved(use_gpu, detached), recovery, name,
                             paddle_logs, preload=("ray.data",) if shard_loader is not None else (),
                             detached=detached)  # fmt: skip
        init_ray(sizes.max, placement.resources_per_rank, use_gpu)
        hold = None
        if detached:
            from ..lifecycle.detached import Hold

            if ray_started_here():
                log.warning("raydist: %r is detached, but this process started the local Ray it runs on, which "
                            "ends with the process: start a cluster (`ray start --head`) for its ranks to outlive "
                            "it", name)  # fmt: skip
            hold = Hold.create(str(name))  # (a detached model has a name: check_arguments)
        self._wire(config, sizes, payload, metrics or [], specs, loss is not None, optimizer is not None, hold)
        if shard_loader is not None:
            shard_loader.prepare()  # the first epoch's split starts while the ranks do
        try:
            self._life.start()
        except BaseException:
            if self._life.hold is not None:
                self._life.hold.end()
            raise
        if shard_loader is not None:
            shard_loader.bind(self._client, self._modes.data_meshes)

    def _wire(self, config: GroupConfig, sizes: Any, payload: bytes, metrics: Sequence[Any], specs: InputSpecs,
              has_loss: bool, has_optimizer: bool, hold: Hold | None) -> None:  # fmt: skip
        """The model's parts, each made whole with the parts it uses, one way whether the model is new
        (``__init__``) or a detached model's ranks a later driver attaches to (`_Attached`); ``hold``:
        this driver's hold on a detached model, whose record learns of every change."""
        self._metrics = list(metrics)
        self._group = group = LiveGroup()
        changes = Changes()
        self._rates = LearningRate(changes)
        self._state = ModelState(has_optimizer, self._rates, group, changes)
        self._modes = Modes(specs, has_loss, has_optimizer, self._state.built, group, changes)
        self._life = Lifecycle(config, sizes, payload, self._metrics, self._modes, self._rates, self._state, group,
                               changes, hold)  # fmt: skip

    @property
    def _client(self) -> RankClient:
        """The live group's client (for tests and benchmarks); a `GroupShutdownError` once shut down."""
        return self._group.get()

    # -- modes -----------------------------------------------------------------

    def train(self) -> None:
        """Switch every rank to "train": calls update the parameters and return the loss."""
        self._modes.check("train")
        self._modes.switch("train")

    def eval(self) -> None:
        """Switch every rank to "eval": calls return the loss, nothing is updated."""
        self._modes.check("eval")
        self._modes.switch("eval")

    def predict(self) -> None:
        """Switch every rank to "predict": calls return the model's outputs."""
        self._modes.switch("predict")

    @property
    def mode(self) -> str:
        """"train", "eval" or "predict"."""
        return self._modes.mode

    # -- steps -----------------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        """One step on a GLOBAL batch: the loss (train, eval) or the outputs (predict).

        Arguments are numpy arrays or paddle Tensors (or lists of them), inputs
        then labels, as for Paddle's DistModel; or the handles a
        `raydist.shard_dataloader` yields, which the ranks read themselves.
        Predict takes inputs only and returns the outputs as numpy. Train and
        eval return a `raydist.Loss` at once, while the step runs: it acts as
        the float loss of the batch, waiting for it when read.
        """
        modes = self._modes
        mode = modes.mode
        if mode == "train":  # a step boundary: move off a draining node, or grow (see Lifecycle.at_boundary)
            self._life.verify()
            self._life.at_boundary()
        message = modes.message(list(leaves(args)), self._rates.take_changes)
        plan = modes.plans[mode]
        rate = self._rates.position() if mode == "train" else None
        client = self._client
        step = client.step(message, lambda results: combine(plan, mode, results))
        self._life.sent(step.number, mode == "train", rate, message)
        return step.result() if mode == "predict" else Loss(step)

    def wait(self) -> None:
        """Complete every step in flight; raises the first failure (with ``check_replicas``, a
        mismatch of the checks of those steps too)."""
        self._client.drain()
        self._life.verify(wait=True)

    def evaluate(self, data: Any, steps: int | None = None, callbacks: Any = None) -> dict[str, float]:
        """Loss and metrics over every row of ``data``, as Paddle's ``Engine.evaluate``.

        ``data``: a `raydist.ShardDataloader` (one epoch of it) or an iterable of
        batches (inputs then labels, as for a call). Returns ``{"loss": ...,
        <metric names>: ...}``: the loss is the mean over the rows, each metric
        (``metrics=`` of the model) is updated with every step's values, which the
        ranks holding the outputs compute, and accumulated. The model goes back
        to its mode afterwards. ``callbacks``: ``paddle.callbacks.Callback`` objects,
        told ``on_eval_begin``, ``on_eval_batch_begin/end`` and ``on_eval_end`` (with
        the result). See `raydist.driver.api.evaluation`.
        """
        from .evaluation import evaluate

        return evaluate(self, self._modes, self._metrics, data, steps, callbacks)

    @property
    def lr_scheduler(self) -> RankScheduler | None:
        """The ranks' ``LRScheduler`` (None when the learning rate is a float): ``step()``,
        ``step(metrics)``, ``last_lr``, ``get_lr()``, ``state_dict()``; a change takes
        effect from the next call on. See `raydist.driver.model.schedule`."""
        return self._rates.scheduler

    # -- programs and state ----------------------------------------------------

    def dist_main_program(self, mode: str | None = None, rank: int = 0) -> str:
        """The text of ``rank``'s distributed main program of ``mode`` (default: current)."""
        return self._program("dist_main", mode, rank)

    def dist_startup_program(self, mode: str | None = None, rank: int = 0) -> str:
        """The text of ``rank``'s distributed startup program of ``mode``."""
        return self._program("dist_startup", mode, rank)

    def serial_main_program(self, mode: str | None = None, rank: int = 0) -> str:
        """The text of ``rank``'s serial (undistributed) main program of ``mode``."""
        return self._program("serial_main", mode, rank)

    def serial_startup_program(self, mode: str | None = None, rank: int = 0) -> str:
        """The text of ``rank``'s serial startup program of ``mode``."""
        return self._program("serial_startup", mode, rank)

    def _program(self, kind: str, mode: str | None, rank: int) -> str:
        from ...protocol import RankActor

        mode = mode or self.mode
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not 0 <= rank < self._client.size:
            raise ValueError(f"rank must be in [0, {self._client.size}), got {rank}")
        self._modes.build(mode)
        return str(self._client.call(RankActor.program, kind, mode, ranks=[rank])[0])

    def state_dict(self, mode: str = "all") -> dict[str, np.ndarray]:
        """The FULL (unsharded) state as numpy arrays, keyed like Paddle's ``DistModel.state_dict``.

        ``mode``: "param" (the model's parameters), "opt" (the optimizer's
        state) or "all".
        """
        if mode not in ("all", "opt", "param"):
            raise ValueError(f"mode must be 'all', 'opt' or 'param', got {mode!r}")
        return self._state.state_dict(mode)

    def set_state_dict(self, state: dict[str, Any]) -> None:
        """Set parameters (and optimizer state) from FULL values; every rank keeps its own shard.

        ``state`` maps names as `state_dict` gives them to numpy arrays or
        paddle Tensors; a subset is fine, e.g. a plain single-process
        ``paddle.nn.Layer.state_dict()`` to start from pretrained weights.
        Unknown names and wrong shapes are errors, before anything is sent.
        """
        self._state.set_state_dict(state)

    def save(self, path: str, position: tuple[int, int] | None = None, record: dict[str, Any] | None = None,
             background: bool = False) -> None:  # fmt: skip
        """Write a distributed checkpoint to ``path`` (a new local directory or a pyarrow.fs URI).

        Every rank writes its own shards, in parallel; the manifest keeps the
        step, the mode and the learning rate's position. ``position`` (the
        loader's epoch and the step in it to go on from) and ``record`` (any
        JSON-able dict, e.g. your loop's losses) are kept too, for
        `raydist.latest_checkpoint` to give back. ``background=True`` returns
        once every rank holds a copy of its shards in host memory: they are
        written while the next steps run, and the checkpoint is committed when
        all are (a failure leaves nothing that looks complete; the next save,
        `load`, `restart` and `shutdown` wait for it). See `raydist.checkpoint`.
        """
        import paddle

        from ... import __version__

        at = None if position is None else [int(p) for p in position]
        began, step = time.monotonic(), self._client.window.submitted
        self._state.save(path, self._life.trained(), background, step=step, mode=self.mode, raydist=__version__,
                         paddle=paddle.__version__, position=at, record=record or {})  # fmt: skip
        self._life.events.emit("checkpoint", step, path=path, background=background,
                               stall_s=round(time.monotonic() - began, 6))  # fmt: skip

    def export(self, path: str, format: str = "safetensors", max_shard_size: int | str = "5GB",
               prefix: str = "") -> list[str]:  # fmt: skip
        """Write the model's FULL parameters to a new directory ``path``, for other tools to load; the files written.

        ``format``: "safetensors" (``model.safetensors``, which PaddleFormers'
        ``from_pretrained`` reads, as do Hugging Face's tools) or "paddle" (a
        ``paddle.save`` state dict, ``model_state.pdparams``, for ``paddle.load``).
        Above ``max_shard_size`` (bytes, or "5GB", "500MB"...) the weights are split
        into shards with an index (``model.safetensors.index.json``). Names are the
        Layer's structured names (``layer.state_dict()``'s). Each file is written by
        one rank from the pieces the others hand it; the driver holds no tensor.
        ``path`` must be visible to every rank (a shared file system on a cluster
        of several nodes). ``prefix``: only the parameters under it, named
        without it (``prefix="lm."`` exports the ``LlamaForCausalLM`` a Layer of
        yours holds as ``self.lm``). In safetensors, ``paddle.nn.Linear`` weights
        are [out, in], as Hugging Face's and PaddleFormers' files hold them. For
        ``from_pretrained``, save the model's config beside
        (``config.save_pretrained(path)``). See `raydist.weights`.
        """
        from ... import weights

        if format not in weights.FORMATS:
            raise ValueError(f"format must be one of {weights.FORMATS}, got {format!r}")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        return self._state.export(os.path.abspath(path), format, weights.parse_size(max_shard_size), prefix)

    def load(self, path: str) -> None:
        """Restore parameters, optimizer state and the learning rate from a checkpoint `save` wrote, on any mesh.

        What the model does not have yet (the optimizer's state before the
        train program is built) is restored when it is built.
        """
        self._state.load(path, self._modes.built("train"), self._life.trained())
        self._life.loaded()

    def fit(
        self,
        loader: ShardDataloader | Any,
        epochs: int = 1,
        steps: int | None = None,
        checkpoint_every: int | None = None,
        checkpoint_dir: str | None = None,
        max_failures: int = 0,
        progress: bool = True,
        callbacks: Sequence[Any] | None = None,
        eval_loader: Any = None,
        eval_every: int | None = None,
        resume: bool = False,
        keep_last: int | None = None,
        flops_per_sample: float | None = None,
        peak_flops: float | None = None,
    ) -> list[float]:
        """Train on ``loader`` for ``epochs`` (or ``steps``), surviving up to ``max_failures`` rank failures.

        Shows a progress bar (loss, steps/s); runs Paddle's callbacks
        (``paddle.callbacks.Callback``: ``on_train_batch_end`` gets ``{"loss", "lr"}``);
        steps the learning-rate schedule every step (or every epoch, with
        ``callbacks=[paddle.callbacks.LRScheduler(by_step=False, by_epoch=True)]``);
        evaluates on ``eval_loader`` (a loader of its own) every ``eval_every``
        steps, or at each epoch's end; saves a checkpoint to
        ``checkpoint_dir/step-NNNNNNNN`` every ``checkpoint_every`` steps; on a
        `RankError` restarts the ranks, restores the newest state (see `restart`)
        and resumes the data where it stood; an elastic model grows at the first
        step boundary after room for more ranks shows. Returns the loss of every
        step. ``loader``: a `raydist.shard_dataloader` (the ranks read their rows), or a
        ``paddle.io.DataLoader`` whose batches the driver sends as global batches (not a
        shuffling one with ``max_failures`` or ``resume``: its order changes on every pass).

        With a ``checkpoint_dir``, the run's end is saved there too (and
        ``finished.json``). ``resume=True`` goes on with the run in
        ``checkpoint_dir`` from its newest complete checkpoint (a driver that
        died, a job run again): parameters, optimizer state, the schedule, the
        data's epoch, step and order, the loss history and the callbacks' state,
        so it ends as an undisturbed run would; an empty directory starts the run,
        a finished one returns its history (the model holds its final state), and
        one of another model or loader is refused, saying how it differs.
        ``keep_last=N`` keeps only the newest N checkpoints. The run's events (`events`) go to
        ``checkpoint_dir/events.jsonl`` too, appended across resumes.

        Throughput: the bar and the callbacks' logs have ``samples_per_s`` (over the last 50
        steps); with ``flops_per_sample`` (forward and backward of one row), ``flops_per_s``;
        with ``peak_flops`` too (the peak FLOP/s of all the ranks' devices together), ``mfu``.
        See `raydist.driver.api.fit`.
        """
        from .fit import fit

        return fit(self, self._life, loader, epochs, steps, checkpoint_every, checkpoint_dir,
                   max_failures, progress, callbacks, eval_loader, eval_every, resume, keep_last, flops_per_sample,
                   peak_flops)  # fmt: skip

    # -- watching --------------------------------------------------------------

    def events(self) -> list[dict[str, Any]]:
        """The run's events, oldest first: failures, restarts, resizes, preemption notices,
        checkpoints, attaches and take-overs, each a dict with ``kind``, ``time``, ``step`` and
        ``model`` and what belongs to its kind (see `raydist.driver.watching.events`)."""
        return self._life.events.list()

    def timeline(self, path: str, steps: int | None = None) -> dict[str, Any]:
        """Write the last ``steps`` steps (None: all each rank keeps, up to 2048) as a Chrome
        trace-event JSON at ``path``, for Perfetto or chrome://tracing: a track per rank with
        each step's wait for its batch, the step, and (CPU) each collective in it; a track for
        the driver's messages; every rank's clock aligned to the driver's. Returns the trace
        (see `raydist.driver.watching.timeline`)."""
        from ..watching.timeline import timeline

        return timeline(self._client, self._life.events.model, path, steps)

    # -- lifetime --------------------------------------------------------------

    @property
    def num_workers(self) -> int:
        """The number of ranks now (an elastic model's changes with the cluster)."""
        return self._client.size

    @property
    def ranks(self) -> list[RankStatus]:
        """This model's ranks as each reports itself now, in rank order: pid, node, device, mode,
        the steps it ran, peak memory (`raydist.RankStatus`). A `RankError` if one does not answer."""
        from ...protocol import RankActor

        group = self._client.group
        reports = group.call(RankActor.status)
        hold = self._life.hold
        return [rank_status(r, group.prefix, detached=hold is not None,
                            held_by=str(hold.holder) if hold is not None else None) for r in reports]  # fmt: skip

    @property
    def dispatch(self) -> str:
        """How steps reach the ranks: "calls" (an actor call per rank), "tree" (relayed by the
        ranks) or "compiled" (Ray's compiled graph); ``dispatch="auto"`` resolved."""
        return self._client.dispatch

    @property
    def step(self) -> int:
        """The number of steps this model was called for so far, over every mode and every group
        it had (the next step's number)."""
        return self._life.step()

    def restart(self) -> None:
        """Start a fresh group of ranks (after a failure) and restore the newest state there is.

        After a rank died, that is the state its surviving peers held, if they
        hold all of it (every shard of the parameters and optimizer state, e.g.
        on a data-parallel mesh) at the last step the driver saw complete: then
        nothing is lost but the steps that failed. Otherwise it is the last
        checkpoint this model saved or loaded; with none, the model starts from
        its initial parameters again (and, when no checkpoint was ever loaded and
        the driver still holds the batches, replays the train steps since). The
        restart's event in `events` says where the state stands: ``source``,
        ``trained`` (the train steps it is after) and ``behind`` (None: the
        checkpoint's or the initial state, with no step replayed; a loop goes
        back to it). Steps in flight are dropped; step numbers
        go on from where they were. An elastic model comes back at the largest
        accepted size the cluster holds now (waiting, up to
        ``placement_timeout_s``, for its minimum).
        """
        self._life.restart()

    def shutdown(self) -> None:
        """Complete the steps in flight, then stop every rank and free their resources; a detached
        model ends (a driver another one took it over from only lets go). Idempotent."""
        self._life.shutdown(drain=True)

    def _close(self) -> None:
        """Stop the ranks now, without completing the steps in flight."""
        self._life.close()

    def __enter__(self) -> DistModel:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # without an exception, raise a failure of the last steps; with one, it says what went wrong
        self._life.shutdown(drain=exc_type is None)


class _Attached(DistModel):
    """The `DistModel` of a detached model whose ranks run already, in a later driver (`raydist.attach`):
    made from the record's `raydist.driver.lifecycle.detached.Snapshot`; its ranks are adopted, not built."""

    def __init__(self, held: Claim, loader: Any = None) -> None:  # (DistModel.__init__ starts a new group)
        snapshot = held.snapshot
        self._wire(snapshot.config, snapshot.sizes, snapshot.payload, snapshot.metrics, snapshot.specs,
                   snapshot.has_loss, snapshot.has_optimizer, held.hold)  # fmt: skip
        self._state.adopt_checkpoint(snapshot.last_checkpoint)
        if isinstance(loader, ShardDataloader):
            loader.prepare()
        self._life.adopt(held.actors, held.pg, snapshot.meshes, snapshot.mode, held.rate)
        if isinstance(loader, ShardDataloader):
            loader.bind(self._client, self._modes.data_meshes)


def to_static(
    layer: Callable[[], Any],
    loader: Any = None,
    loss: Any = None,
    optimizer: Callable[[Sequence[Any]], Any] | None = None,
    strategy: Any = None,
    input_spec: Sequence[Sequence[Any]] | None = None,
    *,
    metrics: Sequence[Any] | None = None,
    num_workers: int | tuple[int, int] | None = None,
    use_gpu: bool = False,
    shard_dims: str | None = "dp",
    resources_per_rank: Mapping[str, float] | None = None,
    placement_strategy: str = "PACK",
    master_port: int | None = None,
    placement_timeout_s: float | None = 300.0,
    name: str | None = None,
    paddle_logs: bool = False,
    runtime_env: Mapping[str, Any] | None = None,
    max_in_flight: int = 2,
    steps_per_message: int | str = "auto",
    dispatch: str = "auto",
    step_timeout_s: float | None = 900.0,
    spare_ranks: int = 0,
    detached: bool = False,
    peer_memory: int | None = None,
    check_replicas: int | None = None,
    replica_mismatch: str = "raise",
    dynamic: bool = False,
    weights: str | Weights | None = None,
    placement_config: PlacementConfig | None = None,
    dispatch_config: DispatchConfig | None = None,
    recovery_config: RecoveryConfig | None = None,
) -> DistModel:
    """Build a `DistModel` on a group of Ray ranks, as ``paddle.distributed.to_static`` would
    (Paddle's arguments in Paddle's order; ``metrics`` is a keyword here). See `DistModel` for
    every argument."""
    return DistModel(layer, loader, loss, optimizer, strategy, metrics, input_spec, num_workers=num_workers,
                     use_gpu=use_gpu, shard_dims=shard_dims, resources_per_rank=resources_per_rank,
                     placement_strategy=placement_strategy, master_port=master_port,
                     placement_timeout_s=placement_timeout_s, name=name, paddle_logs=paddle_logs,
                     runtime_env=runtime_env, max_in_flight=max_in_flight, steps_per_message=steps_per_message,
                     dispatch=dispatch, step_timeout_s=step_timeout_s, spare_ranks=spare_ranks, detached=detached,
                     peer_memory=peer_memory, check_replicas=check_replicas, replica_mismatch=replica_mismatch,
                     dynamic=dynamic, weights=weights, placement_config=placement_config,
                     dispatch_config=dispatch_config, recovery_config=recovery_config)  # fmt: skip


def attach(name: str, loader: Any = None, take_over: bool = False) -> DistModel:
    """The live `DistModel` of the detached model ``name`` (see `raydist.attach`)."""
    from ..lifecycle.detached import claim

    held = claim(name, take_over)
    dm = _Attached(held, loader)
    life = dm._life
    if held.before is None:
        life.events.emit("attach", life.step(), holder=str(held.hold.holder))
    else:
        life.events.emit("take_over", life.step(), holder=str(held.hold.holder), **{"from": str(held.before)})
    return dm
