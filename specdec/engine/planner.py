"""One step's plan: how many guesses each decoding row gets this round, the proposers'
guesses (one batched call per proposer), and the target's ragged batch: decode rows bring
their pending token and their guesses, prefill rows a chunk of what budget remains.

Under overlap (specdec/spec_decode/overlap.py) a row verifies the guesses the draft made
during the previous step, and the draft goes on from their end during this one (its
`windows`)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

import torch

from specdec.engine.state import EngineLimits, Seq
from specdec.model.step.logits_process import history_of, needs_history
from specdec.spec_decode.counters import SpecCounters
from specdec.spec_decode.proposal import Proposal, ProposeInput, Proposer
from specdec.spec_decode.target_runner import TargetRow

log = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class Drafting:
    """What planning and the proposers' calls took, as the step's record reports it."""
    plan_s: float = 0.0          # choosing what to ask, before any proposer runs
    draft_s: float = 0.0         # all proposers (and a prompt catch-up), wall time
    draft_compute_s: float = 0.0  # the same inside the proposers' processes
    draft_bytes: int = 0         # bytes crossing to and from the draft
    # The draft model's own round: rows it drafted for, the largest k, its time.
    draft_rows: int = 0
    draft_k: int = 0
    draft_model_s: float = 0.0
    # Context a drafted row's draft caught up on first: the most of one row, and summed.
    draft_catchup: int = 0
    draft_catchup_total: int = 0
    # Sequential steps: prompt chunks the draft took in beside the target's prefill.
    prompt_catchup: int = 0
    prompt_catchup_rows: int = 0
    prompt_catchup_s: float = 0.0


@dataclasses.dataclass(kw_only=True)
class Plan:
    rows: list[TargetRow]
    num_draft: dict[str, int]      # guesses verified per decode row
    windows: list[ProposeInput]    # what the draft drafts during the target's step
    free: set[str] = dataclasses.field(default_factory=set)  # rows verifying free guesses
    led: set[str] = dataclasses.field(default_factory=set)  # drafting rows the index led
    # Drafting rows whose first guesses are the index's, the draft's extending them: how
    # many of each row's guesses are the index's.
    heads: dict[str, int] = dataclasses.field(default_factory=dict)
    overlapped: bool = False       # the draft drafts during the target's step
    drafting: Drafting = dataclasses.field(default_factory=Drafting)


@dataclasses.dataclass
class _Asks:
    by_method: dict[str, list[ProposeInput]]
    windows: list[ProposeInput]
    predrafted: dict[str, list[int]]  # overlap: the row's guesses drafted during the last step
    free: list[ProposeInput] = dataclasses.field(default_factory=list)  # plain rows' asks
    lead: list[ProposeInput] = dataclasses.field(default_factory=list)  # drafting rows'


def plan_step(decode: list[Seq], prefill: list[Seq], overlapped: bool,
              proposers: dict[str, Proposer], max_len: int, limits: EngineLimits,
              totals: dict[str, SpecCounters]) -> Plan:
    """The step's rows, with the guesses the proposers made for them (and what that took).
    Each decode row's k_now is already chosen."""
    work = Drafting()
    t_plan = time.perf_counter()
    asks = _asks(decode, overlapped, work, max_len)
    t0 = time.perf_counter()
    work.plan_s = t0 - t_plan
    by_id = {seq.req.request_id: seq for seq in decode}
    led, heads = _suffix_leads(asks, proposers.get("suffix"), by_id)
    _mark_draft_seen(asks.by_method.get("draft", []), by_id, work)
    proposals, failed = _propose(asks.by_method, proposers, work)
    proposals.update(led)
    for rid, head in heads.items():
        proposals[rid] = head_then_draft(head, proposals.get(rid))
    free = _free_guesses(asks.free, proposers.get("suffix"), proposals) | set(led)
    work.draft_s = time.perf_counter() - t0
    rows, num_draft = _decode_rows(decode, asks.predrafted, proposals, failed, totals)
    rows += _prefill_rows(prefill, limits, sum(len(r.tokens) for r in rows))
    draft = proposers.get("draft")
    if overlapped:  # hidden: the draft prefills on its own compute beside the target
        asks.windows += _prefill_catchups(prefill, rows, True)
    elif draft is not None and draft.available:
        catchups = _prefill_catchups(prefill, rows, False)
        if catchups and not _catch_up(draft, catchups, work):
            # Not caught up after all: the first round catches up (and is priced so).
            by_id = {seq.req.request_id: seq for seq in prefill}
            for i in catchups:
                by_id[i.seq_id].draft_seen = len(i.context) - i.catchup
    return Plan(rows=rows, num_draft=num_draft, windows=asks.windows, free=free, led=set(led),
                heads={rid: len(h) for rid, h in heads.items()}, overlapped=overlapped,
                drafting=work)


