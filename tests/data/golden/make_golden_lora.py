"""The frozen-weights golden checkpoint (lora_s3_ckpt), written by mindzero at c9a38b7, before frozen weights were
sharded (a frozen weight was a per-rank value then), 4 ranks, stage 3; see make_golden.py. Run in a checkout of
c9a38b7 with make_golden.py of commit cc9612d beside it and the class LoraNet of tests/support/models.py (with
its imports) as tests/multirank/lora_model.py:
    python -m mindzero.launch.local -n 4 --out /tmp/golden tests/data/golden/make_golden_lora.py --dest DEST
"""
import sys
from pathlib import Path

import numpy as np
from mindspore import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "multirank"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # noqa: E402
from lora_model import LoraNet  # noqa: E402
models.MODELS["lora"] = LoraNet
import make_golden  # noqa: E402

make_golden.CASES = {"lora_s3_ckpt": ("lora", "adamw", 3, "ckpt", False, None)}
_build = models.build


def build(name, seed=0):
    net = _build(name, seed)
    if name == "lora":  # frozen weights from an RNG too
        rng = np.random.RandomState(seed + 1)
        for p in net.get_parameters():
            if not p.requires_grad and "moving_" not in p.name and p.name != "steps":
                p.set_data(Tensor((rng.randn(*p.shape) * 0.3).astype(np.float32), p.dtype))
    return net


make_golden.build = build
make_golden.main()
