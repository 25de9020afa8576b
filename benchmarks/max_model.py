"""The largest GPT that trains on this machine: plain data parallel against mindzero's stages, 4 ranks.

    .venv/bin/python benchmarks/max_model.py [--world 4] [--configs dp,2,3] [--budget-gib 22] [--out runs/max_model]

A ladder of GPTs from ``examples/gpt.py`` of one width (``--dim``, default 2048, 16 heads, vocabulary
8192, tied head) and growing depth (``--layers``, default 2, 4, 6, 8, 12, 16, 20, 24, 28: 0.12B to 1.4B
parameters; 12·L·d² + V·d). A configuration *trains* a size when all ranks finish 3 steps (compile
included) with finite losses while the job's processes together hold at most ``--budget-gib`` of RSS
(sampled every 0.5 s; the machine has 24 GiB and nothing else may run): over it, every process is
killed and the size counts as not fitting. Plain DP (``nn.TrainOneStepCell``) builds its network
eagerly, as its users do; mindzero's stages build it under ``mindzero.lazy_init()``.

Per configuration the search starts at the largest size whose fp32 ZeRO formula plus ``--overhead-gib``
per rank fits the budget, then walks up while it trains and down while it does not, so the result is
the largest size that trains with the next larger one seen failing (or the ladder's end).

With ``--reuse``, sizes measured by earlier invocations under ``--out`` are reported too.

``--finetune R``: adapter fine-tuning instead of training from scratch: the GPT's weights are frozen and loaded
from a plain checkpoint the benchmark writes for each size (the standalone GPT, as ``mindspore.save_checkpoint``
writes it; plain DP loads it one tensor at a time into its full network, its best case, mindzero with
``load_pretrained``), rank-R adapters on
every projection train (``examples/gpt.py``: ``GPT(lora_rank=R)``), AdamWeightDecay over the adapters.

Writes ``results.json``, ``results.md`` and ``max_model.png`` under ``--out``.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mindzero.core.estimate import paper_formula  # noqa: E402
from mindzero.launch.local import LaunchError, MemoryLimitExceeded, MemoryWatch, launch  # noqa: E402

GIB = 2 ** 30
NAMES = {"dp": "plain DP", "0": "stage 0", "1": "stage 1", "2": "stage 2", "3": "stage 3",
         "3d": "stage 3, states on disk"}  # 'd': optimizer_offload="disk" under <out>/<config>_L<layers>/offload


def gpt_params(layers: int, dim: int, vocab: int, seq: int, lora: int = 0) -> int:
    """Parameters of ``examples/gpt.py``'s GPT (tied head): blocks, embeddings, final norm (and adapters)."""
    block = 12 * dim * dim + 13 * dim + 16 * dim * lora  # qkv, proj, fc1, fc2 weights and biases, LayerNorms
    return layers * block + vocab * dim + seq * dim + 2 * dim


