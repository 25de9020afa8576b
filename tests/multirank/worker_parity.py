"""One msrun launch, many scenarios (:func:`tests.support.scenarios.parity_scenarios`): every stage of
mindzero against plain data parallel.

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

import numpy as np
from mindspore import Tensor, nn

import mindzero
from mindzero.comm import AllGather, AnyRank, ReduceScatterSum, substitute_collectives
from tests.support.data import batch
from tests.support.models import build, make_optimizer
from tests.support.scenarios import NO_PERSISTENCE_CAP, parity_scenarios
from tests.support.tier import add_worker_flag
from tests.support.worker import counting_collectives, run, start, tally

def count_collectives(world, out_dir):
    """PyNative: count the collectives one optimizer step really calls (K=2 micro-steps) and the bytes they
    move, per stage, with and without comm_fusion, with param_dtype=float16, and at stage 3 with small parameters
    kept whole (``stage3_param_persistence_threshold``); store them next to the plan's ``step_calls``."""
    import mindspore as ms

    from mindzero.core.comm_plan import all_gather_calls, reduce_scatter_calls, summarize

    results = {}
    with counting_collectives() as counted:
        half = [(s, False, "float16", 0) for s in (0, 1, 2, 3)] if world.world_size == 2 else []
        # stage 3 with w1 (105 elements), gain and temp kept whole (stage3_param_persistence_threshold)
        persist = [(3, False, None, 200)]
        for stage, fused, param_dtype, keep in [(s, f, None, 0) for s in (0, 1, 2, 3) for f in (False, True)] + half \
                + persist:
            net = build("awkward")
            fusion = {k: {"bucket_size": 2 ** 20} for k in ("allreduce", "reduce_scatter", "allgather")} \
                if fused else None
            if param_dtype:
                net.to_float(ms.float16)
            train = mindzero.prepare_train_network(net, make_optimizer("adam", net), zero_stage=stage,
                                                   gradient_accumulation_steps=2, clip_grad=True,
                                                   comm_fusion=fusion, param_dtype=param_dtype,
                                                   stage3_param_persistence_threshold=keep,
                                                   stage3_model_persistence_threshold=NO_PERSISTENCE_CAP if keep else None)
            counted.clear()
            for m in range(2):
                train(*batch(type(net), 0, world.world_rank, m, n=2))
            got = tally(counted)
            plan = summarize(train.zero_info.calls)
            # the plan counts one read per parameter; AwkwardNet reads w2 twice, so stage 3 gathers it
            # (and reduce-scatters its gradient) once more per micro-step
            extra = []
            if stage == 3:
                w2 = dataclasses.replace(train.zero_info.plan["w2"], dtype=param_dtype or "float32")
                extra = 2 * (all_gather_calls([w2], world, "forward") + reduce_scatter_calls([w2], world, "backward"))
            extra = summarize(extra)
            key = f"{stage}-{'fused' if fused else 'plain'}{'-fp16' if param_dtype else ''}{'-persist' if keep else ''}"
            results[key] = dict(
                counted=got, plan={op: {k: plan[op][k] + extra[op][k] for k in ("calls", "bytes")} for op in got})
    (out_dir / "collective_counts.json").write_text(json.dumps(results, indent=1))


