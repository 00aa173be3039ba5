"""Workbooks are read row by row and only as far as needed: to the character cap, and never past
XLSX_MAX_CELLS cells, so a workbook of a million blank cells costs no more than a small one."""

from __future__ import annotations

import io
import zipfile

import pytest
from openpyxl import Workbook

from llmserver.inputs.extraction import XLSX_MAX_CELLS, XLSX_MAX_SHARED_STRINGS, Unextractable, extract


def workbook(rows: list[list[object]], *, write_only: bool = True) -> bytes:
    book = Workbook(write_only=write_only)
    sheet = book.create_sheet("Data") if write_only else book.active
    for row in rows:
        sheet.append(row)
    buffer = io.BytesIO()
    book.save(buffer)
    return buffer.getvalue()


def test_the_probes_blank_workbook_is_refused_after_reading_a_bounded_part() -> None:
    blank = workbook([[" "] * 100 for _ in range(10_000)])  # 2.4 MB, a million cells, no <dimension> up front
    with pytest.raises(Unextractable, match="no extractable text"):
        extract("blank.xlsx", blank, max_chars=40_000)


def test_reading_stops_at_the_cell_limit_and_says_so() -> None:
    rows = [["header", "value"]] + [[" "] * 100 for _ in range(XLSX_MAX_CELLS // 100 + 10)] + [["after", "limit"]]
    text = extract("sparse.xlsx", workbook(rows), max_chars=40_000).text
    assert "| header | value |" in text and "after" not in text
    assert f"[only the first {XLSX_MAX_CELLS:,} cells of this workbook were read]" in text


def test_reading_stops_at_the_character_cap() -> None:
    extracted = extract("big.xlsx", workbook([[i, f"name {i}", i * 1.5] for i in range(20_000)]), max_chars=40_000)
    assert extracted.truncated and len(extracted.text) == 40_000
    assert extracted.text.startswith("## Data\n| 0 | name 0 | 0 |\n|---|---|---|\n| 1 | name 1 | 1.5 |")


def test_sheets_tables_and_values() -> None:
    book = Workbook()
    book.active.title = "People"
    book.active.append(["name", "age"])
    book.active.append(["Ada", 36])
    other = book.create_sheet("Notes")
    other.append(["a | pipe", "two\nlines"])
    buffer = io.BytesIO()
    book.save(buffer)
    text = extract("b.xlsx", buffer.getvalue(), max_chars=40_000).text
    assert text == "## People\n| name | age |\n|---|---|\n| Ada | 36 |\n## Notes\n| a \\| pipe | two lines |\n|---|---|"


def test_a_declared_flood_of_shared_strings_is_refused() -> None:
    book = Workbook()
    book.active.append(["x"])
    buffer = io.BytesIO()
    book.save(buffer)
    patched = io.BytesIO()
    flood = XLSX_MAX_SHARED_STRINGS + 1
    table = (
        f'<sst xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main" count="{flood}" uniqueCount="{flood}">'
    )
    with zipfile.ZipFile(buffer) as source, zipfile.ZipFile(patched, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            target.writestr(info, source.read(info.filename))
        target.writestr("xl/sharedStrings.xml", table + "<si><t>x</t></si></sst>")
    with pytest.raises(Unextractable, match="distinct strings"):
        extract("flood.xlsx", patched.getvalue(), max_chars=40_000)
