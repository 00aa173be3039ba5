"""Sniffing decides from the bytes, not the name; text decoding has a fallback that cannot fail."""

from __future__ import annotations

import codecs

from llmserver.inputs.formats import decode_text, is_html, sniff
from tests.support import documents


def test_documents_are_known_by_their_contents() -> None:
    assert sniff(documents.make_docx()).format == "Word document"
    assert sniff(documents.make_xlsx()).format == "Excel workbook"
    assert sniff(documents.make_pptx()).format == "PowerPoint presentation"
    assert sniff(documents.make_pdf()).format == "PDF document"
    assert sniff(documents.make_zip({"a.txt": b"hello"})).family == "archive"
    assert sniff(b"def main():\n    return 0\n").family == "text"


def test_media_and_binaries_are_not_text() -> None:
    assert sniff(documents.PNG).family == "image"
    assert sniff(documents.MP4).family == "video"
    assert sniff(b"ID3\x04\x00" + bytes(100)).family == "audio"
    assert sniff(b"RIFF\x00\x00\x00\x00WAVEfmt ").family == "audio"
    assert sniff(b"\x7fELF\x02\x01\x01" + bytes(100)).family == "binary"
    assert sniff(bytes(range(256)) * 4).family == "binary"


def test_an_encrypted_office_file_is_recognised() -> None:
    cfb = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(500) + "EncryptedPackage".encode("utf-16-le")
    assert sniff(cfb).family == "encrypted"
    assert sniff(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(500)).family == "binary"


def test_text_decoding() -> None:
    assert decode_text("héllo".encode()) == "héllo"
    assert decode_text(codecs.BOM_UTF8 + "héllo".encode()) == "héllo"
    assert decode_text(codecs.BOM_UTF16_LE + "héllo".encode("utf-16-le")) == "héllo"
    assert decode_text(codecs.BOM_UTF16_BE + "héllo".encode("utf-16-be")) == "héllo"
    assert decode_text("héllo".encode("latin-1")) == "héllo"  # not UTF-8: Latin-1
    assert sniff(codecs.BOM_UTF16_LE + "hi there".encode("utf-16-le")).family == "text"


def test_html_is_told_from_other_markup() -> None:
    assert is_html(b"  <!DOCTYPE html><html><body>x</body></html>")
    assert not is_html(b"<?xml version='1.0'?><root/>")
