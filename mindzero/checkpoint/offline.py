"""Offline merge, reshard and verify of mindzero checkpoints, one tensor at a time (no MindSpore import).

* :func:`merge_checkpoint`: one full checkpoint with the network's original parameter names
  (optionally the optimizer states too), loadable into the plain network for inference.
* :func:`reshard_checkpoint`: the same training state laid out for another world size and/or stage,
  loadable with :func:`mindzero.load_checkpoint` by the new run.
* :func:`verify_checkpoint`: every piece of a checkpoint against its checksum.
* :func:`convert_checkpoints`: mindone's signature over a mindzero checkpoint directory.

Every read goes through :class:`mindzero.checkpoint.source.Source`; the command lines are in
:mod:`mindzero.checkpoint.cli`.

Everything is validated before anything is written: all ranks' split-info files present and
agreeing (:func:`mindzero.checkpoint.format.read_all`), every file present and not truncated, every
piece of the expected shape. Output is written under a temporary name and renamed at the end.
Peak memory is about one full tensor plus file buffers.
"""
from __future__ import annotations

import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..core.checks import require_int
from ..core.plan import REASON_FROZEN, REASON_PERSISTENT, REASON_USER, ParamInfo, PartitionPlan, is_per_rank
from .format import FORMATS, SplitInfo, SplitInfoError, Target, entry_at, split_info_name, write_marker
from .source import MergeError, Source
from ..core.checksum import crc32_array
from .tensor_io import np_dtype, open_writer


class _Progress:
    """Progress of a long tensor-by-tensor job: a tqdm bar on stderr (bytes done, rate, time left) when
    tqdm is installed, else a line every 5 s through ``log``; :meth:`summary` ends with one line."""

    def __init__(self, total_tensors, total_bytes, log, desc="tensors"):
        self.n, self.total, self.total_bytes, self.log = 0, total_tensors, total_bytes, log
        self.bytes, self.start, self.last = 0, time.time(), time.time()
        self.bar = None
        if log is not None:
            try:
                from tqdm import tqdm
            except ImportError:  # the periodic log lines instead
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                                file=sys.stderr, mininterval=0.5 if sys.stderr.isatty() else 10)

    def step(self, nbytes):
        self.n += 1
        self.bytes += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
        elif time.time() - self.last > 5 and self.log:
            self.last = time.time()
            self.log(f"  {self.n}/{self.total} tensors, {self.bytes / 2**20:.1f}/{self.total_bytes / 2**20:.1f} MiB")

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def summary(self, what, out):
        self.close()
        secs = time.time() - self.start
        text = f"{what} {self.n} tensors, {self.bytes / 2**20:.1f} MiB in {secs:.1f}s -> {out}"
        if self.log:
            self.log(text)
        return {"tensors": self.n, "bytes": self.bytes, "seconds": secs, "output": str(out)}


