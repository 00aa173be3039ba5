"""The documentation site: it builds with no broken link, missing page or anchor (mkdocs --strict),
every page is in its navigation, and the settings tables are the ones the settings generate."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from llmserver.commands.config import markdown_reference, markdown_renamed

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
ENV = {"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"}  # (mkdocs-material's notice about its successor)


def test_settings_tables_are_current() -> None:
    text = (DOCS / "reference" / "configuration.md").read_text()
    for name, table in (("settings-table", markdown_reference()), ("renamed-table", markdown_renamed())):
        start = text.index(f"<!-- {name}:start -->\n") + len(f"<!-- {name}:start -->\n")
        end = text.index(f"<!-- {name}:end -->")
        assert text[start:end].strip() == table.strip(), "run .venv/bin/python scripts/docs_settings.py"


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
    # Nothing loads from elsewhere (Material's default fonts come from Google's CDN): the site works offline.
    assert not [page for page in (tmp_path / "site").rglob("*.html") if "fonts.googleapis" in page.read_text()]


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


def test_the_cli_reference_is_current() -> None:
    checked = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "docs_cli.py"), "--check"], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, "run .venv/bin/python scripts/docs_cli.py"


def documented_operations(page: Path) -> set[tuple[str, str]]:
    """(METHOD, /path) for each `METHODS /path` the page's endpoint table names ({…} for any parameter)."""
    found: set[tuple[str, str]] = set()
    for line in page.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        for methods, path in re.findall(r"`([A-Z/]+) (/[^`]*)`", first):
            for method in methods.split("/"):
                found.add((method, re.sub(r"\{[^}]*\}", "{}", path)))
    return found


def test_every_endpoint_of_the_openapi_document_is_in_the_api_table(tmp_path: Path) -> None:
    from llmserver.app import create_app
    from llmserver.settings import Settings

    spec = create_app(Settings(data_dir=tmp_path)).openapi()
    served = {
        (method.upper(), re.sub(r"\{[^}]*\}", "{}", path)) for path, operations in spec["paths"].items()
        for method in operations
    }  # fmt: skip
    documented = documented_operations(DOCS / "api" / "index.md")
    assert served - documented == set(), "endpoints the API page does not list"
    # Documented but not in the OpenAPI document: only the pages served outside it.
    assert documented - served == {("GET", "/console"), ("GET", "/openapi.json")}


def documented_metrics() -> set[str]:
    """The metric families the metrics page's table names (as prometheus_client's parser names them)."""
    text = (DOCS / "reference" / "metrics.md").read_text()
    return {re.sub(r"_total$", "", name) for name in re.findall(r"`(llmserver_[a-z_]+)`", text)}


def undocumented(served: set[str]) -> set[str]:
    """Families served that the metrics page does not list; a counter's or a histogram's `_created`
    gauge (prometheus_client's, the time it was created, once it has a sample) goes with its family."""
    return {name for name in served if not name.endswith("_created")} - documented_metrics()
