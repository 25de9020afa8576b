"""How collectives run: one :class:`Backend` per :class:`~mindzero.core.topology.World`, chosen once from
``World.backend`` (:func:`backend_of`). Everything above this module asks its backend for a collective and
never branches on the device.

Scopes: the *op group* (the ranks a tensor is sharded over, ``G``) and the *world* (``N``; with hybrid
sharding ``R = N / G`` replicas of the op group, see :mod:`mindzero.core.topology`):

=========================  ===================================  ==============================================
operation                  ``collectives`` (GPU / Ascend)       ``emulated`` (CPU, MindSpore: world
                                                                group only, no ReduceScatter)
=========================  ===================================  ==============================================
all-gather (op group)      ``AllGather(op group)``              ``AllGather(world)``; hybrid: keep the op
                                                                group's rows (R x the bytes)
reduce-scatter (sum over   ``ReduceScatter(op group)``; hybrid  ``AllReduce(world)`` of the whole unpadded
world, shard over op)      + ``AllReduce(dp group)`` of shard   tensor, then this rank's slice (~2x the bytes
                                                                of a real one; bit-identical to stage 0)
all-reduce (world)         ``AllReduce(world)``                 ``AllReduce(world)`` (SUM only)
all-reduce (op group)      ``AllReduce(op group)``              hybrid: each replica fills its slot of an
                                                                (R, ...) zero tensor, ``AllReduce(world)``
any-rank flag (world)      ``AllReduce(SUM)`` of 0/1            the same (CPU has no MAX reduction)
broadcast from an op rank  ``Broadcast(world)``; hybrid: an     ``Broadcast(world)``; hybrid: a world all-gather
(owner mode's write-back)  op-group all-reduce of the root's    keeping the root's row (N x the bytes)
                           values and the others' zeros
=========================  ===================================  ==============================================

``single`` (a world of one rank, no ``init()``): every collective is the identity, so one process runs
every stage. ``rehearsal`` (:func:`mindzero.comm.groups.rehearse`): one process plays rank 0 of ``N`` to
measure what a step costs (:mod:`mindzero.planner`): CPU's code, with each world collective replaced by a
local operation of the same shapes (an all-gather tiles this rank's tensor ``N`` times, a sum copies it), so
the graph and its buffers are a rank's; the values are not training's. ``substitute`` (test-only, :func:`mindzero.comm.substitute_collectives`): the ``collectives``
code on CPU, with only the group primitives CPU lacks replaced by CPU-legal functions of the same
semantics (docs/backends.md).

All collectives must be entered by **every rank in the same order**; the train step guarantees it by
building the same plan on every rank.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from ..core.topology import COLLECTIVES, EMULATED, REHEARSAL, SINGLE, SUBSTITUTE, World
from .emulation import FusedSumThenSlice, GatherRows, Identity, SlotSum, SumThenSlice
from .layout import MAP, as_rows, flat_concat, own_shard, pieces, reshape_as
from .quantize import QuantizedGather
from .shard_gather import (GradientPort, UnitGather, gradient_attrs, make_shard_gather, reduce_scatter_bprop,
                           sum_then_slice_bprop, sum_then_slice_gather)
from .substitute import substitute_primitive


class Backend:
    """The collectives of one world. Each method returns a graph-callable (a Cell or a primitive):

    * ``gather(scope)``: ``(s,) -> (size * s,)``, every rank's 1D tensor concatenated in group order;
    * ``sum(scope)``: element-wise sum over the scope;
    * ``reduce_scatter()``: ``(x (numel,), padding) -> (shard_size,)``, this rank's padded shard of the op
      group of the sum over the world;
    * ``fused_reduce_scatter()``: ``(tensors, bucket) -> shards``, the same for a bucket in one collective
      (``bucket``: :meth:`mindzero.comm.cells.Bucket.of`);
    * ``shard_gather(numel, padding, reduce_dtype)``: the stage-3 gather primitive of one parameter and the
      rows it keeps (see :mod:`mindzero.comm.shard_gather`);
    * ``quantized_gather(numel, padding, shard_size, block, reduce_dtype)``: the same gather sending int8 values
      with fp32 block scales (:class:`mindzero.comm.quantize.QuantizedGather`: the op group's rows only, the
      same exact backward), or ``None`` where nothing is gathered;
    * ``unit_gather(shards)``: one all-gather of several parameters' shards, concatenated, without a gradient
      (:class:`mindzero.comm.shard_gather.UnitGather`), or ``None`` where nothing is gathered; each member's
      gradient enters through its ``gradient_port(numel, padding, reduce_dtype)``, the exact gather's reduction;
    * ``broadcast(root)``: ``(tensors, bucket) -> tensors``: op rank ``root``'s tensors (of this rank's op group)
      on every rank of the group; the others' inputs give only shapes and dtypes (owner mode's write-back;
      ``bucket``: :meth:`mindzero.comm.cells.Bucket.of` of the tensors, for the backends that concatenate them);
    * ``host_gather(scope)``: ``(s,) tensor -> (size * s,) numpy array``, the op group's (``scope="op"``) or
      every rank's (``"world"``) tensors concatenated in group order, called eagerly (host-side tools such as
      ``gather_full_state_dict`` and prepare's cross-rank checks: no graph to compile per shape).
    """

    name = None
    int8_wire = False  # whether its all-gather takes int8 (else a quantized payload travels as int32 words)

    def __init__(self, world: World):
        self.world = world

    def host_gather(self, scope="op"):
        op = self.gather(scope)
        return lambda x: op(x).asnumpy()

    def host_broadcast(self, root: int):
        """``tensor -> numpy array``: op rank ``root``'s tensor on every rank of the op group, called eagerly (the
        others pass a tensor of its shape and dtype)."""
        cell = self.broadcast(root)
        return lambda x: cell((x,), ((int(x.size),), (0,), (0,), (0,), (0,)))[0].asnumpy()

    def _world_broadcast(self, root: int):
        return WorldBroadcast(self.world.op_ranks[root], self.world.world_group)

    def _world_gather(self):
        return ops.AllGather(self.world.world_group)

    def _world_sum(self):
        return ops.AllReduce(ops.ReduceOp.SUM, self.world.world_group)

    def _rows_select(self):
        """The world ranks of this rank's op group, as a row index into a world all-gather (hybrid only)."""
        return Tensor(list(self.world.op_ranks), ms.int32) if self.world.hybrid else None

    def _port_gather(self):
        """``(gather, rows, select)`` of a gather whose values travel without a gradient (quantized, or a unit's),
        or ``None`` where nothing is gathered. A backend that gathers also defines ``_port_bprop(numel, padding,
        reduce_dtype)``: the exact gather's reduction of one parameter's ``(kept rows, shard)`` gradient."""
        return None

    def quantized_gather(self, numel, padding, shard_size, block, reduce_dtype=None):
        parts = self._port_gather()
        if parts is None:
            return None
        gather, rows, select = parts
        return QuantizedGather(gather, self.int8_wire, rows, shard_size, block, select,
                               self._port_bprop(numel, padding, reduce_dtype),
                               gradient_attrs(self, numel, padding, reduce_dtype))

    def unit_gather(self, shards):
        parts = self._port_gather()
        return None if parts is None else UnitGather(shards, *parts)

    def gradient_port(self, numel, padding, reduce_dtype, kept: int, tag: str):
        """The :class:`~mindzero.comm.shard_gather.GradientPort` of one member of a unit (``tag`` names the unit
        and the member: MindSpore caches a primitive's gradient by its attributes)."""
        return GradientPort(self._port_bprop(numel, padding, reduce_dtype), kept,
                            {**gradient_attrs(self, numel, padding, reduce_dtype), "mindzero_unit": tag})


