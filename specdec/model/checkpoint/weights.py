"""Read a checkpoint's tensors, or only one rank's slice of them, from safetensors files
(GGUF files: specdec.model.checkpoint.gguf_file).

Slices are read through safetensors' lazy `get_slice`, so a tensor-parallel shard never
materializes the whole model: it reads the rows or columns it owns and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def open_checkpoint(path: str | Path):
    """A reader for a safetensors checkpoint directory or a GGUF (a file, or a directory
    holding one and no safetensors, as the offline pack does)."""
    from specdec.model.checkpoint.gguf_file import GGUFCheckpoint, gguf_in

    gguf = gguf_in(path)
    return GGUFCheckpoint(gguf) if gguf is not None else CheckpointReader(path)


class CheckpointReader:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no .safetensors files in {path}")
            weight_map = {}
        self._handles = {f: safe_open(path / f, framework="pt") for f in files}
        if not weight_map:
            for f, h in self._handles.items():
                for key in h.keys():
                    weight_map[key] = f
        self._map = weight_map

    def has(self, name: str) -> bool:
        return name in self._map

    def get(self, name: str, rows: range | None = None, cols: range | None = None,
            dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `name`, optionally only rows[a:b] (dim 0) or cols[a:b] (dim 1)."""
        if name not in self._map:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        sl = self._handles[self._map[name]].get_slice(name)
        if rows is not None:
            t = sl[rows.start:rows.stop]
        elif cols is not None:
            t = sl[:, cols.start:cols.stop]
        else:
            t = sl[:]
        return t.to(dtype) if dtype is not None else t
