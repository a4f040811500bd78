"""What one engine is made of, validated by pydantic: the target group, the draft group, the
limits they share, the policy's settings. The same object drives every way an engine is
assembled (in this process, as Ray actor groups under `specdec generate --tp`, in a Serve
replica; see specdec/engine/assemble.py), so the engine a benchmark measures is the one served.

Resources are what a Ray actor reserves; threads are what it computes with. They differ in
one sanctioned case: a draft with no CPUs of its own borrows its target's cores, which is
sound only while the two never compute at the same time (sequential speculation). Anything
else that would make Ray's numbers hide oversubscription is refused here, naming the field.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specdec.engine.state import EngineLimits
from specdec.model.formats.weight_format import DRAFT_ONLY
from specdec.policy.settings import PolicySettings
from specdec.spec_decode.proposers import DEFAULT_Q_TOP_M
from specdec.vocabulary import DraftSampling, OverlapMode, StepMode, WeightFormatName


class ActorResources(BaseModel):
    """What one shard actor reserves from Ray (one per rank)."""

    model_config = ConfigDict(extra="forbid")
    num_cpus: float = Field(1.0, ge=0, description="CPUs each rank's actor reserves from Ray. "
                            "A draft with 0 (and nothing else) borrows its target's cores.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs each rank's actor reserves "
                            "(1 per rank for NCCL).")
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray "
                                        "resources each rank reserves, e.g. {target_gpu: 1} "
                                        "to land on a node type of the cluster config.")

    def bundle(self) -> dict[str, float]:
        b = {"CPU": self.num_cpus, **self.resources}
        if self.num_gpus:
            b["GPU"] = self.num_gpus
        return {k: v for k, v in b.items() if v}

    @property
    def reserves_nothing(self) -> bool:
        return not self.bundle()


class ModelGroupSpec(BaseModel):
    """One model sharded over `tp` ranks (Ray actors, or this process when tp = 1 locally)."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="A pack name (`specdec models list`), a .gguf file, a "
                       "checkpoint directory or a hub id.")
    tp: int = Field(1, ge=1, le=64, description="Tensor-parallel ranks, one Ray actor each "
                    "(gloo on CPU, NCCL on GPU).")
    dtype: WeightFormatName = Field("auto", description=(
        "Weight format. q4k: a GGUF file's Q4_K and Q6_K tensors in their own blocks, "
        "through our int8-activation kernel (built on first use), other tensors as int8 "
        "(batch-invariant; the CPU target default). int8: int8 weights, per-row two-level "
        "int8 activations (batch-invariant). int4: every projection in Q4_K blocks through "
        "the same kernel, rounded from whatever the file stores (the smallest; for drafts). "
        "w8a8: one level. int8-dynamic: one "
        "activation scale per batch (draft only). float16: fp16 packed for FBGEMM. auto: "
        "the fastest of bf16 / fp16 packed measured on this CPU, bf16 on a GPU."))
    resources: ActorResources = Field(default_factory=ActorResources,
                                      description="What each rank's actor reserves from Ray.")
    threads: int | None = Field(None, ge=1, le=1024, description="Threads per rank for CPU "
                                "matmuls; default: the rank's num_cpus (at least 1).")
    step: StepMode = Field("eager", description=(
        "How each decode, verify or draft forward runs. eager: the ragged forward, its "
        "shapes built per step. static: fixed buffers per bucket of rows x query length x "
        "keys, padded rows writing a scratch slot (the form capture needs). compiled: the "
        "static step through torch.compile, one graph per bucket, compiled on first use. "
        "captured (CUDA only): each bucket's static step captured once as a CUDA graph and "
        "replayed, all buckets sharing one memory pool. "
        "A one-rank draft that is not eager runs each round as one loop (its k guesses "
        "picked on the device, one copy to the host; a graph per rows x keys x k), except "
        "while overlapped with the target or for rows with top_k/top_p. "
        "Prefill chunks and batch-invariant formats (int8, w8a8, q4k) always run eager."))

    def threads_per_rank(self) -> int:
        return self.threads or max(1, math.floor(self.resources.num_cpus))


class DraftGroupSpec(ModelGroupSpec):
    """The draft: a model group, and how it proposes."""

    sampling: DraftSampling = Field("probabilistic", description=(
        "probabilistic: sampled rows draw guesses from the draft's top-m distribution under "
        "the request's temperature/top-p; greedy: always the draft's argmax (one-hot q). "
        "Either way the output follows the target's distribution."))
    vocab_limit: int | None = Field(None, ge=1, description="Guess only among the first N "
                                    "token ids: a smaller output projection per draft step.")
    confidence_threshold: float | None = Field(None, ge=0.0, lt=1.0, description=(
        "End a row's proposal once the draft's probability of its latest guess is below "
        "this (k becomes a cap). Exact: the proposal length depends on the draft only."))
    q_top_m: int = Field(DEFAULT_Q_TOP_M, ge=1, le=4096, description=(
        "Sampled rows draw from the draft's m most likely tokens, and exactly that "
        "distribution is the q of the rejection rule: m (id, prob) pairs cross per guess."))


