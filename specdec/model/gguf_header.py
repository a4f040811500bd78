"""A GGUF file's header, read without decoding what loading a model never uses.

The `gguf` package's reader builds numpy views for every part of every field, one per
element of an array: a Qwen2.5 file's tokenizer holds 151,665 tokens and 151,387 merges, so
it made ~455,000 parts and took ~6 s of a 36 s load of the 1.5B target (and as much again
for the draft, in every rebuild after a lost worker). Here scalars are decoded, numeric
arrays are numpy views of the memory map, and string arrays are skipped by their lengths
and decoded only if asked for. Tensor data stays in the memory map.

Layout (little-endian, GGUF v2/v3): magic "GGUF", u32 version, u64 tensor count, u64 field
count; fields as (string key, u32 type, value); tensor infos as (string name, u32 n_dims,
u64 dims..., u32 ggml type, u64 offset); tensor data from the next multiple of
`general.alignment` (32 by default).
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path

import numpy as np

from specdec.model.gguf_quants import TYPES

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    pass


class StringArray:
    """An array of strings left undecoded: its length at once, its items on request."""

    def __init__(self, buf: memoryview, start: int, count: int) -> None:
        self._buf, self._start, self._count = buf, start, count

    def __len__(self) -> int:
        return self._count

    def tolist(self) -> list[str]:
        out, pos = [], self._start
        for _ in range(self._count):
            (n,) = struct.unpack_from("<Q", self._buf, pos)
            out.append(bytes(self._buf[pos + 8:pos + 8 + n]).decode("utf-8", "replace"))
            pos += 8 + n
        return out


def plain(value):
    """A field's value as Python values (arrays as lists, string arrays decoded)."""
    return value.tolist() if isinstance(value, (np.ndarray, StringArray)) else value


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    tensor_type: int        # ggml type id
    n_bytes: int
    data: np.ndarray        # its bytes (uint8) in the memory map


class GGUFHeader:
    """fields: key -> int | float | bool | str | numpy array | StringArray;
    tensors: in file order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._map)
        if bytes(self._buf[:4]) != b"GGUF":
            raise GGUFFormatError(f"{self.path.name}: not a GGUF file (magic "
                                  f"{bytes(self._buf[:4])!r})")
        self._pos = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"{self.path.name}: GGUF version {version} is not supported "
                                  "(2 and 3 are; a big-endian file reads as a huge version)")
        n_tensors, n_fields = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, object] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            infos.append((name, dims, self._unpack("<I"), self._unpack("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]

    def release(self) -> None:
        """Take the mapped pages out of this process's resident set (MADV_DONTNEED: a
        read-only file mapping stays valid, and pages come back from the page cache when
        read again)."""
        mm = getattr(self._map, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mm.madvise(mmap.MADV_DONTNEED)

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], type_id: int,
                offset: int) -> TensorInfo:
        if type_id not in TYPES:
            # Its size is unknown, so it cannot be sliced; the loader names the type if the
            # model asks for this tensor.
            return TensorInfo(name, dims, type_id, 0, self._map[:0])
        _, per_block, block_bytes = TYPES[type_id]
        n_bytes = int(np.prod(dims, dtype=np.int64)) // per_block * block_bytes
        begin = start + offset
        if begin + n_bytes > len(self._map):
            raise GGUFFormatError(f"{self.path.name}: tensor {name!r} runs past the end of "
                                  "the file (truncated?)")
        return TensorInfo(name, dims, type_id, n_bytes, self._map[begin:begin + n_bytes])

    def _unpack(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._unpack("<Q")
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8", "replace")
        self._pos += n
        return s

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])
        if vtype != _ARRAY:
            raise GGUFFormatError(f"{self.path.name}: unknown GGUF value type {vtype}")
        etype, count = self._unpack("<I"), self._unpack("<Q")
        if etype in _NUMPY:
            dt = np.dtype(_NUMPY[etype])
            arr = self._map[self._pos:self._pos + count * dt.itemsize].view(dt)
            self._pos += count * dt.itemsize
            return arr
        if etype == _STRING:
            start = self._pos
            for _ in range(count):  # only the lengths are read
                self._pos += 8 + struct.unpack_from("<Q", self._buf, self._pos)[0]
            return StringArray(self._buf, start, count)
        # Arrays of arrays: rare and small, so decoded in full.
        return [plain(self._value(etype)) for _ in range(count)]
