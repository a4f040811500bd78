"""A row's result applied to its sequence: what the rejection sampler kept, counted, cut at
EOS, max_tokens or a stop string, and turned into the request's next output."""

from __future__ import annotations

import time

from specdec.engine.request import RequestOutput
from specdec.engine.state import Seq
from specdec.errors import ErrorKind
from specdec.spec_decode.counters import SpecCounters
from specdec.spec_decode.proposal import Proposer
from specdec.spec_decode.target_runner import TargetResult, TargetRow


def apply_result(seq: Seq, row: TargetRow, res: TargetResult, proposer: Proposer | None,
                 totals: dict[str, SpecCounters], eos_ids: frozenset[int],
                 settled: tuple[int, bool, bool] | None = None, method: str | None = None,
                 head: int = 0) -> tuple[list[int], str | None]:
    """The tokens this row emits and why the request finishes (None: it goes on).
    method: whose guesses the row verified, when not the request's own (free guesses).
    head: how many of its guesses were the suffix index's, the draft's extending them.
    settled (overlap): the deferred token, whether the draft offered a head guess for it,
    and whether that guess was kept; the head counts as the round's last guess."""
    req = seq.req
    # The target's cache now holds the row's pending tokens and its kept guesses.
    seq.cached = row.start + len(row.tokens) - row.num_draft + res.num_accepted
    new = list(res.tokens)
    drafted, kept = row.num_draft, res.num_accepted
    if settled is not None:
        token, offered, accepted = settled
        new.append(token)
        drafted += int(offered)
        kept += int(accepted)
    elif proposer is not None and row.num_draft:
        proposer.accepted(req.request_id, seq.cached)
    own = method is None or method == req.method  # free guesses: their own counters
    if head and settled is None and drafted:
        record_headed_round(seq, totals, min(head, drafted), drafted, kept, len(new))
    else:
        (seq.spec if own else seq.free).record_round(drafted, kept, len(new))
        totals[(method or req.method) if drafted else "none"].record_round(drafted, kept,
                                                                           len(new))
    new, reason = _cut(seq, new, eos_ids)
    if res.logprobs is not None:
        # Only the tokens kept after the cut; a settled overlap token never comes with
        # log-probabilities (rows asking for them are not deferred: planner.py).
        seq.logprobs.extend(res.logprobs[: len(new)])
    if seq.grammar is not None:
        seq.grammar.accept(new)
    seq.tokens.extend(new)
    if new and seq.first_token is None:
        seq.first_token = time.monotonic()
    return new, reason


def record_headed_round(seq: Seq, totals: dict[str, SpecCounters], head: int,
                         drafted: int, kept: int, emitted: int) -> None:
    """A round whose first `head` guesses were the suffix index's and the rest the
    draft's: each proposer's record gets its own guesses, the draft's only where they were
    tested (a rejection among the index's leaves them untried, no evidence either way)."""
    if kept < head or drafted == head:  # (nothing of the draft's verified: the index led)
        seq.free.record_round(head, kept, emitted)
        totals["suffix"].record_round(head, kept, emitted)
        return
    seq.free.record_round(head, head, head)
    totals["suffix"].record_round(head, head, head)
    seq.spec.record_round(drafted - head, kept - head, emitted - head)
    totals[seq.req.method].record_round(drafted - head, kept - head, emitted - head)


def _cut(seq: Seq, new: list[int], eos_ids: frozenset[int]) -> tuple[list[int], str | None]:
    """The kept tokens up to EOS, max_tokens (a round can overshoot it) or a stop string."""
    params = seq.req.params
    reason = None
    eos_at = next((j for j, t in enumerate(new) if (t in eos_ids and not params.ignore_eos)
                   or t in params.stop_token_ids), None)
    if eos_at is not None:
        new, reason = new[: eos_at + 1], "stop"
    remaining = params.max_tokens - seq.generated
    if len(new) > remaining:
        new, reason = new[:remaining], "length"
    elif len(new) == remaining and reason is None:
        reason = "length"
    if seq.detok is not None:
        keep = seq.detok.add(new)
        if keep is not None:
            new, reason = new[:keep], "stop"
    return new, reason


def make_output(seq: Seq, new: list[int], finished: bool, reason: str | None,
                error: str | None = None, kind: ErrorKind | None = None) -> RequestOutput:
    """The request's output after this step, handed to its on_output callback too."""
    text = seq.detok.text if seq.detok else ""
    delta = seq.detok.delta(final=finished) if seq.detok else ""
    out = RequestOutput(request_id=seq.req.request_id, new_token_ids=new, new_text=delta,
                        token_ids=seq.tokens[seq.prompt_len:], text=text, finished=finished,
                        finish_reason=reason, prompt_tokens=seq.prompt_len, spec=seq.spec,
                        error=error, k=seq.k_now, method=seq.req.method, error_kind=kind,
                        cached_tokens=seq.reused, free_guesses=seq.free.drafted,
                        free_accepted=seq.free.accepted)
    if seq.req.params.logprobs is not None:
        out.logprobs = list(seq.logprobs) if finished else None  # the whole, once
        out.new_logprobs = seq.logprobs[len(seq.logprobs) - len(new):] if new else []
    if finished and seq.req.arrival:
        now = time.monotonic()
        out.queue_s = seq.admitted - seq.req.arrival
        out.ttft_s = seq.first_token - seq.req.arrival if seq.first_token else None
        out.e2e_s = now - seq.req.arrival
    if seq.req.on_output is not None:
        seq.req.on_output(out)
    return out
