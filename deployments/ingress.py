"""The `Ingress` deployment: HTTP ingress (OpenAI-compatible), request validation and
tokenization, and the hand-off to an engine replica with what the request says about
speculation. The replica that runs a request decides plain or speculative and k from its
own load (specdec/policy/engine_policy.py); its decision comes back with the first chunk and is
reported in `spec_decode` and the policy's decision metrics. No maths here.

Hardening: bodies are capped (413) before they are read whole; bodies are validated by the
declared models (400 naming the field, also for JSON too deeply nested to parse); text is
tokenized on a worker thread, so a long prompt never stalls the event loop that serves
everyone else; an API key, when configured, guards every /v1 route (401); 503s carry
Retry-After.
"""


import asyncio
import concurrent.futures
import json
import logging
import os
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.api_key import RequireKey
from deployments.app_config import AppArgs
from deployments.body_limit import BodyLimit
from deployments.contract import GenerateCall
from deployments.logprobs_format import LogprobFormat
from deployments.metrics import IngressMetrics
from deployments.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_response,
    validation_message,
)
from deployments.openai_responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
)
from deployments.priority import background_priority
from deployments.prompt_size import check_chars, check_template_chars
from deployments.responses import (
    RETRY_AFTER_S,
    Replies,
    choice_calls,
    raise_for,
    unavailable,
)
from deployments.startup import waiting_for
from deployments.structured_output import GrammarFieldError, sized
from deployments.tenancy import TenantError, effective, tenant_of
from deployments.tool_calls import ToolPlan, ToolRequestError, tool_plan
from specdec.errors import ConfigError
from specdec.model.step.grammar import GrammarSpec, grammar_error
from specdec.model.step.sampling import MIN_TEMPERATURE, SamplingParams
from specdec.pack.hub import resolve
from specdec.pack.tokenizer import chat_ids, load_tokenizer
from specdec.spec_decode.speculation import Speculation

log = logging.getLogger("ray.serve")
MAX_BODY_BYTES = 4 << 20  # a body beyond this is refused (413) before it is read whole
api = FastAPI(title="specdec-serve", version="0.2.0", openapi_url=None)
api.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
api.add_middleware(RequireKey)  # outermost: no body is read for a request without a key
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)}


_metrics: IngressMetrics | None = None  # this replica's, set when it starts


def _count(status: int, code: str | None = None) -> None:
    if _metrics is not None:
        _metrics.error(status, code)


@api.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    _count(exc.status, exc.code)
    return exc.response()


@api.exception_handler(RequestValidationError)
async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    msg, param = validation_message(exc.errors())
    _count(400, "invalid_request")
    return error_response(400, msg, param=param)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Route not found, method not allowed, body too large or unparsable: OpenAI-shaped too.
    detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    _count(exc.status_code)
    if exc.status_code == 400 and "parsing the body" in detail:
        detail = "request body could not be parsed as JSON (malformed, or nested too deeply)"
    return error_response(exc.status_code, detail,
                          "invalid_request_error" if exc.status_code < 500 else "server_error",
                          headers=getattr(exc, "headers", None))


@api.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error")
    _count(500, "server_error")
    return error_response(500, "internal error; see the server log", "server_error")


# The most characters a token of any tokenizer here spans (runs of spaces and repeated
# symbols included), generously: the character cap is the context times this.
HEALTH_TTL_S = 1.0


