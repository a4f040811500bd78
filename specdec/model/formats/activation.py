"""The MLP's activation, silu(gate) * up, for the batch-invariant formats: every element the
same arithmetic whatever the rows beside it and the thread count (kernels/row_ops.cpp says
why ATen's is not). Other formats, and machines where the kernel cannot be built, use ATen.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def _ops():
    from specdec.model.formats.kernels.build import KernelUnavailable, rows

    try:
        return rows()
    except KernelUnavailable:
        return None


def kernel_available() -> bool:
    return _ops() is not None


def silu_mul(gate_up: torch.Tensor, row_invariant: bool) -> torch.Tensor:
    """gate_up: [rows, 2 * width] (gate | up) -> silu(gate) * up, [rows, width]."""
    ops = _ops() if row_invariant else None
    if ops is not None and gate_up.device.type == "cpu" and gate_up.dtype == torch.float32:
        return ops.silu_mul(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
