"""The model's inputs and labels at the driver: their specs, inferred or given, and every call checked.

Specs come from ``input_spec`` or a loader, or are inferred from the first
batch of each kind (inputs, then labels: predict needs no labels). Every
call is checked against them before anything is sent, so a bad batch is a
`ValueError`/`TypeError` at the driver and the model goes on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ...specs import TensorSpec, spec_of
from ...topology import Mesh, data_layout

Specs = tuple["list[TensorSpec] | None", "list[TensorSpec] | None"]  # (inputs, labels), None: not known yet


class InputSpecs:
    """The specs a model's calls are held to.

    ``inputs``/``labels``: None until known; ``shard_dims``: the mesh dim
    batches are split along by default; ``micro_batches``: per mode, the
    micro-batches each rank's rows must divide into; ``micro_batch_size``: the rows
    of each, if the strategy names it.
    """

    def __init__(self, inputs: list[TensorSpec] | None, labels: list[TensorSpec] | None, shard_dims: str | None,
                 micro_batches: dict[str, int], micro_batch_size: int | None = None):  # fmt: skip
        self.inputs = inputs
        self.labels = labels
        self.shard_dims = shard_dims
        self.micro_batches = micro_batches
        self.micro_batch_size = micro_batch_size
        self.mesh: Mesh | None = None
        self.label_mesh: Mesh | None = None

    def place(self, mesh: Mesh, label_mesh: Mesh) -> None:
        """The meshes batches lie on by default (known once the layer is built); lays out the specs.

        Specs laid on a mesh of another size (an elastic model's group changed size,
        or its loader was made at the largest size) move to the new mesh, split
        along the same mesh dim.
        """
        self.mesh, self.label_mesh = mesh, label_mesh
        inputs, labels = _moved(self.inputs, mesh), _moved(self.labels, label_mesh)
        self.inputs = None if inputs is None else self._laid(inputs, mesh)
        self.labels = None if labels is None else self._laid(labels, label_mesh)

    def known(self, mode: str) -> bool:
        """Whether ``mode``'s program can be built without a batch."""
        needed = [self.inputs] if mode == "predict" else [self.inputs, self.labels]
        return all(specs is not None and all(s.complete for s in specs) for specs in needed)

    def current(self) -> Specs:
        return self.inputs, self.labels

    def for_call(self, given: list[TensorSpec], mode: str) -> Specs:
        """The specs of a call with arguments ``given``: the known ones, or new ones inferred
        from it (nothing is remembered until `accept`). Raises on a bad call."""
        inputs, labels = self.inputs, self.labels
        if inputs is None:
            n_inputs = len(given) if mode == "predict" else len(given) - 1
            if n_inputs < 1:
                raise ValueError(f"{mode} takes inputs and labels: got {len(given)} argument(s)")
            inputs = self._laid([_named(g, f"input{i}") for i, g in enumerate(given[:n_inputs])], self.mesh)
        if mode != "predict" and labels is None:
            labels = self._laid([_named(g, f"label{i}") for i, g in enumerate(given[len(inputs):])],
                                self.label_mesh)  # fmt: skip
        specs = inputs + ([] if mode == "predict" or labels is None else labels)
        if len(given) != len(specs):
            what = "inputs" if mode == "predict" else "inputs and labels"
            raise ValueError(
                f"{mode} takes {len(specs)} {what} ({', '.join(s.name for s in specs)}), got {len(given)}"
            )
        for i, (spec, g) in enumerate(zip(specs, given)):
            spec.check(g, "label" if i >= len(inputs) else "input")
            _check_divides(spec, g.shape, self.micro_batches[mode], self.micro_batch_size)
        if not all(s.complete for s in specs):  # dims an input_spec left open
            inputs = [s.resolved(g) for s, g in zip(inputs, given)]
            if mode != "predict" and labels is not None:
                labels = [s.resolved(g) for s, g in zip(labels, given[len(inputs):])]
        if inputs is self.inputs and labels is self.labels:
            return self.inputs, self.labels  # the same objects: nothing new to tell the ranks
        return inputs, labels

    def accept(self, specs: Specs, mode: str) -> None:
        """Remember ``specs`` (a mode was built from them)."""
        self.inputs = specs[0]
        if mode != "predict":
            self.labels = specs[1]

    def _laid(self, specs: list[TensorSpec], mesh: Mesh | None) -> list[TensorSpec]:
        """Specs without a layout get the default data layout on ``mesh``."""
        if mesh is None:
            return specs
        shard_dims = self.shard_dims
        if shard_dims == "dp" and "dp" not in mesh.dim_names:  # the default, on a mesh without "dp"
            shard_dims = None
        return [s if s.layout else s.resolved(layout=data_layout(mesh, shard_dims, len(s.shape))) for s in specs]


