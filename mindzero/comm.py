"""The only home of collectives in mindzero.

Every collective the train step, stage-3 parameters and the checkpoint code
use is built here, for one op group, chosen by device target:

==================  ==========================  =========================================
operation           GPU / Ascend                CPU (MindSpore 2.10)
==================  ==========================  =========================================
all-gather          ``ops.AllGather``           ``ops.AllGather`` (world group only)
reduce-scatter      ``ops.ReduceScatter(SUM)``  emulated: ``AllReduce(SUM)`` of the whole
                                                (unpadded) tensor, then this rank's slice;
                                                it moves ~2x the bytes of a real one
all-reduce (sum)    ``ops.AllReduce(SUM)``      ``ops.AllReduce(SUM)`` (SUM only)
any-rank flag       ``AllReduce(SUM)`` of 0/1   the same (CPU has no MAX reduction)
==================  ==========================  =========================================

With an op group of one rank every operation is the identity, so one process
without ``mindspore.communication.init()`` runs every stage.

All collectives here must be entered by **every rank of the group in the same
order**; the train step guarantees it by building the same plan on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
from mindspore import nn, ops

# Backends on which MindSpore registers a real ReduceScatter kernel.
_REAL_REDUCE_SCATTER = ("GPU", "Ascend")


@dataclass(frozen=True)
class World:
    """The communication world of this process: size, rank, device target and world group name."""

    group_size: int
    rank: int
    device: str
    group: str  # MindSpore's world group name ("" when not initialised)

    @property
    def emulated_reduce_scatter(self) -> bool:
        return self.group_size > 1 and self.device not in _REAL_REDUCE_SCATTER


def current_world() -> World:
    """Size and rank of the initialised world, or a world of one when ``init()`` was not called."""
    from mindspore.communication import GlobalComm, get_group_size, get_rank

    device = ms.get_context("device_target")
    if not GlobalComm.INITED:
        return World(1, 0, device, "")
    return World(get_group_size(), get_rank(), device, GlobalComm.WORLD_COMM_GROUP)


def resolve_group(group, argument: str, world: World) -> None:
    """Accept ``None`` or the world group's name for a group argument.

    Raises:
        ValueError: ``group`` names a group mindzero does not know.
        NotImplementedError: ``group`` is a sub-group (hybrid sharding is not implemented yet).
    """
    if group is None:
        return
    if not isinstance(group, str):
        raise ValueError(f"{argument} must be None or a group name (str), got {group!r}")
    from mindspore.communication import GlobalComm

    world_names = {world.group, GlobalComm.WORLD_COMM_GROUP, "hccl_world_group", "nccl_world_group",
                   "mccl_world_group"}
    if group in world_names and world.group_size > 1:
        return
    if world.group_size == 1:
        raise ValueError(f"{argument}={group!r} names a communication group, but the world has one rank "
                         "(mindspore.communication.init() was not called); pass None")
    raise NotImplementedError(f"{argument}={group!r}: sharding over a sub-group (hybrid sharding) is not "
                              f"implemented; pass None or the world group {world.group!r}")


def own_shard(flat, padding: int, rank: int, group_size: int):
    """Graph-mode: ``flat`` zero-padded by ``padding``, then rank ``rank``'s contiguous 1/``group_size``."""
    if padding:
        flat = ops.concat((flat, ops.zeros((padding,), flat.dtype)))
    size = flat.shape[0] // group_size
    return flat[rank * size:(rank + 1) * size]


class AllGather(nn.Cell):
    """Concatenate every rank's 1D shard along dim 0: ``(shard_size,) -> (group_size * shard_size,)``."""

    def __init__(self, world: World):
        super().__init__(auto_prefix=False)
        self.identity = world.group_size == 1
        self.op = None if self.identity else ops.AllGather(world.group)

    def construct(self, x):
        if self.identity:
            return x
        return self.op(x)


class AllReduceSum(nn.Cell):
    """Element-wise sum over the group."""

    def __init__(self, world: World):
        super().__init__(auto_prefix=False)
        self.identity = world.group_size == 1
        self.op = None if self.identity else ops.AllReduce(ops.ReduceOp.SUM, world.group)

    def construct(self, x):
        if self.identity:
            return x
        return self.op(x)


class ReduceScatterSum(nn.Cell):
    """Sum a flat tensor over the group and keep this rank's padded shard.

    ``(numel,) -> (shard_size,)`` with ``shard_size = (numel + padding) / group_size``.
    GPU/Ascend: zero-pad, then ``ReduceScatter``. CPU: ``AllReduce`` of the
    *unpadded* tensor, then pad and slice; all-reducing exactly the tensor a
    plain data-parallel all-reduce would sum keeps the summation order, so the
    result is bit-identical to stage 0's.
    """

    def __init__(self, world: World, padding: int = 0):
        super().__init__(auto_prefix=False)
        self.identity = world.group_size == 1
        self.emulated = world.emulated_reduce_scatter
        self.group_size = world.group_size
        self.rank = world.rank
        self.padding = padding
        if self.identity:
            self.op = None
        elif self.emulated:
            self.op = ops.AllReduce(ops.ReduceOp.SUM, world.group)
        else:
            self.op = ops.ReduceScatter(ops.ReduceOp.SUM, world.group)

    def construct(self, x):
        if self.identity:
            return own_shard(x, self.padding, 0, 1)
        if self.emulated:
            return own_shard(self.op(x), self.padding, self.rank, self.group_size)
        return self.op(own_shard(x, self.padding, 0, 1))


class AnyRank(nn.Cell):
    """``True`` on every rank when ``flag`` is ``True`` on any rank (a SUM of 0/1, as CPU has no MAX)."""

    def __init__(self, world: World):
        super().__init__(auto_prefix=False)
        self.sum = AllReduceSum(world)

    def construct(self, flag):
        count = self.sum(ops.cast(flag, ms.float32).reshape((1,)))
        return count[0] > 0


_SHARED = {}


def shared_cell(cls, world: World):
    """One ``cls(world)`` per process and group, reused by host-side helpers (barriers, plan checks) so
    each compiles once."""
    key = (cls, world.group_size, world.group)
    if key not in _SHARED:
        _SHARED[key] = cls(world)
    return _SHARED[key]
