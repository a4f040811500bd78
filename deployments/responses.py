"""The engine's chunks (deployments/contract.py) turned into OpenAI responses: a whole
completion or chat completion, or its server-sent-event stream; usage, our `spec_decode`
report, log-probabilities where asked; failures inside the engine mapped to their HTTP
status in one table. Formatting only: what the request gets was decided by the engine."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable

from fastapi.responses import StreamingResponse

from deployments.contract import Decided, GenerateCall, Refused, Tokens
from deployments.logprobs_format import LogprobFormat
from deployments.openai_api import APIError
from deployments.tool_calls import ToolPlan, ToolStream
from specdec.errors import ErrorKind
from specdec.model.step.sampling import SEED_MAX, SEED_MIN

RETRY_AFTER_S = "2"

# What the client is told for each way a request can fail inside the engine: status, type,
# code, and whether to retry (Retry-After).
_STATUS = {
    ErrorKind.INVALID: (400, "invalid_request_error", None, False),
    ErrorKind.CAPACITY: (503, "overloaded_error", "overloaded", True),
    ErrorKind.TARGET_DOWN: (503, "service_unavailable", "engine_unavailable", True),
    ErrorKind.TARGET_LOST: (503, "service_unavailable", "engine_unavailable", True),
    ErrorKind.INTERNAL: (500, "server_error", "engine_error", False),
}
_PREFIX = {ErrorKind.TARGET_LOST: "the engine lost its target mid-request: ",
           ErrorKind.INTERNAL: "the engine failed on this request's step: "}


def api_error(kind: ErrorKind, message: str, param: str | None = None) -> APIError:
    status, kind_type, code, retry = _STATUS[kind]
    return APIError(status, _PREFIX.get(kind, "") + message, kind_type, param=param, code=code,
                    headers={"Retry-After": RETRY_AFTER_S} if retry else None)


def unavailable(exc: BaseException) -> APIError:
    """The replica died or Serve could not reach one."""
    return APIError(503, f"no engine available: {type(exc).__name__}", "service_unavailable",
                    code="engine_unavailable", headers={"Retry-After": RETRY_AFTER_S})


def choice_calls(call: GenerateCall, n: int) -> list[GenerateCall]:
    """The engine requests of `n` choices: each its own sequence, speculating on its own;
    they share the prompt, whose K/V the prefix cache shares. A seeded request's choice i
    takes seed + i (wrapped into the seed range), so choice i is what the same request
    with that seed alone would give, and the choices differ; greedy choices are alike."""
    out = [call]
    for i in range(1, n):
        seed = call.params.seed
        if seed is not None:
            seed = SEED_MIN + (seed + i - SEED_MIN) % (SEED_MAX - SEED_MIN + 1)
        out.append(dataclasses.replace(call, request_id=f"{call.request_id}-{i}",
                                       params=dataclasses.replace(call.params, seed=seed)))
    return out


def raise_for(chunk: Decided | Refused | Tokens) -> None:
    if isinstance(chunk, Refused):
        raise api_error(chunk.kind, chunk.message, chunk.param)
    if isinstance(chunk, Tokens) and chunk.finish_reason == "error":
        raise api_error(chunk.error_kind or ErrorKind.TARGET_LOST, chunk.error or "")


def usage(finals: list[Tokens | None]) -> dict:
    """The prompt counted once, the completion tokens of every choice (OpenAI's way)."""
    first = finals[0] if finals else None
    p = first.prompt_tokens if first else 0
    c = sum(f.completion_tokens for f in finals if f is not None)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens if first else 0}}


def spec_report(decision: dict, final: Tokens | None) -> dict:
    s = (final.spec if final else None) or {}
    return {"mode": decision["mode"], "method": decision["method"], "k": decision["k"],
            "engine_s": final.engine_s if final else None,
            "k_last_round": final.k if final else None, "reason": decision["reason"],
            "standby": decision.get("standby"),
            "replica": decision.get("replica"),  # the engine replica that served it
            "inputs": decision["inputs"],
            "expected_speedup": round(decision["expected_speedup"], 3),
            **{key: s.get(key) for key in ("rounds", "drafted", "accepted",
                                           "mean_acceptance_length",
                                           "draft_acceptance_ratio", "alpha_estimate",
                                           "per_position_acceptance", "plain_steps",
                                           "free_guesses", "free_accepted")}}


