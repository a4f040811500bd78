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


def _server_with(check_grammar):
    import concurrent.futures

    from deployments.engine_server import EngineServer

    server = EngineServer.__new__(EngineServer)  # the grammar queue, not a replica
    server._grammar_pool = concurrent.futures.ThreadPoolExecutor(1, "grammar")
    server._grammar_jobs = []
    server.built = types.SimpleNamespace(engine=types.SimpleNamespace(
        check_grammar=check_grammar))
    return server


def _call(i):
    from deployments.contract import GenerateCall
    from specdec.model.step.grammar import GrammarSpec
    from specdec.model.step.sampling import SamplingParams
    from specdec.spec_decode.speculation import Speculation

    return GenerateCall(f"r{i}", [1, 2], SamplingParams(grammar=GrammarSpec("regex", f"a{i}")),
                        Speculation(), False, "structured_outputs.regex")


def test_grammars_queue_on_one_thread_bounded_and_timed_by_their_own_compile(monkeypatch):
    """Past GRAMMAR_QUEUE waiting grammars the next is refused (503, retry); a compile
    whose own CPU time runs past GRAMMAR_COMPILE_S is refused naming the field, while the
    wait in the queue before it does not count; a request that goes takes its grammar off
    the queue."""
    import time

    import pytest

    from deployments import engine_server
    from specdec.errors import CapacityError, EngineError

    monkeypatch.setattr(engine_server, "GRAMMAR_COMPILE_S", 0.6)
    compiled = []

    def check(spec, field):
        compiled.append(spec.text)
        if spec.text == "a9":  # a compile that works (CPU) past the bound
            t0 = time.thread_time()
            while time.thread_time() - t0 < 1.0:
                pass
        else:
            time.sleep(0.4)
        return f"start {spec.text}"

    server = _server_with(check)

    async def burst():
        return await asyncio.gather(*(server._check_grammar(_call(i)) for i in range(5)),
                                    return_exceptions=True)

    got = asyncio.run(burst())
    # The first four were let in and each compiled in 0.4 s (the last of them after 1.2 s
    # of waiting: not its compile); the fifth was refused.
    assert got[:4] == [f"start a{i}" for i in range(4)], got
    assert isinstance(got[4], CapacityError)
    with pytest.raises(EngineError, match="more than 1 s to compile") as err:
        asyncio.run(server._check_grammar(_call(9)))
    assert err.value.param == "structured_outputs.regex"

    async def gone():
        server._grammar_jobs.clear()
        first = asyncio.ensure_future(server._check_grammar(_call(10)))
        second = asyncio.ensure_future(server._check_grammar(_call(11)))
        await asyncio.sleep(0.1)
        second.cancel()  # its client went while the first compiled
        await first
        await asyncio.sleep(0.6)

    time.sleep(1.2)  # the slow compile finishes on its thread
    asyncio.run(gone())
    assert "a11" not in compiled and "a10" in compiled