def write_pretrained(path: Path, layers: int, a) -> None:
    """A plain checkpoint of the standalone GPT of ``layers`` blocks (no adapters), one tensor at a time (the
    GPT is built under lazy_init: this process never holds it whole), as the pretrained model to fine-tune."""
    sys.path.insert(0, str(ROOT / "examples"))
    import mindspore as ms
    from gpt import GPT

    import mindzero
    from mindzero.checkpoint.tensor_io import open_writer
    from mindzero.engine.materialize import full_array

    ms.set_seed(0)
    with mindzero.lazy_init():
        gpt = GPT(a.vocab, a.dim, layers, a.heads, a.seq, tied=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_writer(path, "ckpt", []) as writer:
        for p in gpt.get_parameters():
            writer.write(p.name, full_array(p).astype(np.float32), "float32")


def run(config, layers, a, out: Path) -> dict:
    """One launch: ``{"ok": bool, "why": str, ...}`` with the job's peak RSS and rank 0's numbers."""
    run_dir = out / f"{config}_L{layers}"
    if a.reuse and (run_dir / "outcome.json").exists():
        return json.loads((run_dir / "outcome.json").read_text())
    args = ["--config", config, "--steps", str(a.steps - 1), "--vocab", str(a.vocab), "--dim", str(a.dim),
            "--layers", str(layers), "--heads", str(a.heads), "--seq", str(a.seq), "--batch", str(a.batch)]
    if config != "dp":
        args.append("--lazy")
    phi = gpt_params(layers, a.dim, a.vocab, a.seq, a.finetune)
    pretrained = None
    if a.finetune:
        pretrained = out / "pretrained" / f"gpt_L{layers}.ckpt"
        if not pretrained.exists():
            write_pretrained(pretrained, layers, a)
        args += ["--lora", str(a.finetune), "--pretrained", str(pretrained)]
    watch, t = MemoryWatch(limit=int(a.budget_gib * GIB)), time.time()
    outcome = dict(config=config, layers=layers, dim=a.dim, phi=phi, finetune=a.finetune)
    try:
        launch(ROOT / "benchmarks" / "zero_bench_worker.py", a.world, run_dir, args=args, timeout=a.timeout,
               memory=watch)
        ranks = [json.loads((run_dir / f"rank_{r}.json").read_text()) for r in range(a.world)]
        finite = all(np.isfinite(x["losses"]).all() for x in ranks)
        init = ranks[0]["phases"][0]["rss_kib"]
        outcome.update(ok=finite, why="" if finite else "non-finite loss", losses=ranks[0]["losses"],
                       rank_peak_above_init_gib=max((max(p["peak_kib"] for p in x["phases"][1:]) - init) / 2 ** 20
                                                    for x in ranks),
                       first_step_s=ranks[0]["first_step_s"], step_s=float(np.median(ranks[0]["times"])),
                       timeline=ranks[0]["phases"])
    except MemoryLimitExceeded as err:
        outcome.update(ok=False, why=f"over the {a.budget_gib:g} GiB budget")
        watch.peak_rss = err.peak
    except LaunchError as err:  # a rank died (e.g. the kernel's OOM killer) or the launch timed out
        outcome.update(ok=False, why=str(err).splitlines()[0][:300])
    outcome.update(job_peak_gib=watch.peak_rss / GIB, seconds=time.time() - t)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "outcome.json").write_text(json.dumps(outcome, indent=1))
    print(f"  {NAMES[config]} L={layers} ({phi / 1e9:.2f}B): {'trains' if outcome['ok'] else 'does not: ' + outcome['why']}"
          f" (job peak {outcome['job_peak_gib']:.1f} GiB, {outcome['seconds']:.0f}s)", flush=True)
    return outcome


def start_index(config, a) -> int:
    """The largest ladder size whose formula bytes plus the per-rank overhead fit the budget (fine-tuning: the
    frozen fp32 weights, whole or 1/N at stage 3)."""
    stage = 0 if config == "dp" else int(config[0])
    best = 0
    for i, layers in enumerate(a.ladder):
        phi = gpt_params(layers, a.dim, a.vocab, a.seq, a.finetune)
        if a.finetune:
            per_rank = 4 * phi / (a.world if stage == 3 else 1) + a.overhead_gib * GIB
        else:
            formula = paper_formula(phi, stage, a.world, mixed_precision=False)
            if config.endswith("d"):  # the optimizer states on disk
                formula.pop("optimizer_states")
            per_rank = sum(formula.values()) + a.overhead_gib * GIB
        if per_rank * a.world <= a.budget_gib * GIB:
            best = i
    return best


def search(config, a, out: Path) -> list:
    """Walk the ladder from the estimate: up while a size trains, down while it does not."""
    tried = {}
    i = start_index(config, a)
    while 0 <= i < len(a.ladder) and i not in tried:
        tried[i] = run(config, a.ladder[i], a, out)
        if tried[i]["ok"]:
            i += 1
        elif i - 1 not in tried:
            i -= 1
        else:
            break
    return [tried[i] for i in sorted(tried)]


def earlier(config, a, out: Path) -> list:
    """Outcomes of ``config`` saved under ``out`` by earlier runs with the same model settings."""
    found = [json.loads(f.read_text()) for f in sorted(out.glob(f"{config}_L*/outcome.json"))]
    return [o for o in found if o["dim"] == a.dim and o.get("finetune", 0) == a.finetune
            and o["phi"] == gpt_params(o["layers"], a.dim, a.vocab, a.seq, a.finetune)]


def largest(outcomes):
    ok = [o for o in outcomes if o["ok"]]
    return max(ok, key=lambda o: o["phi"]) if ok else None


