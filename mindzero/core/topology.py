"""The topology of a run: communication groups, this rank's world, hybrid layouts (pure Python).

:class:`World` is what every other part of mindzero reads: the whole world, this rank's op group (the
ranks a tensor is sharded over) and dp group (the ranks holding the same shard in the other op groups),
and the communication **backend**, decided once when the world is made (:func:`backend_for`) and never
again above the communication layer. :class:`HybridLayout` is the global view of a world cut into op
and dp groups, and validates it.

Hybrid sharding layouts: shard inside an op group, replicate across groups.

A world of ``N`` ranks is cut into ``R = N / G`` op groups of ``G`` ranks (each holds one
full copy of the model state, sharded ``G`` ways) and ``G`` dp groups of ``R`` ranks (the
ranks holding the same shard index in every op group). Gradients are reduced over the whole
world (mean over ``N``): within the op group (reduce-scatter) and across the dp group
(all-reduce of the shard); parameters are all-gathered within the op group only.

Example, ``N = 4``, ``G = 2``: op groups ``(0, 1), (2, 3)``, dp groups ``(0, 2), (1, 3)``.

The replica index of a rank is the index of its op group when op groups are ordered by
their smallest rank, so the replica holding world rank 0 is replica 0.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .checks import is_int

# How collectives run (mindzero.comm.backends implements each):
SINGLE = "single"  # a world of one rank: every collective is the identity
EMULATED = "emulated"  # CPU: world collectives only, no ReduceScatter; emulated exactly
COLLECTIVES = "collectives"  # GPU/Ascend: MindSpore's ReduceScatter and sub-group collectives
SUBSTITUTE = "substitute"  # test-only: the GPU/Ascend code with CPU-legal stand-ins for the primitives
REHEARSAL = "rehearsal"  # one process playing rank 0 of N: CPU's code, each collective a local op of its shapes
BACKENDS = (SINGLE, EMULATED, COLLECTIVES, SUBSTITUTE, REHEARSAL)
REAL_COLLECTIVE_DEVICES = ("GPU", "Ascend")  # devices on which MindSpore registers ReduceScatter kernels


DEVICES = ("CPU", "GPU", "Ascend")  # MindSpore's device targets, as mindspore.set_device spells them
DEVICE_VARIABLE = "MINDZERO_DEVICE"


def requested_device(device, environ) -> "str | None":
    """The device a user asked for, in MindSpore's spelling: ``device`` if given, else ``environ``'s
    ``MINDZERO_DEVICE`` if set and not empty; ``None`` when neither asks (MindSpore's own choice stands: mindzero
    calls no ``set_device``).

    Raises:
        ValueError: naming the argument (or the variable), the value and the devices accepted.
    """
    source, value = ("device", device) if device is not None else (DEVICE_VARIABLE, environ.get(DEVICE_VARIABLE))
    if value is None or (source == DEVICE_VARIABLE and not str(value).strip()):
        return None
    by_name = {d.lower(): d for d in DEVICES}
    if not isinstance(value, str) or value.strip().lower() not in by_name:
        raise ValueError(f"{source}={value!r}: must be one of {', '.join(DEVICES)} (any case), or unset to keep "
                         "MindSpore's own device")
    return by_name[value.strip().lower()]


def backend_for(device: str, world_size: int, substitute: bool = False) -> str:
    """The backend of a world of ``world_size`` ranks on ``device`` (``substitute``: the test-only stand-ins,
    which only a CPU world takes)."""
    if world_size == 1:
        return SINGLE
    if device in REAL_COLLECTIVE_DEVICES:
        return COLLECTIVES
    return SUBSTITUTE if substitute else EMULATED


@dataclass(frozen=True)
class Group:
    """A communication group as this rank sees it: MindSpore's ``name`` ("" when not initialised), its
    world ``ranks`` in group order and this rank's ``index`` in it."""

    name: str
    ranks: tuple
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    @staticmethod
    def of(name: str, ranks, me: int) -> "Group":
        ranks = tuple(int(r) for r in ranks)
        return Group(name, ranks, ranks.index(me))


