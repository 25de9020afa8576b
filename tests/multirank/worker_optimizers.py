"""One msrun launch: every optimizer of the table (tests/support/optimizers.py) trained by plain data parallel and
by mindzero at stages 1-3; the network contract of stages 0-2 (the user's Parameters, MindSpore's own
save_checkpoint / load_checkpoint on the network); optimizers that differ across ranks refused.

Each rank writes ``<out>/rank_<r>/<case>-<stage>.npz`` (losses, final full parameters, each parameter's mode and
owner), ``contract.json``, ``mismatch.json``, and ``<out>/rank_<r>.done``.
"""
import argparse
import contextlib
import json
import sys

import numpy as np
import mindspore as ms
from mindspore import nn, ops

import mindzero
from tests.support.optimizers import BY_NAME, CASES, OptNet, build, stages_for
from tests.support.tier import add_worker_flag
from tests.support.worker import ReferenceStep, plain_data_parallel, settle, start, without_parallel_context

STEPS = 4


def context_of(stage):
    """Plain data parallel under MindSpore's DATA_PARALLEL context (what ``nn.TrainOneStepCell`` reduces by); mindzero
    with the context unset, checked."""
    if stage == "dp":
        return plain_data_parallel()
    without_parallel_context()
    return contextlib.nullcontext()


def train(case, stage, world, steps=STEPS, lazy=False):
    """``case``'s optimizer on OptNet: plain data parallel (``stage="dp"``) or mindzero at ``stage`` (``lazy``: the
    network and optimizer built under ``mindzero.lazy_init``)."""
    with context_of(stage):
        return _train(case, stage, world, steps, lazy)


def _train(case, stage, world, steps, lazy):
    settle()
    with mindzero.lazy_init() if lazy else contextlib.nullcontext():
        net = build()
        opt = case.make(net.trainable_params())
    if stage == "dp":
        net.set_train()
        step = ReferenceStep(net, opt) if case.torch_style else nn.TrainOneStepCell(net, opt)
    else:
        step = mindzero.prepare_train_network(net, opt, zero_stage=stage, **dict(case.options))
    losses, k = [], case.accumulation
    for s in range(steps):
        if k == 1:
            out = step(*OptNet.batch(s, world.world_rank))
            losses.append(float((out if stage == "dp" else out[0]).asnumpy()))
            continue
        micro = [OptNet.batch(k * s + m, world.world_rank, n=2) for m in range(k)]
        if stage == "dp":  # one update on the micro-batches concatenated
            out = step(*(ops.concat(list(t)) for t in zip(*micro)))
            losses.append(float(out.asnumpy()))
        else:  # the mean of the micro-batches' losses: the concatenated batch's loss
            losses.append(float(np.mean([step(*inputs)[0].asnumpy() for inputs in micro])))
    if stage == "dp":
        params = {p.name: p.asnumpy() for p in net.trainable_params()}
        return dict(losses=np.array(losses), **{"param/" + k: v for k, v in params.items()})
    info = step.zero_info
    params = mindzero.gather_full_state_dict(step)
    if case.mixed:
        params.update({name + "@master": v for name, v in mindzero.gather_full_state_dict(step, masters=True).items()})
    report = mindzero.memory_report(step)
    modes = {ps.name: ps.update.mode for ps in info.params}
    owners = {ps.name: -1 if ps.update.owner is None else ps.update.owner for ps in info.params}
    return dict(losses=np.array(losses), **{"param/" + k: v for k, v in params.items()},
                **{"mode/" + k: np.array(v) for k, v in modes.items()}, **{"owner/" + k: np.array(v) for k, v in owners.items()},
                owned=np.array(report["owned"]), moments=np.array(report["optimizer_moments"]),
                masters=np.array(report["master_shards"]), expected_masters=np.array(report["expected"]["master_shards"]),
                expected_moments=np.array(report["expected"]["optimizer_moments"]),
                balance=np.array(report["balance"]["per_rank"], np.float64))


