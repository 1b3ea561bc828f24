"""Safetensors files read and written tensor by tensor, with bounded memory.

Why our own reader and writer instead of ``safetensors.safe_open`` / ``save_file``:

* ``safe_open(framework="numpy")`` cannot return float8 tensors (block-FP8 checkpoints) and gives terse errors for
  truncated files; we need messages that name the file, the tensor and the byte ranges.
* ``save_file`` needs every tensor in memory at once. A streaming writer that knows the shapes up front can emit the
  header first and then each tensor (or each expert slice of a stacked tensor) as it is produced.

The format (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian header length ``n``,
``n`` bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``
(padded with spaces), then the data buffer; offsets are relative to the buffer, tensors are row-major, little-endian,
and together cover the buffer without gaps or overlaps.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

# safetensors dtype tag -> numpy dtype (bf16 / float8 through ml_dtypes)
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
TAGS: dict[np.dtype, str] = {dt: tag for tag, dt in DTYPES.items()}

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation refuses larger headers too
COPY_CHUNK_BYTES = 64 * 1024 * 1024  # pass-through copies move at most this much at a time


class CheckpointError(ValueError):
    """Bad checkpoint input: the message names the file, the tensor and the offending values."""


def dtype_tag(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype not in TAGS:
        raise TypeError(f"dtype {dtype} has no safetensors tag")
    return TAGS[dtype]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors tag, e.g. "I32"
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int  # absolute file offset one past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


class SafetensorsFile:
    """A validated safetensors header; tensors are read on demand (``read``), never all at once."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            size = os.path.getsize(self.path)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot read safetensors file ({exc.strerror})") from None
        if size < 8:
            raise CheckpointError(f"{self.path}: file is {size} bytes, too short for a safetensors header length")
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"{self.path}: header length {n} does not fit the file ({size} bytes): truncated or not safetensors"
                )
            raw = f.read(n)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{self.path}: header is not valid JSON ({exc}): corrupted file") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is a {type(header).__name__}, expected a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise CheckpointError(f"{self.path}: __metadata__ must map strings to strings")
        self.metadata: dict[str, str] = meta
        self.data_start = 8 + n
        self.data_bytes = size - self.data_start
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            self.tensors[name] = self._check_entry(name, entry)
        self._check_layout()

    def _check_entry(self, name: str, entry) -> TensorInfo:
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise CheckpointError(f"{where}: header entry {entry!r} lacks dtype/shape/data_offsets")
        tag, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if tag not in DTYPES:
            raise CheckpointError(f"{where}: unknown dtype {tag!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative ints")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{where}: data_offsets {offsets!r} are not [begin, end] with begin <= end")
        expected = math.prod(shape) * DTYPES[tag].itemsize
        if offsets[1] - offsets[0] != expected:
            raise CheckpointError(
                f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but {tag} {shape} needs {expected}"
            )
        if offsets[1] > self.data_bytes:
            raise CheckpointError(
                f"{where}: needs data bytes [{offsets[0]}, {offsets[1]}) but the file holds only {self.data_bytes}:"
                " truncated file"
            )
        return TensorInfo(name, tag, tuple(shape), self.data_start + offsets[0], self.data_start + offsets[1])

    def _check_layout(self) -> None:
        cursor = self.data_start
        for info in sorted(self.tensors.values(), key=lambda t: (t.begin, t.end)):
            if info.begin < cursor:
                raise CheckpointError(f"{self.path}: tensor {info.name!r} overlaps the previous tensor: corrupted header")
            cursor = info.end

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        """The tensor (or, with ``index``, its slice ``[index]`` along dim 0) as a fresh, writable array."""
        info = self.tensors[name]
        begin, shape, count = info.begin, info.shape, math.prod(info.shape)
        if index is not None:
            if not shape or not 0 <= index < shape[0]:
                raise IndexError(f"{self.path}: tensor {name!r} {shape} has no slice {index}")
            count //= shape[0]
            shape = shape[1:]
            begin += index * count * info.np_dtype.itemsize
        raw = np.empty(count * info.np_dtype.itemsize, dtype=np.uint8)  # bf16/float8 have no buffer protocol
        with open(self.path, "rb") as f:
            f.seek(begin)
            got = f.readinto(memoryview(raw))
        if got != raw.nbytes:
            raise CheckpointError(f"{self.path}: tensor {name!r}: read {got} of {raw.nbytes} bytes: truncated file")
        return raw.view(info.np_dtype).reshape(shape)

    def iter_bytes(self, name: str, chunk_bytes: int = COPY_CHUNK_BYTES):
        """A tensor's raw bytes in bounded chunks (each a fresh ``bytes``)."""
        info = self.tensors[name]
        with open(self.path, "rb") as f:
            f.seek(info.begin)
            left = info.nbytes
            while left:
                data = f.read(min(left, chunk_bytes))
                if not data:
                    raise CheckpointError(f"{self.path}: tensor {name!r}: file ended {left} bytes early: truncated file")
                yield data
                left -= len(data)

    def copy_bytes_to(self, name: str, sink) -> None:
        """Stream a tensor's raw bytes into ``sink(bytes_chunk)`` in bounded chunks (pass-through tensors)."""
        info = self.tensors[name]
        buf = bytearray(min(COPY_CHUNK_BYTES, max(info.nbytes, 1)))
        view = memoryview(buf)
        with open(self.path, "rb") as f:
            f.seek(info.begin)
            left = info.nbytes
            while left:
                got = f.readinto(view[: min(left, len(buf))])
                if not got:
                    raise CheckpointError(f"{self.path}: tensor {name!r}: file ended {left} bytes early: truncated file")
                sink(view[:got])
                left -= got


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str  # safetensors tag
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


