"""Every graph-mode kernel of mindzero: ``MultitypeFuncGraph`` s mapped over tuples of tensors with the one
``Map`` (:data:`MAP`), MindSpore's own idiom (``nn/wrap/grad_reducer.py``).

The graph holds one call per tensor; nothing grows a tuple one element at a time (which unrolls into a
graph quadratic in the number of tensors). Per-tensor constants (paddings, positions, buckets) are tuples
of Python numbers mapped alongside. A Cell a kernel calls is mapped as an element too (a tuple of Cells):
bound with ``ops.partial`` instead, MindSpore fails to compile the step ("The pointer[cnode_abs] is
null"), as it does when a kernel chooses between two Cells with ``if``.

Used by the train step (:mod:`mindzero.engine.train_step`); the layout helpers they share with the
collective Cells (``own_shard``, ``pick``, ``MAP``) are in :mod:`mindzero.comm.layout`.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import ops

from ..comm.layout import GETITEM, MAP, own_shard, pick
from ..core.state import OWN_SLICE, REPLICATED

#: primitives called directly in graph code (Tensor methods such as ``.all()`` are parsed into a graph per call site)
IS_FINITE, ALL = ops.IsFinite(), ops.ReduceAll()

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
refresh = ops.MultitypeFuncGraph("mindzero_refresh")
owner_grad = ops.MultitypeFuncGraph("mindzero_owner_grad")
gather_bucket = ops.MultitypeFuncGraph("mindzero_gather_bucket")
broadcast_input = ops.MultitypeFuncGraph("mindzero_broadcast_input")
broadcast_write = ops.MultitypeFuncGraph("mindzero_broadcast_write")
ema_update = ops.MultitypeFuncGraph("mindzero_ema_update")
cast_to = ops.MultitypeFuncGraph("mindzero_cast_to")
write_cast = ops.MultitypeFuncGraph("mindzero_write_cast")


@reduce_unit.register("Tuple", "Function", "Tuple", "Tuple")
def _reduce_unit(grads, reducer, positions, bucket):
    """One bucket's collective: ``reducer`` of the gradients at ``positions``."""
    return reducer(grads, positions, bucket)


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


@route.register("Tuple", "Tensor", "Bool", "Bool", "Number")
def _route(values, factor, scale_it, widen, i):
    """Gradient ``values[i]`` (``values``: the gradients, then every bucket's reduced result), scaled."""
    return _scaled(GETITEM(values, i), factor, scale_it, widen)


@route.register("Tuple", "Tensor", "Bool", "Bool", "Tuple")
def _route_piece(values, factor, scale_it, widen, where):
    """A member of a fused all-reduce: ``where = (j, offset, numel, shape)``, its elements
    ``[offset, offset + numel)`` of the flat sum ``values[j]``, in its shape, scaled (one kernel call a member:
    cut, reshape and scale together)."""
    j, offset, numel, shape = where
    piece = GETITEM(values, j)[offset:offset + numel]
    return _scaled(piece.reshape(shape), factor, scale_it, widen)


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
    """Whether every element of ``g`` is finite (by the primitives: ``.all()`` is parsed into a graph per call)."""
    return ALL(IS_FINITE(g))


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


@gather_unit.register("Tensor", "Tuple", "Tuple", "Function", "Tuple", "Tuple")
def _gather_unit(after, fulls, shards, gather, positions, bucket):
    """After ``after``: one bucket's all-gather of updated master shards into their full parameters (in the
    parameters' dtype: a bucket has one)."""
    held = pick(fulls, positions)
    shards = MAP(ops.partial(depend_on, after), pick(shards, positions))
    return MAP(write_gathered, held, gather(MAP(ops.partial(cast_to, held[0].dtype), shards), bucket))


@gather_write.register("Tensor", "Function", "Tensor", "Tensor")
def _gather_write(after, gather, full, shard):
    """After ``after``: one all-gather of an updated master shard into its full parameter (mixed precision: in
    param_dtype, half the bytes of fp32)."""
    return _write_gathered(full, gather(_cast_to(full.dtype, ops.depend(shard, after))))


@write_gathered.register("Tensor", "Tensor")
def _write_gathered(held, value):
    """``held := value`` (the gathered padded flat tensor) without its padding, in ``held``'s shape."""
    if value.shape[0] != held.size:
        value = value[:held.size]
    return ops.assign(held, value.reshape(held.shape))


