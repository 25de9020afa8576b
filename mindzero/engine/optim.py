"""Re-point the user's optimizer at shard Parameters, so it updates shards exactly as it would full ones.

Why this is exact: the supported optimizers (:data:`ELEMENTWISE_OPTIMIZERS`)
update every element from that element's parameter, gradient and state alone,
with hyper-parameters (learning rate, per-group weight decay, betas, step
counters) that are per parameter or global. Applied to a flat shard they
compute the same numbers as on the full tensor. The decay filter and parameter
groups were resolved by the optimizer's own ``__init__`` from the full
parameters' names, and are kept as they are.

Two families are accepted: ``mindspore.nn.Optimizer`` (``nn.AdamWeightDecay``, ``nn.Adam``, ``nn.SGD``,
``nn.Momentum``) and the torch-style ``mindspore.experimental.optim.Optimizer`` that ``mindspore.mint.optim``
builds on (``mint.optim.Adam``, ``AdamW``, ``SGD``): the same idea, other attribute names (the parameter
tuple is ``_parameters`` in the first, ``parameters`` in the second; the second keeps per-group states such as
AMSGrad's ``max_exp_avg_sq`` in its ``param_groups``).

What changes in the optimizer, in place:

* its parameter tuple (and aliases such as ``parameters`` and ``params``) now holds, for each sharded
  parameter, a 1D shard Parameter: the network's own shard at stage 3 and at stage 1 without ``param_dtype`` (a
  split parameter, :mod:`mindzero.engine.split`), a *master shard* at stages 1-2 with it;
* every per-parameter state tuple (e.g. ``adam_m``/``adam_v``, ``moments``, ``accum``/``stat``,
  ``exp_avg``/``exp_avg_sq``, ``momentum_buf``) holds 1D padded shards of the state, keeping its names;
* replicated parameters (see :mod:`mindzero.core.plan`) keep their full Parameter and full state;
* every other reference it keeps to a replaced tensor is cut (:func:`_swap_references`): MindSpore's
  ``nn.Adam``, ``nn.Momentum`` and ``nn.SGD`` keep the parameter list they were built from
  (``init_params``), grouped optimizers keep ``group_params``, mint's keep ``param_groups``, and
  ``Parameter.clone`` records each state in its source's ``param_info.cloned_obj``; any of these would keep
  a full parameter or a full state alive beside its shard.

Optimizers that are not element-wise (LAMB, LARS, Adafactor, THOR: they use
per-tensor norms or factored moments) would silently change meaning on shards,
so they are refused unless ``zero_stage=0``.
"""
from __future__ import annotations

from mindspore import ParameterTuple, mint, nn
from mindspore.experimental.optim import Optimizer as TorchStyleOptimizer

from .materialize import make_shard, materialize

OPTIMIZER_BASES = (nn.Optimizer, TorchStyleOptimizer)
ELEMENTWISE_OPTIMIZERS = {nn.AdamWeightDecay, nn.Adam, nn.SGD, nn.Momentum, mint.optim.Adam, mint.optim.AdamW,
                          mint.optim.SGD}
# optimizers whose update gives each element the same bits whatever piece of the parameter it is computed in: disk
# offload may cut their parameters into pieces (at multiples of 4096 elements, memory 64-byte aligned). Measured on
# CPU (tests/single/test_offload.py, 4096-element pieces of 13000- and 26000-element shards): bit-identical. Not
# nn.Adam: its fused ApplyAdam kernel splits a tensor between threads and computes each thread's last elements with
# scalar code, the rest 8 lanes at a time with FMA, so an element at a thread boundary of the whole tensor gets
# another last bit in a piece (measured: element 2184 of a 4369-element parameter; 68 of 26000). mint.optim.AdamW
# (no CPU kernel) and registered classes are not verified: whole parameters.
SPLITTABLE_OPTIMIZERS = {nn.AdamWeightDecay, nn.SGD, nn.Momentum, mint.optim.Adam, mint.optim.SGD}
# optimizers whose update kernel MindSpore 2.10 does not register on CPU: class -> (kernel, what to use there)
CPU_MISSING_KERNEL = {mint.optim.AdamW: ("AdamW", "mint.optim.Adam with weight_decay (L2, not decoupled) or "
                                                  "nn.AdamWeightDecay (decoupled, as AdamW)")}


