"""The graph kernels of the quantized gather (mindzero.comm.quantize) against their numpy twin
(mindzero.core.quant), bit for bit, in one process: the payload bytes, both wires (int8, int32 words), the
decode; odd sizes, padding, all-zero blocks, exact ties, subnormal values, fp16 shards."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn

from mindzero.comm import quantize as K
from mindzero.core import quant as Q

ms.set_context(mode=ms.GRAPH_MODE)


class RoundTrip(nn.Cell):
    """One rank's payload, through both wires, decoded."""

    def __init__(self, block, nb, size):
        super().__init__()
        self.block, self.nb = block, nb
        self.words, self.int8 = K.Decoder(block, nb, size, False), K.Decoder(block, nb, size, True)

    def construct(self, x):
        words = K.encode(x, self.block, self.nb, False)
        as_int8 = K.encode(x, self.block, self.nb, True)
        from_words, bits_w = self.words.receive(words, 1)
        from_int8, bits_8 = self.int8.receive(as_int8, 1)
        return words, as_int8, self.words.decode(from_words, bits_w, x.dtype).reshape((-1,)), \
            self.int8.decode(from_int8, bits_8, x.dtype).reshape((-1,)), from_words.reshape((-1,)), bits_w


def _input(size, dtype, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(size) * rng.choice([1e-3, 1.0, 50.0], size)).astype(dtype)
    x[:min(16, size)] = 0  # an all-zero block
    return x


CASES = {
    "odd size, padded last block": _input(1000, np.float32, 0),
    "fp16 shard": _input(37, np.float16, 1),
    "exact ties": np.array([127.0, 63.5, -63.5, 0.5, 1.5, 2.5, -2.5, 0.0] * 2 + [0.0] * 16, np.float32),
    "subnormal values": np.array([0.0] * 16 + [1e-39, -1e-39, 3e-40, 0.0] * 4 + [1e30] + [0.0] * 15, np.float32),
}


@pytest.mark.parametrize("name", list(CASES))
def test_graph_kernels_equal_the_numpy_twin(name):
    x = CASES[name]
    block = 16
    nb = Q.blocks(x.size, block)
    words, as_int8, from_words, from_int8, received, bits = (t.asnumpy() for t in
                                                             RoundTrip(block, nb, x.size)(Tensor(x)))
    ref = Q.payload(x, block)
    assert words.dtype == np.int32 and np.array_equal(words, ref.view(np.int32))  # the CPU wire
    assert as_int8.dtype == np.int8 and np.array_equal(as_int8, ref)  # the GPU/Ascend wire
    assert np.array_equal(received, ref.astype(np.float32))  # the bytes the receiver reads from the words
    assert np.array_equal(bits.reshape(-1), ref[nb * block:].view(np.int32))  # the scales' IEEE bits
    expected = Q.decode(ref, x.size, block, x.dtype)
    assert from_words.dtype == x.dtype
    assert np.array_equal(from_words, expected) and np.array_equal(from_int8, expected)


class Words(nn.Cell):
    def construct(self, w, b):
        return K.words_to_bytes(w), K.bytes_to_words(b)


def test_bytes_and_words_in_float_arithmetic_are_numpys_view():
    """The float-arithmetic byte kernels on every kind of int32 word: extremes, every sign pattern of the bytes,
    words whose fp32 value rounds by the most (|w| near 2**31)."""
    rng = np.random.default_rng(5)
    special = [-2 ** 31, 2 ** 31 - 1, -1, 0, 1, 65535, 65536, -65536, -65537, 2 ** 30 + 63, 2 ** 30 + 64,
               2 ** 31 - 64, -2 ** 31 + 64, 0x7FFF8000, 0x00FF00FF, -0x00FF0100]
    words = np.concatenate([np.array(special, np.int64),
                            rng.integers(-2 ** 31, 2 ** 31, 4096)]).astype(np.int32)
    raw = words.view(np.int8)
    as_bytes, as_words = (t.asnumpy() for t in Words()(Tensor(words), Tensor(raw.astype(np.float32))))
    assert as_bytes.dtype == np.float32 and np.array_equal(as_bytes, raw.astype(np.float32))
    assert as_words.dtype == np.int32 and np.array_equal(as_words, words)
