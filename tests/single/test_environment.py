"""The user's machine, one process: ``start_data_parallel`` chooses a device only where asked and sets nothing of
MindSpore's parallel context; ``python -m mindzero.env`` reports what a bug report needs; a MindSpore older than
supported is refused by prepare; the verbose plan and ``memory_report`` say the device and how each collective runs."""
import json
import subprocess
import sys

import mindspore as ms
import pytest
from mindspore import nn

import mindzero
import mindzero.comm.start as start
from mindzero.core import versions
from mindzero.core.topology import OPERATIONS
from mindzero.engine.report import plan_text


@pytest.fixture
def calls(monkeypatch):
    """What start_data_parallel asks of MindSpore, recorded instead of done (init() would need a launch)."""
    seen = []
    monkeypatch.setattr(start.ms, "set_device", lambda d: seen.append(("set_device", d)))
    monkeypatch.setattr(start.ms, "set_context", lambda **kw: seen.append(("set_context", kw)))
    monkeypatch.setattr(start.ms, "set_auto_parallel_context", lambda **kw: seen.append(("parallel_context", kw)))
    monkeypatch.setattr(start, "init", lambda: seen.append(("init",)))
    monkeypatch.setattr(start, "current_world", lambda: "world")
    monkeypatch.delenv("MINDZERO_DEVICE", raising=False)
    return seen


def test_without_arguments_no_device_and_no_parallel_context(calls):
    assert start.start_data_parallel() == "world"
    assert calls == [("set_context", {"mode": ms.GRAPH_MODE}), ("init",)]


def test_the_device_argument_and_the_variable(calls, monkeypatch):
    start.start_data_parallel(device="ascend", mode=ms.PYNATIVE_MODE)
    assert calls == [("set_context", {"mode": ms.PYNATIVE_MODE}), ("set_device", "Ascend"), ("init",)]
    calls.clear()
    monkeypatch.setenv("MINDZERO_DEVICE", "GPU")
    start.start_data_parallel()
    assert ("set_device", "GPU") in calls
    calls.clear()
    start.start_data_parallel(device="CPU")  # the argument wins
    assert ("set_device", "CPU") in calls and ("set_device", "GPU") not in calls


def test_a_bad_device_is_refused_before_anything_is_set(calls, monkeypatch):
    monkeypatch.setenv("MINDZERO_DEVICE", "TPU")
    with pytest.raises(ValueError, match=r"MINDZERO_DEVICE='TPU': must be one of CPU, GPU, Ascend"):
        start.start_data_parallel()
    assert ("init",) not in calls and not any(c[0] == "set_device" for c in calls)


def test_the_environment_report():
    """``python -m mindzero.env --json``, not launched: versions, the device, the collectives on it."""
    out = subprocess.run([sys.executable, "-m", "mindzero.env", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    sw = report["software"]
    assert sw["mindzero"]["version"] == mindzero.__version__
    assert sw["mindspore"]["version"] == ms.__version__ and sw["mindspore"]["support"] == "tested"
    assert sw["mindspore"]["tested"] == list(versions.TESTED_MINDSPORE)
    assert set(sw["packages"]) == {"numpy", "mindone", "mindcv", "pyyaml"} and sw["packages"]["numpy"].startswith("1.")
    assert report["devices"]["device_target"] == "CPU" and report["devices"]["available"]["CPU"] == 1
    assert report["devices"]["available"]["Ascend"] == 0
    coll = report["collectives"]
    assert (coll["device"], coll["backend"]) == ("CPU", "emulated")
    assert [r["operation"] for r in coll["routes"]] == list(OPERATIONS)
    assert "world" not in report
    text = subprocess.run([sys.executable, "-m", "mindzero.env"], capture_output=True, text=True, timeout=120).stdout
    for line in (f"MindSpore {ms.__version__}: tested", "device: MindSpore runs on CPU; mindzero sets none",
                 "reduce-scatter  emulated  AllReduce(world) of the whole tensor, then this rank's slice",
                 "world: not launched"):
        assert line in text, text


def test_an_older_mindspore_is_refused_at_prepare(monkeypatch):
    net = nn.Dense(3, 2)
    monkeypatch.setattr(ms, "__version__", "2.6.0")
    with pytest.raises(versions.UnsupportedMindSpore, match=r"MindSpore 2\.6\.0 is older than mindzero supports"):
        mindzero.prepare_train_network(nn.WithLossCell(net, nn.MSELoss()), nn.Adam(net.trainable_params()))


def test_the_plan_and_the_report_say_the_device_and_the_collectives():
    net = nn.Dense(3, 2)
    train = mindzero.prepare_train_network(nn.WithLossCell(net, nn.MSELoss()), nn.Adam(net.trainable_params()),
                                           zero_stage=1)
    report = mindzero.memory_report(train)
    assert (report["device"], report["backend"]) == ("CPU", "single")
    assert list(report["collectives"]) == list(OPERATIONS)
    assert report["collectives"]["reduce-scatter"] == {"runs": "identity (one rank)", "kind": "local"}
    assert "collectives on CPU (single backend): all-gather identity (one rank) [local];" in plan_text(train)
