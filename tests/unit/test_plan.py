"""Partition plan, pure Python: sizes, padding, ownership, odd shapes, group sizes 1-8."""
import math
import subprocess
import sys

import pytest

from mindzero.core.plan import (REASON_BUFFER, REASON_EMPTY, REASON_FROZEN, REASON_NOT_OPTIMIZED, REASON_USER, ParamInfo,
                                PartitionPlan, ShardSpec, is_per_rank, shard_of_flat, shard_size_for)

SHAPES = [(7, 15), (17, 257), (1,), (), (4, 4), (3, 1, 5), (1000,), (2, 3, 5, 7)]


def test_no_mindspore_import():
    code = ("import sys, mindzero, mindzero.core.plan, mindzero.core.config, mindzero.core.memory, mindzero.launch.local, "
            "mindzero.launch.mpi, mindzero.core.topology; print('mindspore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("shape", SHAPES)
def test_shards_tile_the_padded_parameter(shape, n):
    numel = math.prod(shape)
    specs = [ShardSpec("w", shape, "float32", n, r, True) for r in range(n)]
    ss = -(-numel // n)
    assert all(s.shard_size == ss for s in specs)
    assert specs[0].padded_numel == ss * n and 0 <= specs[0].padding < n
    # offsets are contiguous, valid counts add up to numel, padding only at the end
    assert [s.offset for s in specs] == [r * ss for r in range(n)]
    assert sum(s.valid for s in specs) == numel
    valids = [s.valid for s in specs]
    assert valids == sorted(valids, reverse=True)
    assert sum(0 < v < ss for v in valids) <= 1  # full shards, at most one partial, then empty ones
    # every element has exactly one owner, the rank whose slice contains it
    for i in range(numel):
        owner = specs[0].owner_of(i)
        assert specs[owner].offset <= i < specs[owner].offset + specs[owner].valid


def test_hand_computed_7x15_over_4():
    s = ShardSpec("w", (7, 15), "float32", 4, 3, True)
    assert (s.numel, s.shard_size, s.padded_numel, s.padding, s.offset, s.valid) == (105, 27, 108, 3, 81, 24)
    assert s.owner_of(0) == 0 and s.owner_of(26) == 0 and s.owner_of(27) == 1 and s.owner_of(104) == 3


def test_hand_computed_scalar_and_one_element_over_4():
    for shape in [(), (1,)]:
        specs = [ShardSpec("s", shape, "float32", 4, r, True) for r in range(4)]
        assert [s.valid for s in specs] == [1, 0, 0, 0]
        assert specs[0].shard_size == 1 and specs[0].padding == 3


def test_shard_of_flat_pads_and_slices():
    """The numpy twin of the graph-mode ``comm.own_shard``: zero-pad the flat tensor, take the rank's slice."""
    import numpy as np

    spec = ShardSpec("w", (7,), "float32", 3, 0, True)
    flat = np.arange(7, dtype=np.float32)
    assert [shard_of_flat(flat, spec.for_rank(r)).tolist() for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 0, 0]]
    spec = ShardSpec("w", (2,), "float32", 4, 0, True)  # a rank whose shard is all padding
    assert [shard_of_flat(flat[:2], spec.for_rank(r)).tolist() for r in range(4)] == [[0], [1], [0], [0]]
    replicated = ShardSpec("b", (7,), "float32", 3, 1, False, REASON_USER)
    out = shard_of_flat(flat, replicated)
    assert out.tolist() == flat.tolist() and out is not flat


def test_per_rank_means_a_buffer():
    """A buffer the network writes is a per-rank value (and so is every non-optimized parameter of a plan or
    checkpoint from before frozen weights were sharded); a frozen weight is not: it is sharded at stage 3."""
    assert is_per_rank(REASON_BUFFER) and is_per_rank(REASON_NOT_OPTIMIZED)
    assert not any(is_per_rank(r) for r in ("", REASON_USER, REASON_EMPTY, REASON_FROZEN))
    plan = PartitionPlan.build([ParamInfo("w", (4,)), ParamInfo("moving_mean", (4,), optimized=False, written=True),
                                ParamInfo("frozen", (4,), optimized=False)], 2, 0)
    assert [s.per_rank for s in plan] == [False, True, False]
    assert [(s.sharded, s.optimized, s.frozen) for s in plan] == [(True, True, False), (False, False, False),
                                                                   (True, False, True)]
    kept = PartitionPlan.build([ParamInfo("frozen", (4,), optimized=False)], 2, 0, shard_frozen=False)
    assert not kept["frozen"].sharded and kept["frozen"].reason == REASON_FROZEN and not kept["frozen"].per_rank


def test_plan_build_reasons():
    plan = PartitionPlan.build([
        ParamInfo("a", (7, 15)),
        ParamInfo("bias", (5,), parallel_optimizer=False),
        ParamInfo("bn.moving_mean", (6,), optimized=False, written=True),
        ParamInfo("frozen", (3,), optimized=False),
        ParamInfo("empty", (0, 3)),
    ], op_size=4, op_rank=1)
    assert [s.name for s in plan.sharded] == ["a", "frozen"]
    assert {s.name: s.reason for s in plan.replicated} == {
        "bias": REASON_USER, "bn.moving_mean": REASON_BUFFER, "empty": REASON_EMPTY}
    assert "2 sharded (1 of them frozen" in plan.summary()
    rep = plan["bias"]
    assert (rep.shard_size, rep.offset, rep.valid, rep.padding) == (5, 0, 5, 0)
    assert "replicated bias (5,): parallel_optimizer=False" in plan.summary()
    assert plan.for_rank(3)["a"].offset == 81


def test_plan_fingerprint_detects_differences():
    base = [ParamInfo("a", (7, 15)), ParamInfo("b", (3,))]
    fp = PartitionPlan.build(base, 2, 0).fingerprint()
    assert fp == PartitionPlan.build(base, 2, 1).fingerprint()  # rank does not matter
    assert fp != PartitionPlan.build([ParamInfo("a", (15, 7)), ParamInfo("b", (3,))], 2, 0).fingerprint()
    assert fp != PartitionPlan.build(base, 4, 0).fingerprint()


@pytest.mark.parametrize("kwargs, message", [
    (dict(op_size=0, op_rank=0), "op_size must be an int >= 1, got 0"),
    (dict(op_size=2, op_rank=2), r"op_rank must be an int in \[0, op_size=2\), got 2"),
    (dict(op_size=2.0, op_rank=0), "op_size must be an int >= 1, got 2.0"),
])
def test_plan_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PartitionPlan.build([ParamInfo("a", (3,))], **kwargs)


def test_duplicate_names_and_bad_dtype():
    with pytest.raises(ValueError, match="parameter names must be unique, got 'a' twice"):
        PartitionPlan.build([ParamInfo("a", (3,)), ParamInfo("a", (4,))], 2, 0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        ShardSpec("a", (3,), "complex64", 2, 0, True)
    with pytest.raises(ValueError, match="needs a reason"):
        ShardSpec("a", (3,), "float32", 2, 0, False)


def test_shard_size_for():
    assert [shard_size_for(10, n) for n in range(1, 9)] == [10, 5, 4, 3, 2, 2, 2, 2]
    assert shard_size_for(0, 4) == 0
