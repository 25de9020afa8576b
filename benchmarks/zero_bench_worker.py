"""One configuration of ``zero_bench.py`` on every rank (launched by msrun; one launch per configuration, so
each process's peak RSS belongs to that configuration alone).

Writes ``<out>/rank_<r>.json``: step times, peak RSS (VmHWM) and RSS after ``init()``, model-state bytes
(``memory_report``, or counted for plain data parallel), the collective plan of one step, and, for plain
data parallel, the time of single collectives of the model's size (to split the step into compute and
communication).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))


def status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="dp, or a zero stage 0-3")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--bucket-mib", type=float, default=0, help="comm_fusion bucket (MiB) for all kinds; 0: off")
    ap.add_argument("--no-regather", action="store_true")
    a = ap.parse_args()

    import mindspore as ms
    from mindspore import Tensor, nn, ops
    from mindspore.communication import init

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    init()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    import mindzero
    from mindzero.comm import current_world
    from mindzero.comm_plan import summarize
    from gpt import GPT

    world = current_world()
    rss_init = status_kib("VmRSS")

    class WithLoss(nn.Cell):
        def __init__(self, net):
            super().__init__()
            self.net = net
            self.loss = nn.CrossEntropyLoss()

        def construct(self, tokens, targets):
            logits = self.net(tokens)
            return self.loss(logits.reshape((-1, logits.shape[-1])), targets.reshape((-1,)))

    ms.set_seed(0)
    net = WithLoss(GPT(a.vocab, a.dim, a.layers, a.heads, a.seq, tied=True))
    phi = sum(int(np.prod(p.shape)) for p in net.trainable_params())
    opt = nn.AdamWeightDecay(net.trainable_params(), 1e-4, weight_decay=0.01)
    if a.config == "dp":
        train = nn.TrainOneStepCell(net, opt)
        train.set_train()
    else:
        fusion = None
        if a.bucket_mib:
            size = int(a.bucket_mib * 2 ** 20)
            fusion = {k: {"openstate": True, "bucket_size": size} for k in ("allreduce", "reduce_scatter", "allgather")}
        train = mindzero.prepare_train_network(net, opt, zero_stage=int(a.config), comm_fusion=fusion,
                                               stage3_regather=not a.no_regather)
    rss_prepared = status_kib("VmRSS")
    hwm_prepared = status_kib("VmHWM")
    rng = np.random.RandomState(world.rank)
    times, losses = [], []
    for i in range(a.warmup + a.steps):
        tokens = rng.randint(0, a.vocab, size=(a.batch, a.seq + 1)).astype(np.int32)
        x, y = Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:])
        t = time.perf_counter()
        out = train(x, y)
        loss = float((out if a.config == "dp" else out[0]).asnumpy())
        times.append(time.perf_counter() - t)
        losses.append(loss)
        print(f"step {i}: {times[-1]:.2f}s loss {loss:.4f}", flush=True)
    result = dict(config=a.config, world=world.world_size, rank=world.rank, phi=phi, times=times[a.warmup:],
                  compile_and_first_step=times[0], losses=losses, rss_init_kib=rss_init, vmhwm_kib=status_kib("VmHWM"),
                  rss_prepared_kib=rss_prepared, vmhwm_prepared_kib=hwm_prepared, rss_end_kib=status_kib("VmRSS"),
                  bucket_mib=a.bucket_mib, regather=not a.no_regather)
    if a.config == "dp":
        params = sum(p.nbytes for p in net.get_parameters())
        moments = sum(p.nbytes for p in opt.moments1) + sum(p.nbytes for p in opt.moments2)
        result["memory"] = dict(parameters=params, gradients=0, optimizer_states=moments)
        # single collectives of the model's size: AllReduce of every gradient (what DP does), AllGather of shards
        flat = Tensor(np.ones(phi, np.float32))
        shard = Tensor(np.ones(-(-phi // world.world_size), np.float32))
        allreduce, allgather = ops.AllReduce(), ops.AllGather()
        timing = {}
        for name, op, arg in (("all_reduce_phi", allreduce, flat), ("all_gather_phi", allgather, shard)):
            op(arg).asnumpy()
            runs = []
            for _ in range(3):
                t = time.perf_counter()
                op(arg).asnumpy()
                runs.append(time.perf_counter() - t)
            timing[name] = float(np.median(runs))
        result["collective_seconds"] = timing
        from mindzero.comm_plan import CommShape, step_calls
        from mindzero.config import STAGES, FusionConfig
        from mindzero.plan import ParamInfo, PartitionPlan
        specs = list(PartitionPlan.build([ParamInfo(p.name, tuple(p.shape)) for p in net.trainable_params()],
                                         world.world_size, world.rank))
        calls = step_calls(specs, [False] * len(specs), STAGES[0], CommShape(world.world_size, world.world_size, True),
                           FusionConfig())
        s = summarize([c for c in calls if c.nbytes > 4])  # MindSpore's reducer: one all-reduce per gradient, no flag
        result["comm"] = result["comm_real"] = {op: s[op] for op in s}
    else:
        rep = mindzero.memory_report(train)
        result["memory"] = {k: rep[k] for k in ("parameters", "gradients", "optimizer_states")}
        result["memory_expected"] = {k: rep["expected"][k] for k in ("parameters", "gradients", "optimizer_states")}
        s = summarize(train.zero_info.calls)
        result["comm"] = {op: s[op] for op in s}
        s_real = summarize(train.zero_info.real_calls)
        result["comm_real"] = {op: s_real[op] for op in s_real}
    if a.config != "dp" and world.rank == 0:  # after the measurements: building the text costs memory too
        from mindzero.prepare import plan_text
        print(plan_text(train), flush=True)
    out = Path(a.out)
    (out / f"rank_{world.rank}.json").write_text(json.dumps(result, indent=1))
    (out / f"rank_{world.rank}.done").write_text("ok")


if __name__ == "__main__":
    main()
