"""The static engine's mode defects (all devices).

Paddle 3.3.1 defects answered here (``paddle/distributed/auto_parallel/api.py``
``DistModel`` and ``static/engine.py`` ``Engine``, PIR mode):

1. ``DistModel.predict()`` then a call raises ``KeyError: 'predict'``:
   ``predict()`` goes through ``Engine.prepare``, which sets
   ``_outside_dataloader``, so ``Engine.run`` calls the legacy
   ``_prepare_reader`` (``KeyError`` on the PIR dist contexts) in predict and in
   every mode after it. And ``Engine.run`` fetches only the loss, which predict
   programs do not have. Fix: build predict programs like the others
   (`build`), keep the model's outputs alive under known names
   (`_predict` below), and fetch them.
2. ``Engine._initialize`` puts the parameters into the scope and runs the
   startup program only for mode "train", so a model without an optimizer
   (eval or predict first) runs with uninitialised parameters. Fix: the first
   mode prepared is initialised as train would be (`build`, ``first=True``).
   That initialisation (``ProgramHelper.init_pir``) may run once per engine:
   it shares the layer's parameters into the scope and frees them, and a
   second run reshards freed tensors (measured: SIGSEGV in
   ``reshard_ad_function``). And the train program's startup program (the
   optimizer's state) runs only while the engine has no executor. So a train
   program built after another mode skips ``init_pir`` and runs its startup
   program on a new executor, which keeps what the scope already holds
   (`build`, mode "train" and ``first=False``).
3. ``Engine._loss_names`` is overwritten by the last mode built, so the loss
   fetched in train after building eval or predict is the wrong one or none.
   Fix: `build` returns the names to fetch per mode, right after that mode is built.
5. ``Engine._job_plan`` (the jobs of gradient merge and pipelines: forward and
   backward per micro-batch, then optimize) is one per engine and is set on the
   executor once: a mode built after a gradient-merge train keeps train's plan,
   so eval updates the parameters (measured: eval after one merged train step
   changed a weight by 0.13) and returns k losses. Fix: `build` takes each
   mode's plan from the engine, and `use_mode` puts the mode's own plan (or
   none) on the executor; the values to fetch come from the plan's programs.
6. The Strategy's ``sharding`` section (``enable``, ``stage``, ``degree``) has
   no effect in PIR mode: ``Engine._parallel_pir`` never reads it (its
   sharding pass is commented out); only ``dist.shard_optimizer`` shards.
   Fix: `shard_by_strategy` wraps the optimizer in ``dist.shard_optimizer``
   with ``ShardingStage{stage}`` along the mesh dim "dp" (else the first).
7. ``DistModel`` ignores its metrics: ``to_static`` takes none, and a call in
   eval fetches the loss only (``Engine.run``), so the metric values
   ``ProxyLayer._eval`` computes are never read and, not persisted, are pruned
   from the PIR program. Fix: the runner hands the engine the metrics,
   `_eval` below keeps their values under known names, and `build` returns
   them to fetch.
8. Not a defect, but a behaviour raydist cannot live with: the train program
   updates each parameter right after its gradient's all_reduce (``adamw_``,
   then the next ``all_reduce``, ...), so a step broken off by a peer's death
   between two all_reduces leaves some parameters updated and others not, and
   the survivors' state cannot be trusted. Fix: `updates_last` moves every op
   that is not part of the update (op role Optimize) from after the first
   update to before it, in order; same ops, same inputs, same order of the
   collectives on every ring, so the same numbers; a step a death breaks off
   then never updated anything.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.base.framework import _dygraph_guard
from paddle.distributed.auto_parallel.static import engine as _engine
from paddle.distributed.auto_parallel.static import helper as _helper

from . import expect_source

OUTPUT_PREFIX = "raydist_output_"
METRIC_PREFIX = "raydist_metric_"

_applied = False
_original_predict = _helper.ProxyLayer._predict
_original_eval = _helper.ProxyLayer._eval


@paddle.jit.not_to_static
def _persist_outputs(proxy, mode):
    outputs = proxy._output_vars[mode]
    flat = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    proxy._raydist_output_names = []
    for i, value in enumerate(flat):
        name = f"{OUTPUT_PREFIX}{i}"
        paddle._C_ops.set_persistable_value(value, name)
        proxy._raydist_output_names.append(name)


def _predict(self, inputs, labels):
    _original_predict(self, inputs, labels)
    _persist_outputs(self, "predict")


@paddle.jit.not_to_static
def _persist_metrics(proxy, mode):
    fed = list(proxy._input_vars[mode]) + list(proxy._label_vars[mode])
    proxy._raydist_metric_names = []
    for i, values in enumerate(proxy._metric_vars[mode]):
        names = [f"{METRIC_PREFIX}{i}_{j}" for j in range(len(values))]
        for value, name in zip(values, names):
            if any(value.is_same(v) for v in fed):  # a fed value passed through (Precision's labels):
                value = paddle.assign(value)  # persisting the feed itself breaks the collectives' rewrite
            paddle._C_ops.set_persistable_value(value, name)
        proxy._raydist_metric_names.append(names)


def _eval(self, inputs, labels):
    _original_eval(self, inputs, labels)
    _persist_metrics(self, "eval")


def build(engine, mode: str, *, first: bool) -> list[list[str]]:
    """Build ``mode``'s program; returns the names of the values to fetch, in groups:
    predict: [outputs]; train: [[loss]]; eval: [[loss], metric 0's values, metric 1's...].

    ``first``: no mode was built before (this one initialises the parameters).
    """
    labels = engine._labels_spec
    if mode == "predict":
        engine._labels_spec = []  # predict programs take inputs only
    if first and mode != "train":
        _initialize_as_train(engine)
    elif mode == "train" and not first:
        _initialize_train_after_another_mode(engine)
    try:
        engine._prepare_program(mode, init_parameters=False)
    finally:
        engine._labels_spec = labels
        engine.__dict__.pop("_initialize", None)
        paddle.disable_static()
        plans = engine.__dict__.setdefault("_raydist_plans", {})
        plans[mode], engine._job_plan = engine._job_plan, None
    proxy = engine.program_helper.proxy_layer
    if mode == "predict":
        return [list(proxy._raydist_output_names)]
    loss = engine._loss_names
    names = [[loss] if isinstance(loss, str) else list(loss)[:1]]
    if mode == "eval":
        names += proxy._raydist_metric_names
    return names


def shard_by_strategy(optimizer, strategy, parameters):
    """The optimizer, sharded as ``strategy.sharding`` asks (defect 6)."""
    from paddle.distributed.auto_parallel.api import _ShardOptimizer

    from ..errors import UsageError
    from ..topology import Mesh

    section = strategy.sharding if strategy is not None else None
    if not _applied or section is None or not section.enable or isinstance(optimizer, _ShardOptimizer):
        return optimizer
    mesh = next((p.process_mesh for p in parameters if p.is_dist()), None)
    if mesh is None:
        raise UsageError("strategy.sharding needs a model whose parameters are on a mesh (dist.shard_tensor)")
    mesh = Mesh.of_paddle(mesh).to_paddle()  # a mesh of its own, not the parameter's
    dim = "dp" if "dp" in mesh.dim_names else mesh.dim_names[0]
    size = mesh.get_dim_size(dim)
    if section.degree not in (size, _DEFAULT_SHARDING_DEGREE):
        raise UsageError(f"strategy.sharding.degree is {section.degree}, but mesh dim {dim!r} has {size} ranks")
    stages = {1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}
    if section.stage not in stages:
        raise UsageError(f"strategy.sharding.stage must be 1, 2 or 3, got {section.stage}")
    return dist.shard_optimizer(optimizer, stages[section.stage](dim, mesh))


_DEFAULT_SHARDING_DEGREE = 8  # Strategy's default: taken as "the mesh dim's size"


OPTIMIZE_ROLE = 2  # paddle.base.core.op_proto_and_checker_maker.OpRole.Optimize
_COMMUNICATION = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast", "send",
                  "recv", "barrier", "all_to_all", "c_", "raydist_")  # fmt: skip


def updates_last(program) -> bool:
    """Behaviour 8: move the communication after the first update (the later gradients'
    all_reduce), with the ops it needs, before that update. Updates are the optimizer's
    in-place ops (``adamw_``, ``sgd_``...); an op that reads what an update made or
    changed stays after it. Returns whether no communication is left after the first
    update: then a step that fails in a collective has updated nothing."""
    ops = list(program.global_block().ops)
    last = max((i for i, op in enumerate(ops) if _communicates(op)), default=-1)
    first = next((i for i, op in enumerate(ops[:last]) if _updates(op)), None)
    if first is None:
        return True
    anchor, made, changed = ops[first], set[int](), set[int]()  # ids: ops that stay after it; values updates change
    for op in ops[first:last + 1]:
        sources = [v for v in op.operands_source() if v is not None and v.initialized()]
        if _updates(op) or any(_made_by(v) in made or v.id in changed for v in sources):
            made.add(op.id())
            if _updates(op):
                changed.update(v.id for v in sources)
            continue
        op.move_before(anchor)
    after = list(program.global_block().ops)
    return not any(_communicates(op) for op in after[after.index(anchor):])


def _updates(op) -> bool:
    return op.op_role == OPTIMIZE_ROLE and op.name().endswith("_") and not _communicates(op)


def _made_by(value) -> int | None:
    op = value.get_defining_op()
    return op.id() if op is not None else None


def _communicates(op) -> bool:
    name = op.name().split(".")[-1]
    return name.startswith(_COMMUNICATION) or op.has_attr("ring_id")


def use_mode(engine, mode: str) -> None:
    """Enter ``mode`` (built): Paddle's mode, and this mode's job plan on the executor."""
    engine.to_mode(mode)
    engine._executor._set_plan(engine._raydist_plans[mode])


def fetch_program(engine, mode: str):
    """The program whose values a step of ``mode`` fetches: the dense program, or,
    with a job plan, the job that computes the loss (as ``Engine.run`` picks it)."""
    plan = engine._raydist_plans[mode]
    if plan is None:
        return engine._pir_dense_main_progs[mode]
    pipeline = engine._strategy.pipeline
    job = f"forward{pipeline.vpp_degree - 1}" if pipeline.enable and pipeline.schedule_mode == "VPP" else "forward"
    return plan.ir_program(job)


# The engine's private members the ranks use, one function each (their guards are in `apply`):
# DistModel keeps its Engine in ``_engine``, the Engine keeps its strategy, specs, metrics,
# executor and programs in private attributes, and Paddle has no public accessor for any.


def engine_of(model):
    """A ``DistModel``'s static ``Engine``."""
    return model._engine


