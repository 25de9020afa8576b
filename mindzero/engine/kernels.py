"""Every graph-mode kernel of mindzero: ``MultitypeFuncGraph`` s mapped over tuples of tensors with the one
``Map`` (:data:`MAP`), MindSpore's own idiom (``nn/wrap/grad_reducer.py``).

The graph holds one call per tensor; nothing grows a tuple one element at a time (which unrolls into a
graph quadratic in the number of tensors). Per-tensor constants (paddings, positions, buckets) are tuples
of Python numbers mapped alongside. A Cell a kernel calls is mapped as an element too (a tuple of Cells):
bound with ``ops.partial`` instead, MindSpore 2.10 fails to compile the step ("The pointer[cnode_abs] is
null"), as it does when a kernel chooses between two Cells with ``if``.

Used by the train step (:mod:`mindzero.engine.train_step`); the layout helpers they share with the
collective Cells (``own_shard``, ``pick``, ``MAP``) are in :mod:`mindzero.comm.layout`.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import ops

from ..comm.layout import MAP, join_split, own_shard, pick, rest_of
from ..core.state import OWN_SLICE, REPLICATED

# --- the train step ----------------------------------------------------------------------------------------
reduce_unit = ops.MultitypeFuncGraph("mindzero_reduce_unit")
route = ops.MultitypeFuncGraph("mindzero_route")
reduce_grad = ops.MultitypeFuncGraph("mindzero_reduce_grad")
scale_by = ops.MultitypeFuncGraph("mindzero_scale_by")
finite = ops.MultitypeFuncGraph("mindzero_finite")
norm_sq = ops.MultitypeFuncGraph("mindzero_norm_sq")
accumulate = ops.MultitypeFuncGraph("mindzero_accumulate")
store = ops.MultitypeFuncGraph("mindzero_store")
zero_after = ops.MultitypeFuncGraph("mindzero_zero_after")
depend_on = ops.MultitypeFuncGraph("mindzero_depend_on")
gather_unit = ops.MultitypeFuncGraph("mindzero_gather_unit")
gather_write = ops.MultitypeFuncGraph("mindzero_gather_write")
write_gathered = ops.MultitypeFuncGraph("mindzero_write_gathered")
join_at = ops.MultitypeFuncGraph("mindzero_join_at")
ema_update = ops.MultitypeFuncGraph("mindzero_ema_update")
cast_to = ops.MultitypeFuncGraph("mindzero_cast_to")
write_cast = ops.MultitypeFuncGraph("mindzero_write_cast")


@reduce_unit.register("Tuple", "Function", "Tuple", "Tuple")
def _reduce_unit(grads, reducer, positions, bucket):
    """One bucket's collective: ``reducer`` of the gradients at ``positions``."""
    return reducer(pick(grads, positions), bucket)


def _scaled(g, factor, scale_it, widen):
    if widen:  # mixed precision: the optimizer updates fp32 masters; scale in fp32 (no fp16 underflow)
        g = ops.cast(g, ms.float32)
    if scale_it:
        return g * ops.cast(factor, g.dtype)
    return g


@reduce_grad.register("Tensor", "Bool", "Bool", "Function", "Number", "Tensor")
def _reduce_grad(factor, scale_it, widen, reducer, padding, g):
    """One gradient's collective (``reducer``), then (``widen``) fp32 and (``scale_it``) the ``factor``."""
    return _scaled(reducer(g, padding), factor, scale_it, widen)


@route.register("Tuple", "Tuple", "Tensor", "Bool", "Bool", "Number", "Number", "Number")
def _route(grads, reduced, factor, scale_it, widen, i, unit, index):
    """Gradient ``i`` after the buckets: ``reduced[unit][index]``, or ``grads[i]`` when in no bucket."""
    if unit < 0:
        g = grads[i]
    else:
        g = reduced[unit][index]
    return _scaled(g, factor, scale_it, widen)


@cast_to.register("TypeType", "Tensor")
def _cast_to(dtype, g):
    """``g`` in ``dtype``; no Cast node where nothing changes (every run without param_dtype)."""
    if g.dtype == dtype:
        return g
    return ops.cast(g, dtype)


@write_cast.register("Tensor", "Tensor", "Tensor")
def _write_cast(after, held, master):
    """After ``after``: the network's ``held`` copy := ``master`` in ``held``'s dtype."""
    return ops.assign(held, ops.cast(ops.depend(master, after), held.dtype))


