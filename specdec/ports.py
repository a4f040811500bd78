"""A free local TCP port, for a server of our own (tests, benchmarks, local Ray)."""

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """host "": free on every interface (a rendezvous other nodes connect to)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
