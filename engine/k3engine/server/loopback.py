"""Whether an address is this machine's own: the default bind rule (server/main.py) and
the loopback-only routes (GET /k3/steps) ask the same question."""
from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False                     # a name: it may resolve anywhere
    mapped = getattr(ip, "ipv4_mapped", None)        # ::ffff:127.0.0.1 from a v6 socket
    return (mapped or ip).is_loopback


__all__ = ["is_loopback"]
