"""A dependency-free progress line for long jobs (model fetch, conversion, benchmark sweeps).

Writes to stderr; on a terminal it redraws one line, elsewhere (CI logs) it prints a line
every few seconds so the log shows the job is alive without flooding it.
"""

from __future__ import annotations

import sys
import time


def _human(n: float, unit: str) -> str:
    if unit != "B":
        return f"{n:.0f}{unit}" if n >= 10 else f"{n:.2f}{unit}"
    for suffix in ("B", "KB", "MB", "GB"):
        if n < 1024 or suffix == "GB":
            return f"{n:.0f}{suffix}" if suffix == "B" else f"{n:.1f}{suffix}"
        n /= 1024
    return f"{n:.1f}GB"


class Progress:
    def __init__(
        self,
        label: str,
        total: float | None = None,
        unit: str = "",
        every_s: float = 5.0,
    ) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.done = 0.0
        self.start = self._last = time.monotonic()
        self.every_s = every_s
        self._tty = sys.stderr.isatty()

    def advance(self, n: float = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self._tty or now - self._last >= self.every_s:
            self._last = now
            self._emit(end="\r" if self._tty else "\n")

    def _emit(self, end: str) -> None:
        elapsed = time.monotonic() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        line = f"{self.label}: {_human(self.done, self.unit)}"
        if self.total:
            line += f" / {_human(self.total, self.unit)} ({100 * self.done / self.total:.0f}%)"
        line += f"  {_human(rate, self.unit)}/s  {elapsed:.0f}s"
        sys.stderr.write(line.ljust(78) + end)
        sys.stderr.flush()

    def close(self) -> None:
        self._emit(end="\n")
