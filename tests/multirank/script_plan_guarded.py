"""A training script with its work under the guard, asking ``predict_peak`` about its own factory from inside
its launch (after ``init()``): rank 0 gets a prediction, rehearsed in processes that must not join the running
job. Writes ``OUT/rank_<r>.json``."""
import argparse
import json
from pathlib import Path

import mindspore as ms
from mindspore import nn
from mindspore.communication import get_rank, init

import mindzero
from mindzero.launch.worker import finish_rank


def factory():
    net = nn.WithLossCell(nn.SequentialCell(nn.Dense(16, 32), nn.ReLU(), nn.Dense(32, 4)), nn.MSELoss())
    return net, nn.Adam(net.trainable_params(), 1e-3)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)  # given by the launcher
    args = parser.parse_args()
    ms.set_context(mode=ms.GRAPH_MODE)
    init()
    result = {}
    if get_rank() == 0:
        pred = mindzero.predict_peak(factory, [((4, 16), "float32"), ((4, 4), "float32")], 2, zero_stage=2)
        result = {"peak": pred.peak, "states": pred.parts["model_states"]}
    Path(args.out, f"rank_{get_rank()}.json").write_text(json.dumps(result))
    finish_rank(args.out, get_rank())