class SingleRank(Backend):
    """A world of one rank: every collective is the identity (reduce-scatter pads the tensor)."""

    name = SINGLE

    def gather(self, scope="op"):
        return Identity()

    def sum(self, scope="world"):
        return Identity()

    def reduce_scatter(self):
        return SumThenSlice(None, 0, 1)

    def fused_reduce_scatter(self):
        return FusedSumThenSlice(None, 0, 1)

    def shard_gather(self, numel, padding, reduce_dtype=None):
        return None, None

    def host_gather(self, scope="op"):
        return lambda x: x.asnumpy()

    def broadcast(self, root: int):
        return IdentityTuple()


class Emulated(Backend):
    """CPU: world collectives only. A reduce-scatter is an all-reduce of exactly the tensor plain data
    parallel sums, then this rank's slice (bit-identical to stage 0); op-group collectives of a hybrid
    layout are world collectives that keep the op group's part."""

    name = EMULATED

    def gather(self, scope="op"):
        if scope == "op" and self.world.hybrid:
            return GatherRows(self._world_gather(), self.world.world_size, self._rows_select())
        return self._world_gather()

    def sum(self, scope="world"):
        if scope == "op" and self.world.hybrid:
            return SlotSum(self._world_sum(), self.world.dp_rank, self.world.dp_size)
        return self._world_sum()

    def reduce_scatter(self):
        return SumThenSlice(self._world_sum(), self.world.op_rank, self.world.op_size)

    def broadcast(self, root: int):
        if self.world.hybrid:
            return RowBroadcast(self._world_gather(), self.world.world_size, self.world.op_ranks[root])
        return self._world_broadcast(root)

    def fused_reduce_scatter(self):
        return FusedSumThenSlice(self._world_sum(), self.world.op_rank, self.world.op_size)

    def shard_gather(self, numel, padding, reduce_dtype=None):
        return sum_then_slice_gather(self, numel, padding, reduce_dtype)

    def host_gather(self, scope="op"):
        """A world all-gather, the op group's rows kept (in numpy) unless ``scope`` is ``"world"``."""
        gather, rows = self._world_gather(), self._rows_select() if scope == "op" else None
        if rows is None:
            return lambda x: gather(x).asnumpy()
        rows, size = rows.asnumpy(), self.world.world_size
        return lambda x: gather(x).asnumpy().reshape((size, -1))[rows].reshape((-1,))

    def _port_gather(self):
        """A world all-gather, the op group's rows kept (quantized: int32 words, CPU has no int8 all-gather)."""
        return self._world_gather(), self.world.world_size, self._rows_select()

    def _port_bprop(self, numel, padding, reduce_dtype):
        return sum_then_slice_bprop(self, numel, padding, reduce_dtype, None)


