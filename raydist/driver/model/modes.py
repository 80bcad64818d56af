"""Modes and plans: which mode the ranks are in, the programs they built, and what each step sends.

Each mode's program is built on the ranks the first time the model enters it
with known input specs (from ``input_spec``, a loader, or the first batch of
that mode). Building tells the driver the mode's `raydist.topology.ModePlan`:
which values a step fetches, from which ranks, laid out how. A call becomes a
step message here, once its arguments are checked against the specs: a global
batch (every rank takes its own shard) or a loader's handles (every rank reads
its own rows).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ...data.loader import Handle
from ...messages import ArraysStep, LoaderStep, LrChange, StepMessage
from ...protocol import RankActor
from ...topology import Mesh, ModePlan, stages, widest
from ..dispatch.client import LiveGroup, live
from .changes import Changes
from .inputs import InputSpecs, Specs, array_specs, to_array

if TYPE_CHECKING:
    from ..dispatch.client import RankClient

MODES = ("train", "eval", "predict")


def default_mode(has_loss: bool, has_optimizer: bool) -> str:
    """As Paddle: loss and optimizer -> "train"; loss only -> "eval"; neither -> "predict"."""
    return "train" if (has_loss and has_optimizer) else ("eval" if has_loss else "predict")


class Modes:
    """The model's mode, and the ranks' programs and specs.

    ``specs``: the inputs' specs (`raydist.driver.model.inputs.InputSpecs`);
    ``on_built(train_built)``: called after a mode's program is built for the first time
    (the state's tensors change: `raydist.driver.model.state.ModelState.built`).
    """

    def __init__(self, specs: InputSpecs, has_loss: bool, has_optimizer: bool, on_built: Callable[[bool], None],
                 group: LiveGroup, changes: Changes):  # fmt: skip
        self.specs = specs
        self.has_loss, self.has_optimizer = has_loss, has_optimizer
        self.mode = default_mode(has_loss, has_optimizer)
        self._on_built = on_built
        self._group = group
        self._told = changes  # "mode" when the mode or the specs change
        self.data_meshes: tuple[Mesh, Mesh] | None = None
        self._rank_mode: str | None = None  # the mode the ranks are in
        self._rank_specs: Specs | None = None  # the specs the ranks have
        self.plans: dict[str, ModePlan] = {}  # mode -> what its steps fetch (rank 0's)

    @property
    def client(self) -> RankClient | None:
        return self._group.client

    def started(self, meshes: list[Mesh]) -> None:
        """A new group of ranks built the layer (``meshes``: its parameters' meshes): no program yet."""
        self.data_meshes = data_meshes(meshes, self._group.get().size)
        self.specs.place(*self.data_meshes)
        self._rank_mode = self._rank_specs = None
        self.plans = {}

    def adopt(self, meshes: list[Mesh], built: list[str]) -> None:
        """A group that runs this model already (a detached model's ranks, attached to): the plans
        of the modes it ``built`` (its current mode last, so it stays in it) are asked again."""
        self.started(meshes)
        client = self._group.get()
        if not built:
            return
        specs = self.specs.current()
        client.call(RankActor.set_specs, specs[0] or [], specs[1] or [])
        self._rank_specs = specs
        for mode in built:
            self.plans[mode] = ModePlan.merge(client.call(RankActor.set_mode, mode))
        self._rank_mode = built[-1]

    def resume(self) -> None:
        """Put the ranks in the model's mode, if its program can be built without a batch."""
        if self.specs.known(self.mode):
            self.enter(self.mode, self.specs.current())

    def check(self, mode: str) -> None:
        """Refuse a mode the model cannot run."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "train" and not (self.has_loss and self.has_optimizer):
            raise ValueError("train mode needs both a loss and an optimizer")
        if mode == "eval" and not self.has_loss:
            raise ValueError("eval mode needs a loss")

    def switch(self, mode: str) -> None:
        """Complete the steps in flight, then put every rank in ``mode`` (built now if its specs are known)."""
        live(self.client).drain()
        self.mode = mode
        self.resume()
        self._changed()

    def _changed(self) -> None:
        self._told.changed("mode")

    def built(self, mode: str) -> bool:
        return mode in self.plans

    def build(self, mode: str) -> None:
        """Build ``mode``'s program (if not yet) and come back to the current mode."""
        if mode in self.plans:
            return
        if not self.specs.known(mode):
            raise ValueError(f"the {mode} program is built at the first {mode} step (or pass input_spec)")
        current = self.mode
        self.switch(mode)
        self.switch(current)

    def enter(self, mode: str, specs: Specs) -> None:
        """Put the ranks in ``mode`` with ``specs`` (building its program the first time); waits.

        A program the ranks cannot build (e.g. a batch of the wrong dtype for
        the layer) is refused on every rank: `UsageError` with Paddle's
        message; the ranks stay, and ``specs`` are not remembered.
        """
        if not _same(specs, self._rank_specs):
            live(self.client).call(RankActor.set_specs, specs[0] or [], specs[1] or [])
            self._rank_specs, self._rank_mode = specs, None
        if self._rank_mode != mode:
            new = mode not in self.plans
            self.plans[mode] = ModePlan.merge(live(self.client).call(RankActor.set_mode, mode))
            self._rank_mode = mode
            self.specs.accept(specs, mode)
            if new:
                self._on_built("train" in self.plans)
                self._changed()

    def message(self, values: list, lr: Callable[[], tuple[LrChange, ...]]) -> StepMessage:
        """The step message for a call's arguments (flattened), once they are checked and the ranks are
        in the model's mode (its program built); ``lr``: the learning-rate changes it carries."""
        mode = self.mode
        handles = [v for v in values if isinstance(v, Handle)]
        if not handles:
            # copies: the step may leave after the call returns (held for the next message, or
            # sent from a compiled graph's thread), and the caller may refill its arrays by then
            arrays = [np.array(v) if isinstance(v, np.ndarray) else to_array(v) for v in values]  # a Tensor's is new
            self.enter(mode, self.specs.for_call(array_specs(arrays), mode))
            return ArraysStep(arrays, lr())  # every rank takes its own shard (a view)
        first = handles[0]
        if len(handles) != len(values):
            raise TypeError("pass either loader handles or arrays to a DistModel call, not both")
        if any((h.loader, h.epoch, h.step) != (first.loader, first.epoch, first.step) for h in handles):
            raise ValueError("the handles of one call must come from the same batch of one loader")
        loader = first.loader
        loader.bind(live(self.client), self.data_meshes)
        by_key = loader.specs_by_key()
        self.enter(mode, self.specs.for_call([by_key[h.key] for h in handles], mode))
        loader.take(first)
        return LoaderStep(loader._id, first.epoch, first.step, tuple(h.key for h in handles), lr())


def data_meshes(meshes: list[Mesh], num_workers: int) -> tuple[Mesh, Mesh]:
    """The meshes inputs and labels are laid on by default.

    Pipeline stages (disjoint meshes, in the order of the layer's
    parameters): inputs on the first, labels on the last, as Paddle's
    ``shard_dataloader`` lays them. Otherwise both on the layer's largest
    mesh, or on all ranks as "dp" if the layer has no dist parameters.
    """
    if meshes and stages(meshes):
        return meshes[0], meshes[-1]
    mesh = widest(meshes, num_workers)
    return mesh, mesh


def _same(a: Specs | None, b: Specs | None) -> bool:
    """Whether two (inputs, labels) hold the very same spec lists (cheaper than comparing them)."""
    return a is not None and b is not None and a[0] is b[0] and a[1] is b[1]
