"""What a starting engine replica is doing, told to the ingress before the replica exists.

An engine replica is not a replica until its constructor returns (weights loaded, warmed
up, step costs calibrated: a minute or two on a small CPU), and until then the ingress
cannot call it. So the replica writes its phase to the cluster's key-value store and the
ingress reads it, to answer 503 with what the service waits for instead of a request that
hangs in a queue for minutes.
"""

from __future__ import annotations

import json
import logging
import time

log = logging.getLogger("ray.serve")
_PREFIX = "specdec/startup/"


def _kv():
    # Ray's own key-value store in the GCS (what Serve keeps its checkpoints in).
    from ray.experimental import internal_kv

    return internal_kv


class StartupReporter:
    """The engine side: one key per starting replica, removed once it serves."""

    def __init__(self, app: str, replica: str) -> None:
        self.key = f"{_PREFIX}{app}/{replica}".encode()
        self.started = time.time()

    def phase(self, name: str) -> None:
        log.info("engine start-up: %s (%.0f s in)", name, time.time() - self.started)
        try:
            _kv()._internal_kv_put(self.key, json.dumps(
                {"phase": name, "started": self.started, "since": time.time()}).encode(),
                overwrite=True)
        except Exception:  # noqa: BLE001 - telling is a courtesy; starting must go on
            log.debug("could not record the start-up phase", exc_info=True)

    def done(self) -> None:
        try:
            _kv()._internal_kv_del(self.key)
        except Exception:  # noqa: BLE001
            pass


def starting_replicas(app: str) -> list[dict]:
    """The ingress side: each starting replica's phase and how long it has been starting."""
    out = []
    try:
        kv = _kv()
        for key in kv._internal_kv_list(f"{_PREFIX}{app}/".encode()):
            raw = kv._internal_kv_get(key)
            if raw:
                entry = json.loads(raw)
                entry["elapsed_s"] = round(time.time() - entry["started"], 1)
                out.append(entry)
    except Exception:  # noqa: BLE001 - unknown: the caller says so in general words
        log.debug("could not read start-up phases", exc_info=True)
    return out


def waiting_for(app: str) -> str:
    """A sentence for a 503 while no engine replica serves yet."""
    starting = starting_replicas(app)
    if not starting:
        return ("no engine replica is serving yet (it is being placed, or its process is "
                "starting)")
    first = max(starting, key=lambda e: e["elapsed_s"])
    return (f"the engine is starting: {first['phase']} ({first['elapsed_s']:.0f} s since "
            "it started)")
