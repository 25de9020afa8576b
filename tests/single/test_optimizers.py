"""One process: how mindzero reads an optimizer and decides, per parameter, flat shards or an owner (the element-wise
probe) for every optimizer of the table; the registration override both ways; optimizers built eagerly and under
``lazy_init``: after ``prepare_train_network`` nothing the user's optimizer or network held before stays alive where
the stage replaces it (weak references), the optimizer holds only what the stage needs, and a lazy build trains as
an eager one, bit for bit; MindSpore's ``mint.optim`` optimizers are accepted, or refused with the reason."""
import contextlib
import json
import re

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, mint, nn

import mindzero
from mindzero.comm.groups import rehearse
from tests.support.optimizers import CASES, build as build_opt_net, came, muon, parameter_modes
from tests.support.release import RELEASE_OPTIMIZERS, StackNet, released

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("kind", list(RELEASE_OPTIMIZERS))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_replaced_tensors_are_released(kind, lazy, stage):
    """Stage 3 replaces the parameters by shards: no original is alive but those it keeps whole (MindSpore's nn.Adam, nn.Momentum and
    nn.SGD keep their parameter list in ``init_params``; Parameter.clone records each state in its source's
    ``param_info``; Cells record Parameters set in lists); stages 1-3 replace every optimizer state: none of
    the full ones is alive. The optimizer then holds the plan's bytes, no more. Rank 0 of 2 (a rehearsal: the
    shards are halves; the 2-rank parity launch checks stages 1 and 3 on a real world in the full tier)."""
    with rehearse(2):
        got = released(kind, lazy, stage)
    assert got["states"] > 0 and got["states_alive"] == 0, got
    # stages 1-2 keep full parameters; stage 3 only those it keeps whole (within 1% of 7,152 elements: one bias)
    assert got["params_alive"] == (got["whole"] if stage == 3 else got["params"]), got
    assert (0 < got["whole"] < got["params"]) if stage == 3 else got["whole"] == 0, got
    # stage 3 replaces every sharded parameter by its shard; stages 1-2 keep the user's parameters, and the
    # optimizer updates a master shard of each
    if stage == 3:
        assert got["sharded"] > 0 and got["sharded_alive"] == 0 and got["masters"] == 0, got
    else:
        assert got["sharded"] == got["sharded_alive"] == got["masters"] > 0, got
    assert got["opt_bytes"] == got["opt_shard_bytes"], got


def _train(kind, lazy, stage, steps=2):
    ms.set_seed(0)
    with mindzero.lazy_init() if lazy else contextlib.nullcontext():
        net = StackNet()
        opt = RELEASE_OPTIMIZERS[kind](net.trainable_params())
    step = mindzero.prepare_train_network(net, opt, zero_stage=stage)
    rng = np.random.RandomState(1)
    losses = [float(step(Tensor(rng.randn(4, 48).astype(np.float32)))[0].asnumpy()) for _ in range(steps)]
    return losses, mindzero.gather_full_state_dict(step)


@pytest.mark.parametrize("kind", list(RELEASE_OPTIMIZERS))
def test_lazy_build_trains_as_eager_at_stage3(kind):
    """After the references are cut the optimizer still compiles and updates its shards; a lazy build (one
    tensor at a time) trains bit for bit as an eager one."""
    eager_losses, eager = _train(kind, False, 3)
    lazy_losses, lazy = _train(kind, True, 3)
    assert lazy_losses == eager_losses
    assert eager.keys() == lazy.keys()
    for name in eager:
        np.testing.assert_array_equal(lazy[name], eager[name], err_msg=name)
    assert any(not np.array_equal(eager[n], v) for n, v in _initial().items()), "training moved nothing"


def _initial():
    ms.set_seed(0)
    return {p.name: p.asnumpy() for p in StackNet().get_parameters()}


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_mint_adamw_refused_on_cpu(stage):
    net = StackNet()
    with pytest.raises(ValueError, match=r"optimizer mindspore\.mint\.optim\.adamw\.AdamW cannot run on CPU: MindSpore "
                                         rf"{re.escape(ms.__version__)} registers no CPU kernel for its update op "
                                         r"\[AdamW\]; on CPU use "
                                         r"mint\.optim\.Adam with weight_decay .* or nn\.AdamWeightDecay"):
        mindzero.prepare_train_network(net, mint.optim.AdamW(net.trainable_params()), zero_stage=stage)


def test_mint_amsgrad_in_some_groups_refused():
    net = StackNet()
    ps = net.trainable_params()
    opt = mint.optim.Adam([{"params": ps[:2], "amsgrad": True}, {"params": ps[2:]}])
    with pytest.raises(ValueError, match=r"keeps \['max_exp_avg_sq'\] in some parameter groups only \(amsgrad set per "
                                         r"group\); mindzero needs it in every group or none"):
        mindzero.prepare_train_network(net, opt, zero_stage=1)


