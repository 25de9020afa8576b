"""The collective Cells the rest of mindzero uses, each built from its world's backend
(:func:`mindzero.comm.backends.backend_of`: decided once per world, never here).

Every Cell here must be called by **every rank in the same order** (they are collectives).
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from ..core.topology import World
from .layout import GETITEM, MAP, column_pieces, flat_concat, flat_pick, pick
from .backends import backend_of


class AllGather(nn.Cell):
    """Concatenate 1D tensors along dim 0 over the op group (``scope="op"``) or the whole world:
    ``(s,) -> (size * s,)`` in group order."""

    def __init__(self, world: World, scope: str = "op"):
        super().__init__(auto_prefix=False)
        self.op = backend_of(world).gather(scope)

    def construct(self, x):
        return self.op(x)


class AllReduceSum(nn.Cell):
    """Element-wise sum over the whole world (``scope="world"``) or over the op group."""

    def __init__(self, world: World, scope: str = "world"):
        super().__init__(auto_prefix=False)
        self.op = backend_of(world).sum(scope)

    def construct(self, x):
        return self.op(x)


class ReduceScatterSum(nn.Cell):
    """Sum a flat tensor over the whole world and keep this rank's padded shard of the op group:
    ``(x (numel,), padding) -> (shard_size,)``, ``shard_size = (numel + padding) / op_size``. ``padding`` is
    a constant, so one instance serves every tensor (graph mode specializes it per shape and padding)."""

    def __init__(self, world: World):
        super().__init__(auto_prefix=False)
        self.op = backend_of(world).reduce_scatter()

    def construct(self, x, padding):
        return self.op(x, padding)


class AnyRank(nn.Cell):
    """``True`` on every rank when ``flag`` is ``True`` on any rank of the world (a SUM of 0/1, as CPU
    has no MAX)."""

    def __init__(self, world: World):
        super().__init__(auto_prefix=False)
        self.sum = AllReduceSum(world, "world")

    def construct(self, flag):
        count = self.sum(ops.cast(flag, ms.float32).reshape((1,)))
        return count[0] > 0


class Bucket:
    """The constants of one ``comm_fusion`` bucket (or of one tensor without fusion), as graph-mode
    arguments: per member its full element count, padding, shard size, offset in the concatenation of full tensors
    and offset in the concatenation of shards."""

    @staticmethod
    def of(specs) -> tuple:
        numels = tuple(int(s.numel) for s in specs)
        paddings = tuple(int(s.padding) for s in specs)
        shard_sizes = tuple(int(s.shard_size) for s in specs)
        offsets = tuple(sum(numels[:i]) for i in range(len(numels)))
        shard_offsets = tuple(sum(shard_sizes[:i]) for i in range(len(shard_sizes)))
        return numels, paddings, shard_sizes, offsets, shard_offsets


class FusedReduceScatterSum(nn.Cell):
    """:class:`ReduceScatterSum` of several tensors in one collective (a ``comm_fusion`` bucket):
    ``(values, positions, bucket) -> (shard_0, ..., shard_k)``, each this rank's padded 1/G of the sum over the
    world of ``values[positions[i]]`` flattened. One tensor: exactly :class:`ReduceScatterSum`. One instance
    serves every bucket."""

    def __init__(self, world: World):
        super().__init__(auto_prefix=False)
        self.op = backend_of(world).fused_reduce_scatter()

    def construct(self, values, positions, bucket):
        return self.op(pick(values, positions), bucket)


class FusedAllReduceSum(nn.Cell):
    """Sum over the world of several full tensors in one all-reduce (a ``comm_fusion`` bucket):
    ``(values, positions, bucket) -> (flat,)``, the sum of ``values[positions[i]]`` flattened and concatenated
    (member ``i`` at ``bucket[3][i]``, ``bucket[0][i]`` elements: its reader cuts it out, as the train step's
    ``route`` does); one tensor: ``(sum,)`` in its shape. One instance serves every bucket."""

    def __init__(self, world: World):
        super().__init__(auto_prefix=False)
        self.sum = AllReduceSum(world, "world")

    def construct(self, values, positions, bucket):
        if len(positions) == 1:
            return (self.sum(GETITEM(values, positions[0])),)
        return (self.sum(flat_pick(values, positions)),)


class FusedAllGather(nn.Cell):
    """:class:`AllGather` (op group) of several shards in one collective (a ``comm_fusion`` bucket):
    ``(shards, bucket) -> (padded_0, ..., padded_k)``, ``padded_i`` the ``(G * shard_size_i,)``
    concatenation of every op-group rank's ``shard_i``. One tensor: exactly :class:`AllGather`.
    One instance serves every bucket."""

    def __init__(self, world: World):
        super().__init__(auto_prefix=False)
        self.gather = AllGather(world)
        self.op_size = world.op_size

    def construct(self, shards, bucket):
        if len(shards) == 1:
            return (self.gather(shards[0]),)
        rows = self.gather(flat_concat(shards)).reshape((self.op_size, -1))
        return column_pieces(rows, bucket[4], bucket[2])


class InOrder(nn.Cell):
    """A collective chained through ``token`` (a scalar Parameter): its input is read after the last collective
    recorded in ``token``, and its output records itself there, so the next chained collective waits for it.
    MindSpore keeps the reads and writes of one Parameter in program order; independent collectives it orders
    as it schedules each rank's graph, which differs between ranks whose graphs differ (two all-gathers of
    different sizes meet: "RingAllGather Memcpy error"). Made by :class:`UpdateCollectives` only."""

    def __init__(self, op, token):
        super().__init__(auto_prefix=False)
        self.op = op
        self.token = token

    def construct(self, x, *args):
        out = self.op(ops.depend(x, self.token + 0), *args)
        return ops.depend(out, ops.assign(self.token, ops.depend(self.token + 1, out)))


class UpdateCollectives:
    """The factory of a train step's update collectives (the write-back gathers, the owners' gradient gathers and
    broadcasts): every one it makes is chained through ``token`` (:class:`InOrder`) when a token is given, none
    otherwise; the train step gives one exactly where its ranks compile different update graphs
    (``ZeroState.ordered``). No update collective is made elsewhere, so none can be left off the chain."""

    def __init__(self, world: World, token=None):
        self.world = world
        self.token = token

    def _made(self, op):
        return op if self.token is None else InOrder(op, self.token)

    def all_gather(self):
        """:class:`AllGather` over the op group."""
        return self._made(AllGather(self.world))

    def fused_all_gather(self):
        """:class:`FusedAllGather`: ``(shards, bucket)``."""
        return self._made(FusedAllGather(self.world))

    def broadcast(self, root: int):
        """The broadcast of a tuple of tensors from op rank ``root`` (``(values, bucket)``)."""
        return self._made(backend_of(self.world).broadcast(root))


def shard_gather(world: World, numel: int, padding: int, reduce_dtype=None):
    """The stage-3 gather primitive of a parameter of ``numel`` elements padded by ``padding``, and the rows
    (world ranks) of this rank's op group its reader keeps (``None``: all); ``(None, None)`` in a world of
    one rank. See ``shard_gather`` of :class:`mindzero.comm.backends.Backend`."""
    return backend_of(world).shard_gather(numel, padding, reduce_dtype)


_SHARED = {}


def shared_cell(cls, world: World, scope: str = "world"):
    """One ``cls(world, scope)`` per process, world and scope, reused by host-side helpers (barriers,
    plan checks) so each compiles once."""
    key = (cls, world, scope)
    if key not in _SHARED:
        _SHARED[key] = cls(world, scope)
    return _SHARED[key]


class Barrier:
    """All ranks wait here; also agrees on a value chosen by rank 0 (a SUM in which the others add 0).
    Called eagerly (host code such as checkpoint saves), by every rank in the same order."""

    def __init__(self, world):
        self.cell, self.rank = shared_cell(AllReduceSum, world), world.world_rank

    def __call__(self, values=(0.0,)):
        x = np.array(values, np.float32) if self.rank == 0 else np.zeros(len(values), np.float32)
        return self.cell(Tensor(x)).asnumpy()

    def count(self, flag: bool) -> int:
        """How many ranks passed ``flag=True`` (every rank contributes; also a barrier)."""
        return int(round(float(self.cell(Tensor(np.array([float(flag)], np.float32))).asnumpy()[0])))
