"""One request must not stall the rest: what the ingress does for a request is bounded
before it costs the shared loop or the engine (deployments/ingress.py)."""

from __future__ import annotations

import asyncio
import types

from deployments.ingress import IngressServer


def test_a_health_flood_asks_the_engine_once():
    """Concurrent /health callers that find the cached state stale share one question."""
    asked = []

    async def load():
        asked.append(1)
        await asyncio.sleep(0.05)
        return {"time": len(asked)}

    ingress = IngressServer.__new__(IngressServer)  # the health cache, not a replica
    ingress._health, ingress._health_asking = None, None
    ingress.engine = types.SimpleNamespace(load=types.SimpleNamespace(remote=load))

    async def flood():
        return await asyncio.gather(*(ingress._engine_load() for _ in range(200)))

    answers = asyncio.run(flood())
    assert len(asked) == 1 and all(a == {"time": 1} for a in answers)
    assert ingress._health_asking is None  # the next stale caller asks again
