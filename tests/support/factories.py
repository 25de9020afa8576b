"""Factories for mindzero.predict_peak / mindzero-plan in the tests: top-level functions returning
``(net_with_loss, optimizer)`` (each rehearsal process imports them again by name)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def tiny_gpt(vocab=512, dim=64, layers=4, heads=4, seq=16):
    """The example GPT (tied head) with nn.AdamWeightDecay."""
    from mindspore import nn
    from gpt import GPT, LMLoss

    net = LMLoss(GPT(vocab, dim, layers, heads, seq, tied=True))
    return net, nn.AdamWeightDecay(net.trainable_params(), 1e-3, weight_decay=0.01)


def no_blocks():
    """A network with no repeated blocks (rehearsed whole)."""
    from mindspore import nn

    net = nn.WithLossCell(nn.SequentialCell(nn.Dense(32, 64), nn.ReLU(), nn.Dense(64, 8)), nn.MSELoss())
    return net, nn.Adam(net.trainable_params(), 1e-3)


def broken():
    raise RuntimeError("this factory fails on purpose")


def not_a_pair():
    from mindspore import nn

    return nn.Dense(2, 2)
