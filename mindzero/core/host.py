"""Host memory: giving freed memory back to the OS, and reading this process's RSS (pure: ctypes and ``/proc``).

``release_host_memory()`` asks glibc to return the free pages of its heap to the OS (``malloc_trim(0)``).
MindSpore's graph compiler allocates and frees many small objects; glibc keeps the freed memory resident,
so a process's RSS after its first compile stays at the compiler's peak. The train step calls it once,
after its first call (the compile); it is a no-op where the C library is not glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util

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


def status_kib(field: str) -> int:
    """A field of ``/proc/self/status`` in KiB: ``VmRSS`` (resident now), ``VmHWM`` (the peak since the last
    :func:`reset_peak`)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> None:
    """Start a new peak: ``VmHWM`` becomes the current RSS (``5`` to ``/proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
