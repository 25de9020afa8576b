"""How each optimized parameter's update is shared out among the op group: the optimizer plan (pure Python).

[Note: update modes] ZeRO shards what the optimizer holds. Two ways keep the result exactly plain data
parallel's, and mindzero picks one per parameter:

* **flat** (:data:`FLAT`): the optimizer updates each element from that element alone (Adam, SGD, RMSProp,
  ...). Each op rank then updates its flat 1/G shard of the parameter with the shards of its states, as the ZeRO
  paper does; the shard update computes the numbers the whole update would.
* **owner** (:data:`OWNER`): any other optimizer (factored statistics such as AdaFactor's and CAME's, a trust
  ratio per tensor such as LAMB's, Muon's orthogonalised matrices). The parameter's update runs whole, from the
  full reduced gradient, on one *owner* op rank, which alone holds that parameter's optimizer states (as PyTorch's
  ``ZeroRedundancyOptimizer`` and Megatron's layer-wise optimizer do); the updated value then reaches the other
  ranks. Owners are chosen so that every rank holds about the same bytes (:func:`assign_owners`).
* **whole** (:data:`WHOLE`): the parameter is not sharded (stage 0, a parameter the plan replicates): every rank
  updates it whole, as plain data parallel does.

Which mode a parameter gets is decided from the optimizer itself (:mod:`mindzero.engine.probe`), per parameter:
one optimizer may hold both kinds (Muon for matrices, AdamW for the rest). That is ``update_sharding="auto"``, the
default (DeepSpeed's layout where the update allows it). ``update_sharding="owner"`` makes every sharded parameter an
owner-mode one, as PyTorch's ``ZeroRedundancyOptimizer`` partitions by parameter: in fp32 at stages 1-2 the owner
updates the user's Parameter itself, so no rank holds a master shard beside it (flat mode keeps one, 1/N of the
parameter), at the cost of a broadcast per parameter after the update and states balanced by whole parameters.

Each optimizer state of a parameter has a *layout* (:class:`StateSpec`): ``element`` (shaped as the parameter:
sharded with it in flat mode), ``scalar`` (one value per parameter, such as ASGD's ``eta``: every rank of a flat
parameter keeps it whole and updates it identically) or ``other`` (another shape: factored rows and columns; such
a state makes its parameter an owner-mode one).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .plan import dtype_bytes

FLAT, OWNER, WHOLE = "flat", "owner", "whole"
MODES = (FLAT, OWNER, WHOLE)
#: ``update_sharding``'s values: decide per parameter (flat where element-wise), or every sharded parameter owned
AUTO, EVERY_OWNER = "auto", "owner"
UPDATE_SHARDINGS = (AUTO, EVERY_OWNER)
ELEMENT, SCALAR, OTHER = "element", "scalar", "other"
LAYOUTS = (ELEMENT, SCALAR, OTHER)


def state_layout(param_shape, state_shape) -> str:
    """The layout of a state of shape ``state_shape`` belonging to a parameter of shape ``param_shape``:
    :data:`ELEMENT` (the parameter's shape), :data:`SCALAR` (one element, of a parameter of more) or
    :data:`OTHER`."""
    param_shape, state_shape = tuple(param_shape), tuple(state_shape)
    if state_shape == param_shape:
        return ELEMENT
    if math.prod(state_shape) == 1:
        return SCALAR
    return OTHER


@dataclass(frozen=True)
class StateSpec:
    """One optimizer state of one parameter: the optimizer's attribute holding it (``attr``), its name, full shape
    and dtype, and its :func:`state_layout`."""

    attr: str
    name: str
    shape: tuple
    dtype: str
    layout: str

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"state {self.name!r}: layout must be one of {LAYOUTS}, got {self.layout!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class Update:
    """How one optimized parameter is updated: its ``mode`` (:data:`MODES`), its ``owner`` (the op rank that
    updates it in owner mode, else ``None``), ``why`` (the reason for owner mode, for the plan's log) and its
    ``states``."""

    mode: str
    owner: object = None
    why: str = ""
    states: tuple = field(default_factory=tuple)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if (self.owner is not None) != (self.mode == OWNER):
            raise ValueError(f"an owner is given exactly for mode {OWNER!r}: got mode {self.mode!r}, "
                             f"owner {self.owner!r}")

    def owned_by(self, op_rank: int) -> bool:
        """Whether op rank ``op_rank`` holds this parameter's optimizer states whole (its owner)."""
        return self.mode == OWNER and self.owner == op_rank

    @property
    def state_bytes(self) -> int:
        return sum(s.nbytes for s in self.states)


def owner_cost(states, master_bytes: int = 0) -> int:
    """What owning one parameter costs its owner: its states' bytes plus the master copy it keeps (``master_bytes``:
    with ``param_dtype``, and at stage 3, the owner updates a full master of the parameter). At least 1, so that
    parameters without states are spread too."""
    return max(1, sum(s.nbytes for s in states) + master_bytes)


def assign_owners(costs, op_size: int) -> tuple:
    """An owner op rank for each item of ``costs`` (bytes), balancing the bytes each rank holds: the largest first,
    each to the rank holding the least so far (ties: the lowest rank). Deterministic: every rank computes the same
    assignment from the same costs (and so does the offline reshard).

    Raises:
        ValueError: ``op_size`` < 1 or a negative cost.
    """
    if not isinstance(op_size, int) or op_size < 1:
        raise ValueError(f"op_size must be an int >= 1, got {op_size!r}")
    costs = list(costs)
    if any(c < 0 for c in costs):
        raise ValueError(f"costs must be >= 0, got {min(costs)}")
    loads, owners = [0] * op_size, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        rank = min(range(op_size), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += costs[i]
    return tuple(owners)


@dataclass(frozen=True)
class Balance:
    """The optimizer-state bytes each op rank holds: ``loads`` (one per op rank, owner-mode and flat states
    together) and ``ideal`` (the total over the ranks); ``ratio`` = the largest load over the ideal (1.0: even)."""

    loads: tuple
    ideal: float

    @property
    def ratio(self) -> float:
        return max(self.loads) / self.ideal if self.ideal else 1.0


def balance(updates, shard_bytes, op_size: int) -> Balance:
    """The :class:`Balance` of ``updates`` (one :class:`Update` per optimized parameter) over ``op_size`` op ranks:
    an owner-mode parameter's states count for its owner; a flat or whole parameter's ``shard_bytes`` (what every
    rank holds of its states: its element states' shards with their padding and its scalar states, or all of them)
    for every rank. The ideal is the sum over the ranks divided by their number."""
    loads = [0] * op_size
    for update, flat in zip(updates, shard_bytes):
        if update.mode == OWNER:
            loads[update.owner] += update.state_bytes
        else:
            loads = [load + flat for load in loads]
    return Balance(tuple(loads), sum(loads) / op_size)


def every_rank_bytes(spec, update: Update) -> int:
    """What every rank holds of a flat or whole parameter's states (a flat one's element states as shards of
    ``spec.shard_size`` elements, the rest whole): the ``shard_bytes`` of :func:`balance`."""
    return sum(spec.shard_size * dtype_bytes(s.dtype) if update.mode == FLAT and s.layout == ELEMENT else s.nbytes
               for s in update.states)


def placeholder_shape(param_shape, shape) -> tuple:
    """The shape of a non-owner's stand-in for ``shape`` (a parameter's own shape, or one of its states'), in owner
    mode: every dimension that is one of the parameter's is 1, any other is kept (a constant such as the one element
    of a scalar state). The stand-in keeps the parameter's number of dimensions, so the optimizer takes the same
    branch for it, on a few elements; its values are never read."""
    dims = set(param_shape)
    return tuple(1 if d in dims else d for d in shape)


# --- what optimizers keep, for estimates before any optimizer exists -----------------------------------------------
@dataclass(frozen=True)
class OptimizerModel:
    """What an optimizer keeps per parameter (for :func:`mindzero.estimate_memory` and ``mindzero-estimate``, which
    see no optimizer): ``element`` states shaped as the parameter, ``scalars`` one-value states, and, for
    parameters of two or more dimensions, ``factored`` statistics (``"rows-cols"``: one of the leading
    dimensions' shape and one of the last dimension's per pair, as AdaFactor and CAME keep; ``"empty"``: an unused
    empty state, as mindone's Muon keeps for its matrices) instead of ``matrix_element`` element states.
    ``elementwise``: how its update treats a parameter of one dimension, and (``matrix_elementwise``) of more."""

    element: int
    scalars: int = 0
    elementwise: bool = True
    matrix_element: int = None  # element states of a matrix (default: element)
    factored: int = 0  # (rows, cols) pairs of a matrix
    matrix_scalars: int = 0
    matrix_empty: int = 0
    matrix_elementwise: bool = None  # default: elementwise

    def states(self, shape, dtype: str) -> tuple:
        """The :class:`StateSpec` of a parameter of ``shape`` whose states are in ``dtype``."""
        shape = tuple(shape)
        matrix = len(shape) >= 2
        element = self.element if not matrix or self.matrix_element is None else self.matrix_element
        shapes = [shape] * element + [(1,)] * (0 if matrix else self.scalars)
        if matrix:
            shapes += [shape[:-1], shape[:-2] + shape[-1:]] * self.factored
            shapes += [(1,)] * self.matrix_scalars + [(0,)] * self.matrix_empty
        return tuple(StateSpec(f"state{k}", f"state{k}", s, dtype, state_layout(shape, s)) for k, s in enumerate(shapes))

    def updates_elementwise(self, shape) -> bool:
        if len(tuple(shape)) >= 2 and self.matrix_elementwise is not None:
            return self.matrix_elementwise
        return self.elementwise

    def states_of(self, spec) -> tuple:
        """The states of the parameter ``spec`` (a :class:`~mindzero.core.plan.ShardSpec`), in fp32."""
        return self.states(spec.shape, "float32")

    def elementwise_of(self, spec) -> bool:
        return self.updates_elementwise(spec.shape) and all(s.layout != OTHER for s in self.states_of(spec))


@dataclass(frozen=True)
class MeasuredModel:
    """What a real optimizer keeps and how it updates, per parameter name (read from the optimizer and its
    element-wise probe by :func:`mindzero.engine.probe.measured_model`): ``{name: (elementwise, states)}``. Used
    like :class:`OptimizerModel` by the estimates of ``mindzero-plan``."""

    by_name: dict
    label: str = "the optimizer"
    splittable: bool = False  # disk offload may cut its parameters into pieces (core.offload.SPLITTABLE_OPTIMIZERS)

    def states_of(self, spec) -> tuple:
        return self.by_name[spec.name][1]

    def elementwise_of(self, spec) -> bool:
        return self.by_name[spec.name][0]

    @property
    def element(self) -> int:
        """Element states per parameter (the most any parameter has): the paper formula's count."""
        return max((sum(s.layout == ELEMENT for s in states) for _, states in self.by_name.values()), default=0)


_ADAM = OptimizerModel(2)
#: what each optimizer keeps, by the names ``estimate_memory`` and ``mindzero-estimate`` take (MindSpore's ``nn``
#: by its class name, torch-style ``mindspore.mint.optim`` / ``experimental.optim`` as ``mint.<name>``)
OPTIMIZER_MODELS = {
    "adamw": _ADAM, "adam": _ADAM, "adam_amsgrad": OptimizerModel(3), "lazyadam": _ADAM, "adamax": _ADAM,
    "sgd": OptimizerModel(2),  # nn.SGD: accum and stat, both shaped as the parameter
    "momentum": OptimizerModel(1), "adagrad": OptimizerModel(1), "proximal_adagrad": OptimizerModel(1),
    "adadelta": OptimizerModel(2), "rmsprop": OptimizerModel(2), "rmsprop_centered": OptimizerModel(3),
    "rprop": OptimizerModel(2), "ftrl": OptimizerModel(2), "asgd": OptimizerModel(1, scalars=2),
    "lamb": OptimizerModel(2, elementwise=False),
    # exp_avg shaped as the parameter; a matrix's exp_avg_sq one value, its rows and columns factored
    "adafactor": OptimizerModel(2, scalars=2, elementwise=False, matrix_element=1, factored=1, matrix_scalars=1),
    # m; a matrix's v one value, v and the residual v_res factored in rows and columns
    "came": OptimizerModel(2, scalars=4, elementwise=False, matrix_element=1, factored=2, matrix_scalars=1),
    # mindone's Muon: AdamW's two moments for vectors; a matrix's momentum and an empty second moment
    "muon": OptimizerModel(2, matrix_element=1, matrix_empty=1, matrix_elementwise=False),
    "mint.adam": _ADAM, "mint.adamw": _ADAM, "mint.adam_amsgrad": OptimizerModel(3), "mint.sgd": OptimizerModel(1),
    "mint.nadam": OptimizerModel(2, scalars=1), "mint.radam": _ADAM,
}


def planned_updates(specs, model, shard: bool, op_size: int, master_bytes=None, sharding: str = AUTO) -> tuple:
    """The :class:`Update` each of ``specs`` (the optimized parameters' plan entries) would get from an optimizer
    keeping what ``model`` says (an :class:`OptimizerModel`, in fp32, or a :class:`MeasuredModel`): whole where nothing is shared out (``shard`` False: stage 0; or the plan
    keeps the parameter whole), flat or owner by ``model``'s element-wise rule, owners assigned as a run assigns
    them (``master_bytes(spec)``: the full master an owner keeps, see :func:`owner_cost`); ``sharding``:
    ``update_sharding`` (:data:`EVERY_OWNER`: every shared-out parameter owner mode)."""
    decided = []
    for spec in specs:
        states = model.states_of(spec)
        if not shard or not spec.sharded:
            decided.append((WHOLE, states))
        elif sharding == AUTO and model.elementwise_of(spec):
            decided.append((FLAT, states))
        else:
            decided.append((OWNER, states))
    costs = [owner_cost(states, master_bytes(spec) if master_bytes else 0)
             for spec, (mode, states) in zip(specs, decided) if mode == OWNER]
    owners = iter(assign_owners(costs, op_size))
    return tuple(Update(mode, next(owners) if mode == OWNER else None, "", states) for mode, states in decided)
