"""Tensor-at-a-time reading and writing of MindSpore ``.ckpt`` and safetensors files (no MindSpore import).

The merge and reshard tools must hold about one full tensor at a time, not the
model. MindSpore's own loader parses a whole file; here:

* ``.ckpt``: MindSpore writes a sequence of serialized ``Checkpoint`` messages,
  each with one ``Value`` (a name and a ``TensorProto``: dims, type name, raw
  bytes); a large tensor is split over several messages with the same name.
  :class:`CkptReader` scans the protobuf wire format once, recording where each
  tensor's bytes are, and reads one tensor on demand; :class:`CkptWriter`
  appends one message per slice, as MindSpore does, so ``mindspore.load_checkpoint``
  reads the result.
* safetensors: an 8-byte header length, a JSON header with offsets, raw bytes.
  The writer needs every tensor's dtype and shape up front, which the split
  info provides.

Tensors are numpy arrays; bfloat16 travels as its raw 16-bit pattern (``uint16``).
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np

# MindSpore tensor_type name / safetensors dtype / numpy dtype (bfloat16 as its bit pattern)
_DTYPES = [
    ("Float32", "F32", "float32", np.float32), ("Float16", "F16", "float16", np.float16),
    ("BFloat16", "BF16", "bfloat16", np.uint16), ("Float64", "F64", "float64", np.float64),
    ("Int64", "I64", "int64", np.int64), ("Int32", "I32", "int32", np.int32), ("Int16", "I16", "int16", np.int16),
    ("Int8", "I8", "int8", np.int8), ("UInt8", "U8", "uint8", np.uint8), ("Bool", "BOOL", "bool", np.bool_),
]
MS_TO_NAME = {ms: name for ms, _, name, _ in _DTYPES}
NAME_TO_MS = {name: ms for ms, _, name, _ in _DTYPES}
ST_TO_NAME = {st: name for _, st, name, _ in _DTYPES}
NAME_TO_ST = {name: st for _, st, name, _ in _DTYPES}
NAME_TO_NP = {name: np.dtype(npt) for _, _, name, npt in _DTYPES}
SLICE_BYTES = 256 << 20  # one .ckpt message per 256 MiB of a tensor (protobuf messages must stay < 2 GiB)


class CheckpointFileError(ValueError):
    """A checkpoint file is missing, truncated or corrupted; the message names the file."""


def np_dtype(name: str) -> np.dtype:
    if name not in NAME_TO_NP:
        raise CheckpointFileError(f"dtype must be one of {sorted(NAME_TO_NP)}, got {name!r}")
    return NAME_TO_NP[name]


def _varint(buf, pos, path):
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise CheckpointFileError(f"{path}: truncated (varint at byte {pos})")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise CheckpointFileError(f"{path}: corrupted (varint too long at byte {pos})")


def _enc_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _fields(buf, start, end, path):
    """Yield ``(field number, wire type, (offset, length))`` of a protobuf message in ``buf[start:end]``
    (for varints ``(value, 0)``). ``buf`` may end before ``end``: fields past it are not visited."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos, path)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos, path)
            yield number, wire, (value, 0)
        elif wire == 2:
            length, pos = _varint(buf, pos, path)
            if pos + length > end:
                raise CheckpointFileError(f"{path}: truncated (field {number} needs {length} bytes at byte {pos})")
            yield number, wire, (pos, length)
            pos += length
            if pos >= len(buf):  # the rest of this message lies beyond the bytes read (tensor data)
                return
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise CheckpointFileError(f"{path}: corrupted (wire type {wire} at byte {pos})")


