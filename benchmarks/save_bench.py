"""The training stall of a synchronous vs an asynchronous checkpoint save, measured side by side in one run.

    .venv/bin/python benchmarks/save_bench.py [--world 2] [--stage 3] [--rounds 2] [--out runs/save_bench]
                                              [model options of zero_bench: --layers 14 --dim 768 ...]

One msrun launch trains the benchmark GPT of ``benchmarks/zero_bench.py`` (default 105M parameters, fp32,
AdamWeightDecay) with ``prepare_train_network(zero_stage=--stage)`` and, after warm-up steps, alternates
``--rounds`` times: a synchronous save followed by a step, then an asynchronous save followed by a step
(the write overlapping it) and ``wait()`` before the next save. Per rank it records the median steady step,
the time inside ``save_checkpoint`` (the training stall), the step after it, the remaining ``wait()``, the
bytes written and the extra host memory of the asynchronous copy. The stall of a save is
``save call + (step after - median step) + wait``: what the training loop loses to it.

Writes ``results.json`` and ``results.md`` under ``--out`` and prints the table. Run it alone: the
machine's 2 cores are shared by the ranks and the writer thread.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mindzero.launch.local import msrun  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from zero_bench_worker import add_model_args, model_args  # noqa: E402

MIB = 2 ** 20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="runs/save_bench")
    add_model_args(ap)
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    msrun(HERE / "save_bench_worker.py", a.world, out, ["--out", str(out), "--stage", str(a.stage), "--rounds",
                                                          str(a.rounds), *model_args(a)], timeout=3600)
    ranks = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(a.world)]
    rows = []
    for mode in ("sync", "async"):
        per_rank = []
        for res in ranks:
            med = res["median_step_s"]
            stalls = [s["call_s"] + max(0.0, s["step_after_s"] - med) + s["wait_s"] for s in res[mode]]
            per_rank.append(dict(call=statistics.median(s["call_s"] for s in res[mode]),
                                 after=statistics.median(s["step_after_s"] for s in res[mode]),
                                 wait=statistics.median(s["wait_s"] for s in res[mode]),
                                 stall=statistics.median(stalls), med=med,
                                 host=max(s.get("host_bytes", 0) for s in res[mode])))
        worst = max(per_rank, key=lambda r: r["stall"])  # the slowest rank sets the pace
        rows.append(dict(mode=mode, **worst))
    sync_stall = rows[0]["stall"]
    lines = [f"# Checkpoint save stall: {ranks[0]['phi'] / 1e6:.0f}M parameters, stage {a.stage}, {a.world} ranks "
             f"(CPU), {ranks[0]['bytes_per_rank'] / MIB:.0f} MiB written per rank",
             "",
             "| save | inside save_checkpoint (s) | step after (s) | median step (s) | wait() (s) | stall (s) | "
             "stall / sync | extra host memory (MiB) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['call']:.2f} | {r['after']:.2f} | {r['med']:.2f} | {r['wait']:.2f} | "
                     f"{r['stall']:.2f} | {r['stall'] / sync_stall:.2f} | {r['host'] / MIB:.0f} |")
    lines += ["", f"Median over {a.rounds} rounds of each, the slowest rank. Stall = time inside save_checkpoint + "
              "the step after minus the median step + the wait() left at the next save."]
    text = "\n".join(lines)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(dict(rows=rows, ranks=ranks), indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