class Replies:
    """One request's response from its engine streams, one per choice (`n`). count(status,
    code): the error metrics' hook, for errors reported inside a stream."""

    def __init__(self, model_name: str, logprobs: LogprobFormat,
                 count: Callable[[int, str | None], None]) -> None:
        self.model_name, self.logprobs, self._count = model_name, logprobs, count

    async def respond(self, req, request_id: str, gens: list, decision: dict, chat: bool,
                      tools: ToolPlan | None = None):
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
                "created": int(time.time()), "model": self.model_name}
        tools = tools if tools is not None and tools.active else None
        if req.stream:
            return self._stream(req, gens, decision, chat, head, tools)
        return await self._whole(gens, decision, chat, head, tools)

    async def _whole(self, gens: list, decision: dict, chat: bool, head: dict,
                     tools: ToolPlan | None) -> dict:
        try:
            got = await asyncio.gather(*(self._collect(g) for g in gens))
        except BaseException:
            for g in gens:  # one choice failed: the others' slots are freed too
                g.cancel()
            raise
        choices = []
        for i, (text, final) in enumerate(got):
            reason = final.finish_reason if final else None
            ids, lps = (final.token_ids, final.logprobs) if final else ([], None)
            if chat:
                message = {"role": "assistant", "content": text}
                content, calls = tools.parse(text) if tools else (text, [])
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    reason = "tool_calls"
                choices.append({"index": i, "message": message,
                                "logprobs": self.logprobs.chat(ids, lps),
                                "finish_reason": reason})
            else:
                choices.append({"index": i, "text": text,
                                "logprobs": self.logprobs.completion(ids, lps),
                                "finish_reason": reason})
        finals = [f for _, f in got]
        return {**head, "object": "chat.completion" if chat else "text_completion",
                "choices": choices, "usage": usage(finals),
                "spec_decode": spec_report(decision, finals[0])}

    def _stream(self, req, gens: list, decision: dict, chat: bool, head: dict,
                tools: ToolPlan | None) -> StreamingResponse:
        obj = "chat.completion.chunk" if chat else "text_completion"
        offset = [0] * len(gens)  # per choice: characters of its text before this chunk
        # Per choice: its text with what may be a tool call held back until the end.
        held = [ToolStream(tools) for _ in gens] if tools and chat else None

        def chunk(i: int, c: Tokens) -> dict:
            if chat:
                text, calls, reason = c.text, [], c.finish_reason
                if held is not None:
                    text = held[i].feed(c.text)
                    if c.finished:
                        rest, calls = held[i].finish()
                        text += rest
                delta: dict = {"content": text} if text else {}
                if calls:
                    delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(calls)]
                    reason = "tool_calls"
                choice = {"index": i, "delta": delta,
                          "logprobs": self.logprobs.chat(c.token_ids, c.logprobs),
                          "finish_reason": reason}
            else:
                lps = self.logprobs.completion(c.token_ids, c.logprobs, offset[i])
                if lps is not None and lps["tokens"]:
                    offset[i] = lps["text_offset"][-1] + len(lps["tokens"][-1])
                choice = {"index": i, "text": c.text, "logprobs": lps,
                          "finish_reason": c.finish_reason}
            return {**head, "object": obj, "choices": [choice]}

        def usage_chunk(finals: list[Tokens]) -> dict:
            return {**head, "object": obj, "choices": [], "usage": usage(finals),
                    "spec_decode": spec_report(decision, finals[0])}

        # Chat streams open with the assistant's role for each choice, as OpenAI's do.
        first = [{**head, "object": obj, "choices": [{
            "index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}]} for i in range(len(gens))] if chat else []
        inc = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(self._sse(gens, chunk, usage_chunk, first, inc),
                                 media_type="text/event-stream")

    @staticmethod
    async def _collect(gen) -> tuple[str, Tokens | None]:
        text, final = [], None
        try:
            async for chunk in gen:
                raise_for(chunk)
                text.append(chunk.text)
                final = chunk
        except APIError:
            raise
        except Exception as exc:  # the replica died or Serve could not reach one
            raise unavailable(exc) from exc
        return "".join(text), final

    async def _sse(self, gens: list, make_chunk, usage_chunk, first_chunks: list,
                   include_usage: bool):
        finals: list[Tokens | None] = [None] * len(gens)
        failed = False
        try:
            for c in first_chunks:
                yield f"data: {json.dumps(c)}\n\n"
            async for i, chunk in _merged(gens):
                try:
                    raise_for(chunk)
                except APIError as exc:
                    failed = True
                    yield f"data: {json.dumps(self._in_band(exc))}\n\n"
                    break
                if chunk.text or chunk.finished or chunk.logprobs:
                    yield f"data: {json.dumps(make_chunk(i, chunk))}\n\n"
                if chunk.finished:
                    finals[i] = chunk
            if include_usage and all(f is not None for f in finals):
                yield f"data: {json.dumps(usage_chunk(finals))}\n\n"
            yield "data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            failed = True
            err = APIError(503, f"no engine available: {type(exc).__name__}",
                           "service_unavailable", code="engine_unavailable")
            yield f"data: {json.dumps(self._in_band(err))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for g, f in zip(gens, finals, strict=True):
                if failed or f is None:  # the client went away, or a choice failed
                    g.cancel()

    def _in_band(self, exc: APIError) -> dict:
        """An error reported inside a stream (the status line is already sent)."""
        self._count(exc.status, exc.code)
        return exc.body()


async def _merged(gens: list):
    """(choice index, chunk) from every choice's stream as chunks arrive."""
    if len(gens) == 1:
        async for c in gens[0]:
            yield 0, c
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen) -> None:
        try:
            async for c in gen:
                await queue.put((i, c))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((i, exc))
        await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, c = await queue.get()
            if c is done:
                left -= 1
            elif isinstance(c, Exception):
                raise c
            else:
                yield i, c
    finally:
        for t in tasks:
            t.cancel()
