"""The mesh and the layouts: which device holds which part of which variable.

`DeviceMesh` and `LayoutMap` are Keras's own `keras.distribution` classes (tfstrat's only
change: a mesh's devices default to this process's devices as tfstrat counts them), so a layout
written for Keras's JAX `ModelParallel`, keras-hub's `get_layout_map` helpers included, is read
unchanged. `Mesh` is the strategy's view of one: the replicas in the mesh's order, each with its
coordinate on the batch axis (which slice of the batch it reads) and on the model axis (which
part of each sharded variable it holds). `Sharding` is one variable's plan: the dimension split
over the model axis, and the dimension sharded over the batch axis, if any.

What a layout can say, and what tfstrat does with it:
- a dimension on the model axis: split into equal parts, part m on the devices whose model
  coordinate is m; each device holds only its part (and its optimizer slots' parts);
- a dimension on the batch axis (ZeRO-3 / FSDP; keras-hub's layouts put the batch axis on
  weights): that dimension of the model part is sharded again over the batch axis, so device
  (b, m) holds block (m, b), 1/(B x M) of the variable and of each slot. Inside a step the
  blocks are all-gathered over the batch axis before use and the gradients reduce-scattered
  (`tfstrat.mesh.collectives.gather_batch`). In one process only, for now: a mesh across
  workers refuses it by the rule's name;
- None: kept whole.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import keras
import numpy as np

from tfstrat.errors import UsageError

logger = logging.getLogger(__name__)


class DeviceMesh(keras.distribution.DeviceMesh):
    """`keras.distribution.DeviceMesh` whose `devices` default to this process's devices:
    every GPU, else every logical CPU device (`tfstrat.split_cpu(n)` first)."""

    def __init__(self, shape, axis_names, devices=None):
        if devices is None:
            devices = _default_devices()
            needed = int(np.prod(shape))
            if len(devices) != needed:
                workers = len(devices) // max(1, len(_here()))
                each = (
                    f"{needed // workers} on each of the {workers} workers"
                    if workers > 1
                    else needed
                )
                raise UsageError(
                    f"Received: DeviceMesh(shape={tuple(shape)}) over {len(devices)} device(s) "
                    f"{devices}: the mesh needs {needed}. Split the CPU with "
                    f"tfstrat.split_cpu(n) before TensorFlow starts (n = {each}), or pass "
                    "devices=[...]."
                )
        super().__init__(shape=tuple(shape), axis_names=list(axis_names), devices=devices)


def _here() -> list[str]:
    from tfstrat.cluster.devices import local_devices

    return local_devices()


def _default_devices() -> list[str]:
    """This process's devices; under a TF_CONFIG of 2+ workers, every worker's (as many on
    each as here), by rank."""
    from tfstrat.cluster import TFConfig

    here = _here()
    if not os.environ.get("TF_CONFIG", "").strip():
        return here
    tf_config = TFConfig.from_env()
    tasks = [
        f"/job:{job}/replica:0/task:{i}"
        for job in ("chief", "worker")
        for i in range(len(tf_config.addresses(job)))
    ]
    if len(tasks) < 2:
        return here
    return [f"{task}{device}" for task in tasks for device in here]


class LayoutMap(keras.distribution.LayoutMap):
    """`keras.distribution.LayoutMap(device_mesh)`: a regex on variable paths (`re.fullmatch`)
    to a layout tuple, e.g. `layout_map["dense.*kernel"] = (None, "model")`."""


def _device_name(device) -> str:
    """A mesh device as TensorFlow names it: Keras's TensorFlow backend lists "cpu:0"."""
    name = str(device)
    if name.startswith("/"):
        return name
    kind, _, index = name.rpartition(":")
    return f"/device:{kind.upper()}:{index}"


