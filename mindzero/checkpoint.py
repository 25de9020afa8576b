"""Full network parameters from a live train step, whatever the stage."""
from __future__ import annotations

import numpy as np
from mindspore import nn

from .shard import GatherFull


class _GatherAll(nn.Cell):
    def __init__(self, gathers):
        super().__init__(auto_prefix=False)
        self.gathers = nn.CellList(gathers)

    def construct(self, *shards):
        out = ()
        for i in range(len(shards)):
            out = out + (self.gathers[i](shards[i]),)
        return out


def gather_full_state_dict(train_net) -> dict:
    """Every network parameter, full, under its original name: ``{name: numpy.ndarray}``.

    Collective: all ranks must call it (stage 3 all-gathers each shard once).
    """
    info = train_net.zero_info
    out, names, shards, gathers = {}, [], [], []
    sharded_names = {s.name for s in info.plan if s.sharded} if info.config.policy.shard_parameters else set()
    for p in train_net.network.get_parameters():
        if p.name in sharded_names:
            names.append(p.name)
            shards.append(p)
            gathers.append(GatherFull(info.plan[p.name], info.world))
        else:
            out[p.name] = p.asnumpy().copy()
    if shards:
        for name, value in zip(names, _GatherAll(gathers)(*shards)):
            out[name] = value.asnumpy()
    return {s.name: out[s.name] for s in info.plan}
