"""``mindzero-env --ranks 2``: the report of a launched world, as a user runs it: every rank's device, backend and
groups, each collective run once and compared with NumPy, a small network trained at every stage against stage 0."""
import json
import subprocess
import sys

from mindzero.core.topology import OPERATIONS
from mindzero.env import TRAINED


def test_the_report_of_a_launched_world():
    out = subprocess.run([sys.executable, "-m", "mindzero.env", "--ranks", "2", "--json", "--timeout", "600"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout)
    ranks = report["world"]["ranks"]
    assert [r["world_rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert (r["world_size"], r["device"], r["mode"], r["backend"]) == (2, "CPU", "graph", "emulated"), r
        assert r["world_group"] == "mccl_world_group" and r["op_group"]["ranks"] == [0, 1]
        assert r["dp_group"]["ranks"] == [r["world_rank"]]
        assert [x["operation"] for x in r["routes"]] == list(OPERATIONS)
        assert set(r["collective_checks"]) == {"all-gather", "all-reduce", "reduce-scatter", "broadcast"}
        assert all(c["ok"] and c["error"] == "" for c in r["collective_checks"].values()), r["collective_checks"]
        trained = r["training_checks"]
        assert list(trained) == [t[0] for t in TRAINED]
        assert all(t["ok"] for t in trained.values()), trained
        for name in ("stage 1", "stage 2", "stage 3"):  # CPU: bit for bit
            assert trained[name]["max_rel_diff"] == 0.0, (name, trained[name])
        assert 0 < trained["stage 3, int8 gathers"]["max_rel_diff"] <= 1e-2  # its rounding shows, within the bound


def test_a_failed_check_fails_the_command():
    """The exit status follows the checks: a launch that cannot start (one rank asked for) is refused, and a report
    whose world failed exits 1."""
    out = subprocess.run([sys.executable, "-m", "mindzero.env", "--ranks", "1"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "--ranks 1: must be 0 (no launch) or at least 2" in out.stderr
    from mindzero.env import passed

    assert passed({"software": {}})
    assert not passed({"world": {"error": "x", "logs": "y"}})
    good = {"ok": True, "error": ""}
    assert passed({"world": {"ranks": [{"collective_checks": {"a": good}, "training_checks": {"b": good}}]}})
    assert not passed({"world": {"ranks": [{"collective_checks": {"a": good},
                                            "training_checks": {"b": {"ok": False, "error": "e"}}}]}})
