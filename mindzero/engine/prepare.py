"""``prepare_train_network``: wrap a network and its optimizer into a ZeRO train step.

The entry point only: the options become one :class:`~mindzero.core.config.ZeroConfig`, the world is
resolved (:mod:`mindzero.comm.groups`), the state assembled (:mod:`mindzero.engine.assemble`), and the step
is :class:`mindzero.engine.train_step.ZeroTrainOneStepCell`.
"""
from __future__ import annotations

import gc
import logging

import mindspore as ms
from mindspore import nn

from ..comm.groups import world_for
from ..core.config import ZeroConfig
from ..core.offload import DEFAULT_CHUNK_MB
from ..core.options import OPTIONS, merge_settings, off_defaults
from ..core.settings import resolve_settings
from ..core.versions import check_mindspore, warn_deviation
from .assemble import assemble
from .precision import check_precision, computing_in
from .report import plan_text
from .train_step import ZeroTrainOneStepCell

logger = logging.getLogger("mindzero")


def prepare_train_network(network, optimizer, scale_sense=1.0, ema=None, updates=0, drop_overflow_update=True,
                          gradient_accumulation_steps=1, clip_grad=False, clip_norm=1.0, verbose=False,
                          zero_stage=0, optimizer_offload=False, optimizer_parallel_group=None, dp_group=None,
                          comm_fusion=None, parallel_modules=None, stage3_regather=True, param_dtype=None,
                          reduce_dtype=None, shard_frozen=True, gather_quantization=None, gather_units=None,
                          stage3_param_persistence_threshold=100_000,
                          stage3_model_persistence_threshold=None, offload_dir=None, offload_chunk_mb=DEFAULT_CHUNK_MB,
                          offload_keep=False, compile_cache=None, update_sharding="auto", config=None):
    """Wrap ``network`` (which returns the loss) and ``optimizer`` into a ZeRO train step.

    Must be called on all ranks, with the same network and optimizer structure,
    after ``mindspore.communication.init()`` (or without it, for one process).

    Args:
        network: a Cell returning a scalar loss.
        optimizer: a ``mindspore.nn.Optimizer`` over (a subset of) ``network``'s parameters.
            From stage 1 on it is re-pointed at shard Parameters in place; do not reuse it elsewhere.
        scale_sense: loss scale: a number, a scalar Tensor, or ``nn.DynamicLossScaleUpdateCell``.
        drop_overflow_update: skip the update on all ranks when any rank's gradients overflow.
        gradient_accumulation_steps: micro-batches per update (each call is one micro-batch).
        clip_grad, clip_norm: clip by the global norm over all shards.
        verbose: log the partition plan on rank 0.
        zero_stage: 0 (plain data parallel), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters).
        optimizer_parallel_group, dp_group: ``None`` (or the world group) to shard over the whole world;
            or, for hybrid sharding, the name of this rank's op group (the ranks it shards with) and of its
            dp group (the ranks holding the same shard in the other op groups); see
            :func:`mindzero.create_hybrid_groups` and docs/hybrid.md.
        comm_fusion: ``None``, or mindone's dict ``{"allreduce" | "reduce_scatter" | "allgather":
            {"openstate": bool, "bucket_size": bytes}}``: consecutive tensors share one collective up to
            ``bucket_size`` bytes (full-tensor bytes) per bucket; results equal fusion off (docs/performance.md).
        stage3_regather: stage 3, graph mode: all-gather each parameter again in backward instead of
            keeping its full value alive from forward (peak gathered-parameter memory about the largest
            layer's, at one more all-gather per parameter); ``False`` trades that memory for speed.
        optimizer_offload: ``False``; ``True`` or ``"host"``: run the optimizer's update primitive (and so keep
            its states) on the host, see :func:`mindzero.engine.optim.offload_update` (on CPU: the same result,
            nothing moves); ``"disk"`` (stages 1-3): keep each rank's optimizer states in a file under
            ``offload_dir`` and stream them through the update ``offload_chunk_mb`` MiB at a time, bit-identical to
            the in-memory update (:mod:`mindzero.engine.offload`, docs/stages.md). The directory must exist, be
            writable and have room for the states (checked, and the space reserved, before training); the file is
            removed at exit unless ``offload_keep=True``. Checkpoints are unchanged: they read the states from it.
        ema: ``None``; a decay in (0, 1); or mindone's ``EMA`` (its ``ema_decay`` is used): keep an
            exponential moving average of the optimized parameters, held like them (shards at stage 3),
            updated after each applied step; ``updates``: its initial step count (decay warm-up).
            Read it with ``gather_full_state_dict(train_net, ema=True)``; checkpoints save it.
        param_dtype: ``None`` (default: parameters trained in their own dtype), ``ms.float16`` or
            ``ms.bfloat16`` (or the name): mixed precision: the network holds its optimized parameters in
            this dtype (full at stages 0-2, shards at stage 3; gathered in it at stages 1-3) and the
            optimizer updates fp32 master values (full at stage 0, shards from stage 1) that are cast back
            after each update. A network with no ``to_float`` setting of its own is made to compute in this
            dtype as MindSpore's AMP O2 does (BatchNorm, LayerNorm and the loss Cells in fp32:
            :mod:`mindzero.engine.precision`); a network you converted keeps its setup. Cells marked
            ``to_float(ms.float32)`` (LayerNorm, BatchNorm) get fp32 copies. Memory: the ZeRO paper's
            16Φ, 4Φ + 12Φ/N, 2Φ + 14Φ/N, 16Φ/N. See docs/stages.md.
        reduce_dtype: with ``param_dtype``: the dtype gradients are reduced and accumulated in: ``None``
            (= ``param_dtype``, half the bytes of fp32) or ``ms.float32``; the optimizer gets fp32. Without
            ``param_dtype``: ``None``/``ms.float32`` (gradients reduced in their parameters' dtype), or
            ``ms.float16`` (needs a loss scale: ``scale_sense``) / ``ms.bfloat16`` (GPU/Ascend): fp32 parameters
            whose gradients are reduced in 16 bits (half the bytes) and widened to fp32 before the mean.
        shard_frozen: stage 3 also shards the parameters the optimizer does not update and the network only
            reads (a frozen backbone; adapter fine-tuning): gathered like the others, with no gradient
            reduction. Buffers the network writes (BatchNorm's statistics, a Parameter a Cell assigns to:
            :func:`mindzero.core.introspect.written_buffers`) stay per rank. ``False``: every frozen parameter is
            kept whole on every rank.
        gather_quantization: stage 3 only: ``None`` (exact gathers), ``"int8"`` or a mapping ``{"kind": "int8",
            "block_size": 256, "min_numel": 65536, "exclude": ["*bias*", "*norm*", ...]}``: the forward and
            backward weight gathers send int8 values with one fp32 scale per block (ZeRO++'s qwZ; about a
            quarter of fp32's bytes); what a rank stores stays exact. Error bound and when to use it:
            docs/stages.md.
        gather_units: stage 3, graph mode only: ``None`` (one all-gather per parameter), an int (bytes of full
            parameters per unit: consecutive parameters share one all-gather) or Cell-name patterns (``"blocks.*"``:
            each matching Cell's parameters share one, as FSDP2 wraps a block). Values and gradients are
            exactly those without units; gradients are still reduced one parameter at a time
            (:mod:`mindzero.core.units`, docs/performance.md).
        stage3_param_persistence_threshold: stage 3: parameters of fewer elements (biases, norms) are kept whole
            on every rank, as DeepSpeed's option of that name: no gather and no reduce-scatter each, their
            gradients all-reduced together in one fused call (``comm_fusion``'s allreduce bucket if set),
            their optimizer states whole. ``100_000`` (DeepSpeed's default): a transformer's biases, norms and
            position tables; ``0``: every parameter sharded. Below stage 3 it changes nothing.
        stage3_model_persistence_threshold: stage 3: the most elements kept whole in all (the smallest
            parameters first), as DeepSpeed's option of that name; ``None``: 1% of the model's elements.
        compile_cache: ``None``, or a directory where the compiled train step is kept (MindSpore's compile cache,
            in a subdirectory named by a digest of everything that shapes the step's graph: its Cells and their
            constants, the parameters' shapes, the inputs' shapes, these options, the world and this rank, the
            versions), so that the next launch or resume with the same key loads it instead of compiling; other
            settings compile anew. With MindSpore's cache on for the whole process (``MS_COMPILER_CACHE_ENABLE=1``)
            and no ``compile_cache``, the step is kept the same way under ``<its path>/mindzero``.
            :mod:`mindzero.engine.compile_cache`, docs/performance.md.
        update_sharding: how stages 1-3 share the update out. ``"auto"``: a parameter whose update is
            element-wise (Adam, SGD, ...) is updated as flat 1/N shards, any other whole on one owner rank (chosen
            per parameter from the optimizer, :mod:`mindzero.core.optim_plan`). ``"owner"``: every sharded
            parameter is updated whole on one owner rank and broadcast, as PyTorch's ``ZeroRedundancyOptimizer``
            partitions by parameter: in fp32 at stages 1-2 no rank keeps a master shard beside the network's
            Parameter (less memory, one broadcast per parameter more; docs/stages.md).
        parallel_modules: mindone's argument; not needed (stage 3 works for any Cell): a value raises
            ``NotImplementedError``.
        config: a settings file (YAML path) or mapping (:func:`mindzero.load_config`) holding any of the
            arguments above that a file can hold (``hybrid_shard_size: G`` there creates the hybrid groups:
            :func:`mindzero.create_hybrid_groups`), or a :class:`~mindzero.core.config.ZeroConfig`. An argument
            also given here with a value other than its default is an error (naming both values): one source
            per setting. The options, their defaults and what each accepts: :data:`mindzero.core.options.OPTIONS`
            (docs/training.md).

    Returns:
        :class:`ZeroTrainOneStepCell`; ``loss, overflow, scale = train_net(*inputs)``.

    Raises:
        ValueError / TypeError: bad arguments (the message names the argument, value and rule).
        mindzero.core.versions.UnsupportedMindSpore: a MindSpore older than mindzero supports.
    """
    given = locals()
    check_mindspore(ms.__version__)  # refuses one older than supported, warns once about one newer than tested
    zero = zero_config({o.name: given[o.name] for o in OPTIONS if o.argument}, config)
    if zero.precision.param_dtype is not None and zero.zero_stage > 0:
        warn_deviation(ms.__version__, "param_dtype")
    if not isinstance(network, nn.Cell):
        raise TypeError(f"network must be a mindspore.nn.Cell, got {type(network).__name__}")
    world = world_for(zero.groups)
    check_precision(zero.precision, optimizer, world)  # before the network is converted: a refusal changes nothing
    network = computing_in(network, zero.precision)
    state = assemble(network, optimizer, zero, world)
    train_net = ZeroTrainOneStepCell(network, optimizer, state)
    # the replaced full tensors (parameters at stage 3, optimizer states from stage 1) sit in reference
    # cycles of MindSpore objects: collect them now, not whenever the cyclic collector next runs (at stage 3 they
    # are most of a model); prepare's own references are gone by here
    gc.collect()
    if verbose and state.world.world_rank == 0:
        logger.warning("%s", plan_text(train_net))
    return train_net


def zero_config(arguments: dict, config=None) -> ZeroConfig:
    """The :class:`ZeroConfig` of ``prepare_train_network``'s keyword ``arguments`` and its ``config`` (``None``, a
    settings path or mapping, or a ``ZeroConfig``), by the one rule for a setting given both ways
    (:func:`~mindzero.core.options.merge_settings`).

    Raises:
        ValueError: a bad value, or a setting given both ways (naming both values).
        TypeError: ``config`` of another type.
    """
    if isinstance(config, ZeroConfig):
        given = off_defaults(arguments)
        if given:
            k = sorted(given)[0]
            raise ValueError(f"{k}={given[k]!r} is given as an argument while config is a ZeroConfig, which holds "
                             "every option; give each setting once")
        return config
    if config is not None and not isinstance(config, (str, dict)) and not hasattr(config, "__fspath__"):
        raise TypeError(f"config must be None, a settings file path, a settings mapping or a ZeroConfig, got "
                        f"{type(config).__name__}")
    if config is not None:
        settings = {k: v for k, v in resolve_settings(config).items() if k != "checkpoint"}
        arguments = merge_settings(arguments, settings)
    return ZeroConfig.from_arguments(arguments)
