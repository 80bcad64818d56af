"""Paddle's TCP store client retries a refused connection only every 3 seconds.

Defect (Paddle 3.3.1, ``paddle/phi/core/distributed/store/tcp_utils.cc``:
``tcp_connect`` sleeps ``kDelay`` = 3 s after each refused attempt): a rank that
reaches ``init_parallel_env`` before rank 0's store listens waits for the next
attempt, up to 3 s after the store is up. Ranks start together, so this is paid
on most starts and restarts. raydist waits for the port itself, polling every
20 ms, so Paddle's first attempt connects. Rank 0's store serves connections
that close without a word (the probe's) and goes on.
"""

from __future__ import annotations

import socket
import time

POLL_S = 0.02


def wait_for_master(master: str, timeout_s: float = 600.0) -> bool:
    """Wait until ``master`` ("host:port") accepts a TCP connection; whether it did in
    ``timeout_s`` (if not, Paddle's own connect reports the failure)."""
    host, port = master.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
