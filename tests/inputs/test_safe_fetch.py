"""The outbound URL rules: only public http(s) addresses, checked once and pinned."""

from __future__ import annotations

import asyncio

import pytest

from llmserver.inputs.safe_fetch import PinnedResolver, UnsafeURL, check_url, is_public


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
