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
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import ml_dtypes
import numpy as np

from workbench.checkpoint.files import CheckpointError, open_regular, short_repr

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
ITEMSIZE: dict[str, int] = {tag: dt.itemsize for tag, dt in DTYPES.items()}

# The reference implementation's limits (safetensors ``MAX_HEADER_SIZE`` and serde_json's nesting limit): a file this
# reader opens is one ``safetensors.safe_open`` opens too, and the writer refuses to produce one it would not.
MAX_HEADER_BYTES = 100_000_000
MAX_JSON_DEPTH = 127  # the header object itself is depth 1
MAX_USIZE = 2**64 - 1  # shapes and offsets are u64 in the reference implementation
COPY_CHUNK_BYTES = 64 * 1024 * 1024  # pass-through copies move at most this much at a time
ENTRY_KEYS = ("dtype", "shape", "data_offsets")


def dtype_tag(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype not in TAGS:
        raise TypeError(f"dtype {dtype} has no safetensors tag")
    return TAGS[dtype]


class TensorInfo(NamedTuple):  # a tuple: headers hold up to millions of entries, each built in the reader's loop
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


class _Object(dict):
    """A JSON object that remembers which keys it saw twice (``json`` keeps the last silently)."""

    __slots__ = ("repeated",)


class _Plain(tuple):
    """A header entry as every writer produces it, already checked: (dtype tag, shape, begin, end). Built by the
    JSON hook in place of the entry's dict, so a header of a million tensors never holds a million dicts."""

    __slots__ = ()


def _object_pairs(pairs):
    if len(pairs) == 3:
        plain = _plain_entry(pairs)
        if plain is not None:
            return plain
    obj = _Object(pairs)
    obj.repeated = [k for k, _ in pairs] if len(obj) != len(pairs) else None
    return obj


def _plain_entry(pairs) -> _Plain | None:
    """The entry ``{"dtype", "shape", "data_offsets"}`` with in-range ints, or None for anything else (which
    ``_parse_entry`` then refuses or accepts with its full checks and messages). The fast path of the reader."""
    entry = dict(pairs)
    tag, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if type(tag) is not str or type(shape) is not list or type(offsets) is not list or len(offsets) != 2:
        return None
    itemsize = ITEMSIZE.get(tag)
    begin, end = offsets
    if itemsize is None or type(begin) is not int or type(end) is not int or not 0 <= begin <= end <= MAX_USIZE:
        return None
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_USIZE:
            return None
    if end - begin != math.prod(shape) * itemsize:
        return None
    return _Plain((tag, tuple(shape), begin, end))


def _refuse_constant(name):
    raise ValueError(f"{name} is not JSON")


def _finite_float(text):
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} out of range")
    return value


