"""A hostile or corrupt .gguf ends in a clear error: mutated counts, dims, types, offsets,
metadata and random header bytes, and truncations, of the pack's real SmolLM2 file, each
loaded by Decoder.from_checkpoint in a process of its own under a memory cap. The only
acceptable outcomes are a model that loads (a mutation that leaves a valid file) or one of
our own errors naming what is wrong; a struct.error, an OverflowError, a RuntimeError deep
in torch, a crash, a hang or running out of memory are failures."""

from __future__ import annotations

import concurrent.futures
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model

# The loader in a process of its own: our own errors print CLEAR, anything else fails.
_LOAD = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
from specdec.model.step.decoder import Decoder
try:
    Decoder.from_checkpoint(sys.argv[1], "float32")
except ValueError as e:  # ours: GGUFFormatError, UnsupportedModel, UnsupportedQuant
    if type(e).__module__.startswith("specdec.") and str(e):
        print("CLEAR", type(e).__name__, str(e)[:300])
        sys.exit(3)
    raise
print("LOADED")
"""


class Layout:
    """Where the header's numbers sit in the file (what the mutations aim at)."""

    SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def __init__(self, data: bytes) -> None:
        self.d, self.pos = data, 4
        self.fields: dict[str, dict] = {}
        self.tensors: list[dict] = []
        self._u(4)  # version
        self.n_tensors_at = self.pos
        n_tensors = self._u(8)
        self.n_fields_at = self.pos
        n_fields = self._u(8)
        for _ in range(n_fields):
            f = {"key_len_at": self.pos}
            key = self._str()
            f["type_at"] = self.pos
            vtype = self._u(4)
            f["value_at"] = self.pos
            if vtype == 9:
                f["elem_type_at"] = self.pos
                etype = self._u(4)
                f["count_at"] = self.pos
                count = self._u(8)
                for _ in range(count):
                    self._skip(etype)
            else:
                self._skip(vtype)
            self.fields[key] = f
        for _ in range(n_tensors):
            t = {"name_at": self.pos, "name": self._str(), "n_dims_at": self.pos}
            n = self._u(4)
            t["dims_at"] = [self.pos + 8 * i for i in range(n)]
            t["dims"] = [self._u(8) for _ in range(n)]
            t["type_at"] = self.pos
            self._u(4)
            t["offset_at"] = self.pos
            t["offset"] = self._u(8)
            self.tensors.append(t)
        self.header_end = self.pos

    def _u(self, n: int) -> int:
        v = int.from_bytes(self.d[self.pos:self.pos + n], "little")
        self.pos += n
        return v

    def _str(self) -> str:
        n = self._u(8)
        s = self.d[self.pos:self.pos + n].decode("utf-8", "replace")
        self.pos += n
        return s

    def _skip(self, vtype: int) -> None:
        if vtype == 8:
            self._str()
        else:
            self.pos += self.SCALAR[vtype]

    def tensor(self, name: str) -> dict:
        return next(t for t in self.tensors if t["name"] == name)


def _put(data: bytearray, at: int, fmt: str, value) -> None:
    struct.pack_into(fmt, data, at, value)


