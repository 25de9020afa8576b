"""``compile_cache``: the train step's compiled graph kept on disk under a key of what shapes it.

The key is checked in this process (building steps compiles nothing); loading is checked in fresh processes
(``tests.support.cached_step``), because MindSpore reads its compile cache in a process's first cached compile.
Each run is rank 0 of 2 rehearsed; every run's losses and parameters are compared with a run without the cache.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn

import mindzero
from mindzero.comm.groups import rehearse
from mindzero.engine.compile_cache import COMPLETE, mindspore_api, step_key
from tests.support.data import batch
from tests.support.models import build, make_optimizer

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")

ROOT = Path(__file__).resolve().parents[2]
LOADED = "Use the compilation cache"  # MindSpore's notice when it loads a cached graph


def key_of(stage=3, optimizer=None, batch_size=None, perturb=False, **options):
    with rehearse(2):
        net = build("gpt")
        if perturb:
            for p in net.trainable_params():
                p.set_data(p * 1.5)
        opt = (optimizer or (lambda ps: nn.AdamWeightDecay(ps, 1e-2)))(net.trainable_params())
        step = mindzero.prepare_train_network(net, opt, zero_stage=stage, **options)
        args = batch(type(net), 1 if perturb else 0, 0, n=batch_size)
        return step_key(step, args, step.zero_info.config, step.zero_info.world)


def test_the_key_sees_what_shapes_the_graph_and_not_the_values():
    """Two builds of one configuration have one key, whatever the parameters' and the inputs' values (a graph
    reads them at each run); the stage, the batch shape, an optimizer's hyper-parameter (a Python number and a
    constant Tensor alike) and another option each change it."""
    base = key_of()
    assert key_of() == base
    assert key_of(perturb=True) == base
    changed = {
        "stage": key_of(stage=1),
        "batch shape": key_of(batch_size=5),
        "weight decay": key_of(optimizer=lambda ps: nn.AdamWeightDecay(ps, 1e-2, weight_decay=0.05)),
        "beta1": key_of(optimizer=lambda ps: nn.AdamWeightDecay(ps, 1e-2, beta1=0.8)),
        "option": key_of(stage3_param_persistence_threshold=0),
    }
    assert all(key != base for key in changed.values()), changed
    assert len(set(changed.values())) == len(changed)


def test_the_key_ignores_where_disk_offload_keeps_its_files(tmp_path):
    """A job's offload directory (often a per-job scratch path) shapes no graph: two directories, one key."""
    keys = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        keys.append(key_of(stage=2, optimizer_offload="disk", offload_dir=str(tmp_path / name)))
    assert keys[0] == keys[1] != key_of(stage=2)


