"""mindzero: ZeRO (stages 0-3) for MindSpore data-parallel training.

``train_net = prepare_train_network(net_with_loss, optimizer, zero_stage=2)``;
``loss, overflow, scale = train_net(*inputs)``.

The pure-Python parts (:mod:`mindzero.plan`, :mod:`mindzero.config`, the settings
file :mod:`mindzero.settings`, the formulas in :mod:`mindzero.memory`) import without
MindSpore; the names that need MindSpore are imported on first use.
"""
from importlib import import_module

from .config import STAGES, MixedPrecision, StagePolicy, ZeroConfig, stage_policy
from .estimate import estimate_memory
from .memory import expected_bytes
from .layout import HybridLayout, LayoutError
from .plan import ParamInfo, PartitionPlan, ShardSpec
from .settings import ConfigError, load_config

__version__ = "0.1.0"

_LAZY = {
    "prepare_train_network": "mindzero.prepare",
    "gather_full_state_dict": "mindzero.checkpoint",
    "save_checkpoint": "mindzero.checkpoint",
    "load_checkpoint": "mindzero.checkpoint",
    "save_full_checkpoint": "mindzero.checkpoint",
    "latest_checkpoint": "mindzero.checkpoint",
    "read_trainer_state": "mindzero.checkpoint",
    "complete_checkpoints": "mindzero.checkpoint",
    "wait_for_save": "mindzero.checkpoint",
    "AsyncSave": "mindzero.checkpoint",
    "CheckpointError": "mindzero.checkpoint",
    "ZeroCheckpoint": "mindzero.callback",
    "merge_checkpoint": "mindzero.merge",
    "reshard_checkpoint": "mindzero.merge",
    "convert_checkpoints": "mindzero.merge",
    "verify_checkpoint": "mindzero.merge",
    "MergeError": "mindzero.merge",
    "memory_report": "mindzero.memory",
    "register_elementwise_optimizer": "mindzero.optim",
    "create_hybrid_groups": "mindzero.comm",
    "start_data_parallel": "mindzero.runtime",
    "release_host_memory": "mindzero.runtime",
    "lazy_init": "mindzero.materialize",
}

__all__ = sorted(["STAGES", "MixedPrecision", "StagePolicy", "ZeroConfig", "stage_policy", "expected_bytes", "ParamInfo",
                  "PartitionPlan", "ShardSpec", "HybridLayout", "LayoutError", "estimate_memory", "ConfigError", "load_config",
                  *_LAZY])


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mindzero' has no attribute {name!r}")
