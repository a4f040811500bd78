"""Whose a request is (deployments/tenancy.py) and the keys that say so
(deployments/api_key.py): the operator's choice, never a client's unchecked word."""

from __future__ import annotations

import pytest

from deployments.api_key import ApiKeys, api_keys_from
from deployments.app import parse_args
from deployments.tenancy import TenantError, effective, tenant_of
from specdec.errors import ConfigError

A, B = "sk-alice-0123", "sk-bob-012345"


def test_each_key_names_its_tenant_and_a_wrong_one_none():
    keys = ApiKeys("sk-single-key", {"alice": A, "bob": B})
    assert keys.tenant(f"Bearer {A}") == "alice" and keys.tenant(f"bearer {B}") == "bob"
    assert keys.tenant("Bearer sk-single-key") == "default"
    assert keys.tenant("Bearer sk-alice-012") is None and keys.tenant(A) is None
    assert keys.tenant("") is None and not ApiKeys(None, {})


def test_keys_from_the_environment_take_precedence_and_bad_ones_are_refused():
    assert api_keys_from({"SPECDEC_API_KEYS": f"alice={A}, bob={B}"}, {"x": "sk-x-0123456"}) \
        == {"alice": A, "bob": B}
    assert api_keys_from({"SPECDEC_API_KEYS": f'{{"alice": "{A}"}}'}, {}) == {"alice": A}
    assert api_keys_from({}, {"alice": A}) == {"alice": A}
    for bad, says in (("alice=short", "shorter"), (f"{A}", "tenant=key"),
                      ('{"alice": 5}', "strings"), ("{nope", "JSON")):
        with pytest.raises(ConfigError, match=says):
            api_keys_from({"SPECDEC_API_KEYS": bad}, {})
    with pytest.raises(ConfigError, match="share an API key"):
        ApiKeys(None, {"alice": A, "bob": A})
    with pytest.raises(ConfigError, match="both name"):
        ApiKeys(A, {"default": B})


def test_the_tenant_under_each_tenancy():
    headers = {"x-tenant-id": "team-7"}
    assert effective("auto", True) == "api_key" and effective("auto", False) == "shared"
    assert tenant_of("shared", "alice", headers, "x-tenant-id", "u", "r1") is None
    assert tenant_of("api_key", "alice", headers, "x-tenant-id", "u", "r1") == "key:alice"
    assert tenant_of("header", None, headers, "x-tenant-id", "u", "r1") == "header:team-7"
    assert tenant_of("user", None, {}, "x-tenant-id", "u", "r1") == "user:u"
    # No user named: shares with nobody, not with everyone else who named none.
    assert tenant_of("user", None, {}, "x-tenant-id", None, "r1") != \
        tenant_of("user", None, {}, "x-tenant-id", None, "r2")
    for given in ({}, {"x-tenant-id": "  "}, {"x-tenant-id": "t" * 300}):
        with pytest.raises(TenantError) as err:
            tenant_of("header", None, given, "x-tenant-id", None, "r1")
        assert err.value.param == "x-tenant-id"


def test_the_config_says_what_tenancy_needs(tiny_llama, monkeypatch):
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    monkeypatch.delenv("SPECDEC_API_KEYS", raising=False)
    base = {"target": {"model": str(tiny_llama)}}
    with pytest.raises(ConfigError, match="tenancy: api_key needs API keys"):
        parse_args({**base, "tenancy": "api_key"})
    with pytest.raises(ConfigError, match="tenancy"):
        parse_args({**base, "tenancy": "per-user"})
    with pytest.raises(ConfigError, match="suffix.scope is gone"):
        parse_args({**base, "suffix": {"scope": "user"}})
    assert parse_args({**base, "api_keys": {"alice": A}, "tenancy": "api_key"}).tenancy \
        == "api_key"


def test_the_draft_groups_client_prices_and_releases_within_a_tenant():
    """RayDraftProposer's side of the draft's cache: a first round's catch-up is priced from
    the tenant's own contexts only; a sequence that never drafted leaves nothing queued for
    release (traffic that never drafts would grow that list without bound)."""
    import collections
    import types

    import numpy as np

    from deployments.actors.draft import RayDraftProposer
    from specdec.model.step.sampling import SamplingParams
    from specdec.spec_decode.proposal import ProposeInput
    from specdec.spec_decode.wire import ContextSender

    draft = RayDraftProposer.__new__(RayDraftProposer)  # the bookkeeping, not the group
    draft.sender, draft._released, draft._tenants = ContextSender(), [], {}
    draft._recent = collections.deque(maxlen=4)
    draft._rebuilding, draft.last_call = False, None
    sent = []
    draft.group = types.SimpleNamespace(actors=[object()],
                                        submit=lambda method, blob, *extra: sent.append(blob))
    for i in range(1000):
        draft.release(f"plain-{i}")
    assert draft._released == [] and not draft._tenants
    inp = ProposeInput("a", list(range(3, 40)), 2, SamplingParams(), tenant="key:alice")
    draft._submit("draft_propose", [inp])  # what a round sends the group
    assert draft.held_prefix(list(range(3, 30)) + [1], "key:alice") == 27
    assert draft.held_prefix(list(range(3, 30)) + [1], "key:bob") == 0
    draft.release("a")
    assert draft._released == ["a"] and len(draft._recent) == 1
    assert draft.held_prefix(np.arange(3, 30).tolist(), "key:alice") == 27
    assert draft.held_prefix(np.arange(3, 30).tolist(), "key:bob") == 0


def _asgi(path: str, headers: dict, root_path: str = ""):
    """A request through RequireKey: (status, whether the app read the body)."""
    import asyncio

    from deployments.api_key import RequireKey

    seen = {"read": False, "status": None}

    async def app(scope, receive, send):
        seen["read"] = True
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive():
        return {"type": "http.request", "body": b"{not json", "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            seen["status"] = message["status"]

    scope = {"type": "http", "path": root_path + path, "root_path": root_path,
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(RequireKey(app)(scope, receive, send))
    return seen["status"], seen["read"]


def test_the_key_is_checked_from_the_headers_before_the_body_is_read(monkeypatch):
    from deployments.api_key import RequireKey

    monkeypatch.setattr(RequireKey, "keys", ApiKeys(None, {"alice": A}))
    assert _asgi("/v1/completions", {}) == (401, False)
    assert _asgi("/v1/completions", {"authorization": "Bearer nope-nope-nope"}) == (401, False)
    assert _asgi("/v1/completions", {"authorization": f"Bearer {A}"}) == (200, True)
    # /health and the schema stay public, under a route prefix too.
    for root in ("", "/llm"):
        assert _asgi("/health", {}, root) == (200, True)
        assert _asgi("/openapi.json", {}, root) == (200, True)
        assert _asgi("/v1/models", {}, root) == (401, False)
