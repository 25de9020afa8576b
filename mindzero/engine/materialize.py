"""Sharded initialisation: build a network without materialising it, keep only this rank's shards.

Under :func:`lazy_init`, ``Parameter(initializer(...))`` and ``param.set_data(initializer(...))`` leave
the Parameter unmaterialised (MindSpore's lazy initializer data: ``param.has_init``), for the network
and the optimizer built inside it.
``prepare_train_network`` then materialises one tensor at a time, keeps what the stage needs (the
shard at stage 3, the parameter split into its shard and the rest at stages 1-2 (with ``param_dtype`` the
full parameter and its master shard); shards of the optimizer
states from stage 1) and frees the rest, so no rank ever holds the full model.

Values equal an eager build's, bit for bit. MindSpore's random initializers each take one seed
from NumPy's global random state when they run (``_numpy_seed()``), so an eager build draws them in
construction order. :func:`lazy_init` records, for every initializer a lazy Parameter receives (at
creation, or later through ``set_data``), NumPy's global state at the moment an eager build would have
initialised it, and advances that state as the
initializer would have (:func:`advance`): one draw for MindSpore's random initializers
(:data:`ONE_DRAW`), none for the constant ones (:data:`NO_DRAW`); any other initializer (a user's
own, ``Sparse``) is run once into a scratch array of its shape, one tensor at a time. Materialising
restores the recorded state, so the order of materialisation does not matter.

Across ranks: with the same seed (``mindspore.set_seed``) every rank draws the same values, and
``prepare_train_network`` checks it (a CRC32 of every full value it computes, compared in one
all-gather). Parameters created under MindSpore's own ``mindspore.nn.utils.no_init_parameters()``
are lazy too but carry no recorded state: they are initialised from the global state in partition-
plan order, equal across ranks with a common seed, but not equal to an eager build.
"""
from __future__ import annotations

import contextlib

import numpy as np

from ..core.checksum import crc32_array
from ..core.plan import shard_array

_STATE = "_mindzero_rng_state"  # attribute on an initializer Tensor: NumPy's state for its eager init
_DEPTH = [0]
_ORIGINAL = {}  # Parameter.__new__ and Parameter.set_data while lazy_init is active


def _initializer_classes():
    from mindspore.common import initializer as ini

    one = (ini.Normal, ini.Uniform, ini.TruncatedNormal, ini.XavierNormal, ini.XavierUniform, ini.HeNormal,
           ini.HeUniform, ini.Orthogonal, ini.VarianceScaling)
    none = (ini.Zero, ini.One, ini.Constant, ini.Identity, ini.Dirac)
    return one, none


def np_dtype(ms_dtype):
    from mindspore.common import dtype as mstype

    return mstype._dtype_to_nptype(ms_dtype)  # pylint: disable=protected-access  (as Tensor.init_data)


def _new_array(init_tensor) -> np.ndarray:
    from mindspore.common.initializer import Zero

    shape, dtype = tuple(init_tensor.shape), np_dtype(init_tensor.dtype)
    return np.zeros(shape, dtype) if isinstance(init_tensor.init, Zero) else np.ndarray(shape, dtype)


def advance(init_tensor) -> None:
    """Move NumPy's global random state as initialising ``init_tensor`` would (see the module note)."""
    from mindspore.common.initializer import _numpy_seed

    one, none = _initializer_classes()
    kind = type(init_tensor.init)
    if kind in none:
        return
    if kind in one:
        _numpy_seed()
        return
    init_tensor.init(_new_array(init_tensor))  # unknown initializer: run it once, one tensor at a time


def _record(init_tensor) -> None:
    """``init_tensor`` is being attached to a lazy Parameter where an eager build would initialise it:
    record NumPy's state for it and move the state on (once per initializer Tensor: a clone or copy
    reuses the Tensor and draws nothing)."""
    if getattr(init_tensor, "init", None) is not None and not hasattr(init_tensor, _STATE):
        setattr(init_tensor, _STATE, np.random.get_state())
        advance(init_tensor)


def _recording_new(cls, default_input, *args, **kwargs):
    obj = _ORIGINAL["__new__"].__func__(cls, default_input, *args, **kwargs)
    if obj.has_init:
        _record(default_input)
    return obj


def _recording_set_data(self, data, slice_shape=False):
    # model zoos re-initialise after construction: ``param.set_data(initializer(...))`` (mindcv's ViTs);
    # an eager build initialises there, a lazy Parameter keeps the initializer (same dtype only: on a dtype
    # change MindSpore initialises at once, drawing from the state itself)
    if is_lazy(self) and getattr(data, "has_init", False) and data.dtype == self.dtype:
        _record(data)
    return _ORIGINAL["set_data"](self, data, slice_shape)