def run(stage, cache, env=None, model="gpt", optimizer="adam", options=None):
    """One fresh process training 3 steps; its RESULT and whether MindSpore loaded a cached graph."""
    args = [sys.executable, "-m", "tests.support.cached_step", model, optimizer, str(stage), str(cache)]
    if options:
        args.append(json.dumps(options))
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MS_COMPILER_CACHE")}
    done = subprocess.run(args, cwd=ROOT, env={**environment, **(env or {})}, capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(lines[0][len("RESULT "):]), LOADED in done.stderr


@pytest.fixture(scope="module")
def references():
    """Stages 3 and 1 without the cache."""
    return {stage: run(stage, "-")[0] for stage in (3, 1)}


def test_the_next_process_loads_the_step_and_trains_the_same(tmp_path, references):
    """The first run compiles and keeps the step, the second loads it (MindSpore says so) and trains the same
    losses and parameters, bit for bit; a step with other settings in the same directory compiles anew (MindSpore's
    own cache would load the stage-3 graph for it: measured, the stage-1 step then aborts) and equals its run
    without the cache."""
    first, loaded_first = run(3, tmp_path)
    second, loaded_second = run(3, tmp_path)
    assert (loaded_first, loaded_second) == (False, True)
    assert first == references[3] and second == references[3]
    keys = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(keys) == 1 and (keys[0] / COMPLETE).exists()
    assert json.loads((keys[0] / COMPLETE).read_text())["zero_stage"] == 3
    other, loaded_other = run(1, tmp_path)
    assert not loaded_other and other == references[1]
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2


def test_a_compile_that_did_not_finish_is_never_loaded(tmp_path, references):
    """A key's directory without its completion mark (the compile was killed while MindSpore wrote its files) is
    removed and compiled again, never loaded: here its cached graph is cut to half its bytes."""
    run(3, tmp_path)
    directory = next(p for p in tmp_path.iterdir() if p.is_dir())
    (directory / COMPLETE).unlink()
    graphs = list(directory.rglob("*.mindir"))
    assert graphs
    for graph in graphs:
        graph.write_bytes(graph.read_bytes()[:graph.stat().st_size // 2])
    again, loaded = run(3, tmp_path)
    assert not loaded and again == references[3]
    assert (directory / COMPLETE).exists()
    assert run(3, tmp_path) == (references[3], True)


def test_mindspores_process_wide_cache_is_kept_off_mindzeros_graphs(tmp_path, references):
    """With MindSpore's cache on for the whole process (``MS_COMPILER_CACHE_ENABLE=1``; it checks only the script's
    source) mindzero's graphs (the step, the optimizer's probe) compile without it: a stage-1 step after a
    stage-3 one in the same path trains right (with MindSpore's cache on them it aborted: ``free(): invalid next
    size``), nothing of theirs is loaded, and ``compile_cache`` given as well changes nothing."""
    env = {"MS_COMPILER_CACHE_ENABLE": "1", "MS_COMPILER_CACHE_PATH": str(tmp_path / "ms")}
    assert run(3, "-", env) == (references[3], False)
    assert run(1, "-", env) == (references[1], False)
    assert run(3, tmp_path / "ours", env) == (references[3], False)
    assert not list(tmp_path.rglob("*.mindir"))


def test_the_cache_setting_is_restored_for_the_users_graphs(tmp_path, monkeypatch):
    """Only the step compiles with the cache: MindSpore's setting is the user's again after it, and a graph the
    user compiles next writes nothing to the step's directory. (In this process, compiled with the script MindSpore
    hashes set to this file: under pytest-xdist the process runs ``python -c``.)"""
    api = mindspore_api()

    monkeypatch.setattr(api, "entry_script_path", __file__)
    before = (ms.get_context("enable_compile_cache"), ms.get_context("compile_cache_path"))
    with rehearse(2):
        net = build("gpt")
        step = mindzero.prepare_train_network(net, make_optimizer("sgd", net), zero_stage=1, compile_cache=tmp_path)
        step.compile(*batch(type(net), 0, 0))
    assert (ms.get_context("enable_compile_cache"), ms.get_context("compile_cache_path")) == before
    files = sorted(str(p) for p in tmp_path.rglob("*"))
    assert any(f.endswith(COMPLETE) for f in files) and any(f.endswith(".mindir") for f in files)
    user = nn.Dense(3, 2)
    user(Tensor(np.ones((1, 3), np.float32)))
    assert sorted(str(p) for p in tmp_path.rglob("*")) == files


def test_a_process_without_a_script_trains_without_the_cache(tmp_path, monkeypatch, caplog):
    """MindSpore's cache hashes the script the process runs; ``python -c`` or an interactive session has none (its
    own dependency scan then raises ``FileNotFoundError``): the step compiles without the cache, warned, and
    trains."""
    api = mindspore_api()

    monkeypatch.setattr(api, "entry_script_path", str(tmp_path / "-c"))
    with rehearse(2):
        net = build("gpt")
        step = mindzero.prepare_train_network(net, make_optimizer("sgd", net), zero_stage=3,
                                              compile_cache=tmp_path / "steps")
        with caplog.at_level("WARNING", logger="mindzero"):
            loss = step(*batch(type(net), 0, 0))[0]
    assert np.isfinite(loss.asnumpy())
    assert "compiles without the cache" in caplog.text and "not a file" in caplog.text
    assert not (tmp_path / "steps").exists()


def test_compile_cache_refuses_what_is_not_a_directory_path():
    """The argument is checked before anything is built, its error naming it, the value and the rule."""
    net = nn.Dense(2, 2)
    with pytest.raises(ValueError, match=r"compile_cache must be None or a directory path, got ''"):
        mindzero.prepare_train_network(net, nn.SGD(net.trainable_params()), compile_cache="")
