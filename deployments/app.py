"""Ray Serve application builder used by serve_config.yaml.

For now the app exposes only a health route; the engine and router deployments plug in here.
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict
from ray import serve

api = FastAPI(title="specdec-serve")


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    target: str = "qwen2.5-coder-1.5b"
    draft: str | None = "qwen2.5-coder-0.5b"


@serve.deployment
@serve.ingress(api)
class Health:
    def __init__(self, args: dict) -> None:
        self.args = AppArgs.model_validate(args)

    @api.get("/health")
    def health(self) -> dict:
        return {"status": "ok", "target": self.args.target, "draft": self.args.draft}


def build_app(args: dict):
    AppArgs.model_validate(args)  # a bad config fails at deploy time, naming the field
    return Health.bind(args)
