"""Which storage each weight gets under the `q4k` and `int4` formats (weight_format.py).

The GGUF loader tags a weight with what the file holds (`q4k_source`: Q4_K or Q6_K blocks,
"int8" for another quantized type, nothing for floats); here that becomes our kernel's
layer over the file's very blocks, a Q4_K layer over floats quantized here, or FBGEMM's
int8. A fused q|k|v or gate|up whose parts the file stores differently keeps each part in
its own storage and joins their outputs.
"""

from __future__ import annotations

import torch

from specdec.model.int8_linear import RowInt8Linear
from specdec.model.linear import Linear
from specdec.model.q4k import QK, Q4KBlocks, Q4KLinear, quantize
from specdec.model.q6k import Q6KBlocks, Q6KLinear


def keeps_blocks(source, everything: bool = False) -> bool:
    """Whether a weight the file holds as `source` runs on those very blocks (so the loader
    never needs its floats): Q4_K always, Q6_K except under int4 (which rounds it to 4 bits)."""
    return isinstance(source, Q4KBlocks) or (isinstance(source, Q6KBlocks) and not everything)


def kind(weight: torch.Tensor, everything: bool = False) -> str:
    """"blocks" / "blocks6" (the file's Q4_K / Q6_K blocks), "int8" (another quantized type,
    or columns that are not whole blocks) or "quantize" (floats, quantized to Q4_K here).
    everything (int4): "blocks" or "quantize", whatever the file stores, where the columns
    come in 32s."""
    source = getattr(weight, "q4k_source", None)
    if isinstance(source, Q4KBlocks):
        return "blocks"
    if isinstance(source, Q6KBlocks) and not everything:
        return "blocks6"
    if everything:
        return "int8" if weight.shape[1] % 32 else "quantize"
    if source == "int8" or weight.shape[1] % QK:
        return "int8"
    return "quantize"


def linear(weight: torch.Tensor, bias: torch.Tensor | None, everything: bool = False) -> Linear:
    k = kind(weight, everything)
    if k == "blocks":
        return Q4KLinear(weight.q4k_source, bias)
    if k == "blocks6":
        return Q6KLinear(weight.q4k_source, bias)
    if k == "quantize":
        return Q4KLinear(quantize(weight), bias, weight.shape[1])
    return RowInt8Linear(weight, bias, 2)


def linear_rows(parts: list[torch.Tensor], bias: torch.Tensor | None,
                everything: bool = False) -> Linear:
    """One layer over weights stacked by rows; consecutive parts of one kind share a layer."""
    groups: list[list[torch.Tensor]] = []
    for p in parts:
        if groups and kind(p, everything) == kind(groups[-1][0], everything):
            groups[-1].append(p)
        else:
            groups.append([p])
    linears, start = [], 0
    for g in groups:
        rows = sum(p.shape[0] for p in g)
        b = None if bias is None else bias[start:start + rows]
        linears.append(linear(_cat_rows(g), b, everything))
        start += rows
    return linears[0] if len(linears) == 1 else RowStackedLinear(linears)


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Weights stacked by rows, with their blocks stacked alike."""
    if len(parts) == 1:
        return parts[0]
    out = torch.cat(parts)
    sources = [getattr(p, "q4k_source", None) for p in parts]
    for blocks in (Q4KBlocks, Q6KBlocks):
        if all(isinstance(s, blocks) for s in sources):
            out.q4k_source = blocks.cat(sources)
    if sources[0] == "int8":
        out.q4k_source = "int8"
    return out


class RowStackedLinear(Linear):
    """Linears over consecutive row ranges of one weight, outputs joined: each part in its
    own storage."""

    def __init__(self, parts: list[Linear]) -> None:
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)
