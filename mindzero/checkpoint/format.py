"""The split-info JSON: a versioned schema that alone suffices to rebuild every full tensor.

One file per rank, ``params_split_info_<rank>.json``, in the checkpoint directory::

    {"format_version": 2, "run_id": "...", "stage": 3, "group_size": 2, "rank": 0, "step": 10,
     "format": "ckpt", "plan_fingerprint": "...", "replicas": 1, "replica": 0,
     "tensors": [{"name": "dense.weight", "kind": "parameter", "param": "dense.weight",
                  "shape": [7, 15], "dtype": "float32", "sharded": true, "replicated_reason": "",
                  "shard_size": 53, "padding": 1, "offset": 0, "file": "rank_0.ckpt",
                  "key": "dense.weight", "crc32": 2312315193}, ...]}

Per tensor: ``name`` (its name in a merged checkpoint), ``kind`` (``parameter``,
``optimizer_state``, ``master`` (the fp32 master values of a ``param_dtype`` run,
named ``zero_master.<parameter>``: the parameter entry then has ``param_dtype``,
its master ``float32``), ``ema`` or ``scalar``), ``param`` (the parameter a state belongs to),
the full ``shape`` and ``dtype``, whether this checkpoint stores it ``sharded``,
why the plan replicates its parameter (``replicated_reason``, empty when the
plan shards it), the ``shard_size``, total ``padding`` and this rank's
``offset`` into the flat padded tensor, and where this rank's piece is: ``file``
(relative to the checkpoint directory) and ``key`` inside it. A tensor that is
not sharded is stored whole: identical replicated tensors once (by rank 0, the
``file`` every rank names), per-rank buffers such as BatchNorm statistics in each
rank's own file (a merge takes rank 0's), the state (or fp32 master) of a parameter updated whole on an owner
rank in that rank's file, ``owner`` naming it (format version 3). :func:`placement` is the rule.

The file-level keys keep the names of format versions 1-2: ``group_size`` is the op group's size
and ``rank`` this file's shard index in it (``SplitInfo.op_size`` / ``op_rank`` in Python);
``replicas`` says how many copies of the op group the run had (hybrid sharding; ``dp_size``) and
``replica`` which one wrote the files (``dp_rank``) (replica 0; the others hold the same shards and write nothing), so a
hybrid checkpoint is a ``group_size``-way checkpoint: it merges, resumes with any number
of replicas, and reshards like any other.

Pure Python (no MindSpore): the merge and reshard tools use it with :mod:`mindzero.core.plan`.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple, Optional

from ..core.options import CHECKPOINT_FORMATS as FORMATS
from ..core.checks import is_int
from ..core.config import stage_policy
from ..core.plan import is_per_rank, valid_elements
from ..core.checksum import crc32_bytes

FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # 1: no checksums (read without verification); 3: optimizer states owned whole
COMPLETE = "COMPLETE"  # the marker file written last into a finished checkpoint directory
KINDS = ("parameter", "optimizer_state", "master", "ema", "scalar")


class SplitInfoError(ValueError):
    """A split-info file is missing, malformed, from another run, or inconsistent with the others."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    kind: str
    param: str
    shape: tuple
    dtype: str
    sharded: bool
    replicated_reason: str
    shard_size: int
    padding: int
    offset: int
    file: str
    key: str
    crc32: Optional[int] = None  # CRC-32 of the piece's bytes (format_version 2; None: written by another rank)
    owner: Optional[int] = None  # the op rank that holds it whole (an owner-mode parameter's state or master)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def valid(self) -> int:
        """Real (non-padding) elements in this rank's piece."""
        return valid_elements(self.numel, self.sharded, self.offset, self.shard_size)

    @property
    def per_rank(self) -> bool:
        """A parameter each rank keeps its own value of (:func:`mindzero.core.plan.is_per_rank`)."""
        return self.kind == "parameter" and is_per_rank(self.replicated_reason)


# attribute -> JSON key where they differ (the JSON keys are those of format versions 1-2)
_JSON_KEYS = {"op_size": "group_size", "op_rank": "rank", "dp_size": "replicas", "dp_rank": "replica"}


