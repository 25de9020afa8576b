"""Which parameters an optimizer updates element by element: decided from the optimizer itself, not from a list.

[Note: the element-wise probe] A parameter can be sharded flat (:data:`~mindzero.core.optim_plan.FLAT`) when the
optimizer's update of each of its elements reads that element alone (its value, gradient and states) and
per-parameter or global hyper-parameters. mindzero decides it per parameter, at ``prepare_train_network``:

1. **Structure.** Every state of the parameter must be shaped as the parameter (moments, accumulators) or hold
   one value (a step count, ASGD's ``eta``). A state of another shape (AdaFactor's and CAME's factored rows and
   columns, a stand-in such as mindone Muon's empty ``exp_avg_sq`` of its matrices) makes it an owner-mode
   parameter (:data:`~mindzero.core.optim_plan.OWNER`) at once, and every other parameter of that optimizer too:
   an update that is not element-wise for some shapes may reduce over the whole tensor for others under conditions
   a probe does not reach (AdaFactor scales every update by its RMS over the tensor once that exceeds a threshold,
   its vectors included).
2. **Probe.** The optimizer's own update runs on a small probe of the parameter (:func:`probe_shape`: the same
   number of dimensions, each dimension's remainder by 32; its dtype; its states started at the values the
   optimizer gave them) twice: whole, and cut into three flat
   padded pieces as sharding cuts it, each piece a 1D parameter of its own, for three steps of random gradients
   spanning four orders of magnitude within a step and, from step to step, growing a hundredfold at one end of the
   tensor and shrinking as much at the other (so that clips, norms and trust ratios over the tensor cross their
   thresholds, and see other statistics in a piece than in the whole). It runs through a *view*
   of the user's optimizer (:func:`optimizer_view`: the same class, hyper-parameters, parameter group and
   per-parameter entries, with copies of its step counters and learning rates, so the user's optimizer does not
   move). Flat when the pieces, joined, equal the whole (values and every state; a one-value state equal in every
   piece) within :data:`RTOL` relative; else owner mode. A probe that fails to build, compile or run decides
   owner mode too: owner mode is exact for any optimizer, flat only for element-wise ones.

Why a tolerance and not bit equality: MindSpore's CPU kernels compute most elements several at a time with fused
multiply-adds and the last few of a tensor (or of a thread's block) one at a time without, so an element can
round its last bit differently when it sits at another place of a shorter tensor (``mindspore.experimental.optim.Adam``
does, by 1 ulp; ``nn.Adam`` at thread boundaries). That is rounding, not a
dependence on other elements, which changes values by far more (a norm or a mean over the piece instead of the
tensor); a flat parameter then trains within a few ulps of plain data parallel, not always bit for bit.

Parameters with the same probe signature (dimensions, dtype, state layouts, per-parameter entries, group) share
one probe; all probes of one optimizer, whole and in pieces, run as entries of one view, so a prepare compiles one
small graph.

What a probe cannot prove: that an update it saw element-wise stays so for values or sizes it did not try (a
threshold its data never crossed, a rule on a tensor's element count). What it rules out: an update that reduces
over the tensor whenever its data crosses a threshold within a hundredfold of the gradients' typical size, and
(by the structure rule) any optimizer that factors or drops a state for some shapes.
:func:`register_elementwise_optimizer` overrides both, for a class, both ways.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn

from ..core.offload import SPLITTABLE_OPTIMIZERS
from ..core.optim_plan import AUTO, ELEMENT, EVERY_OWNER, FLAT, OTHER, OWNER, WHOLE, MeasuredModel, Update
from .compile_cache import without_process_cache
from .materialize import is_lazy, np_dtype
from .optim import OPTIMIZER_BASES, OptimizerLayout, family, qualified_name

logger = logging.getLogger("mindzero")

PIECES = 3  # the probe's shards (an odd count: the last piece padded)
RTOL = 1e-5  # how far a piece's element may round from the whole's (see the module note)
STEPS = 3
_REGISTERED = {}  # optimizer class -> True (flat) / False (owner mode)
PROBE_DIM = 32


def register_elementwise_optimizer(cls, elementwise: bool = True) -> None:
    """Declare how stages 1-3 shard an optimizer class (and its subclasses), instead of the probe (see the module
    note): ``elementwise=True``: every parameter whose states are shaped as it is sharded flat (a state of another
    shape is an error at prepare); ``False``: every sharded parameter is updated whole on its owner rank."""
    if not (isinstance(cls, type) and issubclass(cls, OPTIMIZER_BASES)):
        raise TypeError(f"cls must be a subclass of mindspore.nn.Optimizer or mindspore.experimental.optim.Optimizer "
                        f"(mint.optim's base), got {cls!r}")
    if not isinstance(elementwise, bool):
        raise TypeError(f"elementwise must be a bool, got {elementwise!r}")
    _REGISTERED[cls] = elementwise


def registered(cls):
    """The registration of ``cls`` or of its nearest registered base, else ``None``."""
    for base in cls.__mro__:
        if base in _REGISTERED:
            return _REGISTERED[base]
    return None


def decide_modes(layout: OptimizerLayout, specs, shard: bool, sharding: str = AUTO) -> list:
    """``[(mode, why, states)]`` per optimizer parameter, before owners are assigned: :data:`WHOLE` where the
    stage does not shard (``shard`` False, or the plan keeps the parameter whole), else :data:`FLAT` or
    :data:`OWNER` (see the module note; ``sharding``: ``update_sharding``, :data:`EVERY_OWNER` makes every shared-out
    parameter owner mode); ``states``: its :class:`~mindzero.core.optim_plan.StateSpec`.

    Raises:
        ValueError: a class registered element-wise whose parameter has a state of another shape.
    """
    shapes = [tuple(s.shape) for s in specs]
    states = [layout.state_specs(i, shapes) for i in range(layout.n)]
    cls = type(layout.optimizer)
    forced = registered(cls)
    # a state of another shape for some parameter: the optimizer updates those from more than one element, so no
    # parameter of it is taken as element-wise on a probe's word (the same update may reduce over the whole
    # tensor for other shapes too, under conditions a probe does not reach)
    factored = next(((specs[i].name, s) for i in range(len(specs)) for s in states[i] if s.layout == OTHER), None)
    out, probed = [], []
    for i, spec in enumerate(specs):
        other = [s for s in states[i] if s.layout == OTHER]
        if not shard or not spec.sharded:
            out.append((WHOLE, "", states[i]))
        elif forced is False:
            out.append((OWNER, f"{cls.__name__} is registered as not element-wise", states[i]))
        elif sharding == EVERY_OWNER:
            out.append((OWNER, f"update_sharding={EVERY_OWNER!r}", states[i]))
        elif other:
            if forced:
                raise ValueError(f"optimizer {cls.__name__} is registered element-wise, but its state "
                                 f"{other[0].attr!r} of parameter {spec.name!r} has shape {other[0].shape}, not the "
                                 f"parameter's {tuple(spec.shape)}: it cannot be sharded flat; register it with "
                                 "elementwise=False or not at all")
            out.append((OWNER, f"its state {other[0].attr!r} has shape {other[0].shape}, not the parameter's "
                               f"{tuple(spec.shape)}", states[i]))
        elif forced:
            out.append((FLAT, "", states[i]))
        elif factored is not None:
            name, state = factored
            out.append((OWNER, f"{cls.__name__} keeps its state {state.attr!r} of {name!r} in shape {state.shape}: "
                               "not element-wise for every shape", states[i]))
        else:
            out.append(None)
            probed.append(i)
    if probed:
        verdicts = probe(layout, probed, shapes)
        for i in probed:
            flat, why = verdicts[i]
            out[i] = (FLAT if flat else OWNER, why, states[i])
    return out


def measured_model(layout: OptimizerLayout, specs) -> MeasuredModel:
    """What ``layout``'s optimizer keeps per parameter and how it updates each (:func:`decide_modes` as if every
    parameter were sharded): the model ``mindzero-plan``'s estimates use for this very optimizer. ``specs``: the
    optimizer's parameters' plan entries (their full shapes)."""
    sharded = [dataclasses.replace(s, sharded=True, reason="") for s in specs]
    decided = decide_modes(layout, sharded, True)
    return MeasuredModel({s.name: (mode == FLAT, states) for s, (mode, _, states) in zip(specs, decided)},
                         type(layout.optimizer).__name__,
                         qualified_name(type(layout.optimizer)) in SPLITTABLE_OPTIMIZERS)


def with_owners(decided, owners) -> tuple:
    """The :class:`~mindzero.core.optim_plan.Update` of each parameter: ``decided`` (:func:`decide_modes`) with the
    owner-mode parameters' ``owners`` (one per owner-mode parameter, in order)."""
    owners = iter(owners)
    return tuple(Update(mode, next(owners) if mode == OWNER else None, why, states)
                 for mode, why, states in decided)


