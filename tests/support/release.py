"""Which tensors ``prepare_train_network`` leaves alive: weak references to every Parameter the user's optimizer
and network held before (parameters, optimizer states, per-group states), checked after prepare while the
caller still holds its ``net``, ``opt`` and the train step, as a user's script does."""
import contextlib
import gc
import weakref

import mindspore as ms
from mindspore import ParameterTuple, mint, nn

import mindzero

from .models import runs_here

#: every optimizer mindzero shards, as users build them (name -> maker over the trainable parameters)
RELEASE_OPTIMIZERS = {
    "nn.Adam": lambda ps: nn.Adam(ps, 1e-3),
    "nn.Adam-amsgrad": lambda ps: nn.Adam(ps, 1e-3, use_amsgrad=True),
    # groups: init_params then holds the group dicts, each with its own parameter list
    "nn.Adam-groups": lambda ps: nn.Adam([{"params": [p for p in ps if "bias" not in p.name], "weight_decay": 0.01},
                                          {"params": [p for p in ps if "bias" in p.name]}], 1e-3),
    "nn.AdamWeightDecay-groups": lambda ps: nn.AdamWeightDecay(
        [{"params": [p for p in ps if "bias" not in p.name], "weight_decay": 0.01},
         {"params": [p for p in ps if "bias" in p.name]}], 1e-3),
    "nn.Momentum": lambda ps: nn.Momentum(ps, 1e-3, 0.9),
    "nn.SGD": lambda ps: nn.SGD(ps, 1e-3),
    "mint.optim.Adam": lambda ps: mint.optim.Adam(ps, lr=1e-3),
    "mint.optim.Adam-amsgrad-groups": lambda ps: mint.optim.Adam(
        [{"params": [p for p in ps if "bias" not in p.name], "weight_decay": 0.01},
         {"params": [p for p in ps if "bias" in p.name], "lr": 1e-4}], lr=1e-3, amsgrad=True),
    "mint.optim.SGD": lambda ps: mint.optim.SGD(ps, lr=1e-3, momentum=0.9),
}
#: those the installed MindSpore runs (a release may ship one it does not run; mindzero refuses it there)
RELEASE_OPTIMIZERS = {k: make for k, make in RELEASE_OPTIMIZERS.items() if runs_here(k)}


class StackNet(nn.Cell):
    """Dense layers and a LayerNorm, built from MindSpore's initializers (so ``lazy_init`` leaves them lazy);
    the loss is the output's mean square."""

    def __init__(self, width=48, depth=3):
        super().__init__()
        self.layers = nn.SequentialCell([nn.Dense(width, width) for _ in range(depth)])
        self.norm = nn.LayerNorm((width,))

    def construct(self, x):
        return (self.norm(self.layers(x)) ** 2).mean()


def _big_optimizer_tensors(opt) -> list:
    """Every Parameter ``opt`` holds of more than one element: its own (parameters, states, step counters
    excluded by size) and those in its parameter groups (mint's per-group states)."""
    found = {id(p): p for p in opt.get_parameters()}
    for group in getattr(opt, "param_groups", None) or ():
        for value in group.values():
            if isinstance(value, (ParameterTuple, list)):
                found.update({id(p): p for p in value if isinstance(p, ms.Parameter)})
    return [p for p in found.values() if p.size > 1]


def released(kind: str, lazy: bool, stage: int, seed: int = 0) -> dict:
    """Build ``StackNet`` and the optimizer ``kind`` (under :func:`mindzero.lazy_init` if ``lazy``), prepare at
    ``stage`` on the current world, and count what is still alive of the Parameters held before.

    Returns:
        ``{"params", "params_alive", "sharded", "sharded_alive", "masters", "states", "states_alive", "whole",
        "opt_bytes", "opt_shard_bytes"}``: ``sharded``: the parameters the plan shards (``sharded_alive`` of them
        still alive), ``masters``: the step's master copies (``zero_master.*``);
        ``opt_bytes`` the bytes of every multi-element Parameter the optimizer holds after prepare,
        ``opt_shard_bytes`` what its sharded parameters and states need (the plan's shard sizes); ``states``
        counts the states of the parameters the plan shards, ``whole`` the trainable parameters it keeps whole.
    """
    ms.set_seed(seed)
    with mindzero.lazy_init() if lazy else contextlib.nullcontext():
        net = StackNet()
        opt = RELEASE_OPTIMIZERS[kind](net.trainable_params())
    params = [weakref.ref(p) for p in net.trainable_params()]
    names = [p.name for p in net.trainable_params()]
    states = [(weakref.ref(p), p.name) for p in _big_optimizer_tensors(opt) if p.name not in {q().name for q in params}]
    train = mindzero.prepare_train_network(net, opt, zero_stage=stage)
    gc.collect()
    info = train.zero_info
    # stage 3 keeps its smallest parameters whole (stage3_param_persistence_threshold, within the 1% cap): they and
    # their states are the step's own, not replaced; every other state is
    whole = {s.name for s in info.plan if not s.sharded}
    states = [r for r, name in states if not any(name.endswith("." + w) for w in whole)]
    per_param = {ps.name: ps.spec for ps in info.params}
    n_states = len(info.state_attrs)
    shard_bytes = sum((s.shard_size if ps.sharded else s.numel) * 4 * (n_states + 1)
                      for ps, s in ((ps, per_param[ps.name]) for ps in info.params))
    sharded = {s.name for s in info.plan if s.sharded}
    result = dict(params=len(params), params_alive=sum(r() is not None for r in params), states=len(states),
                  sharded=len(sharded), sharded_alive=sum(r() is not None for r, n in zip(params, names) if n in sharded),
                  masters=sum(p.name.startswith("zero_master.") for p in train.get_parameters()),
                  whole=sum(n not in sharded for n in names),
                  states_alive=sum(r() is not None for r in states),
                  opt_bytes=sum(int(p.nbytes) for p in _big_optimizer_tensors(opt)), opt_shard_bytes=shard_bytes)
    del train, net, opt
    gc.collect()
    return result