class StreamingWriter:
    """Writes one safetensors file whose tensors are declared up front and filled in any order.

    ``write(name, array)`` fills a whole tensor; ``write(name, array, index=e)`` fills slice ``[e]`` along dim 0
    (one expert of a stack); ``append(name, chunk)`` streams raw bytes in order. ``close()`` refuses to finish a
    file with any byte left unwritten, so a file that closes cleanly is complete.
    """

    def __init__(self, path: str | os.PathLike, planned: list[PlannedTensor], metadata: dict[str, str]):
        self.path = os.fspath(path)
        header: dict = {"__metadata__": dict(metadata)}
        self._begin: dict[str, int] = {}
        self._planned = {t.name: t for t in planned}
        offset = 0
        for t in planned:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            self._begin[t.name] = offset
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # align the data buffer to 8 bytes
        self._data_start = 8 + len(raw)
        self._written = {t.name: 0 for t in planned}
        self._appended = {t.name: 0 for t in planned}
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._f.truncate(self._data_start + offset)

    def _check(self, name: str, array: np.ndarray, index: int | None) -> tuple[np.ndarray, int]:
        t = self._planned[name]
        shape = t.shape if index is None else t.shape[1:]
        if index is not None and not 0 <= index < t.shape[0]:
            raise IndexError(f"{name}: slice {index} outside {t.shape}")
        if tuple(array.shape) != tuple(shape) or dtype_tag(array.dtype) != t.dtype:
            raise ValueError(f"{name}: got {dtype_tag(array.dtype)} {tuple(array.shape)}, planned {t.dtype} {shape}")
        nbytes = math.prod(shape) * DTYPES[t.dtype].itemsize
        return np.ascontiguousarray(array), self._begin[name] + (0 if index is None else index * nbytes)

    def write(self, name: str, array: np.ndarray, index: int | None = None) -> None:
        array, at = self._check(name, np.asarray(array), index)
        self._f.seek(self._data_start + at)
        self._f.write(memoryview(array.reshape(-1).view(np.uint8)))
        self._written[name] += array.nbytes

    def append(self, name: str, chunk) -> None:
        at = self._begin[name] + self._appended[name]
        self._f.seek(self._data_start + at)
        self._f.write(chunk)
        self._appended[name] += len(chunk)
        self._written[name] += len(chunk)

    def close(self) -> None:
        short = [f"{n} ({w} of {self._planned[n].nbytes} bytes)" for n, w in self._written.items()
                 if w != self._planned[n].nbytes]
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        if short:
            raise RuntimeError(f"{self.path}: tensors not completely written: {', '.join(short[:5])}")

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
