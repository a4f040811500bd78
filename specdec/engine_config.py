"""What one engine is made of, validated by pydantic: the target group, the draft group, the
limits they share, the policy's settings. The same object drives every way an engine is
assembled (in this process, as Ray actor groups under `specdec generate --tp`, in a Serve
replica; see specdec/assemble.py), so the engine a benchmark measures is the one served.

Resources are what a Ray actor reserves; threads are what it computes with. They differ in
one sanctioned case: a draft with no CPUs of its own borrows its target's cores, which is
sound only while the two never compute at the same time (sequential speculation). Anything
else that would make Ray's numbers hide oversubscription is refused here, naming the field.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specdec.linear import BATCH_DEPENDENT, FORMATS

WeightFormatName = Literal["auto", "float32", "bfloat16", "float16", "int8", "w8a8",
                           "int8-dynamic"]
assert set(WeightFormatName.__args__) == set(FORMATS)


class ActorResources(BaseModel):
    """What one shard actor reserves from Ray (one per rank)."""

    model_config = ConfigDict(extra="forbid")
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)

    def bundle(self) -> dict[str, float]:
        b = {"CPU": self.num_cpus, **self.resources}
        if self.num_gpus:
            b["GPU"] = self.num_gpus
        return {k: v for k, v in b.items() if v}

    @property
    def reserves_nothing(self) -> bool:
        return not self.bundle()


class ModelGroupConfig(BaseModel):
    """One model sharded over `tp` ranks (Ray actors, or this process when tp = 1 locally)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    tp: int = Field(1, ge=1, le=64)
    # Weight format (specdec/linear.py): "auto" = the fastest on the device it runs on.
    dtype: WeightFormatName = "auto"
    resources: ActorResources = Field(default_factory=ActorResources)
    # OpenMP threads per rank for CPU matmuls; default = the rank's CPUs (at least 1).
    threads: int | None = Field(None, ge=1, le=1024)

    def threads_per_rank(self) -> int:
        return self.threads or max(1, math.floor(self.resources.num_cpus))


class DraftGroupConfig(ModelGroupConfig):
    # "greedy": propose the draft's argmax (one-hot q, only ids cross the wire);
    # "probabilistic": sample from the draft's top-m distribution under the request's warp.
    sampling: Literal["probabilistic", "greedy"] = "probabilistic"
    # Guess only among the first N token ids: a smaller vocabulary projection per step.
    vocab_limit: int | None = Field(None, ge=1)
    # Stop drafting a row early once the draft's probability of its guess is below this.
    confidence_threshold: float | None = Field(None, ge=0.0, lt=1.0)
    # Sampled rows draw from the draft's m most likely tokens (renormalized) and send
    # exactly that distribution as q: m (id, prob) pairs per guess instead of the vocabulary.
    q_top_m: int = Field(64, ge=1, le=4096)


class RuntimeConfig(BaseModel):
    """Limits and timeouts shared by the target and draft groups."""

    model_config = ConfigDict(extra="forbid")
    max_slots: int = Field(8, ge=1, le=1024)
    max_len: int = Field(2048, ge=16)
    init_timeout_s: float = Field(300.0, gt=0)      # group start: actors, weights, NCCL/gloo
    step_timeout_s: float = Field(120.0, gt=0)      # one engine step on the group
    collective_timeout_s: float = Field(60.0, gt=0)  # a lost rank fails the step after this
    draft_retry_s: float = Field(2.0, gt=0)          # how often a lost draft is rebuilt
    # A replica whose loop makes no progress this long while it has work is unhealthy (Serve
    # replaces it). Default: a step that times out plus a target rebuild, and a margin.
    watchdog_s: float | None = Field(None, gt=0)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    gloo_socket_ifname: str | None = None            # e.g. "lo" on a single machine

    def watchdog_limit_s(self) -> float:
        return self.watchdog_s or self.step_timeout_s + self.init_timeout_s + 60.0

    @model_validator(mode="after")
    def _check(self) -> RuntimeConfig:
        if self.step_timeout_s < self.collective_timeout_s:
            raise ValueError("step_timeout_s must be >= collective_timeout_s, so a lost rank "
                             "surfaces as a failed collective before the step times out")
        return self


class PolicySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    k_max: int = Field(6, ge=1, le=16)
    min_expected_tokens: int = Field(12, ge=0)
    min_speedup: float = Field(1.05, ge=1.0)
    draft_cost_ratio: float = Field(0.35, gt=0)
    ngram_cost_ratio: float = Field(0.02, ge=0)
    collapse_rounds: int = Field(4, ge=1)
    collapse_alpha: float = Field(0.25, ge=0, le=1)
    acceptance_half_life: float = Field(2000.0, ge=0)  # in trials; 0 = never forget
    explore_share: float = Field(0.05, ge=0, le=1)     # speculate anyway on this share
    # Re-measure a step shape the batch does not run at most this often (0 = never).
    probe_interval_s: float = Field(20.0, ge=0)


class EngineSpec(BaseModel):
    """Everything one engine needs, whichever way it is assembled."""

    model_config = ConfigDict(extra="forbid")
    target: ModelGroupConfig
    draft: DraftGroupConfig | None = None
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    ngram_min: int = Field(2, ge=1)
    ngram_max: int = Field(5, ge=1)
    max_tokens_per_step: int = Field(512, ge=16)
    max_waiting: int = Field(64, ge=1)
    policy: PolicySettings = Field(default_factory=PolicySettings)
    # Run a short request through every path (prefill, plain step, speculative round)
    # before reporting ready, so the first user request does not pay for it.
    warmup: bool = True
    # Draft while the target verifies (specdec/overlap.py): off, on, or auto (the engine
    # measures both and keeps the faster). Needs a draft with compute of its own.
    overlap: Literal["off", "on", "auto"] = "off"

    @model_validator(mode="after")
    def _check(self) -> EngineSpec:
        if self.ngram_min > self.ngram_max:
            raise ValueError("ngram_min must be <= ngram_max")
        if self.target.dtype in BATCH_DEPENDENT:
            raise ValueError(
                f"target.dtype {self.target.dtype!r}: its rows' results depend on the other "
                "rows of a batch, so greedy speculative output would not stay identical to "
                "plain; it is for the draft only (use int8, float16, bfloat16 or auto here)")
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
