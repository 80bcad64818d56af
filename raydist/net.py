"""Ports: a free one, and whether one is free. A leaf module (the standard library only), for raydist,
its tests and its benchmarks alike."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` now ("": every interface), picked by the OS. Another process may
    take it before it is used: callers that bind it later check again (`port_is_free`) or retry."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "") -> bool:
    """Whether TCP ``port`` can be bound on ``host`` now ("": every interface)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