@refresh.register("Tensor", "Number", "Number", "Tensor", "Tensor", "Bool", "Number")
def _refresh(after, op_rank, op_size, master, held, sliced, padding):
    """After ``after``: ``master`` takes up ``held`` (``sliced``: this rank's padded slice of it): in ``held``'s
    dtype, where ``held`` differs from ``master`` cast (a value written into the network since the last update);
    in the same dtype, a copy (equal to ``master`` unless such a write happened)."""
    value = ops.depend(held, after)
    if sliced:
        value = own_shard(value.reshape((-1,)), padding, op_rank, op_size)
    value = value.reshape(master.shape)
    if value.dtype == master.dtype:
        return ops.assign(master, value)
    kept = ops.equal(ops.cast(master, value.dtype), value)
    return ops.assign(master, ops.select(kept, master, ops.cast(value, master.dtype)))


# what the optimizer is handed for one gradient (OwnerGradients): the gradient as reduced (not owner mode, or a
# full gradient its owner updates from), the full gradient gathered from the reduced shards (its owner), zeros of
# the stand-in's shape after that gather (every other rank), or those zeros alone (a full gradient of another owner)
AS_REDUCED, GATHER_FOR_OWNER, GATHER_FOR_OTHER, STAND_IN = 0, 1, 2, 3


@gather_bucket.register("Tuple", "Function", "Tuple", "Tuple")
def _gather_bucket(grads, gather, positions, bucket):
    """Owner mode: one bucket's all-gather of the reduced gradient shards at ``positions`` (``gather``: the update's
    fused all-gather, chained): each one's padded full gradient."""
    return gather(pick(grads, positions), bucket)


@owner_grad.register("Tuple", "Tuple", "Tuple", "Number", "Number", "Tuple", "Tuple")
def _owner_grad(grads, gathered, source, handed, numel, shape, stand_in):
    """Owner mode: what the optimizer gets for one gradient (``handed``: one of :data:`AS_REDUCED`,
    :data:`GATHER_FOR_OWNER`, :data:`GATHER_FOR_OTHER`, :data:`STAND_IN`): ``grads[i]`` as it is, or the padded full
    gradient ``gathered[bucket][j]`` its bucket's all-gather brought (``source``: ``(-1, i)`` or ``(bucket, j)``)."""
    bucket, at = source
    if handed == AS_REDUCED:
        return grads[at]
    if handed == STAND_IN:  # after the full gradient, which the owner's optimizer reads at this point: the
        g = grads[at]       # all-reduce has the same consumers on every rank
        return ops.depend(ops.zeros(stand_in, g.dtype), g)
    full = gathered[bucket][at]
    if handed == GATHER_FOR_OWNER:
        if full.shape[0] != numel:
            full = full[:numel]
        return full.reshape(shape)
    return ops.depend(ops.zeros(stand_in, full.dtype), full)


@broadcast_input.register("Tensor", "Bool", "Bool", "Tuple", "Tensor", "Tensor")
def _broadcast_input(after, sharded, mine, shape, source, held):
    """After ``after``: what this rank puts into an owner's broadcast for one parameter: its updated value (the
    owner: ``source`` in ``held``'s dtype), else a buffer of the full shape (``held`` itself at stages 1-2, zeros at
    stage 3, where ``held`` is a shard)."""
    if mine:
        return ops.cast(ops.depend(source, after), held.dtype).reshape(shape)
    if sharded:
        return ops.depend(ops.zeros(shape, held.dtype), after)
    return ops.depend(held, after)


@broadcast_write.register("Number", "Number", "Bool", "Number", "Tensor", "Tensor")
def _broadcast_write(op_rank, op_size, sharded, padding, held, value):
    """``held := value`` (an owner's broadcast), or at stage 3 this rank's padded shard of it. (PyNative's
    ``Broadcast`` returns float16 values as float32, exactly: cast back.)"""
    value = _cast_to(held.dtype, value)
    if sharded:
        return ops.assign(held, own_shard(value.reshape((-1,)), padding, op_rank, op_size))
    return ops.assign(held, value)


@ema_update.register("Tensor", "Tensor", "Tensor")
def _ema_update(d, ema, w):
    """``ema := d * ema + (1 - d) * w``."""
    factor = ops.cast(d, ema.dtype)
    return ops.assign(ema, ema * factor + ops.cast(w, ema.dtype) * (1.0 - factor))
