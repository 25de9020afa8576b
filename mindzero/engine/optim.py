"""What mindzero reads of the user's optimizer: :class:`OptimizerLayout`, and the checks made before anything changes.

Two families are accepted: ``mindspore.nn.Optimizer`` (``nn.AdamWeightDecay``, ``nn.Adam``, ``nn.SGD``, mindcv's
and mindone's optimizers, ...) and the torch-style ``mindspore.experimental.optim.Optimizer`` that
``mindspore.mint.optim`` and mindone's ``Muon`` build on: the same idea, other attribute names (the parameter tuple
is ``_parameters`` in the first, ``parameters`` in the second; the second keeps hyper-parameters and some states,
such as AMSGrad's ``max_exp_avg_sq``, in its ``param_groups``).

[Note: the optimizer's attributes] An optimizer is read by the role each attribute plays, never by a list of
classes:

* its **parameter tuple**, and every attribute holding that very tuple (``parameters``, ``params``);
* its **states**: tuples of Parameters with one entry per parameter, entry ``i`` named after parameter ``i`` (what
  ``ParameterTuple.clone(prefix=...)`` makes, ``exp_avg_sq.<name>``, and what hand-written optimizers do,
  ``<name>_v_row``): moments, accumulators, factored row and column statistics, per-parameter scalars;
* its **per-parameter entries**: any other list or tuple with one entry per parameter (decay flags, per-group
  learning rates and weight decays, mindone Muon's ``use_muon``, ``nn.SGD``'s update primitives); MindSpore's
  bases name theirs (:data:`KNOWN_PER_PARAMETER`), a subclass may add its own;
* its **shared scalars**: every other Parameter (step counters, learning rates, beta powers).

mindzero replaces the parameter tuple and the states, one new entry per old one (so every per-parameter entry
stays where the optimizer reads it), and never changes the rest (:mod:`mindzero.engine.repoint`). Only the
optimizer views of :mod:`mindzero.engine.probe` cut the per-parameter entries.
"""
from __future__ import annotations

import re

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, mint, nn
from mindspore.experimental.optim import Optimizer as TorchStyleOptimizer

from ..core.checksum import crc32_array
from ..core.optim_plan import StateSpec, state_layout
from ..core.versions import UnsupportedMindSpore, release

OPTIMIZER_BASES = (nn.Optimizer, TorchStyleOptimizer)
# optimizers whose update kernel MindSpore does not register on CPU: class -> (kernel, what to use there)
CPU_MISSING_KERNEL = {
    mint.optim.AdamW: ("AdamW", "mint.optim.Adam with weight_decay (L2, not decoupled) or nn.AdamWeightDecay "
                                "(decoupled, as AdamW)"),
    nn.Lamb: ("Lamb", "another optimizer (on GPU/Ascend nn.Lamb is accepted, its parameters owned whole)"),
    nn.LARS: ("LARSUpdate", "another optimizer"),
}
#: optimizers a MindSpore release ships but does not run: class -> (the first release that runs it, what it does before,
#: what to use instead); refused there, naming the version (in plain MindSpore they train nothing, silently)
BROKEN_BEFORE = {
    mint.optim.SGD: ("2.8.0", "updates no parameter (its step counter stays 0, in MindSpore alone as under mindzero)",
                     "nn.SGD or nn.Momentum"),
}


def unrunnable(cls, version: str = None):
    """Why this MindSpore (``version``, default the installed one) cannot run optimizer class ``cls``, or ``None``."""
    version = ms.__version__ if version is None else version
    known = BROKEN_BEFORE.get(cls)
    if known is None or release(version) >= release(known[0]):
        return None
    first, what, instead = known
    return (f"optimizer {cls.__module__}.{cls.__name__} {what} in MindSpore {version}: use {instead}, or MindSpore "
            f"{first} or later")


