"""`specdec wait-ready URL`: watch a starting service and say when it takes requests.

`specdec serve` runs it beside the service: Serve's own log says the application is "ready"
when the HTTP proxy is, while the engine behind it may still be loading, warming up and
calibrating for a minute or more. /health answers 503 with what start-up is doing until
the engine can serve a request at full speed; this prints each new phase and then one
line saying the service is ready, with how long start-up took.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request


def _health(url: str) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            return r.status, ""
    except urllib.error.HTTPError as exc:
        try:
            body = json.loads(exc.read() or b"{}")
        except ValueError:
            body = {}
        return exc.code, body.get("reason") or body.get("error", {}).get("message", "")
    except (urllib.error.URLError, OSError):
        return None, "the HTTP proxy is not listening yet"


def wait_ready(url: str, timeout_s: float = 1800.0, parent_pid: int | None = None,
               poll_s: float = 1.0, out=sys.stdout, stopped=None) -> bool:
    """Poll until /health answers 200 (True), the timeout passes, parent_pid exits or
    `stopped` (a threading.Event) is set (False). Prints each new reason for waiting, then
    the ready line."""
    url = url.rstrip("/")
    t0, last = time.monotonic(), None
    while time.monotonic() - t0 < timeout_s:
        if parent_pid is not None and not _alive(parent_pid):
            return False
        status, reason = _health(url)
        if stopped is not None and stopped.is_set():
            return False
        if status == 200:
            print(f"specdec: READY, taking requests at {url}/v1 ({time.monotonic() - t0:.0f} s "
                  "after start)", file=out, flush=True)
            return True
        # Phases, not their running seconds: one line per change.
        phase = reason.split(" (")[0]
        if phase != last:
            print(f"specdec: not ready yet ({time.monotonic() - t0:.0f} s): "
                  f"{reason or f'HTTP {status}'}", file=out, flush=True)
            last = phase
        time.sleep(poll_s)
    print(f"specdec: still not ready after {timeout_s:.0f} s", file=out, flush=True)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
