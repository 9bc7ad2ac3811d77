"""A fast reader of a GGUF file's header: metadata and tensor directory, without building the vocabulary.

GGUF (llama.cpp's format, version 2 or 3, little-endian) starts with the magic, the version, the tensor
and key counts, then each key with its typed value, then each tensor's name, dimensions (innermost
first), type and offset into the aligned data section. The `gguf` package's reader turns every array
element into numpy parts on open; a tokenizer's 49k-token and 49k-merge string arrays made that most
of a station's load. Here a string array is only walked by its lengths to find where it ends (by
csrc/gguf_scan.c where the native kernels build), and
decoded when someone asks for it (the tokenizer), once; numeric arrays are numpy views of the map.
A header is read once per process for a given file (path, size and modification time): the config
check, the tokenizer, the chat template and the station of one process share it. No torch here.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quant_shape_to_byte_shape

from mesh.core.model.native import load_native

MAGIC, VERSIONS, DEFAULT_ALIGNMENT = b"GGUF", (2, 3), 32
MAX_DIMS = 4  # dimensions a GGUF tensor may have (ggml's own limit)
_SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
            GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
            GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
            GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
_NUMPY = {t: np.dtype(fmt.replace("?", "b1")) for t, fmt in _SCALARS.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_TYPE_OFFSET = struct.Struct("<IQ")  # a directory entry's tensor type and data offset, after its dimensions
_QTYPES = {int(q): q for q in GGMLQuantizationType}  # type id -> type: a dict read, not an enum call per tensor


class HeaderError(ValueError):
    """A GGUF header this reader cannot parse: not GGUF, another version, cut off or inconsistent."""


@dataclass(frozen=True, slots=True)
class StringArray:
    """A metadata array of strings, not yet decoded: `count` strings starting at byte `offset`."""

    offset: int
    count: int


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One entry of the tensor directory: where a tensor's bytes lie in the file and how to read them."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    data_offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The shape outermost first (as numpy, torch and Hugging Face write it)."""
        return tuple(reversed(self.shape))


