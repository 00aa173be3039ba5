"""Base64 `data:` URIs, the form images and files arrive in: parsed and decoded within a size limit
that is judged from the base64 length first, so an oversized upload is refused without decoding it."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from llmserver.errors import InvalidRequest, RequestTooLarge


@dataclass(frozen=True)
class DataURI:
    media_type: str  # lower case, "" when the URI names none
    payload: str  # still base64


def parse(value: str) -> DataURI | None:
    """The parts of a base64 data: URI; None when `value` is not one."""
    if not value.startswith("data:"):
        return None
    header, comma, payload = value[5:].partition(",")
    if not comma or not header.lower().endswith(";base64"):
        return None
    return DataURI(header.split(";")[0].strip().lower(), payload.strip())


def decode(uri: DataURI, *, max_bytes: int, too_large: str, invalid: str, param: str) -> bytes:
    """The decoded bytes: RequestTooLarge (`too_large`) beyond `max_bytes`, InvalidRequest (`invalid`)
    for bad base64."""
    payload = uri.payload
    if (len(payload) * 3) // 4 - payload[-2:].count("=") > max_bytes:
        raise RequestTooLarge(too_large, param=param)
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(invalid, param=param) from None
    if len(raw) > max_bytes:
        raise RequestTooLarge(too_large, param=param)
    return raw
