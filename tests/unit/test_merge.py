"""Merge and reshard on synthetic shards, pure Python (no MindSpore): the split-info schema alone rebuilds
every tensor; bad input gets a clear error and nothing is written."""
import json
import re
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from mindzero.checkpoint.tensor_io import CkptReader, open_reader, open_writer
from mindzero.core.checksum import crc32_array
from mindzero.checkpoint.source import MergeError
from mindzero.checkpoint.offline import merge_checkpoint, reshard_checkpoint, verify_checkpoint
from mindzero.core.plan import REASON_BUFFER, ParamInfo, PartitionPlan
from mindzero.checkpoint.format import FORMAT_VERSION, SplitInfo, Target, entry_at, split_info_name, write_marker

# a.weight, b.weight, c: optimized; bn.moving_mean: a buffer (per rank); frozen.weight: frozen (sharded at stage 3)
SHAPES = {"a.weight": (7, 15), "b.weight": (17, 257), "c": (), "bn.moving_mean": (6,), "frozen.weight": (5, 3)}
OPTIMIZED = ("a.weight", "b.weight", "c")


def _arrays(seed=0):
    rng = np.random.RandomState(seed)
    full = {n: np.asarray(rng.randn(*s), np.float32) for n, s in SHAPES.items()}
    full.update({"adam_m." + n: np.asarray(rng.randn(*s), np.float32) for n, s in SHAPES.items() if n in OPTIMIZED})
    full["global_step"] = np.array([7], np.int32)
    return full


def write_synthetic(directory, n, stage, fmt="ckpt", seed=0, per_rank_offset=100.0):
    """A checkpoint as N ranks would save it, written with the pure writer; returns the full arrays."""
    full = _arrays(seed)
    infos = [ParamInfo(name, shape, optimized=name in OPTIMIZED, written="moving" in name) for name, shape in SHAPES.items()]
    plan = PartitionPlan.build(infos, n, 0)
    directory.mkdir(parents=True)
    files = {}
    for r in range(n):
        entries = []
        for name, value in full.items():
            kind = "scalar" if name == "global_step" else ("optimizer_state" if name.startswith("adam_m.") else
                                                          "parameter")
            param = "" if kind == "scalar" else name.replace("adam_m.", "")
            spec = plan[param].for_rank(r) if param else None
            entry = entry_at(name, kind, value.shape, str(value.dtype), spec, Target(stage, fmt))
            per_rank = entry.per_rank
            assert per_rank == (kind == "parameter" and spec.reason == REASON_BUFFER)
            piece = value + per_rank_offset * r if per_rank else value
            if entry.sharded:
                flat = np.zeros(spec.shard_size, np.float32)
                flat[:spec.valid] = value.reshape(-1)[spec.offset:spec.offset + spec.valid]
                piece = flat
            file = entry.file
            if file == f"rank_{r}.{fmt}" or r == 0:  # the writer records the piece's checksum
                files.setdefault(file, {})[name] = piece
                entry = replace(entry, crc32=crc32_array(piece))
            entries.append(entry)
        SplitInfo("run-x", stage, n, r, 7, fmt, plan.fingerprint(), tuple(entries)).write(
            directory / split_info_name(r))
    for file, tensors in files.items():
        with open_writer(directory / file, fmt, [(k, str(v.dtype), v.shape) for k, v in tensors.items()]) as w:
            for k, v in tensors.items():
                w.write(k, v, str(v.dtype))
    write_marker(directory, run_id="run-x", step=7, group_size=n)
    return full


def test_no_mindspore_import():
    code = "import sys, mindzero.checkpoint.offline, mindzero.checkpoint.cli, mindzero.checkpoint.tensor_io, mindzero.checkpoint.format; print('mindspore' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_merge_rebuilds_every_tensor(tmp_path, n, stage, fmt):
    full = write_synthetic(tmp_path / "ck", n, stage, fmt)
    out = tmp_path / f"merged.{fmt}"
    summary = merge_checkpoint(tmp_path / "ck", out, format=fmt, with_optimizer=True, log=None)
    reader = open_reader(out)
    assert summary["tensors"] == len(full) == len(reader.names())
    for name, value in full.items():
        np.testing.assert_array_equal(reader.read(name), value, err_msg=name)  # rank 0's buffer, unchanged


def test_merge_parameters_only_by_default(tmp_path):
    write_synthetic(tmp_path / "ck", 2, 3)
    merge_checkpoint(tmp_path / "ck", tmp_path / "m.ckpt", log=None)
    assert sorted(CkptReader(tmp_path / "m.ckpt").names()) == sorted(SHAPES)