def set_metrics(engine, metrics) -> None:
    """Hand the engine the metrics ``to_static`` does not take (defect 7)."""
    engine._metrics = list(metrics)


def strategy_of(engine):
    return engine._strategy


def set_specs(engine, inputs: list, labels: list) -> None:
    """The input and label specs the next `build` builds a mode's program for."""
    engine._inputs_spec, engine._labels_spec = list(inputs), list(labels)


def specs_of(engine) -> tuple[list, list]:
    return engine._inputs_spec, engine._labels_spec


def executor_of(engine):
    return engine._executor


def has_plan(engine, mode: str) -> bool:
    """Whether ``mode`` runs as jobs (gradient merge, pipelines) rather than one program."""
    return engine._raydist_plans[mode] is not None


def expected_place():
    """The place Paddle puts new tensors on in this thread (``paddle.framework._current_expected_place``)."""
    return paddle.framework._current_expected_place()


def in_static_mode():
    """A context in which this thread builds and runs static programs (``paddle.enable_static`` only
    changes the thread that imported Paddle; steps may run on a Ray thread). Every step enters it."""
    return _dygraph_guard(None)


def dense_program(engine, mode: str):
    """The program a step of ``mode`` runs (read every step: a restore may build it anew)."""
    return engine._pir_dense_main_progs[mode]


