"""Starting mindzero jobs (pure until a worker starts MindSpore):

* :mod:`~mindzero.launch.runtime`: ``start_data_parallel`` (every worker's start) and ``release_host_memory``;
* :mod:`~mindzero.launch.local`: local launches under msrun or mpirun with timeouts and the failing rank's
  log, and the worker protocol (``start_worker``, ``Worker.finish``); ``python -m mindzero.local_launch``;
* :mod:`~mindzero.launch.mpi`: joining MindSpore's cluster from ``mpirun``/``srun``:
  ``mpirun -n N python -m mindzero.launch SCRIPT``.
"""
from importlib import import_module

_NAMES = {"cluster_env": "mpi", "job_port": "mpi", "launcher_rank": "mpi", "start_scheduler": "mpi", "main": "mpi",
          "launch": "local", "msrun": "local", "start_worker": "local", "finish_rank": "local", "Worker": "local",
          "start_data_parallel": "runtime", "release_host_memory": "runtime"}


def __getattr__(name):
    if name in _NAMES:
        return getattr(import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
