"""How collectives run: one :class:`Backend` per :class:`~mindzero.core.topology.World`, chosen once from
``World.backend`` (:func:`backend_of`). Everything above this module asks its backend for a collective and
never branches on the device.

Scopes: the *op group* (the ranks a tensor is sharded over, ``G``) and the *world* (``N``; with hybrid
sharding ``R = N / G`` replicas of the op group, see :mod:`mindzero.core.topology`):

=========================  ===================================  ==============================================
operation                  ``collectives`` (GPU / Ascend)       ``emulated`` (CPU, MindSpore 2.10: world
                                                                group only, no ReduceScatter)
=========================  ===================================  ==============================================
all-gather (op group)      ``AllGather(op group)``              ``AllGather(world)``; hybrid: keep the op
                                                                group's rows (R x the bytes)
reduce-scatter (sum over   ``ReduceScatter(op group)``; hybrid  ``AllReduce(world)`` of the whole unpadded
world, shard over op)      + ``AllReduce(dp group)`` of shard   tensor, then this rank's slice (~2x the bytes
                                                                of a real one; bit-identical to stage 0)
all-reduce (world)         ``AllReduce(world)``                 ``AllReduce(world)`` (SUM only)
all-reduce (op group)      ``AllReduce(op group)``              hybrid: each replica fills its slot of an
                                                                (R, ...) zero tensor, ``AllReduce(world)``
any-rank flag (world)      ``AllReduce(SUM)`` of 0/1            the same (CPU has no MAX reduction)
=========================  ===================================  ==============================================

``single`` (a world of one rank, no ``init()``): every collective is the identity, so one process runs
every stage. ``substitute`` (test-only, :func:`mindzero.comm.substitute_collectives`): the ``collectives``
code on CPU, with only the group primitives CPU lacks replaced by CPU-legal functions of the same
semantics (docs/backends.md).

All collectives must be entered by **every rank in the same order**; the train step guarantees it by
building the same plan on every rank.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, nn, ops

from ..core.topology import COLLECTIVES, EMULATED, SINGLE, SUBSTITUTE, World
from .layout import MAP, as_rows, flat_concat, own_part, own_shard
from .quantize import QuantizedGather, bytes_to_words, words_to_bytes
from .shard_gather import GradientPort, UnitGather, make_shard_gather


class Backend:
    """The collectives of one world. Each method returns a graph-callable (a Cell or a primitive):

    * ``gather(scope)``: ``(s,) -> (size * s,)``, every rank's 1D tensor concatenated in group order;
    * ``sum(scope)``: element-wise sum over the scope;
    * ``reduce_scatter()``: ``(x (numel,), padding) -> (shard_size,)``, this rank's padded shard of the op
      group of the sum over the world;
    * ``fused_reduce_scatter()``: ``(tensors, bucket) -> shards``, the same for a bucket in one collective
      (``bucket``: :meth:`mindzero.comm.cells.Bucket.of`);
    * ``shard_gather(numel, padding, reduce_dtype)``: the stage-3 gather primitive of one parameter and the
      rows it keeps (see :mod:`mindzero.comm.shard_gather`);
    * ``quantized_gather(numel, padding, shard_size, block, reduce_dtype)``: the same gather sending int8 values
      with fp32 block scales (:class:`mindzero.comm.quantize.QuantizedGather`: the op group's rows only, the
      same exact backward), or ``None`` where nothing is gathered;
    * ``unit_gather(shards)``: one all-gather of several parameters' shards, concatenated, without a gradient
      (:class:`mindzero.comm.shard_gather.UnitGather`), or ``None`` where nothing is gathered; each member's
      gradient enters through its ``gradient_port(numel, padding, reduce_dtype)``, the exact gather's reduction;
    * ``host_gather()``: ``(s,) tensor -> (op_size * s,) numpy array``, the op group's tensors concatenated in
      group order, called eagerly (host-side tools such as ``gather_full_state_dict``: no graph to compile per
      shape; measured on the test GPT at 2 ranks: 2.3 s of graph compiles -> milliseconds).
    """

    name = None
    int8_wire = False  # whether its all-gather takes int8 (else a quantized payload travels as int32 words)

    def __init__(self, world: World):
        self.world = world

    def host_gather(self):
        op = self.gather("op")
        return lambda x: op(x).asnumpy()

    def _world_gather(self):
        return ops.AllGather(self.world.world_group)

    def _world_sum(self):
        return ops.AllReduce(ops.ReduceOp.SUM, self.world.world_group)

    def _rows_select(self):
        """The world ranks of this rank's op group, as a row index into a world all-gather (hybrid only)."""
        return Tensor(list(self.world.op_ranks), ms.int32) if self.world.hybrid else None

    def _port_gather(self):
        """``(gather, rows, select)`` of a gather whose values travel without a gradient (quantized, or a unit's),
        or ``None`` where nothing is gathered. A backend that gathers also defines ``_port_bprop(numel, padding,
        reduce_dtype)``: the exact gather's reduction of one parameter's ``(kept rows, shard)`` gradient."""
        return None

    def quantized_gather(self, numel, padding, shard_size, block, reduce_dtype=None):
        parts = self._port_gather()
        if parts is None:
            return None
        gather, rows, select = parts
        return QuantizedGather(gather, self.int8_wire, rows, shard_size, block, select,
                               self._port_bprop(numel, padding, reduce_dtype),
                               _gradient_attrs(self, numel, padding, reduce_dtype))

    def unit_gather(self, shards):
        parts = self._port_gather()
        return None if parts is None else UnitGather(shards, *parts)

    def gradient_port(self, numel, padding, reduce_dtype, kept: int, tag: str):
        """The :class:`~mindzero.comm.shard_gather.GradientPort` of one member of a unit (``tag`` names the unit
        and the member: MindSpore caches a primitive's gradient by its attributes)."""
        return GradientPort(self._port_bprop(numel, padding, reduce_dtype), kept,
                            {**_gradient_attrs(self, numel, padding, reduce_dtype), "mindzero_unit": tag})


