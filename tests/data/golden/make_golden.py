"""Write the golden checkpoints (tests/data/golden/<case>/): small mindzero checkpoints kept as test data,
so that checkpoints written by earlier code stay readable (load, merge, reshard, verify) after the code moves.

Written once, by mindzero at commit c9a38b7 (before the package layout of mindzero/core, engine, checkpoint), on 4 CPU ranks:
    python -m mindzero.launch.local -n 4 --out /tmp/golden tests/data/golden/make_golden.py --dest tests/data/golden
Each case trains 2 steps and saves; ``expected.npz`` holds what that code read back: the full parameters
(``param/<name>``, ``gather_full_state_dict``), the fp32 masters of a param_dtype run (``master/<name>``) and every
tensor of ``merge_checkpoint(with_optimizer=True)`` (``merged/<name>``). Regenerating is not meant: the point
is that the files stay as the old code wrote them.
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

import mindzero

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "multirank"))
from models import build  # noqa: E402

# case -> (model, optimizer, stage, format, hybrid, param_dtype)
CASES = {
    "s1_ckpt": ("mixed", "adamw", 1, "ckpt", False, None),
    "s1_safetensors": ("awkward", "adam", 1, "safetensors", False, None),
    "s3_ckpt": ("resnet", "momentum", 3, "ckpt", False, None),
    "s3_safetensors": ("gpt", "sgd", 3, "safetensors", False, None),
    "hybrid_s3_ckpt": ("mixed", "adamw", 3, "ckpt", True, None),
    "mp_s1_ckpt": ("gpt", "adamw", 1, "ckpt", False, "float16"),
}


def optimizer(kind, net):
    params = net.trainable_params()
    return {"adamw": lambda: nn.AdamWeightDecay(params, 1e-2, weight_decay=0.05), "adam": lambda: nn.Adam(params, 1e-2),
            "momentum": lambda: nn.Momentum(params, 0.05, 0.9), "sgd": lambda: nn.SGD(params, 0.1, momentum=0.9)}[kind]()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dest", required=True)
    args = ap.parse_args()
    flat = mindzero.start_data_parallel()
    groups = mindzero.create_hybrid_groups(2)
    dest = Path(args.dest).resolve()
    for case, (model, opt, stage, fmt, hybrid, param_dtype) in CASES.items():
        net = build(model)
        o = optimizer(opt, net)
        if param_dtype:
            net = ms.amp.auto_mixed_precision(net, "O2")
        kw = dict(zip(("optimizer_parallel_group", "dp_group"), groups)) if hybrid else {}
        train = mindzero.prepare_train_network(net, o, zero_stage=stage, param_dtype=param_dtype, **kw)
        cls = type(build(model))
        for step in range(2):
            rng = np.random.RandomState(100 * step + flat.world_rank + 1)
            train(*[Tensor(a) for a in cls.batch(rng)])
        tmp = Path(args.out) / case
        mindzero.save_checkpoint(train, tmp, step=2, format=fmt)
        params = mindzero.gather_full_state_dict(train)
        masters = mindzero.gather_full_state_dict(train, masters=True) if param_dtype else {}
        if flat.world_rank == 0:
            merged = Path(args.out) / f"{case}.{fmt}"
            mindzero.merge_checkpoint(tmp, merged, format=fmt, with_optimizer=True, log=None)
            from mindzero.checkpoint.tensor_io import open_reader
            reader = open_reader(merged)
            arrays = {"param/" + k: v for k, v in params.items()}
            arrays.update({"master/" + k: v for k, v in masters.items()})
            arrays.update({"merged/" + k: reader.read(k) for k in reader.names()})
            shutil.rmtree(dest / case, ignore_errors=True)
            shutil.copytree(tmp, dest / case)
            np.savez(dest / case / "expected.npz", **arrays)
            (dest / case / "case.json").write_text(json.dumps(dict(model=model, optimizer=opt, stage=stage, format=fmt,
                                                                    hybrid=hybrid, param_dtype=param_dtype)))
        print(f"golden {case}: done", flush=True)
    (Path(args.out) / f"rank_{flat.world_rank}.done").write_text("ok")


if __name__ == "__main__":
    main()
