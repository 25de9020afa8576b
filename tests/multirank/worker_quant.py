"""One msrun launch of stage 3's quantized weight gathers and 16-bit gradient reduction (``test_quant.py``).

Each rank writes ``<out>/rank_<r>/<scenario>.npz`` (losses, final full parameters as
``gather_full_state_dict`` returns them, and ``raw/<name>``: the shards all-gathered exactly, unpadded),
``gathered_<scenario>.npz`` (what each sharded parameter's stage-3 read returns: ``got/<name>``, and numpy's
``dequant(quant(shard))`` of every rank's shard: ``twin/<name>``), rank 0 ``merged_<scenario>.npz`` (the run's
checkpoint merged offline) and ``collective_counts.json`` (PyNative: bytes and calls counted at the
primitives against the plan).
"""
import argparse
import json
import sys
import time

import numpy as np
import mindspore as ms
from mindspore import nn, ops

import mindzero
from mindzero.core import quant as Q
from mindzero.engine.stage3 import GATHER_PREFIX, SHARD_SUFFIX
from tests.support.data import batch
from tests.support.models import build, make_optimizer
from tests.support.scenarios import FULL, Scenario, in_tier
from tests.support.tier import add_worker_flag
from tests.support.worker import counting_collectives, run, start, tally

STEPS = 20
#: quantize every 2-D parameter of the small test models (their matrices are far below the default min_numel)
QUANT = {"kind": "int8", "block_size": 16, "min_numel": 0}
FP16_REDUCE = {"reduce_dtype": "float16", "scale_sense": 1024.0}


def scenarios(full_tier: bool = True) -> list:
    """The launch's runs (without ``full_tier``, the default suite's: int8 gathers with fp16 reduction, whose two
    parts run alone in gpt-s3-int8 and gpt-s3-fp16red, in the full tier)."""
    return in_tier([
        Scenario("gpt-dp", "gpt", "sgd", "dp", steps=STEPS),
        Scenario("gpt-s3", "gpt", "sgd", 3, steps=STEPS),
        Scenario("gpt-s3-int8", "gpt", "sgd", 3, {"gather_quantization": QUANT}, steps=STEPS),
        Scenario("gpt-s3-int8-sub", "gpt", "sgd", 3, {"gather_quantization": QUANT}, steps=STEPS, substitute=True),
        Scenario("gpt-s3-fp16red", "gpt", "sgd", 3, dict(FP16_REDUCE), steps=STEPS),
        Scenario("gpt-s3-int8-fp16red", "gpt", "sgd", 3, {"gather_quantization": QUANT, **FP16_REDUCE}, steps=STEPS,
                 tier=FULL),
        Scenario("gpt-s0-fp16red", "gpt", "sgd", 0, dict(FP16_REDUCE), steps=STEPS),
        Scenario("lora-s3", "lora", "adamw", 3, steps=STEPS),
        Scenario("lora-s3-int8", "lora", "adamw", 3, {"gather_quantization": QUANT}, steps=STEPS),
    ], full_tier)


class _Read(nn.Cell):
    """What the stage-3 property returns for one parameter (its gather's ``rebuild`` of its shard)."""

    def __init__(self, cell, attr):
        super().__init__(auto_prefix=False)  # the shards keep their names
        self.g = getattr(cell, GATHER_PREFIX + attr)
        self.s = getattr(cell, attr + SHARD_SUFFIX)

    def construct(self):
        return self.g.rebuild(self.s)


class _Reads(nn.Cell):
    """Every :class:`_Read` in one graph (one compile for the whole network, not one per parameter)."""

    def __init__(self, reads):
        super().__init__(auto_prefix=False)
        self.reads = nn.CellList(reads, auto_prefix=False)  # (a prefix would rename the shards)

    def construct(self):
        out = ()
        for read in self.reads:
            out = out + (read(),)
        return out


