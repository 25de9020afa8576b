"""Shard Parameters, and stage-3 access to full parameters from any Cell.

Stage 3 technique (works for Cells nobody registered): for every Cell that
owns a sharded Parameter under attribute ``w``, the Parameter is removed from
the Cell, its shard is stored as ``w_zero_shard`` (keeping the parameter's
original name), and a Python ``property`` named ``w`` is installed on a
subclass of the Cell's class (one per class and set of sharded attributes;
``cell.__class__ = ...``). The property returns
``self._zero_gather_w.rebuild(self.w_zero_shard)``: the Cell's own
``construct`` reads ``self.w`` unchanged and MindSpore's graph mode parses the
property. :class:`GatherFull` all-gathers with a primitive whose gradient is
mindzero's reduce-scatter (:class:`mindzero.comm.shard_gather.ShardGather`), so the
gradient w.r.t. a shard arrives already summed over the world.

A Parameter shared by several Cells (tied weights) gets one shard, read through
the ``GatherFull`` of each reading Cell's dtype; the gradients of the reads add up.

With ``gather_units`` (:mod:`mindzero.core.units`), the members of a unit read their columns of the unit's
one all-gather (:class:`mindzero.comm.shard_gather.UnitGather`: the reads' identical gathers merge into one
in graph mode) and take their gradients through a port each: the exact gather's reduction, per parameter.

Warning: outside ``construct`` reading ``cell.w`` of a stage-3 network runs an
all-gather, so it must be done on all ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import mindspore as ms
from mindspore import nn, ops

from ..comm.backends import backend_of
from ..comm.cells import ReduceScatterSum, shard_gather
from ..core.config import dtype_name
from ..core.plan import ShardSpec
from ..core.quant import block_for
from ..core.topology import World
from ..core.units import Read, weight_gathers
from .materialize import make_shard

SHARD_SUFFIX = "_zero_shard"
GATHER_PREFIX = "_zero_gather_"


class GatherFull(nn.Cell):
    """The full parameter from its shard: :class:`mindzero.comm.shard_gather.ShardGather` (all-gather forward,
    reduce-scatter backward), then (hybrid on CPU) this op group's rows, the padding dropped, the full
    shape, the reading Cell's compute dtype.

    In graph mode the stage-3 property calls :meth:`rebuild` (a method: inlined like a function), never
    the Cell itself (see :mod:`mindzero.comm.shard_gather` for why). PyNative, which does not use the
    primitive's registered gradient, calls the Cell: its ``bprop`` is the same reduce-scatter. One
    instance serves every parameter of the same full shape, dtype and reading dtype.

    Each step of the rebuild (how the flat values arrive, whether padding is dropped, whether they are cast) is
    a small Cell chosen here, when the gather is built, so :meth:`rebuild` is straight-line code: graph mode
    parses a few graphs per parameter read instead of a branch and a continuation graph for every decision.

    Communication: forward AllGather of ``shard_size`` elements per rank; backward ReduceScatter
    (CPU: AllReduce of ``numel`` elements + slice).
    """

    def __init__(self, spec: ShardSpec, world: World, compute_dtype=None, reduce_dtype=None, quant_block=None):
        super().__init__(auto_prefix=False)
        self.quantized = False
        if quant_block is not None:  # gather_quantization: int8 values and fp32 block scales on the wire
            self.qgather = backend_of(world).quantized_gather(spec.numel, spec.padding, spec.shard_size, quant_block,
                                                              reduce_dtype)
            self.quantized = self.qgather is not None
        gather, select = shard_gather(world, spec.numel, spec.padding, reduce_dtype)
        if self.quantized:
            self.arrive = _Quantized(self.qgather)
        elif gather is None:
            self.arrive = _Local()
        else:
            self.arrive = _Gathered(gather) if select is None else _GatheredRows(gather, select, world.world_size)
        self.unpad = _Unpad(spec.numel) if spec.padding else _Local()
        self.shape = tuple(spec.shape)
        self.reshape = ops.Reshape()
        dtype = getattr(ms, dtype_name(spec.dtype))
        self.to_dtype = _Cast(compute_dtype) if compute_dtype is not None and compute_dtype != dtype else _Local()
        self.reduce_dtype = None if reduce_dtype is None else getattr(ms, reduce_dtype)
        self.padding = spec.padding
        self.reduce_scatter = ReduceScatterSum(world)

    def join_unit(self, unit, offset: int, shard_size: int, port):
        """Read this parameter as columns ``[offset, offset + shard_size)`` of ``unit``'s gather
        (:class:`~mindzero.comm.shard_gather.UnitGather`); ``port``: its gradient's way in, ``None`` for a frozen
        parameter."""
        self.arrive = _UnitColumns(unit, offset, shard_size) if port is None else \
            _UnitColumnsPort(unit, offset, shard_size, port)

    @staticmethod
    def key(spec: ShardSpec, compute_dtype=None, quant_block=None) -> tuple:
        """Parameters with equal keys can share one instance."""
        return tuple(spec.shape), spec.padding, spec.dtype, compute_dtype, quant_block

    def regather(self):
        """Recompute the gather chain in backward instead of keeping the full value from forward (quantized:
        the collective and the decode; the payload is kept from forward, so each shard is quantized once)."""
        for prim in [self.reshape, *self.arrive.regather(), *self.unpad.prims(), *self.to_dtype.prims()]:
            prim.recompute()

    def rebuild(self, shard):
        return self.to_dtype(self.reshape(self.unpad(self.arrive(shard)), self.shape))

    def construct(self, shard):
        return self.rebuild(shard)

    def bprop(self, shard, out, dout):  # PyNative (see the class note)
        dtype = shard.dtype if self.reduce_dtype is None else self.reduce_dtype
        grad = self.reduce_scatter(ops.cast(dout, dtype).reshape((-1,)), self.padding)
        if shard.dtype == ms.float32 and grad.dtype != ms.float32:  # 16-bit reduction of an fp32 parameter
            grad = ops.cast(grad, ms.float32)
        return (grad,)


# --- the steps of GatherFull.rebuild, one small Cell per choice --------------------------------------------
class _Local(nn.Cell):
    """The values as they are: a shard that is the whole parameter (an op group of one rank), no padding to
    drop, no cast."""

    def regather(self):
        return []

    def prims(self):
        return []

    def construct(self, values):
        return values


class _Gathered(nn.Cell):
    """Every rank's shard, flat: the gather primitive (its gradient is the exact reduction)."""

    def __init__(self, gather):
        super().__init__(auto_prefix=False)
        self.gather = gather

    def regather(self):
        return [self.gather]

    def construct(self, shard):
        return self.gather(shard)


