"""Merge and reshard on synthetic shards, pure Python (no MindSpore): the split-info schema alone rebuilds
every tensor; bad input gets a clear error and nothing is written."""
import json
import subprocess
import sys

import numpy as np
import pytest

from mindzero.ckpt_io import CkptReader, open_reader, open_writer
from mindzero.merge import MergeError, merge_checkpoint, reshard_checkpoint
from mindzero.plan import REASON_NOT_OPTIMIZED, ParamInfo, PartitionPlan
from mindzero.split_info import FORMAT_VERSION, SplitInfo, entry_at, split_info_name

SHAPES = {"a.weight": (7, 15), "b.weight": (17, 257), "c": (), "bn.moving_mean": (6,)}


def _arrays(seed=0):
    rng = np.random.RandomState(seed)
    full = {n: np.asarray(rng.randn(*s), np.float32) for n, s in SHAPES.items()}
    full.update({"adam_m." + n: np.asarray(rng.randn(*s), np.float32) for n, s in SHAPES.items() if "moving" not in n})
    full["global_step"] = np.array([7], np.int32)
    return full


def write_synthetic(directory, n, stage, fmt="ckpt", seed=0, per_rank_offset=100.0):
    """A checkpoint as N ranks would save it, written with the pure writer; returns the full arrays."""
    full = _arrays(seed)
    infos = [ParamInfo(name, shape, optimized="moving" not in name) for name, shape in SHAPES.items()]
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
            per_rank = kind == "parameter" and spec.reason == REASON_NOT_OPTIMIZED
            entry = entry_at(name, kind, param, value.shape, str(value.dtype), spec, per_rank, stage, r, fmt)
            piece = value + per_rank_offset * r if per_rank else value
            if entry.sharded:
                flat = np.zeros(spec.shard_size, np.float32)
                flat[:spec.valid] = value.reshape(-1)[spec.offset:spec.offset + spec.valid]
                piece = flat
            entries.append(entry)
            file = entry.file
            if file == f"rank_{r}.{fmt}" or r == 0:
                files.setdefault(file, {})[name] = piece
        SplitInfo("run-x", stage, n, r, 7, fmt, plan.fingerprint(), tuple(entries)).write(
            directory / split_info_name(r))
    for file, tensors in files.items():
        with open_writer(directory / file, fmt, [(k, str(v.dtype), v.shape) for k, v in tensors.items()]) as w:
            for k, v in tensors.items():
                w.write(k, v, str(v.dtype))
    (directory / "COMPLETE").write_text("{}")
    return full


def test_no_mindspore_import():
    code = "import sys, mindzero.merge, mindzero.ckpt_io, mindzero.split_info; print('mindspore' in sys.modules)"
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
    assert {i.group_size for i in infos} == {m} and {i.stage for i in infos} == {new_stage}
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


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "rank_1.ckpt").unlink(), "rank_1.ckpt: checkpoint file is missing"),
    (lambda d: (d / split_info_name(1)).unlink(), "params_split_info_1.json: split-info file is missing"),
    (lambda d: (d / "COMPLETE").unlink(), "incomplete checkpoint"),
    (lambda d: (d / "rank_1.ckpt").write_bytes((d / "rank_1.ckpt").read_bytes()[:-10]), "rank_1.ckpt: truncated"),
    (lambda d: (d / "rank_0.ckpt").write_bytes(b"\x07garbage" * 10), "rank_0.ckpt: not a MindSpore checkpoint"),
    (lambda d: (d / split_info_name(1)).write_text("{not json"), "params_split_info_1.json: not valid JSON"),
])
def test_damaged_checkpoint(tmp_path, damage, message):
    ck = _bad(tmp_path, damage)
    with pytest.raises(MergeError, match=message):
        merge_checkpoint(ck, tmp_path / "out.ckpt", log=None)
    assert not (tmp_path / "out.ckpt").exists()
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_json_from_another_run(tmp_path):
    write_synthetic(tmp_path / "ck", 2, 3)
    write_synthetic(tmp_path / "other", 2, 3, seed=1)
    raw = json.loads((tmp_path / "other" / split_info_name(1)).read_text())
    raw["run_id"] = "run-y"
    (tmp_path / "ck" / split_info_name(1)).write_text(json.dumps(raw))
    with pytest.raises(MergeError, match="params_split_info_1.json: field 'run_id' is 'run-y' but rank 0 has 'run-x'"):
        merge_checkpoint(tmp_path / "ck", tmp_path / "out.ckpt", log=None)


def test_unknown_format_version(tmp_path):
    ck = _bad(tmp_path, lambda d: None)
    raw = json.loads((ck / split_info_name(0)).read_text())
    raw["format_version"] = FORMAT_VERSION + 1
    (ck / split_info_name(0)).write_text(json.dumps(raw))
    with pytest.raises(MergeError, match=f"format_version must be {FORMAT_VERSION}, got {FORMAT_VERSION + 1}"):
        merge_checkpoint(ck, tmp_path / "out.ckpt", log=None)


def test_shape_disagreement_names_the_file(tmp_path):
    ck = _bad(tmp_path, lambda d: None)
    raw = json.loads((ck / split_info_name(1)).read_text())
    raw["tensors"][0]["shape"] = [15, 7]
    (ck / split_info_name(1)).write_text(json.dumps(raw))
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
    ok = subprocess.run([sys.executable, "-c", "import sys; from mindzero.merge import main_merge; "
                         f"sys.exit(main_merge(['{ck}', '-o', '{tmp_path / 'o.ckpt'}']))"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "merged 4 tensors" in ok.stdout, ok
    bad = subprocess.run([sys.executable, "-c", "import sys; from mindzero.merge import main_merge; "
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