def leaves(args: Sequence[Any]) -> Iterator[Any]:
    """Call arguments with lists and tuples flattened, in order."""
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from leaves(a)
        else:
            yield a


def to_array(a: Any) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "numpy") and callable(a.numpy):  # paddle.Tensor
        return np.asarray(a.numpy())
    raise TypeError(f"DistModel inputs must be numpy arrays or paddle Tensors, got {type(a).__name__}")


def array_specs(arrays: list[np.ndarray]) -> list[TensorSpec]:
    return [spec_of(a, f"#{i}") for i, a in enumerate(arrays)]


def _moved(specs: list[TensorSpec] | None, mesh: Mesh) -> list[TensorSpec] | None:
    """``specs`` with the data layouts of a mesh of another size laid on ``mesh`` instead."""
    if specs is None:
        return None
    out = []
    for s in specs:
        layout = s.layout
        if layout is not None and len(layout.mesh.process_ids) != len(mesh.process_ids):
            first = layout.dims_mapping[0] if layout.dims_mapping else -1
            dim = layout.mesh.dim_names[first] if first >= 0 else None
            if any(m >= 0 for m in layout.dims_mapping[1:]) or (dim is not None and dim not in mesh.dim_names):
                raise ValueError(f"{s.name!r} is laid out as {layout}, which a mesh of {mesh.shape} cannot hold")
            s = dataclasses.replace(s, layout=data_layout(mesh, dim, len(s.shape)))
        out.append(s)
    return out


def _named(spec: TensorSpec, name: str) -> TensorSpec:
    """An inferred spec: an array's gets a Paddle-style name, a loader's keeps its column name."""
    return spec if spec.layout is not None else dataclasses.replace(spec, name=name)


def _check_divides(spec: TensorSpec, given: tuple[int | None, ...], micro_batches: int,
                   micro_batch_size: int | None) -> None:  # fmt: skip
    """Refuse a batch of shape ``given`` that the ranks of ``spec``'s layout, or the micro-batches, do not divide."""
    layout = spec.layout
    if layout is None or None in given:  # laid out and given: both known here
        return
    shape = tuple(int(d) for d in given if d is not None)
    for d, m in enumerate(layout.dims_mapping):
        if m >= 0 and shape[d] % layout.mesh.shape[m]:
            raise ValueError(
                f"the global batch of {spec.name!r} has {shape[d]} rows along dim {d}, which does not "
                f"divide by the {layout.mesh.shape[m]} ranks of mesh dim {layout.mesh.dim_names[m]!r} "
                "(the data-parallel degree)"
            )
    if micro_batches > 1 and shape:
        split = layout.mesh.shape[layout.dims_mapping[0]] if layout.dims_mapping and layout.dims_mapping[0] >= 0 else 1
        if (shape[0] // split) % micro_batches:
            raise ValueError(
                f"the global batch of {spec.name!r} has {shape[0]} rows, {shape[0] // split} per rank, which do "
                f"not divide into the strategy's {micro_batches} micro-batches (gradient_merge.k_steps or "
                "pipeline.accumulate_steps)"
            )
    if micro_batch_size and shape:
        split = layout.mesh.shape[layout.dims_mapping[0]] if layout.dims_mapping and layout.dims_mapping[0] >= 0 else 1
        if shape[0] // split != micro_batch_size * micro_batches:
            raise ValueError(
                f"the global batch of {spec.name!r} has {shape[0]} rows, {shape[0] // split} per rank, but "
                f"strategy.pipeline asks for {micro_batches} micro-batches (accumulate_steps) of "
                f"micro_batch_size={micro_batch_size} rows: set accumulate_steps to "
                f"{max(shape[0] // split // micro_batch_size, 1)} or send batches of "
                f"{micro_batch_size * micro_batches * split} rows"
            )
