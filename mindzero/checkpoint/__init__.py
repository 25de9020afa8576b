"""mindzero's checkpoints (docs/checkpoints.md):

* :mod:`~mindzero.checkpoint.format`: the split-info schema, the placement rule, the ``COMPLETE`` marker;
* :mod:`~mindzero.checkpoint.tensor_io`: tensor-at-a-time ``.ckpt``/safetensors files and the one CRC-32;
* :mod:`~mindzero.checkpoint.source`: ``Source``, the reader every load, merge, reshard and verify goes through;
* :mod:`~mindzero.checkpoint.offline`: merge, reshard, verify, mindone's ``convert_checkpoints`` (no MindSpore);
* :mod:`~mindzero.checkpoint.cli`: the ``mindzero-merge``/``-reshard``/``-verify`` command lines;
* :mod:`~mindzero.checkpoint.live` and :mod:`~mindzero.checkpoint.save`: load and save a live train step;
* :mod:`~mindzero.checkpoint.pretrained`: plain full files in (``load_pretrained``) and out (``save_full_checkpoint``,
  also of the trainable parameters alone: an adapter export);
* :mod:`~mindzero.checkpoint.callback`: ``ZeroCheckpoint`` for ``mindspore.train.Model``.

The names below resolve on first use (the offline part imports without MindSpore).
"""
from importlib import import_module

_NAMES = {
    "save_checkpoint": "save", "wait_for_save": "save", "AsyncSave": "save",
    "load_checkpoint": "live", "gather_full_state_dict": "live", "save_full_checkpoint": "pretrained",
    "load_pretrained": "pretrained", "iter_full_tensors": "live",
    "latest_checkpoint": "live", "complete_checkpoints": "live", "read_trainer_state": "live",
    "CheckpointError": "live", "live_tensors": "live",
    "merge_checkpoint": "offline", "reshard_checkpoint": "offline", "verify_checkpoint": "offline",
    "convert_checkpoints": "offline", "MergeError": "source", "Source": "source", "ZeroCheckpoint": "callback",
}


def __getattr__(name):
    if name in _NAMES:
        return getattr(import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