class SuffixSpec(BaseModel):
    """Suffix speculation (specdec/spec_decode/suffix.py): guesses from what this replica
    has seen, the request's own context and every recent prompt and output."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(True, description="Offer the `suffix` method (auto may choose it).")

    @model_validator(mode="before")
    @classmethod
    def _no_scope(cls, data):
        if isinstance(data, dict) and "scope" in data:
            raise ValueError("suffix.scope is gone: the application's `tenancy` now "
                             "partitions the suffix index and both prefix caches alike "
                             "(tenancy: user is what scope: user was)")
        return data
    shared: bool = Field(True, description=(
        "Guess from other requests' prompts and outputs too (per replica; only the same "
        "tenant's where the application has tenants, see `tenancy`); false: only the "
        "request's own context. Either way outputs never change, only speed."))
    min_n: int = Field(2, ge=1, description="Shortest n-gram matched.")
    max_n: int = Field(8, ge=1, le=32, description="Longest n-gram matched.")
    table_bits: int = Field(20, ge=8, le=26, description=(
        "The index holds 2^table_bits n-grams (16 bytes each: 16 MB at 20); newer ones "
        "overwrite older."))
    spec_factor: float = Field(2.0, gt=0, description=(
        "Guesses per matched token: a match of n tokens proposes up to spec_factor * n "
        "(and at most the round's k)."))
    min_count: int = Field(2, ge=1, description=(
        "Times in a row a continuation of a short n-gram (< 4 tokens) must have followed it "
        "before it is guessed."))
    # 12, not 6: a copied file's rounds verify up to 13 tokens for ~1.9 plain steps here
    # (bench repeat: the follow-up 58 tokens/s against 49 at 6; specdec_bench/RESULTS.md).
    plain_rows_k: int = Field(12, ge=0, le=16, description=(
        "Rows decoding plainly (the policy's choice, not a request's `mode: off`) verify up "
        "to this many of the index's guesses where it matches 4+ tokens: free guesses, no "
        "forward to make them; a request whose free guesses mostly fail stops getting "
        "them. A row drafting by the policy's choice takes them instead of the draft's "
        "where the index offers at least its k, and first, the draft extending them, "
        "where it offers fewer. 0: off."))

    @model_validator(mode="after")
    def _check(self) -> SuffixSpec:
        if self.min_n > self.max_n:
            raise ValueError("suffix.min_n must be <= suffix.max_n")
        return self


class RuntimeSpec(BaseModel):
    """Limits and timeouts shared by the target and draft groups."""

    model_config = ConfigDict(extra="forbid")
    max_slots: int = Field(8, ge=1, le=1024, description="Sequences decoded at once (KV "
                           "cache slots); more requests wait, up to max_waiting.")
    max_len: int = Field(2048, ge=16, description="Prompt plus output tokens per sequence "
                         "(the KV cache's length per slot).")
    prefix_cache: bool = Field(True, description=(
        "Keep a finished sequence's K/V in its slot until the slot is needed (least recently "
        "used first) and start each request from the longest prefix of its prompt that a "
        "slot holds (copied from a running sequence's slot where that one holds more): a "
        "conversation's next turn computes only its new tokens, in the target and in the "
        "draft. Exact: greedy output with it is token-identical to output without it."))
    cache_slots: int = Field(0, ge=0, le=4096, description=(
        "KV slots beyond max_slots that only keep finished sequences' prefixes, so that more "
        "conversations stay warm than run at once. Each costs max_len x the KV bytes per "
        "token in the target and in the draft (/health reports the KV cache's size)."))
    init_timeout_s: float = Field(300.0, gt=0, description="A group's start: actors, "
                                  "weights, the gloo/NCCL group.")
    step_timeout_s: float = Field(120.0, gt=0, description="One engine step on a group.")
    collective_timeout_s: float = Field(60.0, gt=0, description="A lost rank fails the "
                                        "step after this long in a collective.")
    draft_retry_s: float = Field(2.0, gt=0, description="How often a lost draft is rebuilt "
                                 "(rounds run plain meanwhile).")
    watchdog_s: float | None = Field(None, gt=0, description=(
        "A replica whose step loop makes no progress this long while it has work fails "
        "its health check (Serve replaces it). Default: step_timeout_s + init_timeout_s "
        "+ 60."))
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement group strategy of a replica's target and draft "
                            "actors.")
    gloo_socket_ifname: str | None = Field(None, description="Network interface for gloo, "
                                           "e.g. lo on a single machine.")

    def kv_slots(self) -> int:
        """KV slots of each model: running sequences, then slots that only keep prefixes."""
        return self.max_slots + self.cache_slots

    def watchdog_limit_s(self) -> float:
        return self.watchdog_s or self.step_timeout_s + self.init_timeout_s + 60.0

    @model_validator(mode="after")
    def _check(self) -> RuntimeSpec:
        if self.step_timeout_s < self.collective_timeout_s:
            raise ValueError("step_timeout_s must be >= collective_timeout_s, so a lost rank "
                             "surfaces as a failed collective before the step times out")
        return self


class EngineSpec(BaseModel):
    """Everything one engine needs, whichever way it is assembled."""

    model_config = ConfigDict(extra="forbid")
    target: ModelGroupSpec = Field(description="The model whose distribution is served.")
    draft: DraftGroupSpec | None = Field(None, description="The draft model; none: only "
                                         "plain decoding and n-gram lookup.")
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec,
                                 description="Limits and timeouts of both groups.")
    ngram_min: int = Field(2, ge=1, description="Shortest suffix the n-gram proposer matches "
                           "in the context.")
    ngram_max: int = Field(5, ge=1, description="Longest suffix the n-gram proposer matches.")
    suffix: SuffixSpec = Field(default_factory=SuffixSpec,
                               description="Suffix speculation across requests.")
    max_tokens_per_step: int = Field(EngineLimits.max_tokens_per_step, ge=16, description=(
        "Token budget of one target forward: decode and verify tokens first, then prefill "
        "chunks of what remains (chunked prefill)."))
    max_waiting: int = Field(EngineLimits.max_waiting, ge=1, description=(
        "Requests queued beyond max_slots; one more is refused with 503 and Retry-After."))
    policy: PolicySettings = Field(default_factory=PolicySettings,
                                   description="The speculation policy.")
    warmup: bool = Field(True, description="Run every path (prefill, plain step, "
                         "speculative round) before reporting ready.")
    overlap: OverlapMode = Field("off", description=(
        "Draft while the target verifies (exact): on, off, or auto (measure both, keep the "
        "faster). Needs a draft with compute of its own."))

    @classmethod
    def from_app_args(cls, args: dict) -> EngineSpec:
        """The engine part of an application's args (serve_config.yaml `args`, whose other
        keys say how Serve runs it)."""
        return cls.model_validate({k: v for k, v in args.items() if k in cls.model_fields})

    @classmethod
    def from_config_file(cls, path: str | Path, app: str | None = None) -> EngineSpec:
        """The EngineSpec of an application in a Serve config file."""
        import yaml

        doc = yaml.safe_load(Path(path).read_text())
        apps = doc.get("applications") or []
        chosen = [a for a in apps if app is None or a.get("name") == app]
        if not chosen:
            raise ValueError(f"{path}: no application{' named ' + repr(app) if app else ''}")
        return cls.from_app_args(chosen[0].get("args") or {})

    def limits(self) -> EngineLimits:
        """What the engine's step loop is held to."""
        return EngineLimits(max_tokens_per_step=self.max_tokens_per_step,
                            max_waiting=self.max_waiting, max_running=self.runtime.max_slots,
                            prefix_cache=self.runtime.prefix_cache)

    @model_validator(mode="after")
    def _check(self) -> EngineSpec:
        if self.ngram_min > self.ngram_max:
            raise ValueError("ngram_min must be <= ngram_max")
        if self.target.dtype in DRAFT_ONLY:
            raise ValueError(
                f"target.dtype {self.target.dtype!r}: {DRAFT_ONLY[self.target.dtype]}; it is "
                "for the draft only (use q4k, int8, float16, bfloat16 or auto here)")
        for role in ("target", "draft"):
            g = getattr(self, role)
            if g is None:
                continue
            own = g.resources.num_cpus
            borrowing = role == "draft" and g.resources.reserves_nothing
            if g.threads and not borrowing and g.threads > max(1.0, math.ceil(own)):
                raise ValueError(
                    f"{role}.threads ({g.threads}) exceeds {role}.resources.num_cpus ({own:g}): "
                    "the actor would compute on cores Ray has given to others; reserve them "
                    "(num_cpus) or lower threads")
        if self.draft is not None and self.draft.resources.reserves_nothing:
            if self.overlap != "off":
                raise ValueError(
                    "overlap: the draft reserves no CPUs of its own (it borrows the target's "
                    "cores while the target waits); drafting while the target computes would "
                    "run both on the same cores. Give draft.resources its own num_cpus (or a "
                    "GPU), or set overlap: off")
            if self.draft.tp != 1:
                raise ValueError(
                    "draft.resources reserves nothing, so the draft borrows the cores of "
                    "target rank 0 and is placed beside it; that needs draft.tp = 1")
        return self