def _refuse_existing(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise MergeError(f"output {str(out)!r} exists; pass force=True (--force) to replace it")


PARAMETER_VALUES = ("master", "param")


def merge_checkpoint(ckpt_dir, out, format="ckpt", with_optimizer=False, force=False, log=print,
                     parameter_values="master") -> dict:
    """Write one full checkpoint from a mindzero checkpoint directory.

    Args:
        ckpt_dir: written by :func:`mindzero.save_checkpoint` (any stage, any world size).
        out: output file (``.ckpt`` or ``.safetensors``, per ``format``).
        with_optimizer: also write the optimizer states and scalars, under their own names.
        force: replace ``out`` if it exists.
        log: progress and summary lines (``None`` for silence).
        parameter_values: a checkpoint of a ``param_dtype`` run holds each optimized parameter twice:
            ``"master"`` (default) writes its fp32 master values under the parameter's name, ``"param"``
            the ``param_dtype`` values the network held. Other checkpoints: the same either way.

    Returns:
        ``{"tensors", "bytes", "seconds", "output"}``.

    Raises:
        MergeError: any validation failure (the message names the file and field); nothing is written.
    """
    if format not in FORMATS:
        raise MergeError(f"format must be one of {FORMATS}, got {format!r}")
    if parameter_values not in PARAMETER_VALUES:
        raise MergeError(f"parameter_values must be one of {PARAMETER_VALUES}, got {parameter_values!r}")
    out = Path(out)
    _refuse_existing(out, force)
    src = Source(ckpt_dir)
    kinds = ("parameter", "optimizer_state", "master", "ema", "scalar") if with_optimizer else ("parameter",)
    entries = [t for t in src.ref.tensors if t.kind in kinds]
    if not entries:
        raise MergeError(f"{src.dir}: the checkpoint has no tensors of kinds {kinds}")
    masters = {t.param: t for t in src.ref.tensors if t.kind == "master"} if parameter_values == "master" else {}
    # (output name, the tensor whose values it gets)
    sources = [(t.name, masters.get(t.name, t) if t.kind == "parameter" else t) for t in entries]
    layout = [(name, t.dtype, t.shape) for name, t in sources]
    progress = _Progress(len(sources), sum(t.numel * np_dtype(t.dtype).itemsize for _, t in sources), log, "merge")
    with open_writer(out, format, layout) as writer:
        for name, t in sources:
            value = src.full(t.name)
            writer.write(name, value, t.dtype)
            progress.step(value.nbytes)
    return progress.summary("merged", out)


def _plan_from_entries(ref: SplitInfo, op_size: int) -> PartitionPlan:
    """The plan of a checkpoint's parameters over ``op_size`` ranks, each kept in its role: buffers per rank,
    frozen weights kept whole where the run kept them whole (a sharded frozen weight is placed as any
    sharded parameter), stage 3's persistent parameters whole (the threshold is in elements: the same at any
    world size)."""
    infos = [ParamInfo(t.name, tuple(t.shape), t.dtype,
                       optimized=not (is_per_rank(t.replicated_reason) or t.replicated_reason == REASON_FROZEN),
                       parallel_optimizer=t.replicated_reason not in (REASON_USER, REASON_PERSISTENT),
                       written=is_per_rank(t.replicated_reason))
             for t in ref.tensors if t.kind == "parameter"]
    return PartitionPlan.build(infos, op_size, 0, shard_frozen=False)


def _resharded_infos(src: Source, world_size: int, stage: int, fmt: str, run_id: str) -> list:
    """The split infos of the new layout, one per new rank (same tensors, new placement)."""
    plan = _plan_from_entries(src.ref, world_size)
    specs = {s.name: s for s in plan}
    out = []
    for rank in range(world_size):
        entries = []
        for t in src.ref.tensors:
            spec = specs[t.param].for_rank(rank) if t.param else None
            entries.append(entry_at(t.name, t.kind, t.shape, t.dtype, spec, Target(stage, fmt)))
        out.append(SplitInfo(run_id, stage, world_size, rank, src.ref.step, fmt, plan.fingerprint(), tuple(entries)))
    return out


def reshard_checkpoint(ckpt_dir, out_dir, world_size, stage=None, format=None, force=False, log=print) -> dict:
    """Rewrite a checkpoint saved by N ranks for ``world_size`` ranks at ``stage`` (default: the same stage).

    Per-rank buffers (e.g. BatchNorm statistics) of new rank ``m`` come from old rank ``m``, or rank 0
    when the old run had fewer ranks.

    Raises:
        MergeError: bad arguments or an invalid source; nothing is written.
    """
    try:
        require_int("world_size", world_size, 1)
    except ValueError as err:
        raise MergeError(str(err)) from None
    src = Source(ckpt_dir)
    stage = src.ref.stage if stage is None else stage
    if stage not in (0, 1, 2, 3):
        raise MergeError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    fmt = format or src.ref.format
    out_dir = Path(out_dir)
    _refuse_existing(out_dir, force)
    run_id = f"reshard-{src.ref.run_id}-{world_size}x{stage}"
    infos = _resharded_infos(src, world_size, stage, fmt, run_id)
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        _write_resharded(src, infos, partial, fmt, log)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if out_dir.exists():
        shutil.rmtree(out_dir)
    partial.rename(out_dir)
    return {"world_size": world_size, "stage": stage, "output": str(out_dir)}


def _write_resharded(src: Source, infos: list, partial: Path, fmt: str, log) -> None:
    layouts = {}
    for info in infos:
        for t in info.tensors:
            piece = (t.shard_size,) if t.sharded else tuple(t.shape)
            if t.file.startswith("rank_") and int(t.file.split("_")[1].split(".")[0]) != info.op_rank:
                continue  # rank 0's shared file: listed once, by rank 0
            layouts.setdefault(t.file, {}).setdefault(t.name, (t.name, t.dtype, piece))
    writers = {f: open_writer(partial / f, fmt, list(lay.values())) for f, lay in layouts.items()}
    progress = _Progress(len(src.ref.tensors), sum(t.numel * np_dtype(t.dtype).itemsize for t in src.ref.tensors),
                         log, "reshard")
    entries = [list(info.tensors) for info in infos]  # gain the CRC-32 of what each rank's entry wrote
    try:
        for i, t in enumerate(src.ref.tensors):
            per_rank = t.per_rank
            full = None if per_rank else src.full(t.name)
            written = set()
            for info in infos:
                new = info.tensors[i]
                if (new.file, new.name) in written:
                    continue
                written.add((new.file, new.name))
                value = src.piece_for(new, info.op_rank, full=full)
                writers[new.file].write(new.name, value, new.dtype)
                entries[info.op_rank][i] = replace(new, crc32=crc32_array(value))
            progress.step(t.numel * np_dtype(t.dtype).itemsize)
        for w in writers.values():
            w.commit()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    for info in infos:
        replace(info, tensors=tuple(entries[info.op_rank])).write(partial / split_info_name(info.op_rank))
    write_marker(partial, run_id=infos[0].run_id, step=infos[0].step, group_size=len(infos),
                 resharded_from=str(src.dir))
    progress.summary(f"resharded to {len(infos)} ranks, stage {infos[0].stage}:", partial)


def verify_checkpoint(ckpt_dir, log=print) -> dict:
    """Check a whole checkpoint: the marker (its checksum, every file's size, the JSON files' checksums), every
    rank's split info and their agreement, and every stored piece (dtype, shape, CRC-32), reading each
    piece once. Problems with single pieces are collected, not stopped at.

    Returns:
        ``{"ok", "problems", "ranks", "stage", "step", "tensors", "bytes", "files", "checksums"}``;
        ``checksums`` is False for a version-1 checkpoint (written before checksums: structure only).
    """
    problems, pieces, nbytes = [], 0, 0
    report = {"ok": False, "problems": problems, "ranks": 0, "stage": None, "step": None, "tensors": 0,
              "bytes": 0, "files": 0, "checksums": False}
    try:
        src = Source(ckpt_dir, check_pieces=False)
    except MergeError as err:
        problems.append(str(err))
        if log:
            log(f"FAILED {ckpt_dir}: {err}")
        return report
    seen = {}
    for info in src.infos:
        for t in info.tensors:
            seen.setdefault((t.file, t.key), t)
    progress = _Progress(len(seen), sum(t.shard_size * np_dtype(t.dtype).itemsize for t in seen.values()), log,
                         "verify")
    for t in seen.values():
        try:
            value = src.read_piece(t)
            pieces += 1
            nbytes += value.nbytes
        except MergeError as err:
            problems.append(str(err))
        progress.step(t.shard_size * np_dtype(t.dtype).itemsize)
    listed = set(src.marker.get("files") or ())
    extra = sorted(p.name for p in src.dir.iterdir() if p.is_file() and listed and p.name not in listed
                   and p.name != "COMPLETE")
    report.update(ok=not problems, ranks=src.op_size, stage=src.ref.stage, step=src.ref.step, tensors=pieces,
                  bytes=nbytes, files=len(listed) + 1 if listed else len(list(src.dir.iterdir())),
                  checksums=src.verified, extra_files=extra)
    progress.close()
    if log:
        for problem in problems:
            log(f"  problem: {problem}")
        what = ("every checksum matches" if src.verified else
                f"format_version {src.ref.format_version}: no checksums recorded, structure and sizes only")
        if extra:
            log(f"  note: files not part of the checkpoint: {extra[:5]}")
        head = "FAILED" if problems else "ok"
        log(f"{head} {src.dir}: {src.op_size} ranks, stage {src.ref.stage}, step {src.ref.step}, {pieces}/"
            f"{len(seen)} pieces, {nbytes / 2**20:.1f} MiB; " + (f"{len(problems)} problem(s)" if problems else what))
    return report


def convert_checkpoints(src_checkpoint, src_param_split_info_json, group_size, format="ckpt"):
    """mindone's ``convert_checkpoints`` over a mindzero checkpoint: merge it into one full checkpoint.

    Args:
        src_checkpoint: per-rank file pattern, e.g. ``"ckpt_dir/rank_{}.ckpt"``.
        src_param_split_info_json: split-info pattern, e.g. ``"ckpt_dir/params_split_info_{}.json"``.
        group_size: the number of ranks that saved it.

    Returns:
        the merged checkpoint's path, ``src_checkpoint.format(f"all_{group_size}")`` (as mindone does).
    """
    try:
        require_int("group_size", group_size, 1)
    except ValueError as err:
        raise MergeError(str(err)) from None
    ckpt_dir = Path(src_param_split_info_json.format(0)).parent
    try:
        saved = SplitInfo.read(ckpt_dir / split_info_name(0))
    except SplitInfoError as err:
        raise MergeError(str(err)) from None
    if saved.op_size != group_size:
        raise MergeError(f"group_size is {group_size}, but the checkpoint was saved by {saved.op_size} ranks")
    for r in range(group_size):
        rank_file, info_file = Path(src_checkpoint.format(r)), Path(src_param_split_info_json.format(r))
        if info_file != ckpt_dir / split_info_name(r):
            raise MergeError(f"src_param_split_info_json must name {split_info_name(r)} files of one directory, "
                             f"got {str(info_file)!r}")
        if rank_file.parent != ckpt_dir or not rank_file.is_file():
            raise MergeError(f"src_checkpoint {src_checkpoint!r} gives {str(rank_file)!r} for rank {r}, which is "
                             f"not a file in {str(ckpt_dir)!r}")
    out = src_checkpoint.format(f"all_{group_size}")
    merge_checkpoint(ckpt_dir, out, format=format, force=True, log=None)
    return out
