"""The quantized gather's format and numpy twin (mindzero.core.quant), pure: the error bound, all-zero blocks,
blocks cut by padding, odd sizes, fp16 inputs, the byte layout, the policy and its errors, the bytes counted."""
import numpy as np
import pytest

from mindzero.core import quant as Q
from mindzero.core.comm_plan import gathered_bytes, plan_state, step_calls, summarize
from mindzero.core.config import ZeroConfig
from mindzero.core.plan import ParamInfo, PartitionPlan
from mindzero.core.topology import EMULATED, World


def _bound(x, block):
    """Half a quantization step of each element's block: max|block| / 254 (2**-126 near fp32's subnormals)."""
    x = np.asarray(x, np.float32).reshape(-1)
    nb = Q.blocks(x.size, block)
    padded = np.zeros(nb * block, np.float32)
    padded[:x.size] = x
    amax = np.abs(padded.reshape(nb, block)).max(axis=1).astype(np.float64)
    return np.repeat(np.maximum(amax / 254, 2.0 ** -126 * (amax > 0)), block)[:x.size]


CASES = [(1000, 64, np.float32), (1024, 256, np.float32), (37, 16, np.float16), (5, 16, np.float32),
         (4097, 1024, np.float32), (300, 32, np.float16)]


@pytest.mark.parametrize("size, block, dtype", CASES)
def test_error_at_most_half_a_step_of_its_block(size, block, dtype):
    rng = np.random.default_rng(size)
    x = (rng.standard_normal(size) * rng.choice([1e-4, 1.0, 300.0], size)).astype(dtype)
    q, scales = Q.quantize(x, block)
    assert q.dtype == np.int8 and scales.dtype == np.float32
    assert q.size == Q.blocks(size, block) * block and np.abs(q).max() <= 127
    back = Q.dequantize(q, scales, size)
    err = np.abs(back.astype(np.float64) - x.astype(np.float32).astype(np.float64))
    assert np.all(err <= _bound(x, block) * (1 + 1e-6)), err.max()
    assert np.abs(q).max() == 127  # the largest element of some block maps to the end of the grid


def test_all_zero_blocks_and_padding_are_exact_zeros():
    x = np.zeros(100, np.float32)
    x[40:45] = [1.0, -2.0, 0.5, 3.0, -3.0]
    q, scales = Q.quantize(x, 16)  # 7 blocks, the last cut by padding (100 = 6 * 16 + 4)
    assert scales.size == 7 and np.count_nonzero(scales) == 1 and scales[2] == np.float32(3.0 / 127)
    assert np.all(q[100:] == 0)
    back = Q.dequantize(q, scales, 100)
    assert np.all(back[:40] == 0) and np.all(back[45:] == 0)
    assert back[43] == 3.0 and back[44] == -3.0  # the block's maximum is exact


def test_ties_round_half_to_even():
    x = np.array([127.0, 63.5, -63.5, 0.5, 1.5, 2.5, -2.5, 0.0], np.float32)  # scale 1: exact ties
    q, scales = Q.quantize(x, 8)
    assert scales[0] == 1.0 and list(q) == [127, 64, -64, 0, 2, 2, -2, 0]


def test_tiny_blocks_use_the_smallest_normal_scale_and_subnormals_flush():
    x = np.array([1e-37, -5e-38, 2e-38, 0.0, 1e-39, -1e-39, 3e-40, 0.0], np.float32)
    q, scales = Q.quantize(x, 4)  # block 0: max/127 below 2**-126; block 1: fp32 subnormals only
    assert scales[0] == np.float32(2.0 ** -126) and scales[1] == 0
    back = Q.dequantize(q, scales, 8)
    assert np.all(np.abs(back - x) <= 2.0 ** -126) and np.all(back[4:] == 0)


def test_payload_layout_and_decode():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(70).astype(np.float32)
    raw = Q.payload(x, 32)  # 3 blocks
    assert raw.dtype == np.int8 and raw.size == Q.payload_bytes(70, 32) == 3 * 32 + 3 * 4
    q, scales = Q.quantize(x, 32)
    assert np.array_equal(raw[:96], q) and np.array_equal(raw[96:].view("<f4"), scales)
    words = raw.view(np.int32)  # the CPU wire: the same bytes
    assert np.array_equal(Q.decode(words, 70, 32), Q.decode(raw, 70, 32))
    assert np.array_equal(Q.decode(raw, 70, 32), Q.dequantize(q, scales, 70))
    assert Q.decode(raw, 70, 32, np.float16).dtype == np.float16


def test_gathered_is_every_ranks_decoded_shard():
    rng = np.random.default_rng(2)
    shards = [rng.standard_normal(40).astype(np.float32) for _ in range(3)]
    got = Q.gathered(shards, 16)
    assert got.size == 120
    for r, s in enumerate(shards):
        assert np.array_equal(got[40 * r:40 * (r + 1)], Q.dequantize(*Q.quantize(s, 16), 40))


