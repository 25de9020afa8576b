"""One rank of ``first_step.py``'s collective launch: per kind of collective, a graph holding that one collective
(1 MiB of fp32) compiled, executed once, executed again; seconds to ``<out>/rank_<r>.json``."""
import argparse
import json
import time
from pathlib import Path

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from mindspore import Tensor, nn, ops

    import mindzero
    from mindzero.launch.worker import finish_rank

    world = mindzero.start_data_parallel()

    class One(nn.Cell):
        """A graph of one collective (``Broadcast`` takes and returns a tuple)."""

        def __init__(self, op, packed: bool):
            super().__init__()
            self.op, self.packed = op, packed

        def construct(self, x):
            if self.packed:
                return self.op((x,))[0]
            return self.op(x)

    x = Tensor(np.ones(2 ** 18, np.float32))
    kinds = []
    for kind, op, packed in (("all_reduce", ops.AllReduce(), False), ("all_gather", ops.AllGather(), False),
                             ("broadcast", ops.Broadcast(0), True)):
        cell = One(op, packed)
        t = time.perf_counter()
        cell.compile(x)
        compile_s = time.perf_counter() - t
        times = []
        for _ in range(2):
            t = time.perf_counter()
            cell(x).asnumpy()
            times.append(time.perf_counter() - t)
        kinds.append(dict(kind=kind, compile_s=compile_s, first_s=times[0], second_s=times[1]))
    out = Path(a.out)
    (out / f"rank_{world.world_rank}.json").write_text(json.dumps(dict(kinds=kinds), indent=1))
    finish_rank(out, world.world_rank)


if __name__ == "__main__":
    main()