def _utf8(text: str) -> bool:
    """False for strings holding lone surrogates (JSON escapes like \\ud800 that are no UTF-8)."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _depth_ok(value, depth: int) -> bool:
    """Whether ``value`` nests at most MAX_JSON_DEPTH deep when it sits at ``depth``; its strings are UTF-8."""
    stack = [(value, depth)]
    while stack:
        v, d = stack.pop()
        if type(v) is _Plain:  # an entry-shaped object: itself, then its shape list
            if d + 1 > MAX_JSON_DEPTH:
                return False
        elif isinstance(v, (dict, list)):
            if d > MAX_JSON_DEPTH:
                return False
            items = list(v.items()) if isinstance(v, dict) else [(None, x) for x in v]
            for key, x in items:
                if key is not None and not _utf8(key):
                    return False
                stack.append((x, d + 1))
        elif isinstance(v, str) and not _utf8(v):
            return False
    return True


def _is_usize(value) -> bool:
    return type(value) is int and 0 <= value <= MAX_USIZE  # bool is an int subclass; the reference refuses it


def parse_header(raw: bytes, where: str) -> tuple[dict[str, str], dict[str, tuple[str, tuple[int, ...], int, int]]]:
    """Header bytes -> (metadata, {name: (dtype tag, shape, begin, end)}) with buffer-relative offsets, refusing
    exactly what ``safetensors.safe_open`` refuses in a header (tested against it) and dtypes this reader lacks."""
    try:
        text = raw.decode("utf-8")
        header = json.loads(text, object_pairs_hook=_object_pairs, parse_constant=_refuse_constant,
                            parse_float=_finite_float)
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{where}: header is not UTF-8 ({exc}): corrupted file") from None
    except ValueError as exc:  # json.JSONDecodeError is a ValueError, as are the two hooks' refusals
        raise CheckpointError(f"{where}: header is not valid JSON ({exc}): corrupted file") from None
    except RecursionError:
        raise CheckpointError(f"{where}: header JSON nests deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: header is a {type(header).__name__}, expected a JSON object")
    if header.repeated and header.repeated.count("__metadata__") > 1:
        raise CheckpointError(f"{where}: header names __metadata__ twice")
    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) and _utf8(v) and _utf8(k) for k, v in meta.items()):
        raise CheckpointError(f"{where}: __metadata__ must map strings to strings, got {short_repr(meta)}")
    # a lone surrogate can only come from a \\ud800-\\udfff escape; without one in the text no string needs a check
    strings = _SURROGATE_ESCAPE.search(text) is not None
    tensors = {}
    for name, entry in header.items():  # a tensor named twice: the last entry counts, as in the reference reader
        tensors[name] = entry if type(entry) is _Plain and not strings else _parse_entry(name, entry, where)
    return dict(meta), tensors


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _parse_entry(name: str, entry, where: str) -> tuple[str, tuple[int, ...], int, int]:
    at = f"{where}: tensor {short_repr(name)}"
    if not _utf8(name):
        raise CheckpointError(f"{where}: tensor name {short_repr(name)} is not UTF-8 (a lone surrogate escape)")
    if type(entry) is _Plain:
        if not _utf8(entry[0]):
            raise CheckpointError(f"{at}: dtype is not UTF-8")
        return tuple(entry)
    if not isinstance(entry, dict):
        raise CheckpointError(f"{at}: header entry {short_repr(entry)} is not an object with dtype/shape/data_offsets")
    if entry.repeated:
        raise CheckpointError(f"{at}: header entry names a key twice ({sorted(entry.repeated)})")
    if not set(ENTRY_KEYS) <= set(entry):
        raise CheckpointError(f"{at}: header entry {short_repr(entry)} lacks {[k for k in ENTRY_KEYS if k not in entry]}")
    tag, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not _depth_ok({k: v for k, v in entry.items() if k not in ENTRY_KEYS}, 2):  # the entry sits at depth 2
        raise CheckpointError(f"{at}: an extra header field nests deeper than {MAX_JSON_DEPTH} levels or is not UTF-8")
    if not isinstance(tag, str) or tag not in DTYPES:
        raise CheckpointError(f"{at}: dtype {short_repr(tag)} is not one of {sorted(DTYPES)}")
    if not (isinstance(shape, list) and all(_is_usize(d) for d in shape)):
        raise CheckpointError(f"{at}: shape {short_repr(shape)} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_usize(o) for o in offsets)):
        raise CheckpointError(f"{at}: data_offsets {short_repr(offsets)} are not [begin, end] (non-negative integers)")
    expected = math.prod(shape) * DTYPES[tag].itemsize
    if expected > MAX_USIZE:
        raise CheckpointError(f"{at}: {tag} {shape} needs {expected} bytes, more than a 64-bit size")
    begin, end = offsets
    if end < begin or end - begin != expected:
        raise CheckpointError(f"{at}: data_offsets {offsets} span {end - begin} bytes, but {tag} {shape} needs"
                              f" {expected}")
    return tag, tuple(shape), begin, end


def check_layout(tensors: dict, data_bytes: int, where: str) -> None:
    """Tensors tile the data buffer exactly: sorted by offsets, each starts where the last ended, the last ends at
    the end of the file (no gap, no overlap, no trailing bytes)."""
    cursor, previous = 0, None
    for name, (_, _, begin, end) in sorted(tensors.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if begin != cursor:
            what = "overlaps" if begin < cursor else f"leaves a gap of {begin - cursor} bytes after"
            after = f"tensor {short_repr(previous)}" if previous is not None else "the header"
            raise CheckpointError(f"{where}: tensor {short_repr(name)} at data bytes [{begin}, {end}) {what} {after}"
                                  f" (ends at {cursor}): corrupted header")
        cursor, previous = end, name
    if cursor != data_bytes:
        if cursor > data_bytes:
            raise CheckpointError(f"{where}: tensor {short_repr(previous)} needs data bytes up to {cursor} but the file"
                                  f" holds only {data_bytes}: truncated file")
        raise CheckpointError(f"{where}: tensors cover {cursor} data bytes but the file holds {data_bytes}:"
                              f" {data_bytes - cursor} trailing bytes")


class _TensorTable(Mapping):
    """``{name: TensorInfo}`` over the parsed entries, each TensorInfo made when asked for (a header may list
    millions of tensors; most callers look at a few)."""

    def __init__(self, entries: dict, data_start: int):
        self._entries, self._start = entries, data_start

    def __getitem__(self, name: str) -> TensorInfo:
        tag, shape, begin, end = self._entries[name]
        return TensorInfo(name, tag, shape, self._start + begin, self._start + end)

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name) -> bool:
        return name in self._entries


class SafetensorsFile:
    """A validated safetensors header; tensors are read on demand (``read``), never all at once."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open_regular(self.path, "safetensors file") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CheckpointError(f"{self.path}: file is {size} bytes, too short for a safetensors header length")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{self.path}: header length {n} is over the {MAX_HEADER_BYTES}-byte limit of"
                                      " the safetensors format: corrupted or not safetensors")
            if 8 + n > size:
                raise CheckpointError(f"{self.path}: header length {n} does not fit the file ({size} bytes):"
                                      " truncated or not safetensors")
            raw = f.read(n)
        if len(raw) != n:
            raise CheckpointError(f"{self.path}: read {len(raw)} of {n} header bytes: truncated file")
        self.metadata, entries = parse_header(raw, self.path)
        self.data_start = 8 + n
        self.data_bytes = size - self.data_start
        check_layout(entries, self.data_bytes, self.path)
        self.tensors = _TensorTable(entries, self.data_start)

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        """The tensor (or, with ``index``, its slice ``[index]`` along dim 0) as a fresh, writable array."""
        info = self.tensors[name]
        begin, shape, count = info.begin, info.shape, math.prod(info.shape)
        if index is not None:
            if not shape or not 0 <= index < shape[0]:
                raise CheckpointError(f"{self.path}: tensor {name!r} {list(shape)} has no slice {index}")
            count //= shape[0]
            shape = shape[1:]
            begin += index * count * info.np_dtype.itemsize
        raw = np.empty(count * info.np_dtype.itemsize, dtype=np.uint8)  # bf16/float8 have no buffer protocol
        with open_regular(self.path, "safetensors file") as f:
            f.seek(begin)
            got = f.readinto(memoryview(raw))
        if got != raw.nbytes:
            raise CheckpointError(f"{self.path}: tensor {name!r}: read {got} of {raw.nbytes} bytes: truncated file")
        return raw.view(info.np_dtype).reshape(shape)

    def iter_bytes(self, name: str, chunk_bytes: int = COPY_CHUNK_BYTES):
        """A tensor's raw bytes in bounded chunks (each a fresh ``bytes``)."""
        info = self.tensors[name]
        with open_regular(self.path, "safetensors file") as f:
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
        with open_regular(self.path, "safetensors file") as f:
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


