"""Outbound HTTP that cannot be pointed at the server's own network (SSRF-checked).

Rules: http or https only; the host name is resolved once and every address must be globally
routable (loopback, private, link-local with 169.254.169.254, CGNAT, multicast, reserved and their
IPv4-mapped forms are refused); the connection goes to the addresses that were checked, never to a
second lookup (DNS rebinding); connect and total times are capped. Webhooks follow no redirects;
fetches follow a few (`max_redirects`), each checked like the first, and stop reading at their size limit.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from llmserver.errors import InvalidRequest, RequestTooLarge

MAX_URL_LENGTH = 2048  # the default of the settings' limits.max_url_length (image and webhook URLs)
_REDIRECTS = (301, 302, 303, 307, 308)


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


Resolve = Callable[[str, int], Awaitable[list[str]]]


async def system_resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


async def check_url(
    url: str,
    *,
    param: str,
    allow_private: bool = False,
    allow_hosts: Collection[str] = (),
    resolve: Resolve = system_resolve,
    max_length: int = MAX_URL_LENGTH,
) -> CheckedURL:
    """Validate and resolve `url`; UnsafeURL (400) if it must not be fetched.

    `allow_hosts` ("host:port") and `allow_private` exist for tests, whose servers are all local."""
    if len(url) > max_length:
        raise UnsafeURL(f"{param} is longer than {max_length} characters.", param=param)
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
        addresses = tuple(dict.fromkeys(await resolve(host, port)))
    except (OSError, UnicodeError):
        raise UnsafeURL(f"{param}: the host name does not resolve.", param=param) from None
    if not addresses:
        raise UnsafeURL(f"{param}: the host name does not resolve.", param=param)
    allowed = allow_private or f"{host}:{port}" in allow_hosts
    if not allowed and not all(is_public(a) for a in addresses):
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


async def fetch_bytes(
    url: str,
    *,
    param: str,
    max_bytes: int,
    max_redirects: int,
    max_url_length: int,
    timeout: float,
    allow_hosts: Collection[str] = (),
    resolve: Resolve = system_resolve,
) -> bytes:
    """GET a public URL's body: every hop checked, at most `max_redirects` redirects, `max_bytes`
    read at most (413 beyond), all within `timeout`. Failures are 400s that say what went wrong."""
    try:
        async with asyncio.timeout(timeout):
            for _ in range(max_redirects + 1):
                checked = await check_url(
                    url, param=param, allow_hosts=allow_hosts, resolve=resolve, max_length=max_url_length
                )
                status, location, body = await _get_once(checked, max_bytes, param)
                if status in _REDIRECTS and location:
                    url = urljoin(url, location)
                    continue
                if status != 200:
                    raise InvalidRequest(f"{param}: fetching the URL answered HTTP {status}.", param=param)
                return body
    except TimeoutError:
        raise InvalidRequest(f"{param}: fetching the URL took longer than {timeout:g} s.", param=param) from None
    except aiohttp.ClientError:
        raise InvalidRequest(f"{param}: the URL could not be fetched.", param=param) from None
    raise InvalidRequest(f"{param}: the URL redirects more than {max_redirects} times.", param=param)


async def _get_once(checked: CheckedURL, max_bytes: int, param: str) -> tuple[int, str | None, bytes]:
    connector = aiohttp.TCPConnector(resolver=PinnedResolver(checked), use_dns_cache=False)
    client_timeout = aiohttp.ClientTimeout(sock_connect=5.0)
    async with (
        aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session,
        session.get(checked.url, allow_redirects=False) as response,
    ):
        if response.status in _REDIRECTS:
            return response.status, response.headers.get("Location"), b""
        too_large = RequestTooLarge(f"{param}: the URL's content is larger than {max_bytes // 2**20} MB.", param=param)
        if response.content_length is not None and response.content_length > max_bytes:
            raise too_large
        body = bytearray()
        async for chunk in response.content.iter_chunked(64 * 1024):
            body += chunk
            if len(body) > max_bytes:
                raise too_large
        return response.status, None, bytes(body)
