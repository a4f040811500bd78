"""`specdec serve CONFIG` stopped every way a user or a service manager stops it: Ctrl-C
(SIGINT to the terminal's process group), SIGTERM to the process, SIGTERM to its process
group (systemd's and most scripts' way). Each time: exit status 0, no abort or stack dump
in the log, no process of the service left, and the requests in flight at the signal
answered in full, not cut off. The app is the tiny fixture pair, started from a YAML
config the way users start serve_config.yaml."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from serve_helpers import tiny_app_args

from specdec.ports import free_port
from specdec_cli.serve import session_pids

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp: Path, target, draft) -> tuple[Path, int]:
    port = free_port()
    cfg = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
           "applications": [{"name": "tiny", "route_prefix": "/",
                             "import_path": "deployments.app:build_app",
                             "args": tiny_app_args(target, draft)}]}
    path = tmp / "serve_config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, port


def _wait_ready(base: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        assert proc.poll() is None, "specdec serve exited while starting"
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("not ready in time")


def _stream(base: str, out: list, started: threading.Semaphore) -> None:
    """One streamed completion; records (status, tokens seen, finish reason, end time) and
    releases `started` at its first token, when the engine is surely running it."""
    tokens, finish = 0, None
    try:
        with httpx.stream("POST", f"{base}/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": "w5 w6", "max_tokens": 100, "ignore_eos": True,
                "stream": True, "speculative": {"mode": "off"}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    tokens += 1
                    if tokens == 1:
                        started.release()
                    if '"finish_reason": "' in line:
                        finish = line.split('"finish_reason": "')[1].split('"')[0]
            out.append((r.status_code, tokens, finish, time.monotonic()))
    except httpx.HTTPError as exc:
        out.append((repr(exc), tokens, finish, time.monotonic()))


def _as_a_background_job() -> None:
    # What a non-interactive shell does to a command run with `&`: SIGINT ignored, which
    # the process and its children inherit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigterm-group", "sigterm-background"])
def test_every_way_of_stopping_drains_and_exits_cleanly(how, tmp_path, tiny_llama,
                                                        tiny_llama_draft):
    config, port = _config(tmp_path, tiny_llama, tiny_llama_draft)
    base = f"http://127.0.0.1:{port}"
    ray_tmp = Path(f"/tmp/sdstop-{os.getpid()}-{how}")  # Ray's socket paths must stay short
    env = dict(os.environ, RAY_TMPDIR=str(ray_tmp), PYTHONPATH=str(ROOT))
    log = tmp_path / "serve.log"
    with open(log, "w") as sink:
        # Its own process group, as a shell gives a job: the group signals reach only it.
        proc = subprocess.Popen([sys.executable, "-m", "specdec_cli.main", "serve", str(config),
                                 "--grace", "60"], cwd=ROOT, env=env, stdout=sink,
                                stderr=subprocess.STDOUT, process_group=0,
                                preexec_fn=_as_a_background_job
                                if how == "sigterm-background" else None)
    driver = None
    try:
        _wait_ready(base, proc)
        driver = next(p for p in _children(proc.pid))
        results: list = []
        started = threading.Semaphore(0)
        clients = [threading.Thread(target=_stream, args=(base, results, started))
                   for _ in range(6)]
        for t in clients:
            t.start()
        # Signal once all six are streaming: a request still on its way to the proxy at the
        # signal is not in flight (it meets an app being deleted), and on a slow machine
        # a fixed pause does not tell the two apart.
        for _ in clients:
            assert started.acquire(timeout=60), "a request never started streaming"
        signalled = time.monotonic()
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        elif how in ("sigterm", "sigterm-background"):
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        status = proc.wait(timeout=90)
        stopped_s = time.monotonic() - signalled
        for t in clients:
            t.join(timeout=60)
        text = log.read_text()
        assert status == 0, text[-3000:]
        for bad in ("SIGTERM received", "Aborted", "core dumped", "Traceback"):
            assert bad not in text, text[-3000:]
        assert "specdec: stopped" in text
        # Every request in flight was answered in full; some were still running at the signal.
        assert len(results) == 6
        assert all(r[0] == 200 and r[2] == "length" for r in results), results
        assert any(r[3] > signalled for r in results), "nothing was in flight at the signal"
        assert session_pids(driver) == [], "processes of the service outlived it"
        print(f"\n{how}: stopped in {stopped_s:.1f} s, exit 0, 6 requests in flight answered")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if driver is not None:
            for pid in session_pids(driver):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(["rm", "-rf", str(ray_tmp)], check=False)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(x) for x in out.split()]
