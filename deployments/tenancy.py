"""Whose a request is: the tenant the engine partitions its caches by.

The prefix caches (target and draft) and the suffix index reuse, for a request, only what
its own tenant sent and got back, because what they reuse shows in the response
(`cached_tokens`, the speculation counters) and in its timing. The tenant is chosen by the
operator (`tenancy`), never by an unauthenticated client:

- `api_key`: the tenant whose key the request carries (the default when keys are set);
- `header`: a header a trusted gateway sets (`tenant_header`); a request without it is
  refused;
- `user`: the OpenAI `user` field (only behind a gateway that sets or checks it); a
  request without one shares with nobody;
- `shared`: one tenant, everyone shares (the default without keys: a single-tenant
  deployment).
"""

from __future__ import annotations

from typing import Literal

from specdec.spec_decode.proposal import ALONE

Tenancy = Literal["auto", "shared", "api_key", "header", "user"]
MAX_TENANT_CHARS = 256


class TenantError(ValueError):
    """A request that does not say whose it is where the deployment needs to know."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def effective(tenancy: Tenancy, have_keys: bool) -> Tenancy:
    """`auto`: by API key when keys are configured, else one shared tenant."""
    if tenancy == "auto":
        return "api_key" if have_keys else "shared"
    return tenancy


def tenant_of(tenancy: Tenancy, key_tenant: str | None, headers, header: str,
              user: str | None, request_id: str) -> str | None:
    """The request's tenant under an effective `tenancy` (None: the shared one)."""
    if tenancy == "shared":
        return None
    if tenancy == "api_key":
        return f"key:{key_tenant}"
    if tenancy == "header":
        value = headers.get(header)
        if not value or not value.strip():
            raise TenantError(f"the {header} header is required here (it names the "
                              "request's tenant)", header)
        if len(value) > MAX_TENANT_CHARS:
            raise TenantError(f"the {header} header is longer than {MAX_TENANT_CHARS} "
                              "characters", header)
        return f"header:{value.strip()}"
    if user:
        return f"user:{user}"
    return f"{ALONE}{request_id}"  # names nobody: shares with nobody
