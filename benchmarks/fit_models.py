"""The networks of the prediction benchmarks (``fit_accuracy.py``), as ``mindzero-plan`` factories: top-level
functions returning ``(net_with_loss, optimizer)``, the optimizer built from the network's parameters."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def gpt(vocab=8192, dim=768, layers=14, heads=12, seq=64):
    """The benchmark GPT (examples/gpt.py, tied head), fp32 AdamWeightDecay: zero_bench's network."""
    from mindspore import nn
    from gpt import GPT, LMLoss

    net = LMLoss(GPT(vocab, dim, layers, heads, seq, tied=True))
    return net, nn.AdamWeightDecay(net.trainable_params(), 1e-4, weight_decay=0.01)


def vit(image=64, patch=8, dim=384, depth=6, heads=6, classes=100):
    """mindcv's VisionTransformer with a cross-entropy loss, nn.Adam (reads cls_token and pos_embed in
    construct)."""
    from mindspore import nn
    from mindcv.models.vit import VisionTransformer

    net = nn.WithLossCell(VisionTransformer(image_size=image, patch_size=patch, embed_dim=dim, depth=depth,
                                            num_heads=heads, num_classes=classes), nn.CrossEntropyLoss())
    return net, nn.Adam(net.trainable_params(), 1e-4)
