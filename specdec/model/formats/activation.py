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


def gelu_tanh_mul(gate_up: torch.Tensor, row_invariant: bool) -> torch.Tensor:
    """gate_up: [rows, 2 * width] -> gelu_tanh(gate) * up (Gemma's GeGLU). Row-invariant: one
    ATen call per row, so no row's elements fall in a vector loop's scalar tail or a
    thread's boundary that another batch would place elsewhere."""
    if not row_invariant or gate_up.shape[0] <= 1:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
    return torch.cat([gelu_tanh_mul(row, False) for row in gate_up.split(1)])


def gate_act(name: str, gate_up: torch.Tensor, row_invariant: bool) -> torch.Tensor:
    """The family's gated activation by name ("silu" or "gelu_tanh")."""
    return (silu_mul if name == "silu" else gelu_tanh_mul)(gate_up, row_invariant)
