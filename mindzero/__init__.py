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
import importlib.abc
import importlib.util
import sys
import warnings

from .core.config import (STAGES, CheckpointOptions, EmaPolicy, GroupPolicy, LossScale,  # noqa: F401 (public)
                          MixedPrecision, StagePolicy, ZeroConfig, stage_policy)
from .core.deprecation import MindzeroDeprecationWarning  # noqa: F401 (public)
from .core.estimate import estimate_memory  # noqa: F401
from .core.memory import expected_bytes  # noqa: F401
from .core.plan import ParamInfo, PartitionPlan, ShardSpec  # noqa: F401
from .core.settings import ConfigError, load_config  # noqa: F401
from .core.topology import HybridLayout, LayoutError, World  # noqa: F401

__version__ = "0.1.0"

_LAZY = {
    "prepare_train_network": "mindzero.engine.prepare",
    "memory_report": "mindzero.engine.report",
    "register_elementwise_optimizer": "mindzero.engine.optim",
    "lazy_init": "mindzero.engine.materialize",
    "gather_full_state_dict": "mindzero.checkpoint.live",
    "load_checkpoint": "mindzero.checkpoint.live",
    "save_full_checkpoint": "mindzero.checkpoint.pretrained",
    "load_pretrained": "mindzero.checkpoint.pretrained",
    "latest_checkpoint": "mindzero.checkpoint.live",
    "read_trainer_state": "mindzero.checkpoint.live",
    "complete_checkpoints": "mindzero.checkpoint.live",
    "CheckpointError": "mindzero.checkpoint.live",
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
    "start_data_parallel": "mindzero.launch.runtime",
    "release_host_memory": "mindzero.launch.runtime",
}

__all__ = sorted(["STAGES", "CheckpointOptions", "EmaPolicy", "GroupPolicy", "LossScale", "MixedPrecision",
                  "StagePolicy", "ZeroConfig", "stage_policy", "MindzeroDeprecationWarning", "estimate_memory",
                  "expected_bytes", "ParamInfo", "PartitionPlan", "ShardSpec", "ConfigError", "load_config",
                  "HybridLayout", "LayoutError", "World", *_LAZY])


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mindzero' has no attribute {name!r}")


#: module paths of mindzero before its package layout (issue 22) -> where that module lives now
MOVED_MODULES = {
    "mindzero.config": "mindzero.core.config",
    "mindzero.settings": "mindzero.core.settings",
    "mindzero.plan": "mindzero.core.plan",
    "mindzero.layout": "mindzero.core.topology",
    "mindzero.state": "mindzero.core.state",
    "mindzero.comm_plan": "mindzero.core.comm_plan",
    "mindzero.memory": "mindzero.core.memory",
    "mindzero.estimate": "mindzero.core.estimate",
    "mindzero.prepare": "mindzero.engine.prepare",
    "mindzero.train_step": "mindzero.engine.train_step",
    "mindzero.shard": "mindzero.engine.stage3",
    "mindzero.optim": "mindzero.engine.optim",
    "mindzero.materialize": "mindzero.engine.materialize",
    "mindzero.runtime": "mindzero.launch.runtime",
    "mindzero.merge": "mindzero.checkpoint.cli",
    "mindzero.split_info": "mindzero.checkpoint.format",
    "mindzero.ckpt_io": "mindzero.checkpoint.tensor_io",
    "mindzero.callback": "mindzero.checkpoint.callback",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import mindzero.plan`` (an old path) gives the module now at ``mindzero.core.plan`` (the same module
    object, under both names) and warns with the new path."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        new = MOVED_MODULES[module.__name__]
        warnings.warn(f"module {module.__name__} is deprecated, use {new} (the package layout, "
                      "docs/architecture.md)", MindzeroDeprecationWarning, stacklevel=2)
        sys.modules[module.__name__] = importlib.import_module(new)  # what the import statement returns


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
