"""The `Router` deployment: HTTP ingress (OpenAI-compatible), request validation, and the
per-request policy call (plain or speculative, method, k) from the live load and acceptance
the engine replicas report. The policy itself is specdec.policy; no maths here."""


import asyncio
import dataclasses
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
from specdec.policy import (
    Decision,
    DraftCostModel,
    LengthEstimator,
    Load,
    PolicyConfig,
    StepCostModel,
    decide,
)

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
        self.policy = PolicyConfig(**self.args.policy.model_dump())
        self.lengths = LengthEstimator(self.policy)
        self.max_len = self.args.runtime.max_len
        self.load: dict = {}
        self._poller: asyncio.Task | None = None
        self.metrics = RouterMetrics()

    # ---- live load ------------------------------------------------------------------------

    async def _poll_load(self) -> None:
        while True:
            try:
                self.load = await self.engine.load.remote()
            except Exception as exc:  # noqa: BLE001 - an engine restarting; keep the last
                log.warning("engine load poll failed: %s", exc)
            self.metrics.policy_inputs(
                self.load.get("alpha") or dict(self.policy.acceptance_prior),
                self.load.get("draft_cost_ratio") or self.policy.draft_cost_ratio)
            await asyncio.sleep(1.0)

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_load())

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

    def _decide(self, req, prompt_tokens: int, max_tokens: int) -> Decision:
        spec = req.speculative
        load = self.load
        methods = list(load.get("methods", ["draft", "ngram"] if self.args.draft else ["ngram"]))
        if spec.method and spec.method not in methods:
            raise APIError(400 if spec.method == "draft" and not self.args.draft else 503,
                           f"speculative.method {spec.method!r} is not available "
                           f"(available: {methods})", param="speculative.method")
        if spec.mode == "off":
            return Decision("plain", "none", 0, "request asked for plain decoding", 1.0, {},
                            "request")
        alpha = load.get("alpha") or dict(self.policy.acceptance_prior)
        if load.get("draft_cost_ratio"):
            self.policy = dataclasses.replace(self.policy,
                                              draft_cost_ratio=load["draft_cost_ratio"])
        cost = StepCostModel.with_fit(load.get("step_cost_fit"))
        draft_cost = DraftCostModel.with_fit(load.get("draft_round_fit"))
        curves = load.get("acceptance_curve")
        lw = Load(load.get("running", 0), load.get("waiting", 0),
                  max(load.get("tokens_per_step", 1.0), 1.0))
        expected = self.lengths.expected(prompt_tokens, max_tokens, bool(req.stop))
        if spec.mode == "on":
            method = spec.method or ("draft" if "draft" in methods else "ngram")
            d = decide(self.policy, [method], alpha, float("inf"), lw, cost,
                       forced_method=method, forced_k=spec.k, draft_cost=draft_cost,
                       curves=curves)
            if d.k == 0:  # "on" means speculate: take the policy's k even below break-even
                d = decide(self.policy, [method], alpha, float("inf"), lw, cost,
                           forced_method=method, forced_k=min(4, self.policy.k_max),
                           draft_cost=draft_cost, curves=curves)
            d.reason = "request asked for speculation; " + d.reason
            d.why = "request"
            return d
        return decide(self.policy, methods, alpha, expected, lw, cost,
                      forced_method=spec.method, forced_k=spec.k, draft_cost=draft_cost,
                      curves=curves)

    def _prepare(self, req, prompt_ids: list[int], prompt_param: str) -> tuple[dict, Decision]:
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
        decision = self._decide(req, len(prompt_ids), max_tokens)
        self.metrics.decided(decision)
        payload = {
            "request_id": uuid.uuid4().hex, "prompt_ids": prompt_ids,
            "params": {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                       "seed": req.seed, "max_tokens": max_tokens, "stop": tuple(req.stop or ()),
                       "ignore_eos": req.ignore_eos},
            "method": decision.method, "k": decision.k,
            "fixed_k": req.speculative.k is not None or req.speculative.mode == "off",
        }
        return payload, decision

    @staticmethod
    def _spec_report(decision: Decision, final: dict) -> dict:
        s = final.get("spec") or {}
        return {"mode": decision.mode, "method": decision.method, "k": decision.k,
                "engine_s": final.get("engine_s"),
                "k_last_round": final.get("k"), "reason": decision.reason,
                "inputs": decision.inputs, "expected_speedup": round(decision.expected_speedup, 3),
                **{key: s.get(key) for key in ("rounds", "drafted", "accepted",
                                               "mean_acceptance_length",
                                               "draft_acceptance_ratio", "alpha_estimate",
                                               "per_position_acceptance", "plain_steps")}}

    async def _respond(self, req, payload: dict, decision: Decision, chat: bool):
        """The OpenAI response for completions or chat, streamed (SSE) or whole."""
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{payload['request_id']}",
                "created": int(time.time()), "model": self.model_name}
        if req.stream:
            obj = "chat.completion.chunk" if chat else "text_completion"

            def chunk(c, usage_only=False, decision=None):
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
            return StreamingResponse(self._sse(payload, decision, chunk, first, inc),
                                     media_type="text/event-stream")
        text, final = await self._collect(payload)
        reason = final.get("finish_reason")
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": reason} if chat else \
            {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {**head, "object": "chat.completion" if chat else "text_completion",
                "choices": [choice], "usage": _usage(final),
                "spec_decode": self._spec_report(decision, final)}

    def _stream(self, payload: dict):
        return self.engine.options(stream=True).generate.remote(payload)

    @staticmethod
    def _raise_for(chunk: dict) -> None:
        if chunk.get("error_kind") == "capacity":
            raise APIError(503, chunk["error"], "overloaded_error", code="overloaded")
        if chunk.get("error_kind") == "invalid":
            raise APIError(400, chunk["error"])
        if chunk.get("finish_reason") == "error":
            raise APIError(503, f"the engine lost its target mid-request: {chunk['error']}",
                           "service_unavailable", code="engine_unavailable")

    async def _collect(self, payload: dict) -> tuple[str, dict]:
        text, final = [], {}
        try:
            async for chunk in self._stream(payload):
                self._raise_for(chunk)
                text.append(chunk.get("text", ""))
                final = chunk
        except APIError:
            raise
        except Exception as exc:  # the replica died or Serve could not reach one
            raise APIError(503, f"no engine available: {type(exc).__name__}",
                           "service_unavailable", code="engine_unavailable") from exc
        self.lengths.observe(final.get("prompt_tokens", 0), final.get("completion_tokens", 0))
        return "".join(text), final

    async def _sse(self, payload: dict, decision: Decision, make_chunk, first_chunk,
                   include_usage: bool):
        gen = self._stream(payload)
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
            if final.get("finished"):
                self.lengths.observe(final.get("prompt_tokens", 0),
                                     final.get("completion_tokens", 0))
                if include_usage:
                    yield f"data: {json.dumps(make_chunk(final, usage_only=True, decision=decision))}\n\n"
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
        self._ensure_poller()
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
        self._ensure_poller()
        req = await self._parse(request, CompletionRequest)
        if isinstance(req.prompt, str):
            ids = self.tokenizer(req.prompt).input_ids
        else:
            ids = list(req.prompt)
            bad = [t for t in ids if not 0 <= t < len(self.tokenizer)]
            if bad:
                raise APIError(400, f"prompt holds token ids outside the vocabulary: {bad[:5]}",
                               param="prompt")
        payload, decision = self._prepare(req, ids, "prompt")
        return await self._respond(req, payload, decision, chat=False)

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request):
        self._ensure_poller()
        req = await self._parse(request, ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
        except Exception as exc:  # noqa: BLE001 - a template that rejects the conversation
            raise APIError(400, f"messages could not be formatted: {exc}",
                           param="messages") from exc
        payload, decision = self._prepare(req, list(ids), "messages")
        return await self._respond(req, payload, decision, chat=True)
