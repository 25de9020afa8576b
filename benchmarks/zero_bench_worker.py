"""One configuration of ``zero_bench.py`` / ``max_model.py`` on every rank (launched by msrun; one launch per
configuration, so each process's memory belongs to that configuration alone).

Phases, each with the RSS at its end and the peak RSS during it (``VmHWM``, reset between phases by writing
``5`` to ``/proc/self/clear_refs``):

* ``init``: ``mindspore.communication.init()`` (the framework; the baseline everything is measured above);
* ``build``: the GPT and its optimizer (eager, or under :func:`mindzero.lazy_init` with ``--lazy``);
* ``prepare``: ``nn.TrainOneStepCell`` (plain DP) or ``mindzero.prepare_train_network``;
* ``first_step``: the first step (graph compile and one step);
* ``steady``: the remaining steps.

Writes ``<out>/rank_<r>.json``: the phases, step times, losses, model-state bytes (``memory_report``, or
counted for plain data parallel), the collective plan of one step and, with ``--time-collectives`` (plain
DP), the time of single collectives of the model's size.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))


from mindzero.core.host import reset_peak, status_kib  # noqa: E402,F401  (the benchmarks import them from here too)
from mindzero.core.offload import DEFAULT_CHUNK_MB  # noqa: E402

MODEL_DEFAULTS = {"vocab": 8192, "dim": 768, "layers": 14, "heads": 12, "seq": 64, "batch": 2}  # 105M parameters


def add_model_args(ap, **defaults) -> None:
    """The benchmark GPT's options (``--vocab --dim --layers --heads --seq --batch``), shared by the benchmarks."""
    for name, value in {**MODEL_DEFAULTS, **defaults}.items():
        ap.add_argument(f"--{name}", type=int, default=value)


def model_args(a) -> list:
    """The same options back as command-line arguments, for a worker."""
    return [x for name in MODEL_DEFAULTS for x in (f"--{name}", str(getattr(a, name)))]


class Phases:
    """RSS at the end of each phase and the peak during it (VmHWM reset at each phase's start)."""

    def __init__(self):
        self.rows = []
        self.start = time.perf_counter()
        reset_peak()

    def end(self, name: str) -> None:
        now = time.perf_counter()
        self.rows.append(dict(phase=name, rss_kib=status_kib("VmRSS"), peak_kib=status_kib("VmHWM"),
                              seconds=now - self.start))
        print(f"phase {name}: rss {self.rows[-1]['rss_kib'] / 1024:.0f} MiB, peak {self.rows[-1]['peak_kib'] / 1024:.0f}"
              f" MiB, {now - self.start:.1f}s", flush=True)
        self.start = now
        reset_peak()


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="dp, or a zero stage 0-3; '2bfs'/'3bfs': that stage compiled in "
                    "MindSpore's default kernel order instead of depth-first (what it did before; docs/stages.md); "
                    "'3q': stage 3 with int8 weight gathers (gather_quantization='int8'), '3h': with gradients reduced "
                    "in fp16 (reduce_dtype=float16, loss scale 1024), '3qh': both; 'u' (e.g. '3u', '3quh'): one all-gather per "
                    "transformer block (gather_units='*blocks.*'); 'p' (e.g. '3p', '3qhp'): parameters below "
                    "--persistence elements kept whole (stage3_param_persistence_threshold; the model cap at its "
                    "default, 1%% of the elements: mindzero's defaults with --persistence 100000); without 'p' "
                    "every parameter is sharded (threshold 0); 'd' (e.g. '3d'): the optimizer states on disk "
                    "(optimizer_offload='disk' under --offload-dir); 'o' (e.g. '2o'): every sharded parameter updated whole on an "
                    "owner rank (update_sharding='owner')")
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "adafactor", "came", "muon"),
                    help="nn.AdamWeightDecay (default), nn.AdaFactor at a fixed learning rate, mindone's CAME, or "
                    "mindone's Muon (Newton-Schulz in fp32) for the matrices with AdamW for the rest")
    ap.add_argument("--offload-dir", help="disk offload's directory (default: <out>/offload)")
    ap.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_MB, help="disk offload's offload_chunk_mb")
    ap.add_argument("--persistence", type=int, default=100_000, help="the threshold of a 'p' configuration")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10, help="steps after the first")
    ap.add_argument("--mode", choices=("graph", "pynative"), default="graph",
                    help="MindSpore's execution mode; plain DP in PyNative is value_and_grad with "
                    "DistributedGradReducer, as MindSpore documents it (graph mode: nn.TrainOneStepCell)")
    add_model_args(ap)
    ap.add_argument("--bucket-mib", type=float, default=0, help="comm_fusion bucket (MiB) for all kinds; 0: off")
    ap.add_argument("--no-regather", action="store_true")
    ap.add_argument("--split-compile", action="store_true",
                    help="compile the step (Cell.compile) before the first step and time the two apart")
    ap.add_argument("--fp16", action="store_true", help="fp16 compute (AMP O2; LayerNorm in fp32); ZeRO configs also "
                    "hold fp16 parameters with fp32 masters (param_dtype=float16), plain DP keeps fp32 parameters")
    ap.add_argument("--compile-cache", help="ZeRO configs: prepare_train_network's compile_cache (plain DP: start the "
                                            "worker with MindSpore's MS_COMPILER_CACHE_ENABLE=1 instead)")
    ap.add_argument("--lazy", action="store_true", help="build the model under mindzero.lazy_init()")
    ap.add_argument("--time-collectives", action="store_true",
                    help="plain DP: time an all-reduce of Φ floats and an all-gather of Φ/N per rank")
    ap.add_argument("--lora", type=int, default=0, help="fine-tuning: adapters of this rank on every projection, "
                    "everything else frozen, the optimizer over the adapters")
    ap.add_argument("--pretrained", help="a plain checkpoint of the GPT (no adapters) to start from: plain DP loads it "
                    "before training (one tensor at a time into its network), mindzero with load_pretrained")
    return ap.parse_args()


