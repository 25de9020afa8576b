"""One msrun launch: training through ``mindspore.train.Model`` against the hand-written loop, and an
interrupted ``Model.train`` restarted through ``mindzero.ZeroCheckpoint``, at the stages given.

The data is a ``GeneratorDataset`` sharded per rank (``num_shards``/``shard_id``), shuffled, batched:
10 batches per rank per epoch, 3 epochs. Per stage, each rank writes ``<out>/rank_<r>/stage<s>.npz``:

* ``loop_losses`` / ``loop/<name>``: the hand-written loop over the same dataset (losses; final full
  parameters);
* ``model_losses`` / ``model/<name>``: ``Model(train_net).train(...)`` with ``LossMonitor`` (stage 0
  with ``dataset_sink_mode=True``, which MindSpore runs without sink on CPU; stage 3 with ``False``);
* ``resumed_losses`` / ``resumed/<name>``: ``Model.train`` with a ``ZeroCheckpoint`` saving every 4 steps,
  keeping 2 (made in each of the forms a user writes: ``FORMS``),
  killed by an exception at step 14, then, as a restarted job does, a new network, train step and
  dataset, ``ZeroCheckpoint.resume`` and ``Model.train(initial_epoch=...)`` to the end (the loss
  history: the checkpoint's and the new steps'); ``resumed_steps``: the step numbers the restarted
  ``Model`` reported;

and ``stage<s>.json``: the checkpoints left, the epoch ``resume`` returned, the steps the first run saw.
"""
import argparse
import json
import sys

import numpy as np
import mindspore as ms
import mindspore.dataset as ds
from mindspore.train import Callback, CheckpointConfig, LossMonitor, Model

import mindzero
from tests.support.models import TinyGPT, build, make_optimizer
from tests.support.worker import start

EPOCHS, SAMPLES, BATCH, CRASH_AT = 3, 40, 2, 14


class Source:
    """Random-access source of learnable token sequences (the same in every process)."""

    def __init__(self):
        self.tokens, self.targets = TinyGPT.batch(np.random.RandomState(11), SAMPLES)

    def __getitem__(self, i):
        return self.tokens[i], self.targets[i]

    def __len__(self):
        return SAMPLES


def dataset(world):
    ds.config.set_seed(7)  # the shuffle order: the same in every run of this process
    d = ds.GeneratorDataset(Source(), ["tokens", "targets"], shuffle=True, num_shards=world.world_size,
                            shard_id=world.world_rank)
    return d.batch(BATCH, drop_remainder=True)


def train_step(stage, config=None):
    net = build("gpt")
    opt = make_optimizer("adamw", net)
    if config is not None:
        return mindzero.prepare_train_network(net, opt, config=config)
    return mindzero.prepare_train_network(net, opt, zero_stage=stage, clip_grad=True,
                                          gradient_accumulation_steps=accumulation(stage))


def accumulation(stage):
    return 2 if stage == 3 else 1


class Record(Callback):
    def __init__(self, crash_at=None):
        super().__init__()
        self.losses, self.steps, self.crash_at = [], [], crash_at

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        self.losses.append(float(cb.net_outputs[0].asnumpy()))
        self.steps.append(int(cb.cur_step_num))
        if cb.cur_step_num == self.crash_at:
            raise KeyboardInterrupt(f"simulated crash at step {self.crash_at}")


# how each run makes its ZeroCheckpoint (first run, restarted run), per stage: every form a user writes
FORMS = {0: ("directory", "checkpoint_config"), 3: ("settings_file", "network_first")}


