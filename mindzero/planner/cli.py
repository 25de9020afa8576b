"""``mindzero-plan``: the planner from the command line (:func:`mindzero.planner.planner.plan`)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..core.fit import GIB
from .planner import DEFAULT_MARGIN, Rehearsal, plan


def _parse_sample(text: str) -> list:
    """``"2x64:int32,2x64:int32"`` -> ``[((2, 64), "int32"), ...]``."""
    out = []
    for part in text.split(","):
        shape, _, dtype = part.strip().partition(":")
        try:
            dims = tuple(int(d) for d in shape.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--sample {text!r}: expected shapes such as 2x64:int32,2x3x224x224:float32")
        out.append((dims, dtype or "float32"))
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="mindzero-plan", description="Will it fit? Predict each rank's peak memory "
                                 "for ZeRO configurations of your network and recommend the one to use.")
    ap.add_argument("factory", help="module:function returning (net_with_loss, optimizer)")
    ap.add_argument("--sample", required=True, type=_parse_sample,
                    help="one micro-batch's inputs per rank, e.g. 2x64:int32,2x64:int32 (dimension 0: the batch)")
    ap.add_argument("--world-size", type=int, required=True, help="ranks of the launch")
    ap.add_argument("--budget", required=True, help="memory per rank above the framework, e.g. 5GiB")
    ap.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                    help="a configuration fits when its prediction times 1 + margin is within the budget "
                    "(default %(default)s: above the largest error against real launches)")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--param-dtype", choices=["float16", "bfloat16"], help="also weigh mixed precision")
    ap.add_argument("--recompute", action="store_true", help="also weigh recomputing each repeated block")
    ap.add_argument("--global-batch", type=int, help="samples per rank per optimizer step: weigh gradient accumulation")
    ap.add_argument("--no-quantization", action="store_true", help="do not weigh int8 gathers")
    ap.add_argument("--depths", default="1,2", help="block counts of the two rehearsed replicas")
    ap.add_argument("--jobs", type=int, default=2, help="rehearsals at once")
    ap.add_argument("--factory-kwargs", type=json.loads, default={}, help='the factory\'s keyword arguments as JSON, '
                    'e.g. \'{"layers": 24}\'')
    ap.add_argument("--json", help="also write the predictions to this file")
    a = ap.parse_args(argv)
    started = time.time()
    try:
        rehearsal = Rehearsal(tuple(int(d) for d in a.depths.split(",")), a.jobs,
                              progress=lambda m: print(m, flush=True), factory_kwargs=a.factory_kwargs)
        result = plan(a.factory, a.sample, a.world_size, a.budget, margin=a.margin, rehearsal=rehearsal,
                      stages=tuple(int(s) for s in a.stages.split(",")), param_dtype=a.param_dtype,
                      recompute=a.recompute, global_batch=a.global_batch, quantization=not a.no_quantization)
    except ValueError as err:
        print(f"mindzero-plan: {err}", file=sys.stderr)
        return 2
    net = result["network"]
    print(f"\n{net['factory']}: {net['blocks'] or 'no'} repeated blocks ({net['block_list']}), {a.world_size} ranks, "
          f"micro-batch {net['batch']}, budget {result['budget'] / GIB:.2f} GiB per rank ({result['usable'] / GIB:.2f} "
          f"GiB with the {result['margin']:.0%} margin) "
          f"(calibrated in {time.time() - started:.0f} s)")
    opt = net["optimizer"]
    owned = (f", {opt['owner']} updated whole on an owner rank (the most loaded holds {opt['balance']:.2f}x the even "
             "share of optimizer states)") if opt["owner"] else ""
    print(f"optimizer {opt['name']} at stages 1-3: {opt['flat']} parameters sharded flat{owned}\n")
    print(result["table"])
    if result["largest_depth"]:
        print("\nlargest depth within the budget (blocks of this width):")
        for k, v in result["largest_depth"].items():
            print(f"  {k}: {v['blocks']} blocks, {v['parameters'] / 1e9:.3f}B parameters")
    print(f"\nrecommended: {result['best'].label}: {result['reason']}")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(network=net, budget=result["budget"], reason=result["reason"],
                                                best=result["best"].label,
                                                predictions=[p.as_dict() for p in result["predictions"]],
                                                largest_depth=result["largest_depth"]), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