#: the per-parameter attributes MindSpore's optimizer bases make (the note above); a subclass may add its own
KNOWN_PER_PARAMETER = frozenset({
    "decay_flags", "dynamic_decay_flags", "optim_filter", "weight_decay", "learning_rate",
    "grad_centralization_flags", "group_params", "group_lr", "group_weight_decay", "group_grad_centralization",
    "_lazy_user_parameters", "ps_parameters", "cache_enable", "opt"})


def param_tuple(optimizer) -> ParameterTuple:
    """The tuple of Parameters ``optimizer`` updates (its order is the order gradients are handed to it)."""
    return optimizer._parameters if isinstance(optimizer, nn.Optimizer) else optimizer.parameters


def family(optimizer) -> str:
    """``"nn"`` (``mindspore.nn.Optimizer``) or ``"torch"`` (``mindspore.experimental.optim.Optimizer``)."""
    return "nn" if isinstance(optimizer, nn.Optimizer) else "torch"


def qualified_name(cls) -> str:
    """``module.Class`` of an optimizer class, as messages and the optimizer table name it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _names_parameter(state_name: str, param_name: str) -> bool:
    """Whether ``state_name`` contains ``param_name`` as a whole component (bounded by the start or end, ``.`` or
    ``_``): ``exp_avg.w``, ``w_v_row``, ``mu_w``, but not ``learning_rate`` for a parameter ``a``."""
    pattern = r"(^|[._])" + re.escape(param_name) + r"($|[._])"
    return re.search(pattern, state_name) is not None


def _is_states_of(value, params) -> bool:
    """``value`` holds one state per parameter of ``params``: a tuple of distinct Parameters, none of them a
    parameter, entry ``i`` named after parameter ``i``."""
    if not isinstance(value, (tuple, list)) or value is params or len(value) != len(params) or not len(params):
        return False
    if not all(isinstance(s, Parameter) for s in value):
        return False
    if len({id(s) for s in value}) != len(value) or {id(s) for s in value} & {id(p) for p in params}:
        return False
    return all(s.name != p.name and _names_parameter(s.name, p.name) for s, p in zip(value, params))


class OptimizerLayout:
    """The roles of a user optimizer's attributes (see the note at the top), read once.

    Attributes:
        optimizer: the user's optimizer.
        params: its parameter tuple; ``aliases``: the attributes holding that very tuple.
        states: ``{attr: tuple}``: one state Parameter per parameter (optimizer order), in attribute order; a
            torch-style optimizer's per-group states are made one attribute first (:meth:`read`).
        per_parameter: attributes holding one other entry per parameter; ``unknown``: those of them that
            :data:`KNOWN_PER_PARAMETER` does not name.
        scalars: ``{key: Parameter}``: the shared scalars, by the key the optimizer registers them under.
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.params = param_tuple(optimizer)
        n = len(self.params)
        own = vars(optimizer)
        self.aliases = tuple(attr for attr, v in own.items() if v is self.params)
        self.states = {attr: tuple(v) for attr, v in own.items() if _is_states_of(v, self.params)}
        internal = _cell_internals()
        self.per_parameter = tuple(attr for attr, v in own.items()
                                   if attr not in self.aliases and attr not in self.states and attr not in internal
                                   and isinstance(v, (tuple, list, nn.CellList)) and len(v) == n)
        self.unknown = tuple(a for a in self.per_parameter if a not in KNOWN_PER_PARAMETER)
        held = {id(p) for p in self.params} | {id(s) for v in self.states.values() for s in v}
        self.scalars = {key: p for key, p in optimizer._params.items()  # pylint: disable=protected-access
                        if p is not None and id(p) not in held}

    @classmethod
    def read(cls, optimizer) -> "OptimizerLayout":
        """The layout of ``optimizer``, after making each per-group state of a torch-style optimizer one attribute
        in parameter order (the same Parameters its groups hold), so that every state is read alike.

        Raises:
            ValueError: a per-group state some groups have and others not (``amsgrad`` set per group).
        """
        for key, per_group in group_state_tuples(optimizer).items():
            if key not in vars(optimizer):
                setattr(optimizer, key, ParameterTuple([s for tup in per_group for s in tup]))
        return cls(optimizer)

    @property
    def n(self) -> int:
        return len(self.params)

    @property
    def state_attrs(self) -> tuple:
        return tuple(self.states)

    def state_specs(self, index: int, shapes=None) -> tuple:
        """The :class:`~mindzero.core.optim_plan.StateSpec` of parameter ``index``'s states, laid out against
        ``shapes[index]`` (its full shape; default: the shape the optimizer holds)."""
        shape = tuple(self.params[index].shape if shapes is None else shapes[index])
        return tuple(StateSpec(attr, s[index].name, tuple(s[index].shape), _dtype_name(s[index].dtype),
                               state_layout(shape, s[index].shape)) for attr, s in self.states.items())

    def describe(self, value, depth: int = 3) -> str:
        """``value`` (an attribute of the optimizer, or part of one) as deterministic text: numbers and flags as
        written, a tensor or Parameter of up to 8 elements by its values and a larger one by dtype, shape and CRC-32,
        the optimizer's own parameters by name, sequences and dicts item by item (a torch-style group without its
        states), a Cell by its class and Parameters, a primitive by its name and attributes."""
        if isinstance(value, (bool, int, float, str, type(None))):
            return repr(value)
        names = {id(p): p.name for p in self.params}
        if id(value) in names:
            return f"<parameter {names[id(value)]}>"
        if isinstance(value, Tensor):
            array = value.asnumpy()
            if array.size <= 8:  # a learning rate, a beta, a step: its values, as messages name them
                return f"{array.dtype}{array.reshape(-1).tolist()}"
            return f"<{array.dtype}{tuple(array.shape)} crc {crc32_array(array)}>"
        if depth == 0:
            return f"<{type(value).__name__}>"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k!r}: {self.describe(v, depth - 1)}" for k, v in value.items()
                                   if k not in self.states) + "}"
        if isinstance(value, (list, tuple)):
            return "[" + ", ".join(self.describe(v, depth - 1) for v in value) + "]"
        if isinstance(value, nn.Cell):
            return f"<{type(value).__name__} {self.describe(list(value.get_parameters()), depth - 1)}>"
        if hasattr(value, "attrs") and hasattr(value, "name"):  # a primitive: its name and attributes
            return f"<{value.name} {sorted((k, repr(v)) for k, v in value.attrs.items())}>"
        return f"<{type(value).__module__}.{type(value).__qualname__}>"

    def hyper_parameters(self) -> tuple:
        """``((what, text), ...)``: the optimizer's class, then every attribute that is not its parameters or states
        (hyper-parameters, per-parameter entries, groups) and every shared scalar, by :meth:`describe`: what every
        rank's optimizer must agree on, and what an update depends on beyond the parameters' own values."""
        skip = set(self.aliases) | set(self.states) | _cell_internals()
        attributes = {key: value for key, value in vars(self.optimizer).items()
                      if key not in skip and not key.startswith("__")}
        attributes.update(self.scalars)  # learning rates, betas, step counters: Parameters a Cell keeps in _params
        return ((("class", qualified_name(type(self.optimizer))),)
                + tuple((f"attribute {key!r}", self.describe(value)) for key, value in sorted(attributes.items())))

    def group_of(self, index: int) -> int:
        """The parameter group of a torch-style optimizer that holds parameter ``index`` (0 for ``nn``)."""
        starts = getattr(self.optimizer, "group_start_id", None)
        if family(self.optimizer) == "nn" or not starts:
            return 0
        return next(g for g in range(len(starts) - 1) if starts[g] <= index < starts[g + 1])


