"""save_checkpoint / load_checkpoint refuse bad input with a clear error and lose nothing (one process)."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn

import mindzero
from mindzero.checkpoint.directory import CheckpointError
from tests.support.models import MODELS, build

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")


def _train(model="awkward", stage=3, steps=2, **kw):
    net = build(model)
    step = mindzero.prepare_train_network(net, nn.Adam(net.trainable_params(), 1e-2), zero_stage=stage, **kw)
    rng = np.random.RandomState(0)
    for _ in range(steps):
        step(*[Tensor(a) for a in type(net).batch(rng)])
    return step


def test_save_refuses_existing_directory_and_keeps_it(tmp_path):
    step = _train()
    mindzero.save_checkpoint(step, tmp_path / "ck")
    before = {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()}
    with pytest.raises(CheckpointError, match="already exists; choose a new directory"):
        mindzero.save_checkpoint(step, tmp_path / "ck")
    assert {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()} == before


def test_save_bad_format_and_mid_accumulation(tmp_path):
    step = _train(stage=2, steps=1, gradient_accumulation_steps=2)
    with pytest.raises(CheckpointError, match="format must be one of"):
        mindzero.save_checkpoint(step, tmp_path / "a", format="pickle")
    with pytest.raises(CheckpointError, match="after an update step: 1 micro-batches taken, gradient_accumulation"):
        mindzero.save_checkpoint(step, tmp_path / "b")
    assert not any(tmp_path.iterdir())


def test_interrupted_save_is_not_loadable(tmp_path):
    step = _train()
    mindzero.save_checkpoint(step, tmp_path / "ck")
    (tmp_path / "ck" / "COMPLETE").unlink()  # what a crash before the final rename leaves (as .partial)
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint \(no COMPLETE marker"):
        mindzero.load_checkpoint(_train(steps=0), tmp_path / "ck")


def test_load_into_other_network_names_the_difference(tmp_path):
    mindzero.save_checkpoint(_train("awkward"), tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"the network has parameters the checkpoint lacks: \['block.0.bias'.*the checkpoint has parameters the network lacks: \['gain'"):
        mindzero.load_checkpoint(_train("mixed", steps=0), tmp_path / "ck")


def test_load_at_another_stage_restores_the_same_state(tmp_path):
    """A stage-3 checkpoint loads straight into a stage-1 train step (no offline reshard): every parameter
    and optimizer state is the saved one, and the next step is the one the stage-3 run takes."""
    saved = _train(stage=3)
    mindzero.save_checkpoint(saved, tmp_path / "ck")
    other = _train(stage=1, steps=0)
    assert mindzero.load_checkpoint(other, tmp_path / "ck").stage == 3
    full = mindzero.gather_full_state_dict(saved)
    for k, v in mindzero.gather_full_state_dict(other).items():
        np.testing.assert_array_equal(v, full[k], err_msg=k)
    batch = [Tensor(a) for a in MODELS["awkward"].batch(np.random.RandomState(5))]
    assert float(other(*batch)[0].asnumpy()) == float(saved(*batch)[0].asnumpy())
    for k, v in mindzero.gather_full_state_dict(other).items():
        np.testing.assert_array_equal(v, mindzero.gather_full_state_dict(saved)[k], err_msg=k)


def test_corrupted_checkpoint_is_refused_and_nothing_changes(tmp_path):
    from mindzero.checkpoint.tensor_io import CkptReader

    mindzero.save_checkpoint(_train(stage=3), tmp_path / "ck")
    path = tmp_path / "ck" / "rank_0.ckpt"
    raw = bytearray(path.read_bytes())
    raw[CkptReader(path).index["w2"][2][0][0] + 7] ^= 0x04
    path.write_bytes(bytes(raw))
    fresh = _train(stage=3, steps=0)
    before = mindzero.gather_full_state_dict(fresh)
    with pytest.raises(CheckpointError, match=r"rank_0.ckpt: tensor 'w2' fails its checksum"):
        mindzero.load_checkpoint(fresh, tmp_path / "ck")
    for k, v in mindzero.gather_full_state_dict(fresh).items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


def test_load_shape_mismatch_names_the_parameter(tmp_path):
    mindzero.save_checkpoint(_train(stage=0), tmp_path / "ck")
    net = build("awkward")
    net.w1 = ms.Parameter(Tensor(np.zeros((7, 16), np.float32)), name="w1")
    step = mindzero.prepare_train_network(net, nn.Adam(net.trainable_params(), 1e-2), zero_stage=0)
    with pytest.raises(CheckpointError, match=r"w1: checkpoint \(7, 15\), network \(7, 16\)"):
        mindzero.load_checkpoint(step, tmp_path / "ck")


def test_save_full_checkpoint_suffix(tmp_path):
    step = _train()
    with pytest.raises(CheckpointError, match="path must end with .ckpt"):
        mindzero.save_full_checkpoint(step, tmp_path / "full.bin")
    mindzero.save_full_checkpoint(step, tmp_path / "full.ckpt")
    loaded = ms.load_checkpoint(str(tmp_path / "full.ckpt"))
    full = mindzero.gather_full_state_dict(step)
    assert sorted(loaded) == sorted(full)
    for k in full:
        np.testing.assert_array_equal(loaded[k].asnumpy(), full[k])
