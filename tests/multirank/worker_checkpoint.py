"""Checkpoint scenarios on several ranks: train 3 steps, save, train 3 more (``--phase train``; with
``async`` the save is asynchronous and the 3 steps overlap its writing); or, in fresh processes, load a
checkpoint (resharded offline, or directly from another world size, stage or precision) and train the same last 3 steps (``--phase resume``).

Data: :func:`tests.support.data.unit_batch` (the same global batch on 2 and 4 ranks).
Each rank writes ``<out>/rank_<r>/<scenario>.npz``: per-step losses, full parameters at the save
(``saved/``) and at the end (``param/``).
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import mindspore as ms

import mindzero
from tests.support.data import unit_batch
from tests.support.models import build, make_optimizer
from tests.support.scenarios import NO_PERSISTENCE_CAP, CheckpointCase
from tests.support.worker import settle, start


def make(case: CheckpointCase):
    net = build(case.model)
    opt = make_optimizer(case.optimizer, net)
    wrapped = ms.amp.auto_mixed_precision(net, "O2") if case.param_dtype else net
    keep = {} if case.persist is None else {"stage3_param_persistence_threshold": case.persist,
                                            "stage3_model_persistence_threshold": NO_PERSISTENCE_CAP}
    return net, mindzero.prepare_train_network(wrapped, opt, zero_stage=case.stage, param_dtype=case.param_dtype,
                                               **keep)


def train_steps(train, cls, steps, world):
    return [float(train(*unit_batch(cls, s, world.world_rank, world.world_size))[0].asnumpy()) for s in steps]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("train", "resume"), required=True)
    ap.add_argument("--cases", required=True, help="JSON list of tests.support.scenarios.CheckpointCase fields")
    worker = start(ap)
    world, out_dir = worker.world, worker.rank_dir
    for case in (CheckpointCase(**c) for c in json.loads(worker.args.cases)):
        settle()
        net, train = make(case)
        mp = bool(case.param_dtype)
        cls, result = type(net), {}
        pending = None
        if worker.args.phase == "train":
            first = train_steps(train, cls, range(3), world)
            pending = mindzero.save_checkpoint(train, case.ckpt, format=case.format, async_save=case.async_save)
            result.update({"saved/" + k: v for k, v in mindzero.gather_full_state_dict(train).items()})
            if mp:
                result.update({"savedmaster/" + k: v
                               for k, v in mindzero.gather_full_state_dict(train, masters=True).items()})
            if case.full_path:
                mindzero.save_full_checkpoint(train, case.full_path)
        else:
            mindzero.load_checkpoint(train, case.ckpt)
            result.update({"loaded/" + k: v for k, v in mindzero.gather_full_state_dict(train).items()})
            if mp:
                result.update({"loadedmaster/" + k: v
                               for k, v in mindzero.gather_full_state_dict(train, masters=True).items()})
            first = []
        last = train_steps(train, cls, range(3, 6), world)  # an asynchronous save is written meanwhile
        if worker.args.phase == "train" and case.async_save:
            assert pending.wait() == Path(case.ckpt)
        result.update({"param/" + k: v for k, v in mindzero.gather_full_state_dict(train).items()})
        np.savez(out_dir / f"{case.name}.npz", first=np.array(first), last=np.array(last),
                 parallel_mode=np.array(ms.get_auto_parallel_context("parallel_mode")), **result)
        print(f"case {case.name} done", flush=True)
    worker.finish()


if __name__ == "__main__":
    sys.exit(main())
