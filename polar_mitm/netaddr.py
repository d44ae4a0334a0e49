"""Addresses: whether a host is this machine's loopback (what a server may bind without TLS, and
what a test may talk to). One check for `run`/`proxy`, `serve`, `view`, the viewer's Host header
and Ray's pinning."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback (what a server may bind without TLS)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
