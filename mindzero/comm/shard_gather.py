"""The stage-3 gather: a primitive whose forward all-gathers a parameter's shards and whose registered
gradient reduces the incoming gradient into this rank's shard (the backend decides how:
``shard_gather`` of :class:`mindzero.comm.backends.Backend`); and the two gathers whose values travel without a
gradient, the shard taking its gradient through a :class:`GradientPort`: the quantized gather
(:mod:`mindzero.comm.quantize`) and :class:`UnitGather` (several parameters in one all-gather).

A primitive, not a Cell: stage 3 reads every parameter through one, and MindSpore compiles a Cell
call per read site (about 35 ms each, 6 s for a 14-layer GPT) and crashes (SIGSEGV) when a Cell's output
only feeds ``is not None`` or goes unused (``if self.cls_token is not None:``, as in mindcv's vision
transformers). The kernel is ``AllGather``'s (``substitute_name``); the gradient is the one its backend
built, registered for this class.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops
from mindspore.ops._grad_experimental.grad_base import bprop_getters
from mindspore.ops.operations.other_ops import StopGradient

from .layout import own_shard


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


def _into_first_row(reduce_into_shard, rows: int):
    """The gradient transform of a port: the incoming ``(R, S)`` gradient reduced into this rank's shard
    (``reduce_into_shard``, the exact gather's backward), placed in row 0 of zeros, so that the sum over rows
    ``Tile``'s own gradient takes is exactly that reduction (``x + 0 = x``)."""

    def transform(dout):
        grad = reduce_into_shard(dout[0], None, dout.reshape((-1,)))[0]
        grad = ops.cast(grad, dout.dtype).reshape((1, -1))
        if rows == 1:
            return grad
        return ops.concat((grad, ops.zeros((rows - 1, grad.shape[1]), grad.dtype)))

    return transform


class GradientPort(nn.Cell):
    """Where a gathered value that travelled without a gradient gives its shard the exact gather's gradient.

    :meth:`attach` ``(values (R, S), shard) -> values``: the same values, plus the shard tiled to ``(R, S)``
    under ``InsertGradientOf`` (which hands ``Tile``'s gradient the reduction in row 0) added as
    ``values + (port + stop_gradient(-port))``: exactly ``values`` (``x + (-x) = 0``), whose gradient w.r.t.
    ``shard`` is ``bprop`` of the incoming ``(R, S)`` gradient. MindSpore has no primitive that returns one input
    and takes another's gradient: ``Depend``/``MulNoNan`` subclasses with a registered gradient lose it (built in
    C++, not looked up by class), ``EmbeddingLookup``'s gradient turns sparse, ``Expand`` refuses outputs above
    10**6 elements, and a Cell with ``bprop`` per read site costs a compiled Cell per read. Called as methods
    (inlined), never as a Cell."""

    def __init__(self, bprop, rows: int, attrs: dict):
        super().__init__(auto_prefix=False)
        self.rows = rows
        self.port = ops.InsertGradientOf(_into_first_row(bprop, rows))
        for key, value in attrs.items():  # MindSpore caches a primitive's gradient by name and attributes
            self.port.add_prim_attr(key, value)
        self.tile, self.add, self.neg = ops.Tile(), ops.Add(), ops.Neg()

    def prims(self):
        return [self.tile, self.add, self.neg]

    def attach(self, values, shard):
        port = self.port(self.tile(shard.reshape((1, -1)), (self.rows, 1)))
        return self.add(values, self.add(port, ops.stop_gradient(self.neg(port))))


class UnitGather(nn.Cell):
    """One all-gather of a unit's shards, concatenated (:mod:`mindzero.core.units`): :meth:`matrix` is every
    kept rank's concatenated shards, ``(R, sum of shard sizes)``, without a gradient; each member's reader
    takes its columns and attaches its own :class:`GradientPort`.

    Every read site of the unit calls :meth:`matrix` with the same primitive on the same Parameters, so graph
    mode's common-subexpression elimination leaves one all-gather per unit (and, with ``regather``, one in
    backward). ``gather``: the backend's all-gather primitive (``rows`` ranks of it in the result), ``select``:
    ``None`` or the rows this rank's op group keeps (a world gather on CPU under hybrid sharding)."""

    def __init__(self, shards, gather, rows: int, select):
        super().__init__(auto_prefix=False)
        # a plain tuple of Parameters: graph mode reads them, the Cell does not register them as its own (the
        # reading Cells own them, under their names)
        self.shards = tuple(shards)
        self.gather, self.rows = gather, rows
        self.has_select = select is not None
        self.kept = rows
        if self.has_select:
            self.select, self.kept = select, int(select.shape[0])
        self.concat, self.reshape, self.take, self.stop = ops.Concat(), ops.Reshape(), ops.Gather(), StopGradient()
        self.offsets, offset = [], 0
        for shard in self.shards:
            self.offsets.append(offset)
            offset += int(shard.shape[0])
        self.size = offset

    def regather(self):
        """Mark the gather for recompute (once: every member's reader asks; a second ``recompute()`` would find
        the attribute it set shadowing the method)."""
        for prim in (self.gather, self.concat, self.reshape, self.take, self.stop):
            if callable(getattr(prim, "recompute", None)):  # (the test-only substitute's all-gather is a function)
                prim.recompute()

    def matrix(self):
        got = self.reshape(self.gather(self.concat(self.shards)), (self.rows, self.size))
        if self.has_select:
            got = self.take(got, self.select, 0)
        return self.stop(got)


# --- the gather's backward on each backend (built by mindzero.comm.backends) -----------------------------
def sum_then_slice_gather(backend, numel, padding, reduce_dtype):
    """The gather over the world (hybrid: keeping the op group's rows) whose backward all-reduces the op
    group's rows of the gradient, unpadded, over the world and keeps this rank's padded slice: exactly the
    tensor plain data parallel all-reduces, so the result is bit-identical to stage 0's."""
    world, select = backend.world, backend._rows_select()
    bprop = sum_then_slice_bprop(backend, numel, padding, reduce_dtype, select)
    return make_shard_gather(backend, world.world_group, numel, padding, reduce_dtype, select, bprop)


def sum_then_slice_bprop(backend, numel, padding, reduce_dtype, select):
    """The backward of :func:`sum_then_slice_gather` (``select``: the op group's rows of a world gather's
    gradient; ``None``: the gradient has the op group's rows only)."""
    world = backend.world
    total = backend._world_sum()
    dtype = None if reduce_dtype is None else getattr(ms, reduce_dtype)
    rows, op_rank, op_size = world.world_size, world.op_rank, world.op_size

    def bprop(x, out, dout):
        grad = dout
        if dtype is not None:
            grad = ops.cast(grad, dtype)
        if select is not None:  # this op group's rows (the others are zero: the forward dropped them)
            grad = ops.gather(grad.reshape((rows, -1)), select, 0).reshape((-1,))
        if padding:
            grad = grad[:numel]
        return (as_shard_dtype(own_shard(total(grad), padding, op_rank, op_size), x),)

    return bprop


def reduce_scatter_bprop(reduce_scatter, dp_sum, reduce_dtype, select, rows):
    """The gather's backward with a reduce-scatter: the gradient (``select``: the op group's rows of a world
    gather) reduce-scattered over the op group, then (hybrid) summed over the dp group."""
    dtype = None if reduce_dtype is None else getattr(ms, reduce_dtype)

    def bprop(x, out, dout):
        if dtype is not None:
            dout = ops.cast(dout, dtype)
        if select is not None:
            dout = ops.gather(dout.reshape((rows, -1)), select, 0).reshape((-1,))
        grad = reduce_scatter(dout)
        if dp_sum is not None:
            grad = dp_sum(grad)
        return (as_shard_dtype(grad, x),)

    return bprop


def gradient_attrs(backend, numel, padding, reduce_dtype) -> dict:
    """The attributes that tell one parameter's gradient primitive from another's (MindSpore caches a
    primitive's gradient by name and attributes; see :func:`mindzero.comm.shard_gather.make_shard_gather`)."""
    attrs = {"mindzero_numel": int(numel), "mindzero_padding": int(padding), "mindzero_backend": backend.name,
             "mindzero_op_ranks": str(backend.world.op_ranks)}
    if reduce_dtype is not None:
        attrs["mindzero_reduce_dtype"] = str(reduce_dtype)
    return attrs


def as_shard_dtype(grad, shard):
    """A gradient reduced in 16 bits for an fp32 shard (``reduce_dtype`` without ``param_dtype``) widened back
    after the collective: every read of a tied parameter then adds gradients of one dtype. (A wider reduction
    of a ``param_dtype`` shard stays wide: the fp32 masters take it.)"""
    if shard.dtype == ms.float32 and grad.dtype != ms.float32:
        return ops.cast(grad, ms.float32)
    return grad