class GGUFHeader:
    """A parsed header over the memory-mapped file: `fields` by key, `tensors` in file order, `data` bytes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.data: np.ndarray = np.memmap(self.path, mode="r").view(np.ndarray)  # uint8, pages read on touch
        self._buf = memoryview(self.data)
        self._strings: dict[str, list[str]] = {}
        try:
            self.fields, self.tensors = self._parse()
        except (struct.error, IndexError) as e:
            raise HeaderError(f"the header ends before it is complete (truncated): {e}") from None
        except UnicodeDecodeError as e:
            raise HeaderError(f"a key or tensor name is not UTF-8: {e}") from None

    def value(self, key: str, default: Any = None) -> Any:
        """Field `key` as a Python value (str, int, float, bool, or a list of them), or `default` when absent."""
        if key not in self.fields:
            return default
        v = self.fields[key]
        if isinstance(v, StringArray):
            if key not in self._strings:
                self._strings[key] = self._decode_strings(key, v)
            return list(self._strings[key])
        return v.tolist() if isinstance(v, np.ndarray) else v

    def length(self, key: str) -> int | None:
        """The element count of array field `key` without decoding it (None when absent or not an array)."""
        v = self.fields.get(key)
        return v.count if isinstance(v, StringArray) else len(v) if isinstance(v, (np.ndarray, list)) else None

    def tensor_bytes(self, t: TensorInfo) -> np.ndarray:
        """Tensor `t`'s bytes as the uint8 array `gguf.quants.dequantize` takes (rows of blocks), mapped, not read."""
        raw = self.data[t.data_offset:t.data_offset + t.n_bytes]
        return raw.reshape(quant_shape_to_byte_shape(t.hf_shape, t.tensor_type))

    # ---- parsing ----------------------------------------------------------------------------------

    def _parse(self) -> tuple[dict[str, Any], list[TensorInfo]]:
        buf = self._buf
        if bytes(buf[:4]) != MAGIC:
            raise HeaderError(f"not a GGUF file (starts with {bytes(buf[:4])!r}, expected {MAGIC!r})")
        version = _U32.unpack_from(buf, 4)[0]
        if version not in VERSIONS:
            raise HeaderError(f"GGUF version {version} is not supported (versions {', '.join(map(str, VERSIONS))}, "
                              "little-endian)")
        n_tensors, n_kv = _U64.unpack_from(buf, 8)[0], _U64.unpack_from(buf, 16)[0]
        self._need(n_kv * 12 + n_tensors * 24, 24, "the key and tensor counts")
        pos, fields = 24, {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            if key in fields:
                raise HeaderError(f"key {key} is listed twice")
            kind = _U32.unpack_from(buf, pos)[0]
            fields[key], pos = self._value(key, kind, pos + 4)
        tensors, pos = self._tensor_infos(n_tensors, pos, fields.get("general.alignment", DEFAULT_ALIGNMENT))
        return fields, tensors

    def _need(self, n: int, pos: int, what: str) -> None:
        if pos + n > len(self._buf):
            raise HeaderError(f"{what} need {n} bytes at byte {pos}, past the end of the file "
                              f"({len(self._buf)} bytes): truncated or corrupt")

    def _string(self, pos: int) -> tuple[str, int]:
        n = _U64.unpack_from(self._buf, pos)[0]
        self._need(n, pos + 8, "a string")
        return str(self._buf[pos + 8:pos + 8 + n], "utf-8"), pos + 8 + n

    def _value(self, key: str, kind: int, pos: int) -> tuple[Any, int]:
        if kind == GGUFValueType.STRING:
            return self._string(pos)
        if kind in _SCALARS:
            return struct.unpack_from(_SCALARS[kind], self._buf, pos)[0], pos + _NUMPY[kind].itemsize
        if kind != GGUFValueType.ARRAY:
            raise HeaderError(f"key {key}: unknown value type {kind}")
        sub, count = _U32.unpack_from(self._buf, pos)[0], _U64.unpack_from(self._buf, pos + 4)[0]
        pos += 12
        if sub in _NUMPY:
            size = count * _NUMPY[sub].itemsize
            self._need(size, pos, f"key {key}")
            return self.data[pos:pos + size].view(_NUMPY[sub]), pos + size
        if sub == GGUFValueType.STRING:
            self._need(count * 8, pos, f"key {key}")
            return StringArray(pos, count), self._skip_strings(pos, count)
        if sub == GGUFValueType.ARRAY:  # arrays of arrays: read whole (rare, small)
            items = []
            for _ in range(count):
                item, pos = self._value(key, GGUFValueType.ARRAY, pos)
                items.append(item.tolist() if isinstance(item, np.ndarray) else item)
            return items, pos
        raise HeaderError(f"key {key}: unknown array element type {sub}")

    def _skip_strings(self, pos: int, count: int) -> int:
        lib, _ = load_native()
        if lib is not None:  # the native loop (csrc/gguf_scan.c), where it builds
            end = ctypes.c_int64()
            lib.gguf_skip_strings(self.data.ctypes.data, len(self.data), pos, count, ctypes.byref(end))
            if end.value < 0:
                raise HeaderError(f"a string array of {count} at byte {pos} runs past the end of the file")
            return end.value
        unpack, buf = _U64.unpack_from, self._buf
        for _ in range(count):
            pos += 8 + unpack(buf, pos)[0]
        self._need(0, pos, "a string array")
        return pos

    def _decode_strings(self, key: str, v: StringArray) -> list[str]:
        unpack, buf, pos, out = _U64.unpack_from, self._buf, v.offset, []
        try:
            for _ in range(v.count):
                n = unpack(buf, pos)[0]
                out.append(str(buf[pos + 8:pos + 8 + n], "utf-8"))
                pos += 8 + n
        except UnicodeDecodeError as e:
            raise HeaderError(f"key {key}: element {len(out)} is not UTF-8: {e}") from None
        return out

    def _tensor_infos(self, count: int, pos: int, alignment: int) -> tuple[list[TensorInfo], int]:
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise HeaderError(f"general.alignment: {alignment!r} is not a power of two")
        buf, size, u32, u64 = self._buf, len(self._buf), _U32.unpack_from, _U64.unpack_from
        rows = []  # one pass over the directory, locals only: a large model lists thousands of tensors
        for _ in range(count):
            end = pos + 8 + u64(buf, pos)[0]
            if end + 4 > size:
                self._need(end + 4 - pos - 8, pos + 8, "a tensor name and its dimension count")
            name = str(buf[pos + 8:end], "utf-8")
            n_dims = u32(buf, end)[0]
            if n_dims > MAX_DIMS:
                raise HeaderError(f"tensor {name}: {n_dims} dimensions (GGUF tensors have at most {MAX_DIMS})")
            self._need(n_dims * 8 + 12, end + 4, f"tensor {name}")
            dims = _dims_struct(n_dims).unpack_from(buf, end + 4)  # Python ints
            pos = end + 4 + 8 * n_dims
            rows.append((name, dims, *_TYPE_OFFSET.unpack_from(buf, pos)))
            pos += _TYPE_OFFSET.size
        start = -(-pos // alignment) * alignment
        tensors, seen = [], set()
        for name, dims, raw_type, offset in rows:
            if name in seen:
                raise HeaderError(f"tensor {name} is listed twice")
            seen.add(name)
            qtype = _QTYPES.get(raw_type)
            if qtype is None:
                raise HeaderError(f"tensor {name}: unknown tensor type id {raw_type}")
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            if dims and dims[0] % block:
                raise HeaderError(f"tensor {name}: rows of {dims[0]} values are not whole {qtype.name} blocks "
                                  f"of {block}")
            n = math.prod(dims)  # Python integers: no overflow, and no numpy call per tensor
            tensors.append(TensorInfo(name, qtype, dims, start + offset, n * block_bytes // block))
        return tensors, pos


@functools.cache
def _dims_struct(n_dims: int) -> struct.Struct:
    """The struct of a tensor's `n_dims` u64 dimensions."""
    return struct.Struct(f"<{n_dims}Q")


@functools.lru_cache(maxsize=8)
def _cached(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    return GGUFHeader(path)


def read_header(path: str | Path) -> GGUFHeader:
    """The header of the GGUF file at `path`, parsed once per process while the file is unchanged."""
    p = Path(path).resolve()
    st = os.stat(p)
    return _cached(str(p), st.st_size, st.st_mtime_ns)


def clear_header_cache() -> None:
    """Forget every parsed header (the next read_header parses again, as a fresh process would)."""
    _cached.cache_clear()
