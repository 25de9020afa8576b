"""Train a small GPT with mindzero: YAML config, periodic checkpoints, resume, merged model, generation.

Launch on 2 CPU ranks (``scripts/run_example.sh`` runs the stages demo):
    python -m mindzero.launch.local -n 2 --out runs/gpt_stage2 examples/train_gpt.py \\
        --config examples/configs/gpt_stage2.yaml
or with msrun / mpirun directly (see docs/launch.md):
    msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --log_dir=logs --join=True \\
        examples/train_gpt.py --config examples/configs/gpt_stage2.yaml --out runs/gpt_stage2

The config's ``zero`` section is mindzero's own settings file format, read and validated by
``mindzero.load_config(path, section="zero")``: ``zero_stage`` and any other ``prepare_train_network`` setting
(``gradient_accumulation_steps``, ``clip_grad``, ``gather_quantization: int8``, ``reduce_dtype: float16``,
``scale_sense: 1024``, ...). The example's own ``run`` section may list several stages (``run.stages: [0, 1, 2,
3]``): they then run one after the other in one launch, from the same initial weights on the same data, and rank 0
prints a table comparing them; with ``run.plain_dp: true`` plain data parallel (MindSpore's ``nn.TrainOneStepCell``)
runs first, and the table gives each stage's measured difference from it. ``train.seed`` picks the initial weights
and the data order (default 0).
Every stage writes into ``OUT/stage_<s>/``: ``checkpoints/step_<n>`` (mindzero checkpoints,
the newest ``train.keep_checkpoints`` kept), ``history.json`` (losses), ``loss.png``,
``final_model.ckpt`` (merged, loads into the plain network) and ``samples.txt``.
Started again with the same ``--out``, a stage resumes from its newest complete
checkpoint (``--no-resume`` refuses to and starts over in a fresh ``--out``).
"""
import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import yaml
import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.communication import get_group_size

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mindzero  # noqa: E402
from gpt import GPT, CharTokenizer, LMLoss, batches, generate, init_params, make_corpus  # noqa: E402

KINDS = ("parameters", "gradients", "optimizer_states")
DEFAULTS = {"train": {"log_every": 10, "save_every": 0, "keep_checkpoints": 2, "weight_decay": 0.0, "seed": 0},
            "generate": {"prompt": "the cat ", "tokens": 60}}


def load_config(path, stage_override=None) -> dict:
    """The example's config: its own sections with their defaults, ``zero`` (mindzero's settings, validated by
    ``mindzero.load_config``; ``zero_stage`` taken out, each stage passes its own) and the stages to run."""
    cfg = yaml.safe_load(Path(path).read_text())
    for section, values in DEFAULTS.items():
        cfg[section] = {**values, **cfg.get(section, {})}
    zero = mindzero.load_config(path, section="zero")
    run = cfg.get("run", {})
    stages = run.get("stages", zero.get("zero_stage", 0)) if stage_override is None else stage_override
    cfg["plain_dp"] = bool(run.get("plain_dp", False)) and stage_override is None
    cfg["stages"] = [int(s) for s in (stages if isinstance(stages, list) else [stages])]
    bad = [s for s in cfg["stages"] if s not in (0, 1, 2, 3)]
    if bad:
        raise ValueError(f"{path}: run.stages={stages!r}: every stage must be 0, 1, 2 or 3")
    cfg["zero"] = {k: v for k, v in zero.items() if k != "zero_stage"}
    cfg["accumulation"] = cfg["zero"].get("gradient_accumulation_steps", 1)
    return cfg


def build_network(cfg, vocab):
    """The GPT with its loss (the same initial weights on every rank and in every run) and its optimizer."""
    m, t = cfg["model"], cfg["train"]
    gpt = GPT(vocab, m["dim"], m["layers"], m["heads"], m["seq"], m["tied"])
    init_params(gpt, seed=t["seed"])
    net = LMLoss(gpt)
    params = net.trainable_params()
    decay = [p for p in params if len(p.shape) >= 2]
    no_decay = [p for p in params if len(p.shape) < 2]
    opt = nn.AdamWeightDecay([{"params": decay, "weight_decay": t["weight_decay"]},
                              {"params": no_decay, "weight_decay": 0.0}], learning_rate=t["lr"])
    return net, opt


def build(cfg, vocab, stage, verbose):
    net, opt = build_network(cfg, vocab)
    return mindzero.prepare_train_network(net, opt, zero_stage=stage, verbose=verbose, config=cfg["zero"])


