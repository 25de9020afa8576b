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

Tests run the GPU/Ascend column on CPU too: inside :func:`substitute_collectives` worlds are not
emulated, and :func:`group_primitive` (where that column creates every group primitive) returns CPU-legal
functions with the primitives' semantics (docs/backends.md).

All collectives here must be entered by **every rank in the same order**; the
train step guarantees it by building the same plan on every rank.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.ops._grad_experimental.grad_base import bprop_getters

from .deprecation import warn_renamed
from .layout import Group, World

def current_world() -> World:
    """Size and rank of the initialised world, or a world of one when ``init()`` was not called."""
    from mindspore.communication import GlobalComm, get_group_size, get_rank

    device = ms.get_context("device_target")
    if not GlobalComm.INITED:
        return World.flat(device, 1, 0, "")
    return World.flat(device, get_group_size(), get_rank(), GlobalComm.WORLD_COMM_GROUP, _substituting())


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


def create_hybrid_groups(op_size: int = None, prefix: str = "mindzero", *, shard_size: int = None) -> tuple:
    """Create the contiguous hybrid layout's groups and return ``(optimizer_parallel_group, dp_group)``
    for this rank: ranks ``[k*G, (k+1)*G)`` shard together, ``G = op_size`` (``shard_size=``: its deprecated
    name).

    Every rank must call it (after ``init()``). On CPU MindSpore creates the groups but runs no
    collective on them; mindzero's communication module then emulates them (docs/hybrid.md).
    """
    from mindspore.communication import create_group

    from .layout import HybridLayout

    if shard_size is not None:
        warn_renamed("create_hybrid_groups(shard_size=)", "create_hybrid_groups(op_size=)",
                     "ranks per op group, not elements per shard")
        op_size = shard_size if op_size is None else op_size
    world = current_world()
    layout = HybridLayout.contiguous(world.world_size, op_size)
    op, dp = layout.op_group_of(world.world_rank), layout.dp_group_of(world.world_rank)
    names = (f"{prefix}_op{op_size}_{layout.dp_rank(world.world_rank)}",
             f"{prefix}_dp{op_size}_{layout.op_rank(world.world_rank)}")
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
    if layout.dp_size == 1:
        return flat
    dp_ranks = layout.dp_group_of(me)  # ordered by replica, so this rank's index is its replica
    return World(flat.device, flat.everyone, Group.of(optimizer_parallel_group, layout.op_group_of(me), me),
                 Group.of(dp_group, dp_ranks, me), flat.backend)


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


_SUBSTITUTE = []  # depth of substitute_collectives() blocks


def _substituting() -> bool:
    return bool(_SUBSTITUTE) or os.environ.get("MINDZERO_SUBSTITUTE_COLLECTIVES") == "1"


@contextlib.contextmanager
def substitute_collectives():
    """Test-only: run the GPU/Ascend code path on CPU.

    Worlds made inside the block (``prepare_train_network`` makes its own) are not emulated: the train
    step builds exactly what it builds on GPU/Ascend (real ``ReduceScatter`` with the fused row layout,
    op-group and dp-group collectives, the two-level hybrid reduction), and only the primitives CPU lacks
    are replaced, by :func:`group_primitive`, with CPU-legal functions of the same semantics. Also
    enabled by ``MINDZERO_SUBSTITUTE_COLLECTIVES=1``. No effect on GPU/Ascend. Costs ``N`` times the bytes
    of the real primitive; for tests (docs/backends.md), not for training.
    """
    _SUBSTITUTE.append(True)
    try:
        yield
    finally:
        _SUBSTITUTE.pop()


def group_primitive(kind: str, world: World, group: str, ranks: tuple):
    """The collective ``kind`` over the named ``group`` as the GPU/Ascend path calls it: ``"reduce_scatter"``
    (sum, then the group index's chunk of dim 0), ``"all_reduce"`` (sum) or ``"all_gather"`` (concatenated
    along dim 0 in group order). MindSpore's primitive, or on a substituting world (:func:`substitute_collectives`)
    a function of the same semantics built from CPU-legal world collectives (``ranks``: the group's world
    ranks in group order)."""
    if not world.substitute:
        if kind == "reduce_scatter":
            return ops.ReduceScatter(ops.ReduceOp.SUM, group)
        if kind == "all_reduce":
            return ops.AllReduce(ops.ReduceOp.SUM, group)
        return ops.AllGather(group)
    return _substitute(kind, world, tuple(ranks))


