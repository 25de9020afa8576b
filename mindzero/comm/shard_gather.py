"""The stage-3 gather: a primitive whose forward all-gathers a parameter's shards and whose registered
gradient reduces the incoming gradient into this rank's shard (the backend decides how:
:meth:`mindzero.comm.backends.Backend.shard_gather`).

A primitive, not a Cell: stage 3 reads every parameter through one, and MindSpore 2.10 compiles a Cell
call per read site (about 35 ms each, 6 s for a 14-layer GPT) and crashes (SIGSEGV) when a Cell's output
only feeds ``is not None`` or goes unused (``if self.cls_token is not None:``, as in mindcv's vision
transformers). The kernel is ``AllGather``'s (``substitute_name``); the gradient is the one its backend
built, registered for this class.
"""
from __future__ import annotations

from mindspore import ops
from mindspore.ops._grad_experimental.grad_base import bprop_getters


class ShardGather(ops.AllGather):
    """``AllGather`` of one parameter's shards whose backward is the backend's reduction of the gradient
    into this rank's shard (``zero_bprop``, built with the primitive by :func:`make_shard_gather`)."""

    substitute_name = "AllGather"


def make_shard_gather(backend, group: str, numel: int, padding: int, reduce_dtype, select, bprop):
    """The :class:`ShardGather` over ``group`` for a parameter of ``numel`` elements padded by ``padding``
    (forward ``(shard_size,) -> (rows * shard_size,)``), with ``bprop`` as its gradient, and ``select``:
    ``None``, or the rows (world ranks) of this rank's op group the reader keeps, in shard order.

    ``reduce_dtype`` (mixed precision, a dtype name): the dtype the gradient is reduced in.
    """
    op = ShardGather(group)
    # MindSpore caches a primitive's gradient by its name and attributes: make them differ where ours does
    op.add_prim_attr("mindzero_numel", int(numel))
    op.add_prim_attr("mindzero_padding", int(padding))
    op.add_prim_attr("mindzero_backend", backend.name)
    op.add_prim_attr("mindzero_op_ranks", str(backend.world.op_ranks))
    if reduce_dtype is not None:
        op.add_prim_attr("mindzero_reduce_dtype", str(reduce_dtype))
    op.zero_bprop = bprop
    return op, select


@bprop_getters.register(ShardGather)
def _shard_gather_bprop(self):
    return self.zero_bprop