@scale_by.register("Tensor", "Tensor")
def _scale(factor, g):
    """``g * factor`` in ``g``'s dtype."""
    return g * ops.cast(factor, g.dtype)


@finite.register("Tensor")
def _finite(g):
    """Whether every element of ``g`` is finite."""
    return ops.isfinite(g).all()


@norm_sq.register("Number", "Number", "Number", "Number", "Number", "Tensor")
def _norm_sq(want, op_rank, op_size, kind, padding, g):
    """Sum of squares (shape ``(1,)``, fp32) of the part of ``g`` this rank counts in the global norm, if
    ``g``'s norm kind is ``want`` (sharded or replicated); zero otherwise (adding it changes nothing)."""
    if (kind == REPLICATED) != (want == REPLICATED):
        return ops.zeros((1,), ms.float32)
    if kind == OWN_SLICE:
        g = own_shard(g.reshape((-1,)), padding, op_rank, op_size)
    return ops.reduce_sum(ops.square(ops.cast(g, ms.float32))).reshape((1,))


@accumulate.register("Tensor", "Tensor")
def _accumulate(buf, g):
    """``buf += g``."""
    return ops.assign_add(buf, g)


@store.register("Tensor", "Tensor")
def _store(buf, g):
    """``buf = g`` (disk offload: the gradient waits for the streamed update)."""
    return ops.assign(buf, g)


@zero_after.register("Tensor", "Tensor")
def _zero_after(after, buf):
    """After ``after``: ``buf := 0``."""
    return ops.assign(buf, ops.depend(ops.zeros_like(buf), after))


@depend_on.register("Tensor", "Tensor")
def _depend_on(after, x):
    """``x``, ordered after ``after``."""
    return ops.depend(x, after)


@gather_unit.register("Tensor", "Tuple", "Tuple", "Tuple", "Tuple", "Function", "Tuple", "Tuple")
def _gather_unit(after, fulls, shards, splits, indices, gather, positions, bucket):
    """After ``after``: one bucket's all-gather of updated master shards into their full parameters, or into
    the rests of split ones (in the parameters' dtype: a bucket has one)."""
    held = pick(fulls, positions)
    shards = MAP(ops.partial(depend_on, after), pick(shards, positions))
    values = gather(MAP(ops.partial(cast_to, held[0].dtype), shards), bucket)
    return MAP(write_gathered, held, values, pick(splits, positions), pick(indices, positions))


@gather_write.register("Tensor", "Function", "Tensor", "Tensor", "Bool", "Tensor")
def _gather_write(after, gather, full, shard, split, index):
    """After ``after``: one all-gather of an updated master shard into its full parameter (mixed precision:
    in param_dtype, half the bytes of fp32), or into the rest of a split one."""
    return _write_gathered(full, gather(_cast_to(full.dtype, ops.depend(shard, after))), split, index)


@write_gathered.register("Tensor", "Tensor", "Bool", "Tensor")
def _write_gathered(held, value, split, rows):
    """``held := value`` (the gathered padded flat tensor) without its padding, in ``held``'s shape; for a
    split parameter ``held`` is the rest: ``value``'s ``rows`` (every op rank's shard but this rank's)."""
    if split:
        return ops.assign(held, rest_of(value, rows))
    return _write_full(held, value)


def _write_full(full, value):
    """``full := value`` without its padding, in ``full``'s shape."""
    if value.shape[0] != full.size:
        value = value[:full.size]
    return ops.assign(full, value.reshape(full.shape))


@join_at.register("Tuple", "Number", "Number", "Tensor", "Number", "Tuple")
def _join_at(values, i, j, order, numel, shape):
    """``values[i]``, or for a split parameter (``j >= 0``) the full tensor joined from its own shard
    ``values[i]`` and its rest ``values[j]`` (a gradient pair, or the pair itself) by the row ``order``, in
    ``shape`` (``numel`` elements)."""
    if j < 0:
        return values[i]
    return join_split(values[i], values[j], order, numel).reshape(shape)


@ema_update.register("Tensor", "Tensor", "Tensor")
def _ema_update(d, ema, w):
    """``ema := d * ema + (1 - d) * w``."""
    factor = ops.cast(d, ema.dtype)
    return ops.assign(ema, ema * factor + ops.cast(w, ema.dtype) * (1.0 - factor))