# --- the probe ----------------------------------------------------------------------------------------------
def probe_shape(shape) -> tuple:
    """A small shape like ``shape``: every dimension of at most :data:`PROBE_DIM` elements as it is, a larger one
    ``PROBE_DIM + d % PROBE_DIM`` (at most twice it): the same number of dimensions, and each dimension's remainder
    by 2, 4, ..., 32 (an update may branch on them: MindSpore's gradient centralization applies where the second
    dimension is a multiple of 16)."""
    return tuple(d if d <= PROBE_DIM else PROBE_DIM + d % PROBE_DIM for d in shape)


def signature(layout: OptimizerLayout, index: int, shapes) -> tuple:
    """What a probe of parameter ``index`` depends on beyond its values: parameters with equal signatures share
    one probe."""
    opt = layout.optimizer
    entries = []
    for attr in layout.per_parameter:
        value = getattr(opt, attr)[index]
        entries.append((attr, value if isinstance(value, (bool, int, float, str, type(None))) else id(value)))
    states = tuple((s.attr, s.layout, str(s.dtype)) for s in layout.state_specs(index, shapes))
    return (len(shapes[index]), str(layout.params[index].dtype), states, tuple(entries), layout.group_of(index))


_VERDICTS = {}  # (the optimizer's hyper-parameters, a representative's key) -> (flat, why), for this process