class _GatheredRows(nn.Cell):
    """A world gather that keeps this rank's op group's rows (hybrid sharding on CPU), flat."""

    def __init__(self, gather, select, rows: int):
        super().__init__(auto_prefix=False)
        self.gather, self.select, self.rows = gather, select, rows
        self.take, self.reshape = ops.Gather(), ops.Reshape()

    def regather(self):
        return [self.gather, self.take, self.reshape]

    def construct(self, shard):
        return self.reshape(self.take(self.reshape(self.gather(shard), (self.rows, -1)), self.select, 0), (-1,))


class _Quantized(nn.Cell):
    """The quantized gather's decoded rows, flat (:class:`mindzero.comm.quantize.QuantizedGather`)."""

    def __init__(self, qgather):
        super().__init__(auto_prefix=False)
        self.qgather, self.reshape = qgather, ops.Reshape()

    def regather(self):
        self.qgather.regather()
        return [self.reshape]

    def construct(self, shard):
        return self.reshape(self.qgather.rows_of(self.qgather.payload(shard), shard), (-1,))


class _UnitColumns(nn.Cell):
    """This parameter's columns of its unit's one gather, flat; a frozen parameter (no gradient to return)."""

    def __init__(self, unit, offset: int, shard_size: int):
        super().__init__(auto_prefix=False)
        self.unit, self.offset, self.end = unit, offset, offset + shard_size
        self.columns, self.reshape = ops.StridedSlice(), ops.Reshape()

    def regather(self):
        self.unit.regather()
        return [self.columns, self.reshape]

    def construct(self, shard):
        return self.reshape(self.columns(self.unit.matrix(), (0, self.offset), (self.unit.kept, self.end), (1, 1)),
                            (-1,))


class _UnitColumnsPort(_UnitColumns):
    """:class:`_UnitColumns` whose gradient enters the shard at its port (the exact gather's reduction)."""

    def __init__(self, unit, offset: int, shard_size: int, port):
        super().__init__(unit, offset, shard_size)
        self.port = port

    def regather(self):
        return super().regather() + self.port.prims()

    def construct(self, shard):
        columns = self.columns(self.unit.matrix(), (0, self.offset), (self.unit.kept, self.end), (1, 1))
        return self.reshape(self.port.attach(columns, shard), (-1,))


class _Unpad(nn.Cell):
    """The first ``numel`` values: the padding of the last shard dropped."""

    def __init__(self, numel: int):
        super().__init__(auto_prefix=False)
        self.numel, self.slice = numel, ops.StridedSlice()

    def prims(self):
        return [self.slice]

    def construct(self, values):
        return self.slice(values, (0,), (self.numel,), (1,))