@dataclass(frozen=True)
class World:
    """This process's communication world: the whole world (``N`` ranks), the op group this rank shards
    over (``G``) and its dp group (the ranks holding the same shard index in the ``R = N / G`` replicas of
    the op group; this rank alone without hybrid sharding, where ``G = N``, ``R = 1``).

    Every rank name says what it indexes: ``world_rank``/``world_size`` (the whole world), ``op_rank``/
    ``op_size`` (this rank's shard index in the op group, and the group's size), ``dp_rank``/``dp_size``
    (which replica of the op group this rank is in, and how many there are).
    """

    device: str
    everyone: Group  # the whole world
    op: Group  # the op group
    dp: Group  # the dp group; its index is this rank's replica
    backend: str  # one of BACKENDS: how this world's collectives run (see backend_for)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")

    @staticmethod
    def flat(device: str, size: int, rank: int, name: str = "", substitute: bool = False) -> "World":
        """A world of ``size`` ranks sharded over all of them (no replicas), seen from world rank ``rank``."""
        everyone = Group(name, tuple(range(size)), rank)
        return World(device, everyone, everyone, Group(name, (rank,), 0), backend_for(device, size, substitute))

    @staticmethod
    def of_sizes(op_size: int, world_size: int, backend: str, device: str = "CPU") -> "World":
        """The world of rank 0 in a contiguous layout of ``world_size`` ranks in op groups of ``op_size``
        (for plans made without running: estimates, benchmarks' accounting, tests)."""
        layout = HybridLayout.contiguous(world_size, op_size)
        everyone = Group("", tuple(range(world_size)), 0)
        return World(device, everyone, Group("", layout.op_group_of(0), 0), Group("", layout.dp_group_of(0), 0),
                     backend)

    def with_backend(self, backend: str) -> "World":
        """The same groups on another backend (the collectives GPU/Ascend would run: ``COLLECTIVES``)."""
        return replace(self, backend=backend)

    world_size = property(lambda self: self.everyone.size, doc="ranks in the world (N)")
    world_rank = property(lambda self: self.everyone.index, doc="this rank in the world")
    world_group = property(lambda self: self.everyone.name, doc="MindSpore's name of the world group")
    op_size = property(lambda self: self.op.size, doc="ranks in the op group (G): what a tensor is sharded over")
    op_rank = property(lambda self: self.op.index, doc="this rank's shard index in the op group")
    op_group = property(lambda self: self.op.name, doc="MindSpore's name of the op group")
    op_ranks = property(lambda self: self.op.ranks, doc="the op group's world ranks in shard order")
    dp_size = property(lambda self: self.dp.size, doc="replicas of the op group (R = N / G)")
    dp_rank = property(lambda self: self.dp.index, doc="which replica this rank is in")
    dp_group = property(lambda self: self.dp.name, doc="MindSpore's name of the dp group")

    @property
    def hybrid(self) -> bool:
        return self.dp_size > 1

    @property
    def emulated(self) -> bool:
        """CPU: no ReduceScatter and no collectives on sub-groups; both are emulated with world collectives
        (unless the test-only substitute runs the GPU/Ascend path instead)."""
        return self.backend == EMULATED

    @property
    def substitute(self) -> bool:
        return self.backend == SUBSTITUTE

    @property
    def writes_shards(self) -> bool:
        """Replica 0 writes the shard files of a checkpoint (the other replicas hold the same shards)."""
        return self.dp_rank == 0

    def routes(self) -> tuple:
        """How each collective of a train step runs on this world's backend: :func:`collective_routes`."""
        return collective_routes(self.backend, self.hybrid)