@pytest.mark.parametrize("n, m, stage, new_stage", [(4, 2, 3, 2), (2, 4, 1, 3), (3, 5, 0, 3), (4, 1, 3, 0)])
def test_reshard_round_trip(tmp_path, n, m, stage, new_stage):
    full = write_synthetic(tmp_path / "ck", n, stage)
    reshard_checkpoint(tmp_path / "ck", tmp_path / "re", m, stage=new_stage, log=None)
    infos = [SplitInfo.read(tmp_path / "re" / split_info_name(r)) for r in range(m)]
    assert {i.op_size for i in infos} == {m} and {i.stage for i in infos} == {new_stage}
    merge_checkpoint(tmp_path / "re", tmp_path / "m.ckpt", with_optimizer=True, log=None)
    reader = CkptReader(tmp_path / "m.ckpt")
    for name, value in full.items():
        np.testing.assert_array_equal(reader.read(name), value, err_msg=name)
    # per-rank buffers: new rank r keeps old rank r's (rank 0's when the old world was smaller)
    for r in range(m):
        info = infos[r].by_name()["bn.moving_mean"]
        got = open_reader(tmp_path / "re" / info.file).read(info.key)
        np.testing.assert_array_equal(got, full["bn.moving_mean"] + 100.0 * (r if r < n else 0))


def _bad(tmp_path, action):
    write_synthetic(tmp_path / "ck", 2, 3)
    action(tmp_path / "ck")
    return tmp_path / "ck"


def _remark(directory):
    """Rewrite the marker over the damaged files, so that the layer below it must find the damage."""
    (directory / "COMPLETE").unlink()
    write_marker(directory, run_id="run-x", step=7, group_size=2)


def _truncate(p):
    p.write_bytes(p.read_bytes()[:-10])


@pytest.mark.parametrize("damage, by_marker, by_reader", [
    (lambda d: (d / "rank_1.ckpt").unlink(), "rank_1.ckpt: missing .the COMPLETE marker lists it",
     "rank_1.ckpt: checkpoint file is missing"),
    (lambda d: (d / split_info_name(1)).unlink(), "params_split_info_1.json: missing",
     "params_split_info_1.json: split-info file is missing"),
    (lambda d: _truncate(d / "rank_1.ckpt"), r"rank_1.ckpt: \d+ bytes, the COMPLETE marker recorded \d+ .truncated",
     "rank_1.ckpt: truncated"),
    (lambda d: (d / "rank_0.ckpt").write_bytes(b"\x07garbage" * 10), "rank_0.ckpt: 80 bytes, the COMPLETE marker",
     "rank_0.ckpt: not a MindSpore checkpoint"),
    (lambda d: (d / split_info_name(1)).write_text("{not json"), r"params_split_info_1.json: 9 bytes",
     "params_split_info_1.json: not valid JSON"),
])
@pytest.mark.parametrize("remark", [False, True], ids=["marker", "reader"])
def test_damaged_checkpoint(tmp_path, damage, by_marker, by_reader, remark):
    ck = _bad(tmp_path, damage)
    if remark:
        _remark(ck)
    with pytest.raises(MergeError, match=by_reader if remark else by_marker):
        merge_checkpoint(ck, tmp_path / "out.ckpt", log=None)
    assert not (tmp_path / "out.ckpt").exists()
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_missing_marker_is_an_incomplete_checkpoint(tmp_path):
    ck = _bad(tmp_path, lambda d: (d / "COMPLETE").unlink())
    with pytest.raises(MergeError, match="incomplete checkpoint .no COMPLETE marker"):
        merge_checkpoint(ck, tmp_path / "out.ckpt", log=None)


