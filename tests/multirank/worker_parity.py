"""One msrun launch, many scenarios: every stage of mindzero against plain data parallel.

Each rank writes ``<out>/rank_<r>/<scenario>.npz`` (per-step losses, overflow flags,
loss scales, final full parameters), ``<out>/rank_<r>/memory.json`` and finally
``<out>/rank_<r>.done``; ``test_parity.py`` compares them.
"""
import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
from mindspore import Tensor, nn

import mindzero
from mindzero.comm import AnyRank, ReduceScatterSum, AllGather, substitute_collectives
from mindzero import start_data_parallel
from models import build

STEPS = 10


def make_optimizer(kind, net):
    params = net.trainable_params()
    if kind == "adamw_groups":  # decay group first: the optimizer reorders its parameters
        decay = [p for p in params if "bias" not in p.name]
        no_decay = [p for p in params if "bias" in p.name]
        return nn.AdamWeightDecay([{"params": no_decay, "weight_decay": 0.0, "lr": 5e-3},
                                   {"params": decay, "weight_decay": 0.05}], learning_rate=1e-2)
    if kind == "adam":
        return nn.Adam(params, 1e-2)
    if kind == "sgd":
        return nn.SGD(params, 0.1, momentum=0.9, weight_decay=1e-4)
    if kind == "momentum":
        return nn.Momentum(params, 0.05, 0.9)
    raise ValueError(kind)


def data(model_cls, step, rank, micro=0, n=None):
    rng = np.random.RandomState(100003 * step + 1009 * rank + 7 * micro + 1)
    arrays = model_cls.batch(rng) if n is None else model_cls.batch(rng, n)
    return [Tensor(a) for a in arrays]


def run(scn, world, groups=None):
    """Train one scenario; ``groups``: ``(optimizer_parallel_group, dp_group)`` for hybrid sharding."""
    net = build(scn["model"])
    init_params = {"init/" + p.name: p.asnumpy().copy() for p in net.trainable_params()}
    cls = type(net)
    opt = make_optimizer(scn["opt"], net)
    if scn.get("param_dtype"):  # fp16 compute, BatchNorm/LayerNorm in fp32: what users of mixed precision run
        from mindspore import amp
        net = amp.auto_mixed_precision(net, "O2")
    k = scn.get("accum", 1)
    if scn["stage"] == "dp":
        train = nn.TrainOneStepCell(net, opt)
        train.set_train()
    else:
        scale = nn.DynamicLossScaleUpdateCell(2.0 ** 12, 2, 50) if scn.get("dynamic_scale") else 1.0
        fusion = None
        if scn.get("fusion"):  # about three buckets of each kind over this model
            bucket = sum(p.nbytes for p in net.trainable_params()) // 3
            fusion = {kind: {"openstate": True, "bucket_size": bucket}
                      for kind in ("allreduce", "reduce_scatter", "allgather")}
        # substitute: the GPU/Ascend code path, CPU-legal primitives (mindzero.comm.substitute_collectives)
        with substitute_collectives() if scn.get("substitute") else contextlib.nullcontext():
            train = mindzero.prepare_train_network(net, opt, scale_sense=scale, zero_stage=scn["stage"],
                                                   comm_fusion=fusion, ema=scn.get("ema"),
                                                   updates=500 if scn.get("ema") else 0,
                                                   optimizer_offload=scn.get("offload", False),
                                                   gradient_accumulation_steps=k, clip_grad=scn.get("clip", False),
                                                   clip_norm=scn.get("clip_norm", 1.0),
                                                   param_dtype=scn.get("param_dtype"),
                                                   reduce_dtype=scn.get("reduce_dtype"),
                                                   **(dict(zip(("optimizer_parallel_group", "dp_group"), groups))
                                                      if groups else {}))
    losses, overflows, scales = [], [], []
    for step in range(scn.get("steps", STEPS)):
        if scn["stage"] == "dp" and k > 1:  # plain DP on the concatenated micro-batches
            micro = [data(cls, step, world.world_rank, m, n=2) for m in range(k)]
            batch = [Tensor(np.concatenate([b[i].asnumpy() for b in micro])) for i in range(len(micro[0]))]
            losses.append(float(train(*batch).asnumpy()))
            continue
        for m in range(k):
            batch = data(cls, step, world.world_rank, m, n=2 if k > 1 else None)
            if scn.get("dynamic_scale") and scn.get("force_overflow", True) and step == 4 \
                    and world.world_rank == world.world_size - 1:
                x = batch[0].asnumpy().copy()
                x.flat[0] = np.inf  # forced overflow on the last rank only
                batch[0] = Tensor(x)
            out = train(*batch)
            if scn["stage"] == "dp":
                losses.append(float(out.asnumpy()))
            else:
                losses.append(float(out[0].asnumpy()))
                overflows.append(bool(out[1].asnumpy()))
                scales.append(float(out[2].asnumpy()))
    if scn["stage"] == "dp":
        params = {p.name: p.asnumpy() for p in net.get_parameters()}
        params.update({k[len("init/"):] + "@init": v for k, v in init_params.items()})
        memory = None
    else:
        params = mindzero.gather_full_state_dict(train)
        if scn.get("ema"):
            params.update({name + "@ema": v for name, v in mindzero.gather_full_state_dict(train, ema=True).items()})
        if scn.get("param_dtype"):
            params.update({name + "@master": v
                           for name, v in mindzero.gather_full_state_dict(train, masters=True).items()})
        memory = mindzero.memory_report(train)
    run.last_train = train
    # emulated False: the GPU/Ascend code path ran (on CPU: substitute_collectives)
    path = {} if scn["stage"] == "dp" else {"emulated": np.array(train.zero_info.world.emulated)}
    return dict(losses=np.array(losses), overflows=np.array(overflows), scales=np.array(scales), **path,
                **{"param/" + n: v for n, v in params.items()}), memory