def callback(form, train, ckpt_dir, cfg):
    """``ZeroCheckpoint`` written as ``form``: every 4 steps, the newest 2 kept."""
    if form == "directory":  # as MindSpore's ModelCheckpoint: no network, found in Model's run context
        return mindzero.ZeroCheckpoint(ckpt_dir, save_every=4, keep=2)
    if form == "checkpoint_config":  # MindSpore's CheckpointConfig for how often and how many
        return mindzero.ZeroCheckpoint(ckpt_dir, config=CheckpointConfig(save_checkpoint_steps=4, keep_checkpoint_max=2))
    if form == "settings_file":  # the checkpoint section of the settings file the train step was made from
        return mindzero.ZeroCheckpoint(train, config=cfg)
    return mindzero.ZeroCheckpoint(train, ckpt_dir, save_every=4, keep=2)  # the network first


def full(train, prefix):
    return {f"{prefix}/{k}": v for k, v in mindzero.gather_full_state_dict(train).items()}


def run_stage(stage, world, out_dir):
    res, meta = {}, {}
    # the hand-written loop
    train, data = train_step(stage), dataset(world)
    losses = []
    it = data.create_tuple_iterator(num_epochs=EPOCHS)
    for _ in range(EPOCHS):
        for tokens, targets in it:
            losses.append(float(train(tokens, targets)[0].asnumpy()))
    res["loop_losses"] = np.array(losses)
    res.update(full(train, "loop"))
    # Model.train
    train, data, rec = train_step(stage), dataset(world), Record()
    print(f"stage {stage}: Model.train", flush=True)
    Model(train).train(EPOCHS, data, callbacks=[rec, LossMonitor(5)], dataset_sink_mode=stage == 0)
    res["model_losses"] = np.array(rec.losses)
    res.update(full(train, "model"))
    # interrupted, then restarted from its newest complete checkpoint (settings from a config file)
    ckpt_dir = out_dir.parent / f"ckpt_stage{stage}"  # shared by the ranks
    cfg = out_dir / f"zero_stage{stage}.yaml"
    cfg.write_text(f"zero_stage: {stage}\nclip_grad: true\ngradient_accumulation_steps: {accumulation(stage)}\n"
                   f"checkpoint: {{dir: {ckpt_dir}, save_every: 4, keep: 2}}\n")
    train, data, rec = train_step(stage, config=cfg), dataset(world), Record(crash_at=CRASH_AT)
    ckpt = callback(FORMS[stage][0], train, ckpt_dir, cfg)
    assert ckpt.resume(data) == 0
    try:
        Model(train).train(EPOCHS, data, callbacks=[ckpt, rec], dataset_sink_mode=False)
        raise AssertionError("the simulated crash did not happen")
    except KeyboardInterrupt:
        pass
    meta["first_run_steps"] = rec.steps
    meta["after_crash"] = sorted(p.name for p in ckpt_dir.iterdir())
    train, data, rec = train_step(stage, config=cfg), dataset(world), Record()
    ckpt = callback(FORMS[stage][1], train, ckpt_dir, cfg)
    meta["initial_epoch"] = initial_epoch = ckpt.resume(data)  # without the network: loaded when Model begins
    meta["loaded_at_resume"] = ckpt.train_net is not None
    Model(train).train(EPOCHS, data, callbacks=[ckpt, rec, LossMonitor(5)], dataset_sink_mode=False,
                       initial_epoch=initial_epoch)
    res["resumed_losses"] = np.array([loss for _, loss in ckpt.history])
    res["resumed_history_steps"] = np.array([s for s, _ in ckpt.history])
    res["resumed_steps"] = np.array(rec.steps)
    res.update(full(train, "resumed"))
    meta["at_end"] = sorted(p.name for p in ckpt_dir.iterdir())
    meta["final_state"] = {k: v for k, v in mindzero.read_trainer_state(ckpt_dir / meta["at_end"][-1]).items()
                           if k != "history"}
    np.savez(out_dir / f"stage{stage}.npz", **res)
    (out_dir / f"stage{stage}.json").write_text(json.dumps(meta, indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default="0,3")
    worker = start(ap)
    ms.set_seed(0)
    for stage in (int(s) for s in worker.args.stages.split(",")):
        run_stage(stage, worker.world, worker.rank_dir)
    worker.finish()


if __name__ == "__main__":
    sys.exit(main())
