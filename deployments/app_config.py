"""The application's configuration (serve_config.yaml `args`), validated at deploy time.

The engine part is specdec's EngineSpec (the same object `specdec generate --config` and
the benchmarks assemble from), held as `engine`; the rest is how Serve runs it. The YAML
keeps one flat `args:` mapping: the EngineSpec's keys are gathered into `engine` before
validation, so an error still names the key as written (`target.tp`, not `engine.target.tp`,
see deployments/app.py)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from deployments.tenancy import Tenancy
from specdec.engine.spec import EngineSpec


class Autoscaling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min_replicas: int = Field(1, ge=0, description="Fewest engine replicas.")
    max_replicas: int = Field(1, ge=1, description="Most engine replicas (each one target "
                              "group and one draft).")
    target_ongoing_requests: float = Field(4.0, gt=0, description="Requests in flight per "
                                           "replica that Serve's autoscaler aims for.")
    upscale_delay_s: float = Field(5.0, ge=0, description="Load must stay high this long "
                                   "before a replica is added.")
    downscale_delay_s: float = Field(60.0, ge=0, description="Load must stay low this long "
                                     "before a replica is removed.")

    @model_validator(mode="after")
    def _check(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        return self


class AppArgs(BaseModel):
    """serve_config.yaml `args` of the application."""

    model_config = ConfigDict(extra="forbid")
    engine: EngineSpec = Field(description="The engine: every key of EngineSpec, written "
                               "flat beside the ones below.")

    model_name: str | None = Field(None, description="The model id /v1/models lists and "
                                   "requests name; default: target.model.")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens of a request that "
                                    "sets none.")
    engine_autoscaling: Autoscaling = Field(default_factory=Autoscaling,
                                            description="Serve autoscaling of the engine.")
    engine_routing: Literal["prefix_affinity", "least_loaded"] = Field(
        "prefix_affinity", description=(
            "How requests are spread over engine replicas. prefix_affinity: to the replica "
            "that was sent the longest prefix of the prompt (a conversation's earlier "
            "turns), unless it is busier than the least loaded one by more than 4 queued "
            "requests; else, and with least_loaded always, Serve's power of two choices "
            "(deployments/prefix_router.py)."))
    replica_cpus: float = Field(0.0, ge=0, description="CPUs the engine replica itself "
                                "reserves (its loop; the models are in their own actors).")
    ingress_cpus: float = Field(0.0, ge=0, validation_alias=AliasChoices(
        "ingress_cpus", "router_cpus"), description="CPUs each HTTP ingress replica "
                                                    "reserves (router_cpus: its old name).")
    ingress_replicas: int = Field(1, ge=1, validation_alias=AliasChoices(
        "ingress_replicas", "router_replicas"), description="HTTP ingress replicas "
                                                            "(router_replicas: its old name).")
    # It must exceed the engine's own capacity (slots + waiting) so an overloaded engine
    # answers 503 itself instead of requests piling up unseen in Serve's queue.
    max_ongoing_requests: int | None = Field(None, ge=1, description=(
        "Requests in flight per engine replica before Serve queues them; default: "
        "2 x (runtime.max_slots + max_waiting)."))
    ingress_max_ongoing_requests: int = Field(1024, ge=1, validation_alias=AliasChoices(
        "ingress_max_ongoing_requests", "router_max_ongoing_requests"), description=(
            "Requests in flight per ingress replica (router_max_ongoing_requests: its old "
            "name)."))
    drain_timeout_s: float = Field(60.0, gt=0, description=(
        "How long an engine replica being stopped (an app deleted or redeployed, a "
        "downscale, `specdec serve` stopped) keeps generating for the requests it holds "
        "before they end with an error; new requests go elsewhere meanwhile."))
    api_key: str | None = Field(None, min_length=8, repr=False, description=(
        "Required as `Authorization: Bearer KEY` on every route but a minimal /health; its "
        "tenant is `default`. The SPECDEC_API_KEY environment variable takes precedence "
        "(keep keys out of files)."))
    api_keys: dict[str, str] = Field(default_factory=dict, repr=False, description=(
        "Tenant name -> its key (each at least 8 characters): any of them is taken, and "
        "with tenancy `api_key` (the default when keys are set) a request's caches are its "
        "key's tenant's alone. SPECDEC_API_KEYS (`name=key,name=key` or a JSON object) "
        "takes precedence."))
    tenancy: Tenancy = Field("auto", description=(
        "Whose prompts and replies a request may reuse (prefix caches) and be guessed from "
        "(the suffix index); both show in a response's `cached_tokens` and speculation "
        "counters. api_key: the key's tenant; header: the value of `tenant_header`, set by "
        "a trusted gateway (required on every request); user: the OpenAI `user` field "
        "(only behind a gateway that sets it; a request without one shares with nobody); "
        "shared: everyone (one tenant). auto: api_key when keys are configured, else "
        "shared (deployments/tenancy.py, docs/deploying.md \"Security\")."))
    tenant_header: str = Field("x-tenant-id", min_length=1, pattern=r"^[A-Za-z0-9-]+$",
                               description="The header naming the tenant (tenancy: header).")

    @model_validator(mode="after")
    def _keys_for_tenancy(self):
        if self.tenancy == "api_key" and not (self.api_key or self.api_keys) and \
                not os.environ.get("SPECDEC_API_KEY") and not os.environ.get("SPECDEC_API_KEYS"):
            raise ValueError("tenancy: api_key needs API keys (api_key, api_keys, or "
                             "SPECDEC_API_KEY / SPECDEC_API_KEYS in the environment)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _gather_engine(cls, data):
        if isinstance(data, dict) and "engine" not in data:
            engine = {k: v for k, v in data.items() if k in EngineSpec.model_fields}
            return {**{k: v for k, v in data.items() if k not in engine}, "engine": engine}
        return data

    def keys(self, environ=os.environ):
        """The API keys this application takes (environment first), by tenant."""
        from deployments.api_key import ApiKeys, api_key_from, api_keys_from
        return ApiKeys(api_key_from(environ, self.api_key), api_keys_from(environ,
                                                                            self.api_keys))

    def engine_max_ongoing(self) -> int:
        e = self.engine
        return self.max_ongoing_requests or 2 * (e.runtime.max_slots + e.max_waiting)

    def served_name(self) -> str:
        return self.model_name or self.engine.target.model
