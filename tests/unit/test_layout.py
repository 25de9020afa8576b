"""Hybrid layouts (pure): the contiguous layout, normalisation, and each layout error."""
import pytest

from mindzero.core.topology import HybridLayout, LayoutError


def test_contiguous_layout():
    lay = HybridLayout.contiguous(8, 4)
    assert lay.op_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert lay.dp_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert (lay.op_size, lay.dp_size) == (4, 2)
    assert [lay.op_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [lay.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert HybridLayout.contiguous(4, 4).dp_size == 1 and HybridLayout.contiguous(4, 1).op_size == 1


def test_strided_layout_is_normalised():
    # op groups (0, 2), (1, 3): ranks 0 and 1 hold shard 0
    lay = HybridLayout.from_groups(4, [(3, 1), (0, 2)], [(2, 1), (3, 0)])
    assert lay.op_groups == ((0, 2), (3, 1)) and lay.dp_rank(3) == 1 and lay.op_rank(1) == 1
    assert lay.dp_groups == ((0, 3), (2, 1))


@pytest.mark.parametrize("op,dp,match", [
    ([(0, 1), (1, 2, 3)], [(0, 2), (1, 3)], r"rank 1 is in two groups, \[0, 1\] and \[1, 2, 3\]"),
    ([(0, 1)], [(0,), (1,)], r"rank\(s\) \[2, 3\] are in no group"),
    ([(0, 1, 2), (3,)], [(0, 3), (1,), (2,)], "size=3: must be a positive divisor of the world size 4"),
    ([(0, 1), (2, 3)], [(0, 2, 1), (3,)], "size=3: must be a positive divisor"),
    ([(0, 1), (2, 3)], [(0, 1), (2, 3)], r"dp_group \[0, 1\] holds two ranks of one optimizer_parallel_group"),
    ([(0, 1), (2, 3)], [(0, 3), (1, 2)], r"shard indices \[0, 1\]"),
    ([(0, 1), (2, 5)], [(0, 2), (1, 3)], r"rank 5 is outside the world \[0, 4\)"),
    ([(0, 1), ()], [(0, 2), (1, 3)], "groups must be non-empty"),
    ([(0,), (1,), (2, 3)], [(0, 1, 2), (3,)], "size=3"),
])
def test_layout_errors(op, dp, match):
    with pytest.raises(LayoutError, match=match):
        HybridLayout.from_groups(4, op, dp)


def test_contiguous_bad_op_size():
    with pytest.raises(LayoutError, match="op_size=3: must be a positive divisor of the world size 8"):
        HybridLayout.contiguous(8, 3)