class SingleRank(Backend):
    """A world of one rank: every collective is the identity (reduce-scatter pads the tensor)."""

    name = SINGLE

    def gather(self, scope="op"):
        return _Identity()

    def sum(self, scope="world"):
        return _Identity()

    def reduce_scatter(self):
        return _SumThenSlice(None, 0, 1)

    def fused_reduce_scatter(self):
        return _FusedSumThenSlice(None, 0, 1)

    def shard_gather(self, numel, padding, reduce_dtype=None):
        return None, None

    def host_gather(self):
        return lambda x: x.asnumpy()


class Emulated(Backend):
    """CPU: world collectives only. A reduce-scatter is an all-reduce of exactly the tensor plain data
    parallel sums, then this rank's slice (bit-identical to stage 0); op-group collectives of a hybrid
    layout are world collectives that keep the op group's part."""

    name = EMULATED

    def gather(self, scope="op"):
        if scope == "op" and self.world.hybrid:
            return _GatherRows(self._world_gather(), self.world.world_size, self._rows_select())
        return self._world_gather()

    def sum(self, scope="world"):
        if scope == "op" and self.world.hybrid:
            return _SlotSum(self._world_sum(), self.world.dp_rank, self.world.dp_size)
        return self._world_sum()

    def reduce_scatter(self):
        return _SumThenSlice(self._world_sum(), self.world.op_rank, self.world.op_size)

    def fused_reduce_scatter(self):
        return _FusedSumThenSlice(self._world_sum(), self.world.op_rank, self.world.op_size)

    def shard_gather(self, numel, padding, reduce_dtype=None):
        return _sum_then_slice_gather(self, numel, padding, reduce_dtype)

    def host_gather(self):
        """A world all-gather, the op group's rows kept (in numpy)."""
        gather, rows = self._world_gather(), self._rows_select()
        if rows is None:
            return lambda x: gather(x).asnumpy()
        rows, size = rows.asnumpy(), self.world.world_size
        return lambda x: gather(x).asnumpy().reshape((size, -1))[rows].reshape((-1,))

    def _port_gather(self):
        """A world all-gather, the op group's rows kept (quantized: int32 words, CPU has no int8 all-gather)."""
        return self._world_gather(), self.world.world_size, self._rows_select()

    def _port_bprop(self, numel, padding, reduce_dtype):
        return _sum_then_slice_bprop(self, numel, padding, reduce_dtype, None)