def contract(world, out_dir):
    """Stages 0-2 keep the user's network: the same Parameter objects (names, shapes); MindSpore's own
    ``save_checkpoint`` of the network writes plain data parallel's values; ``load_checkpoint`` into the network
    (the initial weights, after two steps) then trains on exactly as plain data parallel does. Stage 3 (shards by
    design) takes the same weights with ``mindzero.load_pretrained`` and trains on as plain data parallel."""
    from tests.support.optimizers import BY_NAME

    result = {}
    first = out_dir / "initial.ckpt"
    for kind in ("nn.AdamWeightDecay", "mindone.CAME"):
        case = BY_NAME[kind]
        for stage in ("dp", 0, 1, 2, 3):
            with context_of(stage):
                settle()
                net = build()
                before = [(id(p), p.name, tuple(p.shape)) for p in net.trainable_params()]
                if stage == "dp" and kind == "nn.AdamWeightDecay":
                    ms.save_checkpoint(net, str(first))  # the weights a fine-tuning loads
                opt = case.make(net.trainable_params())
                step = nn.TrainOneStepCell(net, opt) if stage == "dp" else \
                    mindzero.prepare_train_network(net, opt, zero_stage=stage)
                step.set_train()
                after = [(id(p), p.name, tuple(p.shape)) for p in net.trainable_params()]
                losses = []
                for s in range(2):
                    out = step(*OptNet.batch(s, world.world_rank))
                    losses.append(float((out if stage == "dp" else out[0]).asnumpy()))
                if stage == 3:
                    file = {k: v.tolist() for k, v in mindzero.gather_full_state_dict(step).items()}
                    mindzero.load_pretrained(step, str(first))
                else:
                    saved = out_dir / f"network-{kind}-{stage}.ckpt"
                    ms.save_checkpoint(step.network if stage != "dp" else net, str(saved))
                    ms.load_checkpoint(str(first), net=step.network if stage != "dp" else net)  # start again from them
                    file = {k: v.asnumpy().tolist() for k, v in ms.load_checkpoint(str(saved)).items()}
                for s in range(2, 5):
                    out = step(*OptNet.batch(s, world.world_rank))
                    losses.append(float((out if stage == "dp" else out[0]).asnumpy()))
                final = mindzero.gather_full_state_dict(step) if stage == 3 else \
                    {p.name: p.asnumpy() for p in net.trainable_params()}
                result[f"{kind}/{stage}"] = dict(same_objects=before == after and after == [
                    (id(p), p.name, tuple(p.shape)) for p in net.trainable_params()], losses=losses, saved=file,
                    final={k: v.tolist() for k, v in final.items()})
    (out_dir / "contract.json").write_text(json.dumps(result))


def mismatch(world, out_dir):
    """The last rank builds its optimizer with another learning rate, then of another class: prepare fails on every
    rank, naming the rank and both values."""
    last = world.world_rank == world.world_size - 1
    result = {}
    for what, make in (("lr", lambda ps: nn.AdamWeightDecay(ps, 2e-2 if last else 1e-2)),
                       ("class", lambda ps: (nn.Adam if last else nn.AdamWeightDecay)(ps, 1e-2))):
        settle()
        net = build()
        try:
            mindzero.prepare_train_network(net, make(net.trainable_params()), zero_stage=2)
            result[what] = ""
        except ValueError as err:
            result[what] = str(err)
    (out_dir / "mismatch.json").write_text(json.dumps(result))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    add_worker_flag(ap)
    worker = start(ap)
    world, out_dir = worker.world, worker.rank_dir
    mismatch(world, out_dir)
    contract(world, out_dir)
    for case in CASES:
        if worker.args.only and case.name not in worker.args.only.split(","):
            continue
        if case.full_only and not worker.args.full_tier:
            continue
        for stage in (case.reference, *stages_for(case, worker.args.full_tier)):
            np.savez(out_dir / f"{case.name}-{stage}.npz", **train(case, stage, world))
        print(f"optimizer {case.name}: done", flush=True)
    # owner mode under lazy_init: the network and optimizer built unmaterialised, each rank keeping its shards and
    # the states it owns (tests/multirank/test_sharded_init.py does this for flat optimizers)
    np.savez(out_dir / "mindone.CAME-lazy-3.npz", **train(BY_NAME["mindone.CAME"], 3, world, lazy=True))
    worker.finish()


if __name__ == "__main__":
    sys.exit(main())