_INTERNALS = []


def _cell_internals() -> frozenset:
    """The attributes every ``nn.Cell`` has (its own bookkeeping): never an optimizer's per-parameter entries."""
    if not _INTERNALS:
        _INTERNALS.append(frozenset(vars(nn.Cell(auto_prefix=False))))
    return _INTERNALS[0]


def _dtype_name(dtype) -> str:
    return str(dtype).lower().replace("mindspore.", "")


def group_state_tuples(optimizer) -> dict:
    """A torch-style optimizer's per-group state tuples (AMSGrad's ``max_exp_avg_sq``): key -> one tuple per
    parameter group, in group order; ``{}`` for ``nn`` optimizers.

    Raises:
        ValueError: a state some groups have and others not (``amsgrad`` set per group): it would not cover
            every parameter, which sharding and checkpoints need.
    """
    groups = getattr(optimizer, "param_groups", None)
    if isinstance(optimizer, nn.Optimizer) or not groups:
        return {}
    found = [{k for k, v in g.items() if _is_states_of(v, ParameterTuple(g["params"]))} for g in groups]
    keys = set().union(*found)
    partial = sorted(k for k in keys if any(k not in f for f in found))
    if partial:
        raise ValueError(f"optimizer {type(optimizer).__name__} keeps {partial} in some parameter groups only "
                         "(amsgrad set per group); mindzero needs it in every group or none: set amsgrad the same "
                         "for every group")
    return {k: [g[k] for g in groups] for k in sorted(keys)}


