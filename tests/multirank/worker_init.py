"""One msrun launch: sharded initialisation (``mindzero.lazy_init``) against an eager build, on every rank.

Writes ``<out>/rank_<r>/``:

* ``memory.json``: peak RSS growth (VmHWM, reset before the build) over build + prepare of a 64M-parameter
  network of 32 equal tensors, lazily at stages 3 and 2 and, as the control, eagerly at stage 3, with the
  bytes the rank must hold;
* ``<model>-<stage>.npz``: for an eager and a lazy build with the same seed: the full values after prepare
  (``gather_full_state_dict``), and, for the trainable models, the losses and full values after 3 steps;
* ``seed_mismatch-<stage>.txt``: the error prepare raised when the last rank used another seed.
"""
import argparse
import gc
import json

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Initializer, Sparse, TruncatedNormal, initializer

import mindzero
from examples.gpt import GPT, LMLoss
from mindzero.engine.materialize import is_lazy
from tests.support.worker import start

STEPS = 3


def status_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class Scaled(Initializer):
    """A user's own initializer (not one of MindSpore's): it draws from NumPy's global state itself."""

    def _initialize(self, arr):
        arr[...] = np.random.standard_normal(arr.shape).astype(arr.dtype) * 0.1


class Zoo(nn.Cell):
    """What model zoos do: a user initializer, Sparse (data-dependent draws), re-initialisation with
    set_data (mindcv's ViTs), a NumPy-made (not lazy) parameter, a replicated one, BatchNorm buffers,
    an fp16 cell."""

    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer(Scaled(), (9, 13)), name="w")
        self.sparse = Parameter(initializer(Sparse(0.3, 0.5), (13, 6)), name="sparse")
        self.dense = nn.Dense(6, 6).to_float(ms.float16)
        self.dense.weight.set_data(initializer(TruncatedNormal(0.2), self.dense.weight.shape, self.dense.weight.dtype))
        self.fixed = Parameter(Tensor(np.linspace(-1, 1, 6).astype(np.float32)), name="fixed")
        self.rep = Parameter(initializer("normal", (6,)), name="rep")
        self.rep.parallel_optimizer = False
        self.bn = nn.BatchNorm1d(6)
        self.loss = nn.MSELoss()

    def construct(self, x, y):
        h = ops.tanh(ops.matmul(ops.matmul(x, self.w), self.sparse))
        h = ops.cast(self.dense(h), ms.float32) * self.fixed + self.rep
        return self.loss(self.bn(h), y)

    @staticmethod
    def batch(rng):
        x = rng.randn(4, 9).astype(np.float32)
        return x, np.tanh(x[:, :6])


class TinyLM(nn.Cell):
    """The example GPT with MindSpore's default initializers (Dense HeUniform/Uniform, Embedding Normal,
    LayerNorm ones/zeros)."""

    def __init__(self):
        super().__init__()
        self.lm = LMLoss(GPT(50, 32, 2, 4, 8, tied=False))

    def construct(self, x, y):
        return self.lm(x, y)

    @staticmethod
    def batch(rng):
        tok = rng.randint(0, 50, size=(2, 9)).astype(np.int32)
        return tok[:, :-1], tok[:, 1:]


class ViT(nn.Cell):
    """mindcv's vision transformer (reads cls_token / pos_embed in construct; re-initialises every Dense and
    LayerNorm with set_data after construction), small: 32x32 images, 2 blocks."""

    def __init__(self):
        super().__init__()
        from mindcv.models.vit import VisionTransformer
        self.net = nn.WithLossCell(VisionTransformer(image_size=32, patch_size=8, embed_dim=32, depth=2,
                                                     num_heads=4, num_classes=10), nn.CrossEntropyLoss())

    def construct(self, x, y):
        return self.net(x, y)

    @staticmethod
    def batch(rng):
        return rng.randn(2, 3, 32, 32).astype(np.float32), rng.randint(0, 10, size=(2,)).astype(np.int32)


class Wide(nn.Cell):
    """64M parameters in 32 tensors of 8 MiB (the largest), for the memory measurement."""

    def __init__(self):
        super().__init__()
        self.layers = nn.CellList([nn.Dense(1024, 2048, has_bias=False) for _ in range(32)])

    def construct(self, x):
        return x.sum()


def build(model, lazy, seed):
    ms.set_seed(seed)
    make = {"zoo": Zoo, "lm": TinyLM, "vit": ViT, "wide": Wide}[model]
    if lazy:
        with mindzero.lazy_init():
            net = make()
            opt = nn.Adam(net.trainable_params(), 1e-2)
        assert any(is_lazy(p) for p in net.get_parameters()), model
    else:
        net = make()
        opt = nn.Adam(net.trainable_params(), 1e-2)
    return net, opt


def values_and_training(model, stage, lazy, world):
    net, opt = build(model, lazy, seed=7)
    train = mindzero.prepare_train_network(net, opt, zero_stage=stage)
    out = {"init/" + k: v for k, v in mindzero.gather_full_state_dict(train).items()}
    rng = np.random.RandomState(100 + world.world_rank)
    losses = []
    for _ in range(STEPS):
        losses.append(float(train(*[Tensor(a) for a in type(net).batch(rng)])[0].asnumpy()))
    out["losses"] = np.array(losses)
    out.update({"final/" + k: v for k, v in mindzero.gather_full_state_dict(train).items()})
    return out


def peak_growth(model, stage, lazy):
    """Peak RSS growth (MiB) over build + prepare, the bytes the rank holds after it, and the full bytes."""
    gc.collect()
    mindzero.release_host_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_kib("VmRSS")
    net, opt = build(model, lazy, seed=3)
    full = sum(int(np.prod(p.shape)) * 4 for p in net.trainable_params())
    largest = max(int(np.prod(p.shape)) * 4 for p in net.trainable_params())
    train = mindzero.prepare_train_network(net, opt, zero_stage=stage)
    peak = status_kib("VmHWM") - before
    rep = mindzero.memory_report(train)
    result = dict(peak_mib=peak / 1024, held_mib=(rep["parameters"] + rep["optimizer_states"]) / 2 ** 20,
                  full_mib=full / 2 ** 20, largest_mib=largest / 2 ** 20)
    del train, net, opt
    gc.collect()
    return result


def seed_mismatch(stage, world):
    seed = 11 if world.world_rank == world.world_size - 1 else 7
    ms.set_seed(seed)
    with mindzero.lazy_init():
        net = TinyLM()
        opt = nn.Adam(net.trainable_params(), 1e-2)
    try:
        mindzero.prepare_train_network(net, opt, zero_stage=stage)
        return ""
    except ValueError as err:
        return str(err)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default="0,1,2,3", help="stages of the eager-vs-lazy comparisons")
    worker = start(ap)
    world, out_dir = worker.world, worker.rank_dir
    memory = {"lazy-3": peak_growth("wide", 3, True), "lazy-2": peak_growth("wide", 2, True),
              "eager-3": peak_growth("wide", 3, False)}  # lazy first: a fresh process
    (out_dir / "memory.json").write_text(json.dumps(memory, indent=1))
    for model in ("lm", "zoo", "vit"):
        for stage in (int(s) for s in worker.args.stages.split(",")):
            for lazy in (False, True):
                arrays = values_and_training(model, stage, lazy, world)
                np.savez(out_dir / f"{model}-{stage}-{'lazy' if lazy else 'eager'}.npz", **arrays)
    for stage in (0, 3):
        (out_dir / f"seed_mismatch-{stage}.txt").write_text(seed_mismatch(stage, world))
    worker.finish()


if __name__ == "__main__":
    main()