@dataclass(frozen=True)
class SplitInfo:
    run_id: str
    stage: int
    op_size: int  # ranks in the op group (JSON "group_size")
    op_rank: int  # this file's shard index in the op group (JSON "rank")
    step: int
    format: str
    plan_fingerprint: str
    tensors: tuple = field(default_factory=tuple)
    dp_size: int = 1  # hybrid sharding: copies of the op group in the run (JSON "replicas")
    dp_rank: int = 0  # which copy wrote these shards: always 0, the others hold the same ones (JSON "replica")
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        d = {_JSON_KEYS.get(k, k): v for k, v in asdict(self).items()}
        d["tensors"] = [asdict(t) for t in self.tensors]
        return json.dumps(d, indent=1)

    def write(self, path) -> None:
        """Write atomically: a temporary name, fsync, then rename."""
        write_atomic(Path(path), self.to_json().encode())

    @staticmethod
    def read(path) -> "SplitInfo":
        """Read and validate one file.

        Raises:
            SplitInfoError: naming the file and the field that is missing or wrong.
        """
        path = Path(path)
        if not path.is_file():
            raise SplitInfoError(f"{path}: split-info file is missing")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise SplitInfoError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(raw, dict):
            raise SplitInfoError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        version = raw.get("format_version")
        if version not in READABLE_VERSIONS:
            raise SplitInfoError(f"{path}: format_version must be one of {READABLE_VERSIONS}, got {version!r} "
                                 "(written by a newer mindzero?)")
        expect = {"run_id": str, "stage": int, "group_size": int, "rank": int, "step": int, "format": str,
                  "plan_fingerprint": str, "tensors": list}
        for key, typ in expect.items():
            if not isinstance(raw.get(key), typ):
                raise SplitInfoError(f"{path}: field {key!r} must be {typ.__name__}, got {raw.get(key)!r}")
        if raw["format"] not in FORMATS:
            raise SplitInfoError(f"{path}: field 'format' must be one of {FORMATS}, got {raw['format']!r}")
        if not 0 <= raw["rank"] < raw["group_size"]:
            raise SplitInfoError(f"{path}: rank {raw['rank']} is outside group_size {raw['group_size']}")
        tensors = []
        for i, t in enumerate(raw["tensors"]):
            try:
                entry = TensorEntry(**{**t, "shape": tuple(t["shape"])})
            except (TypeError, KeyError) as err:
                raise SplitInfoError(f"{path}: tensors[{i}] is malformed ({err})") from None
            if entry.crc32 is not None and (not is_int(entry.crc32) or not 0 <= entry.crc32 < 1 << 32):
                raise SplitInfoError(f"{path}: tensors[{i}] ({entry.name}) has crc32 {entry.crc32!r}, expected an "
                                     "unsigned 32-bit int or null")
            if entry.owner is not None and (not is_int(entry.owner) or not 0 <= entry.owner < raw["group_size"]):
                raise SplitInfoError(f"{path}: tensors[{i}] ({entry.name}) has owner {entry.owner!r}, expected an op "
                                     f"rank in [0, {raw['group_size']}) or null")
            if entry.kind not in KINDS:
                raise SplitInfoError(f"{path}: tensors[{i}] ({entry.name}) has kind {entry.kind!r}, "
                                     f"expected one of {KINDS}")
            tensors.append(entry)
        for key in ("replicas", "replica"):  # optional: absent in checkpoints of runs without hybrid sharding
            value = raw.setdefault(key, 1 if key == "replicas" else 0)
            if not is_int(value) or value < (1 if key == "replicas" else 0):
                raise SplitInfoError(f"{path}: field {key!r} must be a non-negative int (replicas >= 1), "
                                     f"got {value!r}")
        if raw["replica"] >= raw["replicas"]:
            raise SplitInfoError(f"{path}: replica {raw['replica']} is outside replicas {raw['replicas']}")
        fields = {attr: raw[_JSON_KEYS.get(attr, attr)] for attr in ("run_id", "stage", "op_size", "op_rank", "step",
                                                                      "format", "plan_fingerprint", "dp_size",
                                                                      "dp_rank")}
        return SplitInfo(**fields, tensors=tuple(tensors), format_version=version)

    def by_name(self) -> dict:
        return {t.name: t for t in self.tensors}