def check_optimizer(optimizer, network_params: dict, sharding: bool, device: str = "CPU") -> None:
    """Validate ``optimizer`` against the network, before anything changes.

    Raises:
        TypeError: not a ``mindspore.nn.Optimizer`` nor a torch-style (``mindspore.mint.optim``) optimizer.
        mindzero.core.versions.UnsupportedMindSpore: an optimizer this MindSpore ships but does not run
            (:data:`BROKEN_BEFORE`), naming the version.
        ValueError: a parameter it updates is not one of the network's; its update kernel does not exist on
            ``device``; for ``sharding`` (stages 1-3): it wraps another optimizer, or keeps a per-group state in
            some groups only.
    """
    if not isinstance(optimizer, OPTIMIZER_BASES):
        raise TypeError(f"optimizer must be a mindspore.nn.Optimizer or a mindspore.mint.optim optimizer "
                        f"(mindspore.experimental.optim.Optimizer), got {type(optimizer).__name__}")
    cls = type(optimizer)
    broken = unrunnable(cls)
    if broken is not None:
        raise UnsupportedMindSpore(broken)
    if device == "CPU" and cls in CPU_MISSING_KERNEL:
        kernel, instead = CPU_MISSING_KERNEL[cls]
        raise ValueError(f"optimizer {cls.__module__}.{cls.__name__} cannot run on CPU: MindSpore {ms.__version__} "
                         f"registers no CPU kernel for its update op [{kernel}]; on CPU use {instead}")
    inner = [c for c in optimizer.cells() if isinstance(c, OPTIMIZER_BASES)]
    if sharding and inner:
        raise ValueError(f"optimizer {cls.__name__} wraps another optimizer ({type(inner[0]).__name__}); zero_stage "
                         "1-3 shard one optimizer that updates the network's parameters itself: pass the inner "
                         "optimizer, or use zero_stage=0")
    by_id = {id(p) for p in network_params.values()}
    for p in param_tuple(optimizer):
        if id(p) not in by_id:
            raise ValueError(f"optimizer updates parameter {p.name!r}, which is not a parameter of the network; "
                             "build the optimizer from network.trainable_params()")
    if sharding:
        group_state_tuples(optimizer)  # raises for a per-group state on some groups only


def optimizer_step(optimizer) -> int:
    """The optimizer's step counter: ``global_step`` (``nn``), ``state_step`` (mint's Adam/AdamW, mindone's Muon)
    or ``step_t`` (mint's SGD); 0 when it has none."""
    for attr in ("global_step", "state_step", "step_t"):
        counter = getattr(optimizer, attr, None)
        if isinstance(counter, Parameter):
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
