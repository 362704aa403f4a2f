"""The edge's HTTPS: a server TLS context from ``edge.tls_cert`` / ``edge.tls_key``.

HTTP/1.1 only (aiohttp); HTTP/2 and HTTP/3 belong to a proxy in front, see
docs/security.md for the settings that keep streams unbuffered there.
"""

from __future__ import annotations

import ipaddress
import logging
import ssl

from tidegate.config import EdgeConfig
from tidegate.errors import ConfigError

log = logging.getLogger("tidegate.edge")


def server_tls_context(config: EdgeConfig) -> ssl.SSLContext | None:
    """The context to serve HTTPS with, or None for plain HTTP."""
    if not config.tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"edge.tls_cert / edge.tls_key: cannot load "
                          f"{config.tls_cert} / {config.tls_key}: {exc}") from None
    context.set_alpn_protocols(["http/1.1"])
    return context


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an edge.host value) accepts only local clients."""
    if host in ("localhost", ""):
        return host == "localhost"  # "" binds every interface
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it resolves to something public


def warn_if_public_plaintext(config: EdgeConfig) -> bool:
    """Warn when API keys and prompts would cross a network unencrypted."""
    if config.tls_cert or is_loopback(config.host):
        return False
    log.warning("the edge listens on %s without TLS: API keys and prompts travel in "
                "clear text; set edge.tls_cert / edge.tls_key or put a TLS proxy in front",
                config.host or "every interface")
    return True
