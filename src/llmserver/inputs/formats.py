"""What a file really is, from its bytes: the sniffing that decides how (and whether) it is read.

The declared MIME type and the file name are hints only: a PNG named `notes.txt` is still a PNG.
Pure functions, cheap enough to run on every upload before any extraction starts.
"""

from __future__ import annotations

import codecs
import io
import zipfile
from dataclasses import dataclass
from typing import Literal

from llmserver.inputs.archives import declared_entries

Family = Literal["document", "archive", "text", "image", "audio", "video", "binary", "encrypted"]

SNIFF_BYTES = 8192

# (magic at offset 0, family, format). Checked in order; the longer magics come first where they overlap.
_MAGIC: tuple[tuple[bytes, Family, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "image", "PNG image"),
    (b"\xff\xd8\xff", "image", "JPEG image"),
    (b"GIF87a", "image", "GIF image"),
    (b"GIF89a", "image", "GIF image"),
    (b"II*\x00", "image", "TIFF image"),
    (b"MM\x00*", "image", "TIFF image"),
    (b"\x00\x00\x01\x00", "image", "ICO image"),
    (b"8BPS", "image", "Photoshop image"),
    (b"ID3", "audio", "MP3 audio"),
    (b"OggS", "audio", "Ogg media"),
    (b"fLaC", "audio", "FLAC audio"),
    (b"MThd", "audio", "MIDI audio"),
    (b"#!AMR", "audio", "AMR audio"),
    (b"\x1aE\xdf\xa3", "video", "Matroska/WebM video"),
    (b"FLV\x01", "video", "FLV video"),
    (b"\x00\x00\x01\xba", "video", "MPEG video"),
    (b"\x00\x00\x01\xb3", "video", "MPEG video"),
    (b"\x7fELF", "binary", "ELF executable"),
    (b"MZ", "binary", "Windows executable"),
    (b"\x1f\x8b", "binary", "gzip archive"),
    (b"BZh", "binary", "bzip2 archive"),
    (b"\xfd7zXZ\x00", "binary", "xz archive"),
    (b"7z\xbc\xaf\x27\x1c", "binary", "7-Zip archive"),
    (b"Rar!\x1a\x07", "binary", "RAR archive"),
    (b"(\xb5/\xfd", "binary", "zstd archive"),
    (b"SQLite format 3\x00", "binary", "SQLite database"),
    (b"\x00asm", "binary", "WebAssembly module"),
    (b"GGUF", "binary", "GGUF model"),
)

_CFB = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"  # OLE compound file: legacy Office, or encrypted OOXML
_ZIP = (b"PK\x03\x04", b"PK\x05\x06")

_OPENDOCUMENT = {
    "application/vnd.oasis.opendocument.text": "OpenDocument text",
    "application/vnd.oasis.opendocument.spreadsheet": "OpenDocument spreadsheet",
    "application/vnd.oasis.opendocument.presentation": "OpenDocument presentation",
}

# Office files hold tens of members; a ZIP directory larger than this is not parsed to find out.
_MAX_CONTAINER_ENTRIES = 1000

# Text formats that are converted rather than passed through as they are.
HTML_START = (b"<!doctype html", b"<html")


@dataclass(frozen=True)
class Sniffed:
    family: Family
    format: str  # a name for people: "PDF document", "PNG image", "text"

    @property
    def readable(self) -> bool:
        return self.family in ("document", "archive", "text")


def sniff(data: bytes) -> Sniffed:
    """The file's family and format from its leading bytes (and, for ZIP containers, its directory)."""
    head = data[:SNIFF_BYTES]
    # A ZIP first, by its structure: a stored ZIP holds its members' bytes as they are, so a PDF's
    # header may sit anywhere in the first kilobyte of one.
    if head.startswith(_ZIP) or has_zip_directory(data):
        return _sniff_zip(data)
    if b"%PDF-" in head[:1024]:
        return Sniffed("document", "PDF document")
    if head.startswith(_CFB):
        if "EncryptedPackage".encode("utf-16-le") in data:
            return Sniffed("encrypted", "password-protected Office document")
        return Sniffed("binary", "legacy Office (.doc/.xls/.ppt) document")
    riff = _sniff_riff(head)
    if riff is not None:
        return riff
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand in (b"M4A ", b"M4B ", b"M4P "):
            return Sniffed("audio", "MPEG-4 audio")
        if brand in (b"avif", b"avis", b"heic", b"heix", b"mif1", b"msf1"):
            return Sniffed("image", "HEIF/AVIF image")
        return Sniffed("video", "MPEG-4/QuickTime video")
    for magic, family, name in _MAGIC:
        if head.startswith(magic):
            return Sniffed(family, name)
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0 and not _looks_like_text(head):
        return Sniffed("audio", "MPEG audio")
    if _looks_like_text(head):
        return Sniffed("text", "text")
    return Sniffed("binary", "binary data")