class Collectives(Backend):
    """GPU/Ascend: MindSpore's ``ReduceScatter`` and collectives on the op and dp groups."""

    name = COLLECTIVES
    int8_wire = True

    def _primitive(self, kind: str, group: str, ranks: tuple):
        """MindSpore's collective ``kind`` over ``group`` (``ranks``: its world ranks, for the substitute)."""
        if kind == "reduce_scatter":
            return ops.ReduceScatter(ops.ReduceOp.SUM, group)
        if kind == "all_reduce":
            return ops.AllReduce(ops.ReduceOp.SUM, group)
        return ops.AllGather(group)

    def _op(self, kind):
        return self._primitive(kind, self.world.op_group, self.world.op_ranks)

    def _dp_sum(self):
        """Hybrid: the all-reduce of a reduce-scattered shard over the dp group (the other replicas)."""
        return self._primitive("all_reduce", self.world.dp_group, self.world.dp.ranks) if self.world.hybrid else None

    def gather(self, scope="op"):
        return self._op("all_gather") if scope == "op" and self.world.hybrid else self._world_gather()

    def sum(self, scope="world"):
        return self._op("all_reduce") if scope == "op" and self.world.hybrid else self._world_sum()

    def reduce_scatter(self):
        return _PadThenReduceScatter(self._op("reduce_scatter"), self._dp_sum())

    def fused_reduce_scatter(self):
        return _FusedRowsReduceScatter(self._op("reduce_scatter"), self._dp_sum(), self.world.op_size,
                                       self.reduce_scatter())

    def shard_gather(self, numel, padding, reduce_dtype=None):
        if self.world.op_size == 1:  # an op group of one rank has no reduce-scatter to run: sum over the world
            return _sum_then_slice_gather(self, numel, padding, reduce_dtype)
        return self._shard_gather(numel, padding, reduce_dtype)

    def _port_gather(self):
        """An all-gather over the op group (quantized: of int8); the backward is the exact gather's reduce-scatter."""
        world = self.world
        if world.op_size == 1:
            return None
        gather = self._op("all_gather") if world.hybrid else self._primitive("all_gather", world.world_group,
                                                                              tuple(range(world.world_size)))
        return gather, world.op_size, None

    def _port_bprop(self, numel, padding, reduce_dtype):
        return _reduce_scatter_bprop(self._op("reduce_scatter"), self._dp_sum(), reduce_dtype, None,
                                     self.world.world_size)

    def _shard_gather(self, numel, padding, reduce_dtype):
        group = self.world.op_group if self.world.hybrid else self.world.world_group
        return make_shard_gather(self, group, numel, padding, reduce_dtype, None,
                                 _reduce_scatter_bprop(self._op("reduce_scatter"), self._dp_sum(), reduce_dtype, None,
                                                       self.world.world_size))


class Substituted(Collectives):
    """Test-only: the GPU/Ascend code on CPU. The group primitives are CPU-legal functions with their
    semantics (one world all-gather of every rank's tensor, the group's rows in group order, summed in that
    order); the stage-3 gather is a primitive, so it gathers over the world and keeps the op group's rows
    (a gather only moves values). Costs ``N`` times the bytes of the real primitive."""

    name = SUBSTITUTE

    def _primitive(self, kind, group, ranks):
        return _substitute(kind, self.world, tuple(ranks))

    def _shard_gather(self, numel, padding, reduce_dtype):
        select = self._rows_select()
        return make_shard_gather(self, self.world.world_group, numel, padding, reduce_dtype, select,
                                 _reduce_scatter_bprop(self._op("reduce_scatter"), self._dp_sum(), reduce_dtype,
                                                       select, self.world.world_size))


