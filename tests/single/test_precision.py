"""One process: ``param_dtype`` on the network a user has. A float32 network with no mixed-precision setup is made
to compute in ``param_dtype`` (AMP O2's rules, the loss Cells in fp32); a network the user converted, wholly or in
part, keeps exactly its setup; where it cannot compute in ``param_dtype``, or the policy cannot be honoured, the
error names ``param_dtype`` and the fix, and a refusal leaves the network as it was. (Training results: the parity
launch, ``test_param_dtype_on_a_float32_network``.)"""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, amp, nn

import mindzero
from mindzero.engine.precision import has_own_precision
from tests.support.models import MODELS, build, make_optimizer

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")

SCALE = dict(scale_sense=nn.DynamicLossScaleUpdateCell(2.0 ** 12, 2, 100))


def flags(net):
    """Every Cell's mixed-precision flags, by name."""
    return {name: {k: v for k, v in cell.get_flags().items() if k in ("fp16", "bf16", "fp32")}
            for name, cell in net.cells_and_names()}


def step_once(step, model):
    return step(*[Tensor(a) for a in MODELS[model].batch(np.random.RandomState(0))])


def test_a_float32_network_is_converted_as_amp_o2():
    """The issue's first try: three Dense layers in a WithLossCell, param_dtype=float16, at stages 0 and 3: it
    trains (no kernel type error) with the user's Parameters (same names; at stage 0 the same objects) in fp16, the
    normalization Cells computing in fp32, the loss Cell in fp32 and a float32 loss."""
    for model in ("mlp", "normed"):
        for stage in (0, 3):
            net = build(model)
            before = {p.name: p for p in net.get_parameters()}
            assert not has_own_precision(net)
            step = mindzero.prepare_train_network(net, make_optimizer("adam", net), zero_stage=stage,
                                                  param_dtype=ms.float16, **SCALE)
            loss, overflow, _ = step_once(step, model)
            assert loss.dtype == ms.float32 and np.isfinite(loss.asnumpy()) and not overflow.asnumpy()
            after = {p.name: p for p in net.get_parameters()}
            assert after.keys() == before.keys()
            assert stage == 3 or all(after[k] is before[k] for k in after)  # stage 3: its shards in their place
            cells = dict(net.cells_and_names())
            assert cells["_loss_fn"].get_flags().get("fp32")  # the loss computes in fp32
            norms = [c for c in cells.values() if isinstance(c, (nn.BatchNorm1d, nn.LayerNorm))]
            assert len(norms) == (2 if model == "normed" else 0) and all(c.get_flags().get("fp32") for c in norms)
            dense = [c for c in cells.values() if isinstance(c, nn.Dense)]
            assert all(c.weight.dtype == ms.float16 for c in dense)


def test_a_network_the_user_converted_keeps_its_setup():
    """Converted wholly (AMP O2) or in part (the backbone; one Cell with to_float): every Cell's flags are what
    the user set, after prepare_train_network and after a step."""
    whole = amp.auto_mixed_precision(build("normed"), "O2")
    partial = build("mlp")
    partial._backbone = amp.auto_mixed_precision(partial._backbone, "O2")
    for net, model in ((whole, "normed"), (partial, "mlp")):
        before = flags(net)
        step = mindzero.prepare_train_network(net, make_optimizer("adam", net), zero_stage=3, param_dtype="float16",
                                              **SCALE)
        step_once(step, model)
        now = flags(net)  # (stage 3 adds its gather Cells)
        assert step.network is net and {k: now[k] for k in before} == before


def test_a_partly_converted_network_that_cannot_compute_names_param_dtype():
    """The mixed net has one fp16 Cell of its own and Dense layers without to_float that would read fp16
    weights with fp32 inputs: kept as the user set it, so compiling fails: the error names param_dtype, the
    setup, and the fixes, and keeps MindSpore's message."""
    net = build("mixed")
    step = mindzero.prepare_train_network(net, make_optimizer("adam", net), zero_stage=0, param_dtype=ms.float16)
    with pytest.raises(TypeError, match=r"^param_dtype=float16: the optimized parameters are held in float16, .*"
                                        r"sets up its own mixed precision .*For 'MatMul'.*Fix: convert the whole "
                                        r"network, mindspore.amp.auto_mixed_precision\(net, 'O2'"):
        step_once(step, "mixed")


def test_a_refused_policy_leaves_the_network_as_it_was():
    """bfloat16 on CPU is refused naming param_dtype, before mindzero converts anything."""
    net = build("mlp")
    before = flags(net)
    with pytest.raises(ValueError, match=r"^param_dtype=bfloat16 is not supported on CPU"):
        mindzero.prepare_train_network(net, make_optimizer("adam", net), param_dtype=ms.bfloat16)
    assert flags(net) == before and {p.dtype for p in net.get_parameters()} == {ms.float32}
