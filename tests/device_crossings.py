"""Every crossing between host and device that a step makes, counted on a machine with no
accelerator.

The step runs with its model, cache and buffers on torch's `meta` device, which stands in
for a GPU: kernels run (shapes only), and a mode sees every call. What would make a CUDA
host wait is recorded:

- a read of the device's values (`tolist`, `item`, `cpu`, `bool(t)`, ...): it returns zeros
  of the right shape so the step can go on;
- a synchronous copy to the device: `torch.tensor(data, device=...)`, `.to(device)` or
  `.copy_(host)` without `non_blocking`, or a host tensor handed to a kernel on the device
  (an implicit copy).

A non-blocking copy is recorded apart: on CUDA it waits for nothing (from pinned memory,
which host_copy.py ensures there; pinning itself needs CUDA, so it is not checked here).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}
COPIES = {"to", "cuda", "copy_"}
FACTORIES = {"tensor", "as_tensor"}


def _on_device(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


def _host(x) -> bool:
    # 0-dim host tensors are scalars to a device kernel (passed by value, no copy).
    return isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0


def _fake_read(name: str, t: torch.Tensor):
    zeros = torch.zeros(t.shape, dtype=t.dtype)
    return {"tolist": zeros.tolist, "cpu": lambda: zeros, "numpy": zeros.numpy,
            "__bool__": lambda: False, "__float__": lambda: 0.0}.get(name, lambda: 0)()


class Crossings(TorchFunctionMode):
    """`with Crossings() as seen:` around a step; then seen.reads, seen.sync_copies and
    seen.async_copies name each crossing in order."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.sync_copies: list[str] = []
        self.async_copies: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        flat = tree_flatten((args, kwargs))[0]
        if name in READS and args and _on_device(args[0]):
            self.reads.append(name)
            return _fake_read(name, args[0])
        if name == "to" and args and _on_device(args[0]):
            device = kwargs.get("device", next((a for a in args[1:] if isinstance(
                a, (str, torch.device))), None))
            if device is not None and torch.device(device).type == "cpu":
                self.reads.append("to(cpu)")
                return _fake_read("cpu", args[0]).to(*args[1:], **kwargs)
        out = func(*args, **kwargs)
        if name in FACTORIES:
            if _on_device(out) and not _on_device(args[0] if args else None):
                self.sync_copies.append(f"torch.{name}(..., device=)")
        elif name in COPIES:
            src = args[1] if name == "copy_" else args[0]
            if _host(src) and _on_device(out):
                non_blocking = kwargs.get("non_blocking", len(args) > 2 and args[2] is True)
                (self.async_copies if non_blocking else self.sync_copies).append(name)
        elif any(_on_device(x) for x in flat) and any(_host(x) for x in flat):
            self.sync_copies.append(f"{name} (a host tensor given to a device kernel)")
        return out
