"""Which storage each weight gets under the `q4k` and `int4` formats (weight_format.py).

The loader hands each weight over as a FileWeight: the file's Q4_K or Q6_K blocks (never
dequantized), or its floats with what the file held ("int8" for another quantized type,
None for floats); here that becomes our kernel's layer over the file's very blocks, a Q4_K
layer over floats quantized here, or FBGEMM's int8. A plain float tensor is a FileWeight
of floats. A fused q|k|v or gate|up whose parts the file stores differently keeps each part in
its own storage and joins their outputs.
"""

from __future__ import annotations

import dataclasses

import torch

from specdec.model.checkpoint.kquant_blocks import QK, Q4KBlocks, Q6KBlocks
from specdec.model.formats.int8_linear import RowInt8Linear
from specdec.model.formats.linear import Linear
from specdec.model.formats.q4k import Q4KLinear, quantize
from specdec.model.formats.q6k import Q6KLinear


@dataclasses.dataclass
class FileWeight:
    """A weight as the checkpoint holds it. blocks: the file's Q4_K or Q6_K blocks (floats
    then None where they are kept as they are: nothing dequantizes them), "int8" (floats of
    another quantized type, or of rows the loader reorders) or None (float storage)."""

    floats: torch.Tensor | None
    blocks: Q4KBlocks | Q6KBlocks | str | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.floats.shape) if self.floats is not None else self.blocks.shape


def _file_weight(weight: FileWeight | torch.Tensor) -> FileWeight:
    return weight if isinstance(weight, FileWeight) else FileWeight(weight)


def keeps_blocks(source, round_all_to_q4k: bool = False) -> bool:
    """Whether a weight the file holds as `source` runs on those very blocks (so the loader
    never needs its floats): Q4_K always, Q6_K except under int4 (which rounds it to 4 bits)."""
    return isinstance(source, Q4KBlocks) or (isinstance(source, Q6KBlocks) and not round_all_to_q4k)


def kind(weight: FileWeight | torch.Tensor, round_all_to_q4k: bool = False) -> str:
    """"blocks" / "blocks6" (the file's Q4_K / Q6_K blocks), "int8" (another quantized type,
    or columns that are not whole blocks) or "quantize" (floats, quantized to Q4_K here).
    round_all_to_q4k (int4): "blocks" or "quantize", whatever the file stores, where the columns
    come in 32s."""
    weight = _file_weight(weight)
    source = weight.blocks
    if isinstance(source, Q4KBlocks):
        return "blocks"
    if isinstance(source, Q6KBlocks) and not round_all_to_q4k:
        return "blocks6"
    if round_all_to_q4k:
        return "int8" if weight.shape[1] % 32 else "quantize"
    if source == "int8" or weight.shape[1] % QK:
        return "int8"
    return "quantize"


def linear(weight: FileWeight | torch.Tensor, bias: torch.Tensor | None,
           round_all_to_q4k: bool = False) -> Linear:
    weight = _file_weight(weight)
    k = kind(weight, round_all_to_q4k)
    if k == "blocks":
        return Q4KLinear(weight.blocks, bias)
    if k == "blocks6":
        return Q6KLinear(weight.blocks, bias)
    if k == "quantize":
        return Q4KLinear(quantize(weight.floats), bias, weight.shape[1])
    return RowInt8Linear(weight.floats, bias, 2)


def linear_rows(parts: list[FileWeight | torch.Tensor], bias: torch.Tensor | None,
                round_all_to_q4k: bool = False) -> Linear:
    """One layer over weights stacked by rows; consecutive parts of one kind share a layer."""
    parts = [_file_weight(p) for p in parts]
    groups: list[list[FileWeight]] = []
    for p in parts:
        if groups and kind(p, round_all_to_q4k) == kind(groups[-1][0], round_all_to_q4k):
            groups[-1].append(p)
        else:
            groups.append([p])
    linears, start = [], 0
    for g in groups:
        rows = sum(p.shape[0] for p in g)
        b = None if bias is None else bias[start:start + rows]
        linears.append(linear(_cat_rows(g), b, round_all_to_q4k))
        start += rows
    return linears[0] if len(linears) == 1 else RowStackedLinear(linears)


def _cat_rows(parts: list[FileWeight]) -> FileWeight:
    """Weights of one kind stacked by rows: their blocks, or their floats."""
    if len(parts) == 1:
        return parts[0]
    sources = [p.blocks for p in parts]
    if all(p.floats is None for p in parts):  # kept as the file's blocks: stack those
        for blocks in (Q4KBlocks, Q6KBlocks):
            if all(isinstance(s, blocks) for s in sources):
                return FileWeight(None, blocks.cat(sources))
    # Floats (int4 quantizes even a Q6_K part from them): one kind, so the first part's
    # tag says what they all are.
    return FileWeight(torch.cat([p.floats for p in parts]), sources[0])


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