def _substitute(kind: str, world: World, ranks: tuple):
    """A CPU-legal graph-mode function with the semantics of ``kind`` over the group of world ``ranks``:
    every rank's tensor by one world all-gather, the group's rows taken in group order, summed in that order."""
    gather, take = ops.AllGather(world.world_group), ops.Gather()
    rows, size, index = world.world_size, len(ranks), ranks.index(world.world_rank)
    members = Tensor(list(ranks), ms.int32)

    def of_group(x):  # (size, x.size): every member's x, in group order
        return take(gather(x.reshape((-1,))).reshape((rows, -1)), members, 0)

    def total(parts):
        acc = parts[0]
        for k in range(1, size):
            acc = acc + parts[k]
        return acc

    def all_gather(x):
        return of_group(x).reshape((-1,))

    def all_reduce(x):
        return total(of_group(x)).reshape(x.shape)

    def reduce_scatter(x):
        return total(of_group(x)).reshape((size, -1))[index]

    return {"all_gather": all_gather, "all_reduce": all_reduce, "reduce_scatter": reduce_scatter}[kind]


class AllGather(nn.Cell):
    """Concatenate 1D shards along dim 0 over the op group (``scope="op"``) or the whole world.

    ``(shard_size,) -> (group_size * shard_size,)``. Hybrid on CPU: a world all-gather, then the
    op group's rows (moves ``R`` times the bytes of a real group all-gather).
    """

    def __init__(self, world: World, scope: str = "op"):
        super().__init__(auto_prefix=False)
        size = world.op_size if scope == "op" else world.world_size
        self.identity = size == 1
        self.select = None
        self.take = ops.Gather()
        self.rows = world.world_size
        if self.identity:
            self.op = None
        elif scope == "op" and world.hybrid:
            if world.emulated:
                self.op = ops.AllGather(world.world_group)
                self.select = Tensor(list(world.op_ranks), ms.int32)
            else:
                self.op = group_primitive("all_gather", world, world.op_group, world.op_ranks)
        else:
            self.op = ops.AllGather(world.world_group)

    def construct(self, x):
        if self.identity:
            return x
        y = self.op(x)
        if self.select is not None:
            y = self.take(y.reshape((self.rows, -1)), self.select, 0).reshape((-1,))
        return y


class ShardGather(ops.AllGather):
    """``AllGather`` of one parameter's shards whose backward is mindzero's reduce-scatter: the sum over
    the world of the gradient, this rank's padded shard of the op group (see :func:`shard_gather`).

    A primitive, not a Cell: stage 3 reads every parameter through one, and MindSpore 2.10 compiles a
    Cell call per read site (about 35 ms each, 6 s for a 14-layer GPT) and crashes (SIGSEGV) when a
    Cell's output only feeds ``is not None`` or goes unused (``if self.cls_token is not None:``, as in
    mindcv's vision transformers). The kernel is ``AllGather``'s (``substitute_name``); the gradient is
    the one registered below for this class.
    """

    substitute_name = "AllGather"


def shard_gather(world: World, numel: int, padding: int, reduce_dtype=None):
    """The :class:`ShardGather` for a parameter of ``numel`` elements padded by ``padding`` (forward:
    ``(shard_size,) -> (rows * shard_size,)``), and ``select``: ``None``, or the rows (world ranks) of
    this rank's op group that the caller keeps, in shard order (hybrid on CPU); ``(None, None)`` for a
    world of one rank.

    Backward (the gradient ``dout`` of the gathered rows): GPU/Ascend ``ReduceScatter`` over the op
    group (+ ``AllReduce`` of the shard over the dp group, hybrid); CPU, and an op group of one rank: the
    op group's rows of ``dout`` without padding, ``AllReduce`` over the world, this rank's padded slice:
    exactly the tensor plain data parallel all-reduces, so the result is bit-identical to stage 0's.
    ``reduce_dtype`` (mixed precision, a dtype name): ``dout`` is cast to it first, and the reduced
    shard is returned in it (the train step hands the optimizer fp32).
    """
    if world.world_size == 1:
        return None, None
    emulated = world.emulated or world.op_size == 1
    # the forward gathers over the world and keeps the op group's rows where the op group has no
    # collective: CPU, and the test-only substitute (a gather moves values; its result is the same)
    over_world = emulated or not world.hybrid or world.substitute
    op = ShardGather(world.world_group if over_world else world.op_group)
    op.zero_numel, op.zero_padding, op.zero_emulated = int(numel), int(padding), emulated
    op.zero_world = world
    # MindSpore caches a primitive's gradient by its name and attributes: make them differ where ours does
    op.add_prim_attr("mindzero_numel", int(numel))
    op.add_prim_attr("mindzero_padding", int(padding))
    op.zero_reduce_dtype = None if reduce_dtype is None else getattr(ms, reduce_dtype)
    if reduce_dtype is not None:
        op.add_prim_attr("mindzero_reduce_dtype", str(reduce_dtype))
    select = None
    if over_world and world.hybrid:
        select = Tensor(list(world.op_ranks), ms.int32)
    op.zero_select = select
    return op, select


