"""Shard Parameters, and stage-3 access to full parameters from any Cell.

Stage 3 technique (works for Cells nobody registered): for every Cell that
owns a sharded Parameter under attribute ``w``, the Parameter is removed from
the Cell, its shard is stored as ``w_zero_shard`` (keeping the parameter's
original name), and a Python ``property`` named ``w`` is installed on a
subclass made for that instance (``cell.__class__ = type(...)``). The property
returns ``GatherFull(shard)``: the Cell's own ``construct`` reads ``self.w``
unchanged and MindSpore's graph mode parses the property. ``GatherFull``
all-gathers in forward and reduce-scatters (mean) in its custom ``bprop``, so
the gradient w.r.t. a shard arrives already reduced over the op group.

A Parameter shared by several Cells (tied weights) gets one shard and one
``GatherFull`` per reading Cell; their gradients add up.

Warning: outside ``construct`` reading ``cell.w`` of a stage-3 network runs an
all-gather, so it must be done on all ranks.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from .comm import AllGather, ReduceScatterSum, World
from .plan import ShardSpec

SHARD_SUFFIX = "_zero_shard"
GATHER_PREFIX = "_zero_gather_"


def shard_array(full: np.ndarray, spec: ShardSpec) -> np.ndarray:
    """This rank's padded shard (1D) of ``full``, per ``spec``."""
    flat = np.ascontiguousarray(full).reshape(-1)
    if flat.size != spec.numel:
        raise ValueError(f"tensor for {spec.name!r} has {flat.size} elements, the plan says {spec.numel}")
    if not spec.sharded:
        return flat.copy()
    out = np.zeros(spec.shard_size, dtype=flat.dtype)
    out[:spec.valid] = flat[spec.offset:spec.offset + spec.valid]
    return out


def make_shard(tensor_or_param, spec: ShardSpec, name: str, requires_grad: bool = True) -> Parameter:
    """A new 1D Parameter named ``name`` holding this rank's padded shard of ``tensor_or_param``."""
    return Parameter(Tensor(shard_array(tensor_or_param.asnumpy(), spec)), name=name, requires_grad=requires_grad)


class GatherFull(nn.Cell):
    """Full parameter from its shard: all-gather in forward, reduce-scatter (sum over the world) in backward.

    Communication: forward AllGather of ``shard_size`` elements per rank; backward
    ReduceScatter (CPU: AllReduce + slice) of ``padded_numel`` elements.
    """

    def __init__(self, spec: ShardSpec, world: World, compute_dtype=None):
        super().__init__(auto_prefix=False)
        self.compute_dtype = compute_dtype  # the reading Cell's to_float() dtype, else None
        self.gather = AllGather(world)
        self.reduce_scatter = ReduceScatterSum(world, spec.padding)
        self.numel = spec.numel
        self.padded = spec.padding > 0
        self.shape = tuple(spec.shape)
        self.slice = ops.StridedSlice()
        self.reshape = ops.Reshape()
        self.cast = ops.Cast()

    def regather(self):
        """Recompute the gather in backward instead of keeping the full value from forward."""
        for prim in self.gather.primitives() + [self.slice, self.reshape, self.cast]:
            prim.recompute()

    def construct(self, shard):
        full = self.gather(shard)
        if self.padded:
            full = self.slice(full, (0,), (self.numel,), (1,))
        full = self.reshape(full, self.shape)
        if self.compute_dtype is not None:
            full = self.cast(full, self.compute_dtype)
        return full

    def bprop(self, shard, out, dout):
        grad = self.reduce_scatter(ops.cast(dout, shard.dtype).reshape((-1,)))
        return (grad,)  # a sum over the world: the train step divides by the world size


def _full_property(attr: str) -> property:
    gather_name = GATHER_PREFIX + attr
    shard_name = attr + SHARD_SUFFIX

    def full(self):
        return getattr(self, gather_name)(getattr(self, shard_name))

    full.__name__ = attr
    return property(full, doc=f"full value of {attr!r}, gathered from its shard (mindzero stage 3)")