def register_elementwise_optimizer(cls) -> None:
    """Declare a user optimizer class element-wise, so stages 1-3 may shard it.

    The class must keep its per-parameter states in ``ParameterTuple`` attributes cloned from its
    parameters (``self.parameters.clone(prefix=...)``).
    """
    if not (isinstance(cls, type) and issubclass(cls, OPTIMIZER_BASES)):
        raise TypeError(f"cls must be a subclass of mindspore.nn.Optimizer or mindspore.experimental.optim.Optimizer "
                        f"(mint.optim's base), got {cls!r}")
    ELEMENTWISE_OPTIMIZERS.add(cls)


def param_tuple(optimizer) -> ParameterTuple:
    """The tuple of Parameters ``optimizer`` updates (its order is the order gradients are handed to it)."""
    return optimizer._parameters if isinstance(optimizer, nn.Optimizer) else optimizer.parameters


def check_optimizer(optimizer, network_params: dict, sharding: bool, device: str = "CPU") -> None:
    """Validate ``optimizer`` against the network.

    Raises:
        TypeError: not a ``mindspore.nn.Optimizer`` nor a ``mindspore.mint.optim`` optimizer.
        ValueError: a parameter it updates is not one of the network's; its update kernel does not exist on
            ``device``; or it cannot be sharded faithfully (not element-wise, gradient centralization,
            sparse/lazy/offload Adam, a per-group state on some groups only).
    """
    if not isinstance(optimizer, OPTIMIZER_BASES):
        raise TypeError(f"optimizer must be a mindspore.nn.Optimizer or a mindspore.mint.optim optimizer "
                        f"(mindspore.experimental.optim.Optimizer), got {type(optimizer).__name__}")
    cls = type(optimizer)
    if device == "CPU" and cls in CPU_MISSING_KERNEL:
        kernel, instead = CPU_MISSING_KERNEL[cls]
        raise ValueError(f"optimizer {cls.__module__}.{cls.__name__} cannot run on CPU: MindSpore 2.10 registers no "
                         f"CPU kernel for its update op [{kernel}]; on CPU use {instead} (on GPU/Ascend it is "
                         "accepted and sharded)")
    by_id = {id(p) for p in network_params.values()}
    for p in optimizer.parameters:
        if id(p) not in by_id:
            raise ValueError(f"optimizer updates parameter {p.name!r}, which is not a parameter of the network; "
                             "build the optimizer from network.trainable_params()")
    if not sharding:
        return
    if cls not in ELEMENTWISE_OPTIMIZERS:
        names = sorted(f"mint.optim.{c.__name__}" if c.__module__.startswith("mindspore.mint") else c.__name__
                       for c in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(f"optimizer {cls.__name__} cannot be sharded faithfully by zero_stage 1-3: mindzero shards "
                         f"element-wise optimizers only ({', '.join(names)}); use zero_stage=0, or declare the class "
                         "with mindzero.register_elementwise_optimizer if its update is element-wise")
    flags = getattr(optimizer, "grad_centralization_flags", ()) or ()
    if getattr(optimizer, "grad_centralization", False) or any(flags):
        raise ValueError(f"optimizer {cls.__name__} uses grad_centralization, which is not element-wise; "
                         "it cannot be sharded by zero_stage 1-3")
    for attr in ("use_lazy", "use_offload"):
        if getattr(optimizer, attr, False):
            raise ValueError(f"optimizer {cls.__name__} has {attr}=True, which mindzero cannot shard; "
                             "use zero_stage=0 or turn it off")
    group_state_tuples(optimizer)  # raises for a per-group state on some groups only


def _is_state_of(states, params) -> bool:
    """``states`` is a per-parameter state tuple of ``params``: same length and shapes, each named
    ``<prefix>.<parameter name>`` (what ``ParameterTuple.clone(prefix=...)`` makes)."""
    return (isinstance(states, ParameterTuple) and states is not params and len(states) == len(params)
            and all(s.shape == p.shape and s.name != p.name and s.name.endswith("." + p.name)
                    for s, p in zip(states, params)))


def state_tuples(optimizer) -> dict:
    """The optimizer's per-parameter state tuples: attribute name -> ParameterTuple (one Parameter per
    optimizer parameter, in its order), a mint optimizer's per-group states included once
    :func:`expose_group_states` has made each one attribute."""
    params = param_tuple(optimizer)
    return {attr: value for attr, value in vars(optimizer).items() if _is_state_of(value, params)}


def group_state_tuples(optimizer) -> dict:
    """A mint optimizer's per-group state tuples (AMSGrad's ``max_exp_avg_sq``): key -> one ParameterTuple
    per parameter group, in group order; ``{}`` for ``nn`` optimizers.

    Raises:
        ValueError: a state some groups have and others not (``amsgrad`` set per group): it would not cover
            every parameter, which sharding and checkpoints need.
    """
    groups = getattr(optimizer, "param_groups", None)
    if isinstance(optimizer, nn.Optimizer) or not groups:
        return {}
    found = [{k for k, v in g.items() if _is_state_of(v, ParameterTuple(g["params"]))} for g in groups]
    keys = set().union(*found)
    partial = sorted(k for k in keys if any(k not in f for f in found))
    if partial:
        raise ValueError(f"optimizer {type(optimizer).__name__} keeps {partial} in some parameter groups only "
                         "(amsgrad set per group); mindzero needs it in every group or none: set amsgrad the same "
                         "for every group")
    return {k: [g[k] for g in groups] for k in sorted(keys)}


def optimizer_states(optimizer) -> tuple:
    """The names of ``optimizer``'s per-parameter state tuples (:func:`state_tuples`), after making each
    per-group state of a mint optimizer one attribute in parameter order (the same Parameters the groups
    hold), so that sharding and checkpoints treat every state alike."""
    for key, per_group in group_state_tuples(optimizer).items():
        if key not in vars(optimizer):
            setattr(optimizer, key, ParameterTuple([s for tup in per_group for s in tup]))
    return tuple(state_tuples(optimizer))


def _swap_references(optimizer, mapping: dict, sources) -> None:
    """Replace, by identity, every reference ``optimizer`` keeps to a key of ``mapping`` (``id(old)`` -> new
    Parameter) in its public lists, tuples and dicts (``init_params``, ``group_params``, ``param_groups`` and
    the ParameterTuples in them, a depth of four), and drop every replaced Parameter from the clone records
    (``param_info.cloned_obj``) of ``sources`` (the Parameters it was built from) and of those it keeps:
    otherwise the replaced full tensor stays alive."""

    def swap(value, depth):
        if depth == 0:
            return value
        if isinstance(value, ParameterTuple):  # a group's state (an attribute's own is replaced already)
            new = [mapping.get(id(v), v) for v in value]
            return ParameterTuple(new) if any(a is not b for a, b in zip(new, value)) else value
        if isinstance(value, list):
            value[:] = [mapping[id(v)] if id(v) in mapping else swap(v, depth - 1) for v in value]
        elif isinstance(value, dict):
            for k, v in value.items():
                value[k] = mapping[id(v)] if id(v) in mapping else swap(v, depth - 1)
        elif isinstance(value, tuple):
            new = tuple(mapping[id(v)] if id(v) in mapping else swap(v, depth - 1) for v in value)
            return new if any(a is not b for a, b in zip(new, value)) else value
        return value

    for attr, value in list(vars(optimizer).items()):
        if not attr.startswith("_") and isinstance(value, (list, dict, tuple)) and not isinstance(value, ParameterTuple):
            new = swap(value, 4)  # init_params: {"params": [{"params": [...]}, ...]} (parameter groups)
            if new is not value:
                object.__setattr__(optimizer, attr, new)
    # the Cell's record of Parameters set in list attributes (its duplicate-name check) holds them too
    objs, names = vars(optimizer).get("_exist_objs"), vars(optimizer).get("_exist_names")
    if objs:
        replaced = [p for p in objs if id(p) in mapping]
        for p in replaced:
            objs.discard(p)
            objs.add(mapping[id(p)])
            if names is not None:
                names.discard(p.name)
                names.add(mapping[id(p)].name)
    for p in (*sources, *optimizer.get_parameters()):
        clones = getattr(p.param_info, "cloned_obj", None)
        if clones:
            clones[:] = [c for c in clones if id(c) not in mapping]


def _replace_tuple(optimizer, attrs, old, new: list) -> dict:
    """Set ``attrs`` of ``optimizer`` to ``ParameterTuple(new)`` in place of ``old`` (dropping ``old``'s
    entries from the Cell's parameter table). Returns ``{id(old[i]): new[i]}`` where they differ."""
    # by identity: the key is the name at the optimizer's construction, which a later wrapping Cell
    # may have prefixed (a stale entry would keep the full tensor alive)
    gone = {id(p) for p in old}
    for key in [k for k, v in optimizer._params.items() if id(v) in gone]:
        del optimizer._params[key]
    new_tuple = ParameterTuple(new)
    for attr in attrs:
        if attr in vars(optimizer):
            object.__delattr__(optimizer, attr)
        setattr(optimizer, attr, new_tuple)
    return {id(o): n for o, n in zip(old, new) if o is not n}


def shard_optimizer(optimizer, specs: list, shard_params: list, keep=None) -> tuple:
    """Re-point ``optimizer`` at shards, in place, and cut its references to what was replaced.

    Args:
        optimizer: the user's optimizer (validated by :func:`check_optimizer`).
        specs: the :class:`ShardSpec` of each optimizer parameter, in ``optimizer.parameters`` order.
        shard_params: what the optimizer must update for each parameter, same order: a shard
            Parameter for sharded ones, the full Parameter for replicated ones.
        keep: ``None``, or ``keep(attr, index, state) -> Parameter``: what the optimizer holds for each new state
            (shard or full), called as each is made (disk offload writes it out and returns a stand-in, so no
            more than one state is in memory at a time).

    Returns:
        the state-tuple attribute names (:func:`optimizer_states`).
    """
    old = param_tuple(optimizer)
    if len(specs) != len(old) or len(shard_params) != len(old):
        raise ValueError(f"specs ({len(specs)}) and shard_params ({len(shard_params)}) must match the optimizer's "
                         f"{len(old)} parameters")
    names, mapping = optimizer_states(optimizer), {}
    for attr in names:
        states = getattr(optimizer, attr)
        new = [(keep or _same)(attr, i, make_shard(s, spec, s.name, requires_grad=False) if spec.sharded
                                else materialize(s))
               for i, (s, spec) in enumerate(zip(states, specs))]
        mapping.update(_replace_tuple(optimizer, [attr], states, new))
    aliases = [attr for attr, value in vars(optimizer).items() if value is old]
    mapping.update(_replace_tuple(optimizer, aliases, old, list(shard_params)))
    _swap_references(optimizer, mapping, old)
    return names


def _same(attr, index, state):
    return state


def repoint_optimizer(optimizer, targets: list) -> tuple:
    """Stage 0 with ``param_dtype``: the optimizer updates ``targets`` (fp32 masters, one per parameter, same
    shapes) instead of the network's parameters; its states, cloned from the fp32 parameters, stay.

    Returns:
        the state-tuple attribute names (:func:`optimizer_states`).
    """
    old = param_tuple(optimizer)
    if len(targets) != len(old) or any(tuple(t.shape) != tuple(p.shape) for t, p in zip(targets, old)):
        raise ValueError(f"targets must match the optimizer's {len(old)} parameters one to one, in shape")
    names = optimizer_states(optimizer)
    aliases = [attr for attr, value in vars(optimizer).items() if value is old]
    _swap_references(optimizer, _replace_tuple(optimizer, aliases, old, list(targets)), old)
    return names


def optimizer_state_params(optimizer, attrs) -> list:
    """Every Parameter of the state tuples ``attrs`` (not step counters or learning rates)."""
    return [p for attr in attrs for p in getattr(optimizer, attr)]


def optimizer_step(optimizer) -> int:
    """The optimizer's step counter: ``global_step`` (``nn``), ``state_step`` (mint's Adam/AdamW) or
    ``step_t`` (mint's SGD); 0 when it has none."""
    for attr in ("global_step", "state_step", "step_t"):
        counter = getattr(optimizer, attr, None)
        if counter is not None:
            return int(counter.asnumpy().reshape(-1)[0])
    return 0


_UPDATE_PRIMITIVES = ("fused_opt", "opt", "sparse_opt")  # where MindSpore's optimizers keep their update op


def offload_update(optimizer) -> tuple:
    """``optimizer_offload=True``: run the optimizer's update primitive on the host.

    On GPU/Ascend MindSpore's heterogeneous execution then keeps the states, which only that
    primitive reads, in host memory and copies the (sharded) gradient and parameter across
    (MindSpore's own ``nn.Adam(use_offload=True)`` works the same way). On CPU the update already
    runs on the host: the same graph is built and the result is unchanged.

    Returns:
        the names of the primitives moved (e.g. ``("fused_opt",)`` for AdamWeightDecay).

    Raises:
        ValueError: the optimizer updates with several small ops instead of one primitive (SGD, Lamb, ...).
    """
    from mindspore.ops import Primitive

    if isinstance(optimizer, nn.AdamWeightDecay):
        optimizer.use_fused_opt = True
    moved = tuple(name for name in _UPDATE_PRIMITIVES if isinstance(getattr(optimizer, name, None), Primitive))
    if not moved:
        raise ValueError(f"optimizer_offload=True needs an optimizer whose update is one MindSpore primitive that "
                         f"can run on the host (AdamWeightDecay, Adam, Momentum, Adagrad, RMSProp); got "
                         f"{type(optimizer).__name__}; pass optimizer_offload=False")
    for name in moved:
        getattr(optimizer, name).set_device("CPU")
    return moved


def splits_parameters(optimizer) -> bool:
    """Whether disk offload may cut ``optimizer``'s parameters into pieces (:data:`SPLITTABLE_OPTIMIZERS`)."""
    return type(optimizer) in SPLITTABLE_OPTIMIZERS


def optimizer_view(optimizer, index: int, param, states: dict):
    """A Cell that applies ``optimizer``'s update to one piece of its parameter ``index``: the same class, the same
    hyper-parameters and shared scalars (step counters, learning rates, beta powers: the very Parameters
    ``optimizer`` holds), over ``param`` (a Parameter standing for the piece) and ``states`` (state-tuple attribute
    -> a Parameter standing for that state's piece). Element-wise optimizers
    (:data:`ELEMENTWISE_OPTIMIZERS`) compute the same numbers on the piece as on the whole parameter, provided the
    shared scalars hold what they held before the step (the caller restores them before each piece: each call
    advances them once).

    Every per-parameter tuple of ``optimizer`` (decay flags, per-group learning rates and weight decays, ...) is
    cut to the entry of ``index``; a mint optimizer's parameter groups to the group holding ``index``.
    """
    n = len(param_tuple(optimizer))
    cls = type(optimizer)
    view = cls.__new__(cls)
    nn.Cell.__init__(view, auto_prefix=False)
    internal = set(vars(view))
    old = param_tuple(optimizer)
    for key, value in vars(optimizer).items():
        if key in internal:
            continue
        if key in states:
            value = ParameterTuple([states[key]])
        elif value is old:
            value = ParameterTuple([param])
        elif isinstance(value, ParameterTuple) and len(value) == n:
            value = ParameterTuple([value[index]])
        elif isinstance(value, tuple) and len(value) == n:
            value = (value[index],)
        object.__setattr__(view, key, value)
    for key, p in shared_scalars(optimizer, states).items():
        view._params[key] = p  # pylint: disable=protected-access
    for p in (param, *states.values()):
        view._params[p.name] = p  # pylint: disable=protected-access
    for key, cell in optimizer._cells.items():  # pylint: disable=protected-access
        view._cells[key] = cell  # pylint: disable=protected-access
    if isinstance(optimizer, TorchStyleOptimizer):
        group = _group_of(optimizer, index)
        entry = dict(optimizer.param_groups[group], params=[param])
        for key in states:
            if key in entry:
                entry[key] = ParameterTuple([states[key]])
        object.__setattr__(view, "param_groups", [entry])
        object.__setattr__(view, "group_start_id", [0, 1])
        object.__setattr__(view, "lrs", [optimizer.lrs[group]])
    return view


def view_signature(optimizer, index: int, state_attrs) -> tuple:
    """What :func:`optimizer_view` takes from ``optimizer`` for parameter ``index`` beyond its shape: pieces with
    equal signatures and shapes can share one compiled view."""
    n = len(param_tuple(optimizer))
    old = param_tuple(optimizer)
    out = []
    for key, value in sorted(vars(optimizer).items()):
        if value is old or key in state_attrs or not isinstance(value, tuple) or len(value) != n:
            continue
        item = value[index]
        out.append((key, id(item) if not isinstance(item, (bool, int, float, str, type(None))) else item))
    if isinstance(optimizer, TorchStyleOptimizer):
        out.append(("group", _group_of(optimizer, index)))
    return tuple(out)


def shared_scalars(optimizer, state_attrs) -> dict:
    """The Parameters of ``optimizer`` that are neither its parameters nor their states, by the attribute name the
    optimizer reads them under: step counters, learning rates, beta powers (what each call of the optimizer, or of a
    view of it, may advance)."""
    own = {id(p) for p in param_tuple(optimizer)} | {id(s) for attr in state_attrs for s in getattr(optimizer, attr)}
    return {key: p for key, p in optimizer._params.items() if id(p) not in own}  # pylint: disable=protected-access


def _group_of(optimizer, index: int) -> int:
    """The parameter group of a mint optimizer that holds its parameter ``index``."""
    starts = optimizer.group_start_id
    return next(g for g in range(len(starts) - 1) if starts[g] <= index < starts[g + 1])
