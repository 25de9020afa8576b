"""Disk offload's pure parts (no MindSpore): the policy's parsing, the state file's layout, the directory check and
the file itself (reads and writes round-trip, space reserved, the page cache dropped, removed unless kept)."""
import os
import shutil
import subprocess

import numpy as np
import pytest

from mindzero.core.config import ZeroConfig, stage_policy
from mindzero.core.memory import expected_bytes
from mindzero.core.optim_plan import OptimizerModel, planned_updates
from mindzero.core.offload import (PIECE_ALIGN, SLOTS, OffloadError, OffloadPolicy, StateFile, StateLayout,
                                   check_directory, slot_bytes)
from mindzero.core.plan import ParamInfo, PartitionPlan


def test_policy_parses_the_four_options():
    assert OffloadPolicy.parse(False) == OffloadPolicy()
    assert OffloadPolicy.parse(True).tier == "host" and OffloadPolicy.parse("host").host
    p = OffloadPolicy.parse("disk", "/scratch", 2, True)
    assert p.disk and p.dir == "/scratch" and p.chunk_mb == 2 and p.keep


@pytest.mark.parametrize("args, message", [
    (("ssd",), "optimizer_offload must be a bool, 'host' or 'disk', got 'ssd'"),
    ((1,), "optimizer_offload must be a bool, 'host' or 'disk', got 1"),
    (("disk",), "offload_dir must be a directory path when optimizer_offload='disk', got None"),
    (("disk", ""), "offload_dir must be a directory path when optimizer_offload='disk', got ''"),
    ((False, "/x"), "offload_dir='/x' is given but optimizer_offload=False"),
    (("disk", "/x", 0), "offload_chunk_mb must be a number > 0"),
    (("disk", "/x", 8, "yes"), "offload_keep must be a bool, got 'yes'"),
])
def test_policy_refuses_bad_values_naming_them(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        OffloadPolicy.parse(*args)


def test_disk_offload_needs_a_sharding_stage():
    with pytest.raises(ValueError, match="optimizer_offload='disk' needs zero_stage 1, 2 or 3"):
        ZeroConfig.from_arguments({"optimizer_offload": "disk", "offload_dir": "/tmp"})
    assert ZeroConfig.from_arguments({"zero_stage": 3, "optimizer_offload": "disk", "offload_dir": "/tmp",
                                      "offload_chunk_mb": 1}).offload.disk


def test_layout_cuts_parameters_into_aligned_pieces_of_the_chunk():
    # two states of 4 bytes: a 1 MiB chunk holds 131072 elements (a multiple of PIECE_ALIGN)
    layout = StateLayout.build([300_000, 5, 0, 131_072], [4, 4], 2 ** 20)
    assert [(p.index, p.start, p.stop) for p in layout.pieces] == [
        (0, 0, 131072), (0, 131072, 262144), (0, 262144, 300000), (1, 0, 5), (3, 0, 131072)]
    assert all(p.start % PIECE_ALIGN == 0 for p in layout.pieces)
    # each piece's record: its states side by side, each starting at a multiple of 64 bytes (5 elements: 20 -> 64)
    assert [p.offset for p in layout.pieces] == [0, 131072 * 8, 262144 * 8, 300000 * 8, 300000 * 8 + 128]
    assert layout.nbytes == (300_000 + 131_072) * 8 + 128 and layout.record_bytes(layout.pieces[3]) == 128
    assert layout.piece_bytes == 131072 * 8 and layout.state_offsets(layout.pieces[2]) == (0, 37856 * 4)
    assert layout.state_offsets(layout.pieces[3]) == (0, 64)
    assert [p.index for p in layout.pieces_of(0)] == [0, 0, 0]
    # a chunk smaller than PIECE_ALIGN elements still cuts at PIECE_ALIGN; split=False keeps parameters whole
    assert StateLayout.build([10_000], [4, 4], 100).chunk_elems == PIECE_ALIGN
    whole = StateLayout.build([300_000, 5], [4, 4], 2 ** 20, split=False)
    assert [(p.index, p.start, p.stop) for p in whole.pieces] == [(0, 0, 300000), (1, 0, 5)]
    # a slot: the largest piece's values, its gradient and its states
    assert slot_bytes(whole, [4, 4]) == SLOTS * (300_000 * 4 + 300_000 * 4 + 300_000 * 8)


def test_expected_bytes_with_disk_offload():
    """The moments leave memory for the file (read and written once per update); with accumulation the
    gradients wait in buffers of the optimizer's targets; the slots are counted beside."""
    plan = PartitionPlan.build([ParamInfo("w", (1000, 300)), ParamInfo("b", (7,))], 4, 0)
    updates = dict(zip(("w", "b"), planned_updates(plan.specs, OptimizerModel(2), True, 4)))
    for accumulate in (False, True):
        k = 2 if accumulate else 1
        mem = expected_bytes(plan, ZeroConfig(zero_stage=3, gradient_accumulation_steps=k), updates)
        disk = ZeroConfig(zero_stage=3, gradient_accumulation_steps=k, offload=OffloadPolicy.parse("disk", "/x", 1))
        off = expected_bytes(plan, disk, updates)
        assert mem["optimizer_moments"] == 2 * 4 * (75000 + 2)
        assert off["optimizer_disk"] == 2 * 300032 + 2 * 64  # each state of a piece 64-byte aligned
        assert off["optimizer_moments"] == 0 and off["disk_io_per_step"] == 2 * off["optimizer_disk"]
        assert off["gradients"] - mem["gradients"] == (4 * (75000 + 2) if accumulate else 0)
        # the largest piece is w's whole shard (75000 elements < the 1 MiB chunk's 131072): its values, its gradient
        # and its two states, each rounded up to 64 bytes, three times
        assert off["offload_buffers"] == SLOTS * 4 * 300032


def test_directory_check_names_the_directory_and_the_bytes(tmp_path, monkeypatch):
    need = 3 * 2 ** 20
    with pytest.raises(OffloadError, match=rf"offload_dir '{tmp_path}/missing' does not exist; .*{need} bytes"):
        check_directory(tmp_path / "missing", need)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OffloadError, match="is not a directory"):
        check_directory(tmp_path / "file", need)
    with pytest.raises(OffloadError, match=rf"offload_dir '/proc/1' is not writable by this process; .*{need} bytes"):
        check_directory("/proc/1", need)  # a directory nobody may create files in, root included
    assert check_directory(tmp_path, need) == tmp_path
    # a disk with less free space than the states (the size check; a full disk: posix_fallocate fails the same way)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=need - 1))
    with pytest.raises(OffloadError, match=rf"has {need - 1} bytes \(3.0 MiB\) free, needs {need} bytes"):
        check_directory(tmp_path, need)


