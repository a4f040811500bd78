"""The noise benchmark's conditions: a waker runs only inside its condition, the PIDs given
are stopped in every condition but the one beside them and resumed after, and switches are
counted."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from specdec_bench.host_noise import BESIDE, condition, switches


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def children() -> set[int]:
    """This process's live children (Linux: each thread's children file)."""
    out: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            out |= {int(p) for p in f.read().split() if state(int(p)) not in "ZX"}
    return out


def test_a_waker_wakes_inside_its_condition_and_is_gone_after():
    before = children()
    with condition("waker 1000/s", 20.0, []):
        (waker,) = children() - before
        s0 = switches([waker])
        time.sleep(0.5)
        assert switches([waker]) - s0 > 200  # ~1000/s asked
    assert children() == before


def test_the_given_pids_are_stopped_except_beside_them_and_resumed_after():
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for name in ("quiet", "waker 100/s"):
            with condition(name, 20.0, [other.pid]):
                assert state(other.pid) == "T"
            time.sleep(0.1)  # SIGCONT is delivered asynchronously too
            assert state(other.pid) in "SR"
        with condition(BESIDE, 20.0, [other.pid]):
            assert state(other.pid) in "SR"
    finally:
        other.kill()
        other.wait()
    assert switches([other.pid]) == 0  # gone: counts nothing, raises nothing
