"""Our XChaCha20-Poly1305 results open with an independent implementation (pycryptodome)."""

from __future__ import annotations

import base64

import pytest

from llmserver.errors import InvalidRequest
from llmserver.jobs import crypto
from tests.support.jobs import independent_decrypt


def test_round_trip_against_pycryptodome() -> None:
    key, nonce = crypto.new_key(), crypto.new_nonce()
    assert (len(key), len(nonce)) == (32, 24)
    plaintext = '{"response": "héllo"}'.encode()
    result = crypto.encrypt(plaintext, key, nonce)
    assert len(base64.b64decode(result)) == len(plaintext) + 16
    assert independent_decrypt(result, key, nonce) == plaintext
    assert crypto.decrypt(result, key, nonce) == plaintext


def test_tampering_is_detected() -> None:
    key, nonce = crypto.new_key(), crypto.new_nonce()
    data = bytearray(base64.b64decode(crypto.encrypt(b"secret", key, nonce)))
    data[0] ^= 1
    with pytest.raises(ValueError):
        independent_decrypt(base64.b64encode(bytes(data)).decode(), key, nonce)


@pytest.mark.parametrize(
    "bad", ["", "not base64!", base64.b64encode(b"x" * 31).decode(), base64.b64encode(b"x" * 33).decode()]
)
def test_key_must_be_32_bytes_of_base64(bad: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        crypto.decode_key(bad)
    assert caught.value.param == "key"
    assert bad not in caught.value.message or not bad


def test_valid_key_decodes() -> None:
    raw = bytes(range(32))
    assert crypto.decode_key(base64.b64encode(raw).decode()) == raw
