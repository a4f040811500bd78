"""The `Router` deployment: HTTP ingress (OpenAI-compatible), request validation and
tokenization, and the hand-off to an engine replica with what the request says about
speculation. The replica that runs a request decides plain or speculative and k from its
own load (specdec/engine_policy.py); its decision comes back with the first chunk and is
reported in `spec_decode` and the router's decision metrics. No maths here."""


import asyncio
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve

from deployments.app_config import AppArgs
from deployments.metrics import RouterMetrics
from deployments.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_response,
    validation_message,
)
from specdec.generate import load_tokenizer
from specdec.hub import resolve

log = logging.getLogger("ray.serve")
api = FastAPI(title="specdec-serve", version="0.1.0")


@api.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


@api.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error")
    return error_response(500, "internal error; see the server log", "server_error")


class RouterServer:
    def __init__(self, engine, args: dict) -> None:
        self.args = AppArgs.model_validate(args)
        self.engine = engine
        self.model_name = self.args.served_name()
        self.tokenizer = load_tokenizer(resolve(self.args.target.model))
        self.max_len = self.args.runtime.max_len
        self.metrics = RouterMetrics()

    # ---- request handling -----------------------------------------------------------------

    async def _parse(self, request: Request, schema):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            req = schema.model_validate(body)
        except ValidationError as exc:
            msg, param = validation_message(exc.errors())
            raise APIError(400, msg, param=param) from exc
        if req.model not in (self.model_name, self.args.target.model):
            raise APIError(404, f"model {req.model!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")
        return req

    def _prepare(self, req, prompt_ids: list[int], prompt_param: str) -> dict:
        if not prompt_ids:
            raise APIError(400, f"{prompt_param} is empty after tokenization", param=prompt_param)
        max_tokens = req.max_new_tokens(self.args.default_max_tokens)
        if len(prompt_ids) >= self.max_len:
            raise APIError(400, f"{prompt_param} has {len(prompt_ids)} tokens; the context limit "
                                f"is {self.max_len}", param=prompt_param,
                           code="context_length_exceeded")
        if len(prompt_ids) + max_tokens > self.max_len:
            explicit = req.max_tokens or req.max_completion_tokens
            if explicit:
                raise APIError(400, f"max_tokens ({max_tokens}) + prompt ({len(prompt_ids)} "
                                    f"tokens) exceeds the context limit of {self.max_len}",
                               param="max_tokens", code="context_length_exceeded")
            max_tokens = self.max_len - len(prompt_ids)  # default shrinks to what fits
        spec = req.speculative
        return {
            "request_id": uuid.uuid4().hex, "prompt_ids": prompt_ids,
            "params": {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                       "seed": req.seed, "max_tokens": max_tokens, "stop": tuple(req.stop or ()),
                       "ignore_eos": req.ignore_eos},
            "speculative": {"mode": spec.mode, "method": spec.method, "k": spec.k},
            "stream": bool(req.stream),
        }

    @staticmethod
    def _spec_report(decision: dict, final: dict) -> dict:
        s = final.get("spec") or {}
        return {"mode": decision["mode"], "method": decision["method"], "k": decision["k"],
                "engine_s": final.get("engine_s"),
                "k_last_round": final.get("k"), "reason": decision["reason"],
                "inputs": decision["inputs"],
                "expected_speedup": round(decision["expected_speedup"], 3),
                **{key: s.get(key) for key in ("rounds", "drafted", "accepted",
                                               "mean_acceptance_length",
                                               "draft_acceptance_ratio", "alpha_estimate",
                                               "per_position_acceptance", "plain_steps")}}

    async def _respond(self, req, payload: dict, chat: bool):
        """The OpenAI response for completions or chat, streamed (SSE) or whole. The
        engine's first answer (its decision, or a refusal) comes before any header, so a
        refused request gets its status code even when it asked for a stream."""
        gen, decision = await self._open(payload)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{payload['request_id']}",
                "created": int(time.time()), "model": self.model_name}
        if req.stream:
            obj = "chat.completion.chunk" if chat else "text_completion"

            def chunk(c, usage_only=False):
                body = {**head, "object": obj, "choices": []}
                if usage_only:
                    body["usage"] = _usage(c)
                    body["spec_decode"] = self._spec_report(decision, c)
                elif chat:
                    delta = {"content": c["text"]} if c.get("text") else {}
                    body["choices"] = [{"index": 0, "delta": delta,
                                        "finish_reason": c.get("finish_reason")}]
                else:
                    body["choices"] = [{"index": 0, "text": c.get("text", ""), "logprobs": None,
                                        "finish_reason": c.get("finish_reason")}]
                return body

            # Chat streams open with the assistant's role, as OpenAI's do.
            first = {**head, "object": obj, "choices": [{
                "index": 0, "delta": {"role": "assistant", "content": ""},
                "finish_reason": None}]} if chat else None
            inc = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._sse(gen, chunk, first, inc),
                                     media_type="text/event-stream")
        text, final = await self._collect(gen)
        reason = final.get("finish_reason")
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": reason} if chat else \
            {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {**head, "object": "chat.completion" if chat else "text_completion",
                "choices": [choice], "usage": _usage(final),
                "spec_decode": self._spec_report(decision, final)}

    async def _open(self, payload: dict):
        """Start the request on an engine replica and read its decision (or refusal)."""
        gen = self.engine.options(stream=True).generate.remote(payload)
        try:
            first = await gen.__anext__()
        except Exception as exc:  # the replica died or Serve could not reach one
            gen.cancel()
            raise APIError(503, f"no engine available: {type(exc).__name__}",
                           "service_unavailable", code="engine_unavailable") from exc
        try:
            self._raise_for(first)
        except APIError:
            gen.cancel()
            raise
        self.metrics.decided(first["decision"])
        return gen, first["decision"]

    @staticmethod
    def _raise_for(chunk: dict) -> None:
        if chunk.get("error_kind") == "capacity":
            raise APIError(503, chunk["error"], "overloaded_error", code="overloaded")
        if chunk.get("error_kind") == "invalid":
            raise APIError(400, chunk["error"], param=chunk.get("param"))
        if chunk.get("finish_reason") == "error":
            raise APIError(503, f"the engine lost its target mid-request: {chunk['error']}",
                           "service_unavailable", code="engine_unavailable")

    async def _collect(self, gen) -> tuple[str, dict]:
        text, final = [], {}
        try:
            async for chunk in gen:
                self._raise_for(chunk)
                text.append(chunk.get("text", ""))
                final = chunk
        except APIError:
            raise
        except Exception as exc:  # the replica died or Serve could not reach one
            raise APIError(503, f"no engine available: {type(exc).__name__}",
                           "service_unavailable", code="engine_unavailable") from exc
        return "".join(text), final

    async def _sse(self, gen, make_chunk, first_chunk, include_usage: bool):
        finished = False
        try:
            if first_chunk is not None:
                yield f"data: {json.dumps(first_chunk)}\n\n"
            final: dict = {}
            async for chunk in gen:
                try:
                    self._raise_for(chunk)
                except APIError as exc:
                    finished = True
                    yield f"data: {json.dumps(_err(exc))}\n\n"
                    break
                final = chunk
                if chunk.get("text") or chunk.get("finished"):
                    yield f"data: {json.dumps(make_chunk(chunk))}\n\n"
                finished = chunk.get("finished", False)
            if final.get("finished") and include_usage:
                yield f"data: {json.dumps(make_chunk(final, usage_only=True))}\n\n"
            yield "data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            finished = True
            err = APIError(503, f"no engine available: {type(exc).__name__}",
                           "service_unavailable", code="engine_unavailable")
            yield f"data: {json.dumps(_err(err))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away: free the engine's slot
                gen.cancel()


