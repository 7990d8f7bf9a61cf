"""Network helpers with no component behind them (the config's address checks, process-group set-up, tests and
benchmarks use them): loopback detection, the host of a URL, a free TCP port."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlparse


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (bind to port 0, read it, close): for single-process process
    groups, test rendezvous and benchmarks. Another process may take it before the caller binds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1 (an address remote servers cannot reach us at)."""
    host = host.strip().strip("[]").lower()
    if host in ("localhost", "localhost.localdomain", "ip6-localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_host(url: str) -> str:
    """Host part of a server URL ("http://node7:30000" -> "node7")."""
    return urlparse(url if "://" in url else f"http://{url}").hostname or ""
