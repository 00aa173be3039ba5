"""The outbound URL rules: only public http(s) addresses, checked once and pinned."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from urllib.parse import quote, unquote

import pytest

from llmserver.errors import InvalidRequest, RequestTooLarge
from llmserver.inputs.safe_fetch import PinnedResolver, UnsafeURL, check_url, fetch_bytes, is_public
from tests.support.local_http import LocalHTTPServer, QuietHandler


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0",
        "224.0.0.1", "240.0.0.1", "::1", "fe80::1", "fc00::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "ff02::1",
    ],
)  # fmt: skip
def test_non_public_addresses(address: str) -> None:
    assert not is_public(address)


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2001:4860:4860::8888", "::ffff:8.8.8.8"])
def test_public_addresses(address: str) -> None:
    assert is_public(address)


@pytest.mark.parametrize(
    "url",
    [
        "ftp://8.8.8.8/x", "file:///etc/passwd", "http://", "http://127.0.0.1:9000/hook", "http://localhost/hook",
        "http://[::1]/hook", "http://169.254.169.254/latest/meta-data", "http://user:pw@8.8.8.8/", "http://10.0.0.1/",
        "http://0x7f000001/", "http://2130706433/", "http://no-such-host.invalid/", "http://8.8.8.8:99999/",
    ],
)  # fmt: skip
def test_refused_urls(url: str) -> None:
    with pytest.raises(UnsafeURL) as caught:
        asyncio.run(check_url(url, param="webhook_url"))
    assert caught.value.status == 400 and caught.value.param == "webhook_url"


def test_public_literal_is_accepted_and_pinned() -> None:
    async def scenario() -> None:
        checked = await check_url("https://8.8.8.8/hook", param="webhook_url")
        assert checked.addresses == ("8.8.8.8",) and checked.port == 443
        resolved = await PinnedResolver(checked).resolve("8.8.8.8", 443)
        assert [r["host"] for r in resolved] == ["8.8.8.8"]
        with pytest.raises(OSError):
            await PinnedResolver(checked).resolve("evil.example", 443)

    asyncio.run(scenario())


def test_private_allowed_only_when_asked() -> None:
    checked = asyncio.run(check_url("http://127.0.0.1:9/hook", param="webhook_url", allow_private=True))
    assert checked.addresses == ("127.0.0.1",)


# fetch_bytes against real HTTP servers on 127.0.0.1


class Files(QuietHandler):
    """/small: 1 KB; /big: 9 MB; /to?url=U: a 302 to U; /loop: a redirect to itself."""

    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        if path == "/to":
            self._redirect(unquote(query.removeprefix("url=")))
        elif path == "/loop":
            self._redirect("/loop")
        elif path in ("/small", "/big"):
            body = b"x" * (1024 if path == "/small" else 9 * 1024 * 1024)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(404)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def two_servers() -> Iterator[tuple[str, str]]:
    allowed, other = LocalHTTPServer(), LocalHTTPServer()
    allowed.serve(Files)
    other.serve(Files)
    yield allowed.base_url, other.base_url
    allowed.stop()
    other.stop()


def fetch(url: str, allowed_base: str, **options: object) -> bytes:
    allow = [allowed_base.removeprefix("http://")]
    request = fetch_bytes(
        url,
        param="image",
        max_bytes=8 * 1024 * 1024,
        max_redirects=3,
        max_url_length=2048,
        timeout=10,
        allow_hosts=allow,
        **options,  # type: ignore[arg-type]
    )
    return asyncio.run(request)


def test_an_allowed_server_is_fetched_and_a_large_body_cut_off(two_servers: tuple[str, str]) -> None:
    allowed, _ = two_servers
    assert fetch(allowed + "/small", allowed) == b"x" * 1024
    with pytest.raises(RequestTooLarge):
        fetch(allowed + "/big", allowed)
    with pytest.raises(InvalidRequest, match="HTTP 404"):
        fetch(allowed + "/missing", allowed)
    with pytest.raises(InvalidRequest, match="redirects more than 3 times"):
        fetch(allowed + "/loop", allowed)


def test_private_servers_are_refused_by_address_and_by_name(two_servers: tuple[str, str]) -> None:
    allowed, other = two_servers
    with pytest.raises(UnsafeURL, match="private, loopback or reserved"):
        fetch(other + "/small", allowed)
    port = other.rsplit(":", 1)[1]
    with pytest.raises(UnsafeURL, match="private, loopback or reserved"):
        fetch(f"http://localhost:{port}/small", allowed)


def test_a_redirect_to_a_private_server_is_refused(two_servers: tuple[str, str]) -> None:
    allowed, other = two_servers
    with pytest.raises(UnsafeURL, match="private, loopback or reserved"):
        fetch(f"{allowed}/to?url={quote(other + '/small', safe='')}", allowed)


def test_a_public_name_that_resolves_to_a_private_address_is_refused(two_servers: tuple[str, str]) -> None:
    allowed, other = two_servers
    port = int(other.rsplit(":", 1)[1])

    async def rebinding(host: str, port: int) -> list[str]:
        return ["127.0.0.1"] if host == "images.example.com" else ["93.184.215.14"]

    with pytest.raises(UnsafeURL, match="private, loopback or reserved"):
        fetch(f"http://images.example.com:{port}/small", allowed, resolve=rebinding)
