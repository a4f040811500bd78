"""llama.cpp's llama-server, the peer CPU users run, started and driven for benchmarks.

Built by `make peer` (see the README); the binaries are looked up in peers/llama/build/bin
of this checkout or in $SPECDEC_LLAMA_BIN. It reads the very GGUF files the offline pack is
assembled from, so its rows and ours run the same weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from specdec.ports import free_port

ROOT = Path(__file__).resolve().parents[1]  # the repository root (specdec_bench/..)


def llama_bin(name: str = "llama-server") -> Path | None:
    for d in (os.environ.get("SPECDEC_LLAMA_BIN"), ROOT / "peers/llama/build/bin"):
        if d and (Path(d) / name).is_file():
            return Path(d) / name
    return None




def _post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


# True once a start-up crashed with repacking on: later servers of this process start without
# it at once.
_NO_REPACK = False


class LlamaServer:
    """One llama-server process (ours to stop, by its PID)."""

    def __init__(self, model: Path, args: list[str], threads: int, slots: int = 1,
                 ctx_per_slot: int = 4096) -> None:
        exe = llama_bin()
        if exe is None:
            raise FileNotFoundError("llama-server is not built: run `make peer`")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(exe), "-m", str(model), "-t", str(threads), "-tb", str(threads),
                    "-c", str(ctx_per_slot * slots), "-np", str(slots), "--host", "127.0.0.1",
                    "--port", str(self.port), "--no-webui", *args]
        # Set when the peer only runs with its weight repacking off (see _NO_REPACK).
        self.fallback: str | None = None
        if _NO_REPACK:
            self._no_repack()
        self._start()

    def _start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True)

    def _no_repack(self) -> None:
        self.cmd.append("--no-repack")
        self.fallback = ("--no-repack: with its default weight repacking this build "
                         "crashed at start-up (SIGSEGV)")

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}):\n{err}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"llama-server not ready after {timeout} s")

    def complete(self, prompt, n_predict: int, timeout: float = 600, **extra) -> dict:
        body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "top_k": 1,
                "cache_prompt": False, **extra}
        return _post(self.url + "/completion", body, timeout)

    def rss_bytes(self) -> int:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc.stderr.close()

    def __enter__(self) -> LlamaServer:
        try:
            try:
                self.wait_ready()
            except RuntimeError:
                # Seen on an AMX Xeon: the AMX repacked matmul (ggml_backend_amx_mul_mat)
                # segfaults on the first batch of more than one token, so the server dies
                # in its warm-up. Without repacking it runs (slower: llama-bench decode
                # 12.4 against 17.2 tokens/s there). Rows then say so.
                if self.proc.returncode != -signal.SIGSEGV or "--no-repack" in self.cmd:
                    raise
                global _NO_REPACK
                _NO_REPACK = True
                self.close()
                self._no_repack()
                self._start()
                self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def next_token_logprobs(server: LlamaServer, ids: list[int], top: int = 20) -> list[dict]:
    """Teacher-forced: for each position i >= 1 of ids, the peer's top-`top` log-probs of
    the token after ids[:i] (its prompt cache makes each request one new token)."""
    out = []
    for i in range(1, len(ids)):
        try:
            r = server.complete(ids[:i], 1, n_probs=top, cache_prompt=True, timeout=60)
        except TimeoutError:  # seen once: a cached-prompt request that never returned
            r = server.complete(ids[:i], 1, n_probs=top, cache_prompt=False, timeout=120)
        probs = r["completion_probabilities"][0]["top_logprobs"]
        out.append({p["id"]: p["logprob"] for p in probs})
    return out


# The peer's configurations in `bench served`: its plain decoding, its draft-model
# speculation at its defaults and as tuned in its docs, and its n-gram modes.
CONFIGS: list[tuple[str, list[str], bool]] = [
    ("plain", [], False),
    ("draft-simple (defaults)", ["--spec-type", "draft-simple"], True),
    ("draft-simple n-max 4 p-min 0.75",
     ["--spec-type", "draft-simple", "--spec-draft-n-max", "4", "--spec-draft-p-min", "0.75"],
     True),
    ("ngram-mod", ["--spec-type", "ngram-mod"], False),
    ("ngram-simple", ["--spec-type", "ngram-simple"], False),
]


def peer_rows(target: Path, draft: Path | None, prompts: list[list[int]], max_tokens: int,
              repeats: int, threads: int, progress=None) -> list[dict]:
    """One row per configuration: tokens/s per request (wall clock, prompt included, as
    ours are measured), its decode-only rate, acceptance and the server's resident memory."""
    from specdec_bench.table import median, percentile

    rows = []
    for name, args, needs_draft in CONFIGS:
        if needs_draft and draft is None:
            continue
        extra = ["-md", str(draft), "-td", str(threads)] if needs_draft else []
        rates, decode, drafted, accepted = [], [], 0, 0
        with LlamaServer(target, args + extra, threads) as server:
            server.complete(prompts[0], 8)  # warm: first-call allocations
            for _ in range(repeats):
                for ids in prompts:
                    t = time.perf_counter()
                    r = server.complete(ids, max_tokens, ignore_eos=True)
                    wall = time.perf_counter() - t
                    rates.append(r["tokens_predicted"] / wall)
                    tm = r["timings"]
                    decode.append(tm["predicted_per_second"])
                    drafted += tm.get("draft_n", 0)
                    accepted += tm.get("draft_n_accepted", 0)
                    if progress is not None:
                        progress.advance()
            rss = server.rss_bytes()
            fallback = server.fallback
        rows.append({"system": "llama.cpp", "config": name + (" [no-repack]" if fallback else ""),
                     "dtype": "GGUF as stored", "peer_note": fallback,
                     "runs": len(rates), "tokens_per_s": median(rates),
                     "q1": percentile(rates, 25), "q3": percentile(rates, 75),
                     "decode_only_tokens_per_s": median(decode),
                     "acceptance": accepted / drafted if drafted else None,
                     "rss_GB": rss / 1e9})
    return rows


def start_servers(stack, target: Path, draft: Path | None, modes: list[str],
                  threads: int | None, ctx_per_slot: int) -> dict[str, str]:
    """llama-server plain and in each --spec-type mode, one process each (one slot),
    warmed and held by `stack` (contextlib.ExitStack): mode name -> url."""
    threads = threads or os.cpu_count() or 2
    out = {}
    for name in ["plain", *modes]:
        extra = [] if name == "plain" else ["--spec-type", name]
        if name.startswith("draft"):
            extra += ["-md", str(draft), "-td", str(threads)]
        server = stack.enter_context(LlamaServer(target, extra, threads, slots=1,
                                                 ctx_per_slot=ctx_per_slot))
        server.complete([1, 2, 3], 4)  # warm: first-call allocations
        out[name] = server.url
    return out