def markdown(results, a, command) -> str:
    what = (f"adapter fine-tuning (rank {a.finetune} adapters on every projection, the GPT frozen and loaded from "
            "a plain checkpoint), AdamWeightDecay over the adapters" if a.finetune else "fp32 AdamWeightDecay")
    lines = [f"`{command}`", "",
             f"{a.world} ranks, GPT width {a.dim}, vocabulary {a.vocab}, batch {a.batch} x {a.seq} tokens per rank, "
             f"{what}, {a.steps} steps, budget {a.budget_gib:g} GiB of RSS for the whole job.", "",
             "| config | layers | parameters | trains | job peak RSS GiB | rank peak above init GiB | "
             "first step s | step s |", "|---|---|---|---|---|---|---|---|"]
    for config, outcomes in results.items():
        for o in outcomes:
            lines.append(f"| {NAMES[config]} | {o['layers']} | {o['phi'] / 1e9:.3f}B | "
                         f"{'yes' if o['ok'] else 'no: ' + o['why']} | {o['job_peak_gib']:.1f} | "
                         f"{o.get('rank_peak_above_init_gib', float('nan')):.2f} | "
                         f"{o.get('first_step_s', float('nan')):.0f} | {o.get('step_s', float('nan')):.0f} |")
    lines += ["", "| config | largest that trains | vs plain DP |", "|---|---|---|"]
    dp = largest(results.get("dp", []))
    for config, outcomes in results.items():
        best = largest(outcomes)
        ratio = f"{best['phi'] / dp['phi']:.1f}x" if best and dp else "n/a"
        lines.append(f"| {NAMES[config]} | {best['phi'] / 1e9:.3f}B ({best['layers']} layers) | {ratio} |"
                     if best else f"| {NAMES[config]} | none | n/a |")
    return "\n".join(lines)


def chart(results, a, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for config, outcomes in results.items():
        xs = [o["phi"] / 1e9 for o in outcomes]
        ys = [o["job_peak_gib"] for o in outcomes]
        line, = ax.plot(xs, ys, "-", label=NAMES[config])
        ax.scatter([x for x, o in zip(xs, outcomes) if o["ok"]], [y for y, o in zip(ys, outcomes) if o["ok"]],
                   color=line.get_color(), marker="o")
        ax.scatter([x for x, o in zip(xs, outcomes) if not o["ok"]], [y for y, o in zip(ys, outcomes) if not o["ok"]],
                   color=line.get_color(), marker="x", s=60)
    ax.axhline(a.budget_gib, color="gray", ls="--", lw=0.8, label=f"budget {a.budget_gib:g} GiB")
    ax.set_xlabel("parameters (billions)")
    ax.set_ylabel(f"job peak RSS, {a.world} ranks (GiB)")
    ax.set_title("Largest GPT that trains (o: trains, x: does not)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--configs", default="dp,2,3")
    ap.add_argument("--ladder", default="2,4,6,8,12,16,20,24,28", help="depths, in increasing order")
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-gib", type=float, default=22.0)
    ap.add_argument("--overhead-gib", type=float, default=1.2, help="per-rank framework memory, for the start")
    ap.add_argument("--timeout", type=float, default=5400)
    ap.add_argument("--out", default="runs/max_model")
    ap.add_argument("--reuse", action="store_true", help="reuse finished sizes under --out")
    ap.add_argument("--finetune", type=int, default=0, metavar="R",
                    help="adapter fine-tuning with rank-R adapters on a frozen GPT loaded from a plain checkpoint")
    a = ap.parse_args(argv)
    a.ladder = [int(x) for x in a.ladder.split(",")]
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    results = {c: search(c, a, out) for c in a.configs.split(",")}
    if a.reuse:  # also report sizes measured by earlier invocations (an interrupted or extended ladder)
        results = {c: sorted({o["layers"]: o for o in [*earlier(c, a, out), *outcomes]}.values(),
                             key=lambda o: o["phi"]) for c, outcomes in results.items()}
    command = "python benchmarks/max_model.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table = markdown(results, a, command.strip())
    print(table)
    (out / "results.json").write_text(json.dumps(dict(command=command.strip(), seconds=time.time() - start,
                                                      args=vars(a), results=results), indent=1))
    (out / "results.md").write_text(table + "\n")
    chart(results, a, out / "max_model.png")
    for f in (out / "pretrained").glob("*.ckpt"):  # the plain checkpoints are inputs, large and rebuilt on demand
        f.unlink()
    print(f"wrote {out}/results.json, results.md, max_model.png in {time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