def count_unit_gathers(world, out_dir):
    """Graph mode: the collectives of one compiled TinyGPT step counted in the executed graph MindSpore saves
    (``save_graphs``), next to the plan's: stage 3 with and without ``gather_units="block"`` (one unit of the
    block's 12 parameters), and stage 1 (its write-back gathers, and how often the graph touches the update's
    chain, ``zero_collective_order``: never without owner mode); stages 1 and 2 with ``update_sharding="owner"``
    (every update collective and every write of the chain)."""
    import re
    import tempfile

    from mindzero.core.comm_plan import summarize
    from mindzero.engine.report import plan_text
    from tests.support.graphs import last_graph, saved_graphs

    results = {}
    variants = (("per_parameter", 3, None, "auto"), ("units", 3, "block", "auto"), ("stage1", 1, None, "auto"),
                ("owner1", 1, None, "owner"), ("owner2", 2, None, "owner"))
    for variant, stage, units, sharding in variants:
        # only the graphs of passes named "execute" (45 files instead of 564; a first step 14 s -> 7 s)
        with tempfile.TemporaryDirectory(dir=out_dir) as ir:
            with saved_graphs(ir, "execute"):
                net = build("gpt")
                # every parameter sharded (threshold 0), so that the block's unit holds all 12
                train = mindzero.prepare_train_network(net, make_optimizer("sgd", net), zero_stage=stage,
                                                       gather_units=units, stage3_param_persistence_threshold=0,
                                                       update_sharding=sharding)
                train(*batch(type(net), 0, world.world_rank, 0))
            text = last_graph(ir, "execute")
        sizes = re.findall(r"= AllGather\(.*\n.*?: \(<Tensor\[Float32\], \((\d+)\)>\) ->", text)
        plan = summarize(train.zero_info.calls)
        results[variant] = dict(all_gather=len(re.findall(r"= AllGather\(", text)), gather_sizes=[int(x) for x in sizes],
                                all_reduce=len(re.findall(r"= AllReduce\(", text)),
                                chain=len(re.findall(r"zero_collective_order", text)),
                                broadcast=len(re.findall(r"= Broadcast\(", text)),
                                chain_writes=len(re.findall(r"= (?:PrimFunc_)?Assign\(%para\d+_zero_collective_order",
                                                            text)),
                                plan={op: plan[op]["calls"] for op in ("all_gather", "all_reduce", "broadcast")},
                                plan_gather_bytes=sorted({c.nbytes for c in train.zero_info.calls
                                                          if c.op == "all_gather"}),
                                units=[list(u) for u in train.zero_info.units],
                                unit_shard=sum(s.shard_size for s in train.zero_info.plan if s.name.startswith("block.")),
                                verbose=plan_text(train))
    (out_dir / "unit_gathers.json").write_text(json.dumps(results, indent=1))


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


def check_released(world, out_dir):
    """Every supported optimizer, built eagerly and under lazy_init, prepared at stages 1 and 3 on this world:
    what stays alive of the Parameters held before (:func:`tests.support.release.released`)."""
    from tests.support.release import RELEASE_OPTIMIZERS, released

    result = {f"{kind}/{'lazy' if lazy else 'eager'}/{stage}": released(kind, lazy, stage)
              for kind in RELEASE_OPTIMIZERS for lazy in (False, True) for stage in (1, 3)}
    (out_dir / "released.json").write_text(json.dumps(result, indent=1))


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


def check_device_mismatch(world, out_dir):
    """Ranks on different devices, or on different collective backends, are refused at prepare on every rank, naming
    every rank's: the last rank reports another device (its ``device_target`` read as ``"GPU"``), then runs the
    test-only substitute (the GPU/Ascend code) while the others run CPU's."""
    import unittest.mock

    import mindspore as ms

    last = world.world_rank == world.world_size - 1
    real = ms.get_context
    as_gpu = lambda key: "GPU" if key == "device_target" else real(key)  # noqa: E731
    messages = {}
    for what, context in (("device", unittest.mock.patch.object(ms, "get_context", as_gpu)),
                          ("backend", substitute_collectives())):
        net = build("awkward")
        try:
            with context if last else contextlib.nullcontext():
                mindzero.prepare_train_network(net, nn.Adam(net.trainable_params()), zero_stage=2)
            messages[what] = ""
        except ValueError as err:
            messages[what] = str(err)
    (out_dir / "device_mismatch.json").write_text(json.dumps(messages))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated names of the scenarios to run (default: all); with it "
                    "the launch checks only the collectives and the plan mismatch (what test_launch.py reads), not "
                    "the release, the collective counts and the compiled graphs")
    add_worker_flag(ap)
    worker = start(ap)
    world, out_dir = worker.world, worker.rank_dir
    check_collectives(world, out_dir)
    check_plan_mismatch(world, out_dir)
    check_device_mismatch(world, out_dir)
    if not worker.args.only:
        checks = [count_collectives, count_unit_gathers]
        if worker.args.full_tier:  # the default suite: tests/single/test_optimizers.py, rank 0 of 2 rehearsed
            checks.insert(0, check_released)
        for check in checks:
            t = time.time()
            check(world, out_dir)
            print(f"{check.__name__}: {time.time() - t:.1f}s", flush=True)
    memory = {}
    for scn in parity_scenarios(world.world_size, worker.args.full_tier):
        if worker.args.only and scn.name not in worker.args.only.split(","):
            continue
        t = time.time()
        result = run(scn, world)
        np.savez(out_dir / f"{scn.name}.npz", **result.arrays)
        if result.memory is not None:
            memory[scn.name] = result.memory
        print(f"scenario {scn.name}: {time.time() - t:.1f}s", flush=True)
    (out_dir / "memory.json").write_text(json.dumps(memory, indent=1))
    worker.finish()


if __name__ == "__main__":
    sys.exit(main())