def compute_dtype(cell: nn.Cell):
    """The dtype graph mode casts Parameters read inside ``cell`` to, or ``None``.

    In graph mode ``cell.to_float(dtype)`` casts the Parameters a Cell reads; a
    gathered tensor is not a Parameter, so :class:`GatherFull` casts it itself.
    PyNative casts only the Cell's inputs (the op then promotes), so there is no
    cast to mimic. The mode is the one in force when the network is prepared.
    """
    if ms.get_context("mode") != ms.GRAPH_MODE:
        return None
    flags = cell.get_flags()
    if flags.get("fp16"):
        return ms.float16
    if flags.get("bf16"):
        return ms.bfloat16
    return None


def _own_subclass(cell: nn.Cell) -> type:
    """A class used by ``cell`` alone, so properties installed on it touch no other instance."""
    cls = type(cell)
    if cls.__dict__.get("_mindzero_owner") == id(cell):
        return cls
    sub = type(cls.__name__, (cls,), {"_mindzero_owner": id(cell), "__module__": cls.__module__})
    cell.__class__ = sub
    return sub


def check_pynative_recompute(network: nn.Cell, specs: dict) -> None:
    """Refuse stage 3 in PyNative for a ``recompute()`` Cell holding sharded parameters.

    Measured: PyNative's re-entrant recompute loses the gather's custom ``bprop``
    (stage 3 then differs from stage 0 after one step); graph mode is exact.

    Raises:
        ValueError: naming the Cell.
    """
    if ms.get_context("mode") == ms.GRAPH_MODE:
        return
    for cell_name, cell in network.cells_and_names():
        if getattr(cell, "_recompute_cell", None) is None:
            continue
        held = [p.name for p in cell.get_parameters() if p.name in specs and specs[p.name].sharded]
        if held:
            raise ValueError(f"zero_stage=3 in PyNative mode does not support recompute(): Cell {cell_name!r} is "
                             f"recomputed and holds sharded parameters ({held[0]}, ...); use GRAPH_MODE "
                             "(the target), or do not call recompute() on it")


def shard_network_parameters(network: nn.Cell, specs: dict, world: World, regather: bool = True) -> dict:
    """Stage 3: replace every sharded Parameter of ``network`` by its shard, in place.

    Args:
        network: the user's Cell.
        specs: parameter name -> :class:`ShardSpec`; only ``sharded`` specs are touched.
        world: the op group.
        regather: graph mode: mark each gather's primitives for recompute, so backward all-gathers
            the parameter again instead of keeping the full value alive from forward (peak gathered
            memory about one layer's parameters instead of the whole model's; docs/performance.md).
            PyNative ignores it (its recompute loses the gather's ``bprop``).

    Returns:
        parameter name -> shard Parameter (one per full Parameter, shared by tied uses).
    """
    shards = {}
    gathers = {}  # (name, compute dtype) -> GatherFull: a gather is shared by the Cells reading one parameter
    for _, cell in network.cells_and_names():
        for attr, param in list(cell._params.items()):
            if param is None or param.name not in specs or not specs[param.name].sharded:
                continue
            spec = specs[param.name]
            if param.name not in shards:
                shards[param.name] = make_shard(param, spec, param.name, param.requires_grad)
            key = (param.name, compute_dtype(cell))
            if key not in gathers:
                gathers[key] = GatherFull(spec, world, key[1])
                if regather and ms.get_context("mode") == ms.GRAPH_MODE:
                    gathers[key].regather()
            del cell._params[attr]
            cell.insert_param_to_cell(attr + SHARD_SUFFIX, shards[param.name])
            cell.insert_child_to_cell(GATHER_PREFIX + attr, gathers[key])
            setattr(_own_subclass(cell), attr, _full_property(attr))
    return shards


def tensor_nbytes(t) -> int:
    return int(t.nbytes)
