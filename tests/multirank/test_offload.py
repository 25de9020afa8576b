"""Disk offload across processes (2 ranks; ``worker_offload.py``): the peak per rank against the same run with
its states in memory, checkpoints written from and loaded into the state file (and merged offline), a rank killed in
the middle of an update, and no state file left behind. Parity of the training itself (clipping, overflow,
param_dtype, accumulation) is in test_parity.py's ``disk-*`` rows."""
import json

import numpy as np
import pytest

import mindzero
from mindzero.launch.local import LaunchError, msrun
from mindzero.launch.logs import rank_output
from tests.support.compare import load_npz

from . import WORKERS


@pytest.fixture(scope="module")
def offload(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    ck = root / "ck"
    with pytest.raises(LaunchError) as err:
        msrun(WORKERS / "worker_offload.py", 2, root / "kill", ["--phase", "kill", "--root", str(ck)], timeout=300)
    left = sorted(p.name for p in (ck / "offload" / "rank_1").iterdir())
    msrun(WORKERS / "worker_offload.py", 2, root / "main", ["--phase", "main", "--root", str(ck)], timeout=900)
    reports = [json.loads((root / "main" / f"rank_{r}" / "main.json").read_text()) for r in range(2)]
    for r in range(2):  # the disk run's memory, measured first in the kill launch's processes
        reports[r]["memory"] = json.loads((root / "kill" / f"rank_{r}" / "memory.json").read_text())
    arrays = [load_npz(root / "main" / f"rank_{r}" / "main.npz") for r in range(2)]
    return dict(root=root, ck=ck, kill_error=str(err.value), left=left, reports=reports, arrays=arrays)


def test_peak_is_lower_than_in_memory_by_most_of_the_state_bytes(offload):
    """16.8M parameters at stage 3, 2 ranks: each rank's 67 MiB of Adam states leave memory; the slots (3 x 6 MiB)
    stay. The peak growth over prepare + 3 steps (each the first thing its launch does) drops by at least half the
    state bytes."""
    for r, rep in enumerate(offload["reports"]):
        disk, mem = rep["memory"], rep["memory-in-memory"]
        assert disk["state_bytes"] == mem["state_bytes"] > 60 * 2 ** 20, rep
        saved = mem["peak_growth"] - disk["peak_growth"]
        assert saved >= 0.5 * mem["state_bytes"], (r, saved / 2 ** 20, mem["state_bytes"] / 2 ** 20, rep)


def test_a_rank_killed_mid_update_leaves_the_last_checkpoint_loadable(offload):
    ck = offload["ck"]
    assert "rank 1: exiting in the update of step 2" in rank_output(offload["root"] / "kill", 1), offload["kill_error"]
    assert "not reached" not in rank_output(offload["root"] / "kill", 0)
    assert mindzero.verify_checkpoint(ck / "step_2", log=None)["ok"]
    assert any(name.startswith("states_") for name in offload["left"]), offload["left"]  # the dead rank's scratch
    for r, a in enumerate(offload["arrays"]):
        assert a["kill/resumed_loss"].tolist() == a["kill/straight_loss"].tolist(), r
        for k in (k for k in a if k.startswith("kill/straight/")):
            np.testing.assert_array_equal(a[k.replace("/straight/", "/resumed/")], a[k], err_msg=f"rank {r} {k}")


def test_checkpoints_through_the_file_both_ways(offload, tmp_path):
    """Stage 2: a checkpoint of the states on disk resumes an in-memory run, and the other way round, each equal to
    training straight through; both checkpoints merge offline to the same tensors, optimizer states included."""
    for r, a in enumerate(offload["arrays"]):
        straight = {k[len("ck/straight/"):]: v for k, v in a.items() if k.startswith("ck/straight/")}
        for name in ("on_disk", "mem_from_disk", "disk_from_mem"):
            for k, v in straight.items():
                got = a[f"ck/{name}/{k}"]
                if k == "losses" and name != "on_disk":
                    v = v[2:]
                np.testing.assert_array_equal(got, v, err_msg=f"rank {r} {name} {k}")
    merged = {}
    for name in ("ck_disk", "ck_mem"):
        mindzero.merge_checkpoint(offload["ck"] / name, tmp_path / f"{name}.ckpt", with_optimizer=True, log=None)
        from mindzero.checkpoint.tensor_io import CkptReader
        reader = CkptReader(tmp_path / f"{name}.ckpt")
        merged[name] = {n: reader.read(n) for n in reader.names()}
    assert merged["ck_disk"].keys() == merged["ck_mem"].keys()
    assert any(n.startswith("adam_m.") for n in merged["ck_disk"])
    for n, v in merged["ck_mem"].items():
        np.testing.assert_array_equal(merged["ck_disk"][n], v, err_msg=n)


def test_no_state_file_is_left_behind(offload):
    """While a run lives its file is there; at exit each rank's file is removed, and the killed rank's left-over
    was removed by the next run on this machine (its process was gone)."""
    for rep in offload["reports"]:
        assert rep["files_while_alive"] and all(f.startswith("states_") for f in rep["files_while_alive"]), rep
    offload_dir = offload["ck"] / "offload"
    assert [p for p in offload_dir.rglob("states_*")] == [], list(offload_dir.rglob("*"))
