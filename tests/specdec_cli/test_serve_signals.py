"""`specdec serve`'s parent on a terminal that went away: a stop signal reaches the driver
even when telling the user about it fails (specdec_cli/serve.py)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time

from specdec_cli import serve

# A stand-in driver: serves until SIGINT, then exits cleanly.
DRIVER = ("import signal, sys, time\n"
          "signal.signal(signal.SIGINT, lambda *_: sys.exit(0))\n"
          "print('up', flush=True)\n"
          "while True: time.sleep(0.1)\n")


class ClosedTerminal:
    def write(self, _text):
        raise OSError(errno.EIO, "Input/output error")

    def flush(self):
        raise OSError(errno.EIO, "Input/output error")


def test_a_hangup_on_a_closed_terminal_still_stops_the_driver(monkeypatch):
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen(cmd, **kw):
        child = real_popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, **kw)
        child.stdout.readline()  # it has installed its handler
        started.append(child)
        return child

    monkeypatch.setattr(serve.subprocess, "Popen", popen)
    monkeypatch.setattr(serve, "session_pids", lambda sid: [])
    hangup = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGHUP))
    hangup.start()
    t0 = time.monotonic()
    status = serve.run_serve("unused.yaml", grace_s=20, announce_ready=False,
                             out=ClosedTerminal())
    assert status == 0 and started[0].poll() == 0, (status, started[0].poll())
    assert time.monotonic() - t0 < 15