def test_policy_defaults_and_applies():
    p = Q.GatherQuantization.parse("int8")
    assert p == Q.GatherQuantization() and p.block_size == 256
    assert p.applies("layers.0.attn.qkv.weight", (1024, 256))
    assert not p.applies("layers.0.attn.qkv.weight", (100, 100))  # below min_numel
    assert not p.applies("layers.0.ln.gamma", (512, 512))  # excluded by name
    assert not p.applies("big.bias", (1 << 20,))  # 1-D
    custom = Q.GatherQuantization.parse({"kind": "int8", "block_size": 64, "min_numel": 0, "exclude": []})
    assert custom.applies("a.bias", (2, 2)) and custom.as_dict()["block_size"] == 64
    assert Q.GatherQuantization.parse(None) is None


@pytest.mark.parametrize("value, message", [
    ("int4", r"gather_quantization\['kind'\] must be one of \['int8'\].*got 'int4'"),
    ({"kind": "fp8"}, r"gather_quantization\['kind'\] must be one of"),
    ({"block_size": 8}, r"gather_quantization\['block_size'\] must be an int multiple of 4 in \[16, 1048576\].*got 8"),
    ({"block_size": 30}, r"block_size'\] must be an int multiple of 4.*got 30"),
    ({"block_size": 2.0 ** 22}, r"block_size'\] must be .*got 4194304.0"),
    ({"min_numel": -1}, r"gather_quantization\['min_numel'\] must be an int >= 0.*got -1"),
    ({"exclude": "*bias*"}, r"gather_quantization\['exclude'\] must be a list of name patterns"),
    ({"kind": "int8", "blocks": 4}, "gather_quantization: unknown key 'blocks'"),
    (7, "gather_quantization must be None, 'int8' or a mapping"),
])
def test_policy_errors_name_key_value_and_rule(value, message):
    with pytest.raises(ValueError, match=message):
        Q.GatherQuantization.parse(value)


def test_quantization_needs_stage_3():
    with pytest.raises(ValueError, match="gather_quantization='int8' needs zero_stage=3: .*zero_stage=1 has none"):
        ZeroConfig.from_arguments({"zero_stage": 1, "gather_quantization": "int8"})
    assert ZeroConfig.from_arguments({"zero_stage": 3, "gather_quantization": "int8"}).stage3.quantization.kind == "int8"


def test_the_plan_counts_quantized_gather_bytes():
    """A quantized gather moves the payload (int8 values, fp32 scales), every other collective is unchanged."""
    infos = [ParamInfo("w", (512, 300), "float32"), ParamInfo("b", (300,), "float32")]
    plan = PartitionPlan.build(infos, 4, 0)
    world = World.of_sizes(4, 4, EMULATED)
    exact_cfg = ZeroConfig.from_arguments({"zero_stage": 3})
    quant_cfg = ZeroConfig.from_arguments({"zero_stage": 3, "gather_quantization": {"min_numel": 0}})
    exact = step_calls(plan_state(list(plan), exact_cfg), world)
    quant = step_calls(plan_state(list(plan), quant_cfg), world)
    assert [(c.op, c.phase) for c in exact] == [(c.op, c.phase) for c in quant]
    w = plan["w"]
    assert gathered_bytes(w, quant_cfg.stage3.quantization.block_size) == Q.payload_bytes(w.shard_size, 256) == 38400 + 4 * 150
    gathers = [c for c in quant if c.op == "all_gather"]
    assert sorted({c.nbytes for c in gathers}) == sorted({4 * 4 * plan["b"].shard_size, 4 * Q.payload_bytes(
        w.shard_size, 256)})
    saved = summarize(exact)["all_gather"]["bytes"] - summarize(quant)["all_gather"]["bytes"]
    assert saved == 2 * 4 * (w.shard_size * 4 - Q.payload_bytes(w.shard_size, 256))  # forward and backward


def test_settings_file_takes_gather_quantization(tmp_path):
    from mindzero.core.settings import ConfigError, load_config

    good = tmp_path / "good.yaml"
    good.write_text("zero_stage: 3\ngather_quantization: {kind: int8, block_size: 128}\nreduce_dtype: float16\n"
                    "scale_sense: 1024\n")
    settings = load_config(good)
    assert settings["gather_quantization"] == {"kind": "int8", "block_size": 128}
    config = ZeroConfig.from_arguments({k: v for k, v in settings.items() if k != "checkpoint"})
    assert config.stage3.quantization.block_size == 128 and config.precision.reduce_dtype == "float16"
    bad = tmp_path / "bad.yaml"
    bad.write_text("gather_quantization: {kind: int8, block_size: 7}\n")
    with pytest.raises(ConfigError, match=rf"{bad}: key 'gather_quantization': .*block_size'\] must be an int "
                                          r"multiple of 4 in \[16, 1048576\].*got 7"):
        load_config(bad)
