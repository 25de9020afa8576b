"""A worker that fails on purpose on rank ``--victim`` (default: the last) after one collective:
``--mode raise`` raises, ``--mode kill`` SIGKILLs itself (as the kernel's out-of-memory killer would),
``--mode segv`` crashes in native code (a read of address 0) inside ``first_step``, ``--mode hang`` sleeps; the
other ranks meanwhile wait in a second collective, as a training step would."""
import argparse
import ctypes
import os
import signal
import time

import numpy as np
from mindspore import Tensor, ops
from mindspore.communication import get_group_size, get_rank

from tests.support.worker import start

ap = argparse.ArgumentParser()
ap.add_argument("--mode", choices=("raise", "kill", "segv", "hang"), required=True)
ap.add_argument("--victim", type=int, default=-1)


def first_step():
    """Where the crash happens (the failure report names this frame)."""
    ctypes.string_at(0)


worker = start(ap)
args = worker.args
allreduce = ops.AllReduce()
x = Tensor(np.ones(4, np.float32))
allreduce(x).asnumpy()
if get_rank() == args.victim % get_group_size():
    (worker.rank_dir / "death").write_text(repr(time.time()))  # when the job starts to end (test_launch.py)
    if args.mode == "raise":
        raise RuntimeError(f"deliberate failure on rank {get_rank()}")
    if args.mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.mode == "segv":
        first_step()
    time.sleep(3600)
allreduce(x).asnumpy()  # the survivors wait here for the victim
worker.finish()
