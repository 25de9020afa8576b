"""mindzero: ZeRO (stages 0-3) for MindSpore data-parallel training.

``train_net = prepare_train_network(net_with_loss, optimizer, zero_stage=2)``;
``loss, overflow, scale = train_net(*inputs)``.

The package (docs/architecture.md): :mod:`mindzero.core` is pure Python (options, topology, plans, state
records, formulas; it imports without MindSpore), :mod:`mindzero.engine` builds and runs the MindSpore
train step, :mod:`mindzero.comm` is the only place collectives are made, :mod:`mindzero.checkpoint` saves,
loads and converts checkpoints, :mod:`mindzero.launch` starts jobs. The pure names below are imported at
once; the names that need MindSpore on first use.
"""
import importlib

from .core.config import (STAGES, EmaPolicy, GroupPolicy, LossScale, MixedPrecision,  # noqa: F401 (public)
                          StagePolicy, ZeroConfig, stage_policy)
from .core.options import CheckpointOptions  # noqa: F401 (public)
from .core.estimate import estimate_memory  # noqa: F401
from .core.host import release_host_memory  # noqa: F401
from .core.memory import expected_bytes  # noqa: F401
from .core.offload import OffloadError, OffloadPolicy  # noqa: F401
from .core.plan import ParamInfo, PartitionPlan, ShardSpec  # noqa: F401
from .core.settings import ConfigError, load_config  # noqa: F401
from .core.topology import HybridLayout, LayoutError, World  # noqa: F401

__version__ = "0.1.0"

_LAZY = {
    "prepare_train_network": "mindzero.engine.prepare",
    "memory_report": "mindzero.engine.report",
    "register_elementwise_optimizer": "mindzero.engine.probe",
    "lazy_init": "mindzero.engine.materialize",
    "gather_full_state_dict": "mindzero.checkpoint.live",
    "load_checkpoint": "mindzero.checkpoint.live",
    "save_full_checkpoint": "mindzero.checkpoint.pretrained",
    "load_pretrained": "mindzero.checkpoint.pretrained",
    "latest_checkpoint": "mindzero.checkpoint.directory",
    "read_trainer_state": "mindzero.checkpoint.directory",
    "complete_checkpoints": "mindzero.checkpoint.directory",
    "CheckpointError": "mindzero.checkpoint.directory",
    "save_checkpoint": "mindzero.checkpoint.save",
    "wait_for_save": "mindzero.checkpoint.save",
    "AsyncSave": "mindzero.checkpoint.save",
    "ZeroCheckpoint": "mindzero.checkpoint.callback",
    "merge_checkpoint": "mindzero.checkpoint.offline",
    "reshard_checkpoint": "mindzero.checkpoint.offline",
    "convert_checkpoints": "mindzero.checkpoint.offline",
    "verify_checkpoint": "mindzero.checkpoint.offline",
    "MergeError": "mindzero.checkpoint.source",
    "create_hybrid_groups": "mindzero.comm.groups",
    "start_data_parallel": "mindzero.comm.start",
    "finish_rank": "mindzero.launch.worker",
    "predict_peak": "mindzero.planner.planner",
    "plan": "mindzero.planner.planner",
    "Rehearsal": "mindzero.planner.planner",
    "rehearse": "mindzero.comm.groups",
}

__all__ = sorted(["STAGES", "CheckpointOptions", "EmaPolicy", "GroupPolicy", "LossScale", "MixedPrecision",
                  "StagePolicy", "ZeroConfig", "stage_policy", "estimate_memory", "release_host_memory",
                  "expected_bytes", "ParamInfo", "PartitionPlan", "ShardSpec", "ConfigError", "load_config",
                  "HybridLayout", "LayoutError", "World", "OffloadError", "OffloadPolicy", *_LAZY])


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mindzero' has no attribute {name!r}")
