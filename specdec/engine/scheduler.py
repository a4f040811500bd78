"""The queue and the KV slots: who waits, who runs, and which slot each running sequence
holds. Submission and aborts arrive from other threads (the Serve replica's event loop),
so those go through a lock; the step loop alone admits and releases.

A slot keeps its last sequence's K/V after it is released, and a new request takes the free
slot holding the longest prefix of its prompt (specdec/model/step/prefix_cache.py): the slots
are the prefix cache. There may be more slots than sequences running at once (cache slots),
so that more conversations stay warm."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

import numpy as np

from specdec.engine.request import Request
from specdec.engine.state import Seq, pinned_plain
from specdec.errors import CapacityError
from specdec.model.step.prefix_cache import Choice, PrefixCache


class Scheduler:
    def __init__(self, num_slots: int, max_waiting: int, max_running: int | None = None,
                 prefix_cache: bool = True) -> None:
        self.max_waiting = max_waiting
        self.max_running = min(max_running or num_slots, num_slots)
        self._lock = threading.Lock()
        self._waiting: collections.deque[Request] = collections.deque()
        self._aborts: set[str] = set()
        self.running: dict[str, Seq] = {}
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.prefixes = PrefixCache(num_slots, enabled=prefix_cache)

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

    def free_count(self) -> int:
        """Sequences that could start now."""
        return min(len(self.free_slots), self.max_running - len(self.running))

    def admit(self, start: Callable[[Request, Choice], Seq]) -> None:
        """Move waiting requests into free slots, oldest first, each into the slot holding
        the longest prefix of its prompt; start(req, choice) makes the running sequence."""
        while self.free_slots and len(self.running) < self.max_running:
            with self._lock:
                if not self._waiting:
                    return
                req = self._waiting.popleft()
            choice = self.prefixes.choose(req.prompt_ids, self.free_slots,
                                          self.running_contents(), req.tenant)
            self.free_slots.remove(choice.slot)
            self.running[req.request_id] = start(req, choice)

    def running_contents(self, but: Seq | None = None) -> dict[int, np.ndarray]:
        """slot -> the tokens whose K/V a running sequence's slot holds now."""
        return {s.slot: np.asarray(s.tokens[: s.held()], dtype=np.int64)
                for s in self.running.values() if s is not but and s.held()}

    def release(self, seq: Seq, keep: bool = True) -> None:
        """The sequence stops running and its slot is free again, keeping its K/V for a
        later request (keep=False: after a failed step, what it holds is not known). A
        second call does nothing (the slot may already belong to another sequence)."""
        if self.running.pop(seq.req.request_id, None) is not None:
            self.prefixes.release(seq.slot, seq.tokens[: seq.held()] if keep else [])
            self.free_slots.append(seq.slot)