def attach_histories(rows: list[TargetRow], running: dict[str, Seq], eos_ids) -> None:
    """Rows whose requests use history-dependent sampling controls (penalties, logit_bias,
    min_tokens) carry what their processing reads (model/logits_process.py), rows under a
    grammar their masks (model/grammar.py); the others carry nothing, and their steps cost
    what they did."""
    for row in rows:
        seq = running.get(row.seq_id)
        if not row.sample or seq is None:
            continue
        if needs_history(seq.req.params):
            row.history = history_of(seq.tokens, seq.prompt_len, seq.req.params, eos_ids)
        if seq.grammar is not None and row.masks is None:  # a prompt's last chunk
            row.masks = seq.grammar.guesses_and_masks([])[1]


def _free_guesses(asks: list[ProposeInput], suffix, proposals: dict[str, Proposal]
                  ) -> set[str]:
    """The suffix index's confident guesses for rows decoding plainly this step (a
    lookup, no forward: verifying them costs the target a few tokens of its step)."""
    if not asks or suffix is None:
        return set()
    try:
        got = suffix.propose_confident(asks)
    except Exception:  # guesses are an optimization: never a request's failure
        log.exception("suffix guesses failed; decoding plainly this round")
        return set()
    free = set()
    for i, p in zip(asks, got, strict=True):
        if p.token_ids:
            proposals[i.seq_id] = p
            free.add(i.seq_id)
    return free


def _suffix_leads(asks: _Asks, suffix, by_id: dict[str, Seq]
                  ) -> tuple[dict[str, Proposal], dict[str, list[int]]]:
    """Drafting rows for which the suffix index offers confident guesses. At least the
    row's k: the row verifies those this round (free guesses, counted apart from the
    draft's rounds) and the draft is not asked. Fewer: they are the round's first guesses
    and the draft extends them from their end (its k less theirs), so each costs no draft
    forward (the draft takes them in with its first). Returns (led rows' proposals, the
    heads the draft extends)."""
    if not asks.lead or suffix is None:
        return {}, {}
    try:
        got = suffix.propose_confident(asks.lead)
    except Exception:  # guesses are an optimization: never a request's failure
        log.exception("suffix guesses failed; drafting as planned")
        return {}, {}
    led, heads = {}, {}
    for i, p in zip(asks.lead, got, strict=True):
        seq = by_id[i.seq_id]
        if len(p.token_ids) >= seq.k_now:
            led[i.seq_id] = p
            seq.k_now = 0  # this round: the index's guesses, up to k_free of them
        elif p.token_ids and _head_pays(seq):
            heads[i.seq_id] = list(p.token_ids)
    if led or heads:
        drafting = []
        for i in asks.by_method["draft"]:
            head = heads.get(i.seq_id)
            if i.seq_id in led:
                continue
            if head:
                i = dataclasses.replace(i, context=i.context + head, k=i.k - len(head))
            drafting.append(i)
        asks.by_method["draft"] = drafting
    return led, heads


def _head_pays(seq: Seq) -> bool:
    """Whether the index's guesses may take the first places of this row's draft round: an
    index guess costs no forward where a draft guess costs c of a target step, so it pays
    where it is kept at least as often as the draft's (each proposer's own record for this
    request, once both have been tried 8 times; until then it is tried). For a sampled row
    a one-hot guess is kept with probability p(x), a draft's with the overlap of p and q:
    the records tell which is the higher here."""
    free, own = seq.free, seq.spec
    if free.accepted + free.rejections < 8 or own.accepted + own.rejections < 8:
        return True
    return free.alpha_estimate >= own.alpha_estimate


def head_then_draft(head: list[int], drafted: Proposal | None) -> Proposal:
    """The index's guesses, then the draft's drawn after them: q one-hot at each of the
    index's (a deterministic guess), the draft's own q after. A draft that failed or gave
    nothing leaves the index's guesses alone."""
    if drafted is None or not drafted.token_ids:
        return Proposal(list(head))
    ids = list(head) + list(drafted.token_ids)
    if drafted.q_probs is None:
        return Proposal(ids)
    n, width = len(drafted.token_ids), drafted.q_ids.shape[-1]
    q_ids = drafted.q_ids.new_zeros(len(head), width)
    q_ids[:, 0] = q_ids.new_tensor(head)
    q_probs = drafted.q_probs.new_zeros(len(head), width)
    q_probs[:, 0] = 1.0
    return Proposal(ids, torch.cat([q_ids, drafted.q_ids[:n]]),
                    torch.cat([q_probs, drafted.q_probs[:n]]))


