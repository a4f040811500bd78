"""The queue and the KV slots: who waits, who runs, and which slot each running sequence
holds. Submission and aborts arrive from other threads (the Serve replica's event loop),
so those go through a lock; the step loop alone admits and releases."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from specdec.engine.request import Request
from specdec.engine.state import Seq, pinned_plain
from specdec.errors import CapacityError


class Scheduler:
    def __init__(self, max_slots: int, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self._waiting: collections.deque[Request] = collections.deque()
        self._aborts: set[str] = set()
        self.running: dict[str, Seq] = {}
        self.free_slots = list(range(max_slots - 1, -1, -1))

    # ---- from any thread ------------------------------------------------------------------

    def enqueue(self, req: Request) -> None:
        with self._lock:
            if len(self._waiting) >= self.max_waiting:
                raise CapacityError(f"queue full ({self.max_waiting} waiting requests)")
            req.arrival = time.monotonic()
            self._waiting.append(req)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self.running)

    def waiting_counts(self) -> tuple[int, int]:
        """Requests waiting, and how many of them are pinned to plain decoding."""
        with self._lock:
            return len(self._waiting), sum(map(pinned_plain, self._waiting))

    # ---- from the step loop ---------------------------------------------------------------

    def take_aborts(self) -> list[Seq]:
        """Drop aborted requests from the queue; the running ones aborted, to be finished."""
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            if aborts:
                self._waiting = collections.deque(r for r in self._waiting
                                                  if r.request_id not in aborts)
        return [self.running[rid] for rid in aborts if rid in self.running]

    def admit(self, start: Callable[[Request, int], Seq]) -> None:
        """Move waiting requests into free slots, oldest first; start(req, slot) makes the
        running sequence."""
        while self.free_slots:
            with self._lock:
                if not self._waiting:
                    return
                req = self._waiting.popleft()
            self.running[req.request_id] = start(req, self.free_slots.pop())

    def release(self, seq: Seq) -> None:
        """The sequence stops running and its slot is free again; a second call does
        nothing (the slot may already belong to another sequence)."""
        if self.running.pop(seq.req.request_id, None) is not None:
            self.free_slots.append(seq.slot)
