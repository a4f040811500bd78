"""One request through an assembled engine in this process, timed as a user reads it: decode
tokens/s from the first token to the last (the prefill is not decode)."""

from __future__ import annotations

import time


def decode_one(built, label: str, ids, params, overrides):
    """Submit one request, step the engine until it finishes; (its final output, decode
    tokens/s after the first token)."""
    built.submit(label, ids, params, overrides)
    first = done = None
    while done is None:
        for o in built.engine.step():
            if o.request_id != label:
                continue
            if first is None and o.new_token_ids:
                first = time.perf_counter()
            if o.finished:
                done = o
    return done, (len(done.token_ids) - 1) / (time.perf_counter() - first)
