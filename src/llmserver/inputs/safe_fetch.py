"""Outbound HTTP that cannot be pointed at the server's own network (SSRF-checked).

Rules: http or https only; the host name is resolved once and every address must be globally
routable (loopback, private, link-local with 169.254.169.254, CGNAT, multicast, reserved and their
IPv4-mapped forms are refused); the connection goes to the addresses that were checked, never to a
second lookup (DNS rebinding); redirects are not followed; connect and total times are capped.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from llmserver.errors import InvalidRequest

MAX_URL_LENGTH = 2048


class UnsafeURL(InvalidRequest):
    """A URL the server will not fetch; the message says why, without internal details."""


@dataclass(frozen=True)
class CheckedURL:
    url: str
    host: str
    port: int
    addresses: tuple[str, ...]


def is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


async def check_url(url: str, *, param: str, allow_private: bool = False) -> CheckedURL:
    """Validate and resolve `url`; UnsafeURL (400) if it must not be fetched."""
    if len(url) > MAX_URL_LENGTH:
        raise UnsafeURL(f"{param} is longer than {MAX_URL_LENGTH} characters.", param=param)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UnsafeURL(f"{param} must be an http or https URL with a host.", param=param)
    if parts.username or parts.password:
        raise UnsafeURL(f"{param} must not carry credentials.", param=param)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise UnsafeURL(f"{param} has an invalid port.", param=param) from None
    host = parts.hostname
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise UnsafeURL(f"{param}: the host name does not resolve.", param=param) from None
    addresses = tuple(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise UnsafeURL(f"{param}: the host name does not resolve.", param=param)
    if not allow_private and not all(is_public(a) for a in addresses):
        raise UnsafeURL(f"{param} points to a private, loopback or reserved address.", param=param)
    return CheckedURL(url=url, host=host, port=port, addresses=addresses)


class PinnedResolver(AbstractResolver):
    """Answers only with the addresses that were checked: no second lookup can swap them."""

    def __init__(self, checked: CheckedURL) -> None:
        self._checked = checked

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        if host != self._checked.host:
            raise OSError(f"unexpected host {host!r}")
        results: list[ResolveResult] = []
        for address in self._checked.addresses:
            ip = ipaddress.ip_address(address)
            results.append(
                {
                    "hostname": host,
                    "host": address,
                    "port": port,
                    "family": socket.AF_INET6 if ip.version == 6 else socket.AF_INET,
                    "proto": 0,
                    "flags": socket.AI_NUMERICHOST,
                }
            )
        return results

    async def close(self) -> None:
        return None


async def post_json(checked: CheckedURL, payload: Any, *, timeout: float) -> int:
    """POST JSON to a checked URL, redirects not followed; the HTTP status (raises on network errors)."""
    connector = aiohttp.TCPConnector(resolver=PinnedResolver(checked), use_dns_cache=False)
    client_timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=min(5.0, timeout))
    async with (
        aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session,
        session.post(checked.url, json=payload, allow_redirects=False) as response,
    ):
        await response.read()
        return response.status
