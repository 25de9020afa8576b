"""Hybrid sharding layouts: shard inside an op group, replicate across groups (pure Python).

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

from dataclasses import dataclass


class LayoutError(ValueError):
    """Op and dp groups that do not describe a hybrid layout of the world."""


@dataclass(frozen=True)
class HybridLayout:
    world_size: int
    op_groups: tuple  # each op group's world ranks, in op-rank (shard index) order
    dp_groups: tuple  # each dp group's world ranks, in replica order

    @property
    def shard_size(self) -> int:
        return len(self.op_groups[0])

    @property
    def replicas(self) -> int:
        return len(self.op_groups)

    def op_group_of(self, rank: int) -> tuple:
        return next(g for g in self.op_groups if rank in g)

    def dp_group_of(self, rank: int) -> tuple:
        return next(g for g in self.dp_groups if rank in g)

    def op_rank(self, rank: int) -> int:
        """The shard index of world rank ``rank``."""
        return self.op_group_of(rank).index(rank)

    def replica(self, rank: int) -> int:
        return self.op_groups.index(self.op_group_of(rank))

    @staticmethod
    def contiguous(world_size: int, shard_size: int) -> "HybridLayout":
        """Ranks ``[k*G, (k+1)*G)`` shard together (one node per op group on a usual cluster)."""
        _check_sizes(world_size, shard_size, "shard_size")
        op = tuple(tuple(range(k * shard_size, (k + 1) * shard_size)) for k in range(world_size // shard_size))
        dp = tuple(tuple(range(i, world_size, shard_size)) for i in range(shard_size))
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
    if not isinstance(g, int) or g < 1 or world_size % g:
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
