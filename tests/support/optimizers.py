"""Every optimizer a MindSpore user brings, as users build it: the table the optimizer launch trains at stages 1-3
against plain data parallel, with the update mode mindzero must choose for a matrix and for a vector.

Sources: ``mindspore.nn`` (every optimizer that trains on CPU; ``Lamb`` and ``LARS`` have no CPU kernel),
``mindspore.experimental.optim`` (all 11), ``mindspore.mint.optim`` (``Adam``, ``SGD``; ``AdamW`` has no CPU
kernel), mindcv 0.3's ``AdamW`` (mindone's ``create_optimizer(name="adamw_re")``), mindone 0.5's ``CAME`` and its
``Muon`` (Moonlight's: orthogonalised matrices, AdamW for the rest; its Newton-Schulz step multiplies in bfloat16,
which has no CPU kernel, so the test runs it in fp32: :func:`muon`).

mindone is installed without its dependencies (``scripts/setup_env.sh``); its package imports its model zoo, which
needs them, so its trainer modules are loaded from their files (:func:`mindone_module`), as they are.
"""
import importlib.util
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np
from mindspore import Tensor, mint, nn, ops
import mindspore.experimental.optim as eo

from .models import runs_here

FLAT, OWNER = "flat", "owner"


def mindone_module(relative: str):
    """mindone's module at ``relative`` (e.g. ``"trainers/came.py"``) of the installed package, loaded from its file
    without running the package's ``__init__`` (registered in ``sys.modules``: graph mode resolves its globals)."""
    name = "mindone." + relative[:-3].replace("/", ".")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec("mindone")
    if spec is None:
        raise ImportError("mindone is not installed: bash scripts/setup_env.sh installs mindone==0.5.0 (--no-deps)")
    path = f"{spec.submodule_search_locations[0]}/{relative}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module


def _newton_schulz_fp32(G, steps):
    """mindone's ``zeropower_via_newtonschulz5`` in fp32 (its bfloat16 cast left out) with ``ops`` kernels (mint's
    ``t``, ``norm`` and ``addmm`` have none on CPU): the same quintic iteration."""
    shape = G.shape
    if len(shape) > 2:
        G = G.view(G.shape[0], -1)
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G
    if G.shape[0] > G.shape[1]:
        X = X.T
    X = X / (ops.sqrt(ops.reduce_sum(X * X)) + 1e-7)
    for _ in range(steps):
        A = ops.matmul(X, X.T)
        B = b * A + c * ops.matmul(A, A)
        X = a * X + ops.matmul(B, X)
    if G.shape[0] > G.shape[1]:
        X = X.T
    if len(shape) > 2:
        X = X.view(*shape)
    return X


def muon(params, lr=1e-2):
    """mindone's ``Muon`` over ``params``: the matrices orthogonalised (Newton-Schulz in fp32), AdamW for the rest
    (its own split), no QK-clip (``clip_value=None``: it needs the attention's QK products)."""
    module = mindone_module("trainers/muon.py")
    module.zeropower_via_newtonschulz5 = _newton_schulz_fp32
    return module.Muon(lr, 0.1, muon_params=[p for p in params if p.ndim >= 2],
                       adamw_params=[p for p in params if p.ndim < 2], clip_value=None)


def came(params):
    return mindone_module("trainers/came.py").CAME(params, learning_rate=1e-2)


def came_finetune(params):
    """CAME as mindone's diffusion fine-tuning scripts set it: a small fixed learning rate and weight decay."""
    return mindone_module("trainers/came.py").CAME(params, learning_rate=1e-4, weight_decay=0.03)


def mindcv_adamw(params):
    from mindcv.optim.adamw import AdamW

    return AdamW(params, learning_rate=1e-2, weight_decay=0.05)


@dataclass(frozen=True)
class OptimizerCase:
    """One optimizer: ``make(params)``; ``torch_style``: plain data parallel trains it with the functional loop
    (``tests.support.worker.ReferenceStep``: ``nn.TrainOneStepCell`` needs ``nn.Optimizer``); the modes mindzero
    must choose for a matrix and for a vector."""

    name: str
    make: Callable
    torch_style: bool = False
    matrix: str = FLAT
    vector: str = FLAT
    options: tuple = ()  # prepare_train_network's options beyond the stage, as (name, value) pairs
    full_only: bool = False  # a configuration the full tier adds to the default tier's table

    def mode(self, shape) -> str:
        return self.matrix if len(shape) >= 2 else self.vector

    @property
    def accumulation(self) -> int:
        """Micro-batches per update (``gradient_accumulation_steps``); plain data parallel trains on them
        concatenated."""
        return int(dict(self.options).get("gradient_accumulation_steps", 1))

    @property
    def mixed(self) -> bool:
        """``param_dtype`` set: fp16 parameters updated through fp32 masters."""
        return dict(self.options).get("param_dtype") is not None

    @property
    def reference(self):
        """What the case's stages are compared with: ``"dp"``, plain data parallel with the same optimizer; ``0``,
        mindzero's stage 0 with the same options, where plain data parallel has no counterpart (``param_dtype``:
        every rank updates the whole fp32 masters, then casts them into the fp16 parameters)."""
        return 0 if self.mixed else "dp"


