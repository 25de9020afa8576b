"""``optimizer_offload="disk"`` in one process: every supported optimizer bit for bit as in memory (parameters cut
into pieces where the optimizer allows it), built eagerly and under ``lazy_init``; checkpoints through the file
(into and from an in-memory run); the refusals before training; the file's lifetime; the plan's numbers.
The 2-rank runs (clipping, overflow, param_dtype, accumulation) are in tests/multirank."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn

import mindzero
from mindzero.core.offload import OffloadError
from mindzero.engine.offload import splits_parameters
from tests.support.models import OPTIMIZERS, runs_here

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")
CHUNK_MB = 0.05  # 3276 elements of two fp32 states: cut at 4096 (PIECE_ALIGN), so 13000-element shards split


class Net(nn.Cell):
    """Shards of 13000 and 6500 elements (cut into pieces), a bias of 100 and a 1-element scale (whole pieces; not
    0-d: mint.optim fails on 0-d parameters in memory too, tests/support/scenarios.py; the 2-rank accumulation rows
    train the awkward net's 0-d parameter with nn.Adam)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Dense(260, 100)
        self.b = nn.Dense(100, 130, has_bias=False)
        self.scale = ms.Parameter(Tensor(np.full((1,), 0.5, np.float32)), name="scale")
        self.loss = nn.MSELoss()

    def construct(self, x, y):
        return self.loss(self.b(ms.ops.tanh(self.a(x))) * self.scale, y)


def build(kind, lazy=False):
    ms.set_seed(5)
    np.random.seed(5)
    if lazy:
        with mindzero.lazy_init():
            net = Net()
            return net, OPTIMIZERS[kind](net.trainable_params())
    net = Net()
    return net, OPTIMIZERS[kind](net.trainable_params())


def train(kind, stage, steps=3, lazy=False, inf_at=None, **options):
    """``inf_at``: the micro-step whose input holds an inf (its gradients overflow)."""
    net, opt = build(kind, lazy)
    step = mindzero.prepare_train_network(net, opt, zero_stage=stage, **options)
    rng = np.random.RandomState(0)
    losses, overflows = [], []
    for i in range(steps):
        x = rng.randn(4, 260).astype(np.float32)
        if i == inf_at:
            x[0, 0] = np.inf
        out = step(Tensor(x), Tensor(rng.randn(4, 130).astype(np.float32)))
        losses.append(float(out[0].asnumpy()))
        overflows.append(bool(out[1].asnumpy()))
    step.overflows = overflows
    return losses, mindzero.gather_full_state_dict(step), step


def assert_identical(a, b, what):
    assert a[0] == b[0], (what, a[0], b[0])
    for k in a[1]:
        np.testing.assert_array_equal(a[1][k], b[1][k], err_msg=f"{what}: {k}")


# every optimizer at stage 3 and AdamWeightDecay at stage 1 in the default suite; the rest in the full tier
CASES = [pytest.param(kind, stage, id=f"{kind}-{stage}",
                      marks=() if stage == 3 or (kind, stage) == ("adamw", 1) else pytest.mark.full)
         for kind in ("adamw", "adam", "sgd", "momentum", "mint_adam", "mint_sgd") for stage in (1, 2, 3)
         if (stage != 2 or kind == "adamw") and runs_here(kind)]


@pytest.mark.parametrize("kind, stage", CASES)
def test_every_optimizer_equals_the_update_in_memory(tmp_path, kind, stage):
    ref = train(kind, stage)
    got = train(kind, stage, optimizer_offload="disk", offload_dir=str(tmp_path), offload_chunk_mb=CHUNK_MB)
    assert_identical(got, ref, f"{kind} stage {stage}")
    disk = got[2].zero_info.offload  # the states' file
    pieces = len(disk.layout.pieces)
    if splits_parameters(got[2].optimizer):  # cut inside the parameters
        assert pieces > len(disk.numels), (kind, pieces)
    else:  # nn.Adam's fused kernel and the others: whole parameters (core/offload.py says why)
        assert pieces == len(disk.numels), (kind, pieces)
    rep = mindzero.memory_report(got[2])
    assert rep["optimizer_moments"] == 0 and rep["optimizer_disk"] == rep["expected"]["optimizer_disk"] > 0
    assert rep["offload_buffers"] == rep["expected"]["offload_buffers"]
    assert rep["gradients"] == rep["expected"]["gradients"]


def test_a_lazily_built_network_never_holds_its_states(tmp_path):
    """Under lazy_init each state is made as a shard and written out at once: the optimizer ends with one-element
    stand-ins, and training equals the eager in-memory run."""
    ref = train("adamw", 3)
    got = train("adamw", 3, lazy=True, optimizer_offload="disk", offload_dir=str(tmp_path), offload_chunk_mb=CHUNK_MB)
    assert_identical(got, ref, "lazy stage 3")
    opt = got[2].optimizer
    assert all(p.shape == (1,) for attr in got[2].zero_info.state_attrs for p in getattr(opt, attr))


def test_accumulation_clipping_and_a_skipped_overflow(tmp_path):
    """K=2, clipping and a dynamic loss scale; the second update's micro-batch holds an inf (skipped, the scale
    halved): as in memory, and the EMA too."""
    def options():
        return dict(gradient_accumulation_steps=2, scale_sense=nn.DynamicLossScaleUpdateCell(1024.0, 2, 1000),
                    clip_grad=True, clip_norm=0.1, ema=0.9)
    ref = train("adamw", 3, steps=6, inf_at=3, **options())
    got = train("adamw", 3, steps=6, inf_at=3, optimizer_offload="disk", offload_dir=str(tmp_path),
                offload_chunk_mb=CHUNK_MB, **options())
    assert_identical(got, ref, "accumulation")
    assert got[2].overflows == ref[2].overflows and got[2].overflows[3], got[2].overflows
    assert float(got[2].scale_sense.asnumpy()) == 512.0
    ema_ref, ema_got = (mindzero.gather_full_state_dict(r[2], ema=True) for r in (ref, got))
    for k in ema_ref:
        np.testing.assert_array_equal(ema_got[k], ema_ref[k], err_msg=k)


def test_checkpoints_go_through_the_file(tmp_path):
    """A disk run's checkpoint holds the states (same format: an in-memory run resumes from it bit for bit), and a
    disk run resumes from an in-memory run's checkpoint; both equal training straight through."""
    rng = np.random.RandomState(1)
    data = [(Tensor(rng.randn(4, 260).astype(np.float32)), Tensor(rng.randn(4, 130).astype(np.float32)))
            for _ in range(4)]

    def run(disk, load=None, save=None, steps=range(4)):
        net, opt = build("adamw")
        options = dict(optimizer_offload="disk", offload_dir=str(tmp_path), offload_chunk_mb=CHUNK_MB) if disk else {}
        step = mindzero.prepare_train_network(net, opt, zero_stage=3, **options)
        if load:
            mindzero.load_checkpoint(step, load)
        losses = []
        for i in steps:
            losses.append(float(step(*data[i])[0].asnumpy()))
            if save and i == 1:
                mindzero.save_checkpoint(step, save)
        return losses, mindzero.gather_full_state_dict(step)

    straight = run(False, save=tmp_path / "mem_ckpt")
    disk_saved = run(True, save=tmp_path / "disk_ckpt")
    assert_identical(disk_saved, straight, "disk run")
    for name, disk in (("disk_ckpt", False), ("mem_ckpt", True)):
        resumed = run(disk, load=tmp_path / name, steps=range(2, 4))
        assert resumed[0] == straight[0][2:], (name, resumed[0], straight[0])
        for k in straight[1]:
            np.testing.assert_array_equal(resumed[1][k], straight[1][k], err_msg=f"{name}: {k}")
    # the two checkpoints hold the same tensors, bit for bit (states included)
    from mindzero.checkpoint.source import Source
    a, b = Source(tmp_path / "disk_ckpt"), Source(tmp_path / "mem_ckpt")
    names = sorted(t.name for t in a.ref.tensors)
    assert names == sorted(t.name for t in b.ref.tensors) and any(n.startswith("adam_m.") for n in names)
    for t in a.ref.tensors:
        np.testing.assert_array_equal(a.piece_for(t, 0), b.piece_for(b.entry(t.name), 0), err_msg=t.name)


def test_refusals_come_before_training_and_name_the_directory(tmp_path):
    for path, rule in ((tmp_path / "missing", "does not exist"), ("/proc/1", "is not writable")):
        net, opt = build("adamw")
        with pytest.raises(OffloadError, match=rf"offload_dir '{path}' {rule}.*bytes \(.* MiB\) of optimizer states"):
            mindzero.prepare_train_network(net, opt, zero_stage=3, optimizer_offload="disk", offload_dir=str(path))
    net, opt = build("adamw")
    with pytest.raises(ValueError, match="optimizer_offload='disk' needs zero_stage 1, 2 or 3"):
        mindzero.prepare_train_network(net, opt, zero_stage=0, optimizer_offload="disk", offload_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_optimizers_it_cannot_stream_are_refused_naming_the_rule(tmp_path):
    """Disk offload streams flat parameters' states shaped as their parameters through views of the optimizer:
    an owner-mode optimizer (mindone's CAME), a per-parameter scalar state (ASGD's ``eta``) and a per-parameter
    attribute mindzero does not know (mindone Muon's ``use_muon``) are refused before any file exists."""
    from tests.support.optimizers import build as opt_net, came, muon

    for make, rule in ((came, r"optimizer_offload='disk' streams optimizers that update each element from that "
                              r"element alone; CAME updates parameter 'inp.weight' whole on an owner rank"),
                       (lambda ps: nn.ASGD(ps, 0.01), r"streams states shaped as their parameters; ASGD keeps "
                                                     r"'mu' of shape \(\) for parameter 'inp.weight'"),
                       (muon, r"streams optimizers that update each element from that element alone; Muon updates "
                              r"parameter 'inp.weight' whole")):
        net = opt_net()
        with pytest.raises(ValueError, match=rule):
            mindzero.prepare_train_network(net, make(net.trainable_params()), zero_stage=2, optimizer_offload="disk",
                                           offload_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_the_file_is_removed_unless_kept_and_a_dead_process_file_is_cleared(tmp_path):
    _, _, step = train("adamw", 3, steps=1, optimizer_offload="disk", offload_dir=str(tmp_path))
    path = step.states.disk.file.path
    assert path.exists() and path.parent == tmp_path / "rank_0"
    text = mindzero.engine.report.plan_text(step)
    assert f"of optimizer states in {path}" in text and "MiB read +" in text, text
    step.states.close()  # what process exit does (tests/multirank/test_offload.py: after a launch)
    assert not path.exists() and not (tmp_path / "rank_0").exists()
    _, _, kept = train("adamw", 3, steps=1, optimizer_offload="disk", offload_dir=str(tmp_path), offload_keep=True)
    path = kept.states.disk.file.path
    kept.states.close()
    assert path.exists()
    # a file whose process is gone (a killed rank's) is removed by the next run on this machine
    stale = path.with_name(path.name.replace(f"_{__import__('os').getpid()}_", "_999999999_"))
    path.rename(stale)
    _, _, step = train("adamw", 3, steps=1, optimizer_offload="disk", offload_dir=str(tmp_path))
    assert not stale.exists()


def test_estimate_memory_agrees_with_the_run(tmp_path):
    net, _ = build("adamw")
    est = mindzero.estimate_memory(net, 3, 1, "adamw", optimizer_offload="disk", offload_dir=str(tmp_path),
                                   offload_chunk_mb=CHUNK_MB)
    _, _, step = train("adamw", 3, steps=1, optimizer_offload="disk", offload_dir=str(tmp_path),
                       offload_chunk_mb=CHUNK_MB)
    rep = mindzero.memory_report(step)
    for key in ("optimizer_disk", "disk_io_per_step", "offload_buffers", "gradients", "optimizer_states"):
        assert est[key] == rep[key], (key, est[key], rep[key])


def test_the_splittable_table_names_real_classes():
    """core/offload.SPLITTABLE_OPTIMIZERS (the one table the offload and the estimates read) names classes
    MindSpore has, by the name the offload compares."""
    import importlib

    from mindzero.core.offload import SPLITTABLE_OPTIMIZERS
    from mindzero.engine.optim import qualified_name

    for name in SPLITTABLE_OPTIMIZERS:
        module, _, cls = name.rpartition(".")
        assert qualified_name(getattr(importlib.import_module(module), cls)) == name, name
