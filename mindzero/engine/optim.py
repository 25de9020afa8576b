"""Re-point the user's optimizer at shard Parameters, so it updates shards exactly as it would full ones.

Why this is exact: the supported optimizers (:data:`ELEMENTWISE_OPTIMIZERS`)
update every element from that element's parameter, gradient and state alone,
with hyper-parameters (learning rate, per-group weight decay, betas, step
counters) that are per parameter or global. Applied to a flat shard they
compute the same numbers as on the full tensor. The decay filter and parameter
groups were resolved by the optimizer's own ``__init__`` from the full
parameters' names, and are kept as they are.

What changes in the optimizer, in place:

* its parameter tuple (``_parameters`` and aliases such as ``parameters`` and
  ``params``) now holds, for each sharded parameter, a 1D shard Parameter:
  the network's own shard at stage 3, a *master shard* at stages 1-2;
* every per-parameter state tuple (e.g. ``adam_m``/``adam_v``, ``moments``,
  ``accum``/``stat``) holds 1D padded shards of the state, keeping its names;
* replicated parameters (see :mod:`mindzero.plan`) keep their full Parameter
  and full state.

Optimizers that are not element-wise (LAMB, LARS, Adafactor, THOR: they use
per-tensor norms or factored moments) would silently change meaning on shards,
so they are refused unless ``zero_stage=0``.
"""
from __future__ import annotations

from mindspore import ParameterTuple, nn

from .materialize import make_shard, materialize

ELEMENTWISE_OPTIMIZERS = {nn.AdamWeightDecay, nn.Adam, nn.SGD, nn.Momentum}


def register_elementwise_optimizer(cls) -> None:
    """Declare a user optimizer class element-wise, so stages 1-3 may shard it.

    The class must keep its per-parameter states in ``ParameterTuple``
    attributes cloned from its parameters (``self.parameters.clone(prefix=...)``).
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Optimizer)):
        raise TypeError(f"cls must be a subclass of mindspore.nn.Optimizer, got {cls!r}")
    ELEMENTWISE_OPTIMIZERS.add(cls)


def check_optimizer(optimizer, network_params: dict, sharding: bool) -> None:
    """Validate ``optimizer`` against the network.

    Raises:
        TypeError: not a ``mindspore.nn.Optimizer``.
        ValueError: a parameter it updates is not one of the network's, or it cannot be
            sharded faithfully (not element-wise, gradient centralization, sparse/lazy/offload Adam).
    """
    if not isinstance(optimizer, nn.Optimizer):
        raise TypeError(f"optimizer must be a mindspore.nn.Optimizer, got {type(optimizer).__name__}")
    by_id = {id(p) for p in network_params.values()}
    for p in optimizer.parameters:
        if id(p) not in by_id:
            raise ValueError(f"optimizer updates parameter {p.name!r}, which is not a parameter of the network; "
                             "build the optimizer from network.trainable_params()")
    if not sharding:
        return
    cls = type(optimizer)
    if cls not in ELEMENTWISE_OPTIMIZERS:
        names = sorted(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
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


def state_tuples(optimizer) -> dict:
    """The optimizer's per-parameter state tuples: attribute name -> ParameterTuple.

    A state tuple has one Parameter per optimizer parameter, of the same shape, named
    ``<prefix>.<parameter name>`` (what ``ParameterTuple.clone(prefix=...)`` makes).
    """
    params = optimizer._parameters
    out = {}
    for attr, value in vars(optimizer).items():
        if not isinstance(value, ParameterTuple) or value is params or len(value) != len(params):
            continue
        if all(s.shape == p.shape and s.name != p.name and s.name.endswith("." + p.name)
               for s, p in zip(value, params)):
            out[attr] = value
    return out


def _replace_tuple(optimizer, attrs, old: ParameterTuple, new: list) -> None:
    # by identity: the key is the name at the optimizer's construction, which a later wrapping Cell
    # may have prefixed (a stale entry would keep the full tensor alive)
    gone = {id(p) for p in old}
    for key in [k for k, v in optimizer._params.items() if id(v) in gone]:
        del optimizer._params[key]
    new_tuple = ParameterTuple(new)
    for attr in attrs:
        object.__delattr__(optimizer, attr)
        setattr(optimizer, attr, new_tuple)


def shard_optimizer(optimizer, specs: list, shard_params: list) -> tuple:
    """Re-point ``optimizer`` at shards, in place.

    Args:
        optimizer: the user's optimizer (validated by :func:`check_optimizer`).
        specs: the :class:`ShardSpec` of each optimizer parameter, in ``optimizer.parameters`` order.
        shard_params: what the optimizer must update for each parameter, same order: a shard
            Parameter for sharded ones, the full Parameter for replicated ones.
    """
    old = optimizer._parameters
    if len(specs) != len(old) or len(shard_params) != len(old):
        raise ValueError(f"specs ({len(specs)}) and shard_params ({len(shard_params)}) must match the optimizer's "
                         f"{len(old)} parameters")
    found = state_tuples(optimizer)
    for attr, states in found.items():
        new = [make_shard(s, spec, s.name, requires_grad=False) if spec.sharded else materialize(s)
               for s, spec in zip(states, specs)]
        _replace_tuple(optimizer, [attr], states, new)
    aliases = [attr for attr, value in vars(optimizer).items() if value is old]
    _replace_tuple(optimizer, aliases, old, list(shard_params))
    return tuple(found)


def repoint_optimizer(optimizer, targets: list) -> tuple:
    """Stage 0 with ``param_dtype``: the optimizer updates ``targets`` (fp32 masters, one per parameter, same
    shapes) instead of the network's parameters; its states, cloned from the fp32 parameters, stay.

    Returns:
        the state-tuple attribute names (as :func:`state_tuples`).
    """
    old = optimizer._parameters
    if len(targets) != len(old) or any(tuple(t.shape) != tuple(p.shape) for t, p in zip(targets, old)):
        raise ValueError(f"targets must match the optimizer's {len(old)} parameters one to one, in shape")
    found = tuple(state_tuples(optimizer))
    _replace_tuple(optimizer, [attr for attr, value in vars(optimizer).items() if value is old], old, list(targets))
    return found


def optimizer_state_params(optimizer, attrs) -> list:
    """Every Parameter of the state tuples ``attrs`` (not step counters or learning rates)."""
    return [p for attr in attrs for p in getattr(optimizer, attr)]


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