def run_plain_dp(cfg, ids, tok, world, log):
    """The reference: plain data parallel, MindSpore's own ``nn.TrainOneStepCell`` (its gradient all-reduce under
    the DATA_PARALLEL context) on the same weights and data; no clipping or accumulation (it has neither)."""
    t = cfg["train"]
    if cfg["zero"].get("clip_grad") or cfg["accumulation"] != 1:
        raise ValueError("run.plain_dp: true needs zero.clip_grad: false and zero.gradient_accumulation_steps: 1 "
                         "(MindSpore's nn.TrainOneStepCell does neither; docs/parity.md)")
    net, opt = build_network(cfg, tok.vocab_size)
    # nn.TrainOneStepCell all-reduces its gradients only under MindSpore's DATA_PARALLEL context, which it reads
    # when built; mindzero needs no such context, so it is set for this run alone
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    train = nn.TrainOneStepCell(net, opt)
    ms.reset_auto_parallel_context()
    train.set_train()
    data = batches(ids, t["batch"], cfg["model"]["seq"], world.world_rank, world.world_size, seed=1 + t["seed"])
    losses = []
    for step in range(t["steps"]):
        x, y = next(data)
        losses.append(float(train(Tensor(x), Tensor(y)).asnumpy()))
        if (step + 1) % t["log_every"] == 0 or step + 1 == t["steps"]:
            log(f"plain DP step {step + 1:5d}/{t['steps']} loss {losses[-1]:.4f}")
    states = [p for p in opt.get_parameters() if p.name.startswith(("adam_m.", "adam_v."))]
    held = [sum(p.nbytes for p in net.get_parameters()), 0, sum(p.nbytes for p in states)]
    per_rank = all_ranks(held + held)
    params = {p.name: p.asnumpy() for p in net.trainable_params()}
    return dict(losses=losses, bytes_per_rank=per_rank, params=params)


def all_ranks(row: list) -> list:
    """Every rank's ``row`` of integers, rank by rank (MindSpore's all-gather over the world)."""
    gathered = ops.AllGather()(Tensor(np.array(row, np.int64))).asnumpy()
    return gathered.reshape(get_group_size(), -1).tolist()