def build(a, lazy: bool):
    import mindspore as ms
    from mindspore import nn
    from gpt import GPT, LMLoss
    import mindzero

    ms.set_seed(0)
    lora = getattr(a, "lora", 0)
    def optimizer(params):
        kind = getattr(a, "optimizer", "adamw")
        if kind == "adamw":
            return nn.AdamWeightDecay(params, 1e-4, weight_decay=0.01)
        if kind == "adafactor":  # the fine-tuning setting: a fixed learning rate
            return nn.AdaFactor(params, learning_rate=1e-4, scale_parameter=False, relative_step=False,
                                warmup_init=False)
        from tests.support.optimizers import came, muon

        return came(params) if kind == "came" else muon(params, lr=1e-4)

    if lazy:
        with mindzero.lazy_init():
            net = LMLoss(GPT(a.vocab, a.dim, a.layers, a.heads, a.seq, tied=True, lora_rank=lora))
            opt = optimizer(net.trainable_params())
    else:
        net = LMLoss(GPT(a.vocab, a.dim, a.layers, a.heads, a.seq, tied=True, lora_rank=lora))
        opt = optimizer(net.trainable_params())
    return net, opt


def load_plain(net, path):
    """Plain DP starts from the pretrained file one tensor at a time, straight into its full network (the file is
    the standalone GPT's: its names without the wrapper's ``gpt.``). The best case for plain DP: MindSpore's own
    ``load_checkpoint`` + ``load_param_into_net`` would hold the whole file beside the network (twice the model)."""
    from mindspore import Tensor

    from mindzero.checkpoint.tensor_io import open_reader

    reader = open_reader(path)
    params = {p.name: p for p in net.get_parameters()}
    names = list(reader.names())
    for name in names:
        param = params["gpt." + name]
        param.set_data(Tensor(reader.read(name).reshape(param.shape), param.dtype))
    assert all("_lora." in n for n in set(params) - {"gpt." + n for n in names}), "unloaded weights"


