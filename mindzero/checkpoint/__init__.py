"""mindzero's checkpoints (docs/checkpoints.md):

* :mod:`~mindzero.checkpoint.format`: the split-info schema, the placement rule, the ``COMPLETE`` marker;
* :mod:`~mindzero.checkpoint.tensor_io`: tensor-at-a-time ``.ckpt``/safetensors files (their CRC-32: :mod:`mindzero.core.checksum`);
* :mod:`~mindzero.checkpoint.source`: ``Source``, the reader every load, merge, reshard and verify goes through;
* :mod:`~mindzero.checkpoint.offline`: merge, reshard, verify, mindone's ``convert_checkpoints`` (no MindSpore);
* :mod:`~mindzero.checkpoint.cli`: the ``mindzero-merge``/``-reshard``/``-verify`` command lines;
* :mod:`~mindzero.checkpoint.directory`: complete checkpoints, the newest, trainer states, ``CheckpointError`` (pure);
* :mod:`~mindzero.checkpoint.live` and :mod:`~mindzero.checkpoint.save`: load and save a live train step;
* :mod:`~mindzero.checkpoint.pretrained`: plain full files in (``load_pretrained``) and out (``save_full_checkpoint``,
  also of the trainable parameters alone: an adapter export);
* :mod:`~mindzero.checkpoint.callback`: ``ZeroCheckpoint`` for ``mindspore.train.Model``.

The public names are ``mindzero``'s (``mindzero.save_checkpoint``, ...); the offline modules import without
MindSpore.
"""