def test_register_overrides_the_probe_both_ways():
    """``register_elementwise_optimizer(cls, False)`` owns every sharded parameter whole (an element-wise SGD
    then trains as before); ``True`` shards flat without a probe, and refuses a class whose states are not shaped
    as their parameters, naming the state; a subclass follows its registered base; bad arguments are refused."""
    from mindzero.engine.probe import _REGISTERED

    class MySGD(nn.SGD):
        pass

    try:
        mindzero.register_elementwise_optimizer(nn.SGD, False)
        net = StackNet()
        step = mindzero.prepare_train_network(net, MySGD(net.trainable_params(), 0.1), zero_stage=2)
        assert {u.mode for u in step.zero_info.updates} == {"owner"}
        assert "registered as not element-wise" in step.zero_info.updates[0].why
        mindzero.register_elementwise_optimizer(nn.AdaFactor, True)
        net = StackNet()
        with pytest.raises(ValueError, match=r"optimizer AdaFactor is registered element-wise, but its state "
                                             r"'exp_avg_sq_col' of parameter 'layers.0.weight' has shape \(48,\), "
                                             r"not the parameter's \(48, 48\): it cannot be sharded flat"):
            mindzero.prepare_train_network(net, nn.AdaFactor(net.trainable_params()), zero_stage=1)
    finally:
        _REGISTERED.pop(nn.SGD, None)
        _REGISTERED.pop(nn.AdaFactor, None)
    with pytest.raises(TypeError, match="cls must be a subclass of mindspore.nn.Optimizer or "
                                        "mindspore.experimental.optim.Optimizer .*, got <class 'int'>"):
        mindzero.register_elementwise_optimizer(int)
    with pytest.raises(TypeError, match="elementwise must be a bool, got 'yes'"):
        mindzero.register_elementwise_optimizer(nn.SGD, "yes")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_probe_decides_every_optimizer_of_the_table(case):  # every configuration: a probe is quick
    """Flat where the optimizer updates each element from that element alone, owner mode where it does not
    (factored statistics, an RMS clip, Muon's matrices), decided from the optimizer itself; the user's optimizer
    is not moved by the probe (its step counters and states as they were)."""
    from mindzero.core.plan import ParamInfo, PartitionPlan
    from mindzero.engine.optim import OptimizerLayout
    from mindzero.engine.probe import decide_modes

    net = build_opt_net()
    opt = case.make(net.trainable_params())
    layout = OptimizerLayout.read(opt)
    before = {key: p.asnumpy().copy() for key, p in layout.scalars.items()}
    states = [s.asnumpy().copy() for group in layout.states.values() for s in group]
    specs = PartitionPlan.build([ParamInfo(p.name, tuple(p.shape)) for p in layout.params], 2, 0).specs
    decided = decide_modes(layout, specs, True, dict(case.options).get("update_sharding", "auto"))
    assert {p.name: mode for p, (mode, _, _) in zip(layout.params, decided)} == parameter_modes(case, net)
    for key, p in layout.scalars.items():
        np.testing.assert_array_equal(p.asnumpy(), before[key], err_msg=key)
    for s, value in zip([s for group in layout.states.values() for s in group], states):
        np.testing.assert_array_equal(s.asnumpy(), value)
    whys = [why for mode, why, _ in decided if mode == "owner"]
    assert all(why for why in whys), whys


def test_the_layout_reads_roles_not_classes():
    """States are found by their names (``<prefix>.<param>``, ``<param>_<suffix>``), per-parameter entries by
    length, and a name MindSpore's bases do not use is reported (mindone Muon's ``use_muon`` and ``lr_ratio``); a
    learning-rate tuple of a grouped optimizer is an entry, not a state."""
    from mindzero.engine.optim import OptimizerLayout

    net = build_opt_net()
    layout = OptimizerLayout.read(muon(net.trainable_params()))
    assert set(layout.states) == {"exp_avg", "exp_avg_sq"} and set(layout.unknown) == {"use_muon", "lr_ratio"}
    came_layout = OptimizerLayout.read(came(net.trainable_params()))
    assert set(came_layout.states) == {"m", "v", "v_row", "v_col", "v_res_row", "v_res_col"}
    ps = net.trainable_params()
    grouped = OptimizerLayout.read(nn.AdamWeightDecay([{"params": ps[:2], "lr": 1e-3}, {"params": ps[2:]}], 1e-2))
    assert set(grouped.states) == {"moments1", "moments2"} and "learning_rate" in grouped.per_parameter
    assert not grouped.unknown


def test_a_probe_that_cannot_run_decides_owner_mode():
    """An optimizer whose view fails (here: its update raises for a probe's shape) gets owner mode, which is exact
    for any optimizer, with the reason."""
    class Fussy(nn.SGD):
        def construct(self, gradients):
            if gradients[1].shape[0] == 768:  # a third of a 48 x 48 matrix: a piece of the probe, not a parameter
                raise ValueError("not this shape")
            return super().construct(gradients)

    net = StackNet()
    step = mindzero.prepare_train_network(net, Fussy(net.trainable_params(), 0.1), zero_stage=1)
    updates = step.zero_info.updates
    assert {u.mode for u in updates} == {"owner"}
    assert "the element-wise probe could not run (ValueError: " in updates[0].why and "not this shape" in updates[0].why