class Collectives(Backend):
    """GPU/Ascend: MindSpore's ``ReduceScatter`` and collectives on the op and dp groups."""

    name = COLLECTIVES
    int8_wire = True

    def _primitive(self, kind: str, group: str, ranks: tuple):
        """MindSpore's collective ``kind`` over ``group`` (``ranks``: its world ranks, for the substitute)."""
        if kind == "reduce_scatter":
            return ops.ReduceScatter(ops.ReduceOp.SUM, group)
        if kind == "all_reduce":
            return ops.AllReduce(ops.ReduceOp.SUM, group)
        return ops.AllGather(group)

    def _op(self, kind):
        return self._primitive(kind, self.world.op_group, self.world.op_ranks)

    def _dp_sum(self):
        """Hybrid: the all-reduce of a reduce-scattered shard over the dp group (the other replicas)."""
        return self._primitive("all_reduce", self.world.dp_group, self.world.dp.ranks) if self.world.hybrid else None

    def gather(self, scope="op"):
        return self._op("all_gather") if scope == "op" and self.world.hybrid else self._world_gather()

    def sum(self, scope="world"):
        return self._op("all_reduce") if scope == "op" and self.world.hybrid else self._world_sum()

    def reduce_scatter(self):
        return PadThenReduceScatter(self._op("reduce_scatter"), self._dp_sum())

    def broadcast(self, root: int):
        if self.world.hybrid:  # the root's values, summed with the others' zeros over the op group
            return ZeroSumBroadcast(self._op("all_reduce"), self.world.op_rank == root)
        return self._world_broadcast(root)

    def fused_reduce_scatter(self):
        return FusedRowsReduceScatter(self._op("reduce_scatter"), self._dp_sum(), self.world.op_size,
                                       self.reduce_scatter())

    def shard_gather(self, numel, padding, reduce_dtype=None):
        if self.world.op_size == 1:  # an op group of one rank has no reduce-scatter to run: sum over the world
            return sum_then_slice_gather(self, numel, padding, reduce_dtype)
        return self._shard_gather(numel, padding, reduce_dtype)

    def _port_gather(self):
        """An all-gather over the op group (quantized: of int8); the backward is the exact gather's reduce-scatter."""
        world = self.world
        if world.op_size == 1:
            return None
        gather = self._op("all_gather") if world.hybrid else self._primitive("all_gather", world.world_group,
                                                                              tuple(range(world.world_size)))
        return gather, world.op_size, None

    def _port_bprop(self, numel, padding, reduce_dtype):
        return reduce_scatter_bprop(self._op("reduce_scatter"), self._dp_sum(), reduce_dtype, None,
                                     self.world.world_size)

    def _shard_gather(self, numel, padding, reduce_dtype):
        group = self.world.op_group if self.world.hybrid else self.world.world_group
        return make_shard_gather(self, group, numel, padding, reduce_dtype, None,
                                 reduce_scatter_bprop(self._op("reduce_scatter"), self._dp_sum(), reduce_dtype, None,
                                                       self.world.world_size))


