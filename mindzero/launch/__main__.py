"""``mpirun -n N python -m mindzero.launch [--master-addr A] [--master-port P] SCRIPT [ARGS...]`` (see
:mod:`mindzero.launch.mpi`)."""
import sys

from mindzero.launch.mpi import main

sys.exit(main())
