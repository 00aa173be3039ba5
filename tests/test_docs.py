"""The documentation site: it builds with no broken link, missing page or anchor (mkdocs --strict),
every page is in its navigation, and the settings table is the one the settings generate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from llmserver.commands.config import markdown_reference

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
ENV = {"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"}  # (mkdocs-material's notice about its successor)


def test_settings_table_is_current() -> None:
    text = (DOCS / "reference" / "configuration.md").read_text()
    start = text.index("<!-- settings-table:start -->\n") + len("<!-- settings-table:start -->\n")
    end = text.index("<!-- settings-table:end -->")
    assert text[start:end].strip() == markdown_reference().strip(), "run .venv/bin/python scripts/docs_settings.py"


def nav_pages(entries: list[object]) -> set[str]:
    pages: set[str] = set()
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages |= nav_pages(value) if isinstance(value, list) else {str(value)}
    return pages


def test_every_page_is_in_the_navigation() -> None:
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.SafeLoader)
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert nav_pages(config["nav"]) == pages


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """A warning (a link to a page or an anchor that does not exist) fails the build."""
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "operating" / "monitoring" / "index.html").exists()
    assert (tmp_path / "site" / "img" / "ttft.png").exists()  # a benchmark chart, from bench/results


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The check can fail: a copy of the site with one link to a page that does not exist."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(DOCS, copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy)
    (copy / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "docs_hooks.py", copy / "scripts")
    (copy / "bench" / "results").mkdir(parents=True)
    page = copy / "docs" / "index.md"
    page.write_text(page.read_text() + "\nSee [nowhere](no-such-page.md).\n")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=copy, capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert built.returncode != 0 and "no-such-page.md" in built.stdout + built.stderr
