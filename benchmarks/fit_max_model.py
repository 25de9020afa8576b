"""``mindzero-plan`` against ``max_model.py``'s ladder: the largest GPT each configuration trains in the ladder's
22 GiB, 4-rank job, predicted from one-process rehearsals, next to the largest the ladder found by training.

    .venv/bin/python benchmarks/fit_max_model.py [--ladder docs/results/max_model_results.json] [--out runs/fit_max_model]

The per-rank budget is the job's, less what the ladder measured outside the ranks' growth: ``(budget -
launcher) / N - baseline``, where ``baseline`` is a rank's RSS right after ``init()`` and ``launcher`` (msrun and
its scheduler) is the job peak less ``N`` ranks' peaks, both read from the ladder's trained sizes. Plain DP is
predicted as mindzero's stage 0 (within 5% of plain DP's peak: docs/performance.md). Run it alone: it measures
memory.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from mindzero.core.fit import GIB  # noqa: E402

CONFIGS = {"dp": "stage 0", "2": "stage 2", "3": "stage 3"}  # the ladder's configuration -> the plan's label


def per_rank_budget(ladder: dict) -> tuple:
    """``(bytes, how)``: the per-rank budget above the RSS before building, from the ladder's trained sizes."""
    args, world = ladder["args"], ladder["args"]["world"]
    launchers, baselines = [], []
    for rows in ladder["results"].values():
        for r in rows:
            if r.get("ok"):
                base = r["timeline"][0]["rss_kib"] / 2 ** 20
                baselines.append(base)
                launchers.append(r["job_peak_gib"] - world * (base + r["rank_peak_above_init_gib"]))
    launcher, baseline = statistics.median(launchers), statistics.median(baselines)
    budget = (args["budget_gib"] - launcher) / world - baseline
    how = (f"({args['budget_gib']:.1f} GiB job - {launcher:.2f} GiB launcher) / {world} ranks - {baseline:.2f} GiB "
           f"rank baseline = {budget:.2f} GiB per rank")
    return int(budget * GIB), how


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ladder", default=str(ROOT / "docs" / "results" / "max_model_results.json"))
    ap.add_argument("--out", default="runs/fit_max_model")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--margin", type=float, default=0.0, help="mindzero-plan's margin (0: the prediction itself)")
    a = ap.parse_args(argv)
    from mindzero.planner.planner import Rehearsal, plan

    ladder = json.loads(Path(a.ladder).read_text())
    args = ladder["args"]
    budget, how = per_rank_budget(ladder)
    print(how, flush=True)
    kwargs = dict(vocab=args["vocab"], dim=args["dim"], layers=8, heads=args["heads"], seq=args["seq"])
    sample = [((args["batch"], args["seq"]), "int32")] * 2
    rehearsal = Rehearsal(jobs=a.jobs, progress=lambda m: print(m, flush=True), factory_kwargs=kwargs)
    result = plan("fit_models:gpt", sample, args["world"], budget, margin=a.margin, rehearsal=rehearsal,
                  stages=(0, 2, 3), quantization=False)
    print(result["table"])
    rows = []
    for config, label in CONFIGS.items():
        trained = [r for r in ladder["results"][config] if r.get("ok")]
        best = max(trained, key=lambda r: r["layers"])
        failed = [r["layers"] for r in ladder["results"][config] if not r.get("ok") and r["layers"] > best["layers"]]
        pred = result["largest_depth"][label]
        rows.append(dict(config=config, label=label, predicted_layers=pred["blocks"],
                         predicted_parameters=pred["parameters"], ladder_layers=best["layers"],
                         ladder_parameters=best["phi"], next_failed_layers=min(failed) if failed else None,
                         ratio=pred["parameters"] / best["phi"]))
    lines = [f"per-rank budget: {how}; margin {a.margin:.0%}", "",
             "| config | predicted largest | parameters | ladder's largest that trains | parameters | next size (fails) | "
             "predicted / ladder |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} ({'plain DP' if r['config'] == 'dp' else 'mindzero'}) | {r['predicted_layers']} "
                     f"layers | {r['predicted_parameters'] / 1e9:.3f}B | {r['ladder_layers']} layers | "
                     f"{r['ladder_parameters'] / 1e9:.3f}B | {r['next_failed_layers']} layers | {r['ratio']:.3f} |")
    text = "\n".join(lines)
    print(text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(result["table"] + "\n\n" + text + "\n")
    (out / "results.json").write_text(json.dumps(dict(budget=budget, how=how, rows=rows,
                                                      predictions=[p.as_dict() for p in result["predictions"]]),
                                                 indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
