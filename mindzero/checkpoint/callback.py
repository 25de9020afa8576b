"""Training with ``mindspore.train.Model``: :class:`ZeroCheckpoint`, a callback that saves mindzero
checkpoints every ``save_every`` steps and lets a restarted ``Model.train`` continue exactly.

```python
train_net = mindzero.prepare_train_network(net, opt, config="zero.yaml")
ckpt = mindzero.ZeroCheckpoint(train_net, config="zero.yaml")      # or directory=, save_every=, keep=
initial_epoch = ckpt.resume(dataset)                                 # 0 when there is no checkpoint yet
Model(train_net).train(epochs, dataset, callbacks=[ckpt, LossMonitor(10)], dataset_sink_mode=False,
                       initial_epoch=initial_epoch)
```

A step is one call of the train step (one micro-batch with ``gradient_accumulation_steps``), as
``Model`` counts it. Each checkpoint (``<directory>/step_<n>``, written by
:func:`mindzero.save_checkpoint`) also holds, per rank, ``trainer_state_<rank>.json``: the step, the
epoch, the dataset's size and the rank's loss of every step so far. :meth:`ZeroCheckpoint.resume` loads the newest
complete checkpoint (:func:`mindzero.load_checkpoint`), moves the dataset to the saved position
(``Dataset.set_init_step``, MindSpore's own resume mechanism: the same batches, in the same shuffled
order, as an uninterrupted run) and returns the epoch for ``Model.train(initial_epoch=...)``; the
callback then continues the step count, so ``LossMonitor`` and the saved step numbers carry on.
"""
from __future__ import annotations

import inspect
import logging
import shutil
from pathlib import Path

from mindspore.train import Callback

from ..core.options import CheckpointOptions
from ..core.options import merge_settings
from ..core.settings import resolve_settings
from ..comm.cells import Barrier
from .directory import CheckpointError, complete_checkpoints, latest_checkpoint, read_trainer_state
from .live import load_checkpoint
from .save import save_checkpoint, wait_for_save

logger = logging.getLogger("mindzero")
PREFIX = "step_"


