"""Hybrid sharding on 4 ranks, op groups of 2 (two replicas), in one launch.

Plain data parallel over the 4 ranks, then stages 0-3 sharded inside ``create_hybrid_groups(2)``
on the same seeds and data (``worker_parity.run``); a hybrid checkpoint (saved, reloaded into a
fresh hybrid step); the group-layout errors. Files: ``<out>/rank_<r>/...``; ``test_hybrid.py`` checks.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from mindspore import Tensor, nn

import mindzero
from mindzero.comm import (AllGather, AllReduceSum, ReduceScatterSum, current_world, register_group, resolve_world,
                           substitute_collectives)
from mindzero import start_data_parallel
from models import build
from worker_parity import make_optimizer, run


def scenarios():
    out = []
    for model, opt in [("mixed", "adamw_groups"), ("awkward", "adam"), ("gpt", "sgd"), ("resnet", "momentum")]:
        out.append(dict(name=f"{model}-dp", model=model, opt=opt, stage="dp"))
        for stage in (0, 1, 2, 3):
            out.append(dict(name=f"{model}-h{stage}", model=model, opt=opt, stage=stage, hybrid=True))
    for stage in (1, 2, 3):
        out.append(dict(name=f"clip-h{stage}", model="mixed", opt="adamw_groups", stage=stage, clip=True,
                        clip_norm=0.05, hybrid=True))
    out.append(dict(name="overflow-dp0", model="mixed", opt="adamw_groups", stage=0, dynamic_scale=True))
    for stage in (1, 2, 3):
        out.append(dict(name=f"overflow-h{stage}", model="mixed", opt="adamw_groups", stage=stage,
                        dynamic_scale=True, hybrid=True))
    out.append(dict(name="clip-dp0", model="mixed", opt="adamw_groups", stage=0, clip=True, clip_norm=0.05))
    out.append(dict(name="accum-dp", model="awkward", opt="adam", stage="dp", accum=4))
    for stage in (2, 3):
        out.append(dict(name=f"accum-h{stage}", model="awkward", opt="adam", stage=stage, accum=4, hybrid=True))
    out.append(dict(name="mp-flat0", model="gpt", opt="sgd", stage=0, param_dtype="float16", dynamic_scale=True,
                    force_overflow=False))
    for stage in (3,):  # param_dtype=float16 inside the op groups
        out.append(dict(name=f"mp-h{stage}", model="gpt", opt="sgd", stage=stage, param_dtype="float16",
                        dynamic_scale=True, force_overflow=False, hybrid=True))
    for stage in (1, 2, 3):  # the GPU/Ascend path: op-group ReduceScatter + dp-group AllReduce, CPU-legal
        for fused in (False, True):
            out.append(dict(name=f"real-{'fused-' if fused else ''}h{stage}", model="mixed", opt="adamw_groups",
                            stage=stage, clip=True, clip_norm=0.05, fusion=fused, hybrid=True, substitute=True))
    return out


def check_collectives(world, out_dir, name="collectives.json"):
    """Group collectives (emulated on CPU) against numpy: op-group all-gather and sum, world sum."""
    n, g, r = world.world_size, world.op_size, world.world_rank
    x = np.full(3, r + 1, np.float32)
    ag = AllGather(world)(Tensor(x)).asnumpy()
    op_sum = AllReduceSum(world, "op")(Tensor(x)).asnumpy()
    world_sum = AllReduceSum(world, "world")(Tensor(x)).asnumpy()
    # the sum over the world of a (numel,) tensor padded by 1, this rank's shard of the op group
    y = np.arange(5, dtype=np.float32) * (r + 1)
    rs = ReduceScatterSum(world)(Tensor(y), 1).asnumpy()
    expect_rs = np.concatenate([np.arange(5, dtype=np.float32) * (n * (n + 1) / 2), [0]]).reshape(g, -1)[world.op_rank]
    members = list(world.op_ranks)
    result = dict(all_gather_ok=bool(np.array_equal(ag, np.repeat(np.array(members, np.float32) + 1, 3))),
                  op_sum_ok=bool(np.array_equal(op_sum, np.full(3, sum(m + 1 for m in members), np.float32))),
                  world_sum_ok=bool(np.array_equal(world_sum, np.full(3, n * (n + 1) / 2, np.float32))),
                  reduce_scatter_ok=bool(np.array_equal(rs, expect_rs)), emulated=world.emulated,
                  layout=dict(op_size=g, op_rank=world.op_rank, dp_size=world.dp_size, dp_rank=world.dp_rank,
                              members=members))
    (out_dir / name).write_text(json.dumps(result))


# per world rank: (op group, dp group) each rank claims, for each broken layout
BAD_LAYOUTS = {
    "overlapping": [((0, 1), (0, 2)), ((0, 1), (1, 3)), ((2, 3), (0, 2)), ((1, 3), (1, 3))],
    "not_dividing": [((0, 1, 2), (0, 3)), ((0, 1, 2), (1,)), ((0, 1, 2), (2,)), ((3,), (0, 3))],
    "one_rank_flat": [((0, 1), (0, 2)), ((0, 1), (1, 3)), ((2, 3), (0, 2)), None],
}


def check_layout_errors(world, out_dir):
    messages = {}
    flat = current_world()
    try:
        resolve_world("mindzero_op2_0", None)
        messages["no_dp_group"] = ""
    except ValueError as err:
        messages["no_dp_group"] = str(err)
    for case, claims in BAD_LAYOUTS.items():
        claim = claims[flat.world_rank]
        names = (None, None)
        if claim is not None:
            names = (f"{case}_op_{flat.world_rank}", f"{case}_dp_{flat.world_rank}")
            register_group(names[0], claim[0])
            register_group(names[1], claim[1])
        try:
            net = build("mixed")
            mindzero.prepare_train_network(net, nn.Adam(net.trainable_params()), zero_stage=2,
                                           optimizer_parallel_group=names[0], dp_group=names[1])
            messages[case] = ""
        except ValueError as err:
            messages[case] = str(err)
    (out_dir / "layout_errors.json").write_text(json.dumps(messages, indent=1))


def check_checkpoint(out_root, out_dir):
    """Save the last hybrid train step, reload it into a fresh one, and keep both states."""
    train = run.last_train
    ckpt = out_root / "ckpt_hybrid"
    mindzero.save_checkpoint(train, ckpt, step=10)
    saved = mindzero.gather_full_state_dict(train)
    scn = dict(name="ckpt", model="mixed", opt="adamw_groups", stage=3, hybrid=True)
    net = build(scn["model"], seed=5)  # other initial values: the load must overwrite them
    # from a settings mapping: hybrid_shard_size stands for the groups (the load fails if they were not made)
    fresh = mindzero.prepare_train_network(net, make_optimizer(scn["opt"], net),
                                           config={"zero_stage": 3, "hybrid_shard_size": 2})
    assert (fresh.zero_info.world.op_size, fresh.zero_info.world.dp_size) == (2, 2), fresh.zero_info.world
    mindzero.load_checkpoint(fresh, ckpt)
    loaded = mindzero.gather_full_state_dict(fresh)
    # resume anywhere: the hybrid (2-way sharded) checkpoint straight into plain 4-way stage 1, saved again
    net = build(scn["model"], seed=6)
    plain = mindzero.prepare_train_network(net, make_optimizer(scn["opt"], net), zero_stage=1)
    mindzero.load_checkpoint(plain, ckpt)
    into_plain = mindzero.gather_full_state_dict(plain)
    mindzero.save_checkpoint(plain, out_root / "ckpt_hybrid_into_plain", step=10)
    np.savez(out_dir / "ckpt_state.npz", **{"saved/" + k: v for k, v in saved.items()},
             **{"loaded/" + k: v for k, v in loaded.items()}, **{"plain/" + k: v for k, v in into_plain.items()})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    flat = start_data_parallel()
    groups = mindzero.create_hybrid_groups(op_size=2)
    world = resolve_world(*groups)
    out_dir = Path(args.out) / f"rank_{flat.world_rank}"
    out_dir.mkdir(parents=True, exist_ok=True)
    check_collectives(world, out_dir)
    with substitute_collectives():
        check_collectives(resolve_world(*groups), out_dir, "collectives_substitute.json")
    memory = {}
    for scn in scenarios():
        t = time.time()
        arrays, mem = run(scn, flat, groups if scn.get("hybrid") else None)
        np.savez(out_dir / f"{scn['name']}.npz", **arrays)
        if mem is not None:
            memory[scn["name"]] = mem
        print(f"scenario {scn['name']}: {time.time() - t:.1f}s", flush=True)
        if scn["name"] == "mixed-h3":
            check_checkpoint(Path(args.out), out_dir)
    (out_dir / "memory.json").write_text(json.dumps(memory, indent=1))
    check_layout_errors(world, out_dir)
    (Path(args.out) / f"rank_{flat.world_rank}.done").write_text("ok")


if __name__ == "__main__":
    sys.exit(main())
