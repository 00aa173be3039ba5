"""XChaCha20-Poly1305 (IETF) with libsodium through PyNaCl: the async results' encryption.

`result` = base64(ciphertext ‖ 16-byte tag), no associated data, a fresh 24-byte nonce per job.
"""

from __future__ import annotations

import base64
import binascii
import secrets

from nacl.bindings import crypto_aead_xchacha20poly1305_ietf_decrypt, crypto_aead_xchacha20poly1305_ietf_encrypt

from llmserver.errors import InvalidRequest

KEY_BYTES = 32
NONCE_BYTES = 24
METHOD = "xchacha20"


def decode_key(encoded: str) -> bytes:
    """The client's key: base64 of exactly 32 bytes, else 400 naming `key` (without echoing it)."""
    try:
        key = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("key must be base64 of exactly 32 bytes.", param="key") from None
    if len(key) != KEY_BYTES:
        raise InvalidRequest(f"key must be base64 of exactly 32 bytes, not {len(key)}.", param="key")
    return key


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def encrypt(plaintext: bytes, key: bytes, nonce: bytes) -> str:
    return b64(crypto_aead_xchacha20poly1305_ietf_encrypt(plaintext, None, nonce, key))


def decrypt(result: str, key: bytes, nonce: bytes) -> bytes:
    """The plaintext of a result; raises nacl.exceptions.CryptoError if it was tampered with."""
    return bytes(crypto_aead_xchacha20poly1305_ietf_decrypt(base64.b64decode(result), None, nonce, key))
