"""The CPU emulations of the collectives MindSpore lacks there (world group only, no ReduceScatter), as the
Cells :class:`mindzero.comm.backends.Emulated` returns (the table in :mod:`mindzero.comm.backends`): an op-group
all-gather as a world all-gather keeping the op group's rows, an op-group sum as a world all-reduce of one slot
per replica, a reduce-scatter as an all-reduce of exactly the tensor plain data parallel sums and then this
rank's slice (bit-identical to stage 0). ``SumThenSlice`` without a sum is also the single rank's reduce-scatter.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, nn, ops

from .layout import MAP, flat_concat, own_part, own_shard


class Identity(nn.Cell):
    def construct(self, x):
        return x


class GatherRows(nn.Cell):
    """A world all-gather, then the rows of ``select`` (world ranks) in order."""

    def __init__(self, gather, rows, select):
        super().__init__(auto_prefix=False)
        self.gather, self.rows, self.select, self.take = gather, rows, select, ops.Gather()

    def construct(self, x):
        y = self.gather(x)
        return self.take(y.reshape((self.rows, -1)), self.select, 0).reshape((-1,))


class SlotSum(nn.Cell):
    """An op-group sum from a world all-reduce: each replica writes ``x`` into its own slot of an
    ``(R, ...)`` tensor of zeros, the all-reduce adds them, each rank keeps its replica's slot (exact;
    ``R`` times the bytes of a real group all-reduce)."""

    def __init__(self, total, dp_rank, dp_size):
        super().__init__(auto_prefix=False)
        self.total, self.dp_rank = total, dp_rank
        self.slots = Tensor([1.0 if k == dp_rank else 0.0 for k in range(dp_size)], ms.float32)

    def construct(self, x):
        mask = ops.cast(self.slots, x.dtype).reshape((-1,) + (1,) * x.ndim)
        return self.total(mask * ops.expand_dims(x, 0))[self.dp_rank]


class SumThenSlice(nn.Cell):
    """``(x, padding)``: the sum over the world of the unpadded ``x`` (``total``; none in a world of one),
    then this rank's padded slice. One instance serves every tensor (graph mode specializes it per shape)."""

    def __init__(self, total, op_rank, op_size):
        super().__init__(auto_prefix=False)
        self.total, self.has_total, self.op_rank, self.op_size = total, total is not None, op_rank, op_size

    def construct(self, x, padding):
        if self.has_total:
            x = self.total(x)
        return own_shard(x, padding, self.op_rank, self.op_size)


class FusedSumThenSlice(nn.Cell):
    """A bucket: the unpadded tensors concatenated, one sum over the world (none in a world of one), then
    this rank's padded slice of each."""

    def __init__(self, total, op_rank, op_size):
        super().__init__(auto_prefix=False)
        self.single = SumThenSlice(total, op_rank, op_size)
        self.total, self.has_total, self.op_rank, self.op_size = total, total is not None, op_rank, op_size

    def construct(self, tensors, bucket):
        numels, paddings, shard_sizes, offsets, _ = bucket
        if len(tensors) == 1:
            return (self.single(tensors[0].reshape((-1,)), paddings[0]),)
        flat = flat_concat(tensors)
        if self.has_total:
            flat = self.total(flat)
        return MAP(ops.partial(own_part, flat, self.op_rank, self.op_size), offsets, numels, paddings)
