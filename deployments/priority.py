"""Threads that must not take the model's CPU: background work at a lower priority, and how
much CPU a thread has used."""

from __future__ import annotations

import os
import threading
import time


def background_priority() -> None:
    """Lower this thread's priority (nice 10): the model's steps come first, a compile gets
    what they leave (on a small machine it would otherwise take one core of two)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except OSError:
        pass


def thread_cpu_s(ident: int) -> float:
    """CPU seconds a thread of this process has run (a compile at low priority on a busy
    machine takes longer in wall time, not in work)."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (OSError, ProcessLookupError):
        return 0.0
