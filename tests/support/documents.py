"""Real documents and hostile files, built in the test run (nothing is checked in or downloaded).

Each friendly document carries its own marker sentence, so a test can tell which file's text
came out. The hostile ones are built to the shape of known attacks with modest build times.
"""

from __future__ import annotations

import base64
import io
import zipfile
import zlib

import docx
import fpdf
import openpyxl
import pptx

MARKERS = {
    "docx": "The purple elephants dance at noon in the Word document.",
    "xlsx": "Seven green turtles count coins in the spreadsheet.",
    "pptx": "Orange owls present quarterly snow forecasts on the slide.",
    "pdf": "Blue whales whisper riddles inside the PDF file.",
    "txt": "Silver foxes debug kernels in the plain text file.",
}


def data_uri(data: bytes, mime: str = "application/octet-stream") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def file_part(filename: str, data: bytes, mime: str = "application/octet-stream") -> dict[str, object]:
    return {"type": "file", "file": {"filename": filename, "data": data_uri(data, mime)}}


def make_docx(text: str = MARKERS["docx"]) -> bytes:
    document = docx.Document()
    document.add_heading("Report", level=1)
    document.add_paragraph(text)
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def make_xlsx(text: str = MARKERS["xlsx"]) -> bytes:
    workbook = openpyxl.Workbook()
    sheet = workbook.active
    assert sheet is not None
    sheet.append(["note", "value"])
    sheet.append([text, 42])
    out = io.BytesIO()
    workbook.save(out)
    return out.getvalue()


def make_pptx(text: str = MARKERS["pptx"]) -> bytes:
    presentation = pptx.Presentation()
    slide = presentation.slides.add_slide(presentation.slide_layouts[1])
    slide.shapes.title.text = "Forecast"
    slide.placeholders[1].text = text
    out = io.BytesIO()
    presentation.save(out)
    return out.getvalue()


def make_pdf(text: str = MARKERS["pdf"], *, user_password: str | None = None) -> bytes:
    pdf = fpdf.FPDF()
    if user_password is not None:
        pdf.set_encryption(owner_password="owner-secret", user_password=user_password)
    pdf.add_page()
    pdf.set_font("helvetica", size=12)
    pdf.multi_cell(w=0, text=text)
    return bytes(pdf.output())


def make_zip(members: dict[str, bytes], *, compression: int = zipfile.ZIP_DEFLATED) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return out.getvalue()


def make_odt(text: str) -> bytes:
    content = (
        '<?xml version="1.0" encoding="UTF-8"?>'
        '<office:document-content xmlns:office="urn:oasis:names:tc:opendocument:xmlns:office:1.0" '
        'xmlns:text="urn:oasis:names:tc:opendocument:xmlns:text:1.0"><office:body><office:text>'
        f"<text:h>Title</text:h><text:p>{text}</text:p>"
        "</office:text></office:body></office:document-content>"
    )
    return make_zip({"mimetype": b"application/vnd.oasis.opendocument.text", "content.xml": content.encode()})


def make_epub(text: str) -> bytes:
    container = (
        '<?xml version="1.0"?><container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container">'
        '<rootfiles><rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/>'
        "</rootfiles></container>"
    )
    opf = (
        '<?xml version="1.0"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0">'
        '<metadata xmlns:dc="http://purl.org/dc/elements/1.1/"><dc:title>Book</dc:title></metadata>'
        '<manifest><item id="c1" href="chapter.xhtml" media-type="application/xhtml+xml"/></manifest>'
        '<spine><itemref idref="c1"/></spine></package>'
    )
    chapter = f"<html><body><h1>Chapter</h1><p>{text}</p></body></html>"
    return make_zip(
        {
            "mimetype": b"application/epub+zip",
            "META-INF/container.xml": container.encode(),
            "OEBPS/content.opf": opf.encode(),
            "OEBPS/chapter.xhtml": chapter.encode(),
        }
    )


# Hostile files


def zeros_entry_zip(name: str, size: int) -> bytes:
    """One entry of `size` zero bytes, deflated (about 1000:1), streamed so the test never holds it."""
    out = io.BytesIO()
    chunk = bytes(1024 * 1024)
    info = zipfile.ZipInfo(name)
    info.compress_type = zipfile.ZIP_DEFLATED
    with (
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive,
        archive.open(info, "w", force_zip64=True) as entry,
    ):
        written = 0
        while written < size:
            piece = chunk[: min(len(chunk), size - written)]
            entry.write(piece)
            written += len(piece)
    return out.getvalue()


def nested_bomb(levels: int = 5, fanout: int = 16, leaf_bytes: int = 16 * 1024 * 1024) -> bytes:
    """42.zip's shape: each level holds `fanout` copies of the level below; the leaves are zeros."""
    current = zeros_entry_zip("0.dat", leaf_bytes)
    for _ in range(levels - 1):
        current = make_zip({f"{i}.zip": current for i in range(fanout)})
    return current


def many_entries_zip(count: int = 100_000) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for i in range(count):
            archive.writestr(f"{i:x}", b"x")
    return out.getvalue()


def deeply_nested_zip(depth: int = 10) -> bytes:
    current = make_zip({"bottom.txt": MARKERS["txt"].encode()})
    for level in range(depth - 1):
        current = make_zip({f"level{level}.zip": current})
    return current


def pdf_stream_bomb(inflated: int = 2 * 1024 * 1024 * 1024) -> bytes:
    """A one-page PDF whose content stream inflates to `inflated` bytes (spaces: valid, empty content).

    Built in a second: after a full flush the compressor starts afresh, so every further chunk of
    spaces compresses to the same bytes; only the checksum has to see all of them."""
    chunk = b" " * (4 * 1024 * 1024)
    count = inflated // len(chunk)
    compressor = zlib.compressobj(9)
    first = compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH)
    repeat = compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH)
    checksum = 1
    for _ in range(count):
        checksum = zlib.adler32(chunk, checksum)
    end = compressor.flush(zlib.Z_FINISH)[:-4]  # an empty final block; its checksum is for 2 chunks
    stream = first + repeat * (count - 1) + end + checksum.to_bytes(4, "big")
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R >>",
        b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(stream) + stream + b"\nendstream",
    ]
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % number + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    for offset in offsets:
        out.write(b"%010d 00000 n \n" % offset)
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref))
    return out.getvalue()


def corrupt_docx() -> bytes:
    """A ZIP that claims to be a Word document, whose document.xml is not XML."""
    good = zipfile.ZipFile(io.BytesIO(make_docx()))
    members = {info.filename: good.read(info) for info in good.infolist()}
    members["word/document.xml"] = b"<w:document><w:body><w:p>broken"
    return make_zip(members)


MP4 = b"\x00\x00\x00\x20ftypisom\x00\x00\x02\x00isomiso2avc1mp41" + bytes(4096)
PNG = (
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x02\x00\x00\x00\x90wS\xde"
    b"\x00\x00\x00\x0cIDATx\x9cc\xf8\xff\xff?\x00\x05\xfe\x02\xfe\xa7\x9a\xa0\xb1\x00\x00\x00\x00IEND\xaeB`\x82"
)