def scenarios(world_size=2):
    """Every scenario of one launch. 2 ranks run the full matrix. 4 ranks (to keep the suite's time) run every
    model at every stage, accumulation at every stage (the memory accounting) and ``mp-accum`` (accumulation,
    clipping and EMA in fp16) at every stage, but clipping, forced overflow, EMA, comm_fusion and the mixed
    net in fp16 at stages 0 and 3 only, offload at stage 3, gpt and resnet in fp16 at stages 0 and 3 (stage 3:
    its own fp16 code path: fp16 gathers, reduce_dtype in the gather's backward)."""
    full = world_size == 2
    some = (0, 1, 2, 3) if full else (0, 3)
    out = []
    for model, opt in [("mixed", "adamw_groups"), ("awkward", "adam"), ("gpt", "sgd"), ("resnet", "momentum")]:
        for stage in ("dp", 0, 1, 2, 3):
            out.append(dict(name=f"{model}-{stage}", model=model, opt=opt, stage=stage))
    for stage in some:
        out.append(dict(name=f"clip-{stage}", model="mixed", opt="adamw_groups", stage=stage, clip=True,
                        clip_norm=0.05))
        out.append(dict(name=f"overflow-{stage}", model="mixed", opt="adamw_groups", stage=stage,
                        dynamic_scale=True))
    for stage in ("dp", 0, 1, 2, 3):
        out.append(dict(name=f"accum-{stage}", model="awkward", opt="adam", stage=stage, accum=4))
    for stage in some:
        out.append(dict(name=f"ema-{stage}", model="mixed", opt="adamw_groups", stage=stage, ema=0.99))
    for stage in (1, 3) if full else (3,):
        out.append(dict(name=f"offload-{stage}", model="mixed", opt="adamw_groups", stage=stage, offload=True))
    for model, opt in [("mixed", "adamw_groups"), ("gpt", "sgd"), ("resnet", "momentum")]:
        for stage in some:  # fp16 params, fp32 masters, dynamic scale
            out.append(dict(name=f"mp-{model}-{stage}", model=model, opt=opt, stage=stage, param_dtype="float16",
                            dynamic_scale=True, force_overflow=model == "mixed"))
    if full:
        out.append(dict(name="mp-offload-3", model="mixed", opt="adamw_groups", stage=3, param_dtype="float16",
                        dynamic_scale=True, offload=True))
        for name, param_dtype in (("mp-long-0", "float16"), ("fp32-long-0", None)):  # fp16 against fp32
            out.append(dict(name=name, model="mixed", opt="adamw_groups", stage=0, param_dtype=param_dtype,
                            dynamic_scale=True, steps=20))
        for stage in (0, 3):  # gradients reduced in fp32
            out.append(dict(name=f"mp32-mixed-{stage}", model="mixed", opt="adamw_groups", stage=stage,
                            param_dtype="float16", reduce_dtype="float32", dynamic_scale=True))
    for stage in (0, 1, 2, 3):  # accumulation (buffers in fp16), clipping, EMA
        out.append(dict(name=f"mp-accum-{stage}", model="awkward", opt="adam", stage=stage, accum=4,
                        param_dtype="float16", clip=True, clip_norm=0.05, ema=0.99))
    for stage in some:  # the clip-<stage> runs with comm_fusion buckets
        out.append(dict(name=f"fused-{stage}", model="mixed", opt="adamw_groups", stage=stage, clip=True,
                        clip_norm=0.05, fusion=True))
    if full:  # the GPU/Ascend path (real ReduceScatter, fused row layout) with CPU-legal primitives
        for stage in (1, 2, 3):
            for fused in (False, True):
                out.append(dict(name=f"real-{'fused-' if fused else ''}{stage}", model="mixed", opt="adamw_groups",
                                stage=stage, clip=True, clip_norm=0.05, fusion=fused, substitute=True))
        out.append(dict(name="real-mp-3", model="mixed", opt="adamw_groups", stage=3, param_dtype="float16",
                        dynamic_scale=True, substitute=True))
        out.append(dict(name="real-accum-2", model="awkward", opt="adam", stage=2, accum=4, substitute=True))
    return out


