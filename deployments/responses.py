"""The engine's chunks (deployments/contract.py) turned into OpenAI responses: a whole
completion or chat completion, or its server-sent-event stream; usage, our `spec_decode`
report, log-probabilities where asked; failures inside the engine mapped to their HTTP
status in one table. Formatting only: what the request gets was decided by the engine."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from fastapi.responses import StreamingResponse

from deployments.contract import Decided, Refused, Tokens
from deployments.logprobs_format import LogprobFormat
from deployments.openai_api import APIError
from specdec.errors import ErrorKind

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


def raise_for(chunk: Decided | Refused | Tokens) -> None:
    if isinstance(chunk, Refused):
        raise api_error(chunk.kind, chunk.message, chunk.param)
    if isinstance(chunk, Tokens) and chunk.finish_reason == "error":
        raise api_error(chunk.error_kind or ErrorKind.TARGET_LOST, chunk.error or "")


def usage(final: Tokens | None) -> dict:
    p, c = (final.prompt_tokens, final.completion_tokens) if final else (0, 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": final.cached_tokens if final else 0}}


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
    """One request's response from its engine stream. count(status, code): the error
    metrics' hook, for errors reported inside a stream."""

    def __init__(self, model_name: str, logprobs: LogprobFormat,
                 count: Callable[[int, str | None], None]) -> None:
        self.model_name, self.logprobs, self._count = model_name, logprobs, count

    async def respond(self, req, request_id: str, gen, decision: dict, chat: bool):
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
                "created": int(time.time()), "model": self.model_name}
        if req.stream:
            return self._stream(req, gen, decision, chat, head)
        return await self._whole(gen, decision, chat, head)

    async def _whole(self, gen, decision: dict, chat: bool, head: dict) -> dict:
        text, final = await self._collect(gen)
        reason = final.finish_reason if final else None
        ids, lps = (final.token_ids, final.logprobs) if final else ([], None)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": self.logprobs.chat(ids, lps), "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text,
                      "logprobs": self.logprobs.completion(ids, lps),
                      "finish_reason": reason}
        return {**head, "object": "chat.completion" if chat else "text_completion",
                "choices": [choice], "usage": usage(final),
                "spec_decode": spec_report(decision, final)}

    def _stream(self, req, gen, decision: dict, chat: bool, head: dict) -> StreamingResponse:
        obj = "chat.completion.chunk" if chat else "text_completion"
        offset = [0]  # characters of the completion's text before this chunk's tokens

        def chunk(c: Tokens, usage_only: bool = False) -> dict:
            body = {**head, "object": obj, "choices": []}
            if usage_only:
                body["usage"] = usage(c)
                body["spec_decode"] = spec_report(decision, c)
            elif chat:
                delta = {"content": c.text} if c.text else {}
                body["choices"] = [{"index": 0, "delta": delta,
                                    "logprobs": self.logprobs.chat(c.token_ids, c.logprobs),
                                    "finish_reason": c.finish_reason}]
            else:
                lps = self.logprobs.completion(c.token_ids, c.logprobs, offset[0])
                if lps is not None and lps["tokens"]:
                    offset[0] = lps["text_offset"][-1] + len(lps["tokens"][-1])
                body["choices"] = [{"index": 0, "text": c.text, "logprobs": lps,
                                    "finish_reason": c.finish_reason}]
            return body

        # Chat streams open with the assistant's role, as OpenAI's do.
        first = {**head, "object": obj, "choices": [{
            "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}]} if chat else None
        inc = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(self._sse(gen, chunk, first, inc),
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

    async def _sse(self, gen, make_chunk, first_chunk, include_usage: bool):
        finished = False
        try:
            if first_chunk is not None:
                yield f"data: {json.dumps(first_chunk)}\n\n"
            final: Tokens | None = None
            async for chunk in gen:
                try:
                    raise_for(chunk)
                except APIError as exc:
                    finished = True
                    yield f"data: {json.dumps(self._in_band(exc))}\n\n"
                    break
                final = chunk
                if chunk.text or chunk.finished or chunk.logprobs:
                    yield f"data: {json.dumps(make_chunk(chunk))}\n\n"
                finished = chunk.finished
            if final is not None and final.finished and include_usage:
                yield f"data: {json.dumps(make_chunk(final, usage_only=True))}\n\n"
            yield "data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            finished = True
            err = APIError(503, f"no engine available: {type(exc).__name__}",
                           "service_unavailable", code="engine_unavailable")
            yield f"data: {json.dumps(self._in_band(err))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away: free the engine's slot
                gen.cancel()

    def _in_band(self, exc: APIError) -> dict:
        """An error reported inside a stream (the status line is already sent)."""
        self._count(exc.status, exc.code)
        return exc.body()
