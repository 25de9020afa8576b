"""The options of a ZeRO train step: one frozen tree of policies that validate themselves (pure Python).

:class:`ZeroConfig` is the one home of every option of :func:`mindzero.prepare_train_network`: the stage
(:class:`StagePolicy`: what it shards; everything asks the policy, never ``if stage in (1, 2)``), the loss
scale (:class:`LossScale`), the EMA (:class:`EmaPolicy`), mixed precision (:class:`MixedPrecision`),
communication fusion (:class:`FusionConfig`), the groups (:class:`GroupPolicy`) and the flags. Each policy
parses its own arguments and raises ``ValueError`` naming the argument, the value and the rule. The
keyword arguments (:meth:`ZeroConfig.from_arguments`) and the settings file (:mod:`mindzero.core.settings`,
which only adds the file and key to the errors) feed the same parsers; :mod:`mindzero.core.options` holds the table
of every option and ``merge_settings``, the one rule for a setting given both ways. :class:`CheckpointOptions` does
the same for ``ZeroCheckpoint``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from .checks import is_int, is_number, require_bool, require_int
from .offload import OffloadPolicy
from .optim_plan import UPDATE_SHARDINGS
from .options import ARGUMENT_DEFAULTS
from .plan import Persistence
from .quant import GatherQuantization
from .units import GatherUnits


@dataclass(frozen=True)
class StagePolicy:
    """What one ZeRO stage keeps as 1/N shards on each rank."""

    stage: int
    shard_optimizer_states: bool  # stages 1-3: moments (and fp32 master shards of param_dtype runs) are shards
    shard_gradients: bool  # stages 2-3: gradients are reduce-scattered as produced; accumulation buffers are shards
    shard_parameters: bool  # stage 3: the network holds shards; full values exist only around their use


STAGES = {
    0: StagePolicy(0, False, False, False),
    1: StagePolicy(1, True, False, False),
    2: StagePolicy(2, True, True, False),
    3: StagePolicy(3, True, True, True),
}


def stage_policy(zero_stage) -> StagePolicy:
    """The policy of ``zero_stage``.

    Raises:
        ValueError: ``zero_stage`` is not 0, 1, 2 or 3.
    """
    if not is_int(zero_stage) or int(zero_stage) not in STAGES:
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    return STAGES[int(zero_stage)]


PARAM_DTYPES = ("float16", "bfloat16")  # what a mixed-precision run holds its parameters in
MASTER_DTYPE = "float32"  # the optimizer's master values and states in a mixed-precision run


def dtype_name(dtype) -> str:
    """``"float16"`` from ``ms.float16``, ``"float16"``, ``"Float16"`` or ``numpy.float16`` (no MindSpore import)."""
    name = getattr(dtype, "__name__", None) if isinstance(dtype, type) else None
    return str(name or dtype).lower().replace("mindspore.", "")


@dataclass(frozen=True)
class MixedPrecision:
    """The mixed-precision policy of a train step (FSDP2's ``MixedPrecisionPolicy``, DeepSpeed's fp16/bf16).

    ``param_dtype``: ``None`` (default: parameters trained in their own dtype, no master copy) or
    ``"float16"``/``"bfloat16"``: the network holds its optimized parameters in that dtype (full at stages
    0-2, shards at stage 3) and the optimizer updates fp32 master values (full at stage 0, shards from
    stage 1), cast back after each update. ``reduce_dtype``: the dtype gradients are reduced (and
    accumulated) in: ``param_dtype`` (the default, half the bytes of fp32) or ``"float32"``. Without
    ``param_dtype`` (FSDP2's ``MixedPrecisionPolicy(reduce_dtype=...)`` alone): ``"float16"`` or ``"bfloat16"``
    reduces the gradients of fp32 parameters in 16 bits, widened to fp32 before the mean (no masters: the
    parameters are fp32); ``"float16"`` needs a loss scale (:meth:`ZeroConfig` checks), ``"float32"`` is
    the default.
    """

    param_dtype: str = None
    reduce_dtype: str = None

    @staticmethod
    def parse(param_dtype=None, reduce_dtype=None) -> "MixedPrecision":
        """Validate the two arguments of ``prepare_train_network``.

        Raises:
            ValueError: naming the argument, the value and the rule.
        """
        if param_dtype is None:
            reduce = None if reduce_dtype is None else dtype_name(reduce_dtype)
            if reduce not in (None, MASTER_DTYPE, *PARAM_DTYPES):
                raise ValueError(f"reduce_dtype must be None, float32, float16 or bfloat16 (a 16-bit dtype reduces "
                                 f"gradients in half the bytes), got {reduce_dtype!r}")
            return MixedPrecision(None, None if reduce == MASTER_DTYPE else reduce)
        param = dtype_name(param_dtype)
        if param not in PARAM_DTYPES:
            raise ValueError(f"param_dtype must be None, float16 or bfloat16 (mindspore dtype or name), "
                             f"got {param_dtype!r}")
        reduce = param if reduce_dtype is None else dtype_name(reduce_dtype)
        if reduce not in (param, MASTER_DTYPE):
            raise ValueError(f"reduce_dtype must be None (= param_dtype), {param} or float32 with "
                             f"param_dtype={param}, got {reduce_dtype!r}")
        return MixedPrecision(param, reduce)

    @property
    def enabled(self) -> bool:
        """Parameters held in ``param_dtype`` with fp32 masters."""
        return self.param_dtype is not None

    @property
    def reduce_in(self):
        """The dtype (name) gradients are reduced and accumulated in, when not their parameters' own: with
        ``param_dtype``, ``reduce_dtype``; without it, a 16-bit ``reduce_dtype`` or ``None``."""
        return self.reduce_dtype

    @property
    def widens(self) -> bool:
        """Whether reduced gradients are cast to fp32 before the mean (masters, or a 16-bit reduction)."""
        return self.reduce_dtype is not None

    def held(self, dtype: str, optimized: bool, keep_fp32: bool = False) -> str:
        """The dtype a parameter of ``dtype`` is held in: ``param_dtype`` for an optimized float32 one, unless
        ``keep_fp32`` (its Cell computes in fp32, e.g. BatchNorm: it stays fp32, as FSDP keeps BatchNorm)."""
        if self.enabled and optimized and not keep_fp32 and dtype_name(dtype) == MASTER_DTYPE:
            return self.param_dtype
        return dtype_name(dtype)


FUSION_KINDS = ("allreduce", "reduce_scatter", "allgather")


@dataclass(frozen=True)
class FusionConfig:
    """Bucket size in bytes per collective kind; ``None`` means one collective per tensor (no fusion)."""

    allreduce: int = None
    reduce_scatter: int = None
    allgather: int = None

    def bucket_bytes(self, kind: str):
        return getattr(self, kind)

    @property
    def any(self) -> bool:
        return any(getattr(self, k) is not None for k in FUSION_KINDS)


def parse_comm_fusion(comm_fusion) -> FusionConfig:
    """mindone's ``comm_fusion`` dict to a :class:`FusionConfig`.

    ``comm_fusion`` is ``None`` (no fusion) or a dict whose keys are among ``allreduce``,
    ``reduce_scatter`` and ``allgather``, each ``{"openstate": bool, "bucket_size": bytes}``
    (``openstate`` defaults to ``True``). A kind left out is not fused. A tensor larger than the
    bucket travels alone.

    Raises:
        ValueError: naming the key, the value and the rule.
    """
    if comm_fusion is None:
        return FusionConfig()
    if not isinstance(comm_fusion, dict):
        raise ValueError(f"comm_fusion must be None or a dict such as {{'allreduce': {{'openstate': True, "
                         f"'bucket_size': 5e8}}}}, got {comm_fusion!r}")
    sizes = {}
    for kind, entry in comm_fusion.items():
        if kind not in FUSION_KINDS:
            raise ValueError(f"comm_fusion key {kind!r} is not one of {list(FUSION_KINDS)}")
        if not isinstance(entry, dict) or set(entry) - {"openstate", "bucket_size"}:
            raise ValueError(f"comm_fusion[{kind!r}] must be a dict with keys 'openstate' (bool) and "
                             f"'bucket_size' (bytes > 0), got {entry!r}")
        state = entry.get("openstate", True)
        if not isinstance(state, bool):
            raise ValueError(f"comm_fusion[{kind!r}]['openstate'] must be a bool, got {state!r}")
        if not state:
            continue
        size = entry.get("bucket_size")
        if not is_number(size) or not size >= 1:
            raise ValueError(f"comm_fusion[{kind!r}]['bucket_size'] must be a number of bytes >= 1, got {size!r}")
        sizes[kind] = int(size)
    return FusionConfig(**sizes)


@dataclass(frozen=True)
class LossScale:
    """``scale_sense``: the loss scale the step starts with, and how it changes: ``dynamic`` (a settings
    file's ``{init_loss_scale, scale_factor, scale_window}``: the engine makes MindSpore's
    ``DynamicLossScaleUpdateCell``), or ``manager``, a loss-scale update Cell the user passed (any object
    with ``get_loss_scale()``, used as it is); neither: a static scale."""

    value: float = 1.0
    dynamic: Optional[tuple] = None  # (scale_factor, scale_window)
    manager: object = None

    @staticmethod
    def parse(scale_sense) -> "LossScale":
        """From a number, a scalar Tensor, a loss-scale update Cell or a settings mapping.

        Raises:
            ValueError: naming ``scale_sense``, the value and the rule.
        """
        if isinstance(scale_sense, dict):
            return LossScale._parse_mapping(scale_sense)
        manager = None
        if hasattr(scale_sense, "get_loss_scale"):  # nn.DynamicLossScaleUpdateCell and its like
            value, manager = float(scale_sense.get_loss_scale()), scale_sense
        elif hasattr(scale_sense, "asnumpy") and hasattr(scale_sense, "size"):  # a MindSpore Tensor
            if scale_sense.size != 1:
                raise ValueError(f"scale_sense must be a scalar Tensor, got shape {tuple(scale_sense.shape)}")
            value = float(scale_sense.asnumpy().reshape(()))
        elif is_number(scale_sense):
            value = float(scale_sense)
        else:
            raise ValueError(f"scale_sense must be a number, a Tensor or a loss-scale update Cell with "
                             f"get_loss_scale() (e.g. nn.DynamicLossScaleUpdateCell), got {scale_sense!r}")
        if not value > 0:
            raise ValueError(f"scale_sense must be > 0, got {value}")
        return LossScale(value, None, manager)

    @staticmethod
    def _parse_mapping(mapping: dict) -> "LossScale":
        keys = {"init_loss_scale", "scale_factor", "scale_window"}
        if set(mapping) != keys:
            raise ValueError("scale_sense as a mapping must have exactly the keys init_loss_scale, scale_factor, "
                             f"scale_window (nn.DynamicLossScaleUpdateCell), got {sorted(mapping)}")
        init, factor, window = mapping["init_loss_scale"], mapping["scale_factor"], mapping["scale_window"]
        if not (is_number(init) and init > 0 and is_number(factor) and factor > 1 and is_int(window) and window >= 1):
            raise ValueError("scale_sense: init_loss_scale must be a number > 0, scale_factor a number > 1, "
                             f"scale_window an int >= 1, got {mapping}")
        return LossScale(float(init), (float(factor), int(window)))


@dataclass(frozen=True)
class EmaPolicy:
    """An exponential moving average of the optimized parameters: its ``decay`` and initial step count."""

    decay: float
    updates: int = 0

    @staticmethod
    def parse(ema, updates=0) -> "Optional[EmaPolicy]":
        """From ``ema`` (``None``, a decay in (0, 1), or mindone's ``EMA`` with ``ema_decay``) and ``updates``.

        Raises:
            ValueError: naming the argument, the value and the rule.
        """
        if not is_int(updates) or updates < 0:
            raise ValueError(f"updates (the EMA's initial step count) must be an int >= 0, got {updates!r}")
        if ema is None:
            if updates != 0:
                raise ValueError(f"updates is the EMA's initial step count and needs ema; got updates={updates!r} "
                                 "with ema=None")
            return None
        decay = getattr(ema, "ema_decay", ema)
        if not is_number(decay) or not 0 < decay < 1:
            raise ValueError(f"ema must be None, a decay in (0, 1) or an EMA object with ema_decay in (0, 1) "
                             f"(mindone's EMA), got {ema!r}")
        return EmaPolicy(float(decay), int(updates))


@dataclass(frozen=True)
class GroupPolicy:
    """Which ranks shard together: ``None`` everywhere (the whole world), the names of this rank's op and dp
    groups (hybrid sharding), or, from a settings file, ``hybrid_shard_size`` (ranks per op group: the
    groups are made by :func:`mindzero.create_hybrid_groups`). Whether the names fit the world is checked
    across ranks when the world is resolved (:func:`mindzero.comm.groups.world_for`)."""

    optimizer_parallel_group: Optional[str] = None
    dp_group: Optional[str] = None
    hybrid_shard_size: Optional[int] = None

    def __post_init__(self):
        for name in ("optimizer_parallel_group", "dp_group"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be None or a group name (str), got {value!r}")
        size = self.hybrid_shard_size
        if size is not None and (not is_int(size) or size < 1):
            raise ValueError(f"hybrid_shard_size must be None or an int >= 1 (ranks per op group), got {size!r}")
        named = [n for n in ("optimizer_parallel_group", "dp_group") if getattr(self, n) is not None]
        if size is not None and named:
            raise ValueError(f"hybrid_shard_size={size} makes the groups itself; got {named[0]}="
                             f"{getattr(self, named[0])!r} too: give one of them")


#: stage 3 keeps its small parameters whole up to this share of the model's elements in all, unless
#: ``stage3_model_persistence_threshold`` gives the cap
DEFAULT_PERSISTENCE_SHARE = 0.01


@dataclass(frozen=True)
class Stage3Policy:
    """Stage 3's options, and the two rules they follow, checked here once: ``regather`` (graph mode: gather
    each parameter again in backward instead of keeping its full value from forward), ``shard_frozen`` (also
    shard the parameters the optimizer does not update), ``quantization`` (int8 weight gathers,
    :mod:`mindzero.core.quant`), ``units`` (parameters sharing one all-gather, :mod:`mindzero.core.units`) and
    ``param_persistence_threshold`` (parameters of fewer elements are kept whole: no gather, one fused all-reduce of
    their gradients; DeepSpeed's ``stage3_param_persistence_threshold``, 1e5 by default as there; below stage 3
    it changes nothing, as there) and ``model_persistence_threshold`` (the most elements kept whole in all,
    smallest parameters first; DeepSpeed's ``stage3_model_persistence_threshold``; ``None``: 1% of the
    model's elements, so that a small model, all of whose tensors are below the threshold, is still sharded).
    ``quantization`` and ``units`` need ``zero_stage=3`` (:meth:`check_stage`); ``units`` needs graph mode and
    ``regather`` applies in graph mode only (:meth:`for_mode`)."""

    regather: bool = True
    shard_frozen: bool = True
    quantization: Optional[GatherQuantization] = None
    units: Optional[GatherUnits] = None
    param_persistence_threshold: int = ARGUMENT_DEFAULTS["stage3_param_persistence_threshold"]
    model_persistence_threshold: Optional[int] = ARGUMENT_DEFAULTS["stage3_model_persistence_threshold"]

    def __post_init__(self):
        require_bool("stage3_regather", self.regather)
        require_bool("shard_frozen", self.shard_frozen)
        self.persistence(3)  # the thresholds are validated where they are applied (Persistence)
        for name, value, cls in (("gather_quantization", self.quantization, GatherQuantization),
                                 ("gather_units", self.units, GatherUnits)):
            if value is not None and not isinstance(value, cls):
                raise ValueError(f"{name} must be None or a {cls.__name__}, got {value!r}")

    def persistence(self, zero_stage) -> Persistence:
        """What :meth:`mindzero.core.plan.PartitionPlan.build` keeps whole at ``zero_stage``: stage 3's
        thresholds (the cap in all: ``model_persistence_threshold``, or :data:`DEFAULT_PERSISTENCE_SHARE` of the
        model); nothing below stage 3."""
        if not stage_policy(zero_stage).shard_parameters:
            return Persistence()
        share = DEFAULT_PERSISTENCE_SHARE if self.model_persistence_threshold is None else None
        return Persistence(self.param_persistence_threshold, self.model_persistence_threshold, share)

    def check_stage(self, zero_stage) -> None:
        """Refuse the stage-3-only options below stage 3.

        Raises:
            ValueError: naming the option, its value and the stage.
        """
        if stage_policy(zero_stage).shard_parameters:
            return
        if self.quantization is not None:
            raise ValueError(f"gather_quantization={self.quantization.kind!r} needs zero_stage=3: it quantizes stage 3's "
                             f"weight gathers, and zero_stage={zero_stage} has none (stages 1-2 gather into the full "
                             "parameter each rank keeps, which must stay exact)")
        if self.units is not None:
            raise ValueError(f"gather_units={self.units.as_setting()!r} needs zero_stage=3: it groups stage 3's weight "
                             f"gathers, and zero_stage={zero_stage} has none")

    def for_mode(self, graph_mode: bool) -> "Stage3Policy":
        """The policy as it runs in this execution mode: PyNative does not re-gather (its recompute loses the
        gather's ``bprop``).

        Raises:
            ValueError: ``units`` in PyNative mode (it would run each read's gather separately, so each would
                all-gather its whole unit).
        """
        if graph_mode:
            return self
        if self.units is not None:
            raise ValueError(f"gather_units={self.units.as_setting()!r} needs GRAPH_MODE: PyNative runs every read's "
                             "gather separately, so each would all-gather its whole unit; pass gather_units=None")
        return Stage3Policy(False, self.shard_frozen, self.quantization, None, self.param_persistence_threshold,
                            self.model_persistence_threshold)


@dataclass(frozen=True)
class ZeroConfig:
    """Every option of one ZeRO train step, validated on construction (the first seven fields keep their
    order: ``ZeroConfig(zero_stage, gradient_accumulation_steps, clip_grad, ...)``)."""

    zero_stage: int = 0
    gradient_accumulation_steps: int = 1
    clip_grad: bool = False
    clip_norm: float = 1.0
    drop_overflow_update: bool = True
    verbose: bool = False
    precision: "MixedPrecision" = None  # None: MixedPrecision() (no mixed precision)
    loss_scale: LossScale = field(default_factory=LossScale)
    ema: Optional[EmaPolicy] = None
    fusion: "FusionConfig" = None  # None: FusionConfig() (no fusion)
    groups: GroupPolicy = field(default_factory=GroupPolicy)
    stage3: Stage3Policy = field(default_factory=Stage3Policy)
    offload: OffloadPolicy = None  # None: no offload; OffloadPolicy.parse(optimizer_offload, offload_dir, ...)
    compile_cache: Optional[str] = None  # a directory for the compiled train step (mindzero.engine.compile_cache)
    update_sharding: str = "auto"  # one of UPDATE_SHARDINGS (mindzero.core.optim_plan's note)

    def __post_init__(self):
        if self.precision is None:
            object.__setattr__(self, "precision", MixedPrecision())
        if self.fusion is None:
            object.__setattr__(self, "fusion", FusionConfig())
        for name, cls in (("precision", MixedPrecision), ("fusion", FusionConfig), ("loss_scale", LossScale),
                          ("groups", GroupPolicy), ("stage3", Stage3Policy)):
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"{name} must be a {cls.__name__}, got {getattr(self, name)!r}")
        if self.ema is not None and not isinstance(self.ema, EmaPolicy):
            raise ValueError(f"ema must be None or an EmaPolicy, got {self.ema!r}")
        stage_policy(self.zero_stage)
        require_int("gradient_accumulation_steps", self.gradient_accumulation_steps, 1)
        for name in ("clip_grad", "drop_overflow_update", "verbose"):
            require_bool(name, getattr(self, name))
        if self.offload is None:
            object.__setattr__(self, "offload", OffloadPolicy.parse(False))
        if not isinstance(self.offload, OffloadPolicy):
            raise ValueError(f"offload must be an OffloadPolicy, got {self.offload!r}")
        self.offload.check_stage(self.zero_stage)
        if self.compile_cache is not None:
            if not isinstance(self.compile_cache, (str, os.PathLike)) or str(self.compile_cache) == "":
                raise ValueError(f"compile_cache must be None or a directory path, got {self.compile_cache!r}")
            object.__setattr__(self, "compile_cache", str(self.compile_cache))
        if self.update_sharding not in UPDATE_SHARDINGS:
            raise ValueError(f"update_sharding must be one of {list(UPDATE_SHARDINGS)}, got {self.update_sharding!r}")
        if not is_number(self.clip_norm) or not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be a number > 0, got {self.clip_norm!r}")
        self.stage3.check_stage(self.zero_stage)
        if self.precision.reduce_dtype == "float16" and not self.precision.enabled and self.loss_scale.value == 1.0 \
                and self.loss_scale.dynamic is None and self.loss_scale.manager is None:
            raise ValueError("reduce_dtype='float16' without param_dtype needs a loss scale, so that small "
                             "gradients do not underflow in fp16: pass scale_sense (a number > 1, e.g. 1024, or "
                             "nn.DynamicLossScaleUpdateCell(2**16, 2, 1000)); got scale_sense=1.0")

    @property
    def policy(self) -> StagePolicy:
        return stage_policy(self.zero_stage)

    @property
    def persistence(self) -> Persistence:
        """Which parameters the plan keeps whole (:meth:`Stage3Policy.persistence`)."""
        return self.stage3.persistence(self.zero_stage)

    @staticmethod
    def from_arguments(arguments: dict) -> "ZeroConfig":
        """The config of ``prepare_train_network``'s keyword arguments (or a settings mapping's keys), each
        parsed by its policy; a key left out takes its default (:data:`mindzero.core.options.ARGUMENT_DEFAULTS`).

        Raises:
            ValueError: a bad value (naming the argument, the value and the rule) or an unknown key.
            NotImplementedError: ``parallel_modules`` given (mindone's argument; stage 3 needs no wrappers).
        """
        unknown = sorted(set(arguments) - set(ARGUMENT_DEFAULTS))
        if unknown:
            raise ValueError(f"unknown option {unknown[0]!r}; the options are {sorted(ARGUMENT_DEFAULTS)}")
        a = {**ARGUMENT_DEFAULTS, **arguments}
        if a["parallel_modules"] is not None:
            raise NotImplementedError("parallel_modules: user-supplied per-layer parallel wrappers are not needed "
                                      "(stage 3 works for any Cell) and not supported; pass None")
        stage_policy(a["zero_stage"])  # the stage first: its error is the one a user needs
        return ZeroConfig(a["zero_stage"], a["gradient_accumulation_steps"], a["clip_grad"], a["clip_norm"],
                          a["drop_overflow_update"], a["verbose"], MixedPrecision.parse(a["param_dtype"], a["reduce_dtype"]),
                          loss_scale=LossScale.parse(a["scale_sense"]), ema=EmaPolicy.parse(a["ema"], a["updates"]),
                          fusion=parse_comm_fusion(a["comm_fusion"]),
                          groups=GroupPolicy(a["optimizer_parallel_group"], a["dp_group"], a["hybrid_shard_size"]),
                          offload=OffloadPolicy.parse(a["optimizer_offload"], a["offload_dir"], a["offload_chunk_mb"],
                                                      a["offload_keep"]),
                          compile_cache=a["compile_cache"], update_sharding=a["update_sharding"],
                          stage3=Stage3Policy(a["stage3_regather"], a["shard_frozen"],
                                              GatherQuantization.parse(a["gather_quantization"]),
                                              GatherUnits.parse(a["gather_units"]),
                                              a["stage3_param_persistence_threshold"],
                                              a["stage3_model_persistence_threshold"]))


def check_option(key: str, value) -> None:
    """Validate one option alone, by the policy that parses it (for a settings file, key by key).

    Raises:
        ValueError: naming the option, the value and the rule.
    """
    if key == "optimizer_offload":  # its companion offload_dir is checked with it (the settings' pair rule)
        OffloadPolicy.tier_of(value)
        return
    needs = {"optimizer_offload": "disk"} if key == "offload_dir" else {}  # the only tier offload_dir is for
    ZeroConfig.from_arguments({**_CHECK_ALONE, **needs, key: value})


#: the other options while one is checked alone: the ones a value may need beside it (stage 3 for its options, an
#: EMA for ``updates``, a loss scale for a 16-bit ``reduce_dtype``); the checked key overrides its own
_CHECK_ALONE = {"zero_stage": 3, "ema": 0.5, "scale_sense": 2.0}
