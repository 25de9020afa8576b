"""Worker of ``regather_bench.py``: stage 3 on an MLP of equal square layers, with or without re-gather."""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--no-regather", action="store_true")
    a = ap.parse_args()

    import mindspore as ms
    from mindspore import Tensor, nn, ops

    import mindzero
    from mindzero.launch.worker import finish_rank

    world = mindzero.start_data_parallel()
    dim, layers = a.dim, a.layers

    class MLP(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList([nn.Dense(dim, dim, has_bias=False) for _ in range(layers)])

        def construct(self, x, y):
            for layer in self.layers:
                x = ops.tanh(layer(x))
            return ((x - y) ** 2).mean()

    ms.set_seed(0)
    net = MLP()
    train = mindzero.prepare_train_network(net, nn.SGD(net.trainable_params(), 0.01), zero_stage=a.stage,
                                           stage3_regather=not a.no_regather)
    rng = np.random.RandomState(world.world_rank)
    x = Tensor(rng.randn(a.batch, dim).astype(np.float32))
    y = Tensor(np.zeros((a.batch, dim), np.float32))
    times, losses = [], []
    for _ in range(a.steps):
        t = time.perf_counter()
        losses.append(float(train(x, y)[0].asnumpy()))
        times.append(time.perf_counter() - t)
    Path(a.out, f"rank_{world.world_rank}.json").write_text(json.dumps(dict(times=times, losses=losses)))
    finish_rank(a.out, world.world_rank)  # the launcher waits for it


if __name__ == "__main__":
    main()
