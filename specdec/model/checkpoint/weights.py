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

from specdec.model.checkpoint.family import LAYER, fused_part


def open_checkpoint(path: str | Path):
    """A reader for a safetensors checkpoint directory or a GGUF (a file, or a directory
    holding one and no safetensors, as the offline pack does)."""
    from specdec.model.checkpoint.gguf_file import GGUFCheckpoint, gguf_in

    gguf = gguf_in(path)
    return GGUFCheckpoint(gguf) if gguf is not None else CheckpointReader(path)


class CheckpointReader:
    """Weights asked for by canonical name (specdec.model.checkpoint.family), read where the
    checkpoint's family keeps them: renamed, as rows of a fused tensor, and Gemma's norms
    as the (1 + w) they scale by."""

    def __init__(self, path: str | Path) -> None:
        from specdec.model.checkpoint.config import DecoderConfig

        path = Path(path)
        cfg = DecoderConfig.from_checkpoint(path)
        self.family = cfg.family
        D = cfg.head_dim
        self._parts = (cfg.num_heads * D, cfg.num_kv_heads * D, cfg.intermediate_size)
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

    def _locate(self, name: str) -> tuple[str, int | None, int]:
        """(the stored tensor, first row, rows) of a canonical weight; rows None: all."""
        m = LAYER.match(name)
        if m is None:
            return name, None, 0
        prefix, role, suffix = f"model.layers.{m.group(1)}.", m.group(2), m.group(3) or ""
        fused = (self.family.fused_qkv and role.startswith("self_attn.")) or \
            (self.family.fused_gate_up and role.startswith("mlp."))
        part = fused_part(role, *self._parts) if fused else None
        if part is not None:
            return prefix + part[0] + suffix, part[1], part[2]
        return prefix + self.family.hf_role(role) + suffix, None, 0

    def has(self, name: str) -> bool:
        return self._locate(name)[0] in self._map

    def get(self, name: str, rows: range | None = None, cols: range | None = None,
            dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `name`, optionally only rows[a:b] (dim 0) or cols[a:b] (dim 1)."""
        stored, first, n = self._locate(name)
        if stored not in self._map:
            raise KeyError(f"checkpoint has no tensor {stored!r} (for {name!r})")
        sl = self._handles[self._map[stored]].get_slice(stored)
        if first is not None:
            rows = range(first, first + n) if rows is None else \
                range(first + rows.start, first + rows.stop)
        if rows is not None and cols is not None:
            t = sl[rows.start:rows.stop, cols.start:cols.stop]
        elif rows is not None:
            t = sl[rows.start:rows.stop]
        elif cols is not None:
            t = sl[:, cols.start:cols.stop]
        else:
            t = sl[:]
        if self.family.norm_plus_one and name.endswith("norm.weight"):
            t = 1.0 + t.float()  # Gemma's RMSNorm scales by (1 + w), in fp32
        return t.to(dtype) if dtype is not None else t
