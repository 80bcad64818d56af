"""What the model's inputs and labels look like: names, global shapes, dtypes, layouts."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .topology import Layout, Mesh


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One input or label of the global batch.

    ``shape`` is the global shape (None where a dim is not known yet);
    ``layout`` says how the batch lies on the ranks (None: the default data
    layout, decided once the model's mesh is known).
    """

    name: str
    shape: tuple[int | None, ...]
    dtype: str
    layout: Layout | None = None

    @property
    def complete(self) -> bool:
        return None not in self.shape and self.layout is not None

    @property
    def laid(self) -> Layout:
        """The layout, once there is one (the ranks' specs have theirs)."""
        if self.layout is None:
            raise ValueError(f"{self.name!r} has no layout yet: its mesh is not known")
        return self.layout

    @property
    def dims(self) -> tuple[int, ...]:
        """The shape, once every dim is known (a complete spec's)."""
        if None in self.shape:
            raise ValueError(f"{self.name!r} has dims not known yet: {self.shape}")
        return tuple(int(d) for d in self.shape if d is not None)

    def check(self, given: TensorSpec, what: str) -> None:
        """Raise a clear error unless what is ``given`` (an array's or a loader's spec) fits this spec."""
        if np.dtype(given.dtype) != np.dtype(self.dtype):
            raise TypeError(f"{what} {self.name!r} has dtype {given.dtype}, the model takes {self.dtype}")
        if len(given.shape) != len(self.shape) or any(
            s is not None and s != a for s, a in zip(self.shape, given.shape)
        ):
            shape = ", ".join("?" if s is None else str(s) for s in self.shape)
            raise ValueError(f"{what} {self.name!r} has shape {given.shape}, the model takes ({shape})")
        if given.layout is not None and self.layout is not None and given.layout != self.layout:
            raise ValueError(
                f"{what} {self.name!r} is split over the ranks as {given.layout}, the model reads it as "
                f"{self.layout}: give the loader the model's mesh and shard_dims"
            )

    def resolved(self, given: TensorSpec | None = None, layout: Layout | None = None) -> TensorSpec:
        shape = self.shape if given is None else tuple(a if s is None else s for s, a in zip(self.shape, given.shape))
        return dataclasses.replace(self, shape=shape, layout=self.layout or layout)


def spec_of(array: np.ndarray, name: str) -> TensorSpec:
    return TensorSpec(name, tuple(int(s) for s in array.shape), str(array.dtype))


def from_paddle(spec, name: str) -> TensorSpec:
    """A TensorSpec from Paddle's ``InputSpec`` or ``DistributedInputSpec``."""
    import paddle

    dtype = paddle.base.data_feeder.convert_dtype(spec.dtype)
    shape = tuple(None if (s is None or s < 0) else int(s) for s in spec.shape)
    layout = None
    mesh = getattr(spec, "mesh", None)
    if mesh is not None:
        layout = Layout(Mesh.of_paddle(mesh), tuple(int(d) for d in spec.dims_mapping))
    return TensorSpec(spec.name or name, shape, dtype, layout)


def from_input_spec(input_spec: Sequence) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Paddle's ``input_spec`` argument ([[inputs...], [labels...]]) as TensorSpecs."""
    if not isinstance(input_spec, (list, tuple)) or len(input_spec) != 2:
        raise TypeError("input_spec must be [[input specs...], [label specs...]], as in Paddle")
    inputs = [from_paddle(s, f"input{i}") for i, s in enumerate(input_spec[0] or [])]
    labels = [from_paddle(s, f"label{i}") for i, s in enumerate(input_spec[1] or [])]
    return inputs, labels