class _Cast(nn.Cell):
    """The reading Cell's compute dtype."""

    def __init__(self, dtype):
        super().__init__(auto_prefix=False)
        self.dtype, self.cast = dtype, ops.Cast()

    def prims(self):
        return [self.cast]

    def construct(self, values):
        return self.cast(values, self.dtype)


def _full_property(attr: str, graph_mode: bool) -> property:
    gather_name = GATHER_PREFIX + attr
    shard_name = attr + SHARD_SUFFIX

    if graph_mode:
        def full(self):
            return getattr(self, gather_name).rebuild(getattr(self, shard_name))
    else:
        def full(self):
            return getattr(self, gather_name)(getattr(self, shard_name))

    full.__name__ = attr
    return _FullValue(full, doc=f"full value of {attr!r}, gathered from its shard (mindzero stage 3)")


_DESCRIBING = []  # depth of extend_repr calls of stage-3 reading Cells


class _FullValue(property):
    """The stage-3 property: graph mode parses its getter (a ``property``); read from Python it gathers, except
    while the Cell describes itself (``repr``, which MindSpore also calls when it compiles a network): then it
    is the shard this rank holds, so printing a network runs no collective (safe on one rank alone)."""

    def __get__(self, obj, objtype=None):
        if obj is not None and _DESCRIBING:
            return getattr(obj, self.fget.__name__ + SHARD_SUFFIX)
        return super().__get__(obj, objtype)


def _describe_shards(cls: type):
    def extend_repr(self):
        _DESCRIBING.append(True)
        try:
            return cls.extend_repr(self)
        finally:
            _DESCRIBING.pop()

    return extend_repr


def compute_dtype(cell: nn.Cell):
    """The dtype graph mode casts Parameters read inside ``cell`` to, or ``None``.

    In graph mode ``cell.to_float(dtype)`` casts the Parameters a Cell reads; a
    gathered tensor is not a Parameter, so :class:`GatherFull` casts it itself.
    PyNative casts only the Cell's inputs (the op then promotes), so there is no
    cast to mimic. The mode is the one in force when the network is prepared.
    ``to_float(ms.float32)`` counts: a mixed-precision run gathers ``param_dtype``
    values, which such a Cell (LayerNorm, BatchNorm) gets cast to float32.
    """
    if ms.get_context("mode") != ms.GRAPH_MODE:
        return None
    flags = cell.get_flags()
    if flags.get("fp16"):
        return ms.float16
    if flags.get("bf16"):
        return ms.bfloat16
    if flags.get("fp32"):
        return ms.float32
    return None


_SUBCLASSES = {}  # (class, attribute names, mode, property maker) -> subclass with a property per attribute


def reading_subclass(cls: type, attrs, make_property, marker: str) -> type:
    """The subclass of ``cls`` whose instances read ``attrs`` through ``make_property(attr, graph_mode)`` (stage 3's
    :func:`_full_property`), with ``marker`` set to the
    attribute names on the class.

    Shared by every instance of ``cls`` with exactly these attributes replaced (one class, not one per
    instance); an instance's class changes only if it holds replaced parameters.
    """
    key = (cls, tuple(sorted(attrs)), ms.get_context("mode") == ms.GRAPH_MODE, make_property)
    if key not in _SUBCLASSES:
        body = {attr: make_property(attr, key[2]) for attr in key[1]}
        body.update({"__module__": cls.__module__, marker: key[1], "extend_repr": _describe_shards(cls)})
        _SUBCLASSES[key] = type(cls.__name__, (cls,), body)
    return _SUBCLASSES[key]


def check_pynative_recompute(network: nn.Cell, specs: dict) -> None:
    """Refuse stage 3 in PyNative for a ``recompute()`` Cell holding sharded parameters.

    Measured: PyNative's re-entrant recompute loses the gather's custom ``bprop``
    (stage 3 then differs from stage 0 after one step); graph mode is exact.

    Raises:
        ValueError: naming the Cell.
    """
    if ms.get_context("mode") == ms.GRAPH_MODE:
        return
    for cell_name, cell in network.cells_and_names():
        if getattr(cell, "_recompute_cell", None) is None:
            continue
        held = [p.name for p in cell.get_parameters() if p.name in specs and specs[p.name].sharded]
        if held:
            raise ValueError(f"zero_stage=3 in PyNative mode does not support recompute(): Cell {cell_name!r} is "
                             f"recomputed and holds sharded parameters ({held[0]}, ...); use GRAPH_MODE "
                             "(the target), or do not call recompute() on it")