# what a collective is on a backend (Route.kind)
REAL = "real"  # MindSpore's own collective primitive, as named
EMULATED_ROUTE = "emulated"  # a CPU stand-in with the same result: other primitives, more bytes
SUBSTITUTED = "substituted"  # test-only: the GPU/Ascend code, its group primitives replaced by CPU-legal functions
LOCAL = "local"  # no communication: one rank (identity) or a rehearsal (a local operation of the same shapes)
#: the operations of a train step, in the order reports list them
OPERATIONS = ("all-gather", "reduce-scatter", "all-reduce", "broadcast", "stage-3 gather", "int8 gather")


@dataclass(frozen=True)
class Route:
    """One collective operation of a train step on one backend: ``runs`` (the MindSpore primitives that carry it)
    and ``kind`` (:data:`REAL`, :data:`EMULATED_ROUTE`, :data:`SUBSTITUTED` or :data:`LOCAL`)."""

    operation: str
    runs: str
    kind: str


def collective_routes(backend: str, hybrid: bool = False) -> tuple:
    """Every operation of :data:`OPERATIONS` as ``backend`` runs it (``hybrid``: op groups smaller than the world),
    as :class:`Route` records: the one statement of what :mod:`mindzero.comm.backends` implements per backend, read
    by the verbose plan, ``memory_report`` and ``python -m mindzero.env``.

    Raises:
        ValueError: an unknown backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend in (SINGLE, REHEARSAL):
        how = "identity (one rank)" if backend == SINGLE else "a local operation of the collective's shapes"
        return tuple(Route(op, how, LOCAL) for op in OPERATIONS)
    op = "op group" if hybrid else "world"
    if backend == EMULATED:
        rows = ("AllGather(world), the op group's rows kept", EMULATED_ROUTE) if hybrid else ("AllGather(world)", REAL)
        return (Route("all-gather", *rows),
                Route("reduce-scatter", "AllReduce(world) of the whole tensor, then this rank's slice", EMULATED_ROUTE),
                Route("all-reduce", "AllReduce(world), SUM", REAL),
                Route("broadcast", *(("AllGather(world), the root's row kept", EMULATED_ROUTE) if hybrid
                                     else ("Broadcast(world)", REAL))),
                Route("stage-3 gather", "AllGather(world); gradient: AllReduce(world), then this rank's slice",
                      EMULATED_ROUTE),
                Route("int8 gather", "AllGather(world) of int32 words (CPU has no int8 AllGather)", EMULATED_ROUTE))
    group = REAL if backend == COLLECTIVES else SUBSTITUTED  # the substitute replaces the group primitives only
    dp = " + AllReduce(dp group)" if hybrid else ""
    return (Route("all-gather", f"AllGather({op})", group if hybrid else REAL),
            Route("reduce-scatter", f"ReduceScatter({op}), SUM{dp}", group),
            Route("all-reduce", "AllReduce(world), SUM", REAL),
            Route("broadcast", *(("AllReduce(op group) of the root's values and zeros", group) if hybrid
                                 else ("Broadcast(world)", REAL))),
            Route("stage-3 gather", f"AllGather({op}); gradient: ReduceScatter({op}){dp}", group),
            Route("int8 gather", f"AllGather({op}) of int8", group))


class LayoutError(ValueError):
    """Op and dp groups that do not describe a hybrid layout of the world."""


@dataclass(frozen=True)
class HybridLayout:
    """Every op group and dp group of a world (the global view; :class:`mindzero.comm.World` is one rank's)."""

    world_size: int
    op_groups: tuple  # each op group's world ranks, in op-rank (shard index) order
    dp_groups: tuple  # each dp group's world ranks, in replica order

    @property
    def op_size(self) -> int:
        """Ranks per op group (G)."""
        return len(self.op_groups[0])

    @property
    def dp_size(self) -> int:
        """Replicas of the op group (R = N / G)."""
        return len(self.op_groups)

    def op_group_of(self, rank: int) -> tuple:
        return next(g for g in self.op_groups if rank in g)

    def dp_group_of(self, rank: int) -> tuple:
        return next(g for g in self.dp_groups if rank in g)

    def op_rank(self, rank: int) -> int:
        """The shard index of world rank ``rank``."""
        return self.op_group_of(rank).index(rank)

    def dp_rank(self, rank: int) -> int:
        """The replica (op group index) of world rank ``rank``."""
        return self.op_groups.index(self.op_group_of(rank))

    @staticmethod
    def contiguous(world_size: int, op_size: int) -> "HybridLayout":
        """Ranks ``[k*G, (k+1)*G)`` shard together, ``G = op_size`` (one node per op group on a usual cluster)."""
        _check_sizes(world_size, op_size, "op_size")
        op = tuple(tuple(range(k * op_size, (k + 1) * op_size)) for k in range(world_size // op_size))
        dp = tuple(tuple(range(i, world_size, op_size)) for i in range(op_size))
        return HybridLayout.from_groups(world_size, op, dp)

    @staticmethod
    def from_groups(world_size: int, op_groups, dp_groups, op_name: str = "optimizer_parallel_group",
                    dp_name: str = "dp_group") -> "HybridLayout":
        """Validate and normalise a layout given as lists of world ranks.

        Raises:
            LayoutError: sizes that do not divide the world, overlapping groups, a rank in no group,
                or a dp group whose ranks do not hold the same shard index (the message names them).
        """
        op = _cover(world_size, op_groups, op_name)
        dp = _cover(world_size, dp_groups, dp_name)
        for name, groups in ((op_name, op), (dp_name, dp)):
            for size in sorted({len(x) for x in groups}):
                _check_sizes(world_size, size, f"{name} size")
        if len({len(x) for x in op}) > 1:
            raise LayoutError(f"{op_name}: groups must all have the same size, got sizes {sorted({len(x) for x in op})}")
        g = len(op[0])
        if any(len(x) != world_size // g for x in dp):
            raise LayoutError(f"{dp_name}: with {op_name} of size {g} in a world of {world_size}, every dp group "
                              f"must have {world_size // g} ranks, got sizes {sorted({len(x) for x in dp})}")
        op = tuple(sorted(op, key=min))
        for d in dp:
            owners = [next(i for i, o in enumerate(op) if r in o) for r in d]
            if len(set(owners)) != len(d):
                raise LayoutError(f"{dp_name} {list(d)} holds two ranks of one {op_name} "
                                  f"{list(op[owners[0]])}: a dp group takes one rank from each op group")
            index = {op[o].index(r) for o, r in zip(owners, d)}
            if len(index) != 1:
                raise LayoutError(f"{dp_name} {list(d)}: its ranks hold shard indices {sorted(index)} in their op "
                                  "groups; replicas of one shard must hold the same index")
        dp = tuple(sorted((tuple(sorted(d, key=lambda r: next(i for i, o in enumerate(op) if r in o))) for d in dp),
                          key=lambda d: op[0].index(d[0])))
        return HybridLayout(world_size, op, dp)


def _check_sizes(world_size: int, g: int, what: str) -> None:
    if not is_int(g) or g < 1 or world_size % g:
        raise LayoutError(f"{what}={g!r}: must be a positive divisor of the world size {world_size}")


def _cover(world_size: int, groups, name: str) -> tuple:
    """``groups`` as tuples, checked to cover ``range(world_size)`` exactly once."""
    groups = tuple(tuple(int(r) for r in g) for g in groups)
    if not groups or any(not g for g in groups):
        raise LayoutError(f"{name}: groups must be non-empty, got {[list(g) for g in groups]}")
    seen = {}
    for g in groups:
        for r in g:
            if not 0 <= r < world_size:
                raise LayoutError(f"{name} {list(g)}: rank {r} is outside the world [0, {world_size})")
            if r in seen:
                raise LayoutError(f"{name}: rank {r} is in two groups, {list(seen[r])} and {list(g)} "
                                  "(groups must not overlap)")
            seen[r] = g
    missing = sorted(set(range(world_size)) - set(seen))
    if missing:
        raise LayoutError(f"{name}: rank(s) {missing} are in no group; the groups must cover the world "
                          f"of {world_size} ranks exactly once")
    return groups