class CkptReader:
    """Index of a MindSpore ``.ckpt`` file; :meth:`read` returns one tensor as a numpy array.

    The scan reads only each message's first bytes (name, dims, type and where the raw
    bytes are) and seeks past the tensor data, so memory stays small whatever the file size.
    """

    HEAD = 1 << 16  # bytes read at the start of each message; names and dims fit easily

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointFileError(f"{self.path}: checkpoint file is missing")
        self.index = {}  # name -> (dtype name, shape, [(offset, length), ...])
        with open(self.path, "rb") as f:
            self._scan(f, self.path.stat().st_size)
        self._check_sizes()

    def _scan(self, f, size):
        pos = 0
        while pos < size:
            f.seek(pos)
            head = f.read(min(self.HEAD, size - pos))
            key, p = _varint(head, 0, self.path)
            if key != 0x0A:
                raise CheckpointFileError(f"{self.path}: not a MindSpore checkpoint (byte {pos}: field key {key})")
            length, p = _varint(head, p, self.path)
            if pos + p + length > size:
                raise CheckpointFileError(f"{self.path}: truncated (a record of {length} bytes at byte {pos}, "
                                          f"file of {size})")
            self._index_value(head, p, p + length, pos)
            pos += p + length

    def _index_value(self, head, start, end, base):
        """Record one ``Value`` found in ``head[start:end]`` (``end`` may lie beyond ``head``)."""
        name, dims, dtype, content = None, [], None, None
        for n2, w2, (o2, l2) in _fields(head, start, end, self.path):
            if n2 == 1 and w2 == 2:
                name = _text(head, o2, l2, self.path)
            elif n2 == 2 and w2 == 2:
                for n3, w3, (o3, l3) in _fields(head, o2, o2 + l2, self.path):
                    if n3 == 1 and w3 == 0:
                        dims.append(o3)
                    elif n3 == 1 and w3 == 2:  # packed dims
                        q = o3
                        while q < o3 + l3:
                            d, q = _varint(head, q, self.path)
                            dims.append(d)
                    elif n3 == 2 and w3 == 2:
                        dtype = _text(head, o3, l3, self.path)
                    elif n3 == 3 and w3 == 2:
                        content = (base + o3, l3)
        if name is None or dtype is None or content is None:
            raise CheckpointFileError(f"{self.path}: corrupted (a record at byte {base} without name, type or data)")
        if dtype not in MS_TO_NAME:
            raise CheckpointFileError(f"{self.path}: tensor {name!r} has unsupported type {dtype!r}")
        entry = self.index.setdefault(name, (MS_TO_NAME[dtype], tuple(dims), []))
        entry[2].append(content)

    def _check_sizes(self):
        for name, (dtype, shape, parts) in self.index.items():
            have = sum(length for _, length in parts)
            need = math.prod(shape) * np_dtype(dtype).itemsize
            if have != need:
                raise CheckpointFileError(f"{self.path}: tensor {name!r} has {have} bytes, its shape {shape} "
                                          f"and dtype {dtype} need {need} (truncated or corrupted)")

    def names(self):
        return list(self.index)

    def meta(self, name):
        """``(dtype name, shape)`` of tensor ``name``."""
        if name not in self.index:
            raise CheckpointFileError(f"{self.path}: has no tensor named {name!r}")
        return self.index[name][0], self.index[name][1]

    def read(self, name) -> np.ndarray:
        dtype, shape = self.meta(name)
        out = np.empty(math.prod(shape), dtype=np_dtype(dtype))
        view, at = out.view(np.uint8), 0
        with open(self.path, "rb") as f:
            for offset, length in self.index[name][2]:
                f.seek(offset)
                if f.readinto(memoryview(view)[at:at + length]) != length:
                    raise CheckpointFileError(f"{self.path}: truncated while reading {name!r}")
                at += length
        return out.reshape(shape)


def _text(buf, offset, length, path) -> str:
    if offset + length > len(buf):
        raise CheckpointFileError(f"{path}: unexpected record layout (a name or type beyond the first "
                                  f"{CkptReader.HEAD} bytes)")
    return bytes(buf[offset:offset + length]).decode()