def rel_diff(a, b) -> float:
    """``max|a - b| / max|b|``: how docs/parity.md measures."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def mib(x) -> str:
    return f"{x / 2**20:.3f}"


def run_stage(stage, cfg, ids, tok, world, out: Path, resume: bool, stop_after: int, log):
    t = cfg["train"]
    k, steps = cfg["accumulation"], t["steps"]
    run_dir = out / f"stage_{stage}"
    ckpt_root = run_dir / "checkpoints"
    train = build(cfg, tok.vocab_size, stage, verbose=world.world_rank == 0)
    plan = mindzero.memory_report(train)["expected"]
    shards = train.zero_info.world
    log(f"stage {stage}: {world.world_size} ranks, op group {shards.op_size}, {shards.dp_size} data-parallel "
        f"replica{'s' if shards.dp_size > 1 else ''}; "
        f"memory plan per rank (MiB): parameters {mib(plan['parameters'])}, gradients {mib(plan['gradients'])}, "
        f"optimizer states {mib(plan['optimizer_states'])}")
    start_step, history = 0, []
    latest = mindzero.latest_checkpoint(ckpt_root) if resume else None
    if latest is not None:
        start_step = mindzero.load_checkpoint(train, latest).step
        hist_file = run_dir / "history.json"
        if hist_file.exists():
            history = [h for h in json.loads(hist_file.read_text()) if h["step"] <= start_step]
        log(f"stage {stage}: resumed from {latest} at step {start_step}")
    elif ckpt_root.exists() and any(ckpt_root.iterdir()):  # every rank sees it: all fail, none hangs
        raise FileExistsError(f"--out {out}: {ckpt_root} already holds checkpoints and --no-resume was given; "
                              "use a fresh --out")
    # every rank its own data: by world rank over the world size (also under hybrid sharding)
    data = batches(ids, t["batch"], cfg["model"]["seq"], world.world_rank, world.world_size, seed=1 + t["seed"])
    for _ in range(start_step * k):  # the data position of the resumed step
        next(data)
    tick, tokens, last_saved = None, 0, start_step
    for step in range(start_step, steps):
        micro = []
        for _ in range(k):
            x, y = next(data)
            loss, overflow, scale = train(Tensor(x), Tensor(y))
            micro.append(float(loss.asnumpy()))
            tokens += x.size * world.world_size
        history.append({"step": step + 1, "loss": float(np.mean(micro)), "scale": float(scale.asnumpy()),
                        "overflow": bool(overflow.asnumpy())})
        if tick is None:
            tick, tokens = time.time(), 0  # the first step compiles: rate from the second on
        if (step + 1) % t["log_every"] == 0 or step + 1 == steps:
            h, secs = history[-1], time.time() - tick
            rate = f"{tokens / secs:,.0f}" if tokens else "-"
            log(f"stage {stage} step {step + 1:5d}/{steps} ({100 * (step + 1) // steps:3d}%) loss {h['loss']:.4f} "
                f"scale {h['scale']:g} overflow {h['overflow']} tokens/s {rate}")
        if (t["save_every"] and (step + 1) % t["save_every"] == 0) or step + 1 == steps:
            save(train, ckpt_root, step + 1, history, run_dir, t["keep_checkpoints"], world, log)
            last_saved = step + 1
        if step + 1 == stop_after:
            log(f"stage {stage}: stopping after step {stop_after} (--stop-after)")
            return None
    report = mindzero.memory_report(train)
    per_rank = all_ranks([report[x] for x in KINDS] + [report["expected"][x] for x in KINDS])
    final_params = mindzero.gather_full_state_dict(train)
    if world.world_rank == 0:
        finish(cfg, tok, run_dir, ckpt_root / f"step_{last_saved:06d}", history, stage, log)
    return dict(losses=[h["loss"] for h in history], bytes_per_rank=per_rank, params=final_params)


def save(train, ckpt_root, step, history, run_dir, keep, world, log):
    path = ckpt_root / f"step_{step:06d}"
    if path.exists():
        return
    ckpt_root.mkdir(parents=True, exist_ok=True)
    mindzero.save_checkpoint(train, path, step=step)  # collective; complete on every rank when it returns
    if world.world_rank == 0:
        write_json(run_dir / "history.json", history)
        old = mindzero.complete_checkpoints(ckpt_root)[:-keep] if keep else []
        for p in old:
            shutil.rmtree(p)
        log(f"saved {path}" + (f" (removed {', '.join(p.name for p in old)})" if old else ""))


def finish(cfg, tok, run_dir, last_ckpt, history, stage, log):
    """Rank 0: merge the last checkpoint into one file, load it into the plain network, generate, plot."""
    m, g = cfg["model"], cfg["generate"]
    final = run_dir / "final_model.ckpt"
    mindzero.merge_checkpoint(last_ckpt, final, force=True, log=None)
    gpt = GPT(tok.vocab_size, m["dim"], m["layers"], m["heads"], m["seq"], m["tied"])
    missing, _ = ms.load_param_into_net(LMLoss(gpt), ms.load_checkpoint(str(final)), strict_load=True)
    if missing:
        raise RuntimeError(f"{final}: parameters missing from the merged checkpoint: {missing}")
    ms.set_context(mode=ms.PYNATIVE_MODE)  # one forward per character: no recompiles per length
    text = generate(gpt, tok, g["prompt"], g["tokens"], m["seq"])
    ms.set_context(mode=ms.GRAPH_MODE)
    (run_dir / "samples.txt").write_text(text + "\n")
    log(f"stage {stage}: merged model {final}; greedy sample: {text!r}")
    plot([(f"stage {stage}", history)], run_dir / "loss.png", f"GPT, ZeRO stage {stage}", np.log(tok.vocab_size))


def plot(curves, path: Path, title: str, uniform: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    for label, hist in curves:
        ax.plot([h["step"] for h in hist], [h["loss"] for h in hist], label=label, lw=1.4)
    ax.axhline(uniform, color="grey", ls=":", lw=1, label="uniform guess")
    ax.set(xlabel="optimizer step", ylabel="training loss (rank 0, micro-batch mean)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def print_formulas(phi, n, log):
    """Each stage's bytes per rank by the fp32 formula (what this example trains in; mindzero keeps a master
    shard at stages 1-2) and by the mixed-precision one (``param_dtype=float16``), side by side."""
    log(f"Formulas, Φ = {phi} trainable parameters, N = {n}, Adam (parameters, gradients and optimizer states a "
        "rank holds during a step): " + "; ".join(
            f"stage {s}: fp32 {f['fp32']['total'] / 2 ** 20:.2f} MiB, mixed precision "
            f"{f['mixed_precision']['total'] / 2 ** 20:.2f} MiB" for s, f in
            ((s, mindzero.estimate_memory([(phi,)], s, n)["formulas"]) for s in range(4))))


def print_table(results, n, vocab, log):
    first = next(iter(results.values()))
    ref = "plain DP" if "dp" in results else "stage " + str(next(iter(results)))
    log(f"\nGPT on {n} ranks (vocab {vocab}); uniform-guess loss {np.log(vocab):.3f}; "
        f"first-step loss {first['losses'][0]:.4f}")
    log(f"| run | final loss | max rel. diff vs {ref}: losses | params | rank | params MiB | grads MiB "
        "| optimizer MiB | expected (p/g/o) MiB |")
    log("|---|---|---|---|---|---|---|---|---|")
    for key, r in results.items():
        name = "plain DP" if key == "dp" else f"stage {key}"
        for rank, row in enumerate(r["bytes_per_rank"]):
            lead = (f"| {name} | {r['losses'][-1]:.6f} | {r['loss_diff']:.1e} | {r['param_diff']:.1e} " if rank == 0
                    else "| | | | ")
            expected = "-" if key == "dp" else f"{mib(row[3])}/{mib(row[4])}/{mib(row[5])}"
            log(lead + f"| {rank} | {mib(row[0])} | {mib(row[1])} | {mib(row[2])} | {expected} |")
    log("(bytes a rank holds between steps: gradients are persistent only as accumulation buffers; stage 2's "
        "saving is in the peak during backward, docs/performance.md)")
    if all(r["loss_diff"] == 0 and r["param_diff"] == 0 for r in results.values()):
        log(f"Every stage equals {ref} bit for bit: every loss and every final parameter.")
    else:
        log(f"Stages differ from {ref} by rounding: with gradient accumulation stages 0-1 reduce the accumulated\n"
            "gradient once per update and stages 2-3 every micro-batch (the same sums in another order), which\n"
            "training amplifies; see docs/parity.md. Without accumulation they are bit-identical.")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).parent / "configs" / "gpt_stage2.yaml"))
    ap.add_argument("--out", default="runs/gpt")
    ap.add_argument("--stage", type=int, help="override zero.stage")
    ap.add_argument("--steps", type=int, help="override train.steps")
    ap.add_argument("--no-resume", action="store_true", help="start over; refuse an --out with checkpoints")
    ap.add_argument("--device", help="CPU, GPU or Ascend (default: MINDZERO_DEVICE if set, else MindSpore's own)")
    ap.add_argument("--stop-after", type=int, default=0,
                    help="stop after this step as if interrupted (checkpoints stay; run again to resume)")
    args = ap.parse_args()
    cfg = load_config(args.config, args.stage)
    if args.steps:
        cfg["train"]["steps"] = args.steps
    world = mindzero.start_data_parallel(device=args.device)
    log = (lambda msg: print(msg, flush=True)) if world.world_rank == 0 else (lambda msg: None)
    out = Path(args.out)
    text = make_corpus(cfg["data"]["sentences"], cfg["data"]["seed"])
    tok = CharTokenizer(text)
    ids = tok.encode(text)
    log(f"config {args.config}: stages {cfg['stages']}, {cfg['train']['steps']} steps x "
        f"{cfg['accumulation']} micro-batches of {cfg['train']['batch']} x "
        f"{cfg['model']['seq']} tokens per rank; corpus {len(ids):,} characters, vocab {tok.vocab_size}")
    results, ref = {}, None
    runs = (["dp"] if cfg["plain_dp"] and not args.stop_after else []) + cfg["stages"]
    for stage in runs:
        if stage == "dp":
            r = run_plain_dp(cfg, ids, tok, world, log)
        else:
            r = run_stage(stage, cfg, ids, tok, world, out, not args.no_resume, args.stop_after, log)
        if r is None:
            break
        params = r.pop("params")
        ref = ref or dict(r, params=params)  # the first run: plain DP if it ran
        r["loss_diff"] = rel_diff(r["losses"], ref["losses"])
        r["param_diff"] = max(rel_diff(params[n], ref["params"][n]) for n in params)
        results[stage] = r
    if world.world_rank == 0 and results:
        write_json(out / "results.json", results)
        if len(results) > 1:
            print_table(results, world.world_size, tok.vocab_size, log)
            print_formulas(sum(int(v.size) for v in ref["params"].values()), world.world_size, log)
            curves = [(f"stage {s}", json.loads((out / f"stage_{s}" / "history.json").read_text()))
                      for s in results if s != "dp"]
            plot(curves, out / "loss_all_stages.png", f"GPT on {world.world_size} ranks, ZeRO stages",
                 np.log(tok.vocab_size))
    mindzero.finish_rank(out, world.world_rank)  # what mindzero.launch.local waits for


if __name__ == "__main__":
    main()
