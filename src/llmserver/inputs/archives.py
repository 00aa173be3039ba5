"""Our own ZIP walker: every limit is checked from the central directory before a member is read.

markitdown's ZipConverter recurses with no size, count, depth or ratio limit, so archives (and
the ZIP containers inside Office and EPUB files) come through here first. Nothing is ever written
to disk, so member names only label sections; absolute and `..` parts are dropped from the label.
Runs in the extraction child, whose memory limit and timeout are the last line of defence.
"""

from __future__ import annotations

import io
import lzma
import posixpath
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

MIB = 1024 * 1024


class ArchiveLimits(BaseModel):
    """What one uploaded ZIP may hold: the settings section `limits.files.archive`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_entries: int = Field(default=1000, ge=1, description="Members in one uploaded ZIP, nested ones included (422).")
    max_total_bytes: int = Field(
        default=100 * MIB,
        ge=1024,
        description="Bytes one uploaded ZIP may unpack to, nested ones included (422 beyond).",
    )
    max_ratio: int = Field(
        default=200,
        ge=1,
        description="Unpacked/packed size of one ZIP member larger than ratio_floor (422 beyond: a zip bomb).",
    )
    ratio_floor: int = Field(
        default=MIB, ge=1, description="Members at most this large (bytes unpacked) may compress beyond max_ratio."
    )
    max_depth: int = Field(default=3, ge=1, le=16, description="ZIP nesting levels, the upload itself being 1 (422).")


class ArchiveRejected(Exception):
    """The archive breaks a limit or cannot be read; the whole file is refused (422)."""


@dataclass
class Budget:
    """What one upload may still spend, shared by every archive nested in it."""

    limits: ArchiveLimits
    entries: int = 0
    total_bytes: int = 0


def declared_entries(data: bytes) -> int | None:
    """The entry count the end-of-central-directory record declares, read without parsing the
    directory (100,000 entries take seconds to parse); None when the record cannot be found."""
    end = data.rfind(b"PK\x05\x06", max(0, len(data) - 65_557))
    if end < 0 or end + 22 > len(data):
        return None
    count = int.from_bytes(data[end + 10 : end + 12], "little")
    if count != 0xFFFF:
        return count
    # ZIP64: the count is in the ZIP64 end record, which a locator just before this one points to.
    locator = end - 20
    if locator >= 0 and data[locator : locator + 4] == b"PK\x06\x07":
        offset = int.from_bytes(data[locator + 8 : locator + 16], "little")
        if data[offset : offset + 4] == b"PK\x06\x06":
            return int.from_bytes(data[offset + 32 : offset + 40], "little")
    return None


def _too_many(label: str, limits: ArchiveLimits) -> ArchiveRejected:
    return ArchiveRejected(
        f"{label} holds too many entries: more than {limits.max_entries} in one upload, nested archives included."
    )


def open_checked(data: bytes, label: str, budget: Budget) -> zipfile.ZipFile:
    """The archive, after its central directory passed every limit (nothing decompressed yet)."""
    limits = budget.limits
    declared = declared_entries(data)
    if declared is not None and budget.entries + declared > limits.max_entries:
        raise _too_many(label, limits)
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, ValueError, NotImplementedError, EOFError) as exc:
        raise ArchiveRejected(f"{label} is not a readable ZIP archive ({exc}).") from None
    infos = archive.infolist()
    budget.entries += len(infos)
    if budget.entries > limits.max_entries:
        archive.close()
        raise _too_many(label, limits)
    for info in infos:
        if _is_folder(info):
            continue
        budget.total_bytes += info.file_size
        if budget.total_bytes > limits.max_total_bytes:
            archive.close()
            raise ArchiveRejected(
                f"{label} unpacks to more than {limits.max_total_bytes // MIB} MB, nested archives included."
            )
        if info.file_size > limits.ratio_floor and info.file_size > limits.max_ratio * max(info.compress_size, 1):
            archive.close()
            raise ArchiveRejected(
                f"{label}: the entry {member_label(info.filename)!r} expands more than {limits.max_ratio} times "
                "(a compression bomb)."
            )
    return archive


def read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, label: str) -> bytes:
    """A member's bytes, never more than its directory entry declared."""
    try:
        with archive.open(info) as member:
            data = member.read(info.file_size + 1)
    except (zipfile.BadZipFile, ValueError, NotImplementedError, EOFError, OSError, zlib.error, lzma.LZMAError) as exc:
        # zlib's and lzma's errors are not OSErrors: a corrupt deflate stream (found by fuzz/) raised zlib.error.
        raise ArchiveRejected(f"{label}: the entry {member_label(info.filename)!r} is corrupt ({exc}).") from None
    if len(data) > info.file_size:
        raise ArchiveRejected(f"{label}: the entry {member_label(info.filename)!r} is larger than its header says.")
    return data


def members(archive: zipfile.ZipFile) -> Iterator[zipfile.ZipInfo]:
    """The files of an archive in directory order; folders are not members."""
    for info in archive.infolist():
        if not _is_folder(info):
            yield info


def _is_folder(info: zipfile.ZipInfo) -> bool:
    # Not ZipInfo.is_dir(): it raises IndexError for an entry with an empty name (found by fuzz/).
    return info.filename.endswith("/")


def is_encrypted(info: zipfile.ZipInfo) -> bool:
    return bool(info.flag_bits & 0x1)


def member_label(name: str) -> str:
    """A member's path for people: forward slashes, no leading `/`, no `.` or `..` parts."""
    parts = [part for part in name.replace("\\", "/").split("/") if part not in ("", ".", "..")]
    return posixpath.join(*parts) if parts else "(unnamed)"
