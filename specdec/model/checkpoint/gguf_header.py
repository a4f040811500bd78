"""A GGUF file's header, read without decoding what loading a model never uses.

The `gguf` package's reader builds numpy views for every part of every field, one per
element of an array, and a tokenizer's vocabulary and merges are arrays of hundreds of
thousands of strings: a load (and every rebuild after a lost worker) would pay for them.
Here scalars are decoded, numeric arrays are numpy views of the memory map, and string
arrays are skipped by their lengths and decoded only if asked for. Tensor data stays in
the memory map.

Layout (little-endian, GGUF v2/v3): magic "GGUF", u32 version, u64 tensor count, u64 field
count; fields as (string key, u32 type, value); tensor infos as (string name, u32 n_dims,
u64 dims..., u32 ggml type, u64 offset); tensor data from the next multiple of
`general.alignment` (32 by default).

A file is untrusted input: every count and length is checked against the bytes left before
anything is read or allocated for it, every tensor's dims (1..4 of them, each >= 1, whole
blocks along a row) and its bytes (in Python integers, which do not wrap) against the data
section, and anything wrong is a GGUFFormatError naming the field or tensor.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path

import numpy as np

from specdec.model.checkpoint.gguf_quants import TYPES

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 4           # ggml's GGML_MAX_DIMS
MAX_NESTING = 4        # arrays of arrays: deeper is not a file any writer makes


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
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except ValueError as exc:  # an empty file cannot be mapped
            raise GGUFFormatError(f"{self.path.name}: not a GGUF file ({exc})") from None
        self._buf = memoryview(self._map)
        self._where = "the header"
        if bytes(self._buf[:4]) != b"GGUF":
            raise GGUFFormatError(f"{self.path.name}: not a GGUF file (magic "
                                  f"{bytes(self._buf[:4])!r})")
        self._pos = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"{self.path.name}: GGUF version {version} is not supported "
                                  "(2 and 3 are; a big-endian file reads as a huge version)")
        n_tensors, n_fields = self._unpack("<Q"), self._unpack("<Q")
        # Each field takes at least 12 bytes and each tensor info 24: a count beyond what
        # the file could hold is corrupt (and must not size anything).
        self._check_count(n_fields, 12, "the field count")
        self._check_count(n_tensors, 24, "the tensor count")
        self.fields: dict[str, object] = {}
        for i in range(n_fields):
            self._where = f"field {i}"
            key = self._string()
            self._where = f"field {key!r}"
            self.fields[key] = self._value(self._unpack("<I"))
        infos = []
        for i in range(n_tensors):
            self._where = f"tensor info {i}"
            name = self._string()
            self._where = f"tensor {name!r}"
            n_dims = self._unpack("<I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise self._error(f"{n_dims} dims (1..{MAX_DIMS} are possible)")
            dims = tuple(self._unpack("<Q") for _ in range(n_dims))
            infos.append((name, dims, self._unpack("<I"), self._unpack("<Q")))
        align = self.fields.get("general.alignment", 32)
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or \
                align & (align - 1):
            raise GGUFFormatError(f"{self.path.name}: general.alignment {align!r} is not a "
                                  "positive power of two")
        start = -(-self._pos // align) * align
        names = set()
        self.tensors = []
        for info in infos:
            if info[0] in names:
                raise GGUFFormatError(f"{self.path.name}: tensor {info[0]!r} appears twice")
            names.add(info[0])
            self.tensors.append(self._tensor(start, align, *info))
        # Tensors never share bytes: one whose size (its dims and type) reaches into the next
        # one's is mis-described (read, it would load another tensor's bytes as its own).
        placed = sorted((t.data.ctypes.data, t.n_bytes, t.name) for t in self.tensors
                        if t.n_bytes)
        for (a, n, name), (b, _, other) in zip(placed, placed[1:], strict=False):
            if a + n > b:
                raise GGUFFormatError(f"{self.path.name}: tensor {name!r} ({n} bytes) overlaps "
                                      f"tensor {other!r}: its dims or type are wrong")

    def release(self) -> None:
        """Take the mapped pages out of this process's resident set (MADV_DONTNEED: a
        read-only file mapping stays valid, and pages come back from the page cache when
        read again)."""
        mm = getattr(self._map, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mm.madvise(mmap.MADV_DONTNEED)

    def _error(self, what: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.path.name}: {self._where}: {what}")

    def _left(self) -> int:
        return len(self._map) - self._pos

    def _check_count(self, count: int, min_bytes: int, what: str) -> None:
        if count * min_bytes > self._left():
            raise self._error(f"{what} is {count}, more than the {self._left()} bytes left "
                              "could hold (truncated or corrupt)")

    def _tensor(self, start: int, align: int, name: str, dims: tuple[int, ...],
                type_id: int, offset: int) -> TensorInfo:
        where = f"{self.path.name}: tensor {name!r}"
        if any(d < 1 for d in dims):
            raise GGUFFormatError(f"{where}: dims {dims} (each must be at least 1)")
        if type_id not in TYPES:
            # Its size is unknown, so it cannot be sliced; the loader names the type if the
            # model asks for this tensor.
            return TensorInfo(name, dims, type_id, 0, self._map[:0])
        type_name, per_block, block_bytes = TYPES[type_id]
        if dims[0] % per_block:
            raise GGUFFormatError(f"{where}: rows of {dims[0]} weights are not whole "
                                  f"{type_name} blocks of {per_block}")
        count = 1
        for d in dims:  # Python integers: a product of huge dims cannot wrap to 0
            count *= d
        n_bytes = count // per_block * block_bytes
        if offset % align:
            raise GGUFFormatError(f"{where}: offset {offset} is not a multiple of the "
                                  f"alignment {align}")
        begin = start + offset
        if begin + n_bytes > len(self._map):
            raise GGUFFormatError(f"{where}: its {n_bytes} bytes at offset {offset} run past "
                                  f"the end of the file ({len(self._map)} bytes; truncated?)")
        return TensorInfo(name, dims, type_id, n_bytes, self._map[begin:begin + n_bytes])

    def _unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if size > self._left():
            raise self._error(f"the file ends {self._left()} bytes into a {size}-byte value "
                              "(truncated)")
        (v,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += size
        return v

    def _string(self) -> str:
        n = self._unpack("<Q")
        if n > self._left():
            raise self._error(f"a string of {n} bytes, but {self._left()} are left")
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8", "replace")
        self._pos += n
        return s

    def _value(self, vtype: int, depth: int = 0):
        if vtype == _STRING:
            return self._string()
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])
        if vtype != _ARRAY:
            raise self._error(f"unknown GGUF value type {vtype}")
        if depth >= MAX_NESTING:
            raise self._error(f"arrays nested more than {MAX_NESTING} deep")
        etype, count = self._unpack("<I"), self._unpack("<Q")
        if etype in _NUMPY:
            dt = np.dtype(_NUMPY[etype])
            if count * dt.itemsize > self._left():
                raise self._error(f"an array of {count} {dt} values, but {self._left()} bytes "
                                  "are left")
            arr = self._map[self._pos:self._pos + count * dt.itemsize].view(dt)
            self._pos += count * dt.itemsize
            return arr
        if etype == _STRING:
            self._check_count(count, 8, "a string array's length")
            start = self._pos
            for _ in range(count):  # only the lengths are read
                n = self._unpack("<Q")
                if n > self._left():
                    raise self._error(f"a string of {n} bytes, but {self._left()} are left")
                self._pos += n
            return StringArray(self._buf, start, count)
        if etype != _ARRAY and etype not in _SCALARS:
            raise self._error(f"unknown GGUF value type {etype} in an array")
        # Arrays of arrays: rare and small, so decoded in full.
        self._check_count(count, 12 if etype == _ARRAY else 1, "an array's length")
        return [plain(self._value(etype, depth + 1)) for _ in range(count)]
