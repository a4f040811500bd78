"""Drafting overlapped with verification (PEARL, Liu et al., ICLR 2025), exact.

Sequential speculation alternates: the draft guesses k tokens while the target waits, then
the target verifies them while the draft waits, so a round costs k*c + v target steps. Here
the draft and the target work at the same time. In every step, a speculative row hands the
target its one pending token (the last one emitted) and the guesses already drafted for it;
at the same time the draft continues from the end of those guesses, assuming they will all
be kept, and drafts for as long as the target is busy (at least one guess, at most k: the
draft length adapts to the target's step time by itself). Then:

1. The target verifies the row's guesses with the usual rule. If one is rejected, the
   row's round ends as always (kept guesses, then a draw from max(0, p - q)) and what the
   draft drafted meanwhile is dropped: it assumed a context that did not happen.
2. If all are kept, the target does NOT draw its bonus token from p (the distribution at
   the next position). It keeps p, and the draft's first new guess x1 (drawn from q given
   exactly that context) is verified against it: kept with probability min(1, p/q), else a
   token is drawn from max(0, p - q). Either way the emitted token is distributed as p, as
   the bonus would have been. If x1 is kept, the rest of the draft's new guesses are the
   row's guesses for the next step, ready with no wait; if not, the next step starts from
   the corrected token (and its window verifies the draft's next x1 the same way).

Why the output stays exactly the target's: every emitted token is either a plain draw from
the target's p or the result of the rejection rule applied to a guess that was drawn from
the draft's q given exactly the context the target had confirmed (a guess drafted on an
assumption that failed is never verified). How long the draft drafted depends only on the
target's timing, never on its verdict. So the sequence of accept/reject decisions is the
one sequential speculation would make with some proposal lengths, each exact.

Cost per step: max(target step, draft forwards until stopped) plus one small call to
resolve x1; tokens per step: all kept guesses plus one. On machines where the draft and
the target have their own compute (separate cores, devices or nodes) a round costs
max(k*c, v) instead of k*c + v; where they share cores, overlapping them only moves work.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import get_args

from specdec.spec_decode.proposal import Proposal, ProposeInput
from specdec.spec_decode.target_runner import Head
from specdec.vocabulary import OverlapMode

log = logging.getLogger(__name__)



class ThreadWindow:
    """A draft window in this process: the proposer runs on its own thread (torch releases
    the GIL, so it computes at the same time as the target on the caller's thread)."""

    def __init__(self, propose: Callable, inputs: list[ProposeInput],
                 threads: int | None = None) -> None:
        self._threads = threads
        self._stop = threading.Event()
        self._out: list[Proposal] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(propose, inputs), daemon=True,
                                        name="draft-window")
        self._thread.start()

    def _run(self, propose, inputs) -> None:
        if self._threads:
            # OpenMP teams are per calling thread: this one computes with the draft's own
            # thread count while the caller's computes the target's step.
            import torch

            torch.set_num_threads(self._threads)
        try:
            self._out = propose(inputs, should_stop=self._stop.is_set)
        except BaseException as exc:  # noqa: BLE001 - surfaced by result()
            self._error = exc

    def stop(self) -> None:
        self._stop.set()

    def result(self) -> list[Proposal]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._out or []


@dataclasses.dataclass
class ModeStats:
    seconds: float = 0.0
    row_tokens: float = 0.0   # tokens emitted, summed over rows

    @property
    def seconds_per_row_token(self) -> float:
        return self.seconds / self.row_tokens if self.row_tokens else float("inf")


