"""How close ``mindzero-plan``'s predictions are to the peaks real launches measure.

    .venv/bin/python benchmarks/fit_accuracy.py [--worlds 2,4] [--models gpt256,gpt512,vit] [--out runs/fit_accuracy]

For each network and world size, one :class:`mindzero.planner.planner.Planner` rehearses the replicas every
configuration needs (as ``mindzero-plan`` does: two depths at the sample's batch per configuration, the batch
terms from stage 0 at a second batch), then each configuration is launched for real (msrun, ``benchmarks/
fit_worker.py``: the network built under ``lazy_init``, three steps) and its peak RSS above the RSS right before
building is taken (the highest rank). Prints a table and writes ``results.json``, ``results.md`` and
``fit_accuracy.png`` under ``--out``. Run it alone on the machine: it measures memory.
"""
import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from mindzero.core.fit import MIB  # noqa: E402
from fit_worker import launch  # noqa: E402

GPT_SAMPLE = [((2, 64), "int32"), ((2, 64), "int32")]
VIT_SAMPLE = [((4, 3, 64, 64), "float32"), ((4,), "int32")]
MODELS = {  # name -> (factory, kwargs, sample, configurations)
    "gpt256": ("fit_models:gpt", dict(vocab=8192, dim=256, layers=8, heads=8, seq=64), GPT_SAMPLE,
               ["0", "1", "2", "3", "3-noregather", "3-units", "3-int8", "2-accum2"]),
    "gpt512": ("fit_models:gpt", dict(vocab=8192, dim=512, layers=4, heads=8, seq=64), GPT_SAMPLE,
               ["0", "2", "3", "3-int8"]),
    "gpt105": ("fit_models:gpt", dict(vocab=8192, dim=768, layers=14, heads=12, seq=64), GPT_SAMPLE,  # zero_bench's
               ["0", "3"]),
    "gpt896": ("fit_models:gpt", dict(vocab=8192, dim=896, layers=5, heads=14, seq=64), GPT_SAMPLE,
               ["0", "1", "2", "3", "1-owner", "2-owner", "3-owner"]),
    "vit": ("fit_models:vit", dict(image=64, patch=8, dim=384, depth=6, heads=6, classes=100), VIT_SAMPLE,
            ["0", "2", "3", "3-units"]),
}


def options_of(config: str, units: str) -> dict:
    stage, _, flag = config.partition("-")
    out = {"zero_stage": int(stage)}
    out.update({"": {}, "noregather": {"stage3_regather": False}, "units": {"gather_units": units},
                "int8": {"gather_quantization": "int8"}, "accum2": {"gradient_accumulation_steps": 2},
                "owner": {"update_sharding": "owner"}}[flag])
    return out


def measure(factory, kwargs, sample, batch, options, world, out, timeout, reuse=False):
    spec = dict(factory=factory, factory_kwargs=kwargs, options=options,
                sample=[dict(shape=list(s), dtype=d) for s, d in sample], batch=batch, steps=3)
    ranks = launch(spec, world, out, timeout, reuse)
    return max(r["peak"] for r in ranks), ranks


