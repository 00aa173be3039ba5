"""The ZIP walker and extraction, in this process: each limit is hit and named, sections are labelled."""

from __future__ import annotations

import io
import zipfile

import pytest

from llmserver.inputs import extraction
from llmserver.inputs.archives import ArchiveLimits, ArchiveRejected, declared_entries, member_label
from llmserver.inputs.extraction import Extracted, Unextractable
from llmserver.inputs.limits import FileLimits
from tests.support import documents


def extract(filename: str, data: bytes, limits: ArchiveLimits | None = None) -> Extracted:
    """Extraction with the default character cap."""
    return extraction.extract(filename, data, max_chars=FileLimits().max_chars, limits=limits)


def test_members_become_sections_and_the_rest_is_listed_as_skipped() -> None:
    archive = documents.make_zip(
        {
            "docs/report.docx": documents.make_docx(),
            "inner.zip": documents.make_zip({"deck.pptx": documents.make_pptx()}),
            "photo.png": documents.PNG,
            "../../etc/notes.txt": documents.MARKERS["txt"].encode(),
        }
    )
    result = extract("bundle.zip", archive)
    assert result.format == "ZIP archive"
    assert "--- docs/report.docx ---" in result.text and documents.MARKERS["docx"] in result.text
    assert "--- inner.zip/deck.pptx ---" in result.text and documents.MARKERS["pptx"] in result.text
    assert "--- etc/notes.txt ---" in result.text  # `..` parts never reach a label
    assert result.skipped == ["photo.png (PNG image)"]
    assert not result.truncated


def test_text_is_cut_at_the_character_limit() -> None:
    result = extract("long.txt", b"abcdefghij" * 5000)
    assert len(result.text) == 40_000 and result.truncated
    archive = documents.make_zip({f"{i}.txt": b"x" * 15_000 for i in range(5)})
    result = extract("many.zip", archive)
    assert len(result.text) == 40_000 and result.truncated
    assert result.skipped == [f"{i}.txt (not read: the 40,000-character limit was reached)" for i in (3, 4)]


def test_too_many_entries_is_refused_from_the_directory_record() -> None:
    archive = documents.many_entries_zip(100_000)
    assert declared_entries(archive) == 100_000
    with pytest.raises(ArchiveRejected, match="too many entries: more than 1000"):
        extract("many.zip", archive)


def test_a_high_ratio_entry_is_refused_before_it_is_read() -> None:
    bomb = documents.zeros_entry_zip("zeros.txt", 50 * 1024 * 1024)
    assert len(bomb) < 100_000
    with pytest.raises(ArchiveRejected, match="expands more than 200 times"):
        extract("bomb.zip", bomb)


def test_the_uncompressed_total_is_bounded() -> None:
    members = {f"{i}.txt": b"x" * 300_000 for i in range(4)}
    limits = ArchiveLimits(max_total_bytes=1024 * 1024)
    with pytest.raises(ArchiveRejected, match="unpacks to more than 1 MB"):
        extract("big.zip", documents.make_zip(members), limits=limits)
    nested = documents.make_zip({"a.zip": documents.make_zip(members), "b.txt": b"x"})
    with pytest.raises(ArchiveRejected, match="unpacks to more than 1 MB"):  # nested archives count too
        extract("nested.zip", nested, limits=ArchiveLimits(max_total_bytes=1_100_000))


def test_nesting_depth_is_bounded() -> None:
    with pytest.raises(ArchiveRejected, match="more than 3 levels deep"):
        extract("deep.zip", documents.deeply_nested_zip(10))
    assert documents.MARKERS["txt"] in extract("ok.zip", documents.deeply_nested_zip(3)).text


def test_a_nested_bomb_is_refused() -> None:
    with pytest.raises(ArchiveRejected):
        extract("42.zip", documents.nested_bomb())


def test_a_corrupt_member_is_skipped_but_a_corrupt_upload_is_refused() -> None:
    result = extract("mixed.zip", documents.make_zip({"bad.docx": documents.corrupt_docx(), "ok.txt": b"fine"}))
    assert result.text == "--- ok.txt ---\nfine"
    assert result.skipped[0].startswith("bad.docx (bad.docx could not be read")
    with pytest.raises(Unextractable, match="could not be read"):
        extract("bad.docx", documents.corrupt_docx())
    with pytest.raises(ArchiveRejected, match="not a readable ZIP"):
        extract("cut.zip", documents.make_zip({"a.txt": b"a" * 1000})[:-30])


def test_an_archive_with_nothing_readable() -> None:
    with pytest.raises(Unextractable, match="holds no file with extractable text"):
        extract("pics.zip", documents.make_zip({"a.png": documents.PNG}))


