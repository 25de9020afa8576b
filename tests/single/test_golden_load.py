"""Golden checkpoints (tests/data/golden, written on 4 ranks by mindzero before the package layout of mindzero/core, engine, checkpoint)
load into a train step of today's code in one process (another world size: the resume-anywhere rule), and
saving it again gives back every tensor the old code wrote."""
import json
from pathlib import Path

import numpy as np
import pytest
import mindspore as ms

import mindzero
from mindzero.checkpoint.tensor_io import open_reader
from tests.support.models import build, make_optimizer

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")
GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "case.json").exists())


@pytest.mark.parametrize("case", CASES)
def test_golden_checkpoint_loads_and_saves_back_the_same_tensors(case, tmp_path):
    meta = json.loads((GOLDEN / case / "case.json").read_text())
    with np.load(GOLDEN / case / "expected.npz") as f:
        want = {k: f[k] for k in f.files}
    net = build(meta["model"], seed=9)  # other values: the load must overwrite them
    opt = make_optimizer(meta["optimizer"], net)
    if meta["param_dtype"]:
        net = ms.amp.auto_mixed_precision(net, "O2")
    train = mindzero.prepare_train_network(net, opt, zero_stage=meta["stage"], param_dtype=meta["param_dtype"])
    assert mindzero.load_checkpoint(train, GOLDEN / case).step == 2
    got = mindzero.gather_full_state_dict(train)
    params = {k[len("param/"):]: v for k, v in want.items() if k.startswith("param/")}
    assert sorted(got) == sorted(params)
    for name, value in params.items():
        np.testing.assert_array_equal(got[name], value, err_msg=f"{case} {name}")
    if meta["param_dtype"]:
        masters = mindzero.gather_full_state_dict(train, masters=True)
        for name, value in ((k[len("master/"):], v) for k, v in want.items() if k.startswith("master/")):
            np.testing.assert_array_equal(masters[name], value, err_msg=f"{case} master {name}")
    mindzero.save_checkpoint(train, tmp_path / "again", format=meta["format"])
    out = tmp_path / f"merged.{meta['format']}"
    mindzero.merge_checkpoint(tmp_path / "again", out, format=meta["format"], with_optimizer=True, log=None)
    reader = open_reader(out)
    merged = {k[len("merged/"):]: v for k, v in want.items() if k.startswith("merged/")}
    assert sorted(reader.names()) == sorted(merged)
    for name, value in merged.items():
        np.testing.assert_array_equal(reader.read(name), value, err_msg=f"{case} {name}")