@dataclasses.dataclass(frozen=True)
class Mesh:
    """A 1-D or 2-D device mesh: an optional batch axis and an optional model axis.

    Replicas are numbered in the mesh's row-major order; `local` are this process's (every one
    in one process; across workers, each worker's devices in turn), on `local_devices`.
    """

    devices: tuple[str, ...]  # replica order: the mesh's devices, row-major
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    batch_axis: str | None
    model_axis: str | None
    local: tuple[int, ...]
    local_devices: tuple[str, ...]

    @classmethod
    def of(cls, device_mesh, batch_dim_name: str | None, workers=None) -> Mesh:
        """The mesh of `device_mesh`; `workers`: (this worker's rank, the workers' device
        names by rank) when the mesh spans workers (its own device names are then unused)."""
        shape = tuple(int(s) for s in device_mesh.shape)
        names = tuple(device_mesh.axis_names)
        if len(shape) != len(names) or len(set(names)) != len(names):
            raise UsageError(f"Received: a mesh of shape {shape} with axis names {list(names)}.")
        if batch_dim_name is None:
            batch_dim_name = names[0]
        if batch_dim_name not in names:
            raise UsageError(
                f"Received: batch_dim_name={batch_dim_name!r}, not an axis of the mesh "
                f"{list(names)}. Name the axis the batch is split over."
            )
        others = [n for n in names if n != batch_dim_name]
        if len(others) > 1:
            raise UsageError(
                f"Received: a mesh with axes {list(names)}. tfstrat.ModelParallel takes a batch "
                f"axis ({batch_dim_name!r}) and at most one model axis; merge the others into one."
            )
        if workers is None:
            devices = tuple(_device_name(d) for d in np.asarray(device_mesh.devices).reshape(-1))
            local = tuple(range(len(devices)))
            mesh = cls(devices, shape, names, batch_dim_name, others[0] if others else None,
                       local, devices)  # fmt: skip
        else:
            rank, by_rank = workers
            devices = tuple(d for worker in by_rank for d in worker)
            if len(devices) != int(np.prod(shape)):
                raise UsageError(
                    f"Received: a mesh of shape {shape} ({int(np.prod(shape))} devices) for "
                    f"{len(by_rank)} workers of {len(by_rank[rank])} device(s) each. Make the "
                    "mesh's size the workers' devices (split each worker's CPU with "
                    "tfstrat.split_cpu(n) alike)."
                )
            first = sum(len(w) for w in by_rank[:rank])
            local = tuple(range(first, first + len(by_rank[rank])))
            mesh = cls(devices, shape, names, batch_dim_name, others[0] if others else None,
                       local, tuple(by_rank[rank]))  # fmt: skip
        for r in mesh.local:
            if not set(mesh.model_group(r)) <= set(mesh.local):
                raise UsageError(
                    f"Received: a mesh of shape {shape} ({', '.join(names)}) whose model axis "
                    f"({mesh.model_size} devices) spans workers of {len(mesh.local)} device(s). "
                    "Put the model axis within a worker: make it the mesh's last axis (row-major "
                    "order puts each worker's devices together), of a size that divides each "
                    "worker's devices."
                )
        return mesh

    def position(self, replica: int) -> int:
        """`replica`'s place among this process's replicas."""
        return self.local.index(replica)

    def size(self, axis: str | None) -> int:
        return 1 if axis is None else self.shape[self.axis_names.index(axis)]

    @property
    def data_size(self) -> int:
        return self.size(self.batch_axis)

    @property
    def model_size(self) -> int:
        return self.size(self.model_axis)

    def coordinate(self, replica: int, axis: str | None) -> int:
        if axis is None:
            return 0
        return int(np.unravel_index(replica, self.shape)[self.axis_names.index(axis)])

    def data_group(self, replica: int) -> list[int]:
        """The replicas that hold `replica`'s model part, by batch coordinate."""
        m = self.model_index(replica)
        group = [r for r in range(len(self.devices)) if self.model_index(r) == m]
        return sorted(group, key=self.data_index)

    def data_index(self, replica: int) -> int:
        return self.coordinate(replica, self.batch_axis)

    def model_index(self, replica: int) -> int:
        return self.coordinate(replica, self.model_axis)

    def model_group(self, replica: int) -> list[int]:
        """The replicas that share `replica`'s batch slice, by model coordinate."""
        d = self.data_index(replica)
        group = [r for r in range(len(self.devices)) if self.data_index(r) == d]
        return sorted(group, key=self.model_index)

    def batch_slice(self, replica: int) -> int:
        """Which slice of every global batch `replica` reads: its batch coordinate in one
        process; across W workers, worker w's j-th batch coordinate reads slice j x W + w, the
        order in which Keras's multi-worker `predict` puts the replicas' rows back together."""
        here = len(self.local)
        workers = len(self.devices) // here
        if workers == 1:
            return self.data_index(replica)
        worker = replica // here  # replicas are numbered worker by worker
        mine = sorted({self.data_index(r) for r in range(worker * here, (worker + 1) * here)})
        return mine.index(self.data_index(replica)) * workers + worker


@dataclasses.dataclass(frozen=True)
class Sharding:
    """A variable's plan: `dim` split over the model axis into `parts` equal parts (None, 1:
    not split), and `batch_dim` of each part sharded over the batch axis into `batch_parts`
    (None, 1: not sharded). Device (b, m) holds block (m, b)."""

    path: str
    shape: tuple[int, ...]
    dim: int | None
    parts: int
    rule: str  # the layout map's key that matched
    batch_dim: int | None = None
    batch_parts: int = 1

    @property
    def fsdp(self) -> bool:
        """Whether the variable is sharded over the batch axis too."""
        return self.batch_parts > 1

    def bounds(self, part: int) -> tuple[int, int]:
        """Model part `part`'s rows of dimension `dim`."""
        size = self.shape[self.dim] // self.parts
        return part * size, (part + 1) * size

    @staticmethod
    def _cut(full, dim: int | None, parts: int, part: int):
        if dim is None or parts == 1:
            return full
        size = full.shape[dim] // parts
        index = [slice(None)] * len(full.shape)
        index[dim] = slice(part * size, (part + 1) * size)
        return full[tuple(index)]

    def take(self, full, part: int, batch_part: int = 0):
        """Block (`part`, `batch_part`) of the whole value `full` (an array or tensor): model
        part `part`, and of it, batch part `batch_part`."""
        model_part = self._cut(full, self.dim, self.parts, part)
        return self._cut(model_part, self.batch_dim, self.batch_parts, batch_part)

    def block_shape(self) -> tuple[int, ...]:
        """The shape of the block one device holds."""
        shape = list(self.shape)
        if self.dim is not None:
            shape[self.dim] //= self.parts
        if self.batch_dim is not None:
            shape[self.batch_dim] //= self.batch_parts
        return tuple(shape)

    def assemble(self, blocks, concat):
        """The whole value from `blocks[(part, batch_part)]`, joined by `concat(list, axis)`."""
        parts = []
        for m in range(self.parts):
            row = [blocks[(m, b)] for b in range(self.batch_parts)]
            parts.append(row[0] if len(row) == 1 else concat(row, self.batch_dim))
        return parts[0] if len(parts) == 1 else concat(parts, self.dim)


