"""Stage 1 without ``param_dtype``: each sharded parameter held once, as this rank's shard plus the rest.

[Note: split parameters] The ZeRO paper's stage 1 keeps an fp32 master of this rank's shard because its
parameters are fp16; in fp32 the full parameter is its own master (PyTorch's ``ZeroRedundancyOptimizer``
updates its slice of the flat parameter in place). MindSpore's optimizers update Parameters, not slices of
one, so mindzero cannot hand the optimizer a view of the full tensor. Instead the full parameter is stored in
two Parameters that together hold each element once:

* ``own`` (named like the parameter, 1D, this rank's padded shard): what the optimizer updates and what
  gradients are taken with respect to, with the other piece;
* ``rest`` (``zero_rest.<name>``, 1D, the other op ranks' shards in order): written by the all-gather
  after each update.

Every Cell that reads the parameter reads the pair through a property (the stage-3 technique,
:mod:`mindzero.engine.stage3`): :class:`SplitRead` joins ``own`` and ``rest`` by one gather with a constant row order
(:func:`mindzero.comm.layout.join_split`: the same graph on every rank, see there; its constant is the order of
``op_size`` rows, not an index per element) and reshapes, with no
communication. The joined value is not recomputed in backward (marking it lowered no peak in MindSpore 2.10 and
made a step without the write-back die with SIGSEGV), so a joined weight lives from its forward use to its
backward one, as a gathered weight does in MindSpore's own optimizer parallelism. The train step joins the two
gradients into the full gradient the same way and reduces it exactly as before, so values are bit-identical to
the master-shard layout; the persistent bytes are 4Φ (parameters) + 8Φ/N (Adam) at stage 1 instead of
4Φ + 4Φ/N + 8Φ/N.

Outside the graph a split parameter is seen whole through :class:`FullView` (checkpoints, pretrained
loading, full state dicts, the EMA's initial value): ``asnumpy`` joins, ``set_data`` splits.
"""
from __future__ import annotations

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from ..comm.layout import join_split
from ..core.checksum import crc32_array
from ..core.plan import ShardSpec, split_rows, splits_evenly
from .materialize import full_array
from .stage3 import compute_dtype, reading_subclass

SHARD_SUFFIX = "_zero_shard"
REST_SUFFIX = "_zero_rest"
READ_PREFIX = "_zero_split_"
REST_PREFIX = "zero_rest."


class SplitRead(nn.Cell):
    """The full parameter from its split pair: ``own`` put back into ``rest``, the padding dropped, the full
    shape, the reading Cell's compute dtype (graph mode casts Parameters a ``to_float`` Cell reads; a joined
    tensor is not one). One instance per shape, padding, rank offset and reading dtype."""

    def __init__(self, spec: ShardSpec, dtype=None):
        super().__init__(auto_prefix=False)
        self.order = Tensor(split_rows(spec)[0])
        self.numel = spec.numel
        self.shape = tuple(spec.shape)
        self.compute_dtype = dtype

    @staticmethod
    def key(spec: ShardSpec, dtype=None) -> tuple:
        return tuple(spec.shape), spec.padding, spec.offset, dtype

    def rebuild(self, own, rest):
        full = join_split(own, rest, self.order, self.numel).reshape(self.shape)
        if self.compute_dtype is not None and full.dtype != self.compute_dtype:
            full = ops.cast(full, self.compute_dtype)
        return full

    def construct(self, own, rest):
        return self.rebuild(own, rest)


def _split_property(attr: str, graph_mode: bool) -> property:
    read_name, own_name, rest_name = READ_PREFIX + attr, attr + SHARD_SUFFIX, attr + REST_SUFFIX

    if graph_mode:
        def full(self):
            return getattr(self, read_name).rebuild(getattr(self, own_name), getattr(self, rest_name))
    else:
        def full(self):
            return getattr(self, read_name)(getattr(self, own_name), getattr(self, rest_name))

    full.__name__ = attr
    return property(full, doc=f"full value of {attr!r}, joined from its shard and the rest (mindzero stage 1)")


def split_layout(config, world) -> bool:
    """Whether this step holds its sharded parameters split: stage 1 without ``param_dtype``, over more than one
    rank (an op group of one would split into the whole and nothing).

    Not stage 2 (it keeps the fp32 master shard): there the joined weights, alive from forward to backward,
    cost more than the master saves: stage 2 frees each gradient during backward, so its peak is set there
    (the 24-layer probe of ``tests/multirank/test_sharded_init.py`` rose above its gradient bytes), and a lazy
    build's peak rose by the rest's copy. Stage 1 keeps every full gradient to the end of backward anyway, and
    the joined weights are freed as those gradients arrive."""
    policy = config.policy
    return (policy.shard_optimizer_states and not policy.shard_gradients and not config.precision.enabled
            and world.op_size > 1)


