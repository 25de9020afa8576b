"""Checkpoints across processes: resume bit-identical (fresh processes), merge into the plain network,
mindone-style convert_checkpoints, reshard 4->2 (stage 3->2) and 2->4 (stage 1->3) with continued training."""
import dataclasses

import numpy as np
import pytest

import mindzero
from mindzero.launch.local import msrun
from tests.support.compare import load_npz
from tests.support.scenarios import CheckpointCase as Case
from tests.support.scenarios import cases_arg

from . import WORKERS

STAGES = (0, 1, 2, 3)


def load(out, rank, name):
    return load_npz(out / f"rank_{rank}" / f"{name}.npz")


def launch(n, out, phase, cases):
    msrun(WORKERS / "worker_checkpoint.py", n, out, ["--phase", phase, "--cases", cases_arg(cases)], timeout=900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """All launches once: 2-rank and 4-rank training with saves, reshards, then fresh resumes."""
    root = tmp_path_factory.mktemp("ckpt")
    ck = root / "checkpoints"
    two = [Case(f"mixed-{s}", "mixed", s, str(ck / f"mixed-{s}"), format="safetensors" if s == 2 else "ckpt",
                full_path=str(ck / f"full-{s}.ckpt")) for s in STAGES]
    two += [Case("resnet-3", "resnet", 3, str(ck / "resnet-3")), Case("awk2-s1", "awkward", 1, str(ck / "awk2-s1"))]
    two += [Case(f"mp-mixed-{s}", "mixed", s, str(ck / f"mp-mixed-{s}"), param_dtype="float16") for s in (1, 3)]
    two += [Case("mixed-3-async", "mixed", 3, str(ck / "mixed-3-async"), async_save=True)]
    two += [Case("lora-3", "lora", 3, str(ck / "lora-3"))]  # frozen weights sharded, buffers per rank
    # mint.optim's Adam (AMSGrad, two groups): its states, the per-group max_exp_avg_sq and its step counter
    two += [Case("mint-2", "mixed", 2, str(ck / "mint-2"), optimizer="mint_adam")]
    # stage 3 with the mixed net's biases kept whole (stage3_param_persistence_threshold)
    two += [Case("persist-3", "mixed", 3, str(ck / "persist-3"), persist=64)]
    # mindone's CAME: every sharded parameter's states whole on its owner rank (owner mode), fp32 and param_dtype
    two += [Case("came-2", "mixed", 2, str(ck / "came-2"), optimizer="came"),
            Case("came-3", "awkward", 3, str(ck / "came-3"), optimizer="came"),
            Case("mp-came-1", "mixed", 1, str(ck / "mp-came-1"), param_dtype="float16", optimizer="came")]
    four = [Case("awk4-s3", "awkward", 3, str(ck / "awk4-s3"))]
    launch(2, root / "train2", "train", two)
    launch(4, root / "train4", "train", four)
    mindzero.reshard_checkpoint(ck / "awk4-s3", ck / "awk4-to-2-s2", 2, stage=2, log=None)
    mindzero.reshard_checkpoint(ck / "awk2-s1", ck / "awk2-to-4-s3", 4, stage=3, log=None)
    mindzero.reshard_checkpoint(ck / "came-3", ck / "came-3-to-4-s2", 4, stage=2, log=None)
    resume2 = [dataclasses.replace(c, async_save=False, full_path=None) for c in two[:5] + two[6:]]
    resume2 += [Case("awk4-to-2", "awkward", 2, str(ck / "awk4-to-2-s2"))]
    # resume anywhere: load_checkpoint straight from another world size, stage or precision
    resume2 += [Case("awk4-direct-2", "awkward", 2, str(ck / "awk4-s3")),
                Case("mp3-into-fp32", "mixed", 3, str(ck / "mp-mixed-3")),
                Case("fp32-into-mp1", "mixed", 1, str(ck / "mixed-1"), param_dtype="float16")]
    launch(2, root / "resume2", "resume", resume2)
    launch(4, root / "resume4", "resume", [Case("awk2-to-4", "awkward", 3, str(ck / "awk2-to-4-s3")),
                                           Case("awk2-direct-4", "awkward", 3, str(ck / "awk2-s1")),
                                           Case("lora2-direct-4", "lora", 3, str(ck / "lora-3")),
                                           Case("persist-direct-4", "mixed", 3, str(ck / "persist-3"), persist=64),
                                           Case("came3-direct-4", "awkward", 3, str(ck / "came-3"), optimizer="came"),
                                           Case("came3-to-4", "awkward", 2, str(ck / "came-3-to-4-s2"),
                                                optimizer="came")])
    return root


@pytest.mark.parametrize("name", [f"mixed-{s}" for s in STAGES] + ["resnet-3", "mp-mixed-1", "mp-mixed-3",
                                                                   "mixed-3-async", "lora-3", "mint-2", "persist-3",
                                                                   "came-2", "came-3", "mp-came-1"])
def test_resume_in_fresh_processes(runs, name):
    """Fresh processes restore the saved state bit for bit, and continue exactly as the run that never
    stopped. Exception, measured: the BatchNorm/Conv2d net at 2 ranks differs by 1 ulp in its 3rd resumed
    loss although every restored tensor is bit-equal; plain data parallel (stage 0) does the same and one
    process is exact, so it is MindSpore's CPU kernels, not missing state (docs/checkpoints.md)."""
    exact = not name.startswith("resnet")
    for r in range(2):
        straight, resumed = load(runs / "train2", r, name), load(runs / "resume2", r, name)
        for k in (k for k in straight if k.startswith("saved/")):
            np.testing.assert_array_equal(resumed["loaded/" + k[6:]], straight[k], err_msg=f"{name} rank {r} {k}")
        for k in (k for k in straight if k.startswith("savedmaster/")):  # param_dtype: the fp32 masters too
            np.testing.assert_array_equal(resumed["loadedmaster/" + k[12:]], straight[k], err_msg=f"{name} {k}")
            assert straight[k].dtype == np.float32
        if exact:
            assert resumed["last"].tolist() == straight["last"].tolist(), (r, resumed["last"], straight["last"])
        np.testing.assert_allclose(resumed["last"], straight["last"], rtol=1e-6, atol=0)
        for k in (k for k in straight if k.startswith("param/")):
            if exact:
                np.testing.assert_array_equal(resumed[k], straight[k], err_msg=f"{name} rank {r} {k}")
            else:
                np.testing.assert_allclose(resumed[k], straight[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_every_stage_trains_as_stage_0_without_the_parallel_context(runs, stage):
    """The 2-rank training launch never sets MindSpore's auto-parallel context (``start_data_parallel`` sets none,
    and no plain-DP reference runs in it: its ``parallel_mode`` stays ``stand_alone``): each stage trains the mixed
    net as stage 0 does, bit for bit, every loss and every parameter after 3 and after 6 steps."""
    for r in range(2):
        ref, got = load(runs / "train2", r, "mixed-0"), load(runs / "train2", r, f"mixed-{stage}")
        assert str(ref["parallel_mode"]) == str(got["parallel_mode"]) == "stand_alone", (r, got["parallel_mode"])
        assert got["first"].tolist() == ref["first"].tolist() and got["last"].tolist() == ref["last"].tolist(), r
        names = [k for k in ref if k.startswith(("saved/", "param/"))]
        assert len(names) == 2 * len([k for k in ref if k.startswith("param/")]) > 0
        for k in names:
            np.testing.assert_array_equal(got[k], ref[k], err_msg=f"stage {stage} rank {r} {k}")


@pytest.mark.parametrize("stage", STAGES)
def test_merge_loads_into_plain_network(runs, stage, tmp_path):
    import mindspore as ms
    from tests.support.models import build

    saved = load(runs / "train2", 0, f"mixed-{stage}")
    fmt = "safetensors" if stage == 2 else "ckpt"
    out = tmp_path / f"merged.{fmt}"
    summary = mindzero.merge_checkpoint(runs / "checkpoints" / f"mixed-{stage}", out, format=fmt, log=None)
    net = build("mixed")
    not_loaded, _ = ms.load_param_into_net(net, ms.load_checkpoint(str(out), format=fmt))
    assert not_loaded == [] and summary["tensors"] == len(list(net.get_parameters()))
    for p in net.get_parameters():
        np.testing.assert_array_equal(p.asnumpy(), saved["saved/" + p.name], err_msg=p.name)
    # the online one-call full checkpoint (rank 0 wrote it) is the same
    online = ms.load_checkpoint(str(runs / "checkpoints" / f"full-{stage}.ckpt"))
    for p in net.get_parameters():
        np.testing.assert_array_equal(online[p.name].asnumpy(), p.asnumpy(), err_msg=p.name)


def test_merge_with_optimizer_states(runs, tmp_path):
    out = tmp_path / "with_opt.ckpt"
    mindzero.merge_checkpoint(runs / "checkpoints" / "mixed-3", out, with_optimizer=True, log=None)
    from mindzero.checkpoint.tensor_io import CkptReader

    names = CkptReader(out).names()
    assert "adam_m.inp.weight" in names and "adam_v.out.bias" in names and "global_step" in names
    assert CkptReader(out).meta("adam_m.inp.weight")[1] == (20, 12)


def test_merge_mint_optimizer_states(runs, tmp_path):
    """A ``mint.optim.Adam`` (AMSGrad) checkpoint at stage 2 merges with its states: each of ``exp_avg``,
    ``exp_avg_sq`` and the per-group ``max_exp_avg_sq`` whole, and its step. (``max_exp_avg_sq`` stays zero:
    MindSpore 2.10's AMSGrad kernel rebinds a local name instead of writing the Parameter, in plain MindSpore as
    here, which the parity launch's reference loop shows bit for bit.)"""
    from mindzero.checkpoint.tensor_io import CkptReader

    out = tmp_path / "mint.ckpt"
    mindzero.merge_checkpoint(runs / "checkpoints" / "mint-2", out, with_optimizer=True, log=None)
    reader = CkptReader(out)
    names = reader.names()
    for prefix in ("exp_avg.", "exp_avg_sq.", "max_exp_avg_sq."):
        assert reader.meta(prefix + "inp.weight")[1] == (20, 12), (prefix, names)
    assert all(np.any(reader.read(n) != 0) for n in names if n.startswith("exp_avg"))
    assert np.asarray(reader.read("state_step")).reshape(-1)[0] == 3  # saved after 3 steps (worker_checkpoint)


def test_mindone_style_convert_checkpoints(runs, tmp_path):
    import shutil

    src = tmp_path / "ck"
    shutil.copytree(runs / "checkpoints" / "mixed-3", src)
    out = mindzero.convert_checkpoints(str(src / "rank_{}.ckpt"), str(src / "params_split_info_{}.json"), 2)
    assert out == str(src / "rank_all_2.ckpt")
    import mindspore as ms

    merged = ms.load_checkpoint(out)
    saved = load(runs / "train2", 0, "mixed-3")
    for k in (k for k in saved if k.startswith("saved/")):
        np.testing.assert_array_equal(merged[k[len("saved/"):]].asnumpy(), saved[k])
    with pytest.raises(mindzero.MergeError, match="group_size is 4, but the checkpoint was saved by 2"):
        mindzero.convert_checkpoints(str(src / "rank_{}.ckpt"), str(src / "params_split_info_{}.json"), 4)


def _global(out, name, n):
    runs = [load(out, r, name) for r in range(n)]
    return np.mean([r["last"] for r in runs], axis=0), runs[0]


@pytest.mark.parametrize("src, dst, n_src, n_dst", [("train4", "resume2", 4, 2), ("train2", "resume4", 2, 4)])
def test_reshard_continues_like_the_original_world(runs, src, dst, n_src, n_dst):
    """4 ranks stage 3 -> 2 ranks stage 2, and 2 ranks stage 1 -> 4 ranks stage 3: the continuation
    (global mean loss per step, final parameters) equals the run that went on in the original world."""
    ref_name, new_name = ("awk4-s3", "awk4-to-2") if n_src == 4 else ("awk2-s1", "awk2-to-4")
    ref_loss, ref = _global(runs / src, ref_name, n_src)
    new_loss, new = _global(runs / dst, new_name, n_dst)
    np.testing.assert_allclose(new_loss, ref_loss, rtol=1e-5)
    for k in (k for k in ref if k.startswith("param/")):
        err = np.max(np.abs(new[k] - ref[k])) / max(np.max(np.abs(ref[k])), 1e-12)
        assert err <= 1e-5, f"{k}: {err:.2e}"
    # the continuation really trained: parameters moved after the save
    assert any(np.max(np.abs(ref["param/" + k[6:]] - ref[k])) > 1e-4 for k in ref if k.startswith("saved/"))


@pytest.mark.parametrize("direct, resharded, n", [("awk4-direct-2", "awk4-to-2", 2), ("awk2-direct-4", "awk2-to-4", 4)])
def test_load_from_another_world_size_equals_reshard_then_load(runs, direct, resharded, n):
    """load_checkpoint straight from the 4-rank stage-3 checkpoint into 2 ranks at stage 2 (and 2-rank stage 1
    into 4 ranks at stage 3) restores and continues exactly as mindzero-reshard followed by a load."""
    out = runs / ("resume2" if n == 2 else "resume4")
    for r in range(n):
        a, b = load(out, r, direct), load(out, r, resharded)
        assert sorted(a) == sorted(b)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{direct} rank {r} {k}")


def test_load_across_precision_policies(runs):
    """A param_dtype=float16 checkpoint loaded by a full-precision run gets the fp32 master values; a
    full-precision checkpoint loaded by a param_dtype run gets its values as the masters (not rounded
    through float16)."""
    mp3 = load(runs / "train2", 0, "mp-mixed-3")
    fp1 = load(runs / "train2", 0, "mixed-1")
    for r in range(2):
        into_fp32 = load(runs / "resume2", r, "mp3-into-fp32")
        into_mp = load(runs / "resume2", r, "fp32-into-mp1")
        for k in (k for k in mp3 if k.startswith("savedmaster/")):
            np.testing.assert_array_equal(into_fp32["loaded/" + k[12:]], mp3[k], err_msg=k)
        masters = [k for k in into_mp if k.startswith("loadedmaster/")]
        assert masters
        for k in masters:
            np.testing.assert_array_equal(into_mp[k], fp1["saved/" + k[13:]], err_msg=k)
        assert np.isfinite(into_fp32["last"]).all() and np.isfinite(into_mp["last"]).all()


@pytest.mark.parametrize("stage", [1, 3])
def test_merge_mixed_precision_writes_fp32_masters(runs, stage, tmp_path):
    """A param_dtype=float16 checkpoint merges to the fp32 master values by default (the split info records
    both dtypes), or to the fp16 values the network held with parameter_values='param'."""
    from mindzero.checkpoint.tensor_io import open_reader
    from mindzero.checkpoint.format import SplitInfo

    saved = load(runs / "train2", 0, f"mp-mixed-{stage}")
    ckpt = runs / "checkpoints" / f"mp-mixed-{stage}"
    kinds = {(t.kind, t.dtype) for t in SplitInfo.read(ckpt / "params_split_info_0.json").tensors}
    assert ("parameter", "float16") in kinds and ("master", "float32") in kinds
    for values, prefix, dtype in (("master", "savedmaster/", np.float32), ("param", "saved/", np.float16)):
        out = tmp_path / f"{values}.ckpt"
        mindzero.merge_checkpoint(ckpt, out, parameter_values=values, log=None)
        reader = open_reader(out)
        for k in (k for k in saved if k.startswith("savedmaster/")):
            name = k[len("savedmaster/"):]
            value = reader.read(name)
            assert value.dtype == dtype, (values, name, value.dtype)
            np.testing.assert_array_equal(value, saved[prefix + name], err_msg=f"{values} {name}")


def test_frozen_weights_save_merge_and_resume_at_another_world_size(runs, tmp_path):
    """The adapter network at stage 3 (frozen weights sharded, its buffers per rank): the checkpoint merges to
    the full frozen weights; 4 ranks load the 2-rank checkpoint straight (resume anywhere): every parameter,
    frozen ones included, as saved (the buffers: rank 0's on the new ranks 2-3, as reshard gives them)."""
    from mindzero.checkpoint.format import SplitInfo
    from mindzero.checkpoint.tensor_io import open_reader

    saved = load(runs / "train2", 0, "lora-3")
    ck = runs / "checkpoints" / "lora-3"
    entries = {t.name: t for t in SplitInfo.read(ck / "params_split_info_0.json").tensors}
    assert entries["base1.weight"].sharded and entries["embed.embedding_table"].sharded  # frozen, sharded
    assert entries["steps"].per_rank and not entries["steps"].sharded  # a buffer the network writes
    mindzero.merge_checkpoint(ck, tmp_path / "m.ckpt", log=None)
    merged = open_reader(tmp_path / "m.ckpt")
    for name in ("embed.embedding_table", "base1.weight", "base2.bias", "a1", "bn.gamma"):
        np.testing.assert_array_equal(merged.read(name), saved["saved/" + name], err_msg=name)
    for r in range(4):
        got = load(runs / "resume4", r, "lora2-direct-4")
        own = load(runs / "train2", min(r, 1) if r < 2 else 0, "lora-3")
        for k in (k for k in saved if k.startswith("saved/")):
            name = k[len("saved/"):]
            expect = own[k] if name in ("steps", "bn.moving_mean", "bn.moving_variance") else saved[k]
            np.testing.assert_array_equal(got["loaded/" + name], expect, err_msg=f"rank {r} {name}")


def test_persistent_parameters_save_whole_merge_and_load_at_another_world_size(runs, tmp_path):
    """Stage 3 with the mixed net's biases kept whole (stage3_param_persistence_threshold=64): the split info
    records them replicated for that reason (the weights sharded); the merge gives the full values saved; a
    4-rank run with the same threshold loads the 2-rank checkpoint and holds every saved value."""
    from mindzero.checkpoint.format import SplitInfo
    from mindzero.checkpoint.tensor_io import open_reader
    from mindzero.core.plan import REASON_PERSISTENT

    ck = runs / "checkpoints" / "persist-3"
    entries = {t.name: t for t in SplitInfo.read(ck / "params_split_info_0.json").tensors if t.kind == "parameter"}
    kept = {n for n, t in entries.items() if t.replicated_reason == REASON_PERSISTENT}
    assert kept == {"inp.bias", "half.bias", "block.0.bias"}, kept
    assert all(entries[n].sharded for n in ("inp.weight", "half.weight", "block.0.weight", "out.weight"))
    saved = load(runs / "train2", 0, "persist-3")
    mindzero.merge_checkpoint(ck, tmp_path / "m.ckpt", log=None)
    merged = open_reader(tmp_path / "m.ckpt")
    for name in entries:
        np.testing.assert_array_equal(merged.read(name), saved["saved/" + name], err_msg=name)
    for r in range(4):
        got = load(runs / "resume4", r, "persist-direct-4")
        for name in entries:
            np.testing.assert_array_equal(got["loaded/" + name], saved["saved/" + name], err_msg=f"rank {r} {name}")
        assert np.isfinite(got["last"]).all()


def test_owner_mode_checkpoints_save_merge_and_resume_at_another_world_size(runs, tmp_path):
    """mindone's CAME at stage 3 on 2 ranks: each sharded parameter's states (its factored rows and columns too)
    are whole in its owner's file, the split info naming the owner; the merge writes them whole; 4 ranks continue
    from the checkpoint loaded straight (stage 3, other owners) and from its offline reshard to stage 2, both as
    the 2-rank run went on (global loss per step, final parameters)."""
    from mindzero.checkpoint.format import SplitInfo
    from mindzero.checkpoint.tensor_io import open_reader

    ck = runs / "checkpoints" / "came-3"
    infos = [SplitInfo.read(ck / f"params_split_info_{r}.json") for r in range(2)]
    states = [t for t in infos[0].tensors if t.kind == "optimizer_state"]
    owners = {t.param: t.owner for t in states if t.owner is not None}
    assert owners and set(owners.values()) == {0, 1}, owners
    for t in states:
        assert not t.sharded and (t.owner is None or t.file == f"rank_{t.owner}.ckpt"), t
    assert {t.shape for t in states if t.param == "w2"} >= {(17,), (257,), (17, 257)}  # m, v_row, v_col
    mindzero.merge_checkpoint(ck, tmp_path / "m.ckpt", with_optimizer=True, log=None)
    merged = open_reader(tmp_path / "m.ckpt")
    for t in states:
        assert merged.meta(t.name)[1] == tuple(t.shape), t.name
        assert merged.read(t.name).any() or t.numel == 1, t.name  # trained states, not zeros
    ref_loss, ref = _global(runs / "train2", "came-3", 2)
    for name in ("came3-direct-4", "came3-to-4"):
        new_loss, new = _global(runs / "resume4", name, 4)
        np.testing.assert_allclose(new_loss, ref_loss, rtol=1e-5, err_msg=name)
        for k in (k for k in ref if k.startswith("param/")):
            err = np.max(np.abs(new[k] - ref[k])) / max(np.max(np.abs(ref[k])), 1e-12)
            assert err <= 1e-5, f"{name} {k}: {err:.2e}"