class Substituted(Collectives):
    """Test-only: the GPU/Ascend code on CPU. The group primitives are CPU-legal functions with their
    semantics (one world all-gather of every rank's tensor, the group's rows in group order, summed in that
    order); the stage-3 gather is a primitive, so it gathers over the world and keeps the op group's rows
    (a gather only moves values). Costs ``N`` times the bytes of the real primitive."""

    name = SUBSTITUTE

    def _primitive(self, kind, group, ranks):
        return substitute_primitive(kind, self.world, tuple(ranks))

    def _shard_gather(self, numel, padding, reduce_dtype):
        select = self._rows_select()
        return make_shard_gather(self, self.world.world_group, numel, padding, reduce_dtype, select,
                                 reduce_scatter_bprop(self._op("reduce_scatter"), self._dp_sum(), reduce_dtype,
                                                       select, self.world.world_size))


class Rehearsal(Emulated):
    """One process playing world rank 0 of ``N`` (:func:`mindzero.comm.groups.rehearse`): the CPU code, each
    world collective a local kernel with the collective's shapes (an all-gather tiles the tensor ``N`` times, a sum
    copies it, a broadcast leaves the values as they are), the stage-3 gather a zero padding to the full size (whose own
    gradient, a slice, stands for the reduction). What it measures is memory and graph size; the values are not
    a run's. Hybrid layouts are not rehearsed."""

    name = REHEARSAL

    def _world_gather(self):
        return LocalGather(self.world.world_size)

    def _world_sum(self):
        return LocalCopy()

    def host_gather(self, scope="op"):
        return lambda x: np.tile(x.asnumpy(), self.world.world_size)

    def broadcast(self, root: int):
        # an owner's broadcast adds no buffer a copy would: with a copy of each tensor, the rehearsal of a 5-block
        # GPT of width 896 at stage 1 with update_sharding="owner" peaked 55% above the launch it stood for
        return IdentityTuple()

    def shard_gather(self, numel, padding, reduce_dtype=None):
        shard = (numel + padding) // self.world.op_size
        return ops.Pad(((0, shard * (self.world.world_size - 1)),)), None


class LocalGather(nn.Cell):
    """``(s,) -> (rows * s,)``: the tensor tiled ``rows`` times, as an all-gather of ``rows`` equal ranks."""

    def __init__(self, rows: int):
        super().__init__(auto_prefix=False)
        self.rows, self.tile = rows, ops.Tile()

    def construct(self, x):
        return self.tile(x, (self.rows,))


class IdentityTuple(nn.Cell):
    """A broadcast in a world of one rank, or rehearsed: the tensors as they are."""

    def construct(self, values, bucket):
        return values


