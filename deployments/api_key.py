"""The service's API keys and whose each is: from SPECDEC_API_KEY / SPECDEC_API_KEYS, else the
application config; and the middleware that checks one before a request's body is read."""

from __future__ import annotations

import hmac
import json

from specdec.errors import ConfigError

MIN_API_KEY = 8
# The tenant a lone `api_key` (or SPECDEC_API_KEY) belongs to.
DEFAULT_TENANT = "default"
# Routes anyone may call: a minimal /health (ok or not) for load balancers and probes, and
# the API's schema (it names the served model only).
PUBLIC_PATHS = frozenset({"/health", "/openapi.json"})


def api_key_from(environ, configured: str | None) -> str | None:
    """SPECDEC_API_KEY when set, else the config's api_key. Set but empty or short, it is a
    mistake that would leave the service open: refused."""
    value = environ.get("SPECDEC_API_KEY")
    if value is None:
        return configured
    if len(value.strip()) < MIN_API_KEY:
        what = "empty" if not value.strip() else f"shorter than {MIN_API_KEY} characters"
        raise ConfigError(f"SPECDEC_API_KEY is set but {what}: set a real key, or unset it "
                          "to serve without one")
    return value.strip()


def api_keys_from(environ, configured: dict[str, str]) -> dict[str, str]:
    """Tenant name -> key: SPECDEC_API_KEYS (a JSON object, or `name=key,name=key`) when
    set, else the config's api_keys. Each key at least MIN_API_KEY characters."""
    value = environ.get("SPECDEC_API_KEYS")
    if value is None:
        keys = dict(configured)
    elif value.strip().startswith("{"):
        try:
            keys = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"SPECDEC_API_KEYS is not a JSON object: {exc}") from None
        if not isinstance(keys, dict) or not all(isinstance(v, str) for v in keys.values()):
            raise ConfigError("SPECDEC_API_KEYS must map tenant names to keys (strings)")
    else:
        keys = {}
        for part in filter(None, (p.strip() for p in value.split(","))):
            name, sep, key = part.partition("=")
            if not sep or not name.strip():
                raise ConfigError("SPECDEC_API_KEYS entries are `tenant=key`, comma "
                                  f"separated; {part[:12]!r}... is not")
            keys[name.strip()] = key.strip()
    for name, key in keys.items():
        if len(key.strip()) < MIN_API_KEY:
            raise ConfigError(f"api_keys[{name!r}] is shorter than {MIN_API_KEY} characters")
    return {name: key.strip() for name, key in keys.items()}


class ApiKeys:
    """The keys this service takes and the tenant each belongs to. Every key is compared,
    in constant time each, so the time taken does not tell which one nearly matched."""

    def __init__(self, single: str | None, by_tenant: dict[str, str]) -> None:
        pairs = dict(by_tenant)
        if single:
            if DEFAULT_TENANT in pairs:
                raise ConfigError(f"api_key and api_keys[{DEFAULT_TENANT!r}] both name the "
                                  f"tenant {DEFAULT_TENANT!r}: give one")
            pairs[DEFAULT_TENANT] = single
        keys = list(pairs.values())
        if len(set(keys)) != len(keys):
            raise ConfigError("two tenants share an API key: each tenant needs its own")
        self._pairs = [(key.encode(), tenant) for tenant, key in pairs.items()]

    def __bool__(self) -> bool:
        return bool(self._pairs)

    def tenant(self, authorization: str) -> str | None:
        """The tenant whose key `Authorization: Bearer KEY` carries; None: no key matches."""
        scheme, _, token = authorization.partition(" ")
        given = token.strip().encode()
        found = None
        for key, tenant in self._pairs:
            if hmac.compare_digest(given, key) and scheme.lower() == "bearer":
                found = tenant
        return found


def _unauthorized() -> bytes:
    return json.dumps({"error": {
        "message": "missing or wrong API key: send Authorization: Bearer <key>",
        "type": "authentication_error", "param": None, "code": "invalid_api_key"}}).encode()


class RequireKey:
    """ASGI middleware: with keys configured, a request to any route but PUBLIC_PATHS must
    carry one, checked from its headers alone, before its body is read or parsed (401,
    OpenAI-shaped); the matching key's tenant goes on in scope["state"]["tenant_key"].
    The keys are set when the ingress starts (`RequireKey.keys`)."""

    keys: ApiKeys | None = None

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        keys = RequireKey.keys
        if scope["type"] != "http" or not keys:
            return await self.app(scope, receive, send)
        auth = ""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                auth = value.decode("latin-1")
        tenant = keys.tenant(auth)
        # The route as the app sees it: under a route prefix, Serve keeps the full path and
        # sets root_path.
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if tenant is None and path not in PUBLIC_PATHS:
            body = _unauthorized()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": body})
            return
        scope.setdefault("state", {})["tenant_key"] = tenant
        await self.app(scope, receive, send)