class OverlapChooser:
    """`overlap: auto`: measure both ways, keep the faster, measure again now and then.

    Steps alternate in blocks between sequential and overlapped speculation until each has
    `sample_steps` steps with speculative rows; the mode with fewer seconds per emitted
    token per row wins (ties keep sequential, the simpler one); after `hold_steps` steps
    the comparison starts over (the load, the prompts or the machine may have changed)."""

    def __init__(self, sample_steps: int = 48, block: int = 8, hold_steps: int = 2000) -> None:
        self.sample_steps, self.block, self.hold_steps = sample_steps, block, hold_steps
        self.stats = {False: ModeStats(), True: ModeStats()}
        self.steps = {False: 0, True: 0}
        self.choice: bool | None = None
        self._held = 0
        self._turn = 0

    def use_overlap(self) -> bool:
        if self.choice is not None:
            return self.choice
        return (self._turn // self.block) % 2 == 1

    def observe(self, overlapped: bool, seconds: float, row_tokens: int) -> None:
        """One step that had speculative rows: its time and the tokens its rows emitted."""
        if self.choice is not None:
            self._held += 1
            if self._held >= self.hold_steps:
                self.__init__(self.sample_steps, self.block, self.hold_steps)
            return
        self._turn += 1
        s = self.stats[overlapped]
        s.seconds += seconds
        s.row_tokens += row_tokens
        self.steps[overlapped] += 1
        if min(self.steps.values()) >= self.sample_steps:
            seq, ovl = (self.stats[m].seconds_per_row_token for m in (False, True))
            self.choice = ovl < seq


@dataclasses.dataclass(kw_only=True)
class Settled:
    """The draft's window after the target's step: each deferred position's resolution,
    the head guesses it was settled against, the window's proposals by row, and what it
    took (the draft's time not hidden by the target, the resolve call)."""
    resolved: dict = dataclasses.field(default_factory=dict)
    heads: dict[str, Head] = dataclasses.field(default_factory=dict)
    proposals: dict[str, Proposal] = dataclasses.field(default_factory=dict)
    draft_s: float = 0.0
    draft_compute_s: float = 0.0
    draft_bytes: int = 0
    mean_k: float = 0.0          # guesses per drafting row the window made
    max_k: int = 0
    resolve_s: float = 0.0


def close_window(draft, target, window, windows: list[ProposeInput], results: list) -> Settled:
    """Overlap: stop the draft, take its guesses, settle each deferred position against
    its row's head guess."""
    out = Settled()
    if not windows:
        return out
    # (A window that only caught the draft up on a prompt has nothing to settle.)
    t0 = time.perf_counter()
    proposals: dict[str, Proposal] = {}
    if window is not None:
        window.stop()
        try:
            got = window.result()
            proposals = {i.seq_id: p for i, p in zip(windows, got, strict=False)}
        except Exception as exc:  # noqa: BLE001 - a lost draft: plain draws this step
            log.warning("draft window failed (%s); settling plainly", exc)
        call = draft.last_call
        if call is not None:
            out.draft_compute_s, out.draft_bytes = call.compute_s, call.bytes
    out.draft_s = time.perf_counter() - t0  # the draft's time not hidden by the target
    catchups = {i.seq_id for i in windows if i.catchup_only}
    guessed = [len(p.token_ids) for rid, p in proposals.items()
               if p.token_ids and rid not in catchups]
    out.mean_k = sum(guessed) / len(guessed) if guessed else 0.0
    out.max_k = max(guessed, default=0)
    heads: dict[str, Head | None] = {}
    for res in results:
        if not res.deferred:
            continue
        prop = proposals.get(res.seq_id)
        if prop is None or not prop.token_ids:
            heads[res.seq_id] = None
        else:
            heads[res.seq_id] = Head(prop.token_ids[0],
                                     None if prop.q_ids is None else prop.q_ids[0],
                                     None if prop.q_probs is None else prop.q_probs[0])
    t1 = time.perf_counter()
    out.resolved = target.resolve(heads) if heads else {}
    out.resolve_s = time.perf_counter() - t1
    out.heads = {k: v for k, v in heads.items() if v is not None}
    out.proposals = proposals
    return out


def use_overlap(mode: str, chooser: OverlapChooser | None, draft, target) -> bool:
    """Whether this step drafts during the target's: asked for (on, or auto's choice), and
    a draft that can (a lost draft: plain rounds) beside a target that defers."""
    if mode == "off" or draft is None or not draft.overlaps or not draft.available:
        return False
    return chooser.use_overlap() if chooser is not None else True


class Overlap:
    """Drafting during verification as a step uses it, so the step calls it instead of
    branching on it: whether this step overlaps (mode on, or auto's chooser), the draft's
    window started beside the target's forward and settled after, and each step's outcome
    for the chooser."""

    def __init__(self, mode: OverlapMode = "off") -> None:
        if mode not in get_args(OverlapMode):
            raise ValueError(f"overlap must be one of {get_args(OverlapMode)}, got {mode!r}")
        self.mode = mode
        self.chooser = OverlapChooser() if mode == "auto" else None
        # Told when a step's mode differs from the last one's (auto: the caller's thread
        # plan differs between sequential and overlapped steps).
        self.on_mode: Callable[[bool], None] | None = None
        self._last: bool | None = None

    @property
    def chosen(self) -> bool:
        """Whether rounds overlap now, as the policy prices them (on, or auto's choice)."""
        return self.mode == "on" or (self.chooser is not None and bool(self.chooser.choice))

    def for_step(self, draft, target) -> bool:
        """Whether this step drafts during the target's forward."""
        overlapped = use_overlap(self.mode, self.chooser, draft, target)
        if overlapped != self._last and self.on_mode is not None:
            self.on_mode(overlapped)
        self._last = overlapped
        return overlapped

    @staticmethod
    def start(draft, windows: list[ProposeInput]):
        """The draft's window, started now to work while the target verifies (None where
        there is nothing to draft, or the draft could not start: plain draws this step)."""
        if not windows:
            return None
        try:
            return draft.start_window(windows)
        except Exception as exc:  # noqa: BLE001 - a lost draft: plain draws this step
            log.warning("draft window failed to start: %s", exc)
            return None

    @staticmethod
    def abandon(window) -> None:
        """The target's forward failed: the draft must not go on computing into the next
        step."""
        if window is None:
            return
        window.stop()
        try:
            window.result()
        except Exception:  # noqa: BLE001 - the step's failure is what matters
            pass

    @staticmethod
    def close_window(draft, target, window, windows: list[ProposeInput], results: list) -> Settled:
        return close_window(draft, target, window, windows, results)

    def observe(self, overlapped: bool, step_s: float, emitted: int, drafted: bool,
                graph_built: bool) -> None:
        """A finished step, for auto's chooser: only steps that drafted (a sequential step
        the suffix index led counts: it is what sequential steps can do and overlapped ones
        cannot), and not one that built a graph (its time was mostly the build)."""
        if self.chooser is not None and drafted and not graph_built:
            self.chooser.observe(overlapped, step_s, emitted)

