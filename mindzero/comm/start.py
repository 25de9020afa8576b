"""Starting a data-parallel worker: the start-up every worker repeats (graph mode, device, ``init()``,
MindSpore's data-parallel context), returning the :class:`~mindzero.core.topology.World` it joined. The
example, the benchmarks and the test workers call it (through :func:`mindzero.launch.worker.start_worker`
or directly)."""
from __future__ import annotations

import os

import mindspore as ms
from mindspore.communication import init

from .groups import current_world


def start_data_parallel(device: str = None, mode=None):
    """Start a data-parallel worker: ``mode`` (default graph mode), ``device`` (default
    ``$MINDZERO_DEVICE`` or ``"CPU"``), ``mindspore.communication.init()`` and the DATA_PARALLEL
    context with ``gradients_mean=True``. Call it once per process, on every rank, before building
    the network.

    Returns:
        the :class:`mindzero.core.topology.World` of the whole world (use its ``world_rank`` /
        ``world_size`` for data sharding: every rank its own data, also under hybrid sharding).
    """
    ms.set_context(mode=ms.GRAPH_MODE if mode is None else mode)
    ms.set_device(device or os.environ.get("MINDZERO_DEVICE", "CPU"))
    init()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    return current_world()
