"""The tables of docs/parity.md from a parity launch's output (``worker_parity.py``: ``<out>/rank_<r>/<name>.npz``):
worst over ranks of the losses' and every final parameter's relative difference (``max|a - b| / max|b|``).

    python -m tests.support.parity_table OUT [OUT4]      # OUT: the 2-rank launch's directory, OUT4: the 4-rank one

(pytest keeps the launches' directories under its base temp directory, e.g. ``/tmp/pytest-of-$USER/pytest-N/
parity20``.) A comparison a launch did not run prints ``-``.
"""
import sys
from pathlib import Path

import numpy as np

from .compare import load_npz, rel_err
from .models import PARITY_MODELS
from .scenarios import AUTO_AMP_MODELS, OWNER_FEATURES


def comparisons() -> list:
    """``(label, scenario, reference)`` for every row of the tables."""
    rows = []
    for model in PARITY_MODELS:
        rows.append((f"{model} stage 0 vs DP", f"{model}-0", f"{model}-dp"))
        rows += [(f"{model} stage {s} vs stage 0", f"{model}-{s}", f"{model}-0") for s in (1, 2, 3)]
    for kind in ("clip", "overflow", "ema", "fused"):
        rows += [(f"{kind} stage {s} vs stage 0", f"{kind}-{s}", f"{kind}-0") for s in (1, 2, 3)]
    rows += [(f"accum K=4 stage {s} vs DP batch 8", f"accum-{s}", "accum-dp") for s in (0, 1, 2, 3)]
    for model in ("mixed", "gpt", "resnet", "lora"):
        rows += [(f"fp16 {model} stage {s} vs stage 0", f"mp-{model}-{s}", f"mp-{model}-0") for s in (1, 2, 3)]
    rows += [(f"fp16 accum K=4 + clip + EMA stage {s} vs 0", f"mp-accum-{s}", "mp-accum-0") for s in (1, 2, 3)]
    for model, _ in AUTO_AMP_MODELS:  # param_dtype on a float32 network mindzero converts
        rows += [(f"fp16 (converted by mindzero) {model} stage {s} vs stage 0", f"auto-{model}-{s}", f"auto-{model}-0")
                 for s in (1, 2, 3)]
        rows.append((f"fp16 (converted by mindzero) {model} stage 0 vs fp32, 20 steps: losses", f"auto-{model}-0",
                     f"auto32-{model}-0"))
    rows.append(("fp16, backbone converted by the user, mlp stage 3 vs 0", "partial-mlp-3", "partial-mlp-0"))
    rows.append(("owner mode (CAME) stage 0 vs DP", "came-0", "came-dp"))
    for name in OWNER_FEATURES:  # mindone's CAME: every sharded parameter updated whole on its owner rank
        rows += [(f"owner mode ({name}) stage {s} vs stage 0", f"{name}-{s}", f"{name}-0") for s in (1, 2, 3)]
    return rows


def worst(out: Path, name: str, ref: str):
    """(loss, params) worst over the ranks, or None if the launch did not run both."""
    ranks = sorted(p for p in out.glob("rank_*") if p.is_dir())
    if not ranks or not all((r / f"{n}.npz").exists() for r in ranks for n in (name, ref)):
        return None
    loss = params = 0.0
    for r in ranks:
        got, want = load_npz(r / f"{name}.npz"), load_npz(r / f"{ref}.npz")
        if len(got["losses"]) != len(want["losses"]):  # K micro-batches against one concatenated batch (DP)
            got = dict(got, losses=got["losses"].reshape(len(want["losses"]), -1).mean(axis=1))
        if len(got["losses"]) != len(want["losses"]):
            raise ValueError(f"{name} and {ref} ran a different number of steps")
        finite = np.isfinite(want["losses"])
        loss = max(loss, rel_err(got["losses"][finite], want["losses"][finite]))
        keys = [k for k in want if k.startswith("param/") and not k.endswith("@init") and k in got]
        params = max([params] + [rel_err(got[k], want[k]) for k in keys])
    return loss, params


def main(argv=None) -> int:
    outs = [Path(a) for a in (argv if argv is not None else sys.argv[1:])]
    if not outs:
        print(__doc__)
        return 2
    heads = ["2 ranks", "4 ranks"][:len(outs)]
    print("| comparison | " + " | ".join(f"{h}: loss | {h}: params" for h in heads) + " |")
    print("|---|" + "---|---|" * len(outs))
    for label, name, ref in comparisons():
        cells = []
        for out in outs:
            w = worst(out, name, ref)
            cells += ["-", "-"] if w is None else [f"{w[0]:.1e}", f"{w[1]:.1e}"]
        if set(cells) != {"-"}:
            print(f"| {label} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