def _err(exc: APIError) -> dict:
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param,
                      "code": exc.code}}


def _usage(final: dict) -> dict:
    p, c = final.get("prompt_tokens", 0), final.get("completion_tokens", 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


@serve.deployment(name="Router")
@serve.ingress(api)
class Router(RouterServer):
    @api.get("/health")
    async def health(self) -> dict:
        try:
            load = await asyncio.wait_for(self.engine.load.remote(), timeout=5)
        except Exception as exc:  # noqa: BLE001
            raise APIError(503, f"engine unavailable: {type(exc).__name__}",
                           "service_unavailable") from exc
        return {"status": "ok", "model": self.model_name, "engine": load}

    @api.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "specdec-serve",
            "max_model_len": self.max_len}]}

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        req = await self._parse(request, CompletionRequest)
        if isinstance(req.prompt, str):
            ids = self.tokenizer(req.prompt).input_ids
        else:
            ids = list(req.prompt)
            bad = [t for t in ids if not 0 <= t < len(self.tokenizer)]
            if bad:
                raise APIError(400, f"prompt holds token ids outside the vocabulary: {bad[:5]}",
                               param="prompt")
        return await self._respond(req, self._prepare(req, ids, "prompt"), chat=False)

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request):
        req = await self._parse(request, ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
        except Exception as exc:  # noqa: BLE001 - a template that rejects the conversation
            raise APIError(400, f"messages could not be formatted: {exc}",
                           param="messages") from exc
        return await self._respond(req, self._prepare(req, list(ids), "messages"), chat=True)