def _eo(name, **kw):
    return OptimizerCase(f"experimental.{name}", lambda ps: getattr(eo, name)(ps, lr=1e-2, **kw), torch_style=True)


CASES = [
    OptimizerCase("nn.Adam", lambda ps: nn.Adam(ps, 1e-2)),
    OptimizerCase("nn.Adam-amsgrad", lambda ps: nn.Adam(ps, 1e-2, use_amsgrad=True)),
    OptimizerCase("nn.AdamWeightDecay", lambda ps: nn.AdamWeightDecay(ps, 1e-2, weight_decay=0.05)),
    OptimizerCase("nn.SGD", lambda ps: nn.SGD(ps, 0.05, momentum=0.9)),
    OptimizerCase("nn.Momentum", lambda ps: nn.Momentum(ps, 0.05, 0.9)),
    OptimizerCase("nn.AdaMax", lambda ps: nn.AdaMax(ps, 1e-2)),
    OptimizerCase("nn.Adadelta", lambda ps: nn.Adadelta(ps, 1.0)),
    OptimizerCase("nn.Adagrad", lambda ps: nn.Adagrad(ps, learning_rate=1e-2)),
    OptimizerCase("nn.ASGD", lambda ps: nn.ASGD(ps, 1e-2)),
    OptimizerCase("nn.RMSProp", lambda ps: nn.RMSProp(ps, 1e-2)),
    OptimizerCase("nn.RMSProp-centered", lambda ps: nn.RMSProp(ps, 1e-2, centered=True)),
    OptimizerCase("nn.Rprop", lambda ps: nn.Rprop(ps, 1e-2)),
    OptimizerCase("nn.AdaFactor", lambda ps: nn.AdaFactor(ps), matrix=OWNER, vector=OWNER),
    # fine-tuning's setting (a fixed learning rate): its vectors' states are full-shaped, yet each update is scaled by
    # its RMS over the tensor once that exceeds clip_threshold: owned whole, as its factored matrices
    OptimizerCase("nn.AdaFactor-fixed-lr", lambda ps: nn.AdaFactor(ps, learning_rate=1e-2, scale_parameter=False,
                                                                   relative_step=False, warmup_init=False),
                  matrix=OWNER, vector=OWNER),
    # every parameter owned whole (update_sharding="owner"): in fp32 at stages 1-2 the owner updates the user's
    # Parameter itself, no master shard beside it
    OptimizerCase("nn.Adam-owned", lambda ps: nn.Adam(ps, 1e-2), matrix=OWNER, vector=OWNER,
                  options=(("update_sharding", "owner"),)),
    # the configurations users run beside the defaults (the full tier): a schedule and weight decay by group,
    # nesterov, amsgrad, AdaFactor's fine-tuning setting under a schedule
    OptimizerCase("nn.AdamWeightDecay-groups-schedule", lambda ps: nn.AdamWeightDecay(
        [{"params": [p for p in ps if p.ndim >= 2], "weight_decay": 0.05},
         {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}],
        nn.piecewise_constant_lr([2, 3, 4], [1e-2, 5e-3, 2e-3])), full_only=True),
    OptimizerCase("nn.Momentum-nesterov", lambda ps: nn.Momentum(ps, 0.05, 0.9, use_nesterov=True), full_only=True),
    OptimizerCase("nn.SGD-nesterov-decay", lambda ps: nn.SGD(ps, 0.05, momentum=0.9, nesterov=True,
                                                            weight_decay=1e-3), full_only=True),
    OptimizerCase("nn.AdaFactor-fixed-lr-schedule", lambda ps: nn.AdaFactor(
        ps, learning_rate=nn.piecewise_constant_lr([2, 4], [1e-2, 5e-3]), scale_parameter=False,
        relative_step=False, warmup_init=False), matrix=OWNER, vector=OWNER, full_only=True),
    OptimizerCase("nn.LazyAdam", lambda ps: nn.LazyAdam(ps, 1e-2)),
    OptimizerCase("nn.FTRL", lambda ps: nn.FTRL(ps, learning_rate=1e-2)),
    OptimizerCase("nn.ProximalAdagrad", lambda ps: nn.ProximalAdagrad(ps, 1e-2)),
    _eo("Adam"), _eo("AdamW"), _eo("SGD", momentum=0.9), _eo("Adadelta"), _eo("Adagrad"), _eo("Adamax"),
    _eo("ASGD"), _eo("NAdam"), _eo("RAdam"), _eo("RMSprop"), _eo("Rprop"),
    OptimizerCase("experimental.AdamW-amsgrad", lambda ps: eo.AdamW(ps, lr=1e-2, amsgrad=True), torch_style=True,
                  full_only=True),
    OptimizerCase("mint.optim.Adam", lambda ps: mint.optim.Adam(ps, lr=1e-2), torch_style=True),
    OptimizerCase("mint.optim.SGD", lambda ps: mint.optim.SGD(ps, lr=0.05, momentum=0.9), torch_style=True),
    OptimizerCase("mindcv.AdamW", mindcv_adamw),
    OptimizerCase("mindone.CAME", came, matrix=OWNER, vector=OWNER),
    OptimizerCase("mindone.CAME-finetune", came_finetune, matrix=OWNER, vector=OWNER, full_only=True),
    OptimizerCase("mindone.Muon", muon, torch_style=True, matrix=OWNER, vector=OWNER),
    # fp16 parameters with fp32 masters (against stage 0 of the same options), and accumulation over two
    # micro-batches (against plain data parallel on them concatenated): one flat and one owner-mode optimizer each,
    # one of each in the default tier
    OptimizerCase("nn.AdamWeightDecay-param_dtype", lambda ps: nn.AdamWeightDecay(ps, 1e-2, weight_decay=0.05),
                  options=(("param_dtype", "float16"),)),
    OptimizerCase("mindone.CAME-param_dtype", came, matrix=OWNER, vector=OWNER, options=(("param_dtype", "float16"),),
                  full_only=True),
    OptimizerCase("mindone.CAME-accumulation", came, matrix=OWNER, vector=OWNER,
                  options=(("gradient_accumulation_steps", 2),)),
    OptimizerCase("nn.AdamWeightDecay-accumulation", lambda ps: nn.AdamWeightDecay(ps, 1e-2, weight_decay=0.05),
                  options=(("gradient_accumulation_steps", 2),), full_only=True),
]
#: the table this MindSpore runs: a case it ships but does not run is refused by mindzero instead
#: (tests/single/test_optimizers.py checks the refusal)
CASES = [c for c in CASES if runs_here(c.name)]
BY_NAME = {c.name: c for c in CASES}
#: the flat optimizers the default suite also trains at stage 1 (one of each family and kernel kind); every
#: optimizer trains at stage 3 there, every one at stages 1-3 in the full tier
ALSO_AT_STAGE1 = ("nn.Adam", "nn.ASGD", "experimental.Adam", "mint.optim.SGD", "mindcv.AdamW")