def probe(layout: OptimizerLayout, indices, shapes) -> dict:
    """``{index: (flat, why)}`` for the parameters ``indices`` (module note), one probe per signature. A verdict is
    kept for the process: a later prepare of an optimizer with the same hyper-parameters and parameters alike (a
    training script that prepares again, a test launch's many runs) reuses it instead of compiling the probe again."""
    reps, of = {}, {}
    for i in indices:
        key = signature(layout, i, shapes)
        reps.setdefault(key, i)
        of[i] = reps[key]
    chosen = sorted(reps.values())
    context = layout.hyper_parameters()
    keys = {i: (context, _probe_key(layout, i, shapes)) for i in chosen}
    if not all(k in _VERDICTS for k in keys.values()):
        try:
            found = _run_probe(layout, chosen, shapes)
        except Exception as err:  # noqa: BLE001 - any failure means: not shown element-wise; owner mode is exact
            logger.info("mindzero: the element-wise probe of %s failed (%s: %s); its parameters are owned whole",
                        type(layout.optimizer).__name__, type(err).__name__, err)
            reason = f"the element-wise probe could not run ({type(err).__name__}: {_what_failed(err)})"
            found = {i: (False, reason) for i in chosen}
        _VERDICTS.update({keys[i]: found[i] for i in chosen})
    return {i: _VERDICTS[keys[of[i]]] for i in indices}


def _probe_key(layout: OptimizerLayout, index: int, shapes) -> tuple:
    """What a probe of parameter ``index`` depends on beside the optimizer's hyper-parameters: its probe shape and
    dtype, its states' layouts, dtypes and starting values, its per-parameter entries and its group."""
    opt = layout.optimizer
    states = tuple((s.attr, s.layout, s.dtype, float(_first_value(layout.states[s.attr][index])))
                   for s in layout.state_specs(index, shapes))
    entries = tuple(layout.describe(getattr(opt, attr)[index]) for attr in layout.per_parameter)
    return (probe_shape(shapes[index]), str(layout.params[index].dtype), states, entries, layout.group_of(index))


def _what_failed(err) -> str:
    """The line of ``err`` that says what failed (MindSpore's graph errors open with a banner)."""
    lines = [line.strip() for line in str(err).splitlines()]
    lines = [line for line in lines if line and not set(line) <= {"-"} and not line.startswith("- ")]
    named = [line for line in lines if "Unsupported op" in line]
    return ((named or lines or [""])[0])[:160]


def _first_value(state):
    """The value the optimizer gave ``state`` (its first element: states start uniform), without materialising a
    lazy one."""
    if is_lazy(state):
        from mindspore.common.initializer import initializer

        return initializer(state.init_mode.init, [1], state.dtype).init_data().asnumpy().reshape(-1)[0]
    return state.flatten()[:1].asnumpy()[0]


