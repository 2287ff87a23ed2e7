"""Loopback TCP ports: a free one for a service about to start, and whether something listens on one."""
from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def port_open(host: str, port: int, timeout_s: float = 0.2) -> bool:
    """True when a TCP connection to ``host:port`` succeeds within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
