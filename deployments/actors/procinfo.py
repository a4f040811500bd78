"""This process's memory, as the reliability report and /health show it."""

from __future__ import annotations

import resource


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rss_mb() -> float:
    return _status_mb("VmRSS")


def rss_anon_mb() -> float:
    """Private memory now (weights, cache, interpreter), without the checkpoint's mmap'd
    file pages that reading a slice touches and the kernel can drop at any time."""
    return _status_mb("RssAnon")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