def case_params(cases) -> list:
    """``cases`` as pytest parameters, a full-tier configuration marked ``full``."""
    import pytest

    return [pytest.param(c, id=c.name, marks=pytest.mark.full) if c.full_only else pytest.param(c, id=c.name)
            for c in cases]


def stages_for(case: OptimizerCase, full_tier: bool) -> tuple:
    """The stages the optimizer launch trains ``case`` at: stage 3 always (shards, masters, owners gathering into
    shards); stage 1 too for the owner-mode optimizers and :data:`ALSO_AT_STAGE1` (a flat update at stage 1 is
    stage 2's: the same shards and write-back, only where gradients are reduced differs, which no optimizer sees;
    without accumulation, as here, stage 2 compiles stage 1's graph node for node: tests/single/test_one_process.py);
    stages 1-3 in the full tier, and for a case with options of its own (``update_sharding="owner"``: owner mode's
    stage 1 all-reduces the owners' gradients whole, its stage 2 gathers them from shards, whatever the
    optimizer)."""
    if full_tier or case.options:
        return (1, 2, 3)
    if case.name in ALSO_AT_STAGE1 or OWNER in (case.matrix, case.vector):
        return (1, 3)
    return (3,)


class OptNet(nn.Cell):
    """A small network with biases, a LayerNorm and odd shapes: (13, 7), (13,) x 3, (5, 13), (5,)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Dense(7, 13)
        self.norm = nn.LayerNorm((13,))
        self.out = nn.Dense(13, 5)

    def construct(self, x, y):
        return ops.reduce_mean(ops.square(self.out(ops.tanh(self.norm(self.inp(x)))) - y))

    @staticmethod
    def batch(step: int, rank: int, n: int = 4):
        """This rank's micro-batch of ``step`` (the same on every run)."""
        rng = np.random.RandomState(1000 * step + rank)
        x = rng.randn(n, 7).astype(np.float32)
        teacher = np.random.RandomState(7).randn(7, 5).astype(np.float32)
        return Tensor(x), Tensor(np.tanh(x @ teacher).astype(np.float32))


def build(seed: int = 0) -> OptNet:
    import mindspore as ms

    ms.set_seed(seed)
    net = OptNet()
    # non-zero biases and norms (a fresh Dense has zero biases: a probe of zeros shows little)
    rng = np.random.RandomState(seed + 11)
    for p in net.trainable_params():
        if p.ndim == 1:
            p.set_data(Tensor(rng.randn(*p.shape).astype(np.float32) * 0.1 + (1.0 if "gamma" in p.name else 0.0)))
    return net


def parameter_modes(case: OptimizerCase, net) -> dict:
    """The mode each of ``net``'s trainable parameters must get with ``case``'s optimizer."""
    return {p.name: case.mode(p.shape) for p in net.trainable_params()}


__all__ = ["CASES", "BY_NAME", "case_params", "stages_for", "ALSO_AT_STAGE1", "FLAT", "OWNER", "OptNet", "OptimizerCase", "build",
           "came", "mindcv_adamw", "mindone_module", "muon", "parameter_modes"]
