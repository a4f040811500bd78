"""How much other processes' wake-ups cost a CPU decode step: the config's target in this
process, one row, one token, timed quiet, beside a synthetic waker (a child process that
wakes `rate` times a second and spins `--spin-us` each time), and, given `--freeze PID...`
(a running service's processes), beside them as they run. Those PIDs are stopped (SIGSTOP,
then SIGCONT: only the PIDs given, about a second at a time) during every other condition,
so "quiet" is quiet with a service loaded too.

    .venv/bin/python -m specdec_bench.host_noise [--rates 100 1000 2000] [--rounds 5]
    .venv/bin/python -m specdec_bench.host_noise --freeze $(pgrep -f 'ray::|raylet|gcs_server')

Why: a step's two OpenMP threads meet at a barrier after every linear layer, so a thread
preempted for a few microseconds holds its partner too; a step pays for other processes'
wake-ups far beyond the CPU they use. The conditions alternate round by round so the
machine's drift hits them alike; each cell is the median over rounds of the median step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time

import torch

from specdec.engine.spec import EngineSpec
from specdec.model.step.batch import BatchInput
from specdec.model.step.decoder import Decoder
from specdec.pack import hub
from specdec.progress import Progress
from specdec_bench.table import print_table

BESIDE = "beside the PIDs"
WAKER = """
import sys, time
period, spin = 1.0 / float(sys.argv[1]), float(sys.argv[2]) / 1e6
while True:
    time.sleep(period)
    t = time.perf_counter()
    while time.perf_counter() - t < spin:
        pass
"""


def switches(pids: list[int]) -> int:
    """Context switches so far of every thread of these processes (gone ones count 0)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    total += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
    return total


def _wait_stopped(pids: list[int], timeout_s: float = 2.0) -> None:
    """A signal is delivered asynchronously: time nothing until every PID shows stopped."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in "TtZX":
                        break
            except OSError:
                break
            time.sleep(0.001)


@contextlib.contextmanager
def condition(name: str, spin_us: float, freeze: list[int]):
    waker = None
    if name.startswith("waker "):
        rate = name.split()[1].removesuffix("/s")
        waker = subprocess.Popen([sys.executable, "-c", WAKER, rate, str(spin_us)])
        time.sleep(0.3)  # started and sleeping
    frozen = name != BESIDE and bool(freeze)
    if frozen:
        for pid in freeze:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        _wait_stopped(freeze)
    try:
        yield
    finally:
        if waker is not None:
            waker.kill()
            waker.wait()
        if frozen:
            for pid in freeze:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="serve_config.yaml")
    ap.add_argument("--rates", type=int, nargs="*", default=[100, 1000, 2000],
                    help="synthetic wake-ups per second")
    ap.add_argument("--spin-us", type=float, default=20.0, help="work per wake-up")
    ap.add_argument("--freeze", type=int, nargs="*", default=[],
                    help="PIDs of a running service: timed running and stopped")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    spec = EngineSpec.from_config_file(args.config)
    model = Decoder.from_checkpoint(hub.resolve(spec.target.model), spec.target.dtype, "cpu")
    cache = model.new_cache(1, args.context + 16)
    g = torch.Generator().manual_seed(0)
    model(BatchInput.build([(0, 0, torch.randint(100, 1000, (args.context,),
                                                 generator=g).tolist())], "cpu"), cache)
    batch = BatchInput.build([(0, args.context, [7])], "cpu")  # rolled back every step
    names = ["quiet"] + [f"waker {r}/s" for r in args.rates]
    if args.freeze:
        names.append(BESIDE)
    steps: dict[str, list[float]] = {n: [] for n in names}
    woke: dict[str, list[float]] = {n: [] for n in names}
    progress = Progress("host noise", total=len(names) * args.rounds, unit=" cells")
    for _ in range(args.rounds):
        for name in names:
            with condition(name, args.spin_us, args.freeze):
                times, t0, s0 = [], time.perf_counter(), switches(args.freeze)
                for _ in range(args.steps):
                    t = time.perf_counter()
                    model(batch, cache)
                    times.append(1e3 * (time.perf_counter() - t))
                woke[name].append((switches(args.freeze) - s0) / (time.perf_counter() - t0))
            steps[name].append(statistics.median(times))
            progress.advance()
    progress.close()
    quiet = statistics.median(steps["quiet"])
    rows = [{"condition": n, "step_ms": statistics.median(v), "q1": min(v), "q3": max(v),
             "vs_quiet": statistics.median(v) / quiet,
             "pid_switches_per_s": statistics.median(woke[n]) if args.freeze else ""}
            for n, v in steps.items()]
    print_table(rows, ["condition", "step_ms", "q1", "q3", "vs_quiet", "pid_switches_per_s"],
                title=f"{spec.target.model} ({spec.target.dtype}) decode step, 1 row, "
                      f"{args.context} tokens of context, {torch.get_num_threads()} threads; "
                      f"wakers spin {args.spin_us:g} us per wake-up; median of {args.rounds} "
                      f"rounds x {args.steps} steps (q1/q3: round min/max)"
                      + (f"; {len(args.freeze)} PIDs stopped but beside them" if args.freeze
                         else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
