"""``python -m mindzero.local_launch -n 2 [--nodes K] [--launcher msrun|mpirun] [--timeout S] [--out DIR] SCRIPT``:
the command line of :mod:`mindzero.launch.local` (kept at this path: the README's main command uses it)."""
import sys

from mindzero.launch.local import *  # noqa: F401,F403  (the names of this module before issue 22)
from mindzero.launch.local import main

if __name__ == "__main__":
    sys.exit(main())
