"""The peer's start-up: a llama-server build whose weight repacking crashes on this CPU (seen:
the AMX matmul segfaults in its warm-up) is rerun without repacking, and says so; any other
failure is reported, not retried. A stand-in executable plays the server (llama.cpp is not
part of the test set-up)."""

from __future__ import annotations

import textwrap

import pytest

from specdec_bench import llama_peer

FAKE = textwrap.dedent("""\
    #!/usr/bin/env python3
    # A stand-in llama-server: SIGSEGV at start-up unless --no-repack (or always, with
    # FAKE_ALWAYS_CRASH); otherwise answers /health on its --port.
    import http.server, os, signal, sys
    args = sys.argv[1:]
    if os.environ.get("FAKE_ALWAYS_CRASH") or "--no-repack" not in args:
        os.kill(os.getpid(), signal.SIGSEGV)
    port = int(args[args.index("--port") + 1])

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """)


@pytest.fixture
def fake_peer(tmp_path, monkeypatch):
    exe = tmp_path / "llama-server"
    exe.write_text(FAKE)
    exe.chmod(0o755)
    monkeypatch.setenv("SPECDEC_LLAMA_BIN", str(tmp_path))
    monkeypatch.setattr(llama_peer, "_NO_REPACK", False)
    return tmp_path / "model.gguf"


def test_a_repacking_crash_is_rerun_without_repacking_and_said(fake_peer):
    with llama_peer.LlamaServer(fake_peer, [], 1) as server:
        assert "--no-repack" in server.cmd
        assert "crashed" in server.fallback
        pid = server.proc.pid
        assert server.proc.poll() is None
    # The next server of this process starts without repacking at once.
    second = llama_peer.LlamaServer(fake_peer, ["--spec-type", "ngram-mod"], 1)
    with second:
        assert second.cmd.count("--no-repack") == 1 and second.fallback
    assert second.proc.poll() is not None and pid != second.proc.pid


def test_a_crash_without_repacking_is_reported(fake_peer, monkeypatch):
    monkeypatch.setenv("FAKE_ALWAYS_CRASH", "1")
    with pytest.raises(RuntimeError, match=r"exited \(-11\)"), \
            llama_peer.LlamaServer(fake_peer, [], 1):
        pass
