"""Configuration of the model groups (target, draft), validated by pydantic at start-up."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ActorResources(BaseModel):
    """What one shard actor asks Ray for (one per rank)."""

    model_config = ConfigDict(extra="forbid")
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)

    def bundle(self) -> dict[str, float]:
        b = {"CPU": self.num_cpus, **self.resources}
        if self.num_gpus:
            b["GPU"] = self.num_gpus
        return b


class ModelGroupConfig(BaseModel):
    """One model sharded over `tp` Ray actors."""

    model_config = ConfigDict(extra="forbid")
    model: str
    tp: int = Field(1, ge=1, le=64)
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    resources: ActorResources = Field(default_factory=ActorResources)
    # Threads per rank for CPU matmuls; default = the rank's num_cpus (at least 1).
    threads: int | None = Field(None, ge=1)


class DraftGroupConfig(ModelGroupConfig):
    sampling: Literal["probabilistic", "greedy"] = "probabilistic"
    vocab_limit: int | None = Field(None, ge=1)
    # Stop drafting a row early once the draft's probability of its guess is below this.
    confidence_threshold: float | None = Field(None, ge=0.0, lt=1.0)


class GroupRuntimeConfig(BaseModel):
    """Limits and timeouts shared by the target and draft groups."""

    model_config = ConfigDict(extra="forbid")
    max_slots: int = Field(8, ge=1, le=1024)
    max_len: int = Field(2048, ge=16)
    init_timeout_s: float = Field(300.0, gt=0)      # group start: actors, weights, NCCL/gloo
    step_timeout_s: float = Field(120.0, gt=0)      # one engine step on the group
    collective_timeout_s: float = Field(60.0, gt=0)  # a lost rank fails the step after this
    draft_retry_s: float = Field(5.0, gt=0)          # how often a lost draft is rebuilt
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    gloo_socket_ifname: str | None = None            # e.g. "lo" on a single machine

    @model_validator(mode="after")
    def _check(self) -> GroupRuntimeConfig:
        if self.step_timeout_s < self.collective_timeout_s:
            raise ValueError("step_timeout_s must be >= collective_timeout_s, so a lost rank "
                             "surfaces as a failed collective before the step times out")
        return self
