"""A rank's replica check: every N train steps, a CRC-32 of each of its shards, for the driver to
compare across the data-parallel replicas of each shard (`raydist.driver.lifecycle.replicas`).

CRC-32 is exact for identical bits (the same bytes always give the same code) and finds every
single-bit flip, and every burst of up to 32 flipped bits, for sure; zlib computes it at memory
speed. A copy of the state is not needed: each local array is read once.
"""

from __future__ import annotations

import collections
from typing import Any

from ..handover import code

KEEP = 256  # the newest checks a rank keeps for the driver to read (more than can run ahead of it)


class ReplicaHashes:
    """This rank's codes of its shards after every ``every``-th train step (the model's count)."""

    def __init__(self, rank: int, every: int, base: int, trained: int):
        self.rank, self.every = rank, every
        self._offset = base - trained  # the rank's train steps (since its build) -> the model's index
        # index -> {name: (the piece's key in its layout, its code)}
        self.codes: collections.OrderedDict[int, dict[str, tuple[tuple, int]]] = collections.OrderedDict()

    def after_step(self, trained: int, state: Any) -> None:
        """After the rank's ``trained``-th train step: codes of ``state()`` if it is time."""
        index = self._offset + trained
        if index % self.every:
            return
        self.codes[index] = {name: (layout.key(self.rank) if layout is not None else (), code(array))
                             for name, (array, layout) in state().items()}  # fmt: skip
        while len(self.codes) > KEEP:
            self.codes.popitem(last=False)

    def take(self, index: int) -> dict[str, tuple[tuple, int]] | None:
        """The codes after train step ``index`` (None: not computed, or no longer kept)."""
        return self.codes.get(index)
