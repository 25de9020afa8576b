"""One process: ``prepare_train_network(config=...)`` and ``ZeroCheckpoint`` refuse bad input with errors
that name the argument or key, the value and the rule; a config file gives what the same arguments give."""
import dataclasses
from pathlib import Path
import numpy as np
import pytest
import mindspore as ms
import mindspore.dataset as ds
from mindspore import Tensor, nn
from mindspore.train import Model, RunContext

import mindzero
from mindzero.checkpoint.directory import CheckpointError
from tests.support.models import MixedNet, build

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")


def prepare(**kw):
    net = build("mixed")
    return mindzero.prepare_train_network(net, nn.Adam(net.trainable_params(), 1e-2), **kw)


def losses(step, n=3):
    rng = np.random.RandomState(0)
    return [float(step(*[Tensor(a) for a in MixedNet.batch(rng)])[0].asnumpy()) for _ in range(n)]


def dataset(samples):
    x, y = MixedNet.batch(np.random.RandomState(1), samples)
    return ds.GeneratorDataset(list(zip(x, y)), ["x", "y"], shuffle=False).batch(2)


def test_config_file_equals_arguments(tmp_path):
    cfg = tmp_path / "zero.yaml"
    cfg.write_text("zero_stage: 2\ngradient_accumulation_steps: 1\nclip_grad: true\nclip_norm: 0.1\n"
                   "scale_sense: {init_loss_scale: 1024, scale_factor: 2, scale_window: 2}\n")
    by_file = prepare(config=cfg)
    by_args = prepare(zero_stage=2, clip_grad=True, clip_norm=0.1,
                      scale_sense=nn.DynamicLossScaleUpdateCell(1024.0, 2, 2))
    # the same options; the loss scale: a mapping in the file, a Cell as an argument (the same update rule)
    assert dataclasses.replace(by_file.zero_info.config, loss_scale=by_args.zero_info.config.loss_scale) == \
        by_args.zero_info.config
    file_manager, arg_manager = by_file.zero_info.loss_scale_manager, by_args.zero_info.loss_scale_manager
    assert (float(file_manager.scale_factor), file_manager.scale_window) == (2.0, 2) == \
        (float(arg_manager.scale_factor), arg_manager.scale_window)
    assert losses(by_file) == losses(by_args)
    np.testing.assert_array_equal(by_file.scale_sense.asnumpy(), by_args.scale_sense.asnumpy())
    assert float(by_file.scale_sense.asnumpy()) == 2048.0  # dynamic: grew after 2 good steps


def test_config_given_twice_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"zero_stage is given both as an argument \(3\) and in config \(2\); "
                                         "give each setting once"):
        prepare(zero_stage=3, config={"zero_stage": 2})
    with pytest.raises(mindzero.ConfigError, match=r"missing.yaml: cannot read the settings file"):
        prepare(config=tmp_path / "missing.yaml")
    with pytest.raises(mindzero.ConfigError, match=r"^config: key 'clip_norm': value 0: clip_norm must be a number > 0"):
        prepare(config={"clip_norm": 0})


def test_zero_checkpoint_bad_arguments(tmp_path):
    step = prepare(zero_stage=1, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match=r"save_every=3 must be a multiple of gradient_accumulation_steps=2"):
        mindzero.ZeroCheckpoint(step, tmp_path, save_every=3)
    with pytest.raises(ValueError, match=r"^ZeroCheckpoint: the checkpoint directory is required: "
                                         r"ZeroCheckpoint\(directory, ...\)"):
        mindzero.ZeroCheckpoint(step, save_every=2)
    with pytest.raises(ValueError, match=r"^ZeroCheckpoint: keep must be an int >= 0, got -1"):
        mindzero.ZeroCheckpoint(step, tmp_path, keep=-1)
    with pytest.raises(ValueError, match=r"keep is given both as an argument \(3\) and in config \(5\)"):
        mindzero.ZeroCheckpoint(step, tmp_path, keep=3, config={"checkpoint": {"keep": 5}})
    ck = mindzero.ZeroCheckpoint(step, config={"checkpoint": {"dir": str(tmp_path / "c"), "save_every": 4}})
    assert (ck.directory, ck.save_every, ck.keep, ck.format) == (tmp_path / "c", 4, 2, "ckpt")


def test_zero_checkpoint_written_as_mindspore_callbacks(tmp_path):
    """``ZeroCheckpoint("ckpts", ...)`` without a network (found in Model's run context), MindSpore's
    ``CheckpointConfig`` for how often and how many, the network-first form; a first argument that is neither a
    directory nor a train step is refused naming it."""
    from mindspore.train import CheckpointConfig

    ck = mindzero.ZeroCheckpoint("ckpts", save_every=3, keep=2)
    assert (ck.directory, ck.save_every, ck.keep, ck.train_net) == (Path("ckpts"), 3, 2, None)
    ck = mindzero.ZeroCheckpoint(tmp_path, config=CheckpointConfig(save_checkpoint_steps=6, keep_checkpoint_max=3))
    assert (ck.directory, ck.save_every, ck.keep) == (tmp_path, 6, 3)
    step = prepare(zero_stage=1, gradient_accumulation_steps=2)
    ck = mindzero.ZeroCheckpoint(step, tmp_path, 4, 1)
    assert (ck.train_net, ck.directory, ck.save_every, ck.keep) == (step, tmp_path, 4, 1)
    assert mindzero.ZeroCheckpoint(tmp_path, train_net=step).train_net is step
    with pytest.raises(TypeError, match=r"^ZeroCheckpoint: the first argument must be the checkpoint directory .* "
                                        r"or the train step from mindzero.prepare_train_network, got int 5"):
        mindzero.ZeroCheckpoint(5, tmp_path)
    with pytest.raises(TypeError, match=r"got MixedNet"):  # the network before prepare_train_network
        mindzero.ZeroCheckpoint(build("mixed"), tmp_path)
    with pytest.raises(TypeError, match=r"directory is given twice, as an argument"):
        mindzero.ZeroCheckpoint(step, tmp_path, directory=tmp_path / "other")
    with pytest.raises(ValueError, match=r"save_checkpoint_seconds or keep_checkpoint_per_n_minutes"):
        mindzero.ZeroCheckpoint(tmp_path, config=CheckpointConfig(save_checkpoint_steps=None,
                                                                  save_checkpoint_seconds=60))
    with pytest.raises(ValueError, match=r"save_every=3 must be a multiple of gradient_accumulation_steps=2"):
        mindzero.ZeroCheckpoint(tmp_path, save_every=3).on_train_begin(RunContext(_Params(
            {"dataset_sink_mode": False, "train_network": step, "batch_num": 4, "cur_step_num": 0})))


