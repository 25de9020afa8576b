"""Plain full checkpoints in and out of a prepared train step: :func:`load_pretrained` (start fine-tuning from
a model saved by ``mindspore.save_checkpoint``) and :func:`save_full_checkpoint` (the full network, or only
its trainable parameters: an adapter export). Both move one tensor at a time.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..comm.cells import Barrier
from ..core.plan import shard_array
from ..core.state import GATHER
from .directory import CheckpointError
from .live import iter_full_tensors, write_value
from .tensor_io import CheckpointFileError, np_dtype, open_reader, open_writer
from .format import FORMATS


def load_pretrained(train_net, path, strict: bool = True, prefix: str = None) -> dict:
    """Load a plain full checkpoint into a prepared train step: the weights a fine-tuning starts from.

    ``path`` is a MindSpore ``.ckpt`` or safetensors file of full tensors, as ``mindspore.save_checkpoint``
    writes it for the unwrapped network: its tensor ``name`` gives the network parameter ``prefix + name``
    (MindSpore prefixes a Cell's parameter names with its attribute name when the Cell is wrapped, e.g.
    ``gpt.`` in ``LMLoss(gpt)``; ``prefix=None`` finds the one prefix that maps the file onto the network).
    Every rank calls it (no collective but one agreement). Each rank reads the file one tensor at a time and
    keeps what it holds: the full value at stages 0-2 (and of replicated parameters), its own shard at stage 3,
    so no rank holds the full model, also after :func:`mindzero.lazy_init`. What follows the parameters
    follows them: the masters the optimizer updates (stage 1-2 master shards, an owner's full master, the fp32
    masters of a mixed-precision run: they take the file's values, the ``param_dtype`` copies their cast), the EMA
    (it restarts from the loaded weights); the optimizer states are left as they are (a fresh run's zeros).

    Args:
        strict: every network parameter must be in the file with its shape, and every tensor of the file
            must be a network parameter; ``False``: load those that match and report the rest.
        prefix: what the network's names carry before the file's (e.g. ``"gpt."``); ``None``: found.

    Returns:
        ``{"loaded": [network names], "missing": [network parameters not in the file], "unexpected": [file
        tensors that are no parameter], "mismatched": [(name, file shape, network shape)], "prefix": str}``.

    Raises:
        CheckpointError: the file cannot be read, or (``strict``) a missing, unexpected or mismatched tensor,
            naming them. The check runs on every rank before any value changes, and the ranks agree: either
            every rank loads or every rank raises, and nothing changed on any rank.
    """
    info = train_net.zero_info
    error, reader, report = None, None, None
    try:
        reader, report = _check_pretrained(train_net, Path(path), strict, prefix)
    except CheckpointError as err:
        error = err
    failed = Barrier(info.world).count(error is not None)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{path}: {failed} other rank(s) could not load it (their logs say why); nothing was "
                              "loaded")
    params = {p.name: p for p in train_net.network.get_parameters()}
    states = {ps.name: ps for ps in info.params}
    emas = dict(zip(info.opt_param_names, train_net.ema.ema_weights)) if train_net.has_ema else {}
    stage3 = info.config.policy.shard_parameters
    prefix = report["prefix"]
    for name in report["loaded"]:
        stored = name[len(prefix):]
        full = _as_float(reader.read(stored), reader.meta(stored)[0])
        spec = info.plan[name]
        held = shard_array(full, spec) if stage3 and spec.sharded else full.reshape(spec.shape)
        param = params[name]
        write_value(param, held.astype(_np(param)))
        ps = states.get(name)
        if ps is not None and ps.master is not None:  # the optimizer's master takes the file's values
            master = ps.master.master
            value = shard_array(full, spec) if ps.master.kind == GATHER else full if master.shape == spec.shape else held
            write_value(master, value.astype(_np(master)))
        if name in emas:
            write_value(emas[name], held.astype(_np(emas[name])))
    return report


def _check_pretrained(train_net, path: Path, strict: bool, prefix: str):
    """Open the file and match its tensors to the network's parameters (names and shapes, no values read)."""
    try:
        reader = open_reader(path)
    except CheckpointFileError as err:
        raise CheckpointError(str(err)) from None
    wanted = {s.name: s for s in train_net.zero_info.plan}
    stored = set(reader.names())
    if prefix is None:
        prefix = _find_prefix(stored, wanted)
    missing = sorted(n for n in wanted if not (n.startswith(prefix) and n[len(prefix):] in stored))
    unexpected = sorted(n for n in stored if prefix + n not in wanted)
    mismatched = []
    for name, spec in wanted.items():
        if name.startswith(prefix) and name[len(prefix):] in stored:
            shape = tuple(reader.meta(name[len(prefix):])[1])
            if int(np.prod(shape)) != spec.numel or (shape and tuple(shape) != tuple(spec.shape)):
                mismatched.append((name, shape, tuple(spec.shape)))
    bad = {m[0] for m in mismatched}
    report = {"loaded": sorted(n for n in wanted if n.startswith(prefix) and n[len(prefix):] in stored and n not in bad),
              "missing": missing, "unexpected": unexpected, "mismatched": mismatched, "prefix": prefix}
    if strict and (missing or unexpected or mismatched):
        detail = [f"the network has parameters the file lacks: {_some(missing)}" if missing else "",
                  f"the file has tensors that are no parameter of the network: {_some(unexpected)}" if unexpected
                  else "",
                  f"shapes differ ({len(mismatched)}): " + "; ".join(f"{n}: file {a}, network {b}"
                                                                    for n, a, b in mismatched[:5]) if mismatched else ""]
        raise CheckpointError(f"{path}: does not match the network (strict=True; prefix={prefix!r}): "
                              + "; ".join(d for d in detail if d))
    return reader, report


def _some(names: list, shown: int = 5) -> str:
    """The first ``shown`` names, and how many more there are."""
    return f"{names[:shown]}" + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _find_prefix(stored: set, wanted: dict) -> str:
    """The prefix ``p`` for which the most file names ``f`` have a network parameter ``p + f`` ("" on a tie)."""
    counts = {"": sum(f in wanted for f in stored)}
    for name in wanted:
        for f in stored:
            if name.endswith("." + f):
                p = name[:-len(f)]
                counts[p] = counts.get(p, 0) + 1
    best = max(counts.values())
    return "" if counts[""] == best else min(p for p, c in counts.items() if c == best)


def _np(param):
    from mindspore.common import dtype as mstype

    return mstype._dtype_to_nptype(param.dtype)  # pylint: disable=protected-access


def _as_float(array: np.ndarray, dtype: str) -> np.ndarray:
    """A file's tensor as numbers: bfloat16 (read as its 16-bit patterns) widened to float32."""
    if dtype == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array


def save_full_checkpoint(train_net, path, format="ckpt", trainable_only: bool = False):
    """Write the full network parameters (or, with ``trainable_only``, only those the optimizer updates: the
    adapters of a fine-tuning) into one plain file ``path``, loadable into the plain network with
    ``mindspore.load_checkpoint`` + ``load_param_into_net``. A ``param_dtype`` run writes the fp32 masters.

    Collective: all ranks call it; stage 3 gathers one tensor at a time and rank 0 writes it as it comes
    (a temporary name, renamed when complete).

    Raises:
        CheckpointError: a bad ``format`` or a ``path`` without its suffix.
    """
    if format not in FORMATS:
        raise CheckpointError(f"format must be one of {FORMATS}, got {format!r}")
    path = Path(path)
    if not path.name.endswith("." + format):
        raise CheckpointError(f"path must end with .{format} for format={format!r}, got {str(path)!r}")
    info = train_net.zero_info
    names = [s.name for s in info.plan if s.optimized or not trainable_only]
    if trainable_only:
        names = [n for n in names if n in set(info.opt_param_names)]
    masters = info.precision.enabled
    rank0 = info.world.world_rank == 0
    tmp = path.with_name(f".partial-{os.getpid()}-{path.name}")
    writer = None
    try:
        for name, value in iter_full_tensors(train_net, names, masters=masters):
            if rank0:
                if writer is None:  # the layout: every tensor's name, dtype and shape up front (safetensors)
                    writer = open_writer(tmp, format, [(n, *_layout(info, n, masters)) for n in names])
                dtype = _layout(info, name, masters)[0]
                writer.write(name, value.astype(np_dtype(dtype)).reshape(info.plan[name].shape), dtype)
        if rank0:
            writer = writer or open_writer(tmp, format, [])
            writer.commit()
            os.replace(tmp, path)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    Barrier(info.world)()
    return path


def _layout(info, name, masters):
    """``(dtype, shape)`` a parameter is written with: fp32 masters of a ``param_dtype`` run; bfloat16 as fp32."""
    spec = info.plan[name]
    dtype = "float32" if (masters and name in set(info.opt_param_names)) or spec.dtype == "bfloat16" else spec.dtype
    return dtype, tuple(spec.shape)
