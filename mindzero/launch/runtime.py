"""Process-level helpers: starting a data-parallel worker, and giving freed host memory back to the OS.

``start_data_parallel()`` is the start-up every worker repeats (graph mode, device, ``init()``,
MindSpore's data-parallel context); the example, the benchmarks and the test workers call it.

``release_host_memory()`` asks glibc to return the free pages of its heap to the OS
(``malloc_trim(0)``). MindSpore's graph compiler allocates and frees many small objects; glibc keeps
the freed memory resident, so a process's RSS after its first compile stays at the compiler's peak.
The train step calls it once, after its first call (the compile); it is a no-op where the C library
is not glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

_LIBC = []


def _libc():
    if not _LIBC:
        lib = None
        name = ctypes.util.find_library("c")
        if name:
            try:
                lib = ctypes.CDLL(name)
                lib.malloc_trim  # glibc only  # noqa: B018
            except (OSError, AttributeError):
                lib = None
        _LIBC.append(lib)
    return _LIBC[0]


def release_host_memory() -> bool:
    """``malloc_trim(0)``: return the free memory of glibc's heaps to the OS. ``False`` where unavailable
    (not glibc)."""
    lib = _libc()
    if lib is None:
        return False
    lib.malloc_trim(ctypes.c_size_t(0))
    return True


def start_data_parallel(device: str = None, mode=None):
    """Start a data-parallel worker: ``mode`` (default graph mode), ``device`` (default
    ``$MINDZERO_DEVICE`` or ``"CPU"``), ``mindspore.communication.init()`` and the DATA_PARALLEL
    context with ``gradients_mean=True``. Call it once per process, on every rank, before building
    the network.

    Returns:
        the :class:`mindzero.core.topology.World` of the whole world (use its ``world_rank`` /
        ``world_size`` for data sharding: every rank its own data, also under hybrid sharding).
    """
    import mindspore as ms
    from mindspore.communication import init

    from ..comm.groups import current_world

    ms.set_context(mode=ms.GRAPH_MODE if mode is None else mode)
    ms.set_device(device or os.environ.get("MINDZERO_DEVICE", "CPU"))
    init()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    return current_world()
