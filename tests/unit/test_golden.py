"""Golden checkpoints (tests/data/golden, written by mindzero before the package layout of mindzero/core, engine, checkpoint): they
stay readable by today's offline tools. Pure: no MindSpore."""
import json
from pathlib import Path

import numpy as np
import pytest

from mindzero import merge_checkpoint, reshard_checkpoint, verify_checkpoint
from mindzero.checkpoint.tensor_io import open_reader

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "case.json").exists())


def expected(case):
    with np.load(GOLDEN / case / "expected.npz") as f:
        return {k: f[k] for k in f.files}


def test_every_golden_case_is_present():
    assert CASES == ["hybrid_s3_ckpt", "lora_s3_ckpt", "mp_s1_ckpt", "s1_ckpt", "s1_safetensors", "s3_ckpt",
                     "s3_safetensors"]


@pytest.mark.parametrize("case", CASES)
def test_golden_checkpoint_verifies_and_merges_to_what_the_old_code_read(case, tmp_path):
    meta = json.loads((GOLDEN / case / "case.json").read_text())
    assert verify_checkpoint(GOLDEN / case, log=None)["ok"]
    want = expected(case)
    out = tmp_path / f"merged.{meta['format']}"
    merge_checkpoint(GOLDEN / case, out, format=meta["format"], with_optimizer=True, log=None)
    got = open_reader(out)
    merged = {k[len("merged/"):]: v for k, v in want.items() if k.startswith("merged/")}
    assert sorted(got.names()) == sorted(merged) and len(merged) > 5
    for name, value in merged.items():
        np.testing.assert_array_equal(got.read(name), value, err_msg=f"{case} {name}")


@pytest.mark.parametrize("case", CASES)
def test_golden_checkpoint_reshards(case, tmp_path):
    """Resharded to 2 ranks at stage 3 (and from there to 3 ranks at stage 1), the merged parameters are
    still the ones the old code gathered (per-rank buffers: rank 0's, as gathered on rank 0)."""
    meta = json.loads((GOLDEN / case / "case.json").read_text())
    want = expected(case)
    two, three = tmp_path / "two", tmp_path / "three"
    reshard_checkpoint(GOLDEN / case, two, 2, stage=3, log=None)
    reshard_checkpoint(two, three, 3, stage=1, log=None)
    merge_checkpoint(three, tmp_path / f"m.{meta['format']}", format=meta["format"], log=None,
                     parameter_values="param")
    got = open_reader(tmp_path / f"m.{meta['format']}")
    params = {k[len("param/"):]: v for k, v in want.items() if k.startswith("param/")}
    assert sorted(got.names()) == sorted(params)
    for name, value in params.items():
        np.testing.assert_array_equal(got.read(name), value, err_msg=f"{case} {name}")
