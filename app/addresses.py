"""How an address and port are written together: an IPv6 address in brackets, as URLs and gRPC targets write it."""

from __future__ import annotations


def host_port(host: str, port: int) -> str:
    """`127.0.0.1:8000`, `[::1]:8000`: `::1:8000` reads as an address alone."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def http_url(host: str, port: int) -> str:
    """The URL of a server listening at `host` and `port`."""
    return f"http://{host_port(host, port)}"
