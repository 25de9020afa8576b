"""The compile a stage-1 step cannot avoid in MindSpore graph mode: a MindSpore-only reproduction beside mindzero.

    .venv/bin/python benchmarks/compile_floor.py [--repeats 5] [--configs dp,floor,mz1,...] [--nodes]
        [--dim 512 --layers 6 --heads 8 --vocab 512 --seq 64] [--baseline DIR] [--env KEY=VALUE]
        [--out runs/compile_floor]

Every configuration compiles the train step of the example GPT (fp32 ``nn.AdamWeightDecay``) with ``Cell.compile``
in a fresh process, as rank 0 of 2 played in one process (no communication: where a collective would be, the
operation a rank's graph holds in its place: the identity for the gradient's all-reduce, ``Tile`` for the
all-gather of two equal shards, as :func:`mindzero.comm.groups.rehearse` does). Configurations, launched round-robin
``--repeats`` times so that the machine's drift falls on all of them alike (without ``--configs``: all but the
``mz3-...`` ablations and the ``cut-...`` graphs):

* ``dp``: ``nn.TrainOneStepCell`` (plain data parallel's step);
* ``floor``: written with MindSpore alone, the least a ZeRO stage-1 step adds to it: each gradient cut to this
  rank's flat shard, the optimizer over flat master shards (its states 1/2 the size), and per parameter the two
  writes that keep the network's Parameters the user's: before the update the master takes up this rank's slice of
  the parameter (so a ``load_checkpoint`` into the network takes effect), after it the parameter takes up the
  gathered masters. ``floor-no-refresh`` / ``floor-no-writeback`` / ``floor-bare``: the same without the first /
  the second / both (steps that no longer train right: they show the two writes' price);
* ``floor-finite``: ``floor`` plus the overflow check a loss-scaled step makes (every gradient tested finite, the
  update in a branch taken only when all are);
* ``floor3``: the least a stage-3 step is, written with MindSpore alone: every parameter replaced by its flat shard,
  each Cell reading the full weight through a property that rebuilds it from the shard (the gather as a rehearsal
  has it: the shard zero-padded to the full size, whose gradient, a slice, stands for the reduce-scatter), marked
  for recompute so backward gathers again; the optimizer over the shards. ``floor3-keep``: without the recompute;
  ``floor3-finite``: with the overflow check;
* ``mz0`` / ``mz1`` / ``mz3``: ``mindzero.prepare_train_network`` at stage 0 / 1 / 3 (its defaults), rehearsed the
  same way;
* ``mz3-nopersist`` / ``mz3-nocheck`` / ``mz3-nomean`` / ``mz3-bare``: ``mz3`` with a part taken out, to price it:
  the small parameters kept whole (``stage3_param_persistence_threshold=0``) / the overflow check / the multiply
  that makes the gradient sums means / all three (the last three are patched into the process's mindzero: steps
  that no longer train right);
* ``cut-primitive`` / ``cut-index``: not a step: 51 pieces cut out of one flat tensor, by a call of an
  ``ops.StridedSlice()`` instance / by Tensor indexing, to price the two ways of writing a slice in graph code.

``--baseline DIR``: a checkout of another commit (``git worktree add DIR <commit>``): each ``mz`` configuration is
also compiled from that tree's mindzero (as ``mz3@baseline``), interleaved with this tree's.

``--env KEY=VALUE`` (repeatable): every configuration is also compiled with these variables set in its process (as
``mz3+env``), interleaved, and without them otherwise (a value the caller's environment holds is removed from the
others): for example glibc's allocator settings, ``GLIBC_TUNABLES``.

Prints per configuration the median compile (wall and CPU time of the process) and their ratios to ``dp``'s, and the
graph's size (nodes of the validated graph, with ``--nodes``; costs a second compile per configuration). Writes
``results.json`` and ``results.md`` under ``--out``. Needs the machine alone: the figures are seconds.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree's mindzero, not an installed one
DEFAULT_CONFIGS = ("dp", "floor", "floor-no-refresh", "floor-no-writeback", "floor-bare", "floor-finite", "mz0", "mz1",
                   "floor3", "floor3-keep", "floor3-finite", "mz3")
CONFIGS = DEFAULT_CONFIGS + ("mz3-nopersist", "mz3-nocheck", "mz3-nomean", "mz3-bare", "cut-primitive", "cut-index")
SHAPE = dict(dim=512, layers=6, heads=8, vocab=512, seq=64)


def _finite_check():
    """The overflow check's per-gradient kernel (every element finite) and the reduction of its results, by their
    primitives (a Tensor method, ``.all()``, is parsed into a graph per call site)."""
    from mindspore import ops

    is_finite, reduce_all = ops.IsFinite(), ops.ReduceAll()
    finite = ops.MultitypeFuncGraph("floor_finite")

    @finite.register("Tensor")
    def _finite(g):
        return reduce_all(is_finite(g))

    return finite, reduce_all


def _ablate(parts) -> dict:
    """The ``mz3-...`` ablations: mindzero's stage-3 step with parts of it taken out, to price each part's compile.
    ``nopersist``: an option (``stage3_param_persistence_threshold=0``: every parameter gathered, no fused
    all-reduce of the small ones; a step that trains right); ``nocheck``: no overflow check (the update always
    runs); ``nomean``: the reduced gradients not multiplied into means (steps that no longer train right, patched
    into this process's mindzero); ``bare``: all three. Returns ``prepare_train_network``'s options."""
    import mindspore as ms
    from mindspore import ops

    from mindzero.engine import train_step

    parts = {"nocheck", "nomean", "nopersist"} if parts == ["bare"] else set(parts)
    options = {"stage3_param_persistence_threshold": 0} if "nopersist" in parts else {}
    if "nomean" in parts:
        reduction_init = train_step.Reduction.__init__

        def unscaled(self, n, units, world, scale=False, widen=False):
            reduction_init(self, n, units, world, False, widen)

        train_step.Reduction.__init__ = unscaled
    if "nocheck" in parts:
        def unchecked(self, grads, scale):
            inv = ops.reciprocal(ops.cast(scale, ms.float32) * (self.accum_steps * self.world_size))
            grads = self.boundary(grads, inv)
            overflow = self._update(grads, ops.zeros((), ms.bool_))
            return self.states.settle(self._skipped(overflow), overflow), grads

        train_step.ZeroTrainOneStepCell._apply = unchecked
    return options


def build(config: str, a):
    """The step of ``config`` and its two inputs (one process: MindSpore imported here)."""
    import numpy as np
    import mindspore as ms
    from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, LMLoss, init_params  # noqa: E402

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    if config.startswith("cut-"):  # not a step: no network to build
        return _cuts(config)
    net = LMLoss(GPT(a.vocab, a.dim, a.layers, a.heads, a.seq))
    init_params(net)
    tokens = Tensor(np.random.RandomState(0).randint(0, a.vocab, (2, a.seq)).astype(np.int32))
    if config == "dp":
        return nn.TrainOneStepCell(net, nn.AdamWeightDecay(net.trainable_params(), 1e-3)), tokens
    if config.startswith("floor3"):
        return _floor3(net, config), tokens
    if config.startswith("mz"):
        import mindzero
        from mindzero.comm.groups import rehearse

        stage, *parts = config[2:].split("-")
        options = _ablate(parts)
        with rehearse(2):
            step = mindzero.prepare_train_network(net, nn.AdamWeightDecay(net.trainable_params(), 1e-3),
                                                  zero_stage=int(stage), **options)
        return step, tokens

    ranks, rank = 2, 0
    params = net.trainable_params()
    paddings = tuple(-p.size % ranks for p in params)
    shard_sizes = tuple((p.size + pad) // ranks for p, pad in zip(params, paddings))
    masters = ParameterTuple([Parameter(Tensor(np.zeros(n, np.float32)), name="floor_master." + p.name)
                              for p, n in zip(params, shard_sizes)])
    slicer = ops.StridedSlice()
    finite, reduce_all = _finite_check()
    shard = ops.MultitypeFuncGraph("floor_shard")
    refresh = ops.MultitypeFuncGraph("floor_refresh")
    write_back = ops.MultitypeFuncGraph("floor_write_back")

    def own(x, padding, size):
        flat = x.reshape((-1,))
        if padding:
            flat = ops.concat((flat, ops.zeros((padding,), flat.dtype)))
        return slicer(flat, (rank * size,), ((rank + 1) * size,), (1,))

    @shard.register("Number", "Number", "Tensor")
    def _shard(padding, size, g):
        return own(g, padding, size)

    @refresh.register("Number", "Number", "Tensor", "Tensor")
    def _refresh(padding, size, master, param):
        return ops.assign(master, own(param, padding, size))

    @write_back.register("Tensor", "Tensor")
    def _write_back(param, master):
        full = ops.tile(master, (ranks,))
        if full.shape[0] != param.size:
            full = slicer(full, (0,), (param.size,), (1,))
        return ops.assign(param, full.reshape(param.shape))

    class FloorStep(nn.Cell):
        """Forward and backward, the gradients cut to this rank's shards, the masters refreshed, the update, the
        write-back: each per parameter, mapped (MindSpore's idiom, ``nn/wrap/grad_reducer.py``)."""

        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net, self.params, self.masters = net, ParameterTuple(params), masters
            self.optimizer = nn.AdamWeightDecay(masters, 1e-3)
            self.grad = ops.GradOperation(get_by_list=True)
            self.map = ops.Map()
            self.paddings, self.sizes = paddings, shard_sizes
            self.do_refresh = config in ("floor", "floor-no-writeback", "floor-finite")
            self.do_write_back = config in ("floor", "floor-no-refresh", "floor-finite")
            self.check = config == "floor-finite"

        def update(self, grads):
            done = grads
            if self.do_refresh:
                done = ops.depend(grads, self.map(refresh, self.paddings, self.sizes, self.masters, self.params))
            done = self.optimizer(done)
            if self.do_write_back:
                done = ops.depend(done, self.map(write_back, self.params, self.masters))
            return done

        def construct(self, x, y):
            loss = self.net(x, y)
            grads = self.grad(self.net, self.params)(x, y)
            grads = self.map(shard, self.paddings, self.sizes, grads)
            if self.check:
                ok = reduce_all(ops.stack(self.map(finite, grads)))
                if ok:
                    self.update(grads)
                return loss
            return ops.depend(loss, self.update(grads))

    return FloorStep(), tokens


def _cuts(config: str):
    """``cut-primitive`` / ``cut-index``: a graph of nothing but 51 pieces cut out of one flat tensor and reshaped (as
    stage 3 cuts its small parameters' gradients out of their fused all-reduce), each piece by a call of an
    ``ops.StridedSlice()`` instance / by Tensor indexing (``flat[a:b]``). The same ``StridedSlice`` nodes either way;
    what differs is MindSpore's front end. Returns the Cell and its input (given twice, like the steps' tokens)."""
    import numpy as np
    from mindspore import Tensor, nn, ops

    sizes = [512 * (1 + i % 4) for i in range(51)]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    where = tuple((o, n, (n // 512, 512)) for o, n in zip(offsets, sizes))
    strided_slice = ops.StridedSlice()
    cut = ops.MultitypeFuncGraph("compile_floor_cut")

    if config == "cut-primitive":
        @cut.register("Tensor", "Tuple")
        def _cut(flat, piece):
            offset, numel, shape = piece
            return strided_slice(flat, (offset,), (offset + numel,), (1,)).reshape(shape)
    else:
        @cut.register("Tensor", "Tuple")
        def _cut(flat, piece):
            offset, numel, shape = piece
            return flat[offset:offset + numel].reshape(shape)

    class Cuts(nn.Cell):
        def construct(self, flat, unused):
            return ops.Map()(ops.partial(cut, flat), where)

    return Cuts(), Tensor(np.arange(sum(sizes), dtype=np.float32))


def _floor3(net, config: str):
    """The least a stage-3 step is, written with MindSpore alone: every Parameter of ``net`` replaced by this rank's
    flat shard (rank 0 of 2), each Cell reading its weight through a property (its own ``construct`` unchanged)
    that rebuilds the full value from the shard: the gather as a rehearsal has it (the shard zero-padded to the
    full flat size; the padding's gradient, a slice, stands for the reduce-scatter), the parameter's padding cut,
    the shape restored; one reader per shape, called as a method (inlined). ``floor3`` marks the reader's
    primitives for recompute, so backward gathers again instead of keeping the full value from forward (what
    stage 3 does by default); ``floor3-keep`` does not; ``floor3-finite`` adds the overflow check. The optimizer
    updates the shards; there is nothing to refresh or write back."""
    import numpy as np
    from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

    ranks = 2

    def regathered(prim):
        """``prim``, recomputed in backward unless ``floor3-keep``."""
        if config != "floor3-keep":
            prim.recompute()
        return prim

    class Reader(nn.Cell):
        def __init__(self, shape, shard):
            super().__init__(auto_prefix=False)
            self.shape = shape
            self.pad = regathered(ops.Pad(((0, shard * (ranks - 1)),)))
            self.reshape = regathered(ops.Reshape())

        def rebuild(self, shard):
            return self.reshape(self.pad(shard), self.shape)

    class PaddedReader(Reader):  # a class of its own: a Python ``if`` in ``rebuild`` would parse into branch graphs
        def __init__(self, shape, shard, numel):
            super().__init__(shape, shard)
            self.numel, self.cut = numel, regathered(ops.StridedSlice())

        def rebuild(self, shard):
            return self.reshape(self.cut(self.pad(shard), (0,), (self.numel,), (1,)), self.shape)

    def reading(attr):
        def full(self):
            return getattr(self, "_floor_read_" + attr).rebuild(getattr(self, attr + "_floor_shard"))
        full.__name__ = attr
        return property(full)

    shards, readers, classes = {}, {}, {}
    for _, cell in net.cells_and_names():
        attrs = []
        for attr, param in list(cell._params.items()):
            if param is None:
                continue
            padding = -param.size % ranks
            size = (param.size + padding) // ranks
            if param.name not in shards:
                flat = np.concatenate([param.asnumpy().reshape(-1), np.zeros(padding, np.float32)])
                shards[param.name] = Parameter(Tensor(flat[:size]), name=param.name)
            key = (tuple(param.shape), padding)
            if key not in readers:
                readers[key] = PaddedReader(key[0], size, param.size) if padding else Reader(key[0], size)
            del cell._params[attr]
            cell.insert_param_to_cell(attr + "_floor_shard", shards[param.name])
            cell.insert_child_to_cell("_floor_read_" + attr, readers[key])
            attrs.append(attr)
        if attrs:
            key = (type(cell), tuple(sorted(attrs)))
            if key not in classes:
                classes[key] = type(type(cell).__name__, (type(cell),), {a: reading(a) for a in key[1]})
            cell.__class__ = classes[key]
    finite, reduce_all = _finite_check()

    class Floor3Step(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net, self.shards = net, ParameterTuple(list(shards.values()))
            self.optimizer = nn.AdamWeightDecay(self.shards, 1e-3)
            self.grad = ops.GradOperation(get_by_list=True)
            self.map = ops.Map()
            self.check = config == "floor3-finite"

        def construct(self, x, y):
            loss = self.net(x, y)
            grads = self.grad(self.net, self.shards)(x, y)
            if self.check:
                ok = reduce_all(ops.stack(self.map(finite, grads)))
                if ok:
                    self.optimizer(grads)
                return loss
            return ops.depend(loss, self.optimizer(grads))

    return Floor3Step()


def one(config: str, a) -> dict:
    """Compile ``config``'s step once in this process; with ``--nodes`` count the validated graph's nodes."""
    import contextlib
    import re
    import resource
    import tempfile

    from tests.support.graphs import last_graph, saved_graphs

    step, tokens = build(config, a)
    folder = tempfile.mkdtemp() if a.nodes else None
    with saved_graphs(folder, "validate") if folder else contextlib.nullcontext():
        t, cpu = time.perf_counter(), time.process_time()
        step.compile(tokens, tokens)
        out = {"compile_s": time.perf_counter() - t, "cpu_s": time.process_time() - cpu}
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the process's, this far
    if config.startswith("mz"):
        out["mindzero"] = str(Path(sys.modules["mindzero"].__file__).parents[1])
    if folder:
        out["nodes"] = len(re.findall(r"^\s*%\d+\([^)]*\) = ", last_graph(folder, "validate"), re.M))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--nodes", action="store_true", help="also count the validated graph's nodes")
    ap.add_argument("--baseline", help="a checkout of another commit: its mindzero compiled beside this tree's")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="also compile every configuration with KEY=VALUE in its environment (rows <config>+env)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="runs/compile_floor")
    for key, value in SHAPE.items():
        ap.add_argument(f"--{key}", type=int, default=value)
    a = ap.parse_args(argv)
    if a.one:
        if a.tree:  # the mindzero of that tree, ahead of this one's
            sys.path.insert(0, a.tree)
        print(json.dumps(one(a.one, a)))
        return
    configs = a.configs.split(",")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        ap.error(f"--configs: unknown {unknown}; choose from {','.join(CONFIGS)}")
    shape = [f"--{k}={getattr(a, k)}" for k in SHAPE]
    extra = {}
    for item in a.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--env {item!r}: expected KEY=VALUE")
        extra[key] = value
    plain = {k: v for k, v in os.environ.items() if k not in extra}
    # (row, config, the tree whose mindzero it imports, the process's environment)
    jobs = [(c, c, ROOT, plain) for c in configs]
    if a.baseline:
        jobs += [(c + "@baseline", c, Path(a.baseline).resolve(), plain) for c in configs if c.startswith("mz")]
    if extra:
        jobs += [(row + "+env", c, tree, {**plain, **extra}) for row, c, tree, _ in jobs]
    runs = {row: [] for row, _, _, _ in jobs}
    for r in range(a.repeats):
        for row, c, tree, env in jobs:
            cmd = [sys.executable, __file__, "--one", c, "--tree", str(tree), *shape] + \
                (["--nodes"] if a.nodes and r == 0 else [])
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
            if done.returncode:
                sys.exit(f"{row}: exit {done.returncode}\n{done.stderr[-3000:]}")
            runs[row].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"  {row} run {r}: {runs[row][-1]['compile_s']:.2f}s (CPU {runs[row][-1]['cpu_s']:.2f}s)", flush=True)
    dp = statistics.median(x["compile_s"] for x in runs["dp"]) if "dp" in runs else None
    dp_cpu = statistics.median(x["cpu_s"] for x in runs["dp"]) if "dp" in runs else None
    rows = []
    for c in runs:
        times = [x["compile_s"] for x in runs[c]]
        row = dict(config=c, compile_s=statistics.median(times), runs=times,
                   cpu_s=statistics.median(x["cpu_s"] for x in runs[c]),
                   peak_rss_mib=statistics.median(x["peak_rss_mib"] for x in runs[c]),
                   nodes=next((x["nodes"] for x in runs[c] if "nodes" in x), None))
        row["vs_dp"] = row["compile_s"] / dp if dp else None
        row["cpu_vs_dp"] = row["cpu_s"] / dp_cpu if dp else None
        rows.append(row)
    lines = ["| config | compile s (median) | vs plain DP | CPU s (median) | CPU vs plain DP | peak RSS MiB (median) | "
             "validated graph nodes | every compile s |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ratio = f"{row['vs_dp']:.2f}x" if row["vs_dp"] else ""
        cpu_ratio = f"{row['cpu_vs_dp']:.2f}x" if row["cpu_vs_dp"] else ""
        lines.append(f"| {row['config']} | {row['compile_s']:.2f} | {ratio} | {row['cpu_s']:.2f} | {cpu_ratio} | "
                     f"{row['peak_rss_mib']:.0f} | {row['nodes'] or ''} | "
                     + ", ".join(f"{t:.2f}" for t in row["runs"]) + " |")
    table = "\n".join(lines)
    print(table)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "benchmarks/compile_floor.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "results.json").write_text(json.dumps(dict(command=command, shape={k: getattr(a, k) for k in SHAPE},
                                                      env=extra, rows=rows), indent=1))
    (out / "results.md").write_text(f"`{command}`\n\n{table}\n")


if __name__ == "__main__":
    main()
