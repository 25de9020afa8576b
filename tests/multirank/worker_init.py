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
import time

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Initializer, Sparse, TruncatedNormal, initializer

import mindzero
from examples.gpt import GPT, LMLoss
from mindzero.comm import AllReduceSum
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


class WideMLP(nn.Cell):
    """24 layers of 1024 x 1024: 96 MiB of gradients in tensors of 4 MiB, for the stage 2 memory check."""

    def __init__(self):
        super().__init__()
        self.layers = nn.CellList([nn.Dense(1024, 1024, has_bias=False) for _ in range(24)])

    def construct(self, x):
        for layer in self.layers:
            x = ops.tanh(layer(x))
        return (x * x).mean()


def first_step_peak(stage, default_order=False):
    """Peak RSS growth (MiB) over the first step of the wide MLP at ``stage``, the graph compiled before the
    measurement (its heap is not the step's) and the gradient bytes. MindSpore's memory pool keeps its peak
    for the process, so a later measurement grows only by what it needs beyond the earlier ones' peak (see
    ``test_stage2_frees_each_gradient_as_backward_produces_it``). ``default_order``: the step compiled in
    MindSpore's default kernel order instead of its own (the control)."""
    ms.set_seed(1)
    net = WideMLP()
    train = mindzero.prepare_train_network(net, nn.SGD(net.trainable_params(), 0.01), zero_stage=stage)
    if default_order:
        train.exec_order = None
    x = Tensor(np.random.RandomState(2).randn(8, 1024).astype(np.float32))
    train.compile(x)
    train._compiled = True
    gc.collect()
    mindzero.release_host_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_kib("VmRSS")
    train(x)[0].asnumpy()
    peak = status_kib("VmHWM") - before
    grads = sum(p.nbytes for p in net.trainable_params())
    del train, net
    gc.collect()
    return dict(peak_mib=peak / 1024, grad_mib=grads / 2 ** 20, largest_mib=4.0)


def barrier(world):
    AllReduceSum(world)(Tensor(np.ones(1, np.float32))).asnumpy()


def pretrained_runs(stage, path, world, lazy):
    """The TinyLM trained 3 steps from the weights of ``path`` (a plain checkpoint of its standalone GPT):
    loaded the plain MindSpore way before prepare (``eager``), or by ``mindzero.load_pretrained`` after it."""
    runs = {}
    for kind in ("eager", "loaded") + (("lazy",) if lazy else ()):
        ms.set_seed(7)
        if kind == "lazy":
            with mindzero.lazy_init():
                net = TinyLM()
                opt = nn.Adam(net.trainable_params(), 1e-2)
        else:
            net = TinyLM()
            opt = nn.Adam(net.trainable_params(), 1e-2)
        if kind == "eager":  # the plain MindSpore way: the file's names with the wrapper's prefix
            weights = {"lm.gpt." + k: v for k, v in ms.load_checkpoint(str(path)).items()}
            assert not ms.load_param_into_net(net, weights, strict_load=True)[0]
        train = mindzero.prepare_train_network(net, opt, zero_stage=stage)
        if kind != "eager":
            report = mindzero.load_pretrained(train, path)
            assert report["prefix"] == "lm.gpt." and not report["missing"] and not report["unexpected"], report
        out = {"init/" + k: v for k, v in mindzero.gather_full_state_dict(train).items()}
        rng = np.random.RandomState(100 + world.world_rank)
        out["losses"] = np.array([float(train(*[Tensor(a) for a in TinyLM.batch(rng)])[0].asnumpy())
                                  for _ in range(STEPS)])
        out.update({"final/" + k: v for k, v in mindzero.gather_full_state_dict(train).items()})
        runs[kind] = out
    return runs