def placement(kind: str, stage: int, plan_sharded: bool, per_rank: bool, op_rank: int, fmt: str, owner=None,
              whole: bool = False):
    """Where one tensor lives in a checkpoint of ``stage``: ``(stored sharded, file)``.

    The one rule, used by saving and by resharding: a parameter (and its EMA) is stored in shards at stage 3 and
    an optimizer state (and a master value) from stage 1 on, when the plan shards its parameter, unless it is kept
    ``whole`` (a state of another shape than its parameter: one value per parameter, factored statistics) or
    held by an ``owner`` (an owner-mode parameter's states and master, whole in op rank ``owner``'s file); shards
    and per-rank buffers go to op rank ``op_rank``'s own file (``rank_<op_rank>``); identical replicated tensors
    are written once, by rank 0, into ``network.<fmt>`` (full network parameters, stages 0-2) or ``rank_0.<fmt>``.
    """
    if owner is not None:
        return False, f"rank_{owner}.{fmt}"
    policy = stage_policy(stage)
    sharded = plan_sharded and not whole and (
        (kind in ("parameter", "ema") and policy.shard_parameters)
        or (kind in ("optimizer_state", "master") and policy.shard_optimizer_states))
    if sharded or per_rank:
        return sharded, f"rank_{op_rank}.{fmt}"
    if kind == "parameter" and not policy.shard_parameters:
        return False, f"network.{fmt}"
    return False, f"rank_0.{fmt}"


class Target(NamedTuple):
    """The checkpoint a tensor is placed in: its ZeRO stage and file format."""
    stage: int
    fmt: str


def entry_at(name: str, kind: str, shape, dtype: str, spec, target: Target, owner=None,
             whole: bool = False) -> TensorEntry:
    """The :class:`TensorEntry` of one tensor placed by :func:`placement` in a checkpoint ``target``;
    ``spec`` is its parameter's :class:`mindzero.core.plan.ShardSpec` for the rank that stores it (``None`` for
    scalars, which rank 0 stores); ``owner`` / ``whole``: see :func:`placement`."""
    stage, fmt = target
    per_rank = kind == "parameter" and spec is not None and spec.per_rank
    op_rank = spec.op_rank if spec is not None else 0
    sharded, file = placement(kind, stage, bool(spec and spec.sharded), per_rank, op_rank, fmt, owner, whole)
    shape = tuple(shape)
    return TensorEntry(name, kind, spec.name if spec else "", shape, dtype, sharded, spec.reason if spec else "",
                       spec.shard_size if sharded else math.prod(shape), spec.padding if sharded else 0,
                       spec.offset if sharded else 0, file, name, owner=owner)


def split_info_name(rank: int) -> str:
    return f"params_split_info_{rank}.json"


def read_all(ckpt_dir) -> list:
    """Every rank's split info of a checkpoint directory, validated to agree.

    Raises:
        SplitInfoError: a rank's file is missing, or two files disagree (naming the file and the field).
    """
    ckpt_dir = Path(ckpt_dir)
    first = SplitInfo.read(ckpt_dir / split_info_name(0))
    infos = [first] + [SplitInfo.read(ckpt_dir / split_info_name(r)) for r in range(1, first.op_size)]
    check_consistent(infos, [ckpt_dir / split_info_name(r) for r in range(first.op_size)])
    return infos


