"""Checkpoint faults across processes (2 ranks): a rank killed (SIGKILL) in the middle of a save, a full
disk on one rank during a synchronous and an asynchronous save, a flipped byte in a shard, in a split-info
JSON and in the marker, and ranks' files from different steps. What the user sees, and what survives.
(docs/checkpoints.md has the matrix.)"""
import json
import shutil

import numpy as np
import pytest

import mindzero
from mindzero.checkpoint.format import SplitInfo, split_info_name, write_marker
from mindzero.checkpoint.tensor_io import CkptReader
from mindzero.launch.local import LaunchError, msrun
from mindzero.launch.logs import rank_output
from tests.support.compare import load_npz

from . import WORKERS


def _flip(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01  # "2" -> "3" in JSON: still valid
    path.write_bytes(bytes(raw))


def _damage(root):
    """Copies of the complete checkpoint step_2, each damaged one way; {name: (path, what load must say)}."""
    good = root / "step_2"
    out = {}

    def copy(name):
        shutil.copytree(good, root / name)
        return root / name

    d = copy("flip_shard")  # one bit inside the data of rank 1's shard of w2
    _flip(d / "rank_1.ckpt", CkptReader(d / "rank_1.ckpt").index["w2"][2][0][0] + 5)
    out["flip_shard"] = (d, r"rank_1.ckpt: tensor 'w2' fails its checksum: CRC-32 \d+, the split info recorded \d+")
    d = copy("flip_json")  # one bit of a split-info JSON (still valid JSON)
    raw = (d / split_info_name(1)).read_bytes()
    _flip(d / split_info_name(1), raw.index(b'"step": 2') + 8)
    out["flip_json"] = (d, r"params_split_info_1.json: checksum mismatch: CRC-32 \d+, the COMPLETE marker recorded")
    d = copy("flip_marker")
    _flip(d / "COMPLETE", (d / "COMPLETE").read_bytes().index(b'"step": 2') + 8)
    out["flip_marker"] = (d, r"COMPLETE: corrupted marker")
    d = copy("mixed_steps")  # rank 1's files from step_1
    for name in ("rank_1.ckpt", split_info_name(1)):
        shutil.copy(root / "step_1" / name, d / name)
    out["mixed_steps"] = (d, r"params_split_info_1.json: (\d+ bytes|checksum mismatch)")
    d = copy("mixed_steps_remarked")  # the same, under a marker written over the mixed files
    for name in ("rank_1.ckpt", split_info_name(1)):
        shutil.copy(root / "step_1" / name, d / name)
    (d / "COMPLETE").unlink()
    write_marker(d, run_id="forged", step=2, group_size=2)
    out["mixed_steps_remarked"] = (d, r"params_split_info_1.json: field 'run_id' is .* \(files from different "
                                      r"checkpoints\?\)")
    out["partial"] = (root / "step_3.partial", r"incomplete checkpoint \(no COMPLETE marker")
    return out


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    ck = root / "ck"
    with pytest.raises(LaunchError) as err:
        msrun(WORKERS / "worker_fault.py", 2, root / "kill", ["--phase", "kill", "--root", str(ck)], timeout=300)
    kill_error = str(err.value)
    after_kill = {p.name: sorted(q.name for q in p.iterdir()) for p in ck.iterdir()}
    damaged = _damage(ck)
    msrun(WORKERS / "worker_fault.py", 2, root / "resume",
          ["--phase", "resume", "--root", str(ck), "--damaged", json.dumps([str(p) for p, _ in damaged.values()])],
          timeout=600)
    reports = [json.loads((root / "resume" / f"rank_{r}" / "resume.json").read_text()) for r in range(2)]
    return dict(root=root, ck=ck, kill_error=kill_error, after_kill=after_kill, damaged=damaged, reports=reports)


def test_kill_in_the_middle_of_a_save_leaves_the_previous_checkpoint(faults):
    ck, after = faults["ck"], faults["after_kill"]
    assert "SIGKILL now" in rank_output(faults["root"] / "kill", 1), faults["kill_error"]
    assert "not reached" not in rank_output(faults["root"] / "kill", 0)
    # some files of step 3 were written, it is not complete, and step 2 is untouched
    assert "step_3" not in after and "rank_1.ckpt" in after["step_3.partial"], after
    assert "COMPLETE" not in after["step_3.partial"]
    assert "COMPLETE" in after["step_2"] and mindzero.verify_checkpoint(ck / "step_2", log=None)["ok"]
    # skipped by resume (latest_checkpoint), refused by load (worker), merge and verify
    for r in range(2):
        assert faults["reports"][r]["latest"] == str(ck / "step_2")
    with pytest.raises(mindzero.MergeError, match="incomplete checkpoint"):
        mindzero.merge_checkpoint(ck / "step_3.partial", faults["root"] / "m.ckpt", log=None)
    assert not mindzero.verify_checkpoint(ck / "step_3.partial", log=None)["ok"]
    assert not (faults["root"] / "m.ckpt").exists()


def test_resume_after_the_kill_continues_exactly(faults):
    for r in range(2):
        before = load_npz(faults["root"] / "kill" / f"rank_{r}" / "kill.npz")
        after = load_npz(faults["root"] / "resume" / f"rank_{r}" / "resume.npz")
        for k in (k for k in before if k.startswith("saved/")):
            np.testing.assert_array_equal(after["loaded/" + k[6:]], before[k], err_msg=k)
        assert after["loss3"].tolist() == before["loss3"].tolist()


@pytest.mark.parametrize("case", ["flip_shard", "flip_json", "flip_marker", "mixed_steps", "mixed_steps_remarked",
                                  "partial"])
def test_damaged_checkpoint_is_refused_everywhere(faults, case, tmp_path):
    """load (every rank refuses: the rank that found it names it, the others say another rank could not
    load), merge and mindzero-verify each fail naming the file and what is wrong; nothing is written."""
    import re

    path, message = faults["damaged"][case]
    said = [faults["reports"][r][str(path)] for r in range(2)]
    assert any(re.search(message, s) for s in said), (case, said)
    assert all(re.search(message, s) or "other rank(s) could not load their part" in s for s in said), said
    with pytest.raises(mindzero.MergeError, match=message):
        mindzero.merge_checkpoint(path, tmp_path / "m.ckpt", with_optimizer=True, log=None)
    report = mindzero.verify_checkpoint(path, log=None)
    assert not report["ok"] and re.search(message, report["problems"][0]), report
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_full_disk_fails_every_rank_and_leaves_nothing(faults, mode):
    """A file-size limit on rank 1 (what a full disk looks like to the process): every rank raises, rank 1
    naming the OS error; no checkpoint directory, complete or partial, is left."""
    said = [faults["reports"][r][f"full_disk_{mode}"] for r in range(2)]
    assert "File too large" in said[1], said
    if mode == "sync":
        assert "failed on 1 rank(s), including this rank (1)" in said[1], said
        assert "failed on 1 rank(s), including another rank" in said[0], said
    else:
        assert "rank 1: OSError" in said[0] and "earlier checkpoints are untouched" in said[0], said
    for r in range(2):
        assert faults["reports"][r][f"full_disk_{mode}_left"] == [], faults["reports"][r]


def test_async_save_overlapped_with_training_holds_the_saved_state(faults, tmp_path):
    path = faults["ck"] / "step_async"
    assert all(faults["reports"][r]["async_path"] == str(path) for r in range(2))
    assert all(faults["reports"][r]["async_host_bytes"] > 0 for r in range(2))
    assert mindzero.verify_checkpoint(path, log=None)["ok"]
    saved = load_npz(faults["root"] / "resume" / "rank_0" / "resume.npz")
    mindzero.merge_checkpoint(path, tmp_path / "m.ckpt", log=None)
    merged = CkptReader(tmp_path / "m.ckpt")
    for name in merged.names():
        np.testing.assert_array_equal(merged.read(name), saved["async_saved/" + name], err_msg=name)
    assert SplitInfo.read(path / split_info_name(1)).step == 3