def count_collectives(world, out_dir):
    """PyNative: count the collectives one optimizer step really calls (K=2 micro-steps) and the bytes they
    move, per stage, with and without comm_fusion, and with param_dtype=float16; store them next to the
    plan's ``step_calls``."""
    import mindspore as ms
    from mindspore import ops

    from mindzero.core.comm_plan import all_gather_calls, reduce_scatter_calls, summarize

    counted = []
    originals = {}
    for cls, op in ((ops.AllReduce, "all_reduce"), (ops.AllGather, "all_gather"), (ops.ReduceScatter, "reduce_scatter")):
        def counting(self, *args, _orig=cls.__call__, _op=op):
            out = _orig(self, *args)
            counted.append((_op, int((out if _op == "all_gather" else args[0]).nbytes)))
            return out
        originals[cls] = cls.__call__
        cls.__call__ = counting
    ms.set_context(mode=ms.PYNATIVE_MODE)
    results = {}
    try:
        half = [(s, False, "float16") for s in (0, 1, 2, 3)] if world.world_size == 2 else []
        for stage, fused, param_dtype in [(s, f, None) for s in (0, 1, 2, 3) for f in (False, True)] + half:
            net = build("awkward")
            fusion = {k: {"bucket_size": 2 ** 20} for k in ("allreduce", "reduce_scatter", "allgather")} \
                if fused else None
            if param_dtype:
                net.to_float(ms.float16)
            train = mindzero.prepare_train_network(net, make_optimizer("adam", net), zero_stage=stage,
                                                   gradient_accumulation_steps=2, clip_grad=True,
                                                   comm_fusion=fusion, param_dtype=param_dtype)
            counted.clear()
            for m in range(2):
                train(*data(type(net), 0, world.world_rank, m, n=2))
            got = {op: {"calls": 0, "bytes": 0} for op in ("all_reduce", "all_gather", "reduce_scatter")}
            for op, nbytes in counted:
                got[op]["calls"] += 1
                got[op]["bytes"] += nbytes
            plan = summarize(train.zero_info.calls)
            # the plan counts one read per parameter; AwkwardNet reads w2 twice, so stage 3 gathers it
            # (and reduce-scatters its gradient) once more per micro-step
            extra = []
            if stage == 3:
                w2 = dataclasses.replace(train.zero_info.plan["w2"], dtype=param_dtype or "float32")
                shape = world
                extra = 2 * (all_gather_calls([w2], shape, "forward") + reduce_scatter_calls([w2], shape, "backward"))
            extra = summarize(extra)
            results[f"{stage}-{'fused' if fused else 'plain'}{'-fp16' if param_dtype else ''}"] = dict(
                counted=got, plan={op: {k: plan[op][k] + extra[op][k] for k in ("calls", "bytes")} for op in got})
    finally:
        for cls, call in originals.items():
            cls.__call__ = call
        ms.set_context(mode=ms.GRAPH_MODE)
    (out_dir / "collective_counts.json").write_text(json.dumps(results, indent=1))


