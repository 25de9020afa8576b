"""Checkpoint faults across processes (2 ranks, stage 3, the awkward-shapes net).

``--phase kill``: train 2 steps, saving ``step_1`` and ``step_2``, train step 3 (its loss recorded), then save ``step_3``
during which rank 1 SIGKILLs itself right after writing its shard file: the launch fails.

``--phase resume`` (fresh processes): each damaged checkpoint the test prepared is offered to
``load_checkpoint`` (the refusals are recorded), then the newest complete checkpoint is found and
loaded and step 3 is trained again; a full disk (a file-size limit on rank 1) during a synchronous and
an asynchronous save; finally an asynchronous save overlapped with the next training step.
Each rank writes ``<out>/rank_<r>/<phase>.npz`` and ``<phase>.json``.
"""
import argparse
import json
import os
import resource
import signal
import sys
from pathlib import Path

import numpy as np

import mindzero
import mindzero.checkpoint.save as zc
from mindzero.comm.cells import Barrier
from tests.support.data import batch
from tests.support.models import build, make_optimizer
from tests.support.worker import start


def make():
    net = build("awkward")
    return net, mindzero.prepare_train_network(net, make_optimizer("adam", net), zero_stage=3)


def step(train, cls, s, world):
    return float(train(*batch(cls, s, world.world_rank))[0].asnumpy())


def kill_after_first_file():
    """Rank 1 dies (SIGKILL) as soon as its first checkpoint file is complete on disk."""
    real = zc.open_writer

    def open_writer(path, fmt, layout):
        writer = real(path, fmt, layout)
        commit = writer.commit

        def commit_and_die():
            commit()
            print(f"wrote {Path(path).name}; SIGKILL now", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        writer.commit = commit_and_die
        return writer

    zc.open_writer = open_writer


class FileSizeLimit:
    """A full disk, as the process sees it: writes beyond ``limit`` bytes into a file fail with EFBIG."""

    def __init__(self, limit, active):
        self.limit, self.active = limit, active

    def __enter__(self):
        if self.active:
            self.old = resource.getrlimit(resource.RLIMIT_FSIZE)
            self.handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an OSError instead of death
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.old[1]))

    def __exit__(self, *exc):
        if self.active:
            resource.setrlimit(resource.RLIMIT_FSIZE, self.old)
            signal.signal(signal.SIGXFSZ, self.handler)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="the checkpoint root")
    ap.add_argument("--phase", choices=("kill", "resume"), required=True)
    ap.add_argument("--damaged", default="[]", help="JSON list of checkpoint directories load must refuse")
    worker = start(ap)
    args, world, out_dir = worker.args, worker.world, worker.rank_dir
    root = Path(args.root)
    net, train = make()
    cls = type(net)
    arrays, report = {}, {}
    if args.phase == "kill":
        step(train, cls, 0, world)
        mindzero.save_checkpoint(train, root / "step_1")
        step(train, cls, 1, world)
        mindzero.save_checkpoint(train, root / "step_2")
        arrays.update({"saved/" + k: v for k, v in mindzero.gather_full_state_dict(train).items()})
        arrays["loss3"] = np.array([step(train, cls, 2, world)])
        np.savez(out_dir / "kill.npz", **arrays)
        if world.world_rank == 1:
            kill_after_first_file()
        mindzero.save_checkpoint(train, root / "step_3")  # rank 1 dies inside; rank 0 waits for it
        print("not reached: the save completed", flush=True)
        return 1
    for damaged in json.loads(args.damaged):  # refused before anything changes
        try:
            mindzero.load_checkpoint(train, damaged)
            report[damaged] = "LOADED"
        except mindzero.CheckpointError as err:
            report[damaged] = str(err)
    latest = mindzero.latest_checkpoint(root)
    report["latest"] = str(latest)
    mindzero.load_checkpoint(train, latest)
    arrays.update({"loaded/" + k: v for k, v in mindzero.gather_full_state_dict(train).items()})
    arrays["loss3"] = np.array([step(train, cls, 2, world)])
    for mode in ("sync", "async"):  # a full disk on rank 1: every rank raises, nothing complete is left
        path = root / f"full_disk_{mode}"
        try:
            with FileSizeLimit(8192, world.world_rank == 1):
                if mode == "sync":
                    mindzero.save_checkpoint(train, path)
                else:
                    mindzero.save_checkpoint(train, path, async_save=True).wait()
            report[f"full_disk_{mode}"] = "SAVED"
        except mindzero.CheckpointError as err:
            report[f"full_disk_{mode}"] = str(err)
        Barrier(train.zero_info.world)()  # rank 0 has cleaned up on every path
        report[f"full_disk_{mode}_left"] = sorted(p.name for p in root.iterdir() if p.name.startswith(path.name))
    # an asynchronous save overlapped with the next step: it holds the state at the save
    arrays.update({"async_saved/" + k: v for k, v in mindzero.gather_full_state_dict(train).items()})
    handle = mindzero.save_checkpoint(train, root / "step_async", async_save=True)
    report["async_host_bytes"] = handle.host_bytes
    arrays["loss4"] = np.array([step(train, cls, 3, world)])
    report["async_path"] = str(handle.wait())
    np.savez(out_dir / "resume.npz", **arrays)
    (out_dir / "resume.json").write_text(json.dumps(report, indent=1))
    worker.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
