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

    def __post_init__(self):
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
