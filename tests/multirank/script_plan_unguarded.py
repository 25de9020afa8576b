"""A training script as many are written: no ``if __name__ == "__main__":`` guard, arguments parsed and the
cluster joined at the top level, and the factory it asks ``predict_peak`` about defined right here. Every rank
asks; each writes what it got (a prediction, or the refusal's message) to ``OUT/rank_<r>.json``."""
import argparse
import json
from pathlib import Path

import mindspore as ms
from mindspore import nn
from mindspore.communication import get_rank, init

import mindzero
from mindzero.launch.worker import finish_rank

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)  # given by the launcher
args = parser.parse_args()
ms.set_context(mode=ms.GRAPH_MODE)
init()


def factory():
    net = nn.WithLossCell(nn.SequentialCell(nn.Dense(16, 32), nn.ReLU(), nn.Dense(32, 4)), nn.MSELoss())
    return net, nn.Adam(net.trainable_params(), 1e-3)


try:
    pred = mindzero.predict_peak(factory, [((4, 16), "float32"), ((4, 4), "float32")], 2, zero_stage=2)
    result = {"peak": pred.peak}
except ValueError as err:
    result = {"refused": str(err)}
Path(args.out, f"rank_{get_rank()}.json").write_text(json.dumps(result))
finish_rank(args.out, get_rank())
