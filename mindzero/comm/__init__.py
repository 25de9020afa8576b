"""mindzero's communication layer: the only place collectives are made.

* :mod:`~mindzero.comm.groups`: this process's world, hybrid groups, the cross-rank layout check;
* :mod:`~mindzero.comm.backends`: how collectives run on each backend, chosen once per world;
* :mod:`~mindzero.comm.cells`: the collective Cells the train step and the checkpoint code use;
* :mod:`~mindzero.comm.shard_gather`: stage 3's gather primitive and its reduce-scatter gradient.
"""
from ..core.topology import Group, World
from .backends import backend_of
from .cells import (AllGather, AllReduceSum, AnyRank, Bucket, FusedAllGather, FusedAllReduceSum, FusedReduceScatterSum,
                    ReduceScatterSum, shard_gather, shared_cell)
from .groups import create_hybrid_groups, current_world, register_group, substitute_collectives, world_for
from .shard_gather import ShardGather

__all__ = ["AllGather", "AllReduceSum", "AnyRank", "Bucket", "FusedAllGather", "FusedAllReduceSum",
           "FusedReduceScatterSum", "Group", "ReduceScatterSum", "ShardGather", "World", "backend_of",
           "create_hybrid_groups", "current_world", "register_group", "shard_gather", "shared_cell",
           "substitute_collectives", "world_for"]