def chart(rows, out: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for w, marker in ((2, "o"), (4, "s")):
        sel = [r for r in rows if r["world"] == w]
        axes[0].scatter([r["measured_mib"] for r in sel], [r["predicted_mib"] for r in sel], marker=marker,
                        label=f"{w} ranks")
    lim = max(max(r["measured_mib"], r["predicted_mib"]) for r in rows) * 1.05
    axes[0].plot([0, lim], [0, lim], color="gray", lw=0.8)
    axes[0].fill_between([0, lim], [0, 0.9 * lim], [0, 1.1 * lim], color="gray", alpha=0.15, label="within 10%")
    axes[0].set_xlabel("measured peak per rank (MiB above the RSS before building)")
    axes[0].set_ylabel("predicted (MiB)")
    axes[0].legend()
    labels = [f"{r['model']} {r['config']} x{r['world']}" for r in rows]
    axes[1].barh(range(len(rows)), [100 * r["error"] for r in rows],
                 color=["tab:green" if abs(r["error"]) <= 0.10 else "tab:red" for r in rows])
    axes[1].set_yticks(range(len(rows)))
    axes[1].set_yticklabels(labels, fontsize=7)
    axes[1].axvline(-10, color="gray", lw=0.8)
    axes[1].axvline(10, color="gray", lw=0.8)
    axes[1].set_xlabel("prediction error (%)")
    fig.suptitle("mindzero-plan: predicted vs measured per-rank peak RSS (CPU, one-process rehearsals)")
    fig.tight_layout()
    fig.savefig(out / "fit_accuracy.png", dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--models", default="gpt256,gpt512,vit")
    ap.add_argument("--out", default="runs/fit_accuracy")
    ap.add_argument("--jobs", type=int, default=2, help="rehearsals at once")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--reuse", action="store_true", help="reuse the measured launches under --out (predict again)")
    a = ap.parse_args(argv)
    from mindzero.planner.planner import Planner, Rehearsal

    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows, start = [], time.time()
    for world in (int(w) for w in a.worlds.split(",")):
        for name in a.models.split(","):
            factory, kwargs, sample, configs = MODELS[name]
            t = time.time()
            planner = Planner(factory, sample, world, Rehearsal(jobs=a.jobs, progress=lambda m: print(m, flush=True),
                                                                factory_kwargs=kwargs))
            units = f"{planner.network.list_name}.*"
            opts = [options_of(c, units) for c in configs]
            runs = [(o, d, planner.batch, False) for o in opts for d in planner.depths]
            runs += [({"zero_stage": 0}, d, planner.batch // 2, False) for d in planner.depths]
            planner.measure(runs)
            calibration = time.time() - t
            for config, o in zip(configs, opts):
                pred = planner.predict(o, batch_from={"zero_stage": 0})
                t = time.time()
                peak, ranks = measure(factory, kwargs, sample, planner.batch, o, world, out / f"w{world}_{name}_{config}",
                                      a.timeout, a.reuse)
                row = dict(model=name, config=config, world=world, options=o, predicted_mib=pred.peak / MIB,
                           measured_mib=peak / MIB, error=pred.peak / peak - 1,
                           parts_mib={k: v / MIB for k, v in pred.parts.items()}, wire_mib=pred.wire_bytes / MIB,
                           calibration_s=calibration, launch_s=time.time() - t, blocks=planner.network.depth,
                           measured_ranks_mib=[r["peak"] / MIB for r in ranks])
                rows.append(row)
                print(f"{name} {config} x{world}: predicted {row['predicted_mib']:.0f} MiB, measured "
                      f"{row['measured_mib']:.0f} MiB, error {100 * row['error']:+.1f}%", flush=True)
            planner.close()
    lines = [f"`python benchmarks/fit_accuracy.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             "| model | config | ranks | predicted MiB | measured MiB | error | model states | transient | activations | "
             "framework + graph | calibration s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["parts_mib"]
        lines.append(f"| {r['model']} | {r['config']} | {r['world']} | {r['predicted_mib']:.0f} | {r['measured_mib']:.0f} | "
                     f"{100 * r['error']:+.1f}% | {p['model_states']:.0f} | {p['transient']:.0f} | "
                     f"{p['activations']:.0f} | {p['framework']:.0f} | {r['calibration_s']:.0f} |")
    within = sum(abs(r["error"]) <= 0.10 for r in rows)
    lines += ["", f"within 10%: {within} of {len(rows)}; largest error {max(abs(r['error']) for r in rows) * 100:.1f}%"]
    text = "\n".join(lines)
    print(text)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(dict(rows=rows, seconds=time.time() - start), indent=1))
    chart(rows, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
