"""Text out of one uploaded file. This module runs in the extraction child process.

`extract()` is the whole conversion: it sniffs the bytes, walks ZIP archives with our own limits,
hands each document to the matching markitdown converter (never markitdown's own type guessing or
ZIP recursion) and stops collecting at the character cap. `child_main()` wraps it with the
process's memory and CPU limits and sends the outcome back over a pipe; the parent
(`inputs.documents`) owns the wall-clock timeout and the process.
"""

from __future__ import annotations

import io
import re
import resource
import time
import zipfile
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from llmserver.inputs.archives import (
    ArchiveLimits,
    ArchiveRejected,
    Budget,
    is_encrypted,
    member_label,
    members,
    open_checked,
    read_member,
)
from llmserver.inputs.formats import Sniffed, decode_text, is_html, sniff

_ODF_TEXT_NS = "urn:oasis:names:tc:opendocument:xmlns:text:1.0"


class Unextractable(Exception):
    """This file (or archive member) has no text we can get at; the message says why."""


@dataclass
class Extracted:
    filename: str
    format: str
    text: str  # at most max_chars characters
    truncated: bool
    max_chars: int
    skipped: list[str] = field(default_factory=list)  # archive members that were not converted, and why
    seconds: float = 0.0
    peak_rss_kb: int = 0  # the child's peak resident memory …
    limit_kb: int = 0  # … and its address-space limit


@dataclass
class _Collector:
    max_chars: int
    parts: list[str] = field(default_factory=list)
    chars: int = 0
    truncated: bool = False
    skipped: list[str] = field(default_factory=list)

    @property
    def full(self) -> bool:
        return self.chars >= self.max_chars

    def add(self, text: str) -> None:
        if self.parts:
            text = "\n\n" + text
        room = self.max_chars - self.chars
        if len(text) > room:
            text, self.truncated = text[:room], True
        self.parts.append(text)
        self.chars += len(text)


def extract(filename: str, data: bytes, *, max_chars: int, limits: ArchiveLimits | None = None) -> Extracted:
    """The text of one file, cut at `max_chars`; raises Unextractable or ArchiveRejected."""
    started = time.monotonic()
    budget = Budget(limits or ArchiveLimits())
    kind = sniff(data)
    collector = _Collector(max_chars)
    if kind.family == "archive":
        _walk(data, filename, "", 1, budget, collector)
        if not collector.parts:
            reasons = "; ".join(collector.skipped[:5]) or "it is empty"
            raise Unextractable(f"{filename} holds no file with extractable text ({reasons}).")
        text = "".join(collector.parts)
    else:
        text = _convert(data, kind, filename, budget, max_chars).strip()
        if not text:
            raise Unextractable(f"{filename} has no extractable text.")
        collector.add(text)
        text = collector.parts[0]
    return Extracted(
        filename=filename,
        format=kind.format,
        text=text,
        truncated=collector.truncated,
        max_chars=max_chars,
        skipped=collector.skipped,
        seconds=time.monotonic() - started,
    )


def _walk(data: bytes, label: str, prefix: str, depth: int, budget: Budget, out: _Collector) -> None:
    """Each readable member becomes a section headed by its path; the rest are listed as skipped."""
    with open_checked(data, label, budget) as archive:
        for info in members(archive):
            path = prefix + member_label(info.filename)
            if out.full:
                out.skipped.append(f"{path} (not read: the {out.max_chars:,}-character limit was reached)")
                continue
            if is_encrypted(info):
                out.skipped.append(f"{path} (encrypted)")
                continue
            content = read_member(archive, info, label)
            kind = sniff(content)
            if kind.family == "archive":
                if depth >= budget.limits.max_depth:
                    raise ArchiveRejected(
                        f"{label}: {path} nests archives more than {budget.limits.max_depth} levels deep."
                    )
                _walk(content, label, path + "/", depth + 1, budget, out)
                continue
            if not kind.readable:
                out.skipped.append(f"{path} ({kind.format})")
                continue
            try:
                text = _convert(content, kind, path, budget, out.max_chars - out.chars).strip()
            except Unextractable as exc:
                out.skipped.append(f"{path} ({exc})")
                continue
            if not text:
                out.skipped.append(f"{path} (no text)")
                continue
            out.add(f"--- {path} ---\n{text}")