def time_collectives(phi, world):
    """Single collectives of the model's size: an all-reduce of Φ floats (what DP does per step) and an
    all-gather of Φ/N per rank."""
    from mindspore import Tensor, ops

    timing = {}
    for name, op, size in (("all_reduce_phi", ops.AllReduce(), phi),
                           ("all_gather_phi", ops.AllGather(), -(-phi // world.world_size))):
        arg = Tensor(np.ones(size, np.float32))
        op(arg).asnumpy()
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            op(arg).asnumpy()
            runs.append(time.perf_counter() - t)
        timing[name] = float(np.median(runs))
    return timing


def dp_comm(net, world):
    """The collectives of one plain-DP step: MindSpore's reducer all-reduces every gradient."""
    from mindzero.core.comm_plan import plan_state, step_calls, summarize
    from mindzero.core.config import ZeroConfig
    from mindzero.core.plan import ParamInfo, PartitionPlan

    specs = list(PartitionPlan.build([ParamInfo(p.name, tuple(p.shape)) for p in net.trainable_params()],
                                     world.world_size, world.world_rank))
    calls = step_calls(plan_state(specs, ZeroConfig(0)), world)
    s = summarize([c for c in calls if c.nbytes > 4])  # no overflow flag in MindSpore's step
    return {op: s[op] for op in s}


class PlainDataParallel:
    """Plain data parallel in PyNative as MindSpore documents it: ``value_and_grad`` over the optimizer's parameters,
    ``DistributedGradReducer``'s mean over the world, then the optimizer. Called like ``nn.TrainOneStepCell``."""

    def __init__(self, net, opt):
        import mindspore as ms
        from mindspore import nn

        self.grad_fn = ms.value_and_grad(net, None, opt.parameters)
        self.reducer = nn.DistributedGradReducer(opt.parameters, mean=True)
        self.opt = opt

    def __call__(self, *inputs):
        loss, grads = self.grad_fn(*inputs)
        self.opt(self.reducer(grads))
        return loss


def plain_dp(net, opt, mode: str):
    """Plain data parallel's step: ``nn.TrainOneStepCell`` under MindSpore's DATA_PARALLEL context (the context is
    what makes it all-reduce its gradients; mindzero needs none) in graph mode, :class:`PlainDataParallel` in
    PyNative."""
    import mindspore as ms
    from mindspore import nn

    if mode == "pynative":
        net.set_train()
        return PlainDataParallel(net, opt)
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    train = nn.TrainOneStepCell(net, opt)
    train.set_train()
    return train


def main():
    a = parse_args()
    import mindspore as ms
    from mindspore import Tensor, nn

    import mindzero
    from mindzero.core.comm_plan import summarize

    if a.mode == "pynative" and a.split_compile:
        raise SystemExit("--split-compile: PyNative compiles nothing ahead (use graph mode)")
    world = mindzero.start_data_parallel(mode=ms.PYNATIVE_MODE if a.mode == "pynative" else ms.GRAPH_MODE)
    phases = Phases()
    phases.end("init")
    net, opt = build(a, a.lazy)
    if a.fp16:  # the loss (softmax over the vocabulary) in fp32: in fp16 its sum of exponentials overflows
        import mindspore as ms
        from mindspore import amp
        loss_cell = net
        net = amp.auto_mixed_precision(net, "O2")
        loss_cell.ce.to_float(ms.float32)
    phases.end("build")
    # every weight, counted before prepare (stage 3 leaves the Parameters at their shards' shapes)
    phi = sum(int(np.prod(p.shape)) for p in net.get_parameters() if "moving_" not in p.name)
    if a.config == "dp":
        if a.pretrained:
            load_plain(net, a.pretrained)
        train = plain_dp(net, opt, a.mode)
    else:
        fusion = None
        if a.bucket_mib:
            size = int(a.bucket_mib * 2 ** 20)
            fusion = {k: {"openstate": True, "bucket_size": size} for k in ("allreduce", "reduce_scatter", "allgather")}
        flags = a.config[1:] if not a.config.endswith("bfs") else ""
        half_reduce = "h" in flags and not a.fp16
        offload = {}
        if "d" in flags:
            offload_dir = Path(a.offload_dir or Path(a.out) / "offload")
            offload_dir.mkdir(parents=True, exist_ok=True)
            offload = dict(optimizer_offload="disk", offload_dir=str(offload_dir), offload_chunk_mb=a.chunk_mb)
        # "o": owner mode for every sharded parameter, whatever the probe says
        owner = dict(update_sharding="owner") if "o" in flags else {}
        train = mindzero.prepare_train_network(net, opt, zero_stage=int(a.config[0]), comm_fusion=fusion, **owner,
                                               stage3_regather=not a.no_regather,
                                               param_dtype="float16" if a.fp16 else None,
                                               gather_quantization="int8" if "q" in flags else None,
                                               reduce_dtype="float16" if half_reduce else None,
                                               scale_sense=1024.0 if half_reduce else 1.0,
                                               gather_units="*blocks.*" if "u" in flags else None,
                                               stage3_param_persistence_threshold=a.persistence if "p" in flags else 0,
                                               compile_cache=a.compile_cache, **offload)
        if a.config.endswith("bfs"):
            train.exec_order = None  # MindSpore's default order (bfs), as before the depth-first compile
        if a.pretrained:
            report = mindzero.load_pretrained(train, a.pretrained, strict=False)
            assert report["prefix"] == "gpt." and not report["unexpected"] and not report["mismatched"], report
            assert all("_lora." in n for n in report["missing"]), report["missing"][:3]
    phases.end("prepare")
    trainable = sum(int(np.prod(p.shape)) for p in opt.parameters) if a.config == "dp" else \
        sum(s.numel for s in train.zero_info.plan if s.optimized)
    rng = np.random.RandomState(world.world_rank)
    times, losses, overflows, compile_s = [], [], 0, None
    for i in range(1 + a.steps):
        tokens = rng.randint(0, a.vocab, size=(a.batch, a.seq + 1)).astype(np.int32)
        x, y = Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:])
        if i == 0 and a.split_compile:  # the graph alone, then its first execution (the step's collectives' first run)
            t = time.perf_counter()
            train.compile(x, y)
            compile_s = time.perf_counter() - t
            phases.end("compile")
        t = time.perf_counter()
        out = train(x, y)
        loss = float((out if a.config == "dp" else out[0]).asnumpy())
        overflows += 0 if a.config == "dp" else int(out[1].asnumpy())
        times.append(time.perf_counter() - t)
        losses.append(loss)
        print(f"step {i}: {times[-1]:.2f}s loss {loss:.4f}", flush=True)
        if i == 0:
            phases.end("first_step")
    if a.steps:
        phases.end("steady")
    result = dict(config=a.config, mode=a.mode, world=world.world_size, rank=world.world_rank, phi=phi,
                  trainable=trainable,
                  lora=a.lora, pretrained=bool(a.pretrained), lazy=a.lazy,
                  first_step_s=times[0] + (compile_s or 0.0), compile_s=compile_s, first_execution_s=times[0],
                  times=times[1:], losses=losses, phases=phases.rows,
                  bucket_mib=a.bucket_mib, regather=not a.no_regather, fp16=a.fp16, overflows=overflows,
                  model=dict(vocab=a.vocab, dim=a.dim, layers=a.layers, heads=a.heads, seq=a.seq, batch=a.batch))
    if a.config == "dp":
        params = sum(p.nbytes for p in net.get_parameters())
        from mindzero.engine.optim import OptimizerLayout

        moments = sum(s.nbytes for states in OptimizerLayout(opt).states.values() for s in states)
        result["memory"] = dict(parameters=params, gradients=0, optimizer_states=moments)
        result["comm"] = result["comm_real"] = dp_comm(net, world)
        if a.time_collectives:
            result["collective_seconds"] = time_collectives(phi, world)
    else:
        rep = mindzero.memory_report(train)
        result["memory"] = {k: rep[k] for k in ("parameters", "gradients", "optimizer_states")}
        result["memory_expected"] = {k: rep["expected"][k] for k in ("parameters", "gradients", "optimizer_states")}
        result["updates"], result["balance"] = rep["updates"], rep["balance"]
        result["comm"] = summarize(train.zero_info.calls)
        result["distinct_kernels"] = len({(c.op, c.nbytes) for c in train.zero_info.calls})
        result["comm_real"] = summarize(train.zero_info.real_calls)
        if train.zero_info.offload is not None:
            held, stream = train.states.bytes(), train.states.stream
            result["offload"] = dict(disk_bytes=held["optimizer_disk"], buffer_bytes=held["offload_buffers"],
                                     grad_bytes=held["gradients"], read_bytes=stream.update_io[0],
                                     written_bytes=stream.update_io[1], update_s=stream.update_seconds,
                                     pieces=len(stream.layout.pieces), views=stream.n_views, chunk_mb=a.chunk_mb)
    out = Path(a.out)
    (out / f"rank_{world.world_rank}.json").write_text(json.dumps(result, indent=1))
    from mindzero.launch.worker import finish_rank

    finish_rank(out, world.world_rank)  # the launcher waits for it
    if a.config != "dp" and world.world_rank == 0:  # after the measurements: building the text costs memory too
        from mindzero.engine.report import plan_text
        print(plan_text(train), flush=True)


if __name__ == "__main__":
    main()