def test_zero_checkpoint_refuses_sink_mode_and_another_network(tmp_path):
    step = prepare(zero_stage=0)
    ck = mindzero.ZeroCheckpoint(step, tmp_path)
    cb = {"dataset_sink_mode": True, "train_network": step, "batch_num": 4, "cur_step_num": 0}
    with pytest.raises(ValueError, match=r"needs Model.train\(..., dataset_sink_mode=False\)"):
        ck.on_train_begin(RunContext(_Params(cb)))
    with pytest.raises(ValueError, match=r"Model trains another network than the train_net"):
        ck.on_train_begin(RunContext(_Params({**cb, "dataset_sink_mode": False, "train_network": prepare()})))


class _Params(dict):
    __getattr__ = dict.__getitem__


def test_resume_refuses_other_data_and_foreign_checkpoints(tmp_path):
    """A checkpoint saved with 4 batches per epoch is not resumed with 5 (the position would mean other
    data); a checkpoint not written by ZeroCheckpoint is refused with the way to load it; the train step
    resumed from the right dataset continues at the saved step."""
    step = prepare(zero_stage=1)
    ck = mindzero.ZeroCheckpoint(step, tmp_path / "run", save_every=2)
    Model(step).train(1, dataset(8), callbacks=[ck], dataset_sink_mode=False)
    assert [p.name for p in mindzero.complete_checkpoints(tmp_path / "run")] == ["step_00000002",
                                                                                          "step_00000004"]
    with pytest.raises(CheckpointError, match=r"step_00000004: saved with a dataset of 4 batches per epoch, "
                                              "this dataset has 5"):
        mindzero.ZeroCheckpoint(prepare(zero_stage=1), tmp_path / "run").resume(dataset(10))
    again = mindzero.ZeroCheckpoint(prepare(zero_stage=1), tmp_path / "run")
    assert again.resume(dataset(8)) == 1 and [s for s, _ in again.history] == [1, 2, 3, 4]
    mindzero.save_checkpoint(step, tmp_path / "plain" / "step_00000009")
    with pytest.raises(CheckpointError, match=r"not written by ZeroCheckpoint .*load it with mindzero.load_checkpoint"):
        mindzero.ZeroCheckpoint(step, tmp_path / "plain").resume(dataset(8))
    with pytest.raises(CheckpointError, match=r"trainer_state must be a JSON-serialisable dict"):
        mindzero.save_checkpoint(step, tmp_path / "x", trainer_state={"a": object()})
    assert not (tmp_path / "x").exists()


def test_example_refuses_a_bad_config_before_starting(tmp_path):
    """examples/train_with_model.py reads its ZeRO settings with mindzero.load_config: a bad value stops it
    before any rank starts, naming the file, the key, the value and the rule."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    bad = tmp_path / "bad.yaml"
    bad.write_text((repo / "examples" / "configs" / "gpt_model.yaml").read_text().replace("zero_stage: 3",
                                                                                           "zero_stage: 5"))
    run = subprocess.run([sys.executable, str(repo / "examples" / "train_with_model.py"), "--config", str(bad),
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert f"ConfigError: {bad} [zero]: key 'zero_stage': value 5: zero_stage must be 0, 1, 2 or 3" in run.stderr
    assert not (tmp_path / "out").exists()


def test_async_checkpoints_equal_synchronous_ones(tmp_path):
    """ZeroCheckpoint(async_save=True) under Model.train: the same checkpoints as synchronous saves (the same
    kept steps, every tensor and the trainer state equal), complete when training returns, no leftovers."""
    from mindzero.checkpoint.offline import merge_checkpoint
    from mindzero.checkpoint.tensor_io import open_reader

    kept = {}
    for mode in (False, True):
        step = prepare(zero_stage=3)
        ck = mindzero.ZeroCheckpoint(step, tmp_path / f"async{mode}", save_every=2, keep=2, async_save=mode)
        Model(step).train(2, dataset(8), callbacks=[ck], dataset_sink_mode=False)
        kept[mode] = mindzero.complete_checkpoints(tmp_path / f"async{mode}")
        assert sorted(p.name for p in (tmp_path / f"async{mode}").iterdir()) == [p.name for p in kept[mode]]
        merge_checkpoint(kept[mode][-1], tmp_path / f"m{mode}.ckpt", with_optimizer=True, log=None)
    assert [p.name for p in kept[True]] == [p.name for p in kept[False]] == ["step_00000006", "step_00000008"]
    a, b = open_reader(tmp_path / "mFalse.ckpt"), open_reader(tmp_path / "mTrue.ckpt")
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        np.testing.assert_array_equal(b.read(name), a.read(name), err_msg=name)
    assert mindzero.read_trainer_state(kept[True][-1]) == mindzero.read_trainer_state(kept[False][-1])
