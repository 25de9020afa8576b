"""The MindSpore train step: :mod:`~mindzero.engine.prepare` (the entry point), :mod:`~mindzero.engine.assemble`
(the state), :mod:`~mindzero.engine.consistency` (cross-rank checks), :mod:`~mindzero.engine.train_step` (the
Cell), :mod:`~mindzero.engine.kernels` (every graph kernel), :mod:`~mindzero.engine.stage3` (parameters read
from shards in any Cell), :mod:`~mindzero.engine.optim`, :mod:`~mindzero.engine.materialize` (``lazy_init``),
:mod:`~mindzero.engine.report` (``memory_report``, the verbose log)."""
