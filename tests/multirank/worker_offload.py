"""Disk offload across processes (2 ranks): memory, checkpoints through the state file, a rank killed mid-update.

``--phase kill``: first the memory with the states on disk (below), then the mixed net at stage 3 with its states
on disk trains 2 steps and saves ``<root>/step_2``; in the third step's update rank 1 dies (``os._exit``) halfway
through the pieces.

Memory, the first thing each launch does (so each process's heap is its configuration's alone): a 16.8M-parameter
chain of Dense layers (built under ``lazy_init``) at stage 3, states on disk (``kill``, ``memory.json``) or in
memory (``main``, ``main.json``), prepared and trained 3 steps: peak RSS growth over prepare + steps, and the
state bytes.

``--phase main``: writes ``<out>/rank_<r>/main.npz`` and ``main.json``:

* after the kill: ``<root>/step_2`` loaded into a run with its states on disk, one more step, against an in-memory
  run trained 3 steps straight (the same data); the offload directory's files while that run is alive (the killed
  rank's left-over is removed by the first run on this machine);
* checkpoints: the mixed net at stage 2, states on disk and in memory, each saving after 2 steps; each resumes from
  the other's checkpoint and trains 2 more; the in-memory run trains straight through 4 steps.
"""
import argparse
import gc
import json
import os

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

import mindzero
from mindzero.core.host import reset_peak, status_kib
from tests.support.data import batch
from tests.support.models import build, make_optimizer
from tests.support.worker import start


class Chain(nn.Cell):
    """16 Dense(1024, 1024) without bias: 16.8M parameters, 2 MiB shards of 4 MiB each at 2 ranks."""

    def __init__(self):
        super().__init__()
        self.layers = nn.SequentialCell([nn.Dense(1024, 1024, has_bias=False) for _ in range(16)])
        self.loss = nn.MSELoss()

    def construct(self, x, y):
        return self.loss(self.layers(x), y)


def memory_run(disk_dir, world):
    gc.collect()
    ms.set_seed(3)
    with mindzero.lazy_init():
        net = Chain()
        opt = nn.AdamWeightDecay(net.trainable_params(), 1e-3)
    reset_peak()
    before = status_kib("VmRSS")
    options = dict(optimizer_offload="disk", offload_dir=str(disk_dir)) if disk_dir else {}
    train = mindzero.prepare_train_network(net, opt, zero_stage=3, **options)
    rng = np.random.RandomState(world.world_rank)
    for _ in range(3):
        train(Tensor(rng.randn(4, 1024).astype(np.float32)), Tensor(rng.randn(4, 1024).astype(np.float32)))
    grown = (status_kib("VmHWM") - before) * 1024
    report = mindzero.memory_report(train)
    states = report.get("optimizer_disk") or report["optimizer_moments"]
    if train.zero_info.offload is not None:
        train.states.close()
    del train, net, opt
    gc.collect()
    return dict(peak_growth=grown, state_bytes=states)


def mixed_run(world, stage, disk_dir=None, load=None, save=None, steps=range(4), kill_in_update=None):
    net = build("mixed")
    opt = make_optimizer("adamw_groups", net)
    options = dict(optimizer_offload="disk", offload_dir=str(disk_dir), offload_chunk_mb=0.001) if disk_dir else {}
    train = mindzero.prepare_train_network(net, opt, zero_stage=stage, **options)
    if load:
        mindzero.load_checkpoint(train, load)
    cls, losses = type(net), []
    for s in steps:
        if kill_in_update is not None and s == kill_in_update:
            views = train.states.stream.view_of

            def die(*args, _k=len(views) // 2):
                if world.world_rank == 1:
                    print(f"rank 1: exiting in the update of step {s} at piece {_k} of {len(views)}", flush=True)
                    os._exit(17)
                return views_k(*args)

            views_k = views[len(views) // 2]
            views[len(views) // 2] = die
        losses.append(float(train(*batch(cls, s, world.world_rank))[0].asnumpy()))
        if save is not None and s == 1:
            mindzero.save_checkpoint(train, save)
    params = mindzero.gather_full_state_dict(train)
    return losses, params, train


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("kill", "main"), required=True)
    ap.add_argument("--root", required=True, help="checkpoints and offload directories (shared by the ranks)")
    worker = start(ap)
    args, world, out_dir = worker.args, worker.world, worker.rank_dir
    root = os.path.abspath(args.root)
    disk = os.path.join(root, "offload")
    os.makedirs(disk, exist_ok=True)
    if args.phase == "kill":
        # first in this process (its heap its own): the memory with the states on disk
        (out_dir / "memory.json").write_text(json.dumps(memory_run(disk, world)))
        mixed_run(world, 3, disk, save=os.path.join(root, "step_2"), steps=range(3), kill_in_update=2)
        print("not reached: the update ran through", flush=True)
        return
    result = {"left_by_the_kill": sorted(os.listdir(os.path.join(disk, f"rank_{world.world_rank}")))
              if os.path.isdir(os.path.join(disk, f"rank_{world.world_rank}")) else []}
    result["memory-in-memory"] = memory_run(None, world)  # first in this process, as the disk run in the kill launch
    arrays = {}
    # after the kill: step_2 into a disk run, one more step, against three straight in memory
    straight3 = mixed_run(world, 3, steps=range(3))
    resumed = mixed_run(world, 3, disk, load=os.path.join(root, "step_2"), steps=range(2, 3))
    result["files_while_alive"] = sorted(os.listdir(os.path.join(disk, f"rank_{world.world_rank}")))
    arrays["kill/straight_loss"], arrays["kill/resumed_loss"] = np.array(straight3[0][2:]), np.array(resumed[0])
    arrays.update({f"kill/straight/{k}": v for k, v in straight3[1].items()})
    arrays.update({f"kill/resumed/{k}": v for k, v in resumed[1].items()})
    # checkpoints both ways at stage 2
    ck_disk, ck_mem = os.path.join(root, "ck_disk"), os.path.join(root, "ck_mem")
    straight = mixed_run(world, 2, save=ck_mem)
    on_disk = mixed_run(world, 2, disk, save=ck_disk)
    mem_from_disk = mixed_run(world, 2, load=ck_disk, steps=range(2, 4))
    disk_from_mem = mixed_run(world, 2, disk, load=ck_mem, steps=range(2, 4))
    for name, run in (("straight", straight), ("on_disk", on_disk), ("mem_from_disk", mem_from_disk),
                      ("disk_from_mem", disk_from_mem)):
        arrays[f"ck/{name}/losses"] = np.array(run[0])
        arrays.update({f"ck/{name}/{k}": v for k, v in run[1].items()})
    np.savez(out_dir / "main.npz", **arrays)
    (out_dir / "main.json").write_text(json.dumps(result))
    worker.finish()


if __name__ == "__main__":
    main()
