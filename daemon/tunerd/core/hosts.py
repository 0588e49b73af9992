"""Host names and addresses (pure, no name resolution)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 (bracketed or not) or `localhost`; any other name counts as not loopback (it
    is not resolved: a name can point anywhere)."""
    name = host.strip().strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
