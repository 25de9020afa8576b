"""One rank of ``pynative.py --phases``: PyNative's step split into its phases, plain DP against mindzero.

Plain DP is ``value_and_grad``, ``DistributedGradReducer``, the optimizer (``zero_bench_worker.PlainDataParallel``);
mindzero is its PyNative step: forward and backward eager, then the compiled part (reductions, overflow, clipping,
the update). Steps alternate: a whole step timed as a user runs it (one synchronisation at its end), then a step
with a synchronisation after each phase, so the phases' sum beside the whole step shows what overlaps. Writes
``rank_<r>.json`` with the median of each.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import numpy as np  # noqa: E402

from zero_bench_worker import add_model_args  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="dp, or a zero stage 0-3")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5, help="whole steps, and as many split ones, after two warm-up steps")
    add_model_args(ap)
    a = ap.parse_args()
    import mindspore as ms
    from mindspore import Tensor

    import mindzero
    from mindzero.launch.worker import finish_rank
    from zero_bench_worker import PlainDataParallel, build

    world = mindzero.start_data_parallel(mode=ms.PYNATIVE_MODE)
    net, opt = build(a, a.config != "dp")
    sync = ms.runtime.synchronize
    if a.config == "dp":
        net.set_train()
        train = PlainDataParallel(net, opt)
    else:
        train = mindzero.prepare_train_network(net, opt, zero_stage=int(a.config),
                                               stage3_param_persistence_threshold=100_000)
    rng = np.random.RandomState(world.world_rank)
    whole, split = [], []
    for i in range(2 + 2 * a.steps):
        tokens = rng.randint(0, a.vocab, size=(a.batch, a.seq + 1)).astype(np.int32)
        x, y = Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:])
        if i < 2 or i % 2 == 0:  # warm-up, then every other step whole
            t = time.perf_counter()
            out = train(x, y)
            (out if a.config == "dp" else out[0]).asnumpy()
            sync()
            if i >= 2:
                whole.append(time.perf_counter() - t)
            continue
        t0 = time.perf_counter()
        if a.config == "dp":
            _, grads = train.grad_fn(x, y)
            sync()
            t1 = time.perf_counter()
            grads = train.reducer(grads)
            sync()
            t2 = time.perf_counter()
            train.opt(grads)
            sync()
            t3 = time.perf_counter()
            split.append(dict(forward_backward=t1 - t0, reduce=t2 - t1, update=t3 - t2))
        else:
            _, grads, scale = train._forward_backward(x, y)  # what the train step's PyNative path runs
            sync()
            t1 = time.perf_counter()
            _, _, handoff = train._after_jit(ms.mutable(grads), scale)
            sync()
            t2 = time.perf_counter()
            train.states.after_step(handoff)
            split.append(dict(forward_backward=t1 - t0, reduce=0.0, update=t2 - t1))
    result = dict(config=a.config, rank=world.world_rank, whole_s=statistics.median(whole),
                  phases_s={k: statistics.median(s[k] for s in split) for k in split[0]})
    result["phases_sum_s"] = sum(result["phases_s"].values())
    print(json.dumps(result), flush=True)
    out = Path(a.out)
    (out / f"rank_{world.world_rank}.json").write_text(json.dumps(result, indent=1))
    finish_rank(out, world.world_rank)


if __name__ == "__main__":
    main()