def _check_lazy_parameters(parameter_class) -> None:
    """Refuse a MindSpore whose ``Parameter`` does not read the class flag ``init_param`` (what its own
    ``no_init_parameters`` sets and this context relies on): there every Parameter would be materialised at once."""
    import inspect

    import mindspore as ms

    from ..core.versions import require_feature

    try:
        reads_flag = "init_param" in inspect.getsource(parameter_class.__dict__["__new__"].__func__)
    except (KeyError, AttributeError, OSError, TypeError):
        reads_flag = False
    require_feature(reads_flag, "Parameter.init_param (the flag mindspore.nn.utils.no_init_parameters sets)",
                    ms.__version__, "mindzero.lazy_init()")


@contextlib.contextmanager
def lazy_init():
    """Build the network and its optimizer inside this context to leave their Parameters unmaterialised;
    ``prepare_train_network`` then keeps one shard per rank, with values equal to an eager build's.

    Example::

        mindspore.set_seed(0)            # the same on every rank
        with mindzero.lazy_init():
            net = MyNet()
            opt = nn.AdamWeightDecay(net.trainable_params(), 1e-4)
        train_net = mindzero.prepare_train_network(net, opt, zero_stage=3)

    Parameters made from NumPy arrays or materialised Tensors are not lazy (MindSpore copies their data
    at once); build large ones with ``initializer(...)``.
    """
    from mindspore import Parameter

    if _DEPTH[0] == 0:
        _check_lazy_parameters(Parameter)
        _ORIGINAL.update({"__new__": Parameter.__dict__["__new__"], "set_data": Parameter.__dict__["set_data"]})
        Parameter.__new__ = staticmethod(_recording_new)
        Parameter.set_data = _recording_set_data
        previous = getattr(Parameter, "init_param", True)
        Parameter.init_param = False  # what mindspore.nn.utils.no_init_parameters() sets
    _DEPTH[0] += 1
    try:
        yield
    finally:
        _DEPTH[0] -= 1
        if _DEPTH[0] == 0:
            Parameter.__new__ = _ORIGINAL["__new__"]
            Parameter.set_data = _ORIGINAL["set_data"]
            Parameter.init_param = previous


@contextlib.contextmanager
def _numpy_state(state):
    if state is None:
        yield
        return
    saved = np.random.get_state()
    np.random.set_state(state)
    try:
        yield
    finally:
        np.random.set_state(saved)


def is_lazy(param) -> bool:
    return bool(param.has_init) and getattr(param, "init_mode", None) is not None


def full_array(param) -> np.ndarray:
    """The full value of ``param`` as a new NumPy array: its data, or (lazy) its initializer's output,
    computed exactly as MindSpore's ``Tensor.init_data`` would; ``param`` itself stays as it is."""
    if not is_lazy(param):
        return param.asnumpy()
    from mindspore.common.initializer import Zero

    init_tensor = param.init_mode
    data = _new_array(init_tensor)
    if not isinstance(init_tensor.init, Zero):
        with _numpy_state(getattr(init_tensor, _STATE, None)):
            init_tensor.init(data)
    return data


def materialize(param, digests=None):
    """Initialise a lazy ``param`` in place (full), with the values an eager build gives; a no-op otherwise.
    ``digests``: a dict that receives ``param.name`` -> CRC32 of the value when one was computed."""
    if is_lazy(param):
        with _numpy_state(getattr(param.init_mode, _STATE, None)):
            param.init_data()
        if digests is not None:
            digests[param.name] = crc32_array(param.asnumpy())
    return param


def shard_of(param, spec, digests=None) -> np.ndarray:
    """This rank's padded 1D shard of ``param`` (per ``spec``), computing the full value one tensor at a
    time (none at all for a lazy all-zeros tensor). ``digests``: a dict that receives ``spec.name`` ->
    CRC32 of the full value where one was computed (for the cross-rank check)."""
    from mindspore.common.initializer import Zero

    if is_lazy(param) and isinstance(param.init_mode.init, Zero):
        return np.zeros(spec.shard_size if spec.sharded else spec.numel, np_dtype(param.dtype))
    full = full_array(param)
    if digests is not None:
        digests[spec.name] = crc32_array(full)
    return shard_array(full, spec)


def make_shard(param, spec, name: str, requires_grad: bool = True, digests=None):
    """A new 1D Parameter named ``name`` holding this rank's padded shard of ``param`` (which may be lazy:
    see :func:`shard_of`, which also fills ``digests``)."""
    from mindspore import Parameter, Tensor

    return Parameter(Tensor(shard_of(param, spec, digests), param.dtype), name=name, requires_grad=requires_grad)
