"""Host values onto the device without making the host wait for it.

On CUDA, `torch.tensor(values, device="cuda")`, `.to("cuda")` and `.copy_(host)` from ordinary
(pageable) host memory are synchronous: PyTorch waits for the stream to drain before each
one returns. A step that builds an input after its forward is queued (the verify's positions,
guesses and uniforms come after the target's logits are asked for) would stall the host on
every such copy. So a step's small host inputs are gathered into one pinned buffer per dtype
and sent in one non-blocking copy, ordered on the stream before the kernels that read them
(torch's pinned-memory cache keeps the block until the copy has run). Off CUDA the same code
is a plain move, or nothing where host and device are one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _same(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """x, a host tensor, on `device` by a copy the host does not wait for."""
    device = torch.device(device)
    if _same(x.device, device):
        return x
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device, non_blocking=True)


def to_device_all(tensors: Sequence[torch.Tensor], device: torch.device | str
                  ) -> list[torch.Tensor]:
    """Host tensors on `device`, in their order and shapes, by one copy per dtype among them
    (the results are views of that copy)."""
    device = torch.device(device)
    out = list(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if not _same(t.device, device):
            by_dtype.setdefault(t.dtype, []).append(i)
    for picked in by_dtype.values():
        flat = to_device(torch.cat([tensors[i].reshape(-1) for i in picked]), device)
        parts = flat.split([tensors[i].numel() for i in picked])
        for i, part in zip(picked, parts, strict=True):
            out[i] = part.view(tensors[i].shape)
    return out


def longs_to_device(lists: Sequence[Sequence[int]], device: torch.device | str
                    ) -> list[torch.Tensor]:
    """int64 vectors of host ints on `device`, in one copy."""
    flat = torch.tensor([int(x) for v in lists for x in v], dtype=torch.long)
    return list(to_device(flat, device).split([len(v) for v in lists]))
