"""Stage policies and the validated configuration of one ZeRO train step (no MindSpore import).

A stage is data, chosen once: :data:`STAGES` maps the stage number to what it
shards. Everything else asks the policy, never ``if stage in (1, 2)``.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass


@dataclass(frozen=True)
class StagePolicy:
    """What one ZeRO stage keeps as 1/N shards on each rank."""

    stage: int
    shard_optimizer_states: bool  # stages 1-3: moments (and a master shard) are shards
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
    if isinstance(zero_stage, bool) or not isinstance(zero_stage, numbers.Integral) or int(zero_stage) not in STAGES:
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    return STAGES[int(zero_stage)]


@dataclass(frozen=True)
class ZeroConfig:
    """The train-step options of :func:`mindzero.prepare_train_network`, validated on construction."""

    zero_stage: int = 0
    gradient_accumulation_steps: int = 1
    clip_grad: bool = False
    clip_norm: float = 1.0
    drop_overflow_update: bool = True
    verbose: bool = False
    precision: "MixedPrecision" = None  # None: MixedPrecision() (no mixed precision)

    def __post_init__(self):
        if self.precision is None:
            object.__setattr__(self, "precision", MixedPrecision())
        if not isinstance(self.precision, MixedPrecision):
            raise ValueError(f"precision must be a MixedPrecision (MixedPrecision.parse(param_dtype, reduce_dtype)), "
                             f"got {self.precision!r}")
        stage_policy(self.zero_stage)
        steps = self.gradient_accumulation_steps
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be an int >= 1, got {steps!r}")
        if not isinstance(self.clip_grad, bool):
            raise ValueError(f"clip_grad must be a bool, got {self.clip_grad!r}")
        if isinstance(self.clip_norm, bool) or not isinstance(self.clip_norm, numbers.Real) or not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be a number > 0, got {self.clip_norm!r}")
        if not isinstance(self.drop_overflow_update, bool):
            raise ValueError(f"drop_overflow_update must be a bool, got {self.drop_overflow_update!r}")

    @property
    def policy(self) -> StagePolicy:
        return stage_policy(self.zero_stage)


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
    accumulated) in: ``param_dtype`` (the default, half the bytes of fp32) or ``"float32"``.
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
            if reduce_dtype is not None:
                raise ValueError(f"reduce_dtype={reduce_dtype!r} needs param_dtype: reduce_dtype is the dtype "
                                 "gradients of a mixed-precision run are reduced in; pass param_dtype=float16 "
                                 "or bfloat16 too, or leave reduce_dtype=None")
            return MixedPrecision()
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
        return self.param_dtype is not None

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
        if isinstance(size, bool) or not isinstance(size, numbers.Real) or not size >= 1 or size != size:
            raise ValueError(f"comm_fusion[{kind!r}]['bucket_size'] must be a number of bytes >= 1, got {size!r}")
        sizes[kind] = int(size)
    return FusionConfig(**sizes)
