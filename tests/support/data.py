"""The test data: one formula for every batch, the same in every process, so runs on any stage, world size
or launcher see the same samples."""
import numpy as np
from mindspore import Tensor


def batch(model_cls, step: int, rank: int, micro: int = 0, n: int = None) -> list:
    """World rank ``rank``'s batch of ``step`` (micro-batch ``micro``), ``n`` samples (the model's default if
    ``None``), as Tensors."""
    rng = np.random.RandomState(100003 * step + 1009 * rank + 7 * micro + 1)
    arrays = model_cls.batch(rng) if n is None else model_cls.batch(rng, n)
    return [Tensor(a) for a in arrays]


def concat(batches: list) -> list:
    """Several batches as one (plain data parallel on the micro-batches of an accumulation step)."""
    return [Tensor(np.concatenate([b[i].asnumpy() for b in batches])) for i in range(len(batches[0]))]


UNITS = 4  # units of 2 samples in one global batch of unit_batch


def unit_batch(model_cls, step: int, rank: int, world_size: int) -> list:
    """World rank ``rank``'s share of a global batch of :data:`UNITS` units of 2 samples: runs on 2 and 4 ranks
    are the same computation (equal-size units; the mean of means is the global mean)."""
    per = UNITS // world_size
    parts = [model_cls.batch(np.random.RandomState(1000 * step + u + 1), 2) for u in range(rank * per, (rank + 1) * per)]
    return [Tensor(np.concatenate([p[i] for p in parts])) for i in range(len(parts[0]))]