@bprop_getters.register(ShardGather)
def _shard_gather_bprop(self):
    world, numel, padding, dtype = self.zero_world, self.zero_numel, self.zero_padding, self.zero_reduce_dtype
    select, rows = self.zero_select, world.world_size
    if not self.zero_emulated:
        reduce_scatter, dp = _reduce_scatter_ops(world)

        def bprop(x, out, dout):
            if dtype is not None:
                dout = ops.cast(dout, dtype)
            if select is not None:  # substitute, hybrid: the op group's rows of the world gather
                dout = ops.gather(dout.reshape((rows, -1)), select, 0).reshape((-1,))
            grad = reduce_scatter(dout)
            if dp is not None:
                grad = dp(grad)
            return (grad,)
        return bprop
    allreduce = ops.AllReduce(ops.ReduceOp.SUM, world.world_group)
    rank, group_size = world.op_rank, world.op_size

    def emulated_bprop(x, out, dout):
        grad = dout
        if dtype is not None:
            grad = ops.cast(grad, dtype)
        if select is not None:  # this op group's rows (the others are zero: the forward dropped them)
            grad = ops.gather(grad.reshape((rows, -1)), select, 0).reshape((-1,))
        if padding:
            grad = grad[:numel]
        return (own_shard(allreduce(grad), padding, rank, group_size),)
    return emulated_bprop


class AllReduceSum(nn.Cell):
    """Element-wise sum over the whole world (``scope="world"``) or over the op group.

    Hybrid op-group sum on CPU: each replica writes ``x`` into its own slot of an ``(R, ...)``
    tensor of zeros, a world all-reduce adds them, and each rank keeps its replica's slot
    (exact; ``R`` times the bytes of a real group all-reduce).
    """

    def __init__(self, world: World, scope: str = "world"):
        super().__init__(auto_prefix=False)
        size = world.op_size if scope == "op" else world.world_size
        self.identity = size == 1
        self.slots = None
        if self.identity:
            self.op = None
        elif scope == "op" and world.hybrid:
            if world.emulated:
                self.op = ops.AllReduce(ops.ReduceOp.SUM, world.world_group)
                onehot = [1.0 if k == world.dp_rank else 0.0 for k in range(world.dp_size)]
                self.slots = Tensor(onehot, ms.float32)
                self.replica = world.dp_rank
            else:
                self.op = group_primitive("all_reduce", world, world.op_group, world.op_ranks)
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
    dp = group_primitive("all_reduce", world, world.dp_group, world.dp.ranks) if world.hybrid else None
    return group_primitive("reduce_scatter", world, world.op_group, world.op_ranks), dp


class ReduceScatterSum(nn.Cell):
    """Sum a flat tensor over the whole world and keep this rank's padded shard of the op group.

    ``(x (numel,), padding) -> (shard_size,)`` with ``shard_size = (numel + padding) / group_size``;
    ``padding`` is a constant, so one instance serves every tensor (graph mode specializes it per
    shape and padding). GPU/Ascend: zero-pad, then ``ReduceScatter`` over the op group (and, with
    hybrid sharding, ``AllReduce`` of the shard over the dp group). CPU: ``AllReduce`` of the
    *unpadded* tensor over the world, then pad and slice; all-reducing exactly the tensor a plain
    data-parallel all-reduce would sum keeps the summation order, so the result is bit-identical to
    stage 0's (hybrid or not).
    """

    def __init__(self, world: World):
        super().__init__(auto_prefix=False)
        self.identity = world.world_size == 1
        self.emulated = world.emulated
        self.group_size = world.op_size
        self.rank = world.op_rank
        self.op, self.dp = _reduce_scatter_ops(world)

    def construct(self, x, padding):
        if self.identity:
            return own_shard(x, padding, 0, 1)
        if self.emulated:
            return own_shard(self.op(x), padding, self.rank, self.group_size)
        y = self.op(own_shard(x, padding, 0, 1))
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


# Graph-mode kernels, mapped over tuples of tensors with ``ops.Map`` (one node per tensor; no tuple grown
# element by element, which unrolls into a graph quadratic in the number of tensors).
_map = ops.Map()
_flatten = ops.MultitypeFuncGraph("mindzero_flatten")
_item = ops.MultitypeFuncGraph("mindzero_item")
_own_part = ops.MultitypeFuncGraph("mindzero_own_part")
_as_rows = ops.MultitypeFuncGraph("mindzero_as_rows")
_reshape_as = ops.MultitypeFuncGraph("mindzero_reshape_as")


@_flatten.register("Tensor")
def _flatten_one(x):
    return x.reshape((-1,))


@_item.register("Tuple", "Number")
def _item_at(values, i):
    return values[i]