def _convert(data: bytes, kind: Sniffed, name: str, budget: Budget, max_chars: int) -> str:
    if kind.family == "encrypted":
        raise Unextractable(f"{name} is encrypted (a {kind.format}); remove the password and send it again.")
    if kind.family == "text":
        return _markitdown("html", data, name) if is_html(data) else decode_text(data)
    if kind.format == "PDF document":
        return _pdf(data, name)
    # Every other document format is a ZIP container: its directory passes the archive limits first.
    open_checked(data, name, budget).close()
    if kind.format.startswith("OpenDocument"):
        return _opendocument(data, name)
    if kind.format == "Excel workbook":
        return _xlsx(data, name, max_chars)
    converter = {
        "Word document": "docx",
        "PowerPoint presentation": "pptx",
        "EPUB book": "epub",
    }[kind.format]
    return _markitdown(converter, data, name)


def _markitdown(converter: str, data: bytes, name: str) -> str:
    # Imported here: the parent never needs markitdown, the forkserver preloads it for the children.
    from markitdown import StreamInfo
    from markitdown.converters import DocxConverter, EpubConverter, HtmlConverter, PptxConverter

    classes: dict[str, Any] = {
        "docx": (DocxConverter, ".docx"),
        "pptx": (PptxConverter, ".pptx"),
        "epub": (EpubConverter, ".epub"),
        "html": (HtmlConverter, ".html"),
    }
    cls, extension = classes[converter]
    try:
        result = cls().convert(io.BytesIO(data), StreamInfo(extension=extension, charset="utf-8"))
    except MemoryError:
        raise
    except Exception as exc:  # each library fails in its own way on a broken file
        raise Unextractable(f"{name} could not be read ({type(exc).__name__}); the file may be corrupt.") from None
    return str(result.markdown or "")


# A workbook is read row by row and no further than it must: to the character cap, and never past
# this many cells (empty ones count: a sheet of a million blank cells costs as much to walk).
XLSX_MAX_CELLS = 100_000
# More distinct strings than this in the shared-string table (read whole, up front) is refused.
XLSX_MAX_SHARED_STRINGS = 500_000


def _xlsx(data: bytes, name: str, max_chars: int) -> str:
    """An Excel workbook as one Markdown table per sheet, streamed (openpyxl's read-only mode) and
    stopped at `max_chars` or XLSX_MAX_CELLS, whichever comes first."""
    from openpyxl import load_workbook
    from openpyxl.worksheet._read_only import ReadOnlyWorksheet

    # openpyxl sizes each sheet at load by parsing it to the end when it has no <dimension> up
    # front (a 2.4 MB workbook of blank cells: 6-15 s of XML before the first row). Reading rows
    # needs no size: look for it in the sheet's first bytes only.
    ReadOnlyWorksheet._get_size = _size_from_head
    _check_shared_strings(data, name)
    try:
        workbook = load_workbook(io.BytesIO(data), read_only=True, data_only=True)
    except MemoryError:
        raise
    except Exception as exc:
        raise Unextractable(f"{name} could not be read ({type(exc).__name__}); the file may be corrupt.") from None
    lines: list[str] = []
    chars = cells = 0
    stopped = False
    try:
        for sheet in workbook.worksheets:
            lines.append(f"## {sheet.title}")
            first = True
            for row in sheet.iter_rows(values_only=True):
                cells += len(row)
                values = ["" if value is None else str(value).strip() for value in row]
                while values and not values[-1]:
                    values.pop()
                if values:
                    line = "| " + " | ".join(v.replace("|", "\\|").replace("\n", " ") for v in values) + " |"
                    if first:
                        line += "\n|" + "---|" * len(values)
                        first = False
                    lines.append(line)
                    chars += len(line) + 1
                if chars >= max_chars:
                    return "\n".join(lines)
                if cells >= XLSX_MAX_CELLS:
                    stopped = True
                    break
            if stopped:
                break
    except MemoryError:
        raise
    except Exception as exc:
        raise Unextractable(f"{name} could not be read ({type(exc).__name__}); the file may be corrupt.") from None
    finally:
        workbook.close()
    if stopped:
        lines.append(f"[only the first {XLSX_MAX_CELLS:,} cells of this workbook were read]")
    if not any(line.startswith("|") for line in lines):
        return ""
    return "\n".join(lines)


