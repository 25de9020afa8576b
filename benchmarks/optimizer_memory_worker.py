"""The worker of ``optimizer_memory.py`` (launched by msrun on every rank).

``--job tutorial --config dp|0|1|2|3|1o|2o|3o``: the PyTorch ``ZeroRedundancyOptimizer`` tutorial's experiment in
MindSpore: 20 x ``nn.Dense(2000, 2000)`` built eagerly, ``nn.Adam`` (lr 0.01), one step of MSE on
``randn(20, 2000)``; ``dp`` is ``nn.TrainOneStepCell`` under DATA_PARALLEL, ``0``-``3`` are
``mindzero.prepare_train_network`` (``1o``-``3o``: ``update_sharding="owner"``, so each layer is updated whole on
an owner rank, as PyTorch's ``ZeroRedundancyOptimizer`` partitions). Records the RSS right after ``init()``, the peak RSS up to and after the
step (``VmHWM``), the RSS after prepare, and the sum of the parameters after the step.

``--job matrix --optimizers A,B``: for each optimizer, stage 0-3, eager or ``lazy_init`` build, fp32 or
``param_dtype=float16``, in one process one after the other: the RSS after prepare (every page of the step's
Parameters written with its value, as the first step would: states made as zeros are not resident before) minus the RSS
before the build: the persistent bytes the configuration keeps; ``memory_report``'s counted bytes and the plan's
beside it.
Between cells everything is freed and collected; the RSS before each build is re-read.

Writes ``<out>/rank_<r>.json``. Run under ``MALLOC_MMAP_THRESHOLD_=1048576`` (the launcher sets it), so freed
tensors go back to the OS and RSS measures what is live.
"""
import argparse
import contextlib
import gc
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from zero_bench_worker import reset_peak, status_kib  # noqa: E402  (this script's folder is on sys.path)

MIB = 2 ** 20


def settle() -> int:
    """Collect garbage and give freed heap back to the OS (:func:`mindzero.release_host_memory`); the RSS
    (KiB) after."""
    from mindzero.core.host import release_host_memory

    gc.collect()
    release_host_memory()
    return status_kib("VmRSS")


def tutorial_net(layers: int, width: int):
    from mindspore import nn

    class ToyModel(nn.Cell):  # the tutorial's nn.Sequential of Linear(2000, 2000) layers, with its MSE
        def __init__(self):
            super().__init__()
            self.net = nn.SequentialCell([nn.Dense(width, width) for _ in range(layers)])

        def construct(self, x, y):
            return ((self.net(x) - y) ** 2).mean()

    return ToyModel()


def tutorial(a, world):
    import mindspore as ms
    from mindspore import Tensor, nn

    import mindzero

    base = settle()
    reset_peak()
    ms.set_seed(0)
    net = tutorial_net(a.layers, a.width)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    if a.config == "dp":  # its gradients are all-reduced only under MindSpore's DATA_PARALLEL context
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
        train = nn.TrainOneStepCell(net, opt)
        train.set_train()
    else:
        # "o": update_sharding="owner": each layer updated whole on one rank (its Adam states there, balanced by
        # bytes), the user's Parameter itself in fp32: no master shard
        train = mindzero.prepare_train_network(net, opt, zero_stage=int(a.config[0]),
                                               update_sharding="owner" if a.config.endswith("o") else "auto")
    after_prepare = settle()
    rng = np.random.RandomState(world.world_rank)
    x = Tensor(rng.randn(20, a.width).astype(np.float32))
    y = Tensor(rng.randn(20, a.width).astype(np.float32))
    out = train(x, y)
    loss = float((out if a.config == "dp" else out[0]).asnumpy())
    peak = status_kib("VmHWM")
    params = mindzero.gather_full_state_dict(train) if a.config != "dp" else \
        {p.name: p.asnumpy() for p in net.get_parameters()}
    report = mindzero.memory_report(train) if a.config != "dp" else None
    return dict(config=a.config, world_size=world.world_size, rss_init_kib=base,
                held_mib=None if report is None else sum(report[k] for k in ("parameters", "optimizer_states")) / MIB,
                balance=None if report is None else report["balance"]["ratio"],
                prepare_above_init_mib=(after_prepare - base) / 1024, peak_above_init_mib=(peak - base) / 1024,
                loss=loss, param_sum=float(sum(np.float64(v.sum()) for v in params.values())),
                phi=sum(int(v.size) for v in params.values()))


def touch(train) -> None:
    """Write every Parameter the step holds with the value it has: a state MindSpore made as zeros is not
    resident until the first step writes it, so RSS after prepare would miss it."""
    from mindspore import Tensor

    for p in train.get_parameters():
        p.set_data(Tensor(p.asnumpy().copy(), p.dtype))


def matrix_cell(optimizer: str, stage: int, lazy: bool, fp16: bool, a) -> dict:
    import mindspore as ms

    import mindzero
    from tests.support.release import RELEASE_OPTIMIZERS

    before = settle()
    ms.set_seed(0)
    with mindzero.lazy_init() if lazy else contextlib.nullcontext():
        net = tutorial_net(a.layers, a.width)
        opt = RELEASE_OPTIMIZERS[optimizer](net.trainable_params())
    train = mindzero.prepare_train_network(net, opt, zero_stage=stage, param_dtype="float16" if fp16 else None)
    touch(train)
    after = settle()
    report = mindzero.memory_report(train)
    kinds = ("parameters", "optimizer_moments", "master_shards")
    row = dict(optimizer=optimizer, stage=stage, build="lazy" if lazy else "eager", precision="fp16" if fp16 else "fp32",
               rss_mib=(after - before) / 1024, counted_mib=sum(report[k] for k in kinds) / MIB,
               plan_mib=sum(report["expected"][k] for k in kinds) / MIB,
               **{f"{k}_mib": report[k] / MIB for k in kinds}, states=len(train.zero_info.state_attrs))
    del train, net, opt, report
    settle()
    return row


def matrix(a, world):
    rows = []
    for optimizer in a.optimizers.split(","):
        for fp16 in (False, True):
            for lazy in (False, True):
                for stage in (0, 1, 2, 3):
                    rows.append(matrix_cell(optimizer, stage, lazy, fp16, a))
                    print("cell", json.dumps(rows[-1]), flush=True)
    return dict(world_size=world.world_size, rows=rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", choices=("tutorial", "matrix"), required=True)
    ap.add_argument("--config", default="dp")
    ap.add_argument("--optimizers", default="nn.Adam")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--width", type=int, default=2000)
    from mindzero.launch.worker import start_worker

    worker = start_worker(ap)
    result = tutorial(worker.args, worker.world) if worker.args.job == "tutorial" else matrix(worker.args, worker.world)
    (worker.out / f"rank_{worker.world.world_rank}.json").write_text(json.dumps(result, indent=1))
    worker.finish()


if __name__ == "__main__":
    sys.exit(main())