def program(engine, kind: str, mode: str):
    """``kind`` ("dist_main", "dist_startup", "serial_main", "serial_startup") of ``mode``."""
    return {
        "dist_main": engine._pir_dist_main_progs,
        "dist_startup": engine._pir_dist_startup_progs,
        "serial_main": engine._fwd_main_progs,
        "serial_startup": engine._startup_progs,
        "dense_main": engine._pir_dense_main_progs,  # what runs (`dense_program`)
    }[kind][mode]


# mode -> (its dist program, get_dist_attr of it): 5 ms a call on the bench GPT, and peer memory
# and the replica check read the state every few steps
_DIST_ATTRS: dict[str, tuple] = {}


def local_state(model, mode: str) -> dict[str, tuple]:
    """This rank's state of the current mode's program:
    {structured name: (parameter name, local numpy array, mesh, dims_mapping or None)}."""
    from paddle.distributed.auto_parallel.static.utils import get_dist_attr

    engine = model._engine
    program = engine._pir_dist_main_progs[engine._mode]
    cached = _DIST_ATTRS.get(engine._mode)
    if cached is None or cached[0] is not program:  # a program's layouts are fixed once it is built
        cached = _DIST_ATTRS[engine._mode] = (program, get_dist_attr(program))
    attrs = cached[1]
    to_structured = model._parameter_to_structured_name
    out: dict[str, tuple] = {}
    for var, tensor in program.state_dict(mode, paddle.static.global_scope()).items():
        array = np.array(tensor)
        attr = attrs.get(var)
        name = to_structured.get(var) or var.replace(_DIST, "_", 1)
        if attr is not None and len(attr["dims_mapping"]) == array.ndim:
            mesh = (tuple(attr["process_shape"]), tuple(attr["process_group"]), tuple(attr["dim_names"]))
            out[name] = (var, array, mesh, tuple(attr["dims_mapping"]))
        else:  # e.g. AdamW's [1]-shaped beta powers with a 0-d attribute: the same on every rank
            out[name] = (var, array, None, None)
    return out