@_own_part.register("Tensor", "Number", "Number", "Number", "Number", "Number")
def _own_part_of(flat, rank, group_size, offset, numel, padding):
    return own_shard(flat[offset:offset + numel], padding, rank, group_size)


@_as_rows.register("Number", "Tensor", "Number")
def _as_rows_of(group_size, x, padding):
    return own_shard(x.reshape((-1,)), padding, 0, 1).reshape((group_size, -1))


@_reshape_as.register("Tensor", "Tensor")
def _reshape_as_of(part, like):
    return part.reshape(like.shape)


def pick(values, positions):
    """Graph mode: ``(values[positions[0]], values[positions[1]], ...)``."""
    return _map(ops.partial(_item, values), positions)


def flat_concat(tensors):
    """Graph mode: the tensors flattened and concatenated (no copy for one tensor)."""
    if len(tensors) == 1:
        return tensors[0].reshape((-1,))
    return ops.concat(_map(_flatten, tensors))


class Bucket:
    """The constants of one ``comm_fusion`` bucket (or of one tensor without fusion), as graph-mode
    arguments: per member its full element count, padding, shard size, and offset in the concatenation."""

    @staticmethod
    def of(specs) -> tuple:
        numels = tuple(int(s.numel) for s in specs)
        paddings = tuple(int(s.padding) for s in specs)
        shard_sizes = tuple(int(s.shard_size) for s in specs)
        offsets = tuple(sum(numels[:i]) for i in range(len(numels)))
        return numels, paddings, shard_sizes, offsets


class FusedReduceScatterSum(nn.Cell):
    """:class:`ReduceScatterSum` of several tensors in one collective (a ``comm_fusion`` bucket).

    ``(tensors, bucket) -> (shard_0, ..., shard_k)``, each shard this rank's padded 1/G of the sum over
    the world of ``tensors[i]`` flattened; ``bucket`` is :meth:`Bucket.of` the members' specs. GPU/Ascend:
    every tensor is zero-padded and laid out as ``(G, shard_i)``; the rows are concatenated per rank so one
    ``ReduceScatter`` hands each rank its shard of every tensor (plus, hybrid, one ``AllReduce`` over the
    dp group). CPU: one ``AllReduce`` over the world of the unpadded tensors concatenated, then each rank
    slices its shards. With one tensor this is exactly :class:`ReduceScatterSum`. One instance serves
    every bucket.
    """

    def __init__(self, world: World):
        super().__init__(auto_prefix=False)
        self.single = ReduceScatterSum(world)
        self.group_size, self.rank = world.op_size, world.op_rank
        self.identity = world.world_size == 1
        self.emulated = world.emulated
        self.op, self.dp = self.single.op, self.single.dp

    def construct(self, tensors, bucket):
        numels, paddings, shard_sizes, offsets = bucket
        if len(tensors) == 1:
            return (self.single(tensors[0].reshape((-1,)), paddings[0]),)
        if self.identity or self.emulated:
            flat = flat_concat(tensors)
            rank, size = 0, 1
            if not self.identity:
                flat = self.op(flat)
                rank, size = self.rank, self.group_size
            return _map(ops.partial(_own_part, flat, rank, size), offsets, numels, paddings)
        rows = _map(ops.partial(_as_rows, self.group_size), tensors, paddings)
        mine = self.op(ops.concat(rows, 1).reshape((-1,)))
        if self.dp is not None:
            mine = self.dp(mine)
        return ops.split(mine, shard_sizes)


class FusedAllReduceSum(nn.Cell):
    """Sum over the world of several full tensors in one all-reduce (a ``comm_fusion`` bucket):
    ``(tensors, bucket) -> tensors`` of the same shapes. One instance serves every bucket."""

    def __init__(self, world: World):
        super().__init__(auto_prefix=False)
        self.sum = AllReduceSum(world, "world")

    def construct(self, tensors, bucket):
        if len(tensors) == 1:
            return (self.sum(tensors[0]),)
        parts = ops.split(self.sum(flat_concat(tensors)), bucket[0])
        return _map(_reshape_as, parts, tensors)


class FusedAllGather(nn.Cell):
    """:class:`AllGather` (op group) of several shards in one collective (a ``comm_fusion`` bucket).

    ``(shards, bucket) -> (padded_0, ..., padded_k)``, ``padded_i`` the ``(G * shard_size_i,)``
    concatenation of every op-group rank's ``shard_i``. One tensor: exactly :class:`AllGather`.
    One instance serves every bucket.
    """

    def __init__(self, world: World):
        super().__init__(auto_prefix=False)
        self.gather = AllGather(world)
        self.group_size = world.op_size

    def construct(self, shards, bucket):
        if len(shards) == 1:
            return (self.gather(shards[0]),)
        rows = self.gather(flat_concat(shards)).reshape((self.group_size, -1))
        return _map(_flatten, ops.split(rows, bucket[2], 1))
