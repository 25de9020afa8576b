"""A small GPT-style causal language model and a generated character corpus (no downloads)."""
import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher", "our neighbour"]
VERBS = ["sees", "likes", "follows", "finds", "paints", "remembers", "greets"]
OBJECTS = ["the river", "a red ball", "the garden", "an apple", "the quiet town", "a blue kite", "the sea"]
ENDINGS = ["today", "at night", "in spring", "every morning", "again", "slowly", "with joy"]


def make_corpus(sentences: int = 4000, seed: int = 0) -> str:
    """Generated English-like text: a fixed grammar, so the loss can fall well below uniform."""
    rng = np.random.RandomState(seed)
    pick = lambda words: words[rng.randint(len(words))]  # noqa: E731
    return " ".join(f"{pick(SUBJECTS)} {pick(VERBS)} {pick(OBJECTS)} {pick(ENDINGS)}." for _ in range(sentences))


class CharTokenizer:
    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        return np.array([self.index[c] for c in text], np.int32)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class Adapter(nn.Cell):
    """A low-rank adapter (LoRA) beside a frozen projection: ``x @ a @ b`` with ``a`` (in, r) normal and ``b``
    (r, out) zero at the start, so the adapted network starts as the base one."""

    def __init__(self, d_in: int, d_out: int, rank: int):
        super().__init__()
        self.a = Parameter(Tensor(np.random.RandomState(d_in + rank).randn(d_in, rank).astype(np.float32) * 0.02),
                           name="a")
        self.b = Parameter(Tensor(np.zeros((rank, d_out), np.float32)), name="b")

    def construct(self, x):
        return ops.matmul(ops.matmul(x, ops.cast(self.a, x.dtype)), ops.cast(self.b, x.dtype))


class Block(nn.Cell):
    """Pre-LayerNorm transformer block: causal self-attention and an MLP; with ``lora_rank`` > 0 an
    :class:`Adapter` beside each of its four projections (qkv, proj, fc1, fc2)."""

    def __init__(self, dim: int, heads: int, lora_rank: int = 0):
        super().__init__()
        self.ln1 = nn.LayerNorm((dim,))
        self.qkv = nn.Dense(dim, 3 * dim)
        self.proj = nn.Dense(dim, dim)
        self.ln2 = nn.LayerNorm((dim,))
        self.fc1 = nn.Dense(dim, 4 * dim)
        self.fc2 = nn.Dense(4 * dim, dim)
        self.heads = heads
        self.lora = lora_rank > 0
        if self.lora:
            self.qkv_lora = Adapter(dim, 3 * dim, lora_rank)
            self.proj_lora = Adapter(dim, dim, lora_rank)
            self.fc1_lora = Adapter(dim, 4 * dim, lora_rank)
            self.fc2_lora = Adapter(4 * dim, dim, lora_rank)

    def _qkv(self, x):
        return self.qkv(x) + self.qkv_lora(x) if self.lora else self.qkv(x)

    def _proj(self, x):
        return self.proj(x) + self.proj_lora(x) if self.lora else self.proj(x)

    def _mlp(self, x):
        h = ops.gelu(self.fc1(x) + self.fc1_lora(x) if self.lora else self.fc1(x))
        return self.fc2(h) + self.fc2_lora(h) if self.lora else self.fc2(h)

    def construct(self, x):
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = ops.split(self._qkv(self.ln1(x)), d, axis=-1)
        q = q.reshape(b, t, self.heads, hd).transpose(0, 2, 1, 3)
        k = k.reshape(b, t, self.heads, hd).transpose(0, 2, 1, 3)
        v = v.reshape(b, t, self.heads, hd).transpose(0, 2, 1, 3)
        att = ops.matmul(q, k.transpose(0, 1, 3, 2)) / (hd ** 0.5)
        mask = ops.triu(ops.ones((t, t), ms.float32), 1) * -1e9
        att = ops.softmax(ops.cast(att, ms.float32) + mask, axis=-1)  # in fp32 also when the block runs in fp16
        y = ops.matmul(ops.cast(att, v.dtype), v).transpose(0, 2, 1, 3).reshape(b, t, d)
        x = x + self._proj(y)
        return x + self._mlp(self.ln2(x))


class GPT(nn.Cell):
    """Token + position embeddings, ``layers`` blocks, final LayerNorm, head tied to the embedding or not.
    ``lora_rank`` > 0: adapters in every block and everything else frozen (:func:`freeze_all_but_adapters`)."""

    def __init__(self, vocab: int, dim: int = 64, layers: int = 2, heads: int = 4, seq: int = 32, tied: bool = True,
                 lora_rank: int = 0):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = Parameter(Tensor(np.random.RandomState(1).randn(seq, dim).astype(np.float32) * 0.02), name="pos")
        self.blocks = nn.SequentialCell([Block(dim, heads, lora_rank) for _ in range(layers)])
        self.ln_f = nn.LayerNorm((dim,))
        self.tied = tied
        if not tied:
            self.head = nn.Dense(dim, vocab, has_bias=False)
        self.vocab = vocab
        if lora_rank:
            freeze_all_but_adapters(self)

    def construct(self, tokens):
        t = tokens.shape[1]
        h = self.ln_f(self.blocks(self.embed(tokens) + self.pos[:t]))
        if self.tied:
            return ops.matmul(h, ops.cast(self.embed.embedding_table, h.dtype).T)  # (another Cell's: not auto-cast)
        return self.head(h)


def freeze_all_but_adapters(net: nn.Cell) -> None:
    """Adapter fine-tuning: only the adapters (``*_lora.a``, ``*_lora.b``) train; the rest is frozen."""
    for p in net.get_parameters():
        p.requires_grad = "_lora." in p.name


class LMLoss(nn.Cell):
    """Next-token cross entropy of a GPT."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt
        self.ce = nn.CrossEntropyLoss()

    def construct(self, tokens, targets):
        logits = self.gpt(tokens)
        return self.ce(logits.reshape(-1, self.gpt.vocab), targets.reshape(-1))


def init_params(net: nn.Cell, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic initialisation, identical on every rank and run (MindSpore's default bias init is random):
    normal(std) for matrices, ones for LayerNorm gains, zeros for biases."""
    rng = np.random.RandomState(seed)
    for p in sorted(net.trainable_params(), key=lambda q: q.name):
        if len(p.shape) >= 2:
            value = rng.randn(*p.shape) * std
        else:
            value = np.ones(p.shape) if p.name.endswith("gamma") else np.zeros(p.shape)
        p.set_data(Tensor(value.astype(np.float32), p.dtype))


def batches(ids: np.ndarray, batch: int, seq: int, rank: int, world: int, seed: int = 0):
    """Endless (tokens, targets) batches; each rank draws its own windows (data parallel)."""
    rng = np.random.RandomState(seed * 7919 + rank)
    while True:
        starts = rng.randint(0, len(ids) - seq - 1, size=batch)
        window = np.stack([ids[s:s + seq + 1] for s in starts])
        yield window[:, :-1].copy(), window[:, 1:].copy()


def generate(gpt: GPT, tok: CharTokenizer, prompt: str, steps: int, seq: int) -> str:
    """Greedy generation from a prompt (PyNative-friendly: one forward per character)."""
    ids = list(tok.encode(prompt))
    for _ in range(steps):
        window = np.array([ids[-seq:]], np.int32)
        logits = gpt(Tensor(window)).asnumpy()[0, -1]
        ids.append(int(np.argmax(logits)))
    return tok.decode(ids)