def test_other_formats_in_this_process() -> None:
    odt = extract("letter.odt", documents.make_odt("Dear reader, hello."))
    assert (odt.format, odt.text) == ("OpenDocument text", "Title\nDear reader, hello.")
    epub = extract("book.epub", documents.make_epub("Once upon a time."))
    assert epub.format == "EPUB book" and "Once upon a time." in epub.text
    html = extract("page.html", b"<!doctype html><html><body><h1>Hi</h1><p>A <b>bold</b> claim.</p></body></html>")
    assert "# Hi" in html.text and "**bold**" in html.text and "<p>" not in html.text
    source = b'key: value\nlist:\n  - "caf\xc3\xa9"\n'
    assert extract("config.yaml", source).text == source.decode().strip()
    with pytest.raises(Unextractable, match="no extractable text"):
        extract("blank.txt", b"   \n\n")


def test_member_labels() -> None:
    assert member_label("/abs/path.txt") == "abs/path.txt"
    assert member_label("a/../../b\\c.txt") == "a/b/c.txt"
    assert member_label("..") == "(unnamed)"


# Found by fuzzing (fuzz/crashes/zip_walker/): both raised past the walker, and the extraction child
# died with "the extractor stopped unexpectedly" instead of naming the entry.


def test_a_corrupt_deflate_stream_is_refused_naming_its_entry() -> None:
    good = documents.make_zip({"notes.txt": b"some words that deflate " * 40})
    start = good.index(b"notes.txt") + len("notes.txt")  # the local header's name, then the stream
    corrupt = good[:start] + bytes(b ^ 0x5A for b in good[start : start + 8]) + good[start + 8 :]
    with pytest.raises(ArchiveRejected, match=r"the entry 'notes.txt' is corrupt"):
        extract("bundle.zip", corrupt)


def test_an_entry_with_an_empty_name_is_read_as_unnamed() -> None:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(zipfile.ZipInfo(""), b"nameless text")
        archive.writestr("b.txt", b"named text")
    result = extract("bundle.zip", out.getvalue())
    assert result.text == "--- (unnamed) ---\nnameless text\n\n--- b.txt ---\nnamed text"


CSV = b"animal,count\nwalrus,42\n"
PDF = documents.make_pdf()
MEMBERS_FIRST = {
    "pdf": {"report.pdf": documents.make_pdf(), "t.csv": CSV, "n.md": documents.MARKERS["txt"].encode()},
    "csv": {"t.csv": CSV, "n.md": documents.MARKERS["txt"].encode(), "report.pdf": PDF},
    "docx": {"letter.docx": documents.make_docx(), "report.pdf": PDF},
    "xlsx": {"book.xlsx": documents.make_xlsx(), "deck.pptx": documents.make_pptx(), "report.pdf": PDF},
    "png": {"photo.png": documents.PNG, "report.pdf": documents.make_pdf(), "n.md": documents.MARKERS["txt"].encode()},
}


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED], ids=["stored", "deflated"])
@pytest.mark.parametrize("first", list(MEMBERS_FIRST))
def test_a_zip_is_a_zip_whatever_its_members_bytes_look_like(first: str, compression: int) -> None:
    """A stored ZIP holds its members' bytes as they are: a PDF's header in its first kilobyte made the
    whole upload read as that PDF, and the other members were dropped."""
    members = MEMBERS_FIRST[first]
    archive = documents.make_zip(members, compression=compression)
    result = extract("upload.bin", archive)
    assert result.format == "ZIP archive"
    readable = [name for name in members if not name.endswith(".png")]
    for name in readable:
        assert f"--- {name} ---" in result.text
    if "t.csv" in members:
        assert "walrus" in result.text
    marker_of = {"pdf": "pdf", "docx": "docx", "xlsx": "xlsx", "pptx": "pptx", "md": "txt"}
    for name in readable:
        kind = name.rsplit(".", 1)[1]
        if kind in marker_of:
            assert documents.MARKERS[marker_of[kind]] in result.text, name
    assert result.skipped == [f"{name} (PNG image)" for name in members if name.endswith(".png")]


def test_a_zip_after_other_bytes_is_still_read_as_a_zip() -> None:
    """Whatever comes before it (a stub, a PDF's bytes), a ZIP is known by its directory at the end."""
    archive = documents.make_zip({"n.md": documents.MARKERS["txt"].encode()}, compression=zipfile.ZIP_STORED)
    result = extract("upload.bin", documents.make_pdf() + archive)
    assert result.format == "ZIP archive" and documents.MARKERS["txt"] in result.text
    # A PDF alone stays a PDF.
    assert extract("upload.bin", documents.make_pdf()).format == "PDF document"