class _Probe:
    """The probe's data for the representative parameters: per representative its shape and the initial values of
    its parameter, states and gradients (numpy), whole and as pieces."""

    def __init__(self, layout: OptimizerLayout, chosen, shapes):
        rng = np.random.RandomState(20261126)
        self.layout, self.chosen = layout, list(chosen)
        self.shapes = [probe_shape(shapes[i]) for i in self.chosen]
        self.params, self.states, self.grads = [], {a: [] for a in layout.states}, []
        for i, shape in zip(self.chosen, self.shapes):
            dtype = np_dtype(layout.params[i].dtype)
            self.params.append(np.asarray(rng.randn(*shape) * 0.5, dtype))
            # magnitudes spread over four orders within a step, and from step to step growing a hundredfold at
            # one end of the flat parameter and shrinking as much at the other: an update clipped or scaled by a
            # statistic of the whole tensor (an RMS, a norm, a trust ratio) crosses its threshold, and the pieces
            # see different statistics than the whole
            along = np.linspace(-1.0, 1.0, int(np.prod(shape)) or 1).reshape(shape)
            self.grads.append([np.asarray(rng.randn(*shape) * 10.0 ** (rng.uniform(-2, 2, shape) + 2 * step * along),
                                          dtype) for step in range(STEPS)])
            for attr, states in layout.states.items():
                s = states[i]
                fill = _first_value(s)
                like = shape if tuple(s.shape) == tuple(shapes[i]) else tuple(s.shape)
                self.states[attr].append(np.full(like, fill, np_dtype(s.dtype)))

    def piece(self, array, k: int, r: int) -> np.ndarray:
        """Piece ``r`` of representative ``k``'s ``array`` (flat, zero-padded), or a one-value array as it is."""
        if array.shape != tuple(self.shapes[k]):
            return array.copy()
        flat = array.reshape(-1)
        size = -(-flat.size // PIECES)
        out = np.zeros(size, array.dtype)
        part = flat[r * size:(r + 1) * size]
        out[:part.size] = part
        return out


def _run_probe(layout: OptimizerLayout, chosen, shapes) -> dict:
    """One view holds each representative four times, whole and as its three pieces (independent entries of the
    optimizer's per-parameter map), so one graph compiles; :data:`STEPS` calls of it."""
    data = _Probe(layout, chosen, shapes)
    attrs = list(layout.states)
    copies = [None, *range(PIECES)]  # whole, then the pieces

    def value(array, k, piece):
        return array.copy() if piece is None else data.piece(array, k, piece)

    entries = [(k, piece) for k in range(len(data.chosen)) for piece in copies]
    params = [Parameter(Tensor(value(data.params[k], k, piece)), name=f"zero_probe.{k}.{piece}")
              for k, piece in entries]
    states = {attr: [Parameter(Tensor(value(data.states[attr][k], k, piece)),
                               name=f"zero_probe_state.{attr}.{k}.{piece}", requires_grad=False)
                     for k, piece in entries] for attr in attrs}
    view = optimizer_view(layout, [data.chosen[k] for k, _ in entries], params, states)
    with without_process_cache():
        for step in range(STEPS):
            view(tuple(Tensor(value(data.grads[k][step], k, piece)) for k, piece in entries))
    got = {(k, piece): (params[e].asnumpy(), {a: states[a][e].asnumpy() for a in attrs})
           for e, (k, piece) in enumerate(entries)}
    verdicts = {}
    for k, i in enumerate(data.chosen):
        numel = int(np.prod(data.shapes[k]))
        whole_param, whole_states = got[(k, None)]
        pieces = [got[(k, r)] for r in range(PIECES)]
        pairs = [("", np.concatenate([p[0].reshape(-1) for p in pieces])[:numel], whole_param.reshape(-1))]
        for attr in attrs:
            whole = whole_states[attr]
            if whole.shape == tuple(data.shapes[k]):
                pairs.append((attr, np.concatenate([p[1][attr].reshape(-1) for p in pieces])[:numel],
                              whole.reshape(-1)))
            else:
                pairs += [(attr, p[1][attr], whole) for p in pieces]
        bad = [attr for attr, a, b in pairs if not _close(a, b)]
        if bad:
            what = f"its state {bad[0]!r}" if bad[0] else "its update"
            verdicts[i] = (False, f"{what} differs when the parameter is cut into pieces (the element-wise probe)")
        elif all(np.array_equal(a, b, equal_nan=True) for _, a, b in pairs):
            verdicts[i] = (True, "")
        else:
            verdicts[i] = (True, f"element-wise within the kernels' rounding ({RTOL:g} relative)")
    return verdicts


def _close(a, b) -> bool:
    """Equal within :data:`RTOL` of the larger magnitude, NaN where the other is NaN."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return False
    both_nan = np.isnan(a) & np.isnan(b)
    close = np.abs(a - b) <= RTOL * np.maximum(np.abs(a), np.abs(b))
    return bool(np.all(close | both_nan | (a == b)))


# --- the view ------------------------------------------------------------------------------------------------
def optimizer_view(layout: OptimizerLayout, indices, params, states: dict, share_scalars: bool = False):
    """A Cell applying the user's optimizer to ``params`` (standing for its parameters ``indices``, in order) with
    ``states`` (``{attr: [Parameter per entry of indices]}``): the same class and hyper-parameters, every
    per-parameter entry cut to ``indices``, a torch-style optimizer's parameter groups cut to those holding them.

    The shared scalars (step counters, learning rates, beta powers) are copies (``share_scalars=False``: the
    user's optimizer does not move), or the optimizer's own Parameters (disk offload, which restores them before
    each piece: each call advances them once).
    """
    opt, indices = layout.optimizer, list(indices)
    cls = type(opt)
    view = cls.__new__(cls)
    nn.Cell.__init__(view, auto_prefix=False)
    internal = set(vars(view))
    scalars = dict(layout.scalars) if share_scalars else {
        key: Parameter(Tensor(p.asnumpy().copy(), p.dtype), name=p.name, requires_grad=False)
        for key, p in layout.scalars.items()}
    remap = {id(old): new for old, new in zip(layout.scalars.values(), scalars.values())}

    def mapped(value):
        if isinstance(value, Parameter):
            return remap.get(id(value), value)
        if isinstance(value, ParameterTuple):
            return ParameterTuple([mapped(v) for v in value])
        if isinstance(value, (list, tuple)) and not isinstance(value, nn.CellList):
            return type(value)(mapped(v) for v in value) if isinstance(value, tuple) else [mapped(v) for v in value]
        if isinstance(value, dict):
            return {k: mapped(v) for k, v in value.items()}
        return value

    for key, value in vars(opt).items():
        if key in internal:
            continue
        if key in layout.aliases:
            value = ParameterTuple(params)
        elif key in layout.states:
            value = ParameterTuple(states[key])
        elif key in layout.per_parameter:
            value = _cut(value, indices, mapped)
        else:
            value = mapped(value)
        object.__setattr__(view, key, value)
    if hasattr(view, "param_length"):
        object.__setattr__(view, "param_length", len(indices))
    registry = view._params  # pylint: disable=protected-access
    for key, p in scalars.items():
        registry[key] = p
    for p in (*params, *(s for group in states.values() for s in group)):
        registry[p.name] = p
    for key, cell in opt._cells.items():  # pylint: disable=protected-access
        view._cells[key] = cell  # pylint: disable=protected-access
    if family(opt) == "torch":
        _cut_groups(view, layout, indices, params, states, mapped)
    return view


def _cut(value, indices, mapped):
    """``value``'s entries at ``indices``, in its own kind of sequence."""
    picked = [mapped(value[i]) for i in indices]
    if isinstance(value, ParameterTuple):
        return ParameterTuple(picked)
    if isinstance(value, nn.CellList):
        return nn.CellList(picked, auto_prefix=False)
    return tuple(picked) if isinstance(value, tuple) else picked


def _cut_groups(view, layout, indices, params, states, mapped) -> None:
    """A torch-style view's ``param_groups``, ``group_start_id`` and ``lrs``: the groups holding ``indices``, each
    with its parameters (and per-group states) of the view."""
    opt = layout.optimizer
    groups, starts, lrs = [], [0], []
    for g, group in enumerate(opt.param_groups):
        members = [k for k, i in enumerate(indices) if layout.group_of(i) == g]
        if not members:
            continue
        entry = {key: mapped(v) for key, v in group.items() if key != "params" and key not in states}
        entry["params"] = [params[k] for k in members]
        for key in states:
            if key in group:
                entry[key] = ParameterTuple([states[key][k] for k in members])
        groups.append(entry)
        starts.append(starts[-1] + len(members))
        lrs.append(mapped(opt.lrs[g]))
    object.__setattr__(view, "param_groups", groups)
    object.__setattr__(view, "group_start_id", starts)
    object.__setattr__(view, "lrs", lrs)