def variants(data: bytes) -> dict[str, bytes]:
    """Name -> the mutated file."""
    lay = Layout(data)
    embd, q0 = lay.tensor("token_embd.weight"), lay.tensor("blk.0.attn_q.weight")
    arch = next(k.split(".")[0] for k in lay.fields if k.endswith(".block_count"))
    out: dict[str, bytes] = {}

    def mutate(name, at, fmt, value):
        d = bytearray(data)
        _put(d, at, fmt, value)
        out[name] = bytes(d)

    mutate("magic", 0, "<I", 0x46554748)
    mutate("version 4", 4, "<I", 4)
    mutate("tensor count 2^60", lay.n_tensors_at, "<Q", 1 << 60)
    mutate("field count 2^60", lay.n_fields_at, "<Q", 1 << 60)
    mutate("field count + 1", lay.n_fields_at, "<Q", len(lay.fields) + 1)
    first_key = next(iter(lay.fields.values()))
    mutate("key length 2^62", first_key["key_len_at"], "<Q", 1 << 62)
    tokens = lay.fields["tokenizer.ggml.tokens"]
    mutate("string array count 2^62", tokens["count_at"], "<Q", 1 << 62)
    numeric = next(f for f in lay.fields.values() if "count_at" in f
                   and int.from_bytes(data[f["elem_type_at"]:f["elem_type_at"] + 4],
                                      "little") not in (8, 9))
    mutate("numeric array count 2^61", numeric["count_at"], "<Q", 1 << 61)
    mutate("numeric array count past the end", numeric["count_at"], "<Q", len(data))
    mutate("value type 99", first_key["type_at"], "<I", 99)
    mutate("array element type 99", tokens["elem_type_at"], "<I", 99)
    mutate("nested arrays", tokens["elem_type_at"], "<I", 9)
    mutate("block count 1000", lay.fields[f"{arch}.block_count"]["value_at"], "<I", 1000)
    mutate("head count 0", lay.fields[f"{arch}.attention.head_count"]["value_at"], "<I", 0)
    mutate("head count 7", lay.fields[f"{arch}.attention.head_count"]["value_at"], "<I", 7)
    mutate("embedding length 2^31", lay.fields[f"{arch}.embedding_length"]["value_at"], "<I",
           1 << 31)
    mutate("n_dims 0", q0["n_dims_at"], "<I", 0)
    mutate("n_dims 9", q0["n_dims_at"], "<I", 9)
    mutate("a dim 0", q0["dims_at"][1], "<Q", 0)
    d = bytearray(data)  # 2^32 x 2^32 elements: a byte count that wraps in 64 bits
    _put(d, q0["dims_at"][0], "<Q", 1 << 32)
    _put(d, q0["dims_at"][1], "<Q", 1 << 32)
    out["dims 2^32 x 2^32"] = bytes(d)
    mutate("a row of partial blocks", q0["dims_at"][0], "<Q", q0["dims"][0] + 1)
    mutate("a shape the config does not have", q0["dims_at"][1], "<Q", q0["dims"][1] // 2)
    mutate("embedding rows halved", embd["dims_at"][1], "<Q", embd["dims"][1] // 2)
    mutate("tensor type 99", q0["type_at"], "<I", 99)
    mutate("tensor type F32", q0["type_at"], "<I", 0)
    mutate("offset 2^62", q0["offset_at"], "<Q", 1 << 62)
    mutate("offset misaligned", q0["offset_at"], "<Q", q0["offset"] + 1)
    out["truncated to 10 bytes"] = data[:10]
    out["truncated mid header"] = data[: lay.header_end // 2]
    out["truncated mid data"] = data[: len(data) - 4096]
    out["empty"] = b""
    for seed in range(4):  # random bytes anywhere in the header
        rng = random.Random(seed)
        d = bytearray(data)
        for _ in range(8):
            d[rng.randrange(4, lay.header_end)] = rng.randrange(256)
        out[f"random header bytes {seed}"] = bytes(d)
    return out


def _load(path: Path) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        r = subprocess.run([sys.executable, "-c", _LOAD, str(path)], capture_output=True,
                           text=True, timeout=180, env=env)
    except subprocess.TimeoutExpired:
        return -1, "hung for 180 s"
    return r.returncode, (r.stdout + r.stderr)[-1500:]


def test_every_corrupt_file_ends_in_a_clear_error(smollm2_path, tmp_path):
    from specdec.model.checkpoint.gguf_file import gguf_in

    src = gguf_in(smollm2_path)
    data = src.read_bytes()
    cases = variants(data)
    assert len(cases) >= 20
    paths = {}
    for i, (name, blob) in enumerate(cases.items()):
        d = tmp_path / f"case{i}"
        d.mkdir()
        for extra in smollm2_path.iterdir():  # the tokenizer beside it, as in the pack
            if extra.suffix != ".gguf" and extra.is_file():
                shutil.copy(extra, d / extra.name)
        (d / "model.gguf").write_bytes(blob)
        paths[name] = d
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = dict(zip(paths, pool.map(_load, paths.values()), strict=True))
    bad = {name: out for name, (rc, out) in results.items()
           if not (rc == 3 and "CLEAR" in out) and not (rc == 0 and "LOADED" in out)}
    assert not bad, "\n\n".join(f"{name}:\n{out}" for name, out in bad.items())
    # Most of them are refused, not loaded.
    assert sum(rc == 3 for rc, _ in results.values()) >= len(cases) - 1
