"""A free local TCP port, for a server of our own (tests, benchmarks, local Ray)."""

import random
import socket
from pathlib import Path

# Ray's workers take ports 10002-19999 by default; the kernel hands out its ephemeral range
# (32768-60999 on Linux) to every outgoing connection and every bind to port 0, Ray's gRPC
# servers among them. A port chosen between the two stays free until our server binds it,
# where one the kernel chose (bind to 0) can be handed to another process meanwhile.
_LOW = 20000
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_pick = random.SystemRandom()  # not the random module's state, which tests may seed


def _range() -> tuple[int, int] | None:
    try:
        first = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (_LOW, first - 1) if first - 1 - _LOW >= 1000 else None


def free_port(host: str = "127.0.0.1") -> int:
    """host "": free on every interface (a rendezvous other nodes connect to)."""
    span = _range()
    for _ in range(200 if span else 0):
        port = _pick.randint(*span)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no range known: the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]