class IngressServer:
    def __init__(self, engine, args: dict) -> None:
        self.args = AppArgs.model_validate(args)
        self.engine = engine
        self.model_name = self.args.served_name()
        self.tokenizer = load_tokenizer(resolve(self.args.engine.target.model))
        self.max_len = self.args.engine.runtime.max_len
        self.metrics = IngressMetrics()
        global _metrics
        _metrics = self.metrics
        self._replies = Replies(self.model_name, LogprobFormat(self.tokenizer), _count)
        self.keys = self.args.keys(os.environ)
        if self.args.tenancy == "api_key" and not self.keys:
            # The deploy-time check read the driver's environment; this is the replica's.
            raise ConfigError("tenancy: api_key needs API keys, and this ingress replica has "
                              "none (api_key, api_keys, or SPECDEC_API_KEY / "
                              "SPECDEC_API_KEYS in its environment)")
        RequireKey.keys = self.keys
        self.tenancy = effective(self.args.tenancy, bool(self.keys))
        self._health: tuple[float, dict] | None = None  # (when, the engine's answer)
        self._health_asking: asyncio.Future | None = None  # the question in flight
        # One thread: tokenizers are not safe to share across threads, and the point is
        # only to keep the event loop free.
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, "tokenize")
        # Grammars are checked on a thread of their own: a large one (capped, a few hundred
        # ms at most) never holds up other requests' tokenizing.
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(
            1, "grammar", initializer=background_priority)
        self._openapi: dict | None = None
        # Whether an engine replica has answered since this ingress started: until one
        # does, every route but /openapi.json answers 503 saying what the service waits for.
        self._engine_seen = False
        try:
            self.app_name = serve.get_replica_context().app_name
        except Exception:  # noqa: BLE001 - outside a replica (tests of the class itself)
            self.app_name = ""

    def openapi_schema(self) -> dict:
        """The API's schema, naming the models this server takes, so a client generator
        (or a fuzzer) learns them instead of guessing."""
        if self._openapi is None:
            schema = get_openapi(title=api.title, version=api.version, routes=api.routes)
            # The served name only: the target's reference (a local path, perhaps) is still
            # taken as an alias, but not advertised on a public route.
            names = [self.model_name]
            for request in ("CompletionRequest", "ChatCompletionRequest"):
                schema["components"]["schemas"][request]["properties"]["model"]["enum"] = names
            self._openapi = schema
        return self._openapi

    # ---- request handling -----------------------------------------------------------------

    def _authorize(self, request: Request) -> bool:
        """True when no key is configured or the request carries one (constant-time)."""
        return not self.keys or \
            self.keys.tenant(request.headers.get("authorization", "")) is not None

    def _tenant(self, request: Request, req, request_id: str) -> str | None:
        """The request's tenant (deployments/tenancy.py): 400 naming the header when the
        deployment takes it from a header the request lacks."""
        key_tenant = request.scope.get("state", {}).get("tenant_key")
        try:
            return tenant_of(self.tenancy, key_tenant, request.headers,
                             self.args.tenant_header, req.user, request_id)
        except TenantError as exc:
            raise APIError(400, str(exc), param=exc.param, code="tenant_required") from exc

    async def _check(self, request: Request, req) -> None:
        await self._check_model(request, req.model)

    async def _check_model(self, request: Request, model: str | None) -> None:
        """The key, the model named (None: the one served), an engine up."""
        self._check_key(request)
        if model is not None and model not in (self.model_name, self.args.engine.target.model):
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")
        await self._wait_for_engine()

    def _check_key(self, request: Request) -> None:
        if not self._authorize(request):
            raise APIError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                           "authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    async def _wait_for_engine(self, timeout_s: float = 1.0) -> None:
        """Raise 503 (Retry-After, what start-up is doing) until an engine replica serves.
        An engine replica answers only once weights are loaded, warmed up and its costs
        calibrated, so a request let through here is served at full speed at once."""
        if self._engine_seen:
            return
        try:
            await asyncio.wait_for(self.engine.ready.remote(), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - not constructed yet, or being placed
            raise APIError(503, f"not ready: {waiting_for(self.app_name)}; retry",
                           "service_unavailable", code="engine_starting",
                           headers={"Retry-After": RETRY_AFTER_S}) from None
        if not self._engine_seen:
            self._engine_seen = True
            log.info("an engine replica serves: the service is ready to take requests")

    async def _engine_load(self) -> dict:
        """The engine's state, asked at most once a second however many ask at once (a
        public route must not make every actor answer per request): concurrent callers
        that find it stale share one question to the engine."""
        now = time.monotonic()
        if self._health is not None and now - self._health[0] <= HEALTH_TTL_S:
            return self._health[1]
        if self._health_asking is None:
            self._health_asking = asyncio.ensure_future(self._ask_engine_load())
        return await asyncio.shield(self._health_asking)

    async def _ask_engine_load(self) -> dict:
        try:
            load = await asyncio.wait_for(self.engine.load.remote(), timeout=5)
            self._health = (time.monotonic(), load)
            return load
        finally:
            self._health_asking = None

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    def _check_chars(self, n_chars: int, param: str) -> None:
        check_chars(n_chars, param, self.max_len)

    def _check_template_chars(self, body) -> None:
        check_template_chars(body, self.max_len)

    async def _grammar(self, req) -> tuple[GrammarSpec | None, str | None]:
        """The reply's grammar and the field that gave it, compiled once here (off the event
        loop: a large schema takes milliseconds) so that one that cannot be used is a 400
        naming its field."""
        try:
            spec, field = req.grammar()
        except ValueError as exc:
            raise APIError(400, str(exc),
                           param=getattr(exc, "field", "structured_outputs")) from exc
        if spec is None:
            return None, None
        await self._compiles(spec, field)
        return spec, field

    async def _compiles(self, spec: GrammarSpec, field: str) -> None:
        error = await asyncio.get_running_loop().run_in_executor(self._grammar_pool,
                                                                 grammar_error, spec)
        if error:
            raise APIError(400, f"{field}: the grammar cannot be used: {error}", param=field)

    def _prepare(self, request: Request, req, prompt_ids: list[int], prompt_param: str,
                 grammar: GrammarSpec | None = None,
                 grammar_field: str | None = None) -> GenerateCall:
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
        self._check_ids(req)
        if req.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens ({req.min_tokens}) exceeds max_tokens "
                                f"({max_tokens})", param="min_tokens")
        spec = req.speculative
        try:
            # A temperature below MIN_TEMPERATURE is its limit, greedy (as vLLM takes it).
            temperature = req.temperature if req.temperature >= MIN_TEMPERATURE else 0.0
            params = SamplingParams(temperature=temperature, top_p=req.top_p,
                                    top_k=req.top_k, seed=req.seed, max_tokens=max_tokens,
                                    stop=tuple(req.stop or ()), ignore_eos=req.ignore_eos,
                                    logprobs=req.top_logprobs_asked(),
                                    presence_penalty=req.presence_penalty,
                                    frequency_penalty=req.frequency_penalty,
                                    repetition_penalty=req.repetition_penalty,
                                    min_p=req.min_p, min_tokens=req.min_tokens,
                                    stop_token_ids=tuple(req.stop_token_ids or ()),
                                    logit_bias=req.logit_bias_pairs(), grammar=grammar)
        except ValueError as exc:  # the schema's bounds come first; this is the last guard
            raise APIError(400, str(exc)) from exc
        request_id = uuid.uuid4().hex
        return GenerateCall(request_id, prompt_ids, params,
                            Speculation(mode=spec.mode, method=spec.method, k=spec.k),
                            bool(req.stream), grammar_field,
                            self._tenant(request, req, request_id))

    def _check_ids(self, req) -> None:
        """Token ids a request names must be in the vocabulary: refused, naming the field."""
        vocab = len(self.tokenizer)
        for field, ids in (("logit_bias", [t for t, _ in req.logit_bias_pairs()]),
                           ("stop_token_ids", req.stop_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"{field} names token ids outside the vocabulary "
                                    f"(0..{vocab - 1}): {bad[:5]}", param=field)

    async def _respond(self, req, call: GenerateCall, chat: bool,
                       tools: ToolPlan | None = None):
        """The OpenAI response for completions or chat, streamed (SSE) or whole. The
        engine's first answer (its decision, or a refusal) comes before any header, so a
        refused request gets its status code even when it asked for a stream."""
        gens, decision = [], None
        try:
            for choice in choice_calls(call, req.n):
                gen, decided = await self._open(choice)
                gens.append(gen)
                decision = decision or decided
        except APIError:
            for gen in gens:  # a later choice was refused: the earlier ones stop too
                gen.cancel()
            raise
        return await self._replies.respond(req, call.request_id, gens, decision, chat, tools)

    async def _open(self, call: GenerateCall):
        """Start the request on an engine replica and read its decision (or refusal)."""
        gen = self.engine.options(stream=True).generate.remote(call)
        try:
            first = await gen.__anext__()
        except Exception as exc:  # the replica died or Serve could not reach one
            gen.cancel()
            raise unavailable(exc) from exc
        try:
            raise_for(first)
        except APIError:
            gen.cancel()
            raise
        self.metrics.decided(first.decision)
        return gen, first.decision


@serve.deployment(name="Ingress")
@serve.ingress(api)
class Ingress(IngressServer):
    @api.get("/health")
    async def health(self, request: Request):
        """ok / not ok for anyone; the engine's details only with the API key (if one is
        configured). 503 while the engine starts (saying what it waits for) or when no
        engine replica answers."""
        try:
            await self._wait_for_engine()
        except APIError as exc:
            return JSONResponse(status_code=503, headers={"Retry-After": RETRY_AFTER_S},
                                content={"status": "starting", "reason": exc.message})
        try:
            load = await self._engine_load()
        except Exception as exc:  # noqa: BLE001
            return JSONResponse(status_code=503, headers={"Retry-After": RETRY_AFTER_S},
                                content={"status": "unavailable",
                                         "reason": f"engine unavailable: {type(exc).__name__}"})
        if load.get("target_down"):
            return JSONResponse(status_code=503, headers={"Retry-After": RETRY_AFTER_S},
                                content={"status": "unavailable",
                                         "reason": load["target_down"]})
        if not self._authorize(request):
            return {"status": "ok"}
        return {"status": "ok", "model": self.model_name, "engine": load}

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi(self) -> dict:
        return self.openapi_schema()

    @api.get("/v1/models", responses=_ERRORS)
    async def models(self, request: Request) -> dict:
        self._check_key(request)
        await self._wait_for_engine()
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "specdec-serve",
            "max_model_len": self.max_len}]}

    @api.post("/tokenize", responses=_ERRORS)
    async def tokenize(self, body: TokenizeRequest, request: Request) -> dict:
        """The token ids a prompt (or a chat, through the model's template) becomes."""
        await self._check_model(request, body.model)
        if body.prompt is not None:
            self._check_chars(len(body.prompt), "prompt")
            ids = (await self._off_loop(lambda: self.tokenizer(
                body.prompt, add_special_tokens=body.add_special_tokens))).input_ids
        else:  # exactly as the chat route renders it: tool calls, tool results, tools
            self._check_template_chars(body)
            try:
                tools = tool_plan(body, self.tokenizer, self.args.model_name)
            except ToolRequestError as exc:
                raise APIError(400, str(exc), param=exc.param) from exc
            messages = [m.for_template() for m in body.messages]
            listed = tools.template_tools() if tools else None
            try:
                ids = await self._off_loop(lambda: chat_ids(
                    self.tokenizer, messages, listed, body.add_generation_prompt))
            except Exception as exc:  # noqa: BLE001 - a template that rejects the conversation
                raise APIError(400, f"messages could not be formatted: {exc}",
                               param="messages") from exc
        out = {"count": len(ids), "max_model_len": self.max_len, "tokens": list(ids)}
        if body.return_token_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(list(ids))
        return out

    @api.post("/detokenize", responses=_ERRORS)
    async def detokenize(self, body: DetokenizeRequest, request: Request) -> dict:
        await self._check_model(request, body.model)
        vocab = len(self.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens holds ids outside the vocabulary (0..{vocab - 1}): "
                                f"{bad[:5]}", param="tokens")
        return {"prompt": await self._off_loop(self.tokenizer.decode, body.tokens)}

    @api.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(self, body: CompletionRequest, request: Request):
        await self._check(request, body)
        if isinstance(body.prompt, str):
            self._check_chars(len(body.prompt), "prompt")
            ids = (await self._off_loop(self.tokenizer, body.prompt)).input_ids
        else:
            ids = list(body.prompt)
            vocab = len(self.tokenizer)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"prompt holds token ids outside the vocabulary "
                                    f"(0..{vocab - 1}): {bad[:5]}", param="prompt")
        grammar, field = await self._grammar(body)
        return await self._respond(
            body, self._prepare(request, body, ids, "prompt", grammar, field), chat=False)

    @api.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=_ERRORS)
    async def chat(self, body: ChatCompletionRequest, request: Request):
        await self._check(request, body)
        self._check_template_chars(body)
        try:
            tools = tool_plan(body, self.tokenizer, self.args.model_name)
        except ToolRequestError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
        messages = [m.for_template() for m in body.messages]
        listed = tools.template_tools() if tools else None

        def template():
            return chat_ids(self.tokenizer, messages, listed)

        try:
            ids = await self._off_loop(template)
        except Exception as exc:  # noqa: BLE001 - a template that rejects the conversation
            raise APIError(400, f"messages could not be formatted: {exc}",
                           param="messages") from exc
        grammar, field = await self._grammar(body)
        forced = tools.grammar() if tools else None
        if forced is not None:
            if grammar is not None:
                raise APIError(400, "a required tool call and a response_format both "
                                    "constrain the reply: give one", param="tool_choice")
            try:
                grammar, field = sized(forced, "tools"), "tools"
            except GrammarFieldError as exc:
                raise APIError(400, str(exc), param="tools") from exc
            await self._compiles(grammar, field)  # a tool's parameters schema it cannot use
        return await self._respond(
            body, self._prepare(request, body, list(ids), "messages", grammar, field), chat=True,
            tools=tools)
