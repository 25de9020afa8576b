"""mindzero's pure core: options (:mod:`~mindzero.core.config`, the settings file :mod:`~mindzero.core.settings`),
the topology (:mod:`~mindzero.core.topology`), the partition plan (:mod:`~mindzero.core.plan`), the state
records (:mod:`~mindzero.core.state`), the collectives of a step (:mod:`~mindzero.core.comm_plan`) and the
memory formulas (:mod:`~mindzero.core.memory`, :mod:`~mindzero.core.estimate`). No module here imports
MindSpore (tests/unit/test_layout_guards.py)."""
