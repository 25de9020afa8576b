"""Hybrid sharding on 4 ranks, op groups of 2 (two replicas), in one launch.

Plain data parallel over the 4 ranks, then stages 0-3 sharded inside op groups of 2 (the settings key
``hybrid_shard_size: 2``, which makes the groups with ``create_hybrid_groups(2)``) on the same seeds and data
(:func:`tests.support.scenarios.hybrid_scenarios`); a hybrid checkpoint (saved, reloaded into a fresh hybrid
step); the group-layout errors. Files: ``<out>/rank_<r>/...``; ``test_hybrid.py`` checks.
"""
import argparse
import json
import sys
import time

import numpy as np
from mindspore import Tensor

import mindzero
from mindzero.comm import (AllGather, AllReduceSum, ReduceScatterSum, current_world, register_group,
                           substitute_collectives, world_for)
from mindzero.core.config import GroupPolicy
from tests.support.models import build, make_optimizer
from tests.support.scenarios import hybrid_scenarios
from tests.support.tier import add_worker_flag
from tests.support.worker import run, start


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
        world_for(GroupPolicy("mindzero_op2_0", None))
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
            mindzero.prepare_train_network(net, make_optimizer("adam", net), zero_stage=2,
                                           optimizer_parallel_group=names[0], dp_group=names[1])
            messages[case] = ""
        except ValueError as err:
            messages[case] = str(err)
    (out_dir / "layout_errors.json").write_text(json.dumps(messages, indent=1))


def check_checkpoint(train, out_root, out_dir):
    """Save the hybrid train step ``train``, reload it into a fresh one, and keep both states."""
    ckpt = out_root / "ckpt_hybrid"
    mindzero.save_checkpoint(train, ckpt, step=10)
    saved = mindzero.gather_full_state_dict(train)
    net = build("mixed", seed=5)  # other initial values: the load must overwrite them
    # from a settings mapping: hybrid_shard_size stands for the groups (the load fails if they were not made)
    fresh = mindzero.prepare_train_network(net, make_optimizer("adamw_groups", net),
                                           config={"zero_stage": 3, "hybrid_shard_size": 2})
    assert (fresh.zero_info.world.op_size, fresh.zero_info.world.dp_size) == (2, 2), fresh.zero_info.world
    mindzero.load_checkpoint(fresh, ckpt)
    loaded = mindzero.gather_full_state_dict(fresh)
    # resume anywhere: the hybrid (2-way sharded) checkpoint straight into plain 4-way stage 1, saved again
    net = build("mixed", seed=6)
    plain = mindzero.prepare_train_network(net, make_optimizer("adamw_groups", net), zero_stage=1)
    mindzero.load_checkpoint(plain, ckpt)
    into_plain = mindzero.gather_full_state_dict(plain)
    mindzero.save_checkpoint(plain, out_root / "ckpt_hybrid_into_plain", step=10)
    np.savez(out_dir / "ckpt_state.npz", **{"saved/" + k: v for k, v in saved.items()},
             **{"loaded/" + k: v for k, v in loaded.items()}, **{"plain/" + k: v for k, v in into_plain.items()})


def main():
    ap = argparse.ArgumentParser()
    add_worker_flag(ap)
    worker = start(ap)
    out_root, out_dir = worker.out, worker.rank_dir
    groups = mindzero.create_hybrid_groups(op_size=2)
    world = world_for(GroupPolicy(*groups))
    check_collectives(world, out_dir)
    with substitute_collectives():
        check_collectives(world_for(GroupPolicy(*groups)), out_dir, "collectives_substitute.json")
    memory = {}
    for scn in hybrid_scenarios(worker.args.full_tier):
        t = time.time()
        result = run(scn, worker.world)
        np.savez(out_dir / f"{scn.name}.npz", **result.arrays)
        if result.memory is not None:
            memory[scn.name] = result.memory
        print(f"scenario {scn.name}: {time.time() - t:.1f}s", flush=True)
        if scn.name == "mixed-h3":
            check_checkpoint(result.train, out_root, out_dir)
        del result
    (out_dir / "memory.json").write_text(json.dumps(memory, indent=1))
    check_layout_errors(world, out_dir)
    worker.finish()


if __name__ == "__main__":
    sys.exit(main())