def _cached_bytes(path) -> int:
    """Bytes of ``path`` in the page cache (util-linux's fincore)."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], check=True,
                         capture_output=True, text=True).stdout
    return int(out.strip() or 0)


def test_state_file_round_trips_and_leaves_no_cache(tmp_path):
    size = 8 * 2 ** 20
    f = StateFile(tmp_path / "s.bin", size, flush_bytes=2 ** 20)
    assert os.stat(f.path).st_blocks * 512 >= size  # reserved, not sparse
    data = np.random.default_rng(0).standard_normal(size // 4).astype(np.float32)
    for at in range(0, size, 2 ** 20):
        f.write(data.view(np.uint8)[at:at + 2 ** 20], at)
    f.flush()
    back = np.empty(size, np.uint8)
    for at in range(0, size, 2 ** 20):
        f.read(back[at:at + 2 ** 20], at)
    assert np.array_equal(back.view(np.float32), data)
    assert f.read_bytes == f.written_bytes == size
    if shutil.which("fincore"):
        assert _cached_bytes(f.path) <= 2 * 4096, "the states stayed in the page cache"
    f.close()
    assert not f.path.exists()
    kept = StateFile(tmp_path / "k.bin", 4096, keep=True)
    kept.close()
    assert kept.path.exists()
    with pytest.raises(FileExistsError):  # never over another run's file
        StateFile(tmp_path / "k.bin", 4096)


def test_one_table_of_splittable_optimizers_for_the_offload_and_the_estimates():
    """Disk offload cuts the parameters of these classes into pieces; estimate_memory knows them by these names,
    each a model of OPTIMIZER_MODELS (the classes themselves are checked to exist in tests/single/test_offload.py)."""
    from mindzero.core.offload import SPLITTABLE_MODELS, SPLITTABLE_OPTIMIZERS
    from mindzero.core.optim_plan import OPTIMIZER_MODELS

    assert SPLITTABLE_MODELS <= set(OPTIMIZER_MODELS), SPLITTABLE_MODELS - set(OPTIMIZER_MODELS)
    assert "adam" not in SPLITTABLE_MODELS  # nn.Adam's fused kernel rounds a piece's thread boundary differently
    assert all(k.startswith("mindspore.") and names for k, names in SPLITTABLE_OPTIMIZERS.items())