# A parameter on a mesh is named "<name>.dist" in the programs, and so is its optimizer
# state ("linear_0.w_0.dist_moment1_0"); without a mesh it is "linear_0.w_0_moment1_0",
# as in dygraph's optimizer.state_dict(). State keeps the latter: a checkpoint of a model
# on meshes then loads into one without, and back.
_DIST = ".dist_"


def _initialize_as_train(engine) -> None:
    # _initialize returns at once unless mode == "train": hand it this mode's
    # programs under the name "train" for the one call.
    original = type(engine)._initialize

    def initialize(mode, init_parameters=True):
        progs = (engine._pir_dist_main_progs, engine._startup_progs)
        for p in progs:
            p["train"] = p[mode]
        try:
            return original(engine, "train", init_parameters)
        finally:
            for p in progs:
                p.pop("train")

    engine._initialize = initialize


def _initialize_train_after_another_mode(engine) -> None:
    # the parameters are in the scope already: only train's startup program runs
    original = type(engine)._initialize

    def initialize(mode, init_parameters=True):
        helper = engine.program_helper
        helper.init_pir = lambda *args, **kwargs: None
        engine._executor = None  # _initialize runs the startup program only for a new executor
        try:
            return original(engine, mode, init_parameters)
        finally:
            del helper.init_pir

    engine._initialize = initialize


def apply() -> None:
    global _applied
    if _applied:
        return
    from paddle.distributed.auto_parallel.api import DistModel as _DistModel

    # the private members behind `engine_of` ... `expected_place` (`_dygraph_guard` is imported above: a
    # Paddle without it fails at that import)
    expect_source(_DistModel.__init__, "self._engine = Engine(", fix="engine")
    expect_source(_engine.Engine.__init__, "self._strategy", "self._inputs_spec", "self._labels_spec", "self._metrics",
                  "self._executor", fix="engine")  # fmt: skip
    expect_source(_engine.Engine._parallel_pir, "self._pir_dense_main_progs[mode]", "self._pir_dist_main_progs[mode]",
                  fix="engine")  # fmt: skip
    if not hasattr(paddle.framework, "_current_expected_place"):
        from . import CompatError

        raise CompatError("raydist fix 'engine': Paddle no longer has paddle.framework._current_expected_place; "
                          "update raydist.compat.engine")  # fmt: skip
    expect_source(_engine.Engine._initialize, 'if mode != "train":', fix="engine")
    expect_source(_engine.Engine._initialize, "self._executor._set_plan(self._job_plan)", fix="engine")
    expect_source(_engine.Engine._initialize, "self.program_helper.init_pir(", "if self._executor is None:",
                  fix="engine")  # fmt: skip
    expect_source(_helper.ProgramHelper.init_pir, "param.get_tensor()._clear()", fix="engine")
    expect_source(_engine.Engine.run, 'loss_job_type = f"forward{vpp_degree - 1}"', fix="engine")
    expect_source(_engine.Engine.get_dist_main_program, "self._pir_dist_main_progs[self._mode]", fix="engine")
    expect_source(_helper.ProxyLayer._predict, "self._output_vars[mode] = self.inner_layer(*inputs)", fix="engine")
    expect_source(_helper.ProxyLayer._eval, "self._metric_vars[mode] = self.call_metrics(new_inputs)", fix="engine")
    from paddle.distributed.auto_parallel.api import DistModel

    expect_source(_engine.Engine._parallel_pir, "# dist_program = apply_sharding_optimization_pass", fix="engine")
    expect_source(DistModel._build_distributed_state_dict, 'len(dist_attr["dims_mapping"])', fix="engine")
    _helper.ProxyLayer._predict = _predict
    _helper.ProxyLayer._eval = _eval
    _applied = True
