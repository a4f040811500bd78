"""What a request asks of speculation: one value, carried unchanged from the API's
`speculative` field through the ingress contract and the policy's admission to the engine's
Request and the sequence that runs it.

It says what the caller fixed; what is left open (`None`) the policy chooses at admission
(`policy.Decision`: mode, method, k and the reason) and, each round, revisits
(`EnginePolicy.choose_k`, where a probe may override it for one step). `Engine._k_for` is
where the three meet."""

from __future__ import annotations

import dataclasses

from specdec.vocabulary import Method, SpecMode


@dataclasses.dataclass(frozen=True, kw_only=True)
class Speculation:
    # auto: the policy decides, per request and per round. on: speculate every round (at
    # least one guess while the proposer is up), whatever the costs say. off: plain.
    mode: SpecMode = "auto"
    method: Method | None = None   # None: the policy picks (and `auto` may take free guesses)
    k: int | None = None           # None: the policy picks, and revisits every round

    @property
    def on(self) -> bool:
        """The caller asked for speculation: every round drafts."""
        return self.mode == "on"

    @property
    def pins_k(self) -> bool:
        """The caller fixed k (or asked for plain decoding): no round revisits it."""
        return self.k is not None or self.mode == "off"

    @property
    def pins_method(self) -> bool:
        """The caller named the method: every round uses it, never the suffix index's
        guesses in its place."""
        return self.method is not None


# Nothing fixed: the policy chooses mode, method and k (the API's default).
AUTO = Speculation()
