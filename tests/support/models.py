"""Test networks with the features users have (fp16 cells, recompute, replicated bias, awkward shapes read
in arbitrary expressions, attention with tied embeddings, BatchNorm), the one table of their optimizers,
and what the tests build from them."""
import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, mint, nn, ops

from examples.gpt import Block  # the example's attention block


class _Teacher:
    """Fixed random matrices that make the targets learnable (the same in every process)."""

    def randn(self, *shape):
        return np.random.RandomState(sum(shape) * 7919 + len(shape)).randn(*shape).astype(np.float32)


TEACHER = _Teacher()


class MixedNet(nn.Cell):
    """(a) an fp16 cell, a recompute() cell and a replicated bias (parallel_optimizer=False)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Dense(12, 20)
        self.half = nn.Dense(20, 20).to_float(ms.float16)
        self.block = nn.SequentialCell([nn.Dense(20, 18), nn.GELU()])
        self.block.recompute()
        self.out = nn.Dense(18, 5)
        self.out.bias.parallel_optimizer = False
        self.loss = nn.MSELoss()

    def construct(self, x, y):
        h = ops.relu(self.inp(x))
        h = ops.cast(self.half(h), ms.float32)
        return self.loss(self.out(self.block(h)), y)

    @staticmethod
    def batch(rng, n=4):
        x = rng.randn(n, 12).astype(np.float32)
        return x, np.tanh(x @ TEACHER.randn(12, 5)).astype(np.float32)


class AwkwardNet(nn.Cell):
    """(b) a user's own Cell with odd shapes (7, 15), (17, 257), (1,) and a scalar, read in arbitrary expressions."""

    def __init__(self):
        super().__init__()
        self.w1 = Parameter(Tensor(np.zeros((7, 15), np.float32)), name="w1")
        self.w2 = Parameter(Tensor(np.zeros((17, 257), np.float32)), name="w2")
        self.proj = Parameter(Tensor(np.zeros((15, 17), np.float32)), name="proj")
        self.gain = Parameter(Tensor(np.zeros((1,), np.float32)), name="gain")
        self.temp = Parameter(Tensor(np.zeros((), np.float32)), name="temp")

    def construct(self, x, y):
        h = ops.tanh(ops.matmul(x, self.w1) * (1.0 + self.gain))
        h = ops.matmul(ops.matmul(h, self.proj), self.w2)
        h = h * ops.sigmoid(self.temp) + ops.sin(self.w2[0:1, :]) * 0.1
        return ops.reduce_mean(ops.square(h - y))

    @staticmethod
    def batch(rng, n=4):
        x = rng.randn(n, 7).astype(np.float32)
        return x, (np.sin(x @ TEACHER.randn(7, 257)) * 0.5).astype(np.float32)


class TinyGPT(nn.Cell):
    """(c) embedding, one attention block, LayerNorm and a head tied to the embedding table."""

    VOCAB, DIM, SEQ = 37, 16, 8

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, self.DIM)
        self.pos = Parameter(Tensor(np.zeros((self.SEQ, self.DIM), np.float32)), name="pos")
        self.block = Block(self.DIM, 2)
        self.ln_f = nn.LayerNorm((self.DIM,))
        self.ce = nn.CrossEntropyLoss()

    def construct(self, tokens, targets):
        h = self.embed(tokens) + self.pos
        h = self.ln_f(self.block(h))
        logits = ops.matmul(h, self.embed.embedding_table.T)  # tied head
        return self.ce(logits.reshape(-1, self.VOCAB), targets.reshape(-1))

    @classmethod
    def batch(cls, rng, n=3):
        start = rng.randint(0, cls.VOCAB, size=(n, 1))
        tok = ((start + 3 * np.arange(cls.SEQ + 1)) % cls.VOCAB).astype(np.int32)  # learnable: next = +3
        return tok[:, :-1].copy(), tok[:, 1:].copy()


class ResBlock(nn.Cell):
    def __init__(self, ch):
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, pad_mode="same", has_bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, pad_mode="same", has_bias=False)
        self.bn2 = nn.BatchNorm2d(ch)

    def construct(self, x):
        h = ops.relu(self.bn1(self.conv1(x)))
        return ops.relu(x + self.bn2(self.conv2(h)))