def _mark_draft_seen(drafting: list[ProposeInput], by_id: dict[str, Seq],
                     work: Drafting) -> None:
    """The rows the draft drafts for this step: what it catches up on first (priced by the
    policy as a catch-up, not a round's cost), and where it will have caught up to."""
    for i in drafting:
        seq = by_id[i.seq_id]
        work.draft_catchup = max(work.draft_catchup, len(seq.tokens) - seq.draft_seen)
        work.draft_catchup_total += len(seq.tokens) - seq.draft_seen
        seq.draft_seen = len(seq.tokens)


def _asks(decode: list[Seq], overlapped: bool, work: Drafting, max_len: int) -> _Asks:
    """What each proposer is asked this step, and what the draft drafts meanwhile."""
    out = _Asks(collections.defaultdict(list), [], {})
    for seq in decode:
        rid, method = seq.req.request_id, seq.req.method
        # A row asking for log-probabilities drafts before the step instead: a deferred
        # position's token is settled after the forward, without its logits.
        ahead_of_step = overlapped and method == "draft" and bool(seq.k_now) \
            and seq.req.params.logprobs is None and seq.grammar is None
        if ahead_of_step:
            work.draft_catchup = max(work.draft_catchup, len(seq.tokens) - seq.draft_seen)
            seq.draft_seen = len(seq.tokens)
        if ahead_of_step:
            # This step verifies the guesses drafted during the last one; the draft goes on
            # from their end, as if they will all be kept.
            predrafted = seq.predrafted.token_ids[: seq.k_now] if seq.predrafted else []
            context = seq.tokens + predrafted
            # The draft's cache holds context + (guesses - 1) positions: stay in it.
            window_k = min(seq.k_now, max_len - len(context) + 1)
            if window_k > 0:
                out.predrafted[rid] = predrafted
                out.windows.append(ProposeInput(rid, context, window_k, seq.req.params,
                                                tenant=seq.req.tenant))
                continue
        seq.predrafted = None
        if seq.k_now:
            out.by_method[method].append(ProposeInput(rid, seq.tokens, seq.k_now,
                                                      seq.req.params, tenant=seq.req.tenant))
            if seq.k_free:  # the suffix index may lead this round (Engine._suffix_may_lead)
                out.lead.append(ProposeInput(rid, seq.tokens, seq.k_free, seq.req.params,
                                             tenant=seq.req.tenant))
        elif seq.k_free:
            out.free.append(ProposeInput(rid, seq.tokens, seq.k_free, seq.req.params,
                                         tenant=seq.req.tenant))
    return out


def _propose(asks: dict[str, list[ProposeInput]], proposers: dict[str, Proposer],
             work: Drafting) -> tuple[dict[str, Proposal], set[str]]:
    """Each proposer's guesses, one batched call each; the methods that failed outright."""
    proposals: dict[str, Proposal] = {}
    failed: set[str] = set()
    for method, inputs in asks.items():
        t = time.perf_counter()
        proposer = proposers[method]
        try:
            got = proposer.propose(inputs)
        except Exception:  # a failed proposer costs speed, never a request
            log.exception("proposer %s failed; decoding plainly this round", method)
            got = []
            failed.add(method)
        proposals.update({i.seq_id: p for i, p in zip(inputs, got, strict=False)})
        spent = time.perf_counter() - t
        call = proposer.last_call
        work.draft_compute_s += call.compute_s if call else spent
        work.draft_bytes += call.bytes if call else 0
        if method == "draft" and got:
            work.draft_rows, work.draft_k = len(inputs), max(i.k for i in inputs)
            work.draft_model_s = spent
    return proposals, failed


def _draft_q(prop: Proposal | None, n: int):
    """The first n guesses' q, or None (one-hot: greedy drafts, n-gram, no guesses)."""
    if prop is None or prop.q_probs is None or not n:
        return None
    return prop.q_ids[:n], prop.q_probs[:n]


