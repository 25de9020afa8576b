"""Checkpoint scenarios on several ranks: train 3 steps, save, train 3 more (``--phase train``; with
``async`` the save is asynchronous and the 3 steps overlap its writing); or, in fresh processes, load a
checkpoint (resharded offline, or directly from another world size, stage or precision) and train the same last 3 steps (``--phase resume``).

Data: each step's global batch is 4 units of 2 samples; with W ranks, rank r takes units
[r*4/W, (r+1)*4/W). Mean losses over equal-size units make runs on 2 and 4 ranks the same computation.
Each rank writes ``<out>/rank_<r>/<scenario>.npz``: per-step losses, full parameters at the save
(``saved/``) and at the end (``param/``).
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

import mindzero
from models import build

UNITS = 4


def batch(cls, step, rank, world_size):
    per = UNITS // world_size
    parts = [cls.batch(np.random.RandomState(1000 * step + u + 1), 2) for u in range(rank * per, (rank + 1) * per)]
    return [Tensor(np.concatenate([p[i] for p in parts])) for i in range(len(parts[0]))]


def make(model, stage, param_dtype=None):
    net = build(model)
    opt = nn.AdamWeightDecay(net.trainable_params(), 1e-2, weight_decay=0.05) if model != "resnet" \
        else nn.Momentum(net.trainable_params(), 0.05, 0.9)
    wrapped = ms.amp.auto_mixed_precision(net, "O2") if param_dtype else net
    return net, mindzero.prepare_train_network(wrapped, opt, zero_stage=stage, param_dtype=param_dtype)


def train_steps(train, cls, steps, world):
    return [float(train(*batch(cls, s, world.world_rank, world.world_size))[0].asnumpy()) for s in steps]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", choices=("train", "resume"), required=True)
    ap.add_argument("--scenarios", required=True, help="JSON list of {name, model, stage, ckpt[, format]}")
    args = ap.parse_args()
    world = mindzero.start_data_parallel()
    out_dir = Path(args.out) / f"rank_{world.world_rank}"
    out_dir.mkdir(parents=True, exist_ok=True)
    for scn in json.loads(args.scenarios):
        net, train = make(scn["model"], scn["stage"], scn.get("param_dtype"))
        mp = bool(scn.get("param_dtype"))
        cls, result = type(net), {}
        pending = None
        if args.phase == "train":
            first = train_steps(train, cls, range(3), world)
            pending = mindzero.save_checkpoint(train, scn["ckpt"], format=scn.get("format", "ckpt"),
                                               async_save=bool(scn.get("async")))
            result.update({"saved/" + k: v for k, v in mindzero.gather_full_state_dict(train).items()})
            if mp:
                result.update({"savedmaster/" + k: v
                               for k, v in mindzero.gather_full_state_dict(train, masters=True).items()})
            if scn.get("full_path"):
                mindzero.save_full_checkpoint(train, scn["full_path"])
        else:
            mindzero.load_checkpoint(train, scn["ckpt"])
            result.update({"loaded/" + k: v for k, v in mindzero.gather_full_state_dict(train).items()})
            if mp:
                result.update({"loadedmaster/" + k: v
                               for k, v in mindzero.gather_full_state_dict(train, masters=True).items()})
            first = []
        last = train_steps(train, cls, range(3, 6), world)  # an asynchronous save is written meanwhile
        if args.phase == "train" and scn.get("async"):
            assert pending.wait() == Path(scn["ckpt"])
        result.update({"param/" + k: v for k, v in mindzero.gather_full_state_dict(train).items()})
        np.savez(out_dir / f"{scn['name']}.npz", first=np.array(first), last=np.array(last), **result)
        print(f"scenario {scn['name']} done", flush=True)
    (Path(args.out) / f"rank_{world.world_rank}.done").write_text("ok")


if __name__ == "__main__":
    sys.exit(main())
