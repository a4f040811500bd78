"""The application's configuration (serve_config.yaml `args`), validated at deploy time."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.config import DraftGroupConfig, GroupRuntimeConfig, ModelGroupConfig


class PolicySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    k_max: int = Field(6, ge=1, le=16)
    min_expected_tokens: int = Field(12, ge=0)
    min_speedup: float = Field(1.05, ge=1.0)
    draft_cost_ratio: float = Field(0.35, gt=0)
    ngram_cost_ratio: float = Field(0.02, ge=0)
    collapse_rounds: int = Field(4, ge=1)
    collapse_alpha: float = Field(0.25, ge=0, le=1)


class EngineAppConfig(BaseModel):
    """Everything one engine replica needs."""

    model_config = ConfigDict(extra="forbid")
    target: ModelGroupConfig
    draft: DraftGroupConfig | None = None
    runtime: GroupRuntimeConfig = Field(default_factory=GroupRuntimeConfig)
    ngram_min: int = Field(2, ge=1)
    ngram_max: int = Field(5, ge=1)
    max_tokens_per_step: int = Field(512, ge=16)
    max_waiting: int = Field(64, ge=1)
    policy: PolicySettings = Field(default_factory=PolicySettings)

    @model_validator(mode="after")
    def _check(self) -> EngineAppConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError("ngram_min must be <= ngram_max")
        return self


class Autoscaling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(4.0, gt=0)
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        return self


class AppArgs(EngineAppConfig):
    """serve_config.yaml `args` of the application."""

    model_name: str | None = None        # the id served by /v1/models (default: target)
    default_max_tokens: int = Field(256, ge=1)
    engine_autoscaling: Autoscaling = Field(default_factory=Autoscaling)
    replica_cpus: float = Field(0.1, ge=0)   # the engine replica's own bundle
    router_cpus: float = Field(0.1, ge=0)
    router_replicas: int = Field(1, ge=1)
    # Requests in flight per engine replica before Serve queues them. It must exceed the
    # engine's own capacity (slots + waiting) so an overloaded engine answers 503 itself
    # instead of requests piling up unseen; None = 2 x capacity.
    max_ongoing_requests: int | None = Field(None, ge=1)
    router_max_ongoing_requests: int = Field(1024, ge=1)

    def engine_max_ongoing(self) -> int:
        return self.max_ongoing_requests or 2 * (self.runtime.max_slots + self.max_waiting)

    def served_name(self) -> str:
        return self.model_name or self.target.model

    def engine_config(self) -> dict:
        return EngineAppConfig.model_validate(
            self.model_dump(include=set(EngineAppConfig.model_fields))).model_dump()