def _size_from_head(sheet: Any) -> None:
    from openpyxl.utils.cell import range_boundaries

    with sheet._get_source() as source:
        head = source.read(65536)
    found = re.search(rb'<(?:\w+:)?dimension ref="([A-Z]+[0-9]+(?::[A-Z]+[0-9]+)?)"', head)
    if found:
        sheet._min_column, sheet._min_row, sheet._max_column, sheet._max_row = range_boundaries(found[1].decode())


def _check_shared_strings(data: bytes, name: str) -> None:
    """Refuse, from its first bytes, a shared-string table that declares too many strings."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive, archive.open("xl/sharedStrings.xml") as table:
            head = table.read(1024)
    except KeyError:
        return  # no shared strings
    except (zipfile.BadZipFile, OSError):
        return  # openpyxl says what is wrong
    found = re.search(rb'uniqueCount="(\d+)"', head)
    if found and int(found[1]) > XLSX_MAX_SHARED_STRINGS:
        raise Unextractable(
            f"{name} declares {int(found[1]):,} distinct strings; at most {XLSX_MAX_SHARED_STRINGS:,} are read."
        )


def _pdf(data: bytes, name: str) -> str:
    from markitdown import StreamInfo
    from markitdown.converters import PdfConverter
    from pdfminer.pdfdocument import PDFDocument, PDFEncryptionError, PDFPasswordIncorrect
    from pdfminer.pdfparser import PDFParser

    try:
        PDFDocument(PDFParser(io.BytesIO(data)))
    except (PDFPasswordIncorrect, PDFEncryptionError):
        raise Unextractable(f"{name} is an encrypted PDF; remove the password and send it again.") from None
    except MemoryError:
        raise
    except Exception as exc:
        raise Unextractable(f"{name} is not a readable PDF ({type(exc).__name__}).") from None
    try:
        result = PdfConverter().convert(io.BytesIO(data), StreamInfo(extension=".pdf"))
    except MemoryError:
        raise
    except Exception as exc:
        raise Unextractable(f"{name} could not be read ({type(exc).__name__}); the PDF may be corrupt.") from None
    return str(result.markdown or "")


def _opendocument(data: bytes, name: str) -> str:
    """OpenDocument text, spreadsheets and slides: the paragraphs and headings of content.xml."""
    from defusedxml import ElementTree

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            root = ElementTree.fromstring(archive.read("content.xml"))
    except MemoryError:
        raise
    except Exception as exc:
        raise Unextractable(f"{name} could not be read ({type(exc).__name__}); the file may be corrupt.") from None
    lines = []
    for element in root.iter():
        if element.tag in (f"{{{_ODF_TEXT_NS}}}p", f"{{{_ODF_TEXT_NS}}}h"):
            line = "".join(element.itertext()).strip()
            if line:
                lines.append(line)
    return "\n".join(lines)


# The child process


def peak_rss_kb() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def _address_space() -> int:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[0])
    return pages * resource.getpagesize()


def child_main(
    conn: Connection,
    filename: str,
    data: bytes,
    memory_bytes: int,
    cpu_seconds: int,
    max_chars: int,
    limits: ArchiveLimits,
) -> None:
    """Extract one file under an address-space limit (what is loaded already, plus `memory_bytes`)
    and a CPU-time limit (a backstop: the parent kills the child at its wall-clock timeout)."""
    limit = _address_space() + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 5))
    outcome: tuple[Any, ...]
    try:
        result = extract(filename, data, max_chars=max_chars, limits=limits)
        result.peak_rss_kb, result.limit_kb = peak_rss_kb(), limit // 1024
        outcome = ("ok", result)
    except (Unextractable, ArchiveRejected) as exc:
        outcome = ("unextractable", str(exc), peak_rss_kb(), limit // 1024)
    except MemoryError:
        outcome = ("memory", "", peak_rss_kb(), limit // 1024)
    except RecursionError:
        outcome = ("unextractable", f"{filename} is nested too deeply to read.", peak_rss_kb(), limit // 1024)
    conn.send(outcome)
    conn.close()