def gathered_reads(train, world) -> dict:
    """Each sharded parameter read as the network reads it, next to the numpy twin of every rank's shard."""
    all_gather = ops.AllGather()
    out, seen, reads = {}, set(), []
    for _, cell in train.network.cells_and_names():
        for attr in getattr(type(cell), "_mindzero_sharded", ()):
            shard = getattr(cell, attr + SHARD_SUFFIX)
            if shard.name not in seen:
                seen.add(shard.name)
                reads.append((shard, getattr(cell, GATHER_PREFIX + attr), _Read(cell, attr)))
    got_all = _Reads([read for _, _, read in reads])()
    for (shard, gather, _), got in zip(reads, got_all):
        got = got.asnumpy()
        shards = list(all_gather(shard.value()).asnumpy().reshape(world.world_size, -1))
        full = Q.gathered(shards, gather.qgather.block) if gather.quantized else np.concatenate(shards)
        out["got/" + shard.name] = got
        out["twin/" + shard.name] = full[:got.size].reshape(got.shape).astype(got.dtype)
        out["quantized/" + shard.name] = np.array(bool(gather.quantized))
    return out


def raw_shards(train, world) -> dict:
    """Every sharded parameter's shards (trainable and frozen) all-gathered exactly (unpadded, full shape): what
    the ranks store."""
    all_gather = ops.AllGather()
    held = {p.name: p for p in train.network.get_parameters()}  # a shard keeps its parameter's name
    out = {}
    for spec in train.zero_info.plan:
        if spec.sharded:
            flat = all_gather(held[spec.name].value()).asnumpy().reshape(-1)[:spec.numel]
            out["raw/" + spec.name] = flat.reshape(spec.shape)
    return out


def count_collectives(world, out_dir):
    """PyNative: calls and bytes of one step of a quantized stage 3 (PlainMLP: each parameter read once),
    counted at MindSpore's collective primitives, next to the plan's ``step_calls``."""
    from mindzero.core.comm_plan import summarize

    results = {}
    with counting_collectives() as counted:
        for name, quant in (("exact", None), ("int8", QUANT)):
            net = build("mlp")
            train = mindzero.prepare_train_network(net, make_optimizer("adam", net), zero_stage=3,
                                                   gather_quantization=quant)
            counted.clear()
            train(*batch(type(net), 0, world.world_rank))
            got = tally(counted)
            plan = summarize(train.zero_info.calls)
            results[name] = dict(counted=got, plan={op: {k: plan[op][k] for k in ("calls", "bytes")} for op in got})
    (out_dir / "collective_counts.json").write_text(json.dumps(results, indent=1))


def main():
    ap = argparse.ArgumentParser()
    add_worker_flag(ap)
    worker = start(ap)
    world, out_dir = worker.world, worker.rank_dir
    count_collectives(world, out_dir)
    for scn in scenarios(worker.args.full_tier):
        t = time.time()
        result = run(scn, world)
        arrays = dict(result.arrays)
        if scn.stage == 3:
            arrays.update(raw_shards(result.train, world))
            np.savez(out_dir / f"gathered_{scn.name}.npz", **gathered_reads(result.train, world))
        if scn.name in ("gpt-s3-int8", "lora-s3-int8"):
            ckpt = out_dir.parent / f"ckpt_{scn.name}"
            mindzero.save_checkpoint(result.train, ckpt)
            if world.world_rank == 0:
                merged = out_dir / f"merged_{scn.name}.ckpt"
                mindzero.merge_checkpoint(ckpt, merged, log=None)
                np.savez(out_dir / f"merged_{scn.name}.npz",
                         **{k: v.asnumpy() for k, v in ms.load_checkpoint(str(merged)).items()})
        np.savez(out_dir / f"{scn.name}.npz", **arrays)
        print(f"scenario {scn.name}: {time.time() - t:.1f}s", flush=True)
    worker.finish()


if __name__ == "__main__":
    sys.exit(main())
