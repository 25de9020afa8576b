"""One fresh process trains a few steps as rank 0 of 2 (rehearsed) and prints what it did, for the compile cache's
tests (tests/single/test_compile_cache.py): a process of its own per run, because MindSpore's compile cache is
read by the first compile of a process.

    python -m tests.support.cached_step MODEL OPTIMIZER STAGE CACHE|- [OPTIONS_JSON]

Prints one line ``RESULT {"losses": [...], "params": {name: sha256 of the bytes}}``; ``CACHE`` ``-``: no
``compile_cache``.
"""
import hashlib
import json
import sys

import mindspore as ms

import mindzero
from mindzero.comm.groups import rehearse
from tests.support.data import batch
from tests.support.models import build, make_optimizer

STEPS = 3


def main(argv):
    model, optimizer, stage, cache = argv[:4]
    options = json.loads(argv[4]) if len(argv) > 4 else {}
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    with rehearse(2):
        net = build(model)
        step = mindzero.prepare_train_network(net, make_optimizer(optimizer, net), zero_stage=int(stage),
                                              compile_cache=None if cache == "-" else cache, **options)
        losses = [float(step(*batch(type(net), i, 0))[0].asnumpy()) for i in range(STEPS)]
        params = {name: hashlib.sha256(value.tobytes()).hexdigest()
                  for name, value in mindzero.gather_full_state_dict(step).items()}
    print("RESULT " + json.dumps({"losses": losses, "params": params}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
