"""Worlds and groups: this process's :class:`~mindzero.core.topology.World`, the groups of hybrid sharding,
and the cross-rank check that every rank sees the same layout.

The backend of a world (how its collectives run) is decided here, once, when the world is made
(:func:`mindzero.core.topology.backend_for`): the device, and the test-only :func:`substitute_collectives`.
"""
from __future__ import annotations

import contextlib
import os

import mindspore as ms

from ..core.config import GroupPolicy
from ..core.topology import REHEARSAL, Group, HybridLayout, LayoutError, World
from .backends import backend_of


def current_world() -> World:
    """Size and rank of the initialised world, or a world of one when ``init()`` was not called."""
    from mindspore.communication import GlobalComm, get_group_size, get_rank

    device = ms.get_context("device_target")
    if _REHEARSAL:
        return World.flat(device, _REHEARSAL[-1], 0, "").with_backend(REHEARSAL)
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


def create_hybrid_groups(op_size: int, prefix: str = "mindzero") -> tuple:
    """Create the contiguous hybrid layout's groups and return ``(optimizer_parallel_group, dp_group)``
    for this rank: ranks ``[k*G, (k+1)*G)`` shard together, ``G = op_size``.

    Every rank must call it (after ``init()``). On CPU MindSpore creates the groups but runs no
    collective on them; mindzero's communication module then emulates them (docs/hybrid.md).
    """
    from mindspore.communication import create_group

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


def _resolve_names(optimizer_parallel_group: str, dp_group: str) -> World:
    """The :class:`World` of two group names (or ``None``; the types were checked by
    :class:`~mindzero.core.config.GroupPolicy`), checked across all ranks.

    ``None`` (or the world group's name) for both: shard over the whole world. A sub-group as
    ``optimizer_parallel_group`` needs a ``dp_group`` (mindone's rule); together they must cut the
    world into replicas of equal op groups (:class:`mindzero.core.topology.HybridLayout`). Every rank
    all-gathers its view of the layout (2N numbers), so a layout that is wrong anywhere fails on
    every rank with the same message instead of deadlocking.

    Raises:
        ValueError: a layout error naming the groups.
    """
    flat = current_world()
    for value, argument in ((optimizer_parallel_group, "optimizer_parallel_group"), (dp_group, "dp_group")):
        if value is not None and flat.world_size == 1:
            raise ValueError(f"{argument}={value!r} names a communication group, but the world has one rank "
                             "(mindspore.communication.init() was not called); pass None")
    is_world = lambda g: g is None or g in (flat.world_group, *_WORLD_NAMES)  # noqa: E731
    if flat.world_size == 1 or flat.backend == REHEARSAL:
        if flat.backend == REHEARSAL and not (is_world(optimizer_parallel_group) and is_world(dp_group)):
            raise ValueError("hybrid sharding (optimizer_parallel_group, dp_group) is not rehearsed: "
                             "mindzero.comm.groups.rehearse plays one flat world")
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
    table = backend_of(flat).host_gather("world")(Tensor(row)).reshape(n, 2 * n)
    views = []
    for line in table:
        groups = []
        for base in (0, n):
            part = line[base:base + n]
            groups.append(tuple(int(r) for r in sorted(np.flatnonzero(part), key=lambda r: part[r])))
        views.append(tuple(groups))
    return views


_SUBSTITUTE = []  # depth of substitute_collectives() blocks
_REHEARSAL = []  # world sizes of rehearse() blocks, innermost last


@contextlib.contextmanager
def rehearse(world_size: int):
    """One process plays world rank 0 of ``world_size`` ranks: worlds made inside the block (by
    ``prepare_train_network``) get the ``rehearsal`` backend (:class:`mindzero.comm.backends.Rehearsal`), whose
    collectives are local operations of the right shapes. For measuring a rank's memory and graph before a
    launch (:func:`mindzero.predict_peak`), not for training: the values are not a real run's. Refused where
    ``init()`` was called (a real world exists)."""
    from mindspore.communication import GlobalComm

    from ..core.checks import require_int

    require_int("world_size", world_size, 1)
    if GlobalComm.INITED:
        raise RuntimeError("rehearse: mindspore.communication.init() was called in this process; a rehearsal "
                           "plays a world in one process without one")
    _REHEARSAL.append(int(world_size))
    try:
        yield
    finally:
        _REHEARSAL.pop()


def _substituting() -> bool:
    return bool(_SUBSTITUTE) or os.environ.get("MINDZERO_SUBSTITUTE_COLLECTIVES") == "1"


@contextlib.contextmanager
def substitute_collectives():
    """Test-only: run the GPU/Ascend code path on CPU.

    Worlds made inside the block (``prepare_train_network`` makes its own) get the ``substitute`` backend
    (:class:`mindzero.comm.backends.Substituted`): the train step builds exactly what it builds on GPU/Ascend
    (real ``ReduceScatter`` with the fused row layout, op-group and dp-group collectives, the two-level
    hybrid reduction), and only the primitives CPU lacks are replaced with CPU-legal functions of the same
    semantics. Also
    enabled by ``MINDZERO_SUBSTITUTE_COLLECTIVES=1``. No effect on GPU/Ascend. Costs ``N`` times the bytes
    of the real primitive; for tests (docs/backends.md), not for training.
    """
    _SUBSTITUTE.append(True)
    try:
        yield
    finally:
        _SUBSTITUTE.pop()




def world_for(groups: GroupPolicy) -> World:
    """The :class:`World` of a train step's :class:`~mindzero.core.config.GroupPolicy` (validated there): the
    named groups, or ``hybrid_shard_size`` ranks per op group (made by :func:`create_hybrid_groups`), checked
    across all ranks (:func:`_resolve_names`).

    Raises:
        ValueError: a group name given without ``init()``, or groups that do not cut the world into replicas
            of equal op groups (naming the groups).
    """
    size = groups.hybrid_shard_size
    if size is not None and _REHEARSAL and size != _REHEARSAL[-1]:
        raise ValueError(f"hybrid_shard_size={size!r}: hybrid sharding is not rehearsed (mindzero.comm.groups."
                         "rehearse plays one flat world)")
    if size is not None and size != current_world().world_size:  # the whole world is no hybrid layout
        return _resolve_names(*create_hybrid_groups(size))
    return _resolve_names(groups.optimizer_parallel_group, groups.dp_group)
