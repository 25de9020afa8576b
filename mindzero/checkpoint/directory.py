"""Checkpoint directories (pure: no MindSpore): which are complete, the newest, the ``trainer_state`` each
rank saved beside its pieces, and the error every checkpoint operation raises."""
from __future__ import annotations

import json
from pathlib import Path

from .format import COMPLETE


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; the message names the file and what is wrong."""


def trainer_state_name(world_rank: int) -> str:
    """The file of world rank ``world_rank``'s ``trainer_state`` (every rank writes its own)."""
    return f"trainer_state_{world_rank}.json"


def read_trainer_state(ckpt_dir, world_rank: int = 0) -> dict:
    """The ``trainer_state`` world rank ``world_rank`` saved with a checkpoint (``{}`` if none was)."""
    path = Path(ckpt_dir) / trainer_state_name(world_rank)
    if not (Path(ckpt_dir) / COMPLETE).is_file():
        raise CheckpointError(f"{ckpt_dir}: not a complete mindzero checkpoint (no {COMPLETE} marker)")
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text())
    except ValueError as err:
        raise CheckpointError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(state).__name__}")
    return state


def complete_checkpoints(root, prefix: str = "step_") -> list:
    """The complete checkpoints ``root/<prefix>*`` (with a ``COMPLETE`` marker), oldest first by name;
    ``.partial`` leftovers of an interrupted save are skipped."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(prefix + "*")
                  if p.suffix != ".partial" and (p / COMPLETE).is_file())


def latest_checkpoint(root, prefix: str = "step_"):
    """The newest complete checkpoint under ``root`` (:func:`complete_checkpoints`), or ``None``."""
    done = complete_checkpoints(root, prefix)
    return done[-1] if done else None
