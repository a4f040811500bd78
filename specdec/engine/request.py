"""What a caller hands the engine and what it gets back."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

from specdec.errors import ErrorKind
from specdec.model.step.sampling import SamplingParams
from specdec.spec_decode.counters import SpecCounters
from specdec.spec_decode.speculation import AUTO, Speculation
from specdec.vocabulary import Method

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # What admission chose (the policy's Decision, or the caller's pin): the method, and k
    # for the first round (0 = plain decoding). Each later round's k is Engine._k_for's.
    method: Method = "none"
    k: int = 0
    on_output: Callable[[RequestOutput], None] | None = None
    # What the caller asked of speculation: what it fixed, the policy may not revisit.
    speculation: Speculation = AUTO
    arrival: float = 0.0             # time.monotonic() when the engine took it (set there)
    # Whose it is: the prefix caches and the suffix index reuse only this tenant's tokens
    # for it (None: the deployment's one shared tenant).
    tenant: str | None = None
    # Its grammar's matcher at the start, compiled when the request was checked (off the
    # engine's thread): a sequence starts from a copy of it (specdec/model/step/grammar.py).
    grammar_start: object | None = None

    @classmethod
    def pinned(cls, request_id: str, prompt_ids: list[int], params: SamplingParams,
               method: Method, k: int, **kw) -> Request:
        """A request whose method and k are fixed: every round drafts k with `method`
        (k = 0: plain). What calibration, the benchmarks and the tests run."""
        return cls(request_id, prompt_ids, params, method, k,
                   speculation=Speculation(method=method, k=k), **kw)


@dataclasses.dataclass(kw_only=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    spec: SpecCounters
    error: str | None = None
    k: int = 0                       # the k used for the latest round
    method: Method = "none"
    # Why an errored request failed: TARGET_LOST (the target group went away: retry) or
    # INTERNAL (the step failed unexpectedly: a bug to report).
    error_kind: ErrorKind | None = None
    # Prompt tokens whose K/V came from the prefix cache (OpenAI's usage.prompt_tokens_details
    # .cached_tokens).
    cached_tokens: int = 0
    # Free guesses (the suffix index's, verified on plainly decoded steps): how many were
    # verified and kept; not in `spec`, which is the request's own method's.
    free_guesses: int = 0
    free_accepted: int = 0
    # Where the request asked for them: per token of token_ids and of new_token_ids, the
    # target's log-probability and top alternatives (spec_decode/logprobs.py).
    logprobs: list | None = None
    new_logprobs: list | None = None
    # On the final output: seconds queued before a slot, to the first token, end to end.
    queue_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None

