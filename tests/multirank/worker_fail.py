"""A worker that fails on purpose: ``--mode raise`` raises on the last rank; ``--mode hang`` sleeps there."""
import argparse
import time
from pathlib import Path

import mindspore as ms
from mindspore.communication import get_group_size, get_rank, init

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--mode", choices=("raise", "hang"), required=True)
args = ap.parse_args()
ms.set_device("CPU")
init()
if get_rank() == get_group_size() - 1:
    if args.mode == "raise":
        raise RuntimeError("deliberate failure on the last rank")
    time.sleep(3600)
(Path(args.out) / f"rank_{get_rank()}.done").write_text("ok")
