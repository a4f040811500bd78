"""Give the C heap's free memory back to the system after a model is built.

Loading dequantizes, repacks and drops tensors by the thousand; glibc keeps the freed blocks
in its arenas, so a 1.5B target that holds 1.1 GB of weights stayed at 1.8 GB resident for its
life (0.4 GB of it free heap). malloc_trim(0) returns what is free. Elsewhere (no glibc) it
does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None


def release_free_heap() -> None:
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)
