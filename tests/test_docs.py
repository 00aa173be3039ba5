"""The documentation site: it builds with no broken link, missing page or anchor (mkdocs --strict),
every page is in its navigation, the settings tables are the ones the settings generate, and every
command, option, setting, environment variable and file a page names exists."""

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


# Names the pages may give that are not ours to check: the CLI's and tests' own variables, a peer's file.
NOT_SETTINGS = {"LLMSERVER_API_KEY", "LLMSERVER_DEBUG", "LLMSERVER_TEST_DATABASE"}
FILE_TYPES = {"py", "yaml", "yml", "toml", "md", "json", "sh", "gguf", "txt", "service", "pem", "db"}
OTHER_PROJECTS_FILES = {"tests/protocols/test_http.py"}  # uvicorn's, run by tests/peer/


def made_by_a_script(path: str) -> bool:
    """An output the repository ignores (`deploy/container/wheels/`, made by scripts/container_wheels.py):
    absent from a fresh clone until its script runs (the container test made it before this test ran)."""
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, check=False).returncode == 0


COMMAND_LINE = re.compile(
    r"^\s*(?:\$ )?(?:\.venv/bin/|sudo -u \S+ )?llmserver((?: +(?:[a-z][a-z0-9-]*|--?[a-z][a-z-]*))*)"
)


def code_of(text: str) -> list[str]:
    """Each line of a page's fenced blocks, and each inline code span."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    lines = [line for block in fenced for line in block.splitlines()]
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return lines + re.findall(r"`([^`\n]+)`", prose)


def wrong_names(page: Path) -> list[str]:
    """The commands, options, settings, environment variables and files a page names that do not exist."""
    import click

    from llmserver.cli import cli
    from llmserver.settings import RENAMED, env_name, setting_paths

    paths = setting_paths()
    dotted = {".".join(path) for path in paths}
    sections = {path[0] for path in paths if len(path) > 1}
    variables = {env_name(path) for path in paths} | {"LLMSERVER_" + old.upper() for old in RENAMED} | NOT_SETTINGS
    text = page.read_text()
    wrong: list[str] = []
    for code in code_of(text):
        for segment in re.split(r"&&|\|\||;|\|", code):
            found = COMMAND_LINE.match(segment)
            if found is None:
                continue
            command: click.Command = cli
            for word in found.group(1).split():
                if word.startswith("-"):
                    options = {o for p in command.params for o in getattr(p, "opts", [])} | {"--help", "--debug"}
                    if word not in options:
                        wrong.append(f"option {word} of `llmserver {found.group(1).strip()}`")
                elif isinstance(command, click.Group):
                    if word not in command.commands:
                        wrong.append(f"command `llmserver {found.group(1).strip()}`")
                        break
                    command = command.commands[word]
                else:
                    break
        for name in re.findall(r"^([a-z_]+\.[a-z_.]+)$", code):
            if name.rsplit(".", 1)[1] in FILE_TYPES:
                continue  # a file's name (`node.yaml`), not a setting
            if (
                name.split(".")[0] in sections
                and name not in dotted
                and not any(d.startswith(name + ".") for d in dotted)
            ):
                wrong.append(f"setting `{name}`")
        for path in re.findall(r"^((?:scripts|deploy|bench|src|tests|docs|fuzz|\.ci)/[\w./-]+)$", code):
            path = path.rstrip(".")
            if path not in OTHER_PROJECTS_FILES and not (ROOT / path).exists() and not made_by_a_script(path):
                wrong.append(f"file `{path}`")
    for name in re.findall(r"\bLLMSERVER_[A-Z0-9_]*[A-Z0-9]", text):
        if name not in variables:
            wrong.append(f"environment variable {name}")
    return wrong


def test_every_command_setting_variable_and_file_a_page_names_exists() -> None:
    pages = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
    wrong = {str(page.relative_to(ROOT)): found for page in pages if (found := wrong_names(page))}
    assert wrong == {}


def test_the_name_check_finds_what_does_not_exist(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Run `llmserver nodes evict worker-1` or `llmserver serve --no-such-flag`, set `server.prot` or\n"
        "LLMSERVER_SERVER__PROT, see `scripts/no_such_script.py`:\n\n```sh\nllmserver modles list\n```\n"
        "But `llmserver nodes drain worker-1`, `server.port`, LLMSERVER_SERVER__PORT, LLMSERVER_PORT (its old name)\n"
        "and `scripts/setup.sh` are fine, as is prose: llmserver keeps its promises.\n"
    )
    assert wrong_names(page) == [
        "command `llmserver modles list`", "command `llmserver nodes evict worker-1`",
        "option --no-such-flag of `llmserver serve --no-such-flag`", "setting `server.prot`",
        "file `scripts/no_such_script.py`", "environment variable LLMSERVER_SERVER__PROT",
    ]  # fmt: skip
