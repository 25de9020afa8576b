"""All-reduce ``--mib`` MiB ``--reps`` times after one warm-up and record the time it took (for the shaped-link
test, test_launch.py): ``rank_<r>/link.json`` with the seconds, the bytes and the world size."""
import argparse
import json
import time

import numpy as np
from mindspore import Tensor, ops

from tests.support.worker import start

ap = argparse.ArgumentParser()
ap.add_argument("--mib", type=float, default=4.0)
ap.add_argument("--reps", type=int, default=3)
worker = start(ap)
args = worker.args
allreduce = ops.AllReduce()
x = Tensor(np.ones(int(args.mib * 2 ** 20) // 4, np.float32))
allreduce(x).asnumpy()  # warm-up: the connections are made
begin = time.time()
for _ in range(args.reps):
    y = allreduce(x).asnumpy()
seconds = time.time() - begin
assert float(y[0]) == worker.world.world_size, y[0]
(worker.rank_dir / "link.json").write_text(json.dumps({"seconds": seconds, "bytes": x.nbytes, "reps": args.reps,
                                                       "world_size": worker.world.world_size}))
worker.finish()
