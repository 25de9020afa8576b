"""Training quality of stage 3 with int8 weight gathers and fp16 gradient reduction against exact stage 3.

    .venv/bin/python benchmarks/quant_quality.py [--seeds 0,1,2] [--steps 400] [--out runs/quant_quality]

The example GPT (examples/train_gpt.py, examples/configs/gpt_stage2.yaml's model and data, no gradient
accumulation) on 2 ranks, per seed (initial weights and data order) twice: exact stage 3, and stage 3 with
``gather_quantization={"kind": "int8", "min_numel": 0}`` (every matrix of this small model quantized: the
default ``min_numel`` would keep them all exact) and ``reduce_dtype=float16`` with a loss scale of 1024.
Prints the final losses (mean of the last 20 steps), the exact runs' seed-to-seed spread and where the quantized
mean lies in it; writes ``results.json`` and ``quant_quality.png`` (the loss curves) under ``--out``.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mindzero.launch.local import msrun  # noqa: E402

VARIANTS = {"exact": {}, "int8+fp16": {"gather_quantization": {"kind": "int8", "min_numel": 0},
                                       "reduce_dtype": "float16", "scale_sense": 1024.0}}
TAIL = 20


def run(seed, variant, a, out: Path) -> list:
    run_dir = out / f"{variant}_seed{seed}"
    hist = run_dir / "stage_3" / "history.json"
    if not (a.reuse and hist.exists()):
        cfg = yaml.safe_load((ROOT / "examples" / "configs" / "gpt_stage2.yaml").read_text())
        # the stage-2 config's clipping, one micro-batch per step
        cfg["zero"] = {"zero_stage": 3, "clip_grad": True, "clip_norm": 1.0, **VARIANTS[variant]}
        cfg["train"].update(steps=a.steps, seed=seed, save_every=0, log_every=50)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
        t = time.time()
        msrun(ROOT / "examples" / "train_gpt.py", 2, run_dir,
              args=["--config", str(run_dir / "config.yaml"), "--out", str(run_dir), "--no-resume"], timeout=a.timeout)
        print(f"  {variant} seed {seed}: {time.time() - t:.0f}s", flush=True)
    return [h["loss"] for h in json.loads(hist.read_text())]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", default="runs/quant_quality")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--reuse", action="store_true", help="keep runs whose history exists")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    seeds = [int(s) for s in a.seeds.split(",")]
    curves = {v: {s: run(s, v, a, out) for s in seeds} for v in VARIANTS}
    final = {v: {s: statistics.mean(c[-TAIL:]) for s, c in runs.items()} for v, runs in curves.items()}
    exact, quant = list(final["exact"].values()), list(final["int8+fp16"].values())
    lo, hi = min(exact), max(exact)
    mean_q = statistics.mean(quant)
    summary = dict(seeds=seeds, steps=a.steps, final=final, exact_mean=statistics.mean(exact), exact_min=lo,
                   exact_max=hi, spread=hi - lo, quant_mean=mean_q, within_spread=lo <= mean_q <= hi,
                   per_seed_diff={s: final["int8+fp16"][s] - final["exact"][s] for s in seeds})
    print("| seed | exact final loss | int8 + fp16 final loss | difference |")
    print("|---|---|---|---|")
    for s in seeds:
        print(f"| {s} | {final['exact'][s]:.4f} | {final['int8+fp16'][s]:.4f} | {summary['per_seed_diff'][s]:+.4f} |")
    print(f"exact: mean {summary['exact_mean']:.4f}, seed-to-seed spread [{lo:.4f}, {hi:.4f}] ({hi - lo:.4f}); "
          f"int8 + fp16 mean {mean_q:.4f}: {'within' if summary['within_spread'] else 'outside'} the spread")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(summary, curves=curves), indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for v, style in (("exact", "-"), ("int8+fp16", "--")):
        for k, s in enumerate(seeds):
            ax.plot(range(1, len(curves[v][s]) + 1), curves[v][s], style, color=f"C{k}", lw=1,
                    label=f"{v}, seed {s}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over micro-batches)")
    ax.set_title("Example GPT, stage 3 on 2 ranks: exact gathers vs int8 gathers + fp16 reduction")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "quant_quality.png", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
