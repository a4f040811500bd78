"""`specdec wait-ready` (what `specdec serve` runs beside the service): each start-up phase once,
then READY when /health answers 200."""

from __future__ import annotations

import http.server
import io
import json
import threading

from specdec_cli.wait_ready import wait_ready


def test_prints_each_phase_once_then_ready():
    answers = [(503, "not ready: the engine is starting: loading the target model (3 s)"),
               (503, "not ready: the engine is starting: loading the target model (4 s)"),
               (503, "not ready: the engine is starting: calibrating the step costs (9 s)"),
               (200, None)]

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            status, reason = answers.pop(0) if len(answers) > 1 else answers[0]
            body = json.dumps({"status": "starting", "reason": reason} if reason
                              else {"status": "ok"}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = io.StringIO()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert wait_ready(url, timeout_s=30, poll_s=0.01, out=out)
        lines = out.getvalue().splitlines()
        assert len(lines) == 3, lines  # the repeated phase is printed once
        assert "loading the target model" in lines[0]
        assert "calibrating the step costs" in lines[1]
        assert lines[2].startswith(f"specdec: READY, taking requests at {url}/v1")
    finally:
        server.shutdown()


def test_gives_up_when_nothing_answers():
    out = io.StringIO()
    assert not wait_ready("http://127.0.0.1:9", timeout_s=0.3, poll_s=0.05, out=out)
    assert "not listening yet" in out.getvalue() and "still not ready" in out.getvalue()