def load_peak(path, world):
    """Peak RSS growth (MiB) while ``load_pretrained`` loads the 256 MiB plain file of the wide network into a
    lazily built stage-3 step, and (the control: the measurement sees a full model) while MindSpore's own
    ``load_checkpoint`` reads it."""
    net, opt = build("wide", True, seed=3)
    train = mindzero.prepare_train_network(net, opt, zero_stage=3)
    gc.collect()
    mindzero.release_host_memory()
    result = {}
    for what in ("load_pretrained", "mindspore.load_checkpoint"):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = status_kib("VmRSS")
        if what == "load_pretrained":
            mindzero.load_pretrained(train, path)
            result[what] = (status_kib("VmHWM") - before) / 1024
            loaded = {k: float(np.abs(v).sum()) for k, v in mindzero.gather_full_state_dict(train).items()}
        else:
            full = ms.load_checkpoint(str(path))
            result[what] = (status_kib("VmHWM") - before) / 1024
    rep = mindzero.memory_report(train)
    result.update(held_mib=(rep["parameters"] + rep["optimizer_states"]) / 2 ** 20, largest_mib=8.0,
                  same_values=all(abs(loaded[k] - float(np.abs(full[k].asnumpy()).sum())) < 1e-3 * loaded[k] + 1e-6
                                  for k in loaded))
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


def stage_list(text: str) -> list:
    """``"0,1,3"`` -> ``[0, 1, 3]`` (parsed once, by argparse)."""
    return [int(s) for s in text.split(",")]


def compare_list(text: str) -> dict:
    """``"lm=0,1,3/zoo=3"`` -> ``{"lm": [0, 1, 3], "zoo": [3]}``: the stages of each model's comparison."""
    pairs = (item.split("=") for item in text.split("/"))
    return {model: stage_list(stages) for model, stages in pairs}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", type=compare_list, default="lm=0,1,2,3/zoo=0,1,2,3/vit=0,1,2,3",
                    help="the stages of each model's eager-vs-lazy comparison")
    ap.add_argument("--pretrained-stages", type=stage_list, default="0,1,2,3",
                    help="stages of the load_pretrained runs")
    worker = start(ap)
    world, out_dir = worker.world, worker.rank_dir
    t = time.time()
    memory = {"lazy-3": peak_growth("wide", 3, True), "lazy-2": peak_growth("wide", 2, True),
              "eager-3": peak_growth("wide", 3, False)}  # lazy first: a fresh process
    # the smallest expected step peak first (the memory pool keeps its peak): stage 2, then stage 1 (the same step),
    # then the control, stage 2 in MindSpore's default kernel order
    memory.update({f"step-{stage}": first_step_peak(stage) for stage in (2, 1)})
    memory["step-2-default-order"] = first_step_peak(2, default_order=True)
    files = worker.out / "pretrained"
    if world.world_rank == 0:  # plain checkpoints, as mindspore.save_checkpoint writes them
        files.mkdir(exist_ok=True)
        ms.set_seed(5)
        ms.save_checkpoint(GPT(50, 32, 2, 4, 8, tied=False), str(files / "gpt.ckpt"))  # standalone: no prefix
        ms.save_checkpoint(build("wide", False, seed=4)[0], str(files / "wide.ckpt"))
    barrier(world)
    memory["load-3"] = load_peak(files / "wide.ckpt", world)
    (out_dir / "memory.json").write_text(json.dumps(memory, indent=1))
    print(f"memory checks: {time.time() - t:.1f}s", flush=True)
    for stage in worker.args.pretrained_stages:
        t = time.time()
        for kind, arrays in pretrained_runs(stage, files / "gpt.ckpt", world, lazy=stage == 3).items():
            np.savez(out_dir / f"pretrained-{stage}-{kind}.npz", **arrays)
        print(f"pretrained stage {stage}: {time.time() - t:.1f}s", flush=True)
    for model, stages in worker.args.compare.items():
        for stage in stages:
            t = time.time()
            for lazy in (False, True):
                arrays = values_and_training(model, stage, lazy, world)
                np.savez(out_dir / f"{model}-{stage}-{'lazy' if lazy else 'eager'}.npz", **arrays)
            print(f"{model} stage {stage} eager and lazy: {time.time() - t:.1f}s", flush=True)
    for stage in (0, 3):
        (out_dir / f"seed_mismatch-{stage}.txt").write_text(seed_mismatch(stage, world))
    worker.finish()


if __name__ == "__main__":
    main()
