"""Mixed precision on the network a user has: what ``param_dtype`` needs of it, and the conversion mindzero
makes when the network has none of its own.

With ``param_dtype`` the network holds its optimized parameters in fp16/bf16, so it must compute in that dtype
where it reads them (a fp32 MatMul of a fp16 weight is a kernel type error). FSDP2's ``MixedPrecisionPolicy``
makes the forward run in ``param_dtype`` by itself; mindzero does the same where the user has not set up mixed
precision: a network none of whose Cells has a ``to_float`` setting is converted as MindSpore's AMP level O2
does (``mindspore.amp.auto_mixed_precision(network, "O2")``: BatchNorm and LayerNorm in fp32, the output cast to
fp32), with the loss Cells (``nn.LossBase``) computing in fp32 too, so that an fp16 softmax over a vocabulary
cannot overflow. A network the user converted, wholly or in part (any ``to_float``, e.g.
``auto_mixed_precision(net, "O2")``), keeps exactly its setup.
"""
from __future__ import annotations

import contextlib

import mindspore as ms
from mindspore import amp, nn

from ..core.config import MixedPrecision

_PRECISION_FLAGS = ("fp16", "bf16", "fp32")


def has_own_precision(network) -> bool:
    """Whether any Cell of ``network`` has a ``to_float`` setting (the user set up mixed precision)."""
    return any(cell.get_flags().get(flag) for _, cell in network.cells_and_names() for flag in _PRECISION_FLAGS)


def computing_in(network, precision: MixedPrecision):
    """``network`` as the train step runs it under ``precision``: as it is, or converted to compute in
    ``param_dtype`` (see the module note); returns the (possibly wrapped) network, whose Parameters are the
    user's (the conversion keeps their names)."""
    if not precision.enabled or has_own_precision(network):
        return network
    converted = amp.auto_mixed_precision(network, "O2", dtype=getattr(ms, precision.param_dtype))
    for _, cell in network.cells_and_names():
        if isinstance(cell, nn.LossBase):  # computes in fp32 and returns fp32 (not cast back, as O2's black list is)
            cell.to_float(ms.float32)
    return converted


_TYPE_NAMES = {"float16": "Float16", "bfloat16": "BFloat16"}


@contextlib.contextmanager
def explain_dtype_errors(network, precision: MixedPrecision):
    """Turn a compile-time dtype mismatch between ``param_dtype`` weights and float32 activations into an error
    naming ``param_dtype`` and the fix.

    It can only happen with a network the user converted in part (mindzero keeps such a setup as it is): a
    Cell without ``to_float`` that reads a ``param_dtype`` weight with float32 inputs. Which Cells those are
    cannot be told before compiling without false alarms (a ``construct`` may cast its inputs itself), so
    MindSpore's own error is kept, chained, below this one.
    """
    try:
        yield
    except TypeError as err:
        text = str(err)
        if not precision.enabled or _TYPE_NAMES[precision.param_dtype] not in text or "Float32" not in text:
            raise
        reads = f"computes in float32 where it reads a {precision.param_dtype} parameter"
        why = (f"the network sets up its own mixed precision (a Cell has a to_float setting), which mindzero keeps "
               f"as it is, and a Cell of it {reads}" if has_own_precision(network) else f"a Cell {reads}")
        first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
        raise TypeError(f"param_dtype={precision.param_dtype}: the optimized parameters are held in "
                        f"{precision.param_dtype}, so the network must compute in it where it reads them; {why} "
                        f"(MindSpore: {first}). Fix: convert the whole network, "
                        f"mindspore.amp.auto_mixed_precision(net, 'O2', dtype=ms.{precision.param_dtype}), or "
                        f"to_float(ms.{precision.param_dtype}) on the Cells that read them, or remove the "
                        f"to_float settings and let mindzero convert it; or keep a parameter in float32 by "
                        f"marking its Cell to_float(ms.float32)") from err


def check_precision(precision: MixedPrecision, optimizer, world) -> None:
    """Refuse a mixed-precision policy this run cannot honour.

    Raises:
        ValueError: bfloat16 on CPU (MindSpore has no bfloat16 Dense/MatMul kernels there), or an
            optimized parameter that is not float32 (its fp32 master and states come from it).
    """
    if precision.reduce_dtype == "bfloat16" and not precision.enabled and world.device == "CPU":
        raise ValueError("reduce_dtype=bfloat16 is not supported on CPU: mindzero refuses bfloat16 there as it "
                         f"refuses param_dtype=bfloat16 (MindSpore {ms.__version__} has no bfloat16 Dense/MatMul kernels on CPU; "
                         "its bfloat16 collectives are not verified there); use reduce_dtype=float16 with a loss "
                         "scale on CPU (bfloat16 on GPU/Ascend)")
    if not precision.enabled:
        return
    if precision.param_dtype == "bfloat16" and world.device == "CPU":
        raise ValueError(f"param_dtype=bfloat16 is not supported on CPU: MindSpore {ms.__version__} has no bfloat16 "
                         "kernels for Dense/MatMul there; use param_dtype=float16 on CPU (bfloat16 on GPU/Ascend)")
    for p in optimizer.parameters:
        if str(p.dtype).lower() != "float32":
            raise ValueError(f"param_dtype={precision.param_dtype} needs the optimizer's parameters in float32 "
                             f"(mindzero makes the {precision.param_dtype} copies and keeps the fp32 masters); "
                             f"parameter {p.name!r} is {str(p.dtype).lower()}: build the network in float32")
