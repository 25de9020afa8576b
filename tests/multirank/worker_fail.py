"""A worker that fails on purpose on rank ``--victim`` (default: the last) after one collective:
``--mode raise`` raises, ``--mode kill`` SIGKILLs itself, ``--mode hang`` sleeps; the other ranks
meanwhile wait in a second collective, as a training step would."""
import argparse
import os
import signal
import time
from pathlib import Path

import numpy as np
from mindspore import Tensor, ops
from mindspore.communication import get_group_size, get_rank

import mindzero

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--mode", choices=("raise", "kill", "hang"), required=True)
ap.add_argument("--victim", type=int, default=-1)
args = ap.parse_args()
mindzero.start_data_parallel()
allreduce = ops.AllReduce()
x = Tensor(np.ones(4, np.float32))
allreduce(x).asnumpy()
if get_rank() == args.victim % get_group_size():
    if args.mode == "raise":
        raise RuntimeError(f"deliberate failure on rank {get_rank()}")
    if args.mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)
allreduce(x).asnumpy()  # the survivors wait here for the victim
(Path(args.out) / f"rank_{get_rank()}.done").write_text("ok")