@dataclass
class ShardedNetwork:
    """What :func:`shard_network_parameters` did: ``shards`` (parameter name -> shard Parameter, one per full
    Parameter, shared by tied uses), ``digests`` (name -> CRC-32 of each full value it computed, for the
    cross-rank check) and ``gathers`` (the :class:`~mindzero.core.units.WeightGather` records it built one
    all-gather from each, which the communication plan counts)."""

    shards: dict = field(default_factory=dict)
    digests: dict = field(default_factory=dict)
    gathers: tuple = ()


def shard_network_parameters(network: nn.Cell, specs: dict, world: World, config) -> ShardedNetwork:
    """Stage 3: replace every sharded Parameter of ``network`` by its shard, in place.

    Args:
        network: the user's Cell.
        specs: parameter name -> :class:`ShardSpec`; only ``sharded`` specs are touched.
        world: the op group.
        config: the :class:`~mindzero.core.config.ZeroConfig`; read here: ``stage3``
            (:class:`~mindzero.core.config.Stage3Policy` as it runs in this mode: ``regather`` marks each
            gather's primitives for recompute, so backward all-gathers the parameter again instead of keeping
            the full value alive from forward; ``quantization``: which gathers send int8 values with fp32 block
            scales; ``units``: which parameters share one all-gather) and ``precision.reduce_in`` (the dtype the
            gathers' backward reduces gradients in).

    Raises:
        ValueError: ``gather_units`` in PyNative mode.
    """
    stage3 = config.stage3.for_mode(ms.get_context("mode") == ms.GRAPH_MODE)
    quantization, units, reduce_dtype = stage3.quantization, stage3.units, config.precision.reduce_in
    out = ShardedNetwork()

    def quant_block(name, spec):
        return block_for(quantization, name, spec.shape)

    # the record first: one gather per entry (a unit's members share theirs); an op group of one rank gathers
    # nothing, so it forms no unit
    out.gathers = weight_gathers(_reads(network, specs, quant_block), units if world.op_size > 1 else None,
                                 lambda name: quant_block(name, specs[name]))
    gather_of = {name: g for g in out.gathers for name in g.names}
    shards = out.shards
    gathers = {}  # GatherFull.key -> GatherFull, shared by every parameter with that shape and reading dtype
    members = {}  # unit WeightGather -> [(name, GatherFull)], in unit order
    for _, cell in network.cells_and_names():
        attrs = []
        for attr, param in list(cell._params.items()):
            if param is None or param.name not in specs or not specs[param.name].sharded:
                continue
            spec, record = specs[param.name], gather_of[param.name]
            if param.name not in shards:
                shards[param.name] = make_shard(param, spec, param.name, param.requires_grad, out.digests)
            dtype = compute_dtype(cell)
            key = ("unit", param.name) if record.unit else GatherFull.key(spec, dtype, record.quant_block)
            if key not in gathers:
                gathers[key] = GatherFull(spec, world, dtype, reduce_dtype, record.quant_block)
                if record.unit:
                    members.setdefault(record, []).append((param.name, gathers[key]))
            del cell._params[attr]
            cell.insert_param_to_cell(attr + SHARD_SUFFIX, shards[param.name])
            cell.insert_child_to_cell(GATHER_PREFIX + attr, gathers[key])
            attrs.append(attr)
        if attrs:
            cell.__class__ = reading_subclass(type(cell), attrs, _full_property, "_mindzero_sharded")
    backend = backend_of(world)
    for index, record in enumerate(g for g in out.gathers if g.unit):
        unit = members[record]
        gather = backend.unit_gather([shards[name] for name, _ in unit])
        for (name, reader), offset in zip(unit, gather.offsets):
            spec, shard = specs[name], shards[name]
            port = backend.gradient_port(spec.numel, spec.padding, reduce_dtype, gather.kept,
                                         f"{index}:{name}") if shard.requires_grad else None
            reader.join_unit(gather, offset, spec.shard_size, port)
    if stage3.regather:
        for reader in gathers.values():
            reader.regather()
    return out


def _reads(network: nn.Cell, specs: dict, quant_block) -> list:
    """A :class:`~mindzero.core.units.Read` per sharded parameter ``network`` reads, in its Cells' order: the
    first Cell reading it, and its kind (``None``, in no unit, where several Cells read it or it is quantized)."""
    readers, order = {}, []
    for cell_name, cell in network.cells_and_names():
        for param in cell._params.values():
            if param is None or param.name not in specs or not specs[param.name].sharded:
                continue
            if param.name not in readers:
                order.append(param.name)
            readers.setdefault(param.name, []).append(cell_name)
    reads = []
    for name in order:
        spec = specs[name]
        alone = len(readers[name]) > 1 or quant_block(name, spec) is not None  # tied, or quantized
        reads.append(Read(name, readers[name][0], spec.numel * spec.itemsize, None if alone else (spec.dtype,)))
    return reads