def check_consistent(infos, paths) -> None:
    """Raise :class:`SplitInfoError` unless the files describe the ranks 0..N-1 of one checkpoint."""
    ref = infos[0]
    ref_tensors = {t.name: (t.kind, t.param, t.shape, t.dtype, t.sharded, t.owner) for t in ref.tensors}
    for info, path in zip(infos, paths):
        for key in ("run_id", "stage", "op_size", "step", "format", "plan_fingerprint", "format_version"):
            if getattr(info, key) != getattr(ref, key):
                raise SplitInfoError(f"{path}: field {_JSON_KEYS.get(key, key)!r} is {getattr(info, key)!r} but "
                                     f"rank 0 has {getattr(ref, key)!r} (files from different checkpoints?)")
        if info.op_rank != paths.index(path):
            raise SplitInfoError(f"{path}: field 'rank' is {info.op_rank}, expected {paths.index(path)}")
        tensors = {t.name: (t.kind, t.param, t.shape, t.dtype, t.sharded, t.owner) for t in info.tensors}
        if tensors != ref_tensors:
            missing = sorted(set(ref_tensors) - set(tensors))
            extra = sorted(set(tensors) - set(ref_tensors))
            changed = sorted(n for n in set(tensors) & set(ref_tensors) if tensors[n] != ref_tensors[n])
            raise SplitInfoError(f"{path}: tensor set differs from rank 0's (missing {missing[:3]}, extra "
                                 f"{extra[:3]}, different {changed[:3]})")


def _marker_checksum(marker: dict) -> int:
    body = {k: v for k, v in marker.items() if k != "checksum"}
    return crc32_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def write_marker(directory: Path, **fields) -> dict:
    """Write the ``COMPLETE`` marker of a finished checkpoint directory (the one writer, used by save and
    reshard): ``fields`` plus every other file's size, the CRC-32 of each JSON file, and the marker's own
    checksum. Call it when every file is durable; it is written atomically (fsync, rename)."""
    directory = Path(directory)
    files = {}
    for p in sorted(directory.iterdir()):
        if p.name == COMPLETE or not p.is_file():
            continue
        entry = {"bytes": p.stat().st_size}
        if p.suffix == ".json":
            entry["crc32"] = crc32_bytes(p.read_bytes())
        files[p.name] = entry
    marker = {**fields, "format_version": FORMAT_VERSION, "files": files}
    marker["checksum"] = _marker_checksum(marker)
    write_atomic(directory / COMPLETE, json.dumps(marker, indent=1).encode())
    return marker


def read_marker(ckpt_dir) -> dict:
    """Read and check the ``COMPLETE`` marker: its own checksum, then every file it lists (present, of the
    recorded size; JSON files by CRC-32). A marker of a version-1 checkpoint has no checksums: returned with
    ``"verified": False``.

    Raises:
        SplitInfoError: no marker (an interrupted save), a corrupted marker, or a file that is missing,
            truncated or altered (naming it and both values).
    """
    path = Path(ckpt_dir) / COMPLETE
    if not path.is_file():
        raise SplitInfoError(f"{ckpt_dir}: incomplete checkpoint (no {COMPLETE} marker: the save was interrupted "
                             "or this is not a mindzero checkpoint)")
    try:
        marker = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise SplitInfoError(f"{path}: corrupted marker (not valid JSON: {err})") from None
    if not isinstance(marker, dict):
        raise SplitInfoError(f"{path}: corrupted marker (expected a JSON object)")
    if "format_version" not in marker:  # version 1
        return {**marker, "verified": False}
    if marker.get("checksum") != _marker_checksum(marker):
        raise SplitInfoError(f"{path}: corrupted marker (checksum {marker.get('checksum')!r}, its content gives "
                             f"{_marker_checksum(marker)})")
    files = marker.get("files")
    if not isinstance(files, dict):
        raise SplitInfoError(f"{path}: corrupted marker (no file list)")
    for name, want in files.items():
        p = Path(ckpt_dir) / name
        if not p.is_file():
            raise SplitInfoError(f"{p}: missing (the {COMPLETE} marker lists it)")
        size = p.stat().st_size
        if size != want.get("bytes"):
            raise SplitInfoError(f"{p}: {size} bytes, the {COMPLETE} marker recorded {want.get('bytes')} "
                                 "(truncated or replaced)")
        if "crc32" in want:
            got = crc32_bytes(p.read_bytes())
            if got != want["crc32"]:
                raise SplitInfoError(f"{p}: checksum mismatch: CRC-32 {got}, the {COMPLETE} marker recorded "
                                     f"{want['crc32']} (the file was altered)")
    return {**marker, "verified": True}


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(directory) -> None:
    """Make renames inside ``directory`` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