_BACKENDS = {b.name: b for b in (SingleRank, Emulated, Collectives, Substituted)}
_OF_WORLD = {}


def backend_of(world: World) -> Backend:
    """The one :class:`Backend` of ``world`` (by ``world.backend``, decided when the world was made)."""
    if world not in _OF_WORLD:
        _OF_WORLD[world] = _BACKENDS[world.backend](world)
    return _OF_WORLD[world]


# --- the stage-3 gather's backward on each backend ----------------------------------------------------------
def _sum_then_slice_gather(backend: Backend, numel, padding, reduce_dtype):
    """The gather over the world (hybrid: keeping the op group's rows) whose backward all-reduces the op
    group's rows of the gradient, unpadded, over the world and keeps this rank's padded slice: exactly the
    tensor plain data parallel all-reduces, so the result is bit-identical to stage 0's."""
    world, select = backend.world, backend._rows_select()
    bprop = _sum_then_slice_bprop(backend, numel, padding, reduce_dtype, select)
    return make_shard_gather(backend, world.world_group, numel, padding, reduce_dtype, select, bprop)


def _sum_then_slice_bprop(backend: Backend, numel, padding, reduce_dtype, select):
    """The backward of :func:`_sum_then_slice_gather` (``select``: the op group's rows of a world gather's
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
        return (_as_shard_dtype(own_shard(total(grad), padding, op_rank, op_size), x),)

    return bprop


def _reduce_scatter_bprop(reduce_scatter, dp_sum, reduce_dtype, select, rows):
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
        return (_as_shard_dtype(grad, x),)

    return bprop


def _gradient_attrs(backend: Backend, numel, padding, reduce_dtype) -> dict:
    """The attributes that tell one parameter's gradient primitive from another's (MindSpore caches a
    primitive's gradient by name and attributes; see :func:`mindzero.comm.shard_gather.make_shard_gather`)."""
    attrs = {"mindzero_numel": int(numel), "mindzero_padding": int(padding), "mindzero_backend": backend.name,
             "mindzero_op_ranks": str(backend.world.op_ranks)}
    if reduce_dtype is not None:
        attrs["mindzero_reduce_dtype"] = str(reduce_dtype)
    return attrs


def _as_shard_dtype(grad, shard):
    """A gradient reduced in 16 bits for an fp32 shard (``reduce_dtype`` without ``param_dtype``) widened back
    after the collective: every read of a tied parameter then adds gradients of one dtype. (A wider reduction
    of a ``param_dtype`` shard stays wide: the fp32 masters take it.)"""
    if shard.dtype == ms.float32 and grad.dtype != ms.float32:
        return ops.cast(grad, ms.float32)
    return grad


def _substitute(kind: str, world: World, ranks: tuple):
    """A CPU-legal graph-mode function with the semantics of ``kind`` over the group of world ``ranks``:
    every rank's tensor by one world all-gather, the group's rows taken in group order, summed in that order."""
    gather, take = ops.AllGather(world.world_group), ops.Gather()
    rows, size, index = world.world_size, len(ranks), ranks.index(world.world_rank)
    members = Tensor(list(ranks), ms.int32)

    def of_group(x):  # (size, x.size): every member's x, in group order
        return take(gather(x.reshape((-1,))).reshape((rows, -1)), members, 0)

    def total(parts):
        acc = parts[0]
        for k in range(1, size):
            acc = acc + parts[k]
        return acc

    def all_gather(x):
        if x.dtype == ms.int8:  # no int8 all-gather on CPU: the same bytes travel as int32 words
            words = of_group(bytes_to_words(ops.cast(x, ms.int32))).reshape((-1,))
            return ops.cast(words_to_bytes(words), ms.int8)
        return of_group(x).reshape((-1,))

    def all_reduce(x):
        return total(of_group(x)).reshape(x.shape)

    def reduce_scatter(x):
        return total(of_group(x)).reshape((size, -1))[index]

    return {"all_gather": all_gather, "all_reduce": all_reduce, "reduce_scatter": reduce_scatter}[kind]


# --- the Cells the backends return --------------------------------------------------------------------------
class _Identity(nn.Cell):
    def construct(self, x):
        return x


class _GatherRows(nn.Cell):
    """A world all-gather, then the rows of ``select`` (world ranks) in order."""

    def __init__(self, gather, rows, select):
        super().__init__(auto_prefix=False)
        self.gather, self.rows, self.select, self.take = gather, rows, select, ops.Gather()

    def construct(self, x):
        y = self.gather(x)
        return self.take(y.reshape((self.rows, -1)), self.select, 0).reshape((-1,))


class _SlotSum(nn.Cell):
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


class _SumThenSlice(nn.Cell):
    """``(x, padding)``: the sum over the world of the unpadded ``x`` (``total``; none in a world of one),
    then this rank's padded slice. One instance serves every tensor (graph mode specializes it per shape)."""

    def __init__(self, total, op_rank, op_size):
        super().__init__(auto_prefix=False)
        self.total, self.has_total, self.op_rank, self.op_size = total, total is not None, op_rank, op_size

    def construct(self, x, padding):
        if self.has_total:
            x = self.total(x)
        return own_shard(x, padding, self.op_rank, self.op_size)


class _PadThenReduceScatter(nn.Cell):
    """``(x, padding)``: ``x`` zero-padded, reduce-scattered over the op group, then (hybrid) summed over
    the dp group."""

    def __init__(self, reduce_scatter, dp_sum):
        super().__init__(auto_prefix=False)
        self.reduce_scatter, self.dp_sum, self.has_dp = reduce_scatter, dp_sum, dp_sum is not None

    def construct(self, x, padding):
        y = self.reduce_scatter(own_shard(x, padding, 0, 1))
        if self.has_dp:
            y = self.dp_sum(y)
        return y


class _FusedSumThenSlice(nn.Cell):
    """A bucket: the unpadded tensors concatenated, one sum over the world (none in a world of one), then
    this rank's padded slice of each."""

    def __init__(self, total, op_rank, op_size):
        super().__init__(auto_prefix=False)
        self.single = _SumThenSlice(total, op_rank, op_size)
        self.total, self.has_total, self.op_rank, self.op_size = total, total is not None, op_rank, op_size

    def construct(self, tensors, bucket):
        numels, paddings, shard_sizes, offsets = bucket
        if len(tensors) == 1:
            return (self.single(tensors[0].reshape((-1,)), paddings[0]),)
        flat = flat_concat(tensors)
        if self.has_total:
            flat = self.total(flat)
        return MAP(ops.partial(own_part, flat, self.op_rank, self.op_size), offsets, numels, paddings)


class _FusedRowsReduceScatter(nn.Cell):
    """A bucket in one ``ReduceScatter``: every tensor zero-padded and laid out as ``(G, shard_i)``, the rows
    concatenated per rank, so one reduce-scatter hands each rank its shard of every tensor (then, hybrid,
    one all-reduce over the dp group)."""

    def __init__(self, reduce_scatter, dp_sum, op_size, single):
        super().__init__(auto_prefix=False)
        self.reduce_scatter, self.dp_sum, self.has_dp, self.op_size = reduce_scatter, dp_sum, dp_sum is not None, op_size
        self.single = single

    def construct(self, tensors, bucket):
        numels, paddings, shard_sizes, offsets = bucket
        if len(tensors) == 1:
            return (self.single(tensors[0].reshape((-1,)), paddings[0]),)
        rows = MAP(ops.partial(as_rows, self.op_size), tensors, paddings)
        mine = self.reduce_scatter(ops.concat(rows, 1).reshape((-1,)))
        if self.has_dp:
            mine = self.dp_sum(mine)
        return ops.split(mine, shard_sizes)
