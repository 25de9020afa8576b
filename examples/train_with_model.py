"""Train the small GPT through ``mindspore.train.Model``: a ``GeneratorDataset`` sharded per rank,
``LossMonitor`` and ``TimeMonitor``, ``mindzero.ZeroCheckpoint`` (a restarted run resumes), and the
ZeRO settings read from the config file by ``mindzero.load_config``.

    python -m mindzero.launch.local -n 2 --out runs/gpt_model examples/train_with_model.py \\
        --config examples/configs/gpt_model.yaml
or with msrun directly (docs/launch.md). Run it again with the same ``--out`` and it continues from the
newest complete checkpoint in ``OUT/checkpoints``; at the end rank 0 merges the newest checkpoint into
``OUT/final_model.ckpt`` (loads into the plain network) and prints a summary line.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np
import yaml
import mindspore.dataset as ds
from mindspore import nn
from mindspore.train import Callback, LossMonitor, Model, TimeMonitor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mindzero  # noqa: E402
from gpt import GPT, CharTokenizer, LMLoss, init_params, make_corpus  # noqa: E402


class Windows:
    """``windows`` fixed (tokens, targets) windows of the corpus, random access (shuffled and sharded
    per rank by the dataset)."""

    def __init__(self, ids, seq, windows, seed):
        self.ids, self.seq = ids, seq
        self.starts = np.random.RandomState(seed).randint(0, len(ids) - seq - 1, size=windows)

    def __getitem__(self, i):
        w = self.ids[self.starts[i]:self.starts[i] + self.seq + 1]
        return w[:-1], w[1:]

    def __len__(self):
        return len(self.starts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).parent / "configs" / "gpt_model.yaml"))
    ap.add_argument("--out", default="runs/gpt_model")
    ap.add_argument("--epochs", type=int, help="override train.epochs")
    ap.add_argument("--device", help="CPU, GPU or Ascend (default: MINDZERO_DEVICE if set, else MindSpore's own)")
    ap.add_argument("--stop-after", type=int, default=0,
                    help="stop after this step (ZeroCheckpoint saves there); run again to continue")
    args = ap.parse_args()
    cfg = yaml.safe_load(Path(args.config).read_text())
    zero = mindzero.load_config(args.config, section="zero")  # validated: errors name file, key, value, rule
    out = Path(args.out).resolve()
    zero["checkpoint"]["dir"] = str(out / (zero["checkpoint"]["dir"] or "checkpoints"))
    m, d, t = cfg["model"], cfg["data"], cfg["train"]
    epochs = args.epochs or t["epochs"]

    world = mindzero.start_data_parallel(device=args.device)
    text = make_corpus(d["sentences"], d["seed"])
    tok = CharTokenizer(text)
    ds.config.set_seed(d["seed"])  # the shuffle order: the same in a restarted run
    data = ds.GeneratorDataset(Windows(tok.encode(text), m["seq"], d["windows"], d["seed"]), ["tokens", "targets"],
                               shuffle=True, num_shards=world.world_size, shard_id=world.world_rank)
    data = data.batch(d["batch"], drop_remainder=True)

    gpt = GPT(tok.vocab_size, m["dim"], m["layers"], m["heads"], m["seq"], m["tied"])
    init_params(gpt)
    net = LMLoss(gpt)
    decay = [p for p in net.trainable_params() if len(p.shape) >= 2]
    rest = [p for p in net.trainable_params() if len(p.shape) < 2]
    opt = nn.AdamWeightDecay([{"params": decay, "weight_decay": t["weight_decay"]}, {"params": rest}],
                             learning_rate=t["lr"])
    train_net = mindzero.prepare_train_network(net, opt, config=zero)
    ckpt = mindzero.ZeroCheckpoint(train_net, config=zero)
    initial_epoch = ckpt.resume(data)
    log = print if world.world_rank == 0 else (lambda *a, **k: None)
    steps = epochs * data.get_dataset_size()
    log(f"{args.config}: ZeRO stage {train_net.zero_info.config.zero_stage} on {world.world_size} ranks, "
        f"{epochs} epochs x {data.get_dataset_size()} steps of {d['batch']} x {m['seq']} tokens per rank; "
        + (f"resumed at step {ckpt.history[-1][0]} (epoch {initial_epoch + 1})" if ckpt.history else "from scratch"),
        flush=True)
    if initial_epoch >= epochs:
        log(f"already trained {steps} steps ({ckpt.directory}); nothing to do", flush=True)
    else:
        run = dict(epochs=epochs, initial_epoch=initial_epoch, log_every=t["log_every"], stop_after=args.stop_after,
                   out=out, uniform=np.log(tok.vocab_size))
        train(train_net, ckpt, data, run, log)
    mindzero.finish_rank(out, world.world_rank)  # what mindzero.launch.local waits for


def train(train_net, ckpt, data, run, log):
    """``Model.train`` to the end (or ``--stop-after``); rank 0 merges the final checkpoint; a summary line."""
    steps, log_every = run["epochs"] * data.get_dataset_size(), run["log_every"]
    callbacks = [ckpt, LossMonitor(log_every), TimeMonitor()]
    if run["stop_after"]:
        callbacks.append(StopAfter(run["stop_after"]))
    start = time.time()
    Model(train_net).train(run["epochs"], data, callbacks=callbacks, dataset_sink_mode=False,
                           initial_epoch=run["initial_epoch"])
    secs = time.time() - start
    last = mindzero.latest_checkpoint(ckpt.directory)
    if train_net.zero_info.world.world_rank == 0 and ckpt.history[-1][0] == steps:
        mindzero.merge_checkpoint(last, run["out"] / "final_model.ckpt", force=True)
    first, final = ckpt.history[0][1], np.mean([loss for _, loss in ckpt.history[-log_every:]])
    log(f"done: step {ckpt.history[-1][0]}/{steps} in {secs:.0f}s; loss {first:.3f} -> {final:.3f} (rank 0, mean "
        f"of the last {log_every} steps; uniform {run['uniform']:.3f}); newest checkpoint {last}", flush=True)


class StopAfter(Callback):
    """Stop ``Model.train`` after step ``n`` (a time-boxed job); ZeroCheckpoint saves at the end of training."""

    def __init__(self, n):
        super().__init__()
        self.n = n

    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num == self.n:
            print(f"stopping after step {self.n} (--stop-after)", flush=True)
            run_context.request_stop()


if __name__ == "__main__":
    main()