def _axes(layout) -> tuple:
    """A layout's axis names per dimension: a `TensorLayout`, or a tuple as written."""
    axes = getattr(layout, "axes", layout)
    return tuple(axes)


def _matching_rules(layout_map, path: str) -> list[str]:
    import re

    return [key for key in layout_map.keys() if re.fullmatch(key, path)]


def plan(layout_map, mesh: Mesh, path: str, shape) -> tuple[Sharding | None, str | None]:
    """The plan for the variable at `path` of `shape`, and a line for the start-up log when its
    layout names the batch axis (None: nothing to say beyond its layer's line). Raises
    `UsageError` for a layout that cannot apply."""
    rules = _matching_rules(layout_map, path)
    if not rules:
        return None, None
    if len(rules) > 1:
        raise UsageError(
            f"Variable {path!r} matches {len(rules)} layout rules {rules}. Make the rules' "
            "regular expressions exclusive (LayoutMap keys match with re.fullmatch)."
        )
    rule = rules[0]
    axes = _axes(layout_map[rule])
    shape = tuple(int(s) for s in shape)
    if len(axes) != len(shape):
        raise UsageError(
            f"Layout rule {rule!r} gives {path!r} (shape {shape}) the layout {axes}: "
            f"{len(axes)} entries for {len(shape)} dimensions. Give one entry per dimension."
        )
    for axis in axes:
        if axis is not None and axis not in mesh.axis_names:
            raise UsageError(
                f"Layout rule {rule!r} names the axis {axis!r}, which the mesh does not have "
                f"(its axes: {list(mesh.axis_names)}). Use one of those, or None."
            )
    model_dims = [k for k, a in enumerate(axes) if a is not None and a == mesh.model_axis]
    batch_dims = [k for k, a in enumerate(axes) if a is not None and a == mesh.batch_axis]
    for dims, axis in ((model_dims, mesh.model_axis), (batch_dims, mesh.batch_axis)):
        if len(dims) > 1:
            raise UsageError(
                f"Layout rule {rule!r} puts {len(dims)} dimensions of {path!r} on the axis "
                f"{axis!r}: {axes}. Put one dimension on each axis."
            )
    dim = model_dims[0] if model_dims and mesh.model_size > 1 else None
    batch_dim = batch_dims[0] if batch_dims and mesh.data_size > 1 else None
    if batch_dim is not None and len(mesh.local) != len(mesh.devices):
        raise UsageError(
            f"Layout rule {rule!r} gives {path!r} the layout {axes}, which shards it over the "
            f"batch axis {mesh.batch_axis!r} (FSDP): tfstrat does that within one process, "
            "not across workers yet. Put None in place of "
            f"{mesh.batch_axis!r} in that rule (the variable is then whole over the batch axis)."
        )
    for k, axis, parts in ((dim, mesh.model_axis, mesh.model_size),
                           (batch_dim, mesh.batch_axis, mesh.data_size)):  # fmt: skip
        if k is not None and shape[k] % parts:
            raise UsageError(
                f"Variable {path!r} has shape {shape}: its dimension {k} ({shape[k]}) does not "
                f"divide by the axis {axis!r} ({parts} devices). Change the layer's size or the "
                "mesh, or leave that dimension unsharded (None)."
            )
    if dim is None and batch_dim is None:
        return None, None
    sharding = Sharding(path, shape, dim, mesh.model_size if dim is not None else 1, rule,
                        batch_dim, mesh.data_size if batch_dim is not None else 1)  # fmt: skip
    line = None
    if batch_dim is not None:
        where = f"dimension {dim} split over {mesh.model_axis!r}, " if dim is not None else ""
        line = (
            f"{path}: {where}dimension {batch_dim} sharded over the batch axis "
            f"{mesh.batch_axis!r} (FSDP): each device holds {sharding.block_shape()}"
        )
    return sharding, line


def unused_rules(layout_map, paths) -> list[str]:
    """The layout map's rules that match none of `paths`."""
    import re

    return [key for key in layout_map.keys() if not any(re.fullmatch(key, p) for p in paths)]