class ZeroCheckpoint(Callback):
    """Save mindzero checkpoints during ``Model.train`` and resume from the newest complete one.

    Written as MindSpore's ``ModelCheckpoint``: ``ZeroCheckpoint("ckpts", save_every=100)`` finds the train
    step in ``Model.train``'s run context; ``ZeroCheckpoint(train_net, "ckpts", ...)`` (the network first) works
    too.

    Args:
        directory: where the checkpoints go (``step_<n>`` directories); or the train step from
            :func:`mindzero.prepare_train_network`, the one ``Model`` trains, with the directory second.
        save_every: save every this many steps (a multiple of ``gradient_accumulation_steps``: a
            checkpoint is taken after an update); ``None``: only at the end of training.
        keep: keep the newest ``keep`` checkpoints (``0``: all).
        format: ``"ckpt"`` or ``"safetensors"``.
        async_save: write each checkpoint in the background while training goes on
            (:func:`mindzero.save_checkpoint` ``async_save=True``); the next save and the end of training
            wait for it. Old checkpoints are removed only once the previous save is complete.
        config: MindSpore's ``CheckpointConfig`` (its ``save_checkpoint_steps`` and ``keep_checkpoint_max``
            give ``save_every`` and ``keep``), or a settings file or mapping (:func:`mindzero.load_config`) whose
            ``checkpoint`` section gives any of ``dir``, ``save_every``, ``keep``, ``format``, ``async_save``. An
            argument also given here with a value other than its default is an error.

    Collective: every rank must use it (each save is collective). ``dataset_sink_mode=False`` only.
    """

    def __init__(self, *args, directory=None, save_every=None, keep=2, format="ckpt", config=None, async_save=False,
                 train_net=None):
        super().__init__()
        args = list(args)
        if args and _is_train_step(args[0]):  # ZeroCheckpoint(train_net, directory, ...): the network first
            train_net = args.pop(0)
        if args and args[0] is not None and not isinstance(args[0], (str, Path)):
            raise TypeError(f"ZeroCheckpoint: the first argument must be the checkpoint directory (str or Path) or "
                            f"the train step from mindzero.prepare_train_network, got {type(args[0]).__name__} "
                            f"{args[0]!r}")
        named = dict(directory=directory, save_every=save_every, keep=keep, format=format, config=config,
                     async_save=async_save)
        if len(args) > len(named):
            raise TypeError(f"ZeroCheckpoint: at most {len(named)} positional arguments after the network "
                            f"({', '.join(named)}), got {len(args)}")
        for key, value in zip(named, args):
            default = _SIGNATURE[key].default
            if named[key] is not default and named[key] != default:
                raise TypeError(f"ZeroCheckpoint: {key} is given twice, as an argument ({value!r}) and by name "
                                f"({named[key]!r})")
            named[key] = value
        directory, save_every, keep = named["directory"], named["save_every"], named["keep"]
        format, config, async_save = named["format"], named["config"], named["async_save"]
        given = {"dir": None if directory is None else str(directory), "save_every": save_every, "keep": keep,
                 "format": format, "async_save": async_save}
        defaults = CheckpointOptions().as_dict()
        try:
            settings = CheckpointOptions(**merge_settings(given, _config_options(config, defaults), defaults)).as_dict()
        except ValueError as err:
            raise ValueError(f"ZeroCheckpoint: {err}") from None
        if settings["dir"] is None:
            raise ValueError("ZeroCheckpoint: the checkpoint directory is required: ZeroCheckpoint(directory, ...) "
                             "(or checkpoint.dir in a settings file given as config=)")
        self.directory = Path(settings["dir"])
        self.save_every, self.keep, self.format = settings["save_every"], settings["keep"], settings["format"]
        self.async_save = settings["async_save"]
        self.train_net = None
        if train_net is not None:
            self._attach(train_net)
        self._start_step = 0
        self._batch_num = None
        self._last_saved = None
        self._pending = None
        self.history = []  # [step, loss] of every step taken, including those before a resume

    def _attach(self, train_net) -> None:
        """The train step this callback saves (given, or found in the run context); checks ``save_every``."""
        if not _is_train_step(train_net):
            raise TypeError(f"ZeroCheckpoint: the network must be a train step from mindzero.prepare_train_network, "
                            f"got {type(train_net).__name__}")
        k = train_net.zero_info.config.gradient_accumulation_steps
        if self.save_every is not None and self.save_every % k:
            raise ValueError(f"ZeroCheckpoint: save_every={self.save_every} must be a multiple of "
                             f"gradient_accumulation_steps={k} (a checkpoint is taken after an update)")
        self.train_net = train_net
        self._accumulation = k
        self._rank = train_net.zero_info.world.world_rank

    def resume(self, dataset, train_net=None) -> int:
        """Load the newest complete checkpoint under ``directory`` (if any) into the train step, move
        ``dataset`` to the position it was saved at, and return the epoch to pass as
        ``Model.train(..., initial_epoch=...)`` (0 without a checkpoint). Every rank calls it, before
        ``Model.train``. ``train_net``: the train step to load into; without it (and none given when the
        callback was made) the checkpoint is loaded into the network ``Model.train`` runs, when it begins.

        Raises:
            CheckpointError: the checkpoint does not fit the train step, or was saved with a dataset of
                another size (the saved data position would mean other batches).
        """
        if train_net is not None:
            self._attach(train_net)
        latest = latest_checkpoint(self.directory, PREFIX)
        if latest is None:
            return 0
        state = read_trainer_state(latest, self._rank if self.train_net is not None else _world_rank())
        missing = [k for k in ("step", "batch_num", "history") if k not in state]
        if missing:
            raise CheckpointError(f"{latest}: not written by ZeroCheckpoint (trainer_state lacks {missing}); "
                                  "load it with mindzero.load_checkpoint")
        size = dataset.get_dataset_size()
        if size != state["batch_num"]:
            raise CheckpointError(f"{latest}: saved with a dataset of {state['batch_num']} batches per epoch, "
                                  f"this dataset has {size}: the saved position would mean other data")
        if self.train_net is not None:
            load_checkpoint(self.train_net, latest)
        else:
            self._pending = latest  # loaded in on_train_begin, into the network Model trains
        step = int(state["step"])
        dataset.set_init_step(step)
        self._start_step = self._last_saved = step
        self.history = [list(h) for h in state["history"]]
        logger.info("ZeroCheckpoint: resumed from %s at step %d (epoch %d)", latest, step, step // size)
        return step // size

    def on_train_begin(self, run_context):
        cb = run_context.original_args()
        if cb.dataset_sink_mode:
            raise ValueError("ZeroCheckpoint needs Model.train(..., dataset_sink_mode=False): in sink mode "
                             "several steps run inside the device, where no checkpoint can be taken")
        if self.train_net is None:  # as MindSpore's ModelCheckpoint: the network from the run context
            self._attach(cb.train_network)
        if self._pending is not None:  # resume() found a checkpoint before the network was known
            load_checkpoint(self.train_net, self._pending)
            self._pending = None
        if cb.train_network is not self.train_net:
            raise ValueError("ZeroCheckpoint: Model trains another network than the train_net given to "
                             "ZeroCheckpoint; pass the Cell prepare_train_network returned to both")
        self._batch_num = cb.batch_num
        if self._start_step and cb.cur_step_num < self._start_step:
            cb.cur_step_num = self._start_step  # Model counts from 0; the resumed run carries on

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        out = cb.net_outputs
        loss = out[0] if isinstance(out, (tuple, list)) else out
        self.history.append([int(cb.cur_step_num), float(loss.asnumpy())])
        if self.save_every and cb.cur_step_num % self.save_every == 0:
            self._save(cb)

    def on_train_end(self, run_context):
        cb = run_context.original_args()
        step = int(cb.cur_step_num)
        if step != self._last_saved:
            self._final_save(cb, step)
        if self.async_save:  # the last checkpoint is complete when training returns
            wait_for_save()
            self._rotate()

    def _final_save(self, cb, step) -> None:
        if step % self._accumulation:
            logger.warning("ZeroCheckpoint: training ended at step %d, between the micro-batches of an update "
                           "(gradient_accumulation_steps=%d): no final checkpoint", step, self._accumulation)
            return
        self._save(cb)

    def _save(self, cb) -> None:
        step = int(cb.cur_step_num)
        path = self.directory / f"{PREFIX}{step:08d}"
        if path.exists():
            raise CheckpointError(f"{path} already exists: a ZeroCheckpoint directory belongs to one run (resume "
                                  "it with ZeroCheckpoint.resume, or choose another directory)")
        self.directory.mkdir(parents=True, exist_ok=True)
        state = {"step": step, "epoch": int(cb.cur_epoch_num), "batch_num": int(self._batch_num),
                 "history": self.history}
        if self.async_save:
            wait_for_save()  # the previous checkpoint is complete (on every rank) before older ones go
            self._rotate()
            save_checkpoint(self.train_net, path, step=step, format=self.format, trainer_state=state,
                            async_save=True)
        else:
            save_checkpoint(self.train_net, path, step=step, format=self.format, trainer_state=state)
            self._rotate()
        self._last_saved = step
        logger.info("ZeroCheckpoint: %s %s", "saving (in the background)" if self.async_save else "saved", path)

    def _rotate(self) -> None:
        """Rank 0 keeps the newest ``keep`` complete checkpoints and removes interrupted saves; every rank
        then sees the directory as rank 0 left it. Never called while a save of this run is in flight."""
        if self._rank == 0:
            removed = complete_checkpoints(self.directory, PREFIX)[:-self.keep] if self.keep else []
            stale = [p for p in self.directory.glob(PREFIX + "*.partial") if p.is_dir()]  # interrupted saves
            for p in (*removed, *stale):
                shutil.rmtree(p, ignore_errors=True)
            if removed:
                logger.info("ZeroCheckpoint: removed %s", ", ".join(p.name for p in removed))
        Barrier(self.train_net.zero_info.world)()  # every rank sees the directory as rank 0 left it


_SIGNATURE = inspect.signature(ZeroCheckpoint.__init__).parameters  # the defaults of the named arguments


def _world_rank() -> int:
    """This process's rank in the world (0 outside a distributed launch)."""
    from ..comm.groups import current_world
    return current_world().world_rank


def _is_train_step(obj) -> bool:
    return hasattr(obj, "zero_info") and hasattr(obj, "optimizer")


def _config_options(config, defaults: dict) -> dict:
    """The checkpoint options a ``config`` gives: MindSpore's ``CheckpointConfig`` (how often, how many), or the
    ``checkpoint`` section of a settings file or mapping (the values other than the defaults)."""
    if config is None:
        return {}
    if hasattr(config, "save_checkpoint_steps") and hasattr(config, "keep_checkpoint_max"):  # CheckpointConfig
        if getattr(config, "save_checkpoint_seconds", None) or getattr(config, "keep_checkpoint_per_n_minutes", None):
            raise ValueError("ZeroCheckpoint: config (a CheckpointConfig) saves by time (save_checkpoint_seconds or "
                             "keep_checkpoint_per_n_minutes); ZeroCheckpoint saves every save_checkpoint_steps steps")
        options = {"save_every": config.save_checkpoint_steps, "keep": config.keep_checkpoint_max}
        return {k: v for k, v in options.items() if v != defaults[k]}
    return {k: v for k, v in resolve_settings(config)["checkpoint"].items() if v != defaults[k]}