class SafetensorsReader:
    """Header of a safetensors file; :meth:`read` returns one tensor."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointFileError(f"{self.path}: checkpoint file is missing")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointFileError(f"{self.path}: truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise CheckpointFileError(f"{self.path}: truncated (header of {n} bytes, file of {size})")
            try:
                header = json.loads(f.read(n))
            except ValueError:
                raise CheckpointFileError(f"{self.path}: corrupted safetensors header") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self.base = 8 + n
        self.index = {}
        for name, h in header.items():
            dtype = ST_TO_NAME.get(h.get("dtype"))
            if dtype is None:
                raise CheckpointFileError(f"{self.path}: tensor {name!r} has unsupported dtype {h.get('dtype')!r}")
            begin, end = h["data_offsets"]
            need = math.prod(h["shape"]) * np_dtype(dtype).itemsize
            if end - begin != need or self.base + end > size:
                raise CheckpointFileError(f"{self.path}: tensor {name!r} is truncated or corrupted "
                                          f"(bytes {begin}-{end}, file of {size})")
            self.index[name] = (dtype, tuple(h["shape"]), begin, end)

    def names(self):
        return list(self.index)

    def meta(self, name):
        if name not in self.index:
            raise CheckpointFileError(f"{self.path}: has no tensor named {name!r}")
        return self.index[name][:2]

    def read(self, name) -> np.ndarray:
        dtype, shape, begin, end = self.index[name] if name in self.index else (None,) + self.meta(name)
        with open(self.path, "rb") as f:
            f.seek(self.base + begin)
            raw = f.read(end - begin)
        return np.frombuffer(raw, dtype=np_dtype(dtype)).reshape(shape).copy()


def open_reader(path):
    """A reader for ``path`` by its suffix (``.ckpt`` or ``.safetensors``)."""
    return SafetensorsReader(path) if str(path).endswith(".safetensors") else CkptReader(path)


class _AtomicFile:
    """Writes to ``.<name>.partial`` and renames to ``name`` on :meth:`commit`; :meth:`abort` removes it."""

    def __init__(self, path):
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.partial-{os.getpid()}")
        self.f = open(self.tmp, "wb")

    def commit(self):
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)

    def abort(self):
        if not self.f.closed:
            self.f.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class CkptWriter(_AtomicFile):
    """Append tensors one at a time to a MindSpore ``.ckpt`` file (atomic: temporary name, then rename)."""

    def write(self, name: str, array: np.ndarray, dtype: str) -> None:
        """Append ``array``; the header bytes are built, the data is written from the array's own buffer."""
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        dims = b"".join(_enc_varint(d) for d in array.shape)
        head = b"\x0a" + _enc_varint(len(dims)) + dims if array.shape else b""
        type_name = NAME_TO_MS[dtype].encode()
        head += b"\x12" + _enc_varint(len(type_name)) + type_name
        tag = name.encode()
        step = max(SLICE_BYTES - SLICE_BYTES % max(array.itemsize, 1), array.itemsize)
        for start in range(0, max(flat.size, 1), step):
            content = memoryview(flat[start:start + step])
            tensor_len = len(head) + 1 + len(_enc_varint(len(content))) + len(content)
            value_head = b"\x0a" + _enc_varint(len(tag)) + tag + b"\x12" + _enc_varint(tensor_len)
            value_len = len(value_head) + tensor_len
            self.f.write(b"\x0a" + _enc_varint(value_len) + value_head + head + b"\x1a"
                         + _enc_varint(len(content)))
            self.f.write(content)


class SafetensorsWriter(_AtomicFile):
    """Write tensors one at a time to a safetensors file; ``layout`` lists ``(name, dtype, shape)`` up front."""

    def __init__(self, path, layout):
        super().__init__(path)
        header, offset = {}, 0
        self._expect = []
        for name, dtype, shape in layout:
            n = math.prod(shape) * np_dtype(dtype).itemsize
            header[name] = {"dtype": NAME_TO_ST[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._expect.append(name)
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.f.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, array: np.ndarray, dtype: str) -> None:
        if self._next >= len(self._expect) or self._expect[self._next] != name:
            raise ValueError(f"safetensors tensors must be written in layout order; got {name!r}")
        self._next += 1
        self.f.write(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))

    def commit(self):
        if self._next != len(self._expect):
            raise ValueError(f"{self.path}: {len(self._expect) - self._next} tensors of the layout were not written")
        super().commit()


def open_writer(path, fmt: str, layout):
    """A writer for ``fmt`` (``"ckpt"`` or ``"safetensors"``); ``layout`` is ``[(name, dtype, shape)]``."""
    return SafetensorsWriter(path, layout) if fmt == "safetensors" else CkptWriter(path)
