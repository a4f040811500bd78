"""The application's configuration (serve_config.yaml `args`), validated at deploy time.

The engine part is specdec's EngineSpec (the same object `specdec generate --config` and
the benchmarks assemble from); the rest is how Serve runs it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specdec.engine_config import EngineSpec


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


class AppArgs(EngineSpec):
    """serve_config.yaml `args` of the application."""

    model_name: str | None = None        # the id served by /v1/models (default: target)
    default_max_tokens: int = Field(256, ge=1)
    engine_autoscaling: Autoscaling = Field(default_factory=Autoscaling)
    replica_cpus: float = Field(0.0, ge=0)   # the engine replica's own bundle
    router_cpus: float = Field(0.0, ge=0)
    router_replicas: int = Field(1, ge=1)
    # Requests in flight per engine replica before Serve queues them. It must exceed the
    # engine's own capacity (slots + waiting) so an overloaded engine answers 503 itself
    # instead of requests piling up unseen; None = 2 x capacity.
    max_ongoing_requests: int | None = Field(None, ge=1)
    router_max_ongoing_requests: int = Field(1024, ge=1)
    # Required as `Authorization: Bearer` on every /v1 route when set. The SPECDEC_API_KEY
    # environment variable of the router's process takes precedence (keep keys out of files).
    api_key: str | None = Field(None, min_length=8, repr=False)

    def engine_max_ongoing(self) -> int:
        return self.max_ongoing_requests or 2 * (self.runtime.max_slots + self.max_waiting)

    def served_name(self) -> str:
        return self.model_name or self.target.model

    def engine_spec(self) -> EngineSpec:
        return EngineSpec.model_validate(self.model_dump(include=set(EngineSpec.model_fields)))