def encode_header(header: dict, where: str) -> bytes:
    """The padded header bytes of a file to write; refused when a reader (ours, the reference) would refuse them."""
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # align the data buffer to 8 bytes
    if len(raw) > MAX_HEADER_BYTES:
        raise CheckpointError(f"{where}: the header would be {len(raw)} bytes, over the {MAX_HEADER_BYTES}-byte limit of"
                              " the safetensors format (write fewer tensors per file: a smaller --max-shard-size)")
    return raw


def planned_header(planned: list[PlannedTensor], metadata: dict[str, str]) -> dict:
    """The header a ``StreamingWriter`` writes for these tensors, in this order."""
    header: dict = {"__metadata__": dict(metadata)}
    offset = 0
    for t in planned:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    return header


class StreamingWriter:
    """Writes one safetensors file whose tensors are declared up front and filled in any order.

    ``write(name, array)`` fills a whole tensor; ``write(name, array, index=e)`` fills slice ``[e]`` along dim 0
    (one expert of a stack); ``append(name, chunk)`` streams raw bytes in order. ``close()`` refuses to finish a
    file with any byte left unwritten, so a file that closes cleanly is complete.
    """

    def __init__(self, path: str | os.PathLike, planned: list[PlannedTensor], metadata: dict[str, str]):
        self.path = os.fspath(path)
        header = planned_header(planned, metadata)
        self._planned = {t.name: t for t in planned}
        self._begin = {t.name: header[t.name]["data_offsets"][0] for t in planned}
        offset = sum(t.nbytes for t in planned)
        raw = encode_header(header, self.path)
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

    def flush(self) -> None:
        self._f.flush()

    def written(self, name: str) -> int:
        """Bytes of tensor ``name`` written through this writer so far."""
        return self._written[name]

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
