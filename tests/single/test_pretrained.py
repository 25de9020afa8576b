"""Plain full checkpoints in and out of a train step, one process: ``mindzero.load_pretrained`` (every stage, the
masters of a mixed-precision run, strict errors that name the tensors and change nothing, the prefix a wrapped
network adds) and the adapter export ``save_full_checkpoint(trainable_only=True)``. Multi-rank loading (shards,
``lazy_init``, memory) is in tests/multirank/test_sharded_init.py."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Parameter, Tensor, nn

import mindzero
from mindzero.checkpoint.tensor_io import open_reader
from tests.support.models import build, make_optimizer

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")


def plain_file(tmp_path, seed=3, drop=(), extra=None, reshape=None, name="plain.ckpt"):
    """A plain checkpoint of the adapter network as ``mindspore.save_checkpoint`` writes it, with tensors left
    out, added or reshaped to order."""
    net = build("lora", seed=seed)
    items = [{"name": p.name, "data": p} for p in net.get_parameters() if p.name not in drop]
    if reshape:
        items = [{"name": i["name"], "data": Tensor(np.zeros(reshape[1], np.float32))} if i["name"] == reshape[0]
                 else i for i in items]
    if extra:
        items.append({"name": extra, "data": Tensor(np.ones(3, np.float32))})
    path = tmp_path / name
    ms.save_checkpoint(items, str(path))
    return path, {p.name: p.asnumpy().copy() for p in net.get_parameters()}


def prepared(stage, **options):
    net = build("lora", seed=9)
    return mindzero.prepare_train_network(net, make_optimizer("adamw", net), zero_stage=stage, **options)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_load_pretrained_sets_every_parameter_and_its_master(stage, tmp_path):
    path, values = plain_file(tmp_path)
    train = prepared(stage, ema=0.99)
    report = mindzero.load_pretrained(train, path)
    assert report["missing"] == report["unexpected"] == report["mismatched"] == [] and report["prefix"] == ""
    assert len(report["loaded"]) == len(values)
    for name, value in mindzero.gather_full_state_dict(train).items():
        np.testing.assert_array_equal(value, values[name], err_msg=name)
    for name, value in mindzero.gather_full_state_dict(train, ema=True).items():  # the EMA restarts there
        np.testing.assert_array_equal(value, values[name], err_msg=f"ema {name}")
    if stage in (1, 2):  # the master shards follow
        for pair in train.zero_info.master_pairs:
            np.testing.assert_array_equal(pair.master.asnumpy()[:values[pair.held.name].size],
                                          values[pair.held.name].reshape(-1)[:pair.master.shape[0]])
    losses = [float(train(*[Tensor(a) for a in type(build("lora")).batch(np.random.RandomState(s))])[0].asnumpy())
              for s in range(3)]
    assert np.isfinite(losses).all()


def test_load_pretrained_mixed_precision_masters_take_the_files_values(tmp_path):
    path, values = plain_file(tmp_path)
    net = build("lora", seed=9)
    opt = make_optimizer("adamw", net)
    train = mindzero.prepare_train_network(ms.amp.auto_mixed_precision(net, "O2"), opt, zero_stage=3,
                                           param_dtype="float16")
    mindzero.load_pretrained(train, path)
    masters = mindzero.gather_full_state_dict(train, masters=True)
    held = mindzero.gather_full_state_dict(train)
    for name in train.zero_info.opt_param_names:
        np.testing.assert_array_equal(masters[name], values[name], err_msg=name)  # fp32, not rounded
        if held[name].dtype == np.float16:
            np.testing.assert_array_equal(held[name], values[name].astype(np.float16), err_msg=name)


@pytest.mark.parametrize("case, message", [
    (dict(drop=("base1.weight",)), r"the network has parameters the file lacks: \['base1.weight'\]"),
    (dict(extra="head.weight"), r"the file has tensors that are no parameter of the network: \['head.weight'\]"),
    (dict(reshape=("a1", (3, 4))), r"a1: file \(3, 4\), network \(12, 2\)"),
])
def test_strict_errors_name_the_tensors_and_change_nothing(case, message, tmp_path):
    path, _ = plain_file(tmp_path, **case)
    train = prepared(3)
    before = mindzero.gather_full_state_dict(train)
    with pytest.raises(mindzero.CheckpointError, match=message):
        mindzero.load_pretrained(train, path)
    for name, value in mindzero.gather_full_state_dict(train).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    report = mindzero.load_pretrained(train, path, strict=False)  # what matches, and the rest reported
    assert report["missing"] or report["unexpected"] or report["mismatched"]
    assert report["loaded"] and "a2" in report["loaded"]


def test_a_wrapped_network_finds_the_prefix(tmp_path):
    """The file of the standalone network loads into a network that wraps it (MindSpore prefixes the wrapped
    Cell's parameter names): the prefix is found, or given."""
    path, values = plain_file(tmp_path)

    class Wrapper(nn.Cell):
        def __init__(self):
            super().__init__()
            self.inner = build("lora", seed=9)

        def construct(self, x, y):
            return self.inner(x, y)

    net = Wrapper()
    train = mindzero.prepare_train_network(net, make_optimizer("adamw", net.inner), zero_stage=3)
    assert mindzero.load_pretrained(train, path)["prefix"] == "inner."
    assert mindzero.load_pretrained(train, path, prefix="inner.")["loaded"]
    got = mindzero.gather_full_state_dict(train)
    for name, value in values.items():
        np.testing.assert_array_equal(got["inner." + name], value, err_msg=name)
    with pytest.raises(mindzero.CheckpointError, match="prefix='wrong.'"):
        mindzero.load_pretrained(train, path, prefix="wrong.")


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(mindzero.CheckpointError, match="missing.ckpt: checkpoint file is missing"):
        mindzero.load_pretrained(prepared(1), tmp_path / "missing.ckpt")


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_adapter_export_writes_only_the_trainable_parameters(stage, fmt, tmp_path):
    """``save_full_checkpoint(trainable_only=True)``: one plain file of the adapters (and the trainable
    BatchNorm scale), full, loadable into the plain network; the full export has the frozen weights too."""
    train = prepared(stage)
    for s in range(2):
        train(*[Tensor(a) for a in type(build("lora")).batch(np.random.RandomState(s))])
    full = mindzero.gather_full_state_dict(train)
    adapters = tmp_path / f"adapters.{fmt}"
    mindzero.save_full_checkpoint(train, adapters, format=fmt, trainable_only=True)
    names = sorted(open_reader(adapters).names())
    assert names == sorted(["a1", "b1", "a2", "b2", "bn.gamma", "bn.beta"])
    plain = build("lora", seed=1)
    not_loaded, _ = ms.load_param_into_net(plain, ms.load_checkpoint(str(adapters), format=fmt))
    assert sorted(not_loaded) == sorted(p.name for p in plain.get_parameters() if p.name not in names)
    for name in names:
        np.testing.assert_array_equal(plain.parameters_dict()[name].asnumpy(), full[name], err_msg=name)
    whole = tmp_path / f"whole.{fmt}"
    mindzero.save_full_checkpoint(train, whole, format=fmt)
    reader = open_reader(whole)
    assert sorted(reader.names()) == sorted(full)
    for name, value in full.items():
        np.testing.assert_array_equal(reader.read(name), value, err_msg=name)


def test_frozen_weights_are_sharded_and_buffers_written_at_stage3():
    """One process (an op group of one): the plan says frozen weights are sharded at stage 3 and the buffers
    the network writes (its step counter, BatchNorm's statistics) are not; the counter counts every step (no
    parameter kept whole for its size: threshold 0)."""
    train = prepared(3, stage3_param_persistence_threshold=0)
    plan = train.zero_info.plan
    assert {s.name for s in plan if s.frozen} == {"embed.embedding_table", "base1.weight", "base1.bias",
                                                   "base2.weight", "base2.bias"}
    assert {s.name for s in plan if s.per_rank} == {"steps", "bn.moving_mean", "bn.moving_variance"}
    for s in range(3):
        train(*[Tensor(a) for a in type(build("lora")).batch(np.random.RandomState(s))])
    assert float(mindzero.gather_full_state_dict(train)["steps"][0]) == 3.0
    text = mindzero.engine.report.plan_text(train)
    assert "5 of them frozen" in text and "replicated steps (1,): a buffer the network writes" in text


def test_shard_frozen_false_keeps_frozen_weights_whole():
    train = prepared(3, shard_frozen=False)
    assert not any(s.frozen for s in train.zero_info.plan)
    assert train.zero_info.plan["base1.weight"].reason.startswith("frozen")


def test_user_parameter_opt_out_keeps_a_frozen_weight_whole():
    net = build("lora", seed=9)
    net.base1.weight.parallel_optimizer = False
    train = mindzero.prepare_train_network(net, make_optimizer("adamw", net), zero_stage=3)
    assert not train.zero_info.plan["base1.weight"].sharded and train.zero_info.plan["base2.weight"].frozen


def test_a_parameter_written_through_a_held_primitive_is_a_buffer():
    from mindspore import ops

    class Counter(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(Tensor(np.ones(3, np.float32)), name="w")
            self.seen = Parameter(Tensor(np.zeros(1, np.float32)), name="seen", requires_grad=False)
            self.bump = ops.AssignAdd()

        def construct(self, x):
            self.bump(self.seen, ops.ones((1,), ms.float32))
            return (self.w * x).sum()

    net = Counter()
    train = mindzero.prepare_train_network(net, nn.SGD([net.w], 0.1), zero_stage=3)
    assert train.zero_info.plan["seen"].per_rank
    for _ in range(2):
        train(Tensor(np.ones(3, np.float32)))
    assert float(net.seen.asnumpy()[0]) == 2.0