def check_collectives(world, out_dir):
    """AnyRank / ReduceScatterSum / AllGather against numpy, on this world."""
    n, r = world.world_size, world.world_rank
    x = np.arange(3 * n, dtype=np.float32) * (r + 1)
    rs = ReduceScatterSum(world)(Tensor(x), 0).asnumpy()
    expect_rs = (np.arange(3 * n, dtype=np.float32) * sum(range(1, n + 1)))[3 * r:3 * r + 3]
    ag = AllGather(world)(Tensor(np.full(2, r, np.float32))).asnumpy()
    any_last = bool(AnyRank(world)(Tensor(r == n - 1)).asnumpy())
    any_none = bool(AnyRank(world)(Tensor(False)).asnumpy())
    result = dict(reduce_scatter_ok=bool(np.array_equal(rs, expect_rs)),
                  all_gather_ok=bool(np.array_equal(ag, np.repeat(np.arange(n, dtype=np.float32), 2))),
                  any_rank_last=any_last, any_rank_none=any_none)
    (out_dir / "collectives.json").write_text(json.dumps(result))


def check_plan_mismatch(world, out_dir):
    """The last rank builds a network with one parameter reshaped: prepare must fail on every rank
    with a message naming the parameter, instead of deadlocking."""
    from mindspore import Parameter

    net = build("awkward")
    if world.world_rank == world.world_size - 1:
        net.proj = Parameter(Tensor(np.zeros((15, 18), np.float32)), name="proj")
    try:
        mindzero.prepare_train_network(net, nn.Adam(net.trainable_params()), zero_stage=3)
        message = ""
    except ValueError as err:
        message = str(err)
    (out_dir / "plan_mismatch.txt").write_text(message)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    world = start_data_parallel()
    out_dir = Path(args.out) / f"rank_{world.world_rank}"
    out_dir.mkdir(parents=True, exist_ok=True)
    check_collectives(world, out_dir)
    check_plan_mismatch(world, out_dir)
    count_collectives(world, out_dir)
    memory = {}
    ran = [scn["name"] for scn in scenarios(world.world_size)
           if not args.only or scn["name"].startswith(tuple(args.only.split(",")))]
    (out_dir / "scenarios.json").write_text(json.dumps(ran))
    for scn in scenarios(world.world_size):
        if args.only and not scn["name"].startswith(tuple(args.only.split(","))):
            continue
        t = time.time()
        arrays, mem = run(scn, world)
        np.savez(out_dir / f"{scn['name']}.npz", **arrays)
        if mem is not None:
            memory[scn["name"]] = mem
        print(f"scenario {scn['name']}: {time.time() - t:.1f}s", flush=True)
    (out_dir / "memory.json").write_text(json.dumps(memory, indent=1))
    (Path(args.out) / f"rank_{world.world_rank}.done").write_text("ok")


if __name__ == "__main__":
    sys.exit(main())
