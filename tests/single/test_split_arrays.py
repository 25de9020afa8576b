"""The host side of stage 1's split parameters (``mindzero.engine.split``): a full value split into this rank's
shard and the rest, and joined back, by the indices the train step's graph uses."""
import numpy as np
import pytest

from mindzero.core.plan import ParamInfo, PartitionPlan, shard_array, split_rows, splits_evenly
from mindzero.engine.split import joined_array, split_array


@pytest.mark.parametrize("shape", [(7, 13), (91,), (6, 6, 3, 3), (17, 257), (2,)])
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_split_then_join_is_the_full_value(shape, n):
    full = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    pieces = []
    for rank in range(n):
        (spec,) = PartitionPlan.build([ParamInfo("w", shape)], n, rank)
        if not splits_evenly(spec):
            continue
        own, rest = split_array(full, spec)
        np.testing.assert_array_equal(own, shard_array(full, spec))  # the shard is the plan's
        order, rows = split_rows(spec)
        assert rest.size == spec.shard_size * (n - 1) and rows.size == n - 1 and order.size == n  # a few bytes
        assert sorted(order.tolist()) == list(range(n)) and order[rank] == 0
        np.testing.assert_array_equal(joined_array(own, rest, spec), full)
        pieces.append(own)
    if pieces:  # the ranks' shards, in order, are the padded parameter
        np.testing.assert_array_equal(np.concatenate(pieces)[:full.size], full.reshape(-1))
