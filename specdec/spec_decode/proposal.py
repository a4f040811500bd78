"""What a proposer is asked and what it answers: the contract between the engine, the
proposers (draft model, n-gram lookup, the draft as a Ray actor) and overlapped drafting."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from specdec.model.step.sampling import SamplingParams
from specdec.spec_decode.calls import CallStats

# A tenant named with this prefix is one request's alone (it names nobody): it shares with
# no other request, and nothing is kept for it that no later request could use.
ALONE = "alone:"


@dataclasses.dataclass
class ProposeInput:
    seq_id: str
    context: list[int]   # the whole sequence so far: prompt and output
    k: int
    params: SamplingParams
    # Only catch the draft up on this context (a prompt the target prefills in the same
    # step); its guess is not used. `catchup`: the tokens of it the draft had not seen.
    catchup_only: bool = False
    catchup: int = 0
    # The tenant the request belongs to: the prefix caches and the suffix index reuse only
    # its own tenant's tokens for it (None: a deployment with one tenant, all shared).
    tenant: str | None = None


@dataclasses.dataclass
class Proposal:
    """At most k guesses (maybe none) and the distribution q each was drawn from, as
    (ids, probs) [len, m]: q is zero outside ids. None means one-hot q (greedy, n-gram)."""

    token_ids: list[int]
    q_ids: torch.Tensor | None = None     # [len, m] int
    q_probs: torch.Tensor | None = None   # [len, m] float32, rows sum to 1


class DraftWindow(Protocol):
    """Drafting that runs while the target verifies (see specdec/spec_decode/overlap.py)."""

    def stop(self) -> None: ...

    def result(self) -> list[Proposal]: ...


class Proposer(Protocol):
    """Everything the engine and overlapped drafting ask of a proposer."""

    name: str
    # False while it cannot serve (a draft actor being rebuilt): its rounds then go plain.
    available: bool
    # The last propose call's own compute time and bytes, when it crossed into another
    # process; None when it ran in this one (its wall time is then its compute time).
    last_call: CallStats | None
    # Whether it can draft during the target's step (start_window, see overlap.py).
    overlaps: bool

    def propose(self, inputs: list[ProposeInput]) -> list[Proposal]: ...

    def accepted(self, seq_id: str, valid_len: int) -> None:
        """The first valid_len tokens of the sequence are final (drafts past them are not)."""

    def release(self, seq_id: str) -> None: ...


def draft_held_prefix(proposer, context: list[int], tenant: str | None = None) -> int:
    """Tokens of `context` a proposer's own cache holds for `tenant` (0 for proposers
    without one, or a draft that is down)."""
    held = getattr(proposer, "held_prefix", None)
    if held is None or not getattr(proposer, "available", True):
        return 0
    return held(context, tenant)
