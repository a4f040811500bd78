"""`specdec serve CONFIG`: serve a Serve config (what `serve run CONFIG` does), stopped
cleanly however it is asked to stop.

`serve run` is a Ray driver: the signal handler Ray's C++ core installs in it answers
SIGTERM (what systemd, Kubernetes or a script send) with a stack dump and an abort
(status -6); the same SIGTERM sent to its process group also hits Ray's GCS, raylet and
dashboard, which run in that group, and its own Ctrl-C path (`serve.shutdown()`) kills the
HTTP proxies at once, cutting off every request in flight. So the driver here
(specdec_cli/serve_driver.py) runs in a session of its own, where a terminal's Ctrl-C or a
group's SIGTERM cannot reach it or Ray's processes, under this small parent without Ray.
SIGINT, SIGTERM and SIGHUP to the parent (or its group) all become one SIGINT to the
driver, which drains: the applications are deleted the way `serve.delete` does it (the
replicas finish what they hold, up to the app's drain_timeout_s, while new requests are
refused), then Serve and Ray shut down. Whatever of the session is still alive after
`grace_s` is killed, as is any Ray worker left behind. Exit status: 0 after a requested
stop that ended cleanly, 1 when something had to be killed, the driver's own status when
it ended by itself. A second signal while stopping kills at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def driver_command(config: str) -> list[str]:
    """The Ray driver (specdec_cli/serve_driver.py) in this interpreter."""
    return [sys.executable, "-m", "specdec_cli.serve_driver", config]


def session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (the driver started with start_new_session: it, the
    Ray daemons it started and their workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # Fields after the command (which may hold spaces): state is first, session the 4th.
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry))
    return found


def kill_session(sid: int, grace_s: float = 5.0) -> list[int]:
    """SIGTERM every live process of the session, SIGKILL what is left after grace_s;
    returns the pids that had to be signalled."""
    pids = session_pids(sid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_pids(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.1)
    return pids


def ready_url(config: str) -> str:
    """Where the config's HTTP proxy listens (Serve's defaults where it says nothing)."""
    import yaml

    with open(config) as f:
        http = (yaml.safe_load(f) or {}).get("http_options") or {}
    host = http.get("host", "127.0.0.1")
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{http.get('port', 8000)}"


def _say(out, message: str) -> None:
    """A line for the user, never at the cost of the stop: on a closed terminal (SIGHUP, a
    write that fails with EIO) the service is stopped all the same."""
    try:
        print(message, file=out, flush=True)
    except (OSError, ValueError):
        pass


def run_serve(config: str, grace_s: float = 90.0, announce_ready: bool = True,
              out=sys.stderr) -> int:
    child = subprocess.Popen(driver_command(config), start_new_session=True)
    asked: list[int] = []
    since: list[float] = []  # when the first stop signal came
    stopping = threading.Event()

    def on_signal(signum, _frame) -> None:
        asked.append(signum)
        if len(asked) == 1:
            since.append(time.monotonic())
            stopping.set()
            child.send_signal(signal.SIGINT)  # first: whatever happens to the message
            _say(out, f"specdec: {signal.Signals(signum).name}: stopping (Serve drains the "
                      f"requests in flight; at most {grace_s:.0f} s)")
        else:
            kill_session(child.pid, grace_s=0.5)
            _say(out, "specdec: second signal: killed")

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    if announce_ready:
        from specdec_cli.wait_ready import wait_ready

        threading.Thread(target=wait_ready, args=(ready_url(config),),
                         kwargs={"out": out, "stopped": stopping}, daemon=True).start()
    try:
        while True:
            try:
                status = child.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if since and time.monotonic() - since[0] > grace_s:
                    _say(out, f"specdec: still running {grace_s:.0f} s after the stop: "
                              "killing")
                    kill_session(child.pid)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    # Ray's workers notice their raylet is gone within seconds; a driver killed hard leaves
    # them running.
    deadline = time.monotonic() + 10
    while session_pids(child.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = kill_session(child.pid)
    if left:
        _say(out, f"specdec: ended {len(left)} leftover process(es) of the service")
    if not asked:
        return status if status >= 0 else 128 - status
    clean = status == 0 and not left
    _say(out, "specdec: stopped" if clean else f"specdec: stopped uncleanly (status {status})")
    return 0 if clean else 1