class WorldBroadcast(nn.Cell):
    """MindSpore's ``Broadcast`` over the world from world rank ``root`` (every tensor in one call)."""

    def __init__(self, root: int, group: str):
        super().__init__(auto_prefix=False)
        self.op = ops.Broadcast(root, group)

    def construct(self, values, bucket):
        return self.op(values)


class RowBroadcast(nn.Cell):
    """CPU, hybrid: a broadcast from world rank ``root`` as one world all-gather of the tensors concatenated,
    keeping the root's row (``rows`` times the bytes of a broadcast)."""

    def __init__(self, gather, rows: int, root: int):
        super().__init__(auto_prefix=False)
        self.gather, self.rows, self.root = gather, rows, root

    def construct(self, values, bucket):
        row = self.gather(flat_concat(values)).reshape((self.rows, -1))[self.root]
        return MAP(reshape_as, pieces(row, bucket[3], bucket[0]), values)


class ZeroSumBroadcast(nn.Cell):
    """GPU/Ascend, hybrid: a broadcast over the op group as one all-reduce of the tensors concatenated, to which the
    root adds its values and every other rank zeros (exact: ``x + 0``; twice a broadcast's bytes)."""

    def __init__(self, total, mine: bool):
        super().__init__(auto_prefix=False)
        self.total, self.mine = total, mine

    def construct(self, values, bucket):
        flat = flat_concat(values)
        if not self.mine:
            flat = ops.zeros_like(flat)
        return MAP(reshape_as, pieces(self.total(flat), bucket[3], bucket[0]), values)


class LocalCopy(nn.Cell):
    """A sum over equal ranks' tensors, up to the factor: a fresh buffer of the same values."""

    def construct(self, x):
        return ops.mul(x, ops.ones_like(x))


_BACKENDS = {b.name: b for b in (SingleRank, Emulated, Collectives, Substituted, Rehearsal)}
_OF_WORLD = {}


def backend_of(world: World) -> Backend:
    """The one :class:`Backend` of ``world`` (by ``world.backend``, decided when the world was made)."""
    if world not in _OF_WORLD:
        _OF_WORLD[world] = _BACKENDS[world.backend](world)
    return _OF_WORLD[world]


# --- the GPU/Ascend reduce-scatter Cells ----------------------------------------------------------------
class PadThenReduceScatter(nn.Cell):
    """``(x, padding)``: ``x`` zero-padded, reduce-scattered over the op group, then (hybrid) summed over
    the dp group."""

    def __init__(self, reduce_scatter, dp_sum):
        super().__init__(auto_prefix=False)
        self.reduce_scatter, self.dp_sum, self.has_dp = reduce_scatter, dp_sum, dp_sum is not None

    def construct(self, x, padding):
        y = self.reduce_scatter(own_shard(x, padding, 0, 1))
        if self.has_dp:
            y = self.dp_sum(y)
        return y


class FusedRowsReduceScatter(nn.Cell):
    """A bucket in one ``ReduceScatter``: every tensor zero-padded and laid out as ``(G, shard_i)``, the rows
    concatenated per rank, so one reduce-scatter hands each rank its shard of every tensor (then, hybrid,
    one all-reduce over the dp group)."""

    def __init__(self, reduce_scatter, dp_sum, op_size, single):
        super().__init__(auto_prefix=False)
        self.reduce_scatter, self.dp_sum, self.has_dp, self.op_size = reduce_scatter, dp_sum, dp_sum is not None, op_size
        self.single = single

    def construct(self, tensors, bucket):
        numels, paddings, shard_sizes, offsets, shard_offsets = bucket
        if len(tensors) == 1:
            return (self.single(tensors[0].reshape((-1,)), paddings[0]),)
        rows = MAP(ops.partial(as_rows, self.op_size), tensors, paddings)
        mine = self.reduce_scatter(ops.concat(rows, 1).reshape((-1,)))
        if self.has_dp:
            mine = self.dp_sum(mine)
        return pieces(mine, shard_offsets, shard_sizes)