def _decode_rows(decode: list[Seq], predrafted: dict[str, list[int]],
                 proposals: dict[str, Proposal], failed: set[str],
                 totals: dict[str, SpecCounters]) -> tuple[list[TargetRow], dict[str, int]]:
    rows: list[TargetRow] = []
    num_draft: dict[str, int] = {}
    for seq in decode:
        rid = seq.req.request_id
        pending = seq.tokens[seq.cached:]
        if rid in predrafted:  # overlap: verify last step's guesses, defer the last position
            guesses = predrafted[rid]
            num_draft[rid] = len(guesses)
            rows.append(TargetRow(rid, seq.slot, seq.cached, pending + guesses, len(guesses),
                                  _draft_q(seq.predrafted, len(guesses)), True, defer_last=True))
            continue
        prop = proposals.get(rid)
        guesses = prop.token_ids[: seq.k_now or seq.k_free] if prop else []
        masks = None
        if seq.grammar is not None:
            # Verified up to the first guess the grammar refuses (rejected there, its residual
            # drawn: see GrammarState.guesses_and_masks); the guesses after it are dropped.
            n, masks = seq.grammar.guesses_and_masks(guesses)
            guesses = guesses[:n]
        num_draft[rid] = len(guesses)
        if seq.k_now and not guesses and seq.req.method not in failed:
            # Asked for guesses, got none (no n-gram match): for the policy this
            # opportunity failed like a rejection at the first position. A proposer that
            # failed outright is an outage, not evidence about its guesses.
            seq.spec.empty_proposals += 1
            totals[seq.req.method].empty_proposals += 1
        rows.append(TargetRow(rid, seq.slot, seq.cached, pending + guesses, len(guesses),
                              _draft_q(prop, len(guesses)), True, masks=masks))
    return rows, num_draft


def _prefill_rows(prefill: list[Seq], limits: EngineLimits, used: int) -> list[TargetRow]:
    """Chunks of the prompts still being prefilled, in what the token budget leaves (at
    least min_prefill_chunk, so a prefill advances even under a full decode batch)."""
    budget = max(limits.max_tokens_per_step - used, limits.min_prefill_chunk)
    rows = []
    for seq in prefill:
        if budget <= 0:
            break
        chunk = seq.tokens[seq.cached: min(seq.prompt_len, seq.cached + budget)]
        budget -= len(chunk)
        done = seq.cached + len(chunk) == seq.prompt_len
        rows.append(TargetRow(seq.req.request_id, seq.slot, seq.cached, chunk, 0, None, done))
        if done:
            seq.k_now = 0
    return rows


def _prefill_catchups(prefill: list[Seq], rows: list[TargetRow], overlapped: bool
                      ) -> list[ProposeInput]:
    """The draft takes in each prompt chunk the step prefills, up to that chunk's end (the
    prompt is known: the draft need not wait for the target), so that a row's first round
    finds nothing to catch up on and its reply never stalls while the draft prefills.

    Overlapped, every row that may draft gets it: the draft works on its own compute
    beside the target. Sequential, only a row that will draft from its first round (mode
    `on`, or `auto` admitted to speculate with the draft): its catch-up is a cost it pays
    anyway, moved before its first token; a row on standby or decoding plainly may never
    draft, and must not pay the draft's prefill (the policy prices that)."""
    ends = {r.seq_id: r.start + len(r.tokens) for r in rows}
    out = []
    for seq in prefill:
        end = ends.get(seq.req.request_id, 0)
        if seq.req.method != "draft" or end <= seq.draft_seen:
            continue
        if not overlapped and not (seq.req.speculation.on or seq.req.k > 0):
            continue
        out.append(ProposeInput(seq.req.request_id, seq.tokens[:end], 1, seq.req.params,
                                catchup_only=True, catchup=end - seq.draft_seen,
                                tenant=seq.req.tenant))
        seq.draft_seen = end
    return out


def _catch_up(draft: Proposer, catchups: list[ProposeInput], work: Drafting) -> bool:
    """Sequential steps: the draft prefills the prompt chunks before the target's step, in
    one batched call whose one guess per row is dropped. Timed apart from the decode rows'
    draft call (prompt_catchup_s, not draft_model_s): the policy learns a catch-up's
    per-token cost from it, and a round's cost from the round alone. A failed or lost
    draft costs the row nothing but a catch-up at its first round."""
    t = time.perf_counter()
    try:
        draft.propose(catchups)
    except Exception:  # an optimization: never a request's failure
        log.exception("draft catch-up on prompts failed; they catch up at their first round")
        return False
    spent = time.perf_counter() - t
    call = draft.last_call
    work.draft_compute_s += call.compute_s if call else spent
    work.draft_bytes += call.bytes if call else 0
    work.draft_s += spent
    work.prompt_catchup_s = spent
    work.prompt_catchup = sum(i.catchup for i in catchups)
    work.prompt_catchup_rows = len(catchups)
    return True