def test_a_verdict_is_reused_for_the_same_optimizer_and_redone_for_another(monkeypatch):
    """The probe's verdicts are kept for the process: preparing the same optimizer (class, hyper-parameters,
    parameters alike) again compiles no probe; another learning rate probes again."""
    from mindzero.engine import probe

    runs = []
    real = probe._run_probe
    monkeypatch.setattr(probe, "_run_probe", lambda *a: runs.append(1) or real(*a))
    for lr in (0.125, 0.125, 0.25):
        net = StackNet()
        mindzero.prepare_train_network(net, nn.Momentum(net.trainable_params(), lr, 0.9), zero_stage=1)
    assert len(runs) == 2


def test_a_wrapping_optimizer_is_refused_naming_the_rule():
    class Wrapper(nn.Optimizer):
        def __init__(self, inner):
            super().__init__(0.1, inner.parameters)
            self.inner = inner

        def construct(self, gradients):
            return self.inner(gradients)

    net = StackNet()
    with pytest.raises(ValueError, match="optimizer Wrapper wraps another optimizer \\(SGD\\); zero_stage 1-3 shard one "
                                         "optimizer"):
        mindzero.prepare_train_network(net, Wrapper(nn.SGD(net.trainable_params(), 0.1)), zero_stage=2)


def test_checkpoint_step_from_mint_counters(tmp_path):
    """``save_checkpoint`` records the optimizer's own step: mint's Adam counts in ``state_step``, SGD in
    ``step_t`` (nn optimizers in ``global_step``)."""
    for kind in (k for k in ("mint.optim.Adam", "mint.optim.SGD", "nn.Adam") if k in RELEASE_OPTIMIZERS):
        net = StackNet()
        step = mindzero.prepare_train_network(net, RELEASE_OPTIMIZERS[kind](net.trainable_params()), zero_stage=2)
        for _ in range(3):
            step(Tensor(np.ones((2, 48), np.float32)))
        path = tmp_path / kind
        mindzero.save_checkpoint(step, path)
        assert json.loads((path / "COMPLETE").read_text())["step"] == 3, kind


def test_an_optimizer_the_mindspore_ships_but_does_not_run_is_refused(monkeypatch):
    """MindSpore 2.7's ``mint.optim.SGD`` updates nothing (its step counter stays 0, in MindSpore alone): on such a
    release prepare refuses it, naming the version and what to use, before anything changes; from 2.8 it runs."""
    from mindzero.core.versions import UnsupportedMindSpore
    from mindzero.engine.optim import unrunnable

    assert unrunnable(mint.optim.SGD, "2.8.0") is None and unrunnable(mint.optim.Adam, "2.7.1") is None
    net = StackNet()
    before = [p.asnumpy().copy() for p in net.trainable_params()]
    monkeypatch.setattr(ms, "__version__", "2.7.1")
    with pytest.raises(UnsupportedMindSpore, match=r"optimizer mindspore\.mint\.optim\.sgd\.SGD updates no parameter "
                                                   r"\(its step counter stays 0, .*\) in MindSpore 2\.7\.1: use nn\.SGD "
                                                   r"or nn\.Momentum, or MindSpore 2\.8\.0 or later"):
        mindzero.prepare_train_network(net, mint.optim.SGD(net.trainable_params(), lr=0.1), zero_stage=2)
    assert all(np.array_equal(b, p.asnumpy()) for b, p in zip(before, net.trainable_params()))


@pytest.mark.parametrize("kind", [k for k in ("mint.optim.Adam", "mint.optim.SGD") if k in RELEASE_OPTIMIZERS])
def test_mint_optim_with_param_dtype(kind):
    """``param_dtype=float16`` with a mint optimizer: it updates fp32 masters (re-pointed at stage 0, shards from
    stage 1), and every stage trains as stage 0, bit for bit (one process)."""
    def train(stage):
        ms.set_seed(0)
        net = StackNet()
        step = mindzero.prepare_train_network(net, RELEASE_OPTIMIZERS[kind](net.trainable_params()), zero_stage=stage,
                                              param_dtype="float16", scale_sense=1024.0)
        rng = np.random.RandomState(1)
        losses = [float(step(Tensor(rng.randn(4, 48).astype(np.float32)))[0].asnumpy()) for _ in range(3)]
        return losses, mindzero.gather_full_state_dict(step, masters=True)

    ref_losses, ref = train(0)
    assert all(v.dtype == np.float32 for v in ref.values())
    for stage in (1, 3):
        losses, got = train(stage)
        assert losses == ref_losses, (stage, losses, ref_losses)
        for name in ref:
            np.testing.assert_array_equal(got[name], ref[name], err_msg=f"stage {stage} {name}")
