"""Starting mindzero jobs:

* :mod:`~mindzero.launch.local`: local launches under msrun or mpirun with timeouts and the failing rank's
  log: ``python -m mindzero.launch.local -n N SCRIPT`` (pure: imports no MindSpore);
* :mod:`~mindzero.launch.mpi`: joining MindSpore's cluster from ``mpirun``/``srun``:
  ``mpirun -n N python -m mindzero.launch SCRIPT`` (pure);
* :mod:`~mindzero.launch.worker`: the worker side of a launch (``start_worker``, ``Worker.finish``,
  ``finish_rank``), the one module here that starts MindSpore.
"""