def _flip(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def _tensor_offset(path, name):
    return CkptReader(path).index[name][2][0][0] + 3  # a byte inside the tensor's data


@pytest.mark.parametrize("what", ["shard", "replicated", "split_info", "marker"])
def test_flipped_byte_is_found_by_merge_reshard_and_verify(tmp_path, what):
    """One flipped bit anywhere (a shard's data, rank 0's shared tensor, a split-info JSON, the marker):
    merge, reshard and verify each fail naming the file (and the tensor) and the two checksums; nothing is
    written."""
    ck = _bad(tmp_path, lambda d: None)
    if what == "shard":
        _flip(ck / "rank_1.ckpt", _tensor_offset(ck / "rank_1.ckpt", "b.weight"))
        message = r"rank_1.ckpt: tensor 'b.weight' fails its checksum: CRC-32 \d+, the split info recorded \d+"
    elif what == "replicated":
        _flip(ck / "rank_0.ckpt", _tensor_offset(ck / "rank_0.ckpt", "global_step"))
        message = r"rank_0.ckpt: tensor 'global_step' fails its checksum"
    elif what == "split_info":
        path = ck / split_info_name(1)
        _flip(path, path.read_bytes().index(b'"step": 7') + 8)  # 7 -> 6: still valid JSON
        message = r"params_split_info_1.json: checksum mismatch: CRC-32 \d+, the COMPLETE marker recorded \d+"
    else:
        path = ck / "COMPLETE"
        _flip(path, path.read_bytes().index(b'"step": 7') + 8)
        message = r"COMPLETE: corrupted marker .checksum \d+, its content gives \d+"
    with pytest.raises(MergeError, match=message):
        merge_checkpoint(ck, tmp_path / "out.ckpt", with_optimizer=True, log=None)
    with pytest.raises(MergeError, match=message):
        reshard_checkpoint(ck, tmp_path / "re", 3, log=None)
    lines = []
    report = verify_checkpoint(ck, log=lines.append)
    assert not report["ok"] and re.search(message, report["problems"][0]), report
    assert lines[-1].startswith("FAILED"), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_verify_whole_checkpoint_and_cli(tmp_path):
    write_synthetic(tmp_path / "ck", 3, 3)
    lines = []
    report = verify_checkpoint(tmp_path / "ck", log=lines.append)
    assert report["ok"] and report["checksums"] and report["ranks"] == 3 and report["step"] == 7, report
    pieces = {(t.file, t.key) for r in range(3) for t in SplitInfo.read(tmp_path / "ck" / split_info_name(r)).tensors}
    assert report["tensors"] == len(pieces) > len(_arrays()), report  # every piece of every rank, each once
    assert lines[-1].startswith("ok ") and "every checksum matches" in lines[-1], lines
    write_synthetic(tmp_path / "bad", 2, 1)
    _flip(tmp_path / "bad" / "network.ckpt", _tensor_offset(tmp_path / "bad" / "network.ckpt", "a.weight"))
    code = "import sys; from mindzero.checkpoint.cli import main_verify; sys.exit(main_verify(sys.argv[1:]))"
    ok = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ck")], capture_output=True, text=True)
    assert ok.returncode == 0 and "every checksum matches" in ok.stdout, ok
    bad = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ck"), str(tmp_path / "bad")],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "network.ckpt: tensor 'a.weight' fails its checksum" in bad.stdout, bad


def test_version_1_checkpoint_reads_without_verification(tmp_path):
    """A checkpoint written before checksums (format_version 1, a marker without a file list) still merges;
    verify says that only its structure was checked."""
    full = write_synthetic(tmp_path / "ck", 2, 3)
    for r in range(2):
        raw = json.loads((tmp_path / "ck" / split_info_name(r)).read_text())
        raw["format_version"] = 1
        for t in raw["tensors"]:
            del t["crc32"]
        (tmp_path / "ck" / split_info_name(r)).write_text(json.dumps(raw))
    (tmp_path / "ck" / "COMPLETE").write_text(json.dumps({"run_id": "run-x", "step": 7, "files": []}))
    with pytest.warns(UserWarning, match=r"without checksums \(format_version 1\); read without verification"):
        merge_checkpoint(tmp_path / "ck", tmp_path / "m.ckpt", log=None)
    np.testing.assert_array_equal(CkptReader(tmp_path / "m.ckpt").read("b.weight"), full["b.weight"])
    lines = []
    with pytest.warns(UserWarning):
        report = verify_checkpoint(tmp_path / "ck", log=lines.append)
    assert report["ok"] and not report["checksums"]
    assert "format_version 1: no checksums recorded" in lines[-1], lines


def test_json_from_another_run(tmp_path):
    write_synthetic(tmp_path / "ck", 2, 3)
    write_synthetic(tmp_path / "other", 2, 3, seed=1)
    raw = json.loads((tmp_path / "other" / split_info_name(1)).read_text())
    raw["run_id"] = "run-y"
    (tmp_path / "ck" / split_info_name(1)).write_text(json.dumps(raw))
    with pytest.raises(MergeError, match=r"params_split_info_1.json: (\d+ bytes|checksum mismatch)"):  # the marker
        merge_checkpoint(tmp_path / "ck", tmp_path / "out.ckpt", log=None)
    _remark(tmp_path / "ck")  # a marker written over the mixed files: the split infos disagree
    with pytest.raises(MergeError, match="params_split_info_1.json: field 'run_id' is 'run-y' but rank 0 has 'run-x'"):
        merge_checkpoint(tmp_path / "ck", tmp_path / "out.ckpt", log=None)


def _edit_split_info(tmp_path, rank, edit):
    """A valid checkpoint whose rank's split info ``edit`` changed (under a new marker, so only the split
    infos' rules can catch it)."""
    ck = _bad(tmp_path, lambda d: None)
    raw = json.loads((ck / split_info_name(rank)).read_text())
    edit(raw)
    (ck / split_info_name(rank)).write_text(json.dumps(raw))
    _remark(ck)
    return ck


def test_unknown_format_version(tmp_path):
    ck = _edit_split_info(tmp_path, 0, lambda raw: raw.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(MergeError, match=fr"format_version must be one of \(1, 2, 3\), got {FORMAT_VERSION + 1}"):
        merge_checkpoint(ck, tmp_path / "out.ckpt", log=None)


def test_shape_disagreement_names_the_file(tmp_path):
    ck = _edit_split_info(tmp_path, 1, lambda raw: raw["tensors"][0].update(shape=[15, 7]))
    with pytest.raises(MergeError, match=r"params_split_info_1.json: tensor set differs .*different \['a.weight'\]"):
        merge_checkpoint(ck, tmp_path / "out.ckpt", log=None)


def test_existing_output_is_refused_and_kept(tmp_path):
    ck = _bad(tmp_path, lambda d: None)
    out = tmp_path / "out.ckpt"
    out.write_bytes(b"precious")
    with pytest.raises(MergeError, match="exists; pass force=True"):
        merge_checkpoint(ck, out, log=None)
    assert out.read_bytes() == b"precious"
    merge_checkpoint(ck, out, force=True, log=None)
    assert "a.weight" in CkptReader(out).names()


def test_cli_errors_and_summary(tmp_path):
    ck = _bad(tmp_path, lambda d: None)
    ok = subprocess.run([sys.executable, "-c", "import sys; from mindzero.checkpoint.cli import main_merge; "
                         f"sys.exit(main_merge(['{ck}', '-o', '{tmp_path / 'o.ckpt'}']))"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and f"merged {len(SHAPES)} tensors" in ok.stdout, ok
    bad = subprocess.run([sys.executable, "-c", "import sys; from mindzero.checkpoint.cli import main_merge; "
                          f"sys.exit(main_merge(['{ck}', '-o', '{tmp_path / 'o.ckpt'}']))"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "exists; pass force=True" in bad.stderr, bad


def test_progress_bar_and_summary_line(tmp_path, capsys):
    """Merge and reshard show a tqdm bar (bytes) on stderr and end with one summary line through ``log``;
    ``log=None`` shows neither."""
    write_synthetic(tmp_path / "ck", 2, 3)
    lines = []
    merge_checkpoint(tmp_path / "ck", tmp_path / "m.ckpt", with_optimizer=True, log=lines.append)
    reshard_checkpoint(tmp_path / "ck", tmp_path / "re", 4, log=lines.append)
    err = capsys.readouterr().err
    assert "merge:" in err and "reshard:" in err and "100%" in err, err
    assert len(lines) == 2 and lines[0].startswith("merged ") and lines[1].startswith("resharded to 4 ranks, stage 3:")
    merge_checkpoint(tmp_path / "ck", tmp_path / "m2.ckpt", log=None)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("n, m, stage, new_stage", [(4, 2, 3, 2), (2, 4, 1, 3), (3, 5, 3, 3), (2, 1, 3, 0),
                                                    (2, 2, 3, 1), (2, 3, 2, 3)])
def test_piece_for_another_layout_reads_only_overlapping_pieces(tmp_path, n, m, stage, new_stage):
    """Loading at another world size or stage (load_checkpoint's rule): what each new rank gets is the padded
    slice of the full tensor (per-rank buffers: old rank r's, rank 0's beyond the old world), and a new shard
    reads only the old pieces that overlap it."""
    from mindzero.checkpoint.offline import _resharded_infos
    from mindzero.checkpoint.source import Source

    full = write_synthetic(tmp_path / "ck", n, stage)
    src = Source(tmp_path / "ck", check_pieces=False)
    reads = []
    real_read = src.read_piece
    src.read_piece = lambda t: reads.append(t) or real_read(t)
    for info in _resharded_infos(src, m, new_stage, "ckpt", "run-new"):
        for t in info.tensors:
            reads.clear()
            got = src.piece_for(t, info.op_rank)
            value = full[t.name].reshape(-1)
            if t.name == "bn.moving_mean":
                value = value + 100.0 * (info.op_rank if info.op_rank < n else 0)
            elif t.sharded:
                value = np.concatenate([value, np.zeros(t.shard_size * m - value.size, value.dtype)])
                value = value[t.offset:t.offset + t.shard_size]
                old = src.ref.by_name()[t.name]
                if old.sharded:  # only the old shards overlapping [offset, offset + valid) (or the same piece)
                    assert all((r.offset < t.offset + t.valid and t.offset < r.offset + r.valid)
                               or (r.offset, r.shard_size) == (t.offset, t.shard_size) for r in reads), (t, reads)
                    assert len(reads) <= -(-t.shard_size // old.shard_size) + 1, (t, reads)
            np.testing.assert_array_equal(got.reshape(-1), value, err_msg=f"{t.name} new rank {info.op_rank}")
