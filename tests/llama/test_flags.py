"""The llama_server_args allowlist against llama-server's own `--help` of the pinned build: every
allowed spelling is one llama.cpp knows, taking a value exactly when llama.cpp's does, so that the
allowlist's reading of an argument list (which argument is a flag, which a value) is llama.cpp's."""

from __future__ import annotations

import re
import subprocess

import pytest

from llmserver.llama import flags as llama_flags
from llmserver.models.files import llama_server_binary


@pytest.fixture(scope="module")
def llama_options() -> dict[str, bool]:
    """Each spelling `llama-server --help` lists → whether it takes a value."""
    shown = subprocess.run(
        [str(llama_server_binary(None)), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    options: dict[str, bool] = {}
    for line in (shown.stdout + shown.stderr).splitlines():
        if not line.startswith("-") or line.startswith("--- ") or line.startswith("-----"):
            continue
        head = re.split(r"\s{2,}", re.sub(r",\s+", ", ", line.strip()), maxsplit=1)[0]
        items = head.split(", ")
        takes = len(items[-1].split()) > 1
        for item in items:
            options[item.split()[0]] = takes
    assert len(options) > 200, "llama-server --help was not read"
    return options


def test_every_allowed_flag_is_llama_cpps_and_takes_a_value_as_it_does(llama_options: dict[str, bool]) -> None:
    unknown = sorted(flag for flag in llama_flags.ALLOWED if flag not in llama_options)
    assert not unknown, unknown
    different = sorted(flag for flag, takes in llama_flags.ALLOWED.items() if llama_options[flag] != takes)
    assert not different, different


@pytest.mark.parametrize(
    "flag",
    ["--tools", "--api-key", "--api-key-file", "--log-file", "--slot-save-path", "--cache-ram", "--props", "--webui",
     "--host", "--port", "--path", "--lora", "--grammar-file", "--media-path", "--models-dir", "--mcp-servers-config",
     "--ssl-key-file", "--model", "--hf-repo", "--verbose", "--metrics", "--jinja", "--parallel", "--ctx-size"],
)  # fmt: skip
def test_flags_that_reach_the_host_or_undo_llmserver_are_not_allowed(llama_options: dict[str, bool], flag: str) -> None:
    assert flag in llama_options  # llama.cpp has it (so the test names a real flag)
    assert flag not in llama_flags.ALLOWED and llama_flags.normalised(flag.replace("-", "_")) not in llama_flags.ALLOWED
