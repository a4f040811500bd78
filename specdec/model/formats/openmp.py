"""What OpenMP really runs a parallel region with, read from the library torch loaded.

torch.get_num_threads() answers from torch's own setting; on a thread that Ray's executor
created the OpenMP runtime may still use the process environment's OMP_NUM_THREADS (Ray
sets 1 for actors with fractional CPUs). Reading omp_get_max_threads() on the calling
thread tells which one a matmul there will actually get.
"""

from __future__ import annotations

import ctypes
import functools


@functools.lru_cache(maxsize=1)
def _omp():
    import torch  # noqa: F401 - loads the OpenMP runtime torch was built with

    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "omp" in line.split()[-1].rsplit("/", 1)[-1]}
    for path in sorted(libs):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_get_max_threads.restype = ctypes.c_int
            return lib
        except (OSError, AttributeError):
            continue
    return None


def omp_max_threads() -> int | None:
    """OpenMP's thread count for a parallel region started on this thread (None if torch
    uses no OpenMP runtime)."""
    lib = _omp()
    return None if lib is None else int(lib.omp_get_max_threads())
