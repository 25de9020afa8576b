"""Starting a data-parallel worker: the start-up every worker repeats (graph mode, ``init()``), returning the
:class:`~mindzero.core.topology.World` it joined. The examples, the benchmarks and the test workers call it
(through :func:`mindzero.launch.worker.start_worker` or directly).

It leaves the device to MindSpore unless asked (``device=`` or ``MINDZERO_DEVICE``), and sets nothing of
MindSpore's static-graph parallel context: mindzero's train step makes its collectives itself. Only MindSpore's
own ``nn.TrainOneStepCell`` reduces gradients by that context; a script comparing with it sets it itself.
"""
from __future__ import annotations

import os

import mindspore as ms
from mindspore.communication import init

from ..core.topology import requested_device
from .groups import current_world


def start_data_parallel(device: str = None, mode=None):
    """Start a data-parallel worker: ``mode`` (default graph mode; ``mindspore.PYNATIVE_MODE`` runs the same train
    step with forward and backward eager), the device only where asked, then ``mindspore.communication.init()``.
    Call it once per process, on every rank, before building the network.

    Args:
        device: ``"CPU"``, ``"GPU"`` or ``"Ascend"`` (any case), or ``None``: ``$MINDZERO_DEVICE`` if set, else
            no ``mindspore.set_device`` call at all, so MindSpore's own choice stands (what the script set
            before, or the backend the installed MindSpore defaults to).
        mode: ``mindspore.GRAPH_MODE`` (``None``) or ``mindspore.PYNATIVE_MODE``.

    Returns:
        the :class:`mindzero.core.topology.World` of the whole world (use its ``world_rank`` / ``world_size``
        for data sharding: every rank its own data, also under hybrid sharding); its ``device`` is the one
        MindSpore runs on.

    Raises:
        ValueError: a ``device`` or ``MINDZERO_DEVICE`` that names no MindSpore device.
    """
    ms.set_context(mode=ms.GRAPH_MODE if mode is None else mode)
    chosen = requested_device(device, os.environ)
    if chosen is not None:
        ms.set_device(chosen)
    init()
    return current_world()
