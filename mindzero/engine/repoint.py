"""Re-point the user's optimizer, in place, at what this rank updates: its parameter tuple and its state tuples
get one new entry per old one (:class:`~mindzero.engine.optim.OptimizerLayout`), and every other reference it keeps
to a replaced tensor is cut.

Per optimized parameter (its :class:`~mindzero.core.optim_plan.Update`):

* **flat**: a 1D shard Parameter (the network's own shard at stage 3, a master shard at stages 1-2) and the
  shards of its element states; its scalar states (one value per parameter) stay whole on every rank;
* **owner**, on the owner: the parameter itself or its full master, and its states whole; on every other rank a
  *stand-in* of a few elements (:func:`~mindzero.core.optim_plan.placeholder_shape`) for the parameter and each
  state: the optimizer keeps one entry per parameter (so every per-parameter entry it reads, such as a decay flag
  or Muon's ``use_muon``, stays in place), takes the same branch for the stand-in, and nothing reads the result;
* **whole**: the parameter (or its fp32 master) and its states, as they are.

Why the optimizer is never cut to fewer entries: an optimizer may keep per-parameter entries mindzero does not know
by name (:data:`~mindzero.engine.optim.KNOWN_PER_PARAMETER`); keeping one entry per parameter leaves them all
right whatever they are. The cost is a few-element update per stand-in.

References cut (:func:`_swap_references`): MindSpore's ``nn.Adam``, ``nn.Momentum`` and ``nn.SGD`` keep the
parameter list they were built from (``init_params``), grouped optimizers keep ``group_params``, torch-style ones
``param_groups``, and ``Parameter.clone`` records each state in its source's ``param_info.cloned_obj``; any of these
would keep a full parameter or a full state alive beside its shard.
"""
from __future__ import annotations

import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor

from ..core.optim_plan import ELEMENT, FLAT, OWNER, placeholder_shape
from .materialize import make_shard, materialize, np_dtype
from .optim import OptimizerLayout

PLACEHOLDER_PREFIX = "zero_placeholder."


def stand_in(name: str, shape, dtype) -> Parameter:
    """A non-owner's stand-in Parameter (zeros of ``shape``, ``dtype``), never read (module docstring)."""
    return Parameter(Tensor(np.zeros(tuple(shape), np_dtype(dtype))), name=name, requires_grad=False)


def new_states(layout: OptimizerLayout, updates, specs, op_rank: int, keep=None) -> dict:
    """What the optimizer holds of each state after re-pointing: ``{attr: [Parameter per parameter]}``.

    Args:
        layout: the optimizer's layout (its states as the user built them, possibly lazy).
        updates: the :class:`~mindzero.core.optim_plan.Update` of each optimizer parameter.
        specs: the :class:`~mindzero.core.plan.ShardSpec` of each optimizer parameter (its full shape, its shard).
        op_rank: this rank's place in the op group (who owns what).
        keep: ``None``, or ``keep(attr, index, state) -> Parameter``: what the optimizer holds for each element
            state of a flat or whole parameter, called as each is made (disk offload writes it out and returns a
            stand-in, so no more than one state is in memory at a time).

    Each state is materialised (a lazy one: computed once, one tensor at a time) only where this rank keeps it.
    """
    out = {}
    for attr, states in layout.states.items():
        made = []
        for i, (state, update, spec) in enumerate(zip(states, updates, specs)):
            own = [s for s in update.states if s.attr == attr][0]
            if update.mode == OWNER:
                made.append(materialize(state) if update.owned_by(op_rank) else
                            stand_in(state.name, placeholder_shape(spec.shape, state.shape), state.dtype))
                continue
            value = make_shard(state, spec, state.name, requires_grad=False) if update.mode == FLAT and \
                own.layout == ELEMENT else materialize(state)
            made.append(keep(attr, i, value) if keep and own.layout == ELEMENT else value)
        out[attr] = made
    return out


def repoint_optimizer(layout: OptimizerLayout, targets: list, states: dict) -> None:
    """Re-point the optimizer of ``layout`` in place: its parameter tuple (and every alias) becomes ``targets``
    and each state tuple ``states[attr]`` (one entry per parameter, optimizer order); the references it keeps to
    what was replaced are cut.

    Raises:
        ValueError: ``targets`` or a state list does not have one entry per parameter.
    """
    optimizer, old = layout.optimizer, layout.params
    if len(targets) != len(old) or any(len(states[a]) != len(old) for a in layout.states):
        raise ValueError(f"targets and states must have one entry per optimizer parameter ({len(old)})")
    mapping = {}
    for attr, before in layout.states.items():
        mapping.update(_replace_tuple(optimizer, [attr], before, list(states[attr])))
    mapping.update(_replace_tuple(optimizer, list(layout.aliases), old, list(targets)))
    _swap_references(optimizer, mapping, old)
    layout.params = ParameterTuple(targets)
    layout.states = {attr: tuple(states[attr]) for attr in layout.states}


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
    for key in [k for k, v in optimizer._params.items() if id(v) in gone]:  # pylint: disable=protected-access
        del optimizer._params[key]  # pylint: disable=protected-access
    new_tuple = ParameterTuple(new)
    for attr in attrs:
        if attr in vars(optimizer):
            object.__delattr__(optimizer, attr)
        setattr(optimizer, attr, new_tuple)
    return {id(o): n for o, n in zip(old, new) if o is not n}


def optimizer_state_params(layout: OptimizerLayout) -> list:
    """Every Parameter of the optimizer's state tuples (not step counters or learning rates)."""
    return [p for states in layout.states.values() for p in states]


def owner_placeholders(layout: OptimizerLayout, updates, op_rank: int) -> list:
    """The stand-ins this rank's optimizer holds (parameters and states of the owner-mode parameters it does not
    own): what it keeps of them, a few elements each."""
    out = []
    for i, update in enumerate(updates):
        if update.mode == OWNER and not update.owned_by(op_rank):
            out.append(layout.params[i])
            out += [states[i] for states in layout.states.values()]
    return out
