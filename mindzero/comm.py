"""The only home of collectives in mindzero.

Every collective the train step, stage-3 parameters and the checkpoint code
use is built here, chosen by device target. Scopes: the *op group* (the ranks
a tensor is sharded over, ``G``) and the *world* (``N``; with hybrid sharding
``R = N / G`` replicas of the op group, see :mod:`mindzero.layout`):

=========================  ===================================  ==============================================
operation                  GPU / Ascend                         CPU (MindSpore 2.10: world group only, no RS)
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
=========================  ===================================  ==============================================

With a world of one rank every operation is the identity, so one process
without ``mindspore.communication.init()`` runs every stage.

All collectives here must be entered by **every rank in the same order**; the
train step guarantees it by building the same plan on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
from mindspore import Tensor, nn, ops

# Backends on which MindSpore registers a real ReduceScatter kernel.
_REAL_REDUCE_SCATTER = ("GPU", "Ascend")


@dataclass(frozen=True)
class World:
    """This process's communication world: the op group it shards over and, with hybrid sharding,
    the replicas of that group.

    ``group_size``/``rank``/``group``: the op group (size ``G``, this rank's shard index, its
    name); ``world_size``/``world_rank``/``world_group``: the whole world (``N``);
    ``replicas``/``replica``: ``R = N / G`` copies of the op group and which one this rank is
    in; ``members``: the op group's world ranks in shard order; ``dp_group``: the group of the
    ranks holding this shard index in every replica. Without hybrid sharding ``G = N``, ``R = 1``.
    """

    group_size: int
    rank: int
    device: str
    group: str  # MindSpore's name of the op group ("" when not initialised)
    world_size: int = 0  # 0: the same as group_size
    world_rank: int = -1
    world_group: str = ""
    replicas: int = 1
    replica: int = 0
    members: tuple = ()
    dp_group: str = ""

    def __post_init__(self):
        if self.world_size == 0:
            object.__setattr__(self, "world_size", self.group_size)
            object.__setattr__(self, "world_rank", self.rank)
            object.__setattr__(self, "world_group", self.group)
            object.__setattr__(self, "members", tuple(range(self.group_size)))

    @property
    def hybrid(self) -> bool:
        return self.replicas > 1

    @property
    def emulated(self) -> bool:
        """CPU: no ReduceScatter and no collectives on sub-groups; both are emulated with world collectives."""
        return self.world_size > 1 and self.device not in _REAL_REDUCE_SCATTER

    @property
    def writes_shards(self) -> bool:
        """Replica 0 writes the shard files of a checkpoint (the other replicas hold the same shards)."""
        return self.replica == 0


def current_world() -> World:
    """Size and rank of the initialised world, or a world of one when ``init()`` was not called."""
    from mindspore.communication import GlobalComm, get_group_size, get_rank

    device = ms.get_context("device_target")
    if not GlobalComm.INITED:
        return World(1, 0, device, "")
    return World(get_group_size(), get_rank(), device, GlobalComm.WORLD_COMM_GROUP)


_WORLD_NAMES = ("hccl_world_group", "nccl_world_group", "mccl_world_group")
_GROUP_RANKS = {}  # group name -> world ranks, for groups made by create_hybrid_groups or register_group


def register_group(name: str, ranks) -> None:
    """Tell mindzero the world ranks of a group (``create_hybrid_groups`` does this for its groups)."""
    _GROUP_RANKS[name] = tuple(int(r) for r in ranks)


def group_ranks(name: str) -> tuple:
    """World ranks of a named group: registered here, else asked of MindSpore."""
    if name in _GROUP_RANKS:
        return _GROUP_RANKS[name]
    from mindspore.communication import get_process_group_ranks

    return tuple(int(r) for r in get_process_group_ranks(name))


def create_hybrid_groups(shard_size: int, prefix: str = "mindzero") -> tuple:
    """Create the contiguous hybrid layout's groups and return ``(optimizer_parallel_group, dp_group)``
    for this rank: ranks ``[k*G, (k+1)*G)`` shard together, ``G = shard_size``.

    Every rank must call it (after ``init()``). On CPU MindSpore creates the groups but runs no
    collective on them; mindzero's communication module then emulates them (docs/hybrid.md).
    """
    from mindspore.communication import create_group

    from .layout import HybridLayout

    world = current_world()
    layout = HybridLayout.contiguous(world.world_size, shard_size)
    op, dp = layout.op_group_of(world.world_rank), layout.dp_group_of(world.world_rank)
    names = (f"{prefix}_op{shard_size}_{layout.replica(world.world_rank)}",
             f"{prefix}_dp{shard_size}_{layout.op_rank(world.world_rank)}")
    for name, ranks in zip(names, (op, dp)):
        if name not in _GROUP_RANKS:
            if len(ranks) > 1:
                create_group(name, list(ranks))
            register_group(name, ranks)
    return names


def resolve_world(optimizer_parallel_group, dp_group) -> World:
    """The :class:`World` for ``prepare_train_network``'s group arguments, checked across all ranks.

    ``None`` (or the world group's name) for both: shard over the whole world. A sub-group as
    ``optimizer_parallel_group`` needs a ``dp_group`` (mindone's rule); together they must cut the
    world into replicas of equal op groups (:class:`mindzero.layout.HybridLayout`). Every rank
    all-gathers its view of the layout (2N numbers), so a layout that is wrong anywhere fails on
    every rank with the same message instead of deadlocking.

    Raises:
        ValueError: a group argument that is not a name, or a layout error naming the groups.
    """
    from .layout import HybridLayout, LayoutError

    flat = current_world()
    for value, argument in ((optimizer_parallel_group, "optimizer_parallel_group"), (dp_group, "dp_group")):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{argument} must be None or a group name (str), got {value!r}")
        if value is not None and flat.world_size == 1:
            raise ValueError(f"{argument}={value!r} names a communication group, but the world has one rank "
                             "(mindspore.communication.init() was not called); pass None")
    is_world = lambda g: g is None or g in (flat.world_group, *_WORLD_NAMES)  # noqa: E731
    if flat.world_size == 1:
        return flat
    n, me = flat.world_size, flat.world_rank
    if is_world(optimizer_parallel_group):
        op, dp = tuple(range(n)), (me,)
        if not is_world(dp_group) and len(group_ranks(dp_group)) > 1:
            raise ValueError(f"dp_group={dp_group!r} with optimizer_parallel_group={optimizer_parallel_group!r}: "
                             "sharding over the whole world leaves no replicas for a dp group; pass dp_group=None")
    else:
        if is_world(dp_group):
            raise ValueError(f"optimizer_parallel_group={optimizer_parallel_group!r} is a sub-group, so dp_group "
                             f"must name the group of ranks holding the same shard in the other op groups; got "
                             f"dp_group={dp_group!r}")
        op, dp = group_ranks(optimizer_parallel_group), group_ranks(dp_group)
    views = _gather_views(flat, op, dp)
    try:
        layout = HybridLayout.from_groups(n, {v[0] for v in views}, {v[1] for v in views},
                                          f"optimizer_parallel_group ({optimizer_parallel_group!r} on rank {me})",
                                          f"dp_group ({dp_group!r} on rank {me})")
    except LayoutError as err:
        raise ValueError(f"rank {me}: {err}") from None
    if layout.replicas == 1:
        return flat
    mine = layout.op_group_of(me)
    return World(layout.shard_size, layout.op_rank(me), flat.device, optimizer_parallel_group, n, me,
                 flat.world_group, layout.replicas, layout.replica(me), mine, dp_group)


def _gather_views(flat: World, op, dp) -> list:
    """Every rank's ``(op group, dp group)`` as it sees them: one world all-gather of 2N numbers
    (position ``r`` holds 1 + r's index in the group, 0 if absent)."""
    import numpy as np
    from mindspore import Tensor

    n = flat.world_size
    row = np.zeros(2 * n, np.float32)
    for base, ranks in ((0, op), (n, dp)):
        for i, r in enumerate(ranks):
            if 0 <= r < n:
                row[base + r] = i + 1
    table = shared_cell(AllGather, flat, "world")(Tensor(row)).asnumpy().reshape(n, 2 * n)
    views = []
    for line in table:
        groups = []
        for base in (0, n):
            part = line[base:base + n]
            groups.append(tuple(int(r) for r in sorted(np.flatnonzero(part), key=lambda r: part[r])))
        views.append(tuple(groups))
    return views


def own_shard(flat, padding: int, rank: int, group_size: int):
    """Graph-mode: ``flat`` zero-padded by ``padding``, then rank ``rank``'s contiguous 1/``group_size``.

    Pads the whole tensor before slicing: slicing a collective's output first and padding the tail made
    MindSpore 2.10's CPU all-reduce write into a buffer of the slice's size ("RunRingAllReduce Memcpy
    error"). Without padding or sharding the tensor is returned as it is.
    """
    if padding:
        flat = ops.concat((flat, ops.zeros((padding,), flat.dtype)))
    if group_size == 1:
        return flat
    size = flat.shape[0] // group_size
    return flat[rank * size:(rank + 1) * size]


class AllGather(nn.Cell):
    """Concatenate 1D shards along dim 0 over the op group (``scope="op"``) or the whole world.

    ``(shard_size,) -> (group_size * shard_size,)``. Hybrid on CPU: a world all-gather, then the
    op group's rows (moves ``R`` times the bytes of a real group all-gather).
    """

    def __init__(self, world: World, scope: str = "op"):
        super().__init__(auto_prefix=False)
        size = world.group_size if scope == "op" else world.world_size
        self.identity = size == 1
        self.select = None
        self.take = ops.Gather()
        self.rows = world.world_size
        if self.identity:
            self.op = None
        elif scope == "op" and world.hybrid:
            if world.emulated:
                self.op = ops.AllGather(world.world_group)
                self.select = Tensor(list(world.members), ms.int32)
            else:
                self.op = ops.AllGather(world.group)
        else:
            self.op = ops.AllGather(world.world_group)

    def construct(self, x):
        if self.identity:
            return x
        y = self.op(x)
        if self.select is not None:
            y = self.take(y.reshape((self.rows, -1)), self.select, 0).reshape((-1,))
        return y

    def primitives(self) -> list:
        """The primitives of the forward chain (for recompute)."""
        return [p for p in (self.op, self.take if self.select is not None else None) if p is not None]


class AllReduceSum(nn.Cell):
    """Element-wise sum over the whole world (``scope="world"``) or over the op group.

    Hybrid op-group sum on CPU: each replica writes ``x`` into its own slot of an ``(R, ...)``
    tensor of zeros, a world all-reduce adds them, and each rank keeps its replica's slot
    (exact; ``R`` times the bytes of a real group all-reduce).
    """

    def __init__(self, world: World, scope: str = "world"):
        super().__init__(auto_prefix=False)
        size = world.group_size if scope == "op" else world.world_size
        self.identity = size == 1
        self.slots = None
        if self.identity:
            self.op = None
        elif scope == "op" and world.hybrid:
            if world.emulated:
                self.op = ops.AllReduce(ops.ReduceOp.SUM, world.world_group)
                onehot = [1.0 if k == world.replica else 0.0 for k in range(world.replicas)]
                self.slots = Tensor(onehot, ms.float32)
                self.replica = world.replica
            else:
                self.op = ops.AllReduce(ops.ReduceOp.SUM, world.group)
        else:
            self.op = ops.AllReduce(ops.ReduceOp.SUM, world.world_group)

    def construct(self, x):
        if self.identity:
            return x
        if self.slots is not None:
            mask = ops.cast(self.slots, x.dtype).reshape((-1,) + (1,) * x.ndim)
            return self.op(mask * ops.expand_dims(x, 0))[self.replica]
        return self.op(x)


def _reduce_scatter_ops(world: World) -> tuple:
    """``(op, dp)``: nothing for one rank; CPU: a world all-reduce; else the op group's reduce-scatter and,
    hybrid, the dp group's all-reduce of the shard."""
    if world.world_size == 1:
        return None, None
    if world.emulated:
        return ops.AllReduce(ops.ReduceOp.SUM, world.world_group), None
    dp = ops.AllReduce(ops.ReduceOp.SUM, world.dp_group) if world.hybrid else None
    return ops.ReduceScatter(ops.ReduceOp.SUM, world.group), dp


class ReduceScatterSum(nn.Cell):
    """Sum a flat tensor over the whole world and keep this rank's padded shard of the op group.

    ``(numel,) -> (shard_size,)`` with ``shard_size = (numel + padding) / group_size``.
    GPU/Ascend: zero-pad, then ``ReduceScatter`` over the op group (and, with hybrid
    sharding, ``AllReduce`` of the shard over the dp group). CPU: ``AllReduce`` of the
    *unpadded* tensor over the world, then pad and slice; all-reducing exactly the tensor a
    plain data-parallel all-reduce would sum keeps the summation order, so the result is
    bit-identical to stage 0's (hybrid or not).
    """

    def __init__(self, world: World, padding: int = 0):
        super().__init__(auto_prefix=False)
        self.identity = world.world_size == 1
        self.emulated = world.emulated
        self.group_size = world.group_size
        self.rank = world.rank
        self.padding = padding
        self.op, self.dp = _reduce_scatter_ops(world)

    def construct(self, x):
        if self.identity:
            return own_shard(x, self.padding, 0, 1)
        if self.emulated:
            return own_shard(self.op(x), self.padding, self.rank, self.group_size)
        y = self.op(own_shard(x, self.padding, 0, 1))
        if self.dp is not None:
            y = self.dp(y)
        return y


class AnyRank(nn.Cell):
    """``True`` on every rank when ``flag`` is ``True`` on any rank of the world (a SUM of 0/1, as CPU
    has no MAX)."""

    def __init__(self, world: World):
        super().__init__(auto_prefix=False)
        self.sum = AllReduceSum(world, "world")

    def construct(self, flag):
        count = self.sum(ops.cast(flag, ms.float32).reshape((1,)))
        return count[0] > 0


_SHARED = {}


def shared_cell(cls, world: World, scope: str = "world"):
    """One ``cls(world, scope)`` per process, group and scope, reused by host-side helpers (barriers,
    plan checks) so each compiles once."""
    key = (cls, world, scope)
    if key not in _SHARED:
        _SHARED[key] = cls(world, scope)
    return _SHARED[key]


def flat_concat(tensors):
    """Graph mode: the tensors flattened and concatenated (no copy for one tensor)."""
    if len(tensors) == 1:
        return tensors[0].reshape((-1,))
    flat = ()
    for t in tensors:
        flat = flat + (t.reshape((-1,)),)
    return ops.concat(flat)


class FusedReduceScatterSum(nn.Cell):
    """:class:`ReduceScatterSum` of several tensors in one collective (a ``comm_fusion`` bucket).

    ``(t_0, ..., t_k) -> (shard_0, ..., shard_k)``, each shard this rank's padded 1/G of the sum over
    the world of ``t_i`` flattened. GPU/Ascend: every tensor is zero-padded and laid out as ``(G, shard_i)``;
    the rows are concatenated per rank so one ``ReduceScatter`` hands each rank its shard of every
    tensor (plus, hybrid, one ``AllReduce`` over the dp group). CPU: one ``AllReduce`` over the world of
    the unpadded tensors concatenated, then each rank slices its shards. With one tensor this is
    exactly :class:`ReduceScatterSum`.
    """

    def __init__(self, world: World, numels, paddings):
        super().__init__(auto_prefix=False)
        self.single = ReduceScatterSum(world, paddings[0]) if len(numels) == 1 else None
        self.numels = tuple(int(n) for n in numels)
        self.paddings = tuple(int(p) for p in paddings)
        self.group_size, self.rank = world.group_size, world.rank
        self.shard_sizes = tuple((n + p) // world.group_size for n, p in zip(self.numels, self.paddings))
        self.offsets = tuple(sum(self.numels[:i]) for i in range(len(self.numels)))
        self.identity = world.world_size == 1
        self.emulated = world.emulated
        self.op, self.dp = _reduce_scatter_ops(world)

    def construct(self, tensors):
        if self.single is not None:
            return (self.single(tensors[0].reshape((-1,))),)
        if self.identity or self.emulated:
            flat = flat_concat(tensors)
            if not self.identity:
                flat = self.op(flat)
            out = ()
            for i in range(len(self.numels)):
                part = flat[self.offsets[i]:self.offsets[i] + self.numels[i]]
                out = out + (own_shard(part, self.paddings[i], 0 if self.identity else self.rank,
                                       1 if self.identity else self.group_size),)
            return out
        rows = ()
        for i in range(len(self.numels)):
            padded = own_shard(tensors[i].reshape((-1,)), self.paddings[i], 0, 1)
            rows = rows + (padded.reshape((self.group_size, self.shard_sizes[i])),)
        mine = self.op(ops.concat(rows, 1).reshape((-1,)))
        if self.dp is not None:
            mine = self.dp(mine)
        return ops.split(mine, self.shard_sizes)


class FusedAllGather(nn.Cell):
    """:class:`AllGather` (op group) of several shards in one collective (a ``comm_fusion`` bucket).

    ``(shard_0, ..., shard_k) -> (padded_0, ..., padded_k)``, ``padded_i`` the ``(G * shard_size_i,)``
    concatenation of every op-group rank's ``shard_i``. One tensor: exactly :class:`AllGather`.
    """

    def __init__(self, world: World, shard_sizes):
        super().__init__(auto_prefix=False)
        self.gather = AllGather(world)
        self.shard_sizes = tuple(int(s) for s in shard_sizes)
        self.group_size = world.group_size

    def construct(self, shards):
        if len(self.shard_sizes) == 1:
            return (self.gather(shards[0]),)
        rows = self.gather(flat_concat(shards)).reshape((self.group_size, -1))
        parts = ops.split(rows, self.shard_sizes, 1)
        out = ()
        for part in parts:
            out = out + (part.reshape((-1,)),)
        return out