class TinyResNet(nn.Cell):
    """(d) convolutions with BatchNorm (moving statistics are non-trainable Parameters)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, pad_mode="same")
        self.bn = nn.BatchNorm2d(6)
        self.res = ResBlock(6)
        self.head = nn.Dense(6, 4)
        self.ce = nn.CrossEntropyLoss()

    def construct(self, x, y):
        h = self.res(ops.relu(self.bn(self.stem(x))))
        return self.ce(self.head(h.mean(axis=(2, 3))), y)

    @staticmethod
    def batch(rng, n=4):
        x = rng.randn(n, 3, 6, 6).astype(np.float32)
        return x, (np.argmax(x.mean(axis=(2, 3)) @ TEACHER.randn(3, 4), axis=1)).astype(np.int32)


class LoraNet(nn.Cell):
    """(e) adapter fine-tuning: a frozen embedding and frozen base layers, trainable rank-2 adapters on them, a
    BatchNorm (trainable scale, per-rank statistics), and a step counter the network writes itself
    (``ops.assign_add``: a buffer, which must stay per rank)."""

    VOCAB, DIM, RANK = 23, 12, 2

    def __init__(self):
        super().__init__()
        d, r = self.DIM, self.RANK
        self.embed = nn.Embedding(self.VOCAB, d)
        self.base1 = nn.Dense(d, d)
        self.base2 = nn.Dense(d, 5)
        for p in (*self.embed.get_parameters(), *self.base1.get_parameters(), *self.base2.get_parameters()):
            p.requires_grad = False  # the frozen backbone
        self.a1 = Parameter(Tensor(np.zeros((d, r), np.float32)), name="a1")
        self.b1 = Parameter(Tensor(np.zeros((r, d), np.float32)), name="b1")
        self.a2 = Parameter(Tensor(np.zeros((d, r), np.float32)), name="a2")
        self.b2 = Parameter(Tensor(np.zeros((r, 5), np.float32)), name="b2")
        self.bn = nn.BatchNorm1d(d)
        self.steps = Parameter(Tensor(np.zeros((1,), np.float32)), name="steps", requires_grad=False)
        self.loss = nn.MSELoss()

    def construct(self, tokens, y):
        ops.assign_add(self.steps, ops.ones((1,), ms.float32))
        h = self.embed(tokens).mean(axis=1)
        h = self.base1(h) + ops.matmul(ops.matmul(h, self.a1), self.b1)
        h = ops.relu(self.bn(h))
        return self.loss(self.base2(h) + ops.matmul(ops.matmul(h, self.a2), self.b2), y)

    @classmethod
    def batch(cls, rng, n=4):
        tokens = rng.randint(0, cls.VOCAB, size=(n, 6)).astype(np.int32)
        return tokens, np.tanh(np.eye(cls.VOCAB, 5, dtype=np.float32)[tokens].mean(axis=1) * 3)


class PlainMLP(nn.WithLossCell):
    """(f) what a new user writes first: three ``nn.Dense`` in float32, ``nn.WithLossCell`` with ``nn.MSELoss``,
    no mixed-precision setup of its own (``param_dtype`` makes mindzero convert it)."""

    def __init__(self):
        super().__init__(nn.SequentialCell([nn.Dense(12, 24), nn.ReLU(), nn.Dense(24, 24), nn.ReLU(),
                                            nn.Dense(24, 5)]), nn.MSELoss())

    batch = MixedNet.batch


class NormedMLP(nn.WithLossCell):
    """(g) float32 Dense layers with a BatchNorm and a LayerNorm between them (the Cells AMP keeps in fp32)."""

    def __init__(self):
        super().__init__(nn.SequentialCell([nn.Dense(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dense(16, 16),
                                            nn.LayerNorm((16,)), nn.GELU(), nn.Dense(16, 5)]), nn.MSELoss())

    batch = MixedNet.batch


MODELS = {"mixed": MixedNet, "awkward": AwkwardNet, "gpt": TinyGPT, "resnet": TinyResNet, "lora": LoraNet,
          "mlp": PlainMLP, "normed": NormedMLP}
# the models of the parity and hybrid matrices (every stage, fp32); mlp and normed: the mixed-precision runs
PARITY_MODELS = ("mixed", "awkward", "gpt", "resnet", "lora")


def build(name, seed=0):
    """A fresh network whose parameters (trainable and frozen; not buffers such as BatchNorm's statistics or a
    step counter) come from a numpy RNG, identical across runs and ranks."""
    net = MODELS[name]()
    rng = np.random.RandomState(seed)
    params = [p for p in net.get_parameters() if p.requires_grad or name == "lora" and "moving_" not in p.name
              and p.name != "steps"]
    for p in sorted(params, key=lambda q: q.name):
        scale = 0.5 / np.sqrt(max(1, p.shape[-1] if p.shape else 1))
        p.set_data(Tensor((rng.randn(*p.shape) * scale).astype(np.float32), p.dtype))
    return net


#: the one table of the tests' optimizers (name -> maker over a parameter list)
OPTIMIZERS = {
    "adamw": lambda ps: nn.AdamWeightDecay(ps, 1e-2, weight_decay=0.05),
    "adam": lambda ps: nn.Adam(ps, 1e-2),
    "sgd": lambda ps: nn.SGD(ps, 0.1, momentum=0.9),
    # with weight decay, stage 0 and nn.TrainOneStepCell differ in the last bit of a few elements (seen with
    # every layout of the package): the multi-rank parity runs (1e-5) use it, the one-process tests (bit for bit) do not
    "sgd_decay": lambda ps: nn.SGD(ps, 0.1, momentum=0.9, weight_decay=1e-4),
    "momentum": lambda ps: nn.Momentum(ps, 0.05, 0.9),
    # MindSpore's torch-style optimizers: Adam with AMSGrad, two groups (decay first: the group order is the
    # optimizer's parameter order) and per-group lr; SGD with Nesterov momentum and L2 weight decay
    "mint_adam": lambda ps: mint.optim.Adam([{"params": [p for p in ps if "bias" not in p.name], "weight_decay": 0.01},
                                             {"params": [p for p in ps if "bias" in p.name], "lr": 5e-3}],
                                            lr=1e-2, amsgrad=True),
    "mint_sgd": lambda ps: mint.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True),
    # not element-wise (factored statistics, an RMS clip): every sharded parameter owned whole by one rank
    "came": lambda ps: _came(ps),
}


def _came(params):
    from .optimizers import came

    return came(params)


#: the tests' names of the optimizer classes a MindSpore release ships but may not run
#: (:data:`mindzero.engine.optim.BROKEN_BEFORE`)
CLASS_OF_NAME = {"mint_sgd": mint.optim.SGD, "mint.optim.SGD": mint.optim.SGD}


def runs_here(name: str) -> bool:
    """Whether the installed MindSpore runs the optimizer of the tests' tables named ``name``: mindzero refuses one that
    a MindSpore release ships but does not run (:func:`mindzero.engine.optim.unrunnable`), and the tests then check
    the refusal instead of training it."""
    from mindzero.engine.optim import unrunnable

    cls = CLASS_OF_NAME.get(name)
    return cls is None or unrunnable(cls) is None
#: optimizers that are not mindspore.nn.Optimizer: plain data parallel trains them with a reference loop
#: (tests.support.worker.ReferenceStep), as nn.TrainOneStepCell needs an nn.Optimizer's attributes
TORCH_STYLE = ("mint_adam", "mint_sgd")
#: the optimizer each model trains with unless a test says otherwise
DEFAULT_OPTIMIZER = {"mixed": "adamw_groups", "awkward": "adam", "gpt": "sgd", "resnet": "momentum", "lora": "adamw",
                     "mlp": "adam", "normed": "adamw"}


def make_optimizer(kind: str, net):
    """The optimizer ``kind`` over ``net``'s trainable parameters; ``adamw_groups``: AdamWeightDecay with the
    decay group first (the optimizer reorders its parameters) and per-group learning rates."""
    params = net.trainable_params()
    if kind == "adamw_groups":
        decay = [p for p in params if "bias" not in p.name]
        no_decay = [p for p in params if "bias" in p.name]
        return nn.AdamWeightDecay([{"params": no_decay, "weight_decay": 0.0, "lr": 5e-3},
                                   {"params": decay, "weight_decay": 0.05}], learning_rate=1e-2)
    if kind not in OPTIMIZERS:
        raise KeyError(f"optimizer {kind!r} is not one of {sorted([*OPTIMIZERS, 'adamw_groups'])}")
    return OPTIMIZERS[kind](params)


def trainable_bytes(model: str) -> int:
    """Bytes of ``model``'s trainable parameters (fp32)."""
    return sum(p.nbytes for p in build(model).trainable_params())
