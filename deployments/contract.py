"""What crosses between the Ingress deployment and an engine replica: typed, both ways.

The ingress validates the OpenAI request, tokenizes it and sends one `GenerateCall`. The
replica answers with a stream: first `Decided` (plain or speculative, and why) or
`Refused` (nothing was started), then `Tokens` chunks, the last with finished=True. A
request that fails after it started ends with a `Tokens` whose error_kind says why. The
ingress turns each ErrorKind into its HTTP status in one table (responses.py).
"""

from __future__ import annotations

import dataclasses

from specdec.errors import ErrorKind
from specdec.model.step.sampling import SamplingParams
from specdec.spec_decode.speculation import Speculation


@dataclasses.dataclass(frozen=True)
class GenerateCall:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculative: Speculation
    stream: bool
    # The request field that asked for params.grammar: an error about it names that field.
    grammar_field: str | None = None
    # Whose request it is (deployments/tenancy.py): the engine's caches reuse only this
    # tenant's tokens for it. None: the deployment's one shared tenant.
    tenant: str | None = None


@dataclasses.dataclass(frozen=True)
class Decided:
    decision: dict  # policy Decision.as_dict(): mode, method, k, reason, why, inputs, ...


@dataclasses.dataclass(frozen=True)
class Refused:
    kind: ErrorKind
    message: str
    param: str | None = None  # the request field at fault (INVALID)


@dataclasses.dataclass
class Tokens:
    text: str                  # new text (stream) or the whole text (one final chunk)
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    k: int                     # the k of the request's latest round
    cached_tokens: int = 0     # prompt tokens served from the prefix cache
    spec: dict | None = None   # speculation counters, on the final chunk
    error: str | None = None
    error_kind: ErrorKind | None = None
    engine_s: float | None = None  # seconds inside the replica, on the final chunk
    # Where asked: per token of token_ids, (log-probability, [(id, log-probability)...]).
    logprobs: list | None = None
