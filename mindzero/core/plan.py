"""Partition plan: which rank owns which slice of every parameter.

Vocabulary (used across mindzero):

* **full parameter**: a network Parameter as the user built it, shape ``S``,
  ``numel(S)`` elements.
* **shard**: this rank's contiguous 1/N of the *flattened, zero-padded* full
  parameter. ``shard_size = ceil(numel / N)``; rank ``r`` owns flat elements
  ``[r * shard_size, (r + 1) * shard_size)``. The padding lives only in the last
  rank(s) and is always zero. Every shape is shardable this way, including
  ``(7, 15)`` over 4 ranks and a scalar.
* **padded shard**: the shard including its padding; every rank's shard of one
  parameter has the same ``shard_size`` elements.
* **op group** (optimizer-parallel group): the ranks that share one copy of the
  sharded state; ``op_size`` below is its size and ``op_rank`` a rank's shard index in it.
* **replicated**: a parameter every rank keeps whole, with the reason recorded
  (``parallel_optimizer=False``, a buffer the network writes, frozen with ``shard_frozen=False``, empty, or
  at stage 3 smaller than ``stage3_param_persistence_threshold`` elements: a *persistent* parameter, whose
  gradient is all-reduced with the other persistent ones in one fused call instead of a gather and a
  reduce-scatter each).
* **frozen**: a parameter the optimizer does not update and the network only reads (a frozen backbone of
  adapter fine-tuning): sharded at stage 3 like a trainable one (``ShardSpec.optimized`` False), with no
  gradient and no optimizer state. A **buffer** the network writes (BatchNorm's moving statistics, a
  Parameter a Cell assigns to) is never sharded: a write to a gathered copy would be lost without an error
  (MindSpore runs ``ops.assign`` and BatchNorm's update on a non-Parameter and drops the result), so
  :func:`mindzero.core.introspect.written_buffers` finds them and each rank keeps its own.

This module is pure Python (no MindSpore import): the train step, the memory
report and the checkpoint tools all build the same :class:`PartitionPlan`.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

from .checks import is_int, require_int

# bytes per element of the dtypes a MindSpore network holds
DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}

REASON_USER = "parallel_optimizer=False"
REASON_BUFFER = "a buffer the network writes"
REASON_FROZEN = "frozen (not updated by the optimizer), kept whole: shard_frozen=False"
REASON_EMPTY = "has no elements"
REASON_PERSISTENT = "smaller than stage3_param_persistence_threshold: kept whole"
# the reason of every parameter the optimizer did not update, in plans and checkpoints before frozen weights
# were sharded (split-info format versions 1-2 still carry it): a per-rank value
REASON_NOT_OPTIMIZED = "not updated by the optimizer (buffer or frozen)"


def is_per_rank(reason: str) -> bool:
    """Whether a parameter the plan replicates for ``reason`` is a per-rank value: a buffer the network
    writes (BatchNorm's statistics; in older plans every parameter the optimizer did not update). Each rank
    keeps its own (a checkpoint stores every rank's), and it has no gradient or optimizer state. The one
    test of it, for plans (:attr:`ShardSpec.per_rank`) and split infos (``TensorEntry.per_rank``)."""
    return reason in (REASON_BUFFER, REASON_NOT_OPTIMIZED)


def valid_elements(numel: int, sharded: bool, offset: int, shard_size: int) -> int:
    """Real (non-padding) elements of a piece starting at flat ``offset`` with ``shard_size`` elements."""
    if not sharded:
        return numel
    return max(0, min(numel, offset + shard_size) - offset)


def shard_of_flat(flat, piece):
    """numpy twin of :func:`mindzero.comm.layout.own_shard`: ``flat`` (a full tensor, 1D numpy array) zero-padded,
    then ``piece``'s slice (a :class:`ShardSpec` or a split-info entry: ``sharded``, ``shard_size``,
    ``offset``, ``valid``); a copy of ``flat`` when not sharded."""
    if not piece.sharded:
        return flat.copy()
    import numpy as np

    out = np.zeros(piece.shard_size, dtype=flat.dtype)
    out[:piece.valid] = flat[piece.offset:piece.offset + piece.valid]
    return out


def shard_array(full, spec: "ShardSpec"):
    """This rank's padded shard (1D numpy array) of the full tensor ``full`` (any shape), per ``spec``.

    Raises:
        ValueError: ``full`` does not have the plan's element count.
    """
    import numpy as np

    flat = np.ascontiguousarray(full).reshape(-1)
    if flat.size != spec.numel:
        raise ValueError(f"tensor for {spec.name!r} has {flat.size} elements, the plan says {spec.numel}")
    return shard_of_flat(flat, spec)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (a name such as ``"float32"``)."""
    key = str(dtype).lower().replace("mindspore.", "")
    if key not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[key]


def shard_size_for(numel: int, op_size: int) -> int:
    """Elements per rank of a parameter with ``numel`` elements over ``op_size`` ranks: ``ceil(numel / op_size)``."""
    if op_size < 1:
        raise ValueError(f"op_size must be >= 1, got {op_size}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return -(-numel // op_size)


@dataclass(frozen=True)
class ShardSpec:
    """One parameter's partition over an op group, seen from one rank.

    ``offset`` is where this rank's shard starts in the flat padded parameter;
    ``valid`` is how many of its ``shard_size`` elements are real (the rest are
    padding). A replicated parameter has ``shard_size == numel`` and offset 0.
    """

    name: str
    shape: tuple  # full shape, as the user built it
    dtype: str
    op_size: int  # ranks in the op group
    op_rank: int  # the rank this spec is seen from: its shard index in the op group
    sharded: bool
    reason: str = ""  # why the parameter is replicated; empty when sharded
    optimized: bool = True  # the optimizer updates it (False: frozen, or a buffer): no gradient, no state

    def __post_init__(self):
        if not 0 <= self.op_rank < self.op_size:
            raise ValueError(f"op_rank must be in [0, op_size={self.op_size}), got {self.op_rank} "
                             f"for parameter {self.name!r}")
        if any(not is_int(d) or d < 0 for d in self.shape):
            raise ValueError(f"shape of parameter {self.name!r} must be non-negative ints, got {self.shape}")
        dtype_bytes(self.dtype)
        if not self.sharded and not self.reason:
            raise ValueError(f"replicated parameter {self.name!r} needs a reason")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def shard_size(self) -> int:  # elements per rank, padding included
        return shard_size_for(self.numel, self.op_size) if self.sharded else self.numel

    @property
    def padded_numel(self) -> int:  # 1D length of the flat padded full parameter
        return self.shard_size * self.op_size if self.sharded else self.numel

    @property
    def padding(self) -> int:  # zeros appended to the flat full parameter
        return self.padded_numel - self.numel

    @property
    def offset(self) -> int:  # first flat element of this rank's shard
        return self.op_rank * self.shard_size if self.sharded else 0

    @property
    def valid(self) -> int:  # real (non-padding) elements in this rank's shard
        return valid_elements(self.numel, self.sharded, self.offset, self.shard_size)

    @property
    def per_rank(self) -> bool:  # a buffer each rank keeps its own value of (see is_per_rank)
        return is_per_rank(self.reason)

    @property
    def local_numel(self) -> int:  # elements this rank stores for the parameter's sharded state
        return self.shard_size

    def owner_of(self, flat_index: int) -> int:
        """The op rank that owns flat element ``flat_index`` of the full parameter."""
        if not 0 <= flat_index < self.numel:
            raise IndexError(f"flat_index must be in [0, {self.numel}) for {self.name!r}, got {flat_index}")
        return flat_index // self.shard_size if self.sharded else self.op_rank

    @property
    def frozen(self) -> bool:
        """Sharded (at stage 3) but not updated by the optimizer: read-only."""
        return self.sharded and not self.optimized

    def for_rank(self, op_rank: int) -> "ShardSpec":
        """The same parameter's spec as seen from op rank ``op_rank``."""
        return ShardSpec(self.name, self.shape, self.dtype, self.op_size, op_rank, self.sharded, self.reason,
                         self.optimized)


@dataclass(frozen=True)
class ParamInfo:
    """What the plan needs to know of one parameter; built from a MindSpore Parameter or by hand."""

    name: str
    shape: tuple
    dtype: str = "float32"
    optimized: bool = True  # updated by the optimizer
    parallel_optimizer: bool = True  # the user's per-parameter opt-out
    written: bool = False  # the network writes it (a buffer: never sharded)


def _kept_whole_reason(p: ParamInfo, shard_frozen: bool) -> str:
    """Why ``p`` is replicated whatever the persistence rule ("" if it may be sharded)."""
    if not p.parallel_optimizer:
        return REASON_USER
    if not p.optimized and p.written:
        return REASON_BUFFER
    if not p.optimized and not shard_frozen:
        return REASON_FROZEN
    if math.prod(p.shape) == 0:
        return REASON_EMPTY
    return ""


@dataclass(frozen=True)
class Persistence:
    """Which shardable parameters the plan keeps whole (stage 3's ``stage3_param_persistence_threshold`` and
    ``stage3_model_persistence_threshold``, :class:`mindzero.core.config.Stage3Policy`): those of fewer than
    ``param_threshold`` elements, smallest first (ties in parameter order) while the kept ones hold at most
    ``model_threshold`` elements in all, or ``model_share`` of the non-empty parameters' elements (``None`` for
    both: no cap). The default keeps none. Validated here, once."""

    param_threshold: int = 0
    model_threshold: Optional[int] = None
    model_share: Optional[float] = None

    def __post_init__(self):
        require_int("stage3_param_persistence_threshold", self.param_threshold, 0)
        if self.model_threshold is not None:
            require_int("stage3_model_persistence_threshold", self.model_threshold, 0)
        if self.model_share is not None and not (isinstance(self.model_share, float) and 0.0 <= self.model_share <= 1.0):
            raise ValueError(f"the share of the model kept whole must be a float in [0, 1], got {self.model_share!r}")

    def kept(self, params: list, shard_frozen: bool) -> set:
        """The names of the parameters of ``params`` kept whole."""
        small = sorted(((math.prod(p.shape), i, p.name) for i, p in enumerate(params)
                        if not _kept_whole_reason(p, shard_frozen) and math.prod(p.shape) < self.param_threshold))
        total = self.model_threshold
        if total is None and self.model_share is not None:
            total = int(self.model_share * sum(math.prod(p.shape) for p in params))
        kept, used = set(), 0
        for numel, _, name in small:
            if total is not None and used + numel > total:
                break
            kept.add(name)
            used += numel
        return kept


@dataclass(frozen=True)
class PartitionPlan:
    """Every parameter's :class:`ShardSpec` for one rank of an op group.

    Build it with :meth:`build`; it is the one source of truth for which
    parameters are sharded, their padding and their owners.
    """

    op_size: int
    op_rank: int
    specs: tuple = field(default_factory=tuple)

    @staticmethod
    def build(params: Iterable[ParamInfo], op_size: int, op_rank: int, *, shard_frozen: bool = True,
              persistence: Persistence = Persistence()) -> "PartitionPlan":
        """Shard every non-empty parameter that the user did not opt out and the network does not write, over
        an op group of ``op_size`` ranks, seen from ``op_rank``: the optimized ones, and the frozen ones unless
        ``shard_frozen`` is False; the ones ``persistence`` keeps are kept whole (:data:`REASON_PERSISTENT`;
        stage 3's persistence thresholds; none at the other stages). The same at any ``op_size``.

        Raises:
            ValueError: ``op_size`` < 1, ``op_rank`` outside ``[0, op_size)``, or a duplicate parameter name.
        """
        require_int("op_size", op_size, 1)
        if not isinstance(persistence, Persistence):
            raise ValueError(f"persistence must be a Persistence, got {persistence!r}")
        params = list(params)
        kept = persistence.kept(params, shard_frozen)
        if not is_int(op_rank) or not 0 <= op_rank < op_size:
            raise ValueError(f"op_rank must be an int in [0, op_size={op_size}), got {op_rank!r}")
        specs, seen = [], set()
        for p in params:
            if p.name in seen:
                raise ValueError(f"parameter names must be unique, got {p.name!r} twice")
            seen.add(p.name)
            shape = tuple(int(d) for d in p.shape)
            reason = _kept_whole_reason(p, shard_frozen) or (REASON_PERSISTENT if p.name in kept else "")
            specs.append(ShardSpec(p.name, shape, str(p.dtype), op_size, op_rank, not reason, reason, p.optimized))
        return PartitionPlan(op_size, op_rank, tuple(specs))

    def __getitem__(self, name: str) -> ShardSpec:
        for s in self.specs:
            if s.name == name:
                return s
        raise KeyError(f"parameter {name!r} is not in the partition plan")

    def __iter__(self):
        return iter(self.specs)

    def __len__(self):
        return len(self.specs)

    @property
    def sharded(self) -> tuple:
        return tuple(s for s in self.specs if s.sharded)

    @property
    def replicated(self) -> tuple:
        return tuple(s for s in self.specs if not s.sharded)

    def for_rank(self, op_rank: int) -> "PartitionPlan":
        return PartitionPlan(self.op_size, op_rank, tuple(s.for_rank(op_rank) for s in self.specs))

    def fingerprint(self) -> str:
        """A hash of what every rank must agree on (names, shapes, dtypes, sharding, op group size)."""
        text = repr([(s.name, s.shape, s.dtype, s.sharded, s.optimized) for s in self.specs] + [self.op_size])
        return hashlib.sha256(text.encode()).hexdigest()

    def summary(self) -> str:
        """Human-readable lines: counts, padding and the replicated parameters with reasons."""
        pad = sum(s.padding for s in self.sharded)
        frozen = sum(s.frozen for s in self.specs)
        lines = [f"partition plan: {len(self.sharded)} sharded ({frozen} of them frozen: sharded at stage 3, "
                 f"no gradient or optimizer state), {len(self.replicated)} replicated parameters over an op group "
                 f"of {self.op_size} (op rank {self.op_rank}); padding {pad} elements in all"]
        kept = [s for s in self.replicated if s.reason == REASON_PERSISTENT]
        for s in self.replicated:
            if s.reason != REASON_PERSISTENT:
                lines.append(f"  replicated {s.name} {s.shape}: {s.reason}")
        if kept:  # often a hundred biases and norms: one line
            names = ", ".join(s.name for s in kept[:3]) + (", ..." if len(kept) > 3 else "")
            lines.append(f"  replicated {len(kept)} parameters of {sum(s.numel for s in kept)} elements ({names}): "
                         f"{REASON_PERSISTENT}, gradients all-reduced together")
        return "\n".join(lines)