def splittable(ps) -> bool:
    """Whether a :class:`~mindzero.core.state.ParamState` is held split: a sharded parameter whose every shard holds
    at least one element (:func:`mindzero.core.plan.splits_evenly`); a tiny one (fewer elements than ranks
    times its shard, e.g. 5 over 4 ranks) keeps the master layout."""
    return ps.sharded and splits_evenly(ps.spec)


def own_and_rest(param, spec: ShardSpec, digests=None) -> tuple:
    """``(own, rest)`` numpy arrays of ``param`` (which may be lazy: its full value is computed once, one
    tensor at a time); ``digests`` receives ``spec.name`` -> CRC-32 of the full value."""
    full = full_array(param)
    if digests is not None:
        digests[spec.name] = crc32_array(full)
    return split_array(full, spec)


def split_array(full, spec: ShardSpec) -> tuple:
    """``(own, rest)`` of a full value (any shape) per ``spec``: the numpy twin of the train step's write-back,
    by the same rows (:func:`mindzero.core.plan.split_rows`)."""
    flat = np.zeros(spec.numel + spec.padding, dtype=full.dtype)
    flat[:spec.numel] = np.ascontiguousarray(full).reshape(-1)
    rows = flat.reshape(spec.op_size, -1)
    return rows[spec.op_rank].copy(), rows[split_rows(spec)[1]].reshape(-1)


def joined_array(own, rest, spec: ShardSpec) -> np.ndarray:
    """The full value (the parameter's shape) of a split pair's arrays: the numpy twin of
    :func:`mindzero.comm.layout.join_split`, by the same rows."""
    rows = np.concatenate((own, rest)).reshape(spec.op_size, -1)
    return rows[split_rows(spec)[0]].reshape(-1)[:spec.numel].reshape(spec.shape)


def split_network_parameters(network: nn.Cell, specs: dict, names, digests: dict) -> dict:
    """Replace each parameter of ``names`` (optimized, sharded) in every Cell of ``network`` that holds it by
    its split pair, in place. Returns ``{name: (own, rest)}`` for those found in some Cell's parameters
    (a parameter held elsewhere keeps the master-shard layout)."""
    names, pairs, readers = set(names), {}, {}
    for _, cell in network.cells_and_names():
        attrs = []
        for attr, param in list(cell._params.items()):
            if param is None or param.name not in names:
                continue
            spec = specs[param.name]
            if param.name not in pairs:
                own, rest = own_and_rest(param, spec, digests)
                pairs[param.name] = (Parameter(Tensor(own, param.dtype), name=param.name,
                                               requires_grad=param.requires_grad),
                                     Parameter(Tensor(rest, param.dtype), name=REST_PREFIX + param.name,
                                               requires_grad=False))  # not trainable: the step lists it for its gradient
            dtype = compute_dtype(cell)
            key = SplitRead.key(spec, dtype)
            if key not in readers:
                readers[key] = SplitRead(spec, dtype)
            own, rest = pairs[param.name]
            del cell._params[attr]
            cell.insert_param_to_cell(attr + SHARD_SUFFIX, own)
            cell.insert_param_to_cell(attr + REST_SUFFIX, rest)
            cell.insert_child_to_cell(READ_PREFIX + attr, readers[key])
            attrs.append(attr)
        if attrs:
            cell.__class__ = reading_subclass(type(cell), attrs, _split_property, "_mindzero_split")
    return pairs


class FullView:
    """A split parameter seen whole outside the graph: ``name``, ``dtype``, ``shape`` of the full parameter;
    ``asnumpy()`` joins the pair, ``set_data(tensor)`` splits a full value into it."""

    def __init__(self, own, rest, spec: ShardSpec):
        self.own, self.rest, self.spec = own, rest, spec
        self.name, self.dtype, self.shape = spec.name, own.dtype, tuple(spec.shape)

    def asnumpy(self) -> np.ndarray:
        return joined_array(self.own.asnumpy(), self.rest.asnumpy(), self.spec)

    def set_data(self, data):
        own, rest = split_array(data.asnumpy() if hasattr(data, "asnumpy") else np.asarray(data), self.spec)
        self.own.set_data(Tensor(own, self.own.dtype))
        self.rest.set_data(Tensor(rest, self.rest.dtype))
        return self


def network_values(train_net) -> dict:
    """Each network parameter by name as checkpoints see it: the Parameter, or for a split one its
    :class:`FullView`."""
    info = train_net.zero_info
    values = {p.name: p for p in train_net.network.get_parameters()}
    for pair in info.master_pairs:
        if pair.split:
            values.pop(pair.held.name, None)
            values[pair.master.name] = FullView(pair.master, pair.held, info.plan[pair.master.name])
    return values