def has_zip_directory(data: bytes) -> bool:
    """Whether the bytes end as a ZIP does: an end-of-central-directory record whose directory (just
    before it) starts with a central directory entry. Data before the archive (a self-extracting
    stub, another file's bytes) does not matter, as for every ZIP reader."""
    end = data.rfind(b"PK\x05\x06", max(0, len(data) - 65_557))
    if end < 0 or end + 22 > len(data):
        return False
    size = int.from_bytes(data[end + 12 : end + 16], "little")
    if size == 0xFFFFFFFF:  # ZIP64: let zipfile find the directory
        try:
            return zipfile.is_zipfile(io.BytesIO(data))
        except (zipfile.BadZipFile, ValueError, EOFError):  # a multi-disk archive, a broken ZIP64 record
            return False
    return size > 0 and data[end - size : end - size + 4] == b"PK\x01\x02"


def _sniff_riff(head: bytes) -> Sniffed | None:
    if not head.startswith(b"RIFF") or len(head) < 12:
        return None
    kind = head[8:12]
    if kind == b"WEBP":
        return Sniffed("image", "WEBP image")
    if kind == b"WAVE":
        return Sniffed("audio", "WAV audio")
    if kind == b"AVI ":
        return Sniffed("video", "AVI video")
    return Sniffed("binary", "RIFF media")


def _sniff_zip(data: bytes) -> Sniffed:
    """Office, OpenDocument and EPUB files are ZIPs known by their members; other ZIPs are archives."""
    entries = declared_entries(data)
    if entries is None or entries > _MAX_CONTAINER_ENTRIES:
        return Sniffed("archive", "ZIP archive")  # not parsed here: the archive limits judge it in the child
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = set(archive.namelist())
            if "mimetype" in names:
                info = archive.getinfo("mimetype")
                mimetype = archive.read(info).decode("ascii", "replace").strip() if info.file_size < 256 else ""
                if mimetype == "application/epub+zip":
                    return Sniffed("document", "EPUB book")
                if mimetype in _OPENDOCUMENT:
                    return Sniffed("document", _OPENDOCUMENT[mimetype])
            if "[Content_Types].xml" in names:
                if "word/document.xml" in names:
                    return Sniffed("document", "Word document")
                if "xl/workbook.xml" in names:
                    return Sniffed("document", "Excel workbook")
                if "ppt/presentation.xml" in names:
                    return Sniffed("document", "PowerPoint presentation")
    except (zipfile.BadZipFile, ValueError, NotImplementedError, RuntimeError, EOFError):
        return Sniffed("archive", "ZIP archive")  # reported as corrupt when it is opened for real
    return Sniffed("archive", "ZIP archive")


def _looks_like_text(head: bytes) -> bool:
    """Text in a common encoding: a Unicode BOM, or no NUL bytes and few control characters."""
    if head.startswith((codecs.BOM_UTF8, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return True
    if not head:
        return True
    if b"\x00" in head:
        return False
    controls = sum(1 for byte in head if byte < 32 and byte not in (9, 10, 12, 13, 27))
    return controls <= len(head) // 100


def decode_text(data: bytes) -> str:
    """Bytes to text: a BOM decides (UTF-8, UTF-16), else UTF-8, else Latin-1 (which cannot fail)."""
    for bom, codec in (
        (codecs.BOM_UTF8, "utf-8"),
        (codecs.BOM_UTF32_LE, "utf-32-le"),
        (codecs.BOM_UTF32_BE, "utf-32-be"),
        (codecs.BOM_UTF16_LE, "utf-16-le"),
        (codecs.BOM_UTF16_BE, "utf-16-be"),
    ):
        if data.startswith(bom):
            return data[len(bom) :].decode(codec, errors="replace")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def is_html(data: bytes) -> bool:
    start = data[:512].lstrip(codecs.BOM_UTF8).lstrip().lower()
    return start.startswith(HTML_START)
