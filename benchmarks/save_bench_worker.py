"""One rank of ``benchmarks/save_bench.py``: train the benchmark GPT, time synchronous and asynchronous saves."""
import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
from zero_bench_worker import add_model_args, build  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=4)
    add_model_args(ap)
    a = ap.parse_args()
    from mindspore import Tensor

    import mindzero
    from mindzero.launch.worker import finish_rank

    world = mindzero.start_data_parallel()
    net, opt = build(a, lazy=True)
    train = mindzero.prepare_train_network(net, opt, zero_stage=a.stage)
    rng = np.random.RandomState(world.world_rank)

    def step():
        tokens = rng.randint(0, a.vocab, size=(a.batch, a.seq + 1)).astype(np.int32)
        t = time.perf_counter()
        train(Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:]))[0].asnumpy()
        return time.perf_counter() - t

    steady = [step() for _ in range(a.warmup)][1:]
    root = Path(a.out) / "ckpts"
    result = {"sync": [], "async": []}
    n = 0
    for _ in range(a.rounds):
        for mode in ("sync", "async"):
            n += 1
            path = root / f"{mode}_{n}"
            t = time.perf_counter()
            handle = mindzero.save_checkpoint(train, path, async_save=mode == "async")
            call = time.perf_counter() - t
            after = step()
            t = time.perf_counter()
            if mode == "async":
                handle.wait()
            wait = time.perf_counter() - t
            rec = dict(call_s=call, step_after_s=after, wait_s=wait)
            if mode == "async":
                rec["host_bytes"] = handle.host_bytes
            result[mode].append(rec)
            steady.append(step())
            print(f"{mode} save {n}: call {call:.2f}s, step after {after:.2f}s, wait {wait:.2f}s", flush=True)
    written = sum(p.stat().st_size for p in (root / "sync_1").iterdir() if p.name.startswith(f"rank_{world.world_rank}."))
    if world.world_rank == 0:
        written += sum(p.stat().st_size for p in (root / "sync_1").iterdir() if p.name.startswith("network."))
    phi = sum(s.numel for s in train.zero_info.plan)
    res = dict(rank=world.world_rank, phi=phi, median_step_s=statistics.median(steady), steps=steady,
               bytes_per_rank=written, **result)
    out = Path(a.out)
    (out / f"rank_{world.world_rank}.json").write_text(json.dumps(res, indent=1))
    from mindzero.comm.cells import Barrier

    Barrier(train.zero_info.world)()
    if world.world_rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    finish_rank(out, world.world_rank)  # the launcher waits for it


if __name__ == "__main__":
    sys.exit(main())
