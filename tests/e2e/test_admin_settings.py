"""An admin setting cannot reach the host (issue 54, row 2): llama_server_args by allowlist, read as
llama.cpp reads its command line, and model files only from the directories the operator allows."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support import Server, assert_error, make_key

ISSUE_ARGS = ["--api_key", "K", "--tools", "read_file,exec_shell_command", "--log_file", "/tmp/x", "--cache_ram", "512"]


@pytest.fixture(scope="module")
def admin(server: Server) -> str:
    return make_key(server.data_dir, "settings-admin", admin=True)


def add(server: Server, admin: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(server.url + "/api/models", json=body, headers={"Authorization": f"Bearer {admin}"}, timeout=60)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (ISSUE_ARGS, "--api_key"),
        (["--tools", "exec_shell_command"], "--tools"),
        (["--no-warmup", "--log_file", "/tmp/x"], "--log_file"),
        (["--cache_ram", "512"], "--cache_ram"),
        (["--slot_save_path", "/tmp"], "--slot_save_path"),
        (["--api-key=K"], "--api-key=K"),
    ],
)
def test_llama_server_args_outside_the_allowlist_are_400_naming_the_flag(
    server: Server, admin: str, args: list[str], named: str
) -> None:
    error = assert_error(add(server, admin, {"name": "x", "min_instances": 0, "llama_server_args": args}), 400,
                         "invalid_request_error", "llama_server_args")  # fmt: skip
    assert named in str(error["message"])


@pytest.mark.parametrize(
    ("field", "path"),
    [
        ("path", "/proc/self/environ"),
        ("path", "../../../../../../etc/passwd"),
        ("mmproj", "/etc/passwd"),
        ("draft_model", "/etc/hostname"),
        ("chat_template_file", "/etc/hostname"),
    ],
)
def test_model_files_outside_the_allowed_directories_are_400(server: Server, admin: str, field: str, path: str) -> None:
    error = assert_error(add(server, admin, {"name": "x", "min_instances": 0, field: path}), 400,
                         "invalid_request_error", field)  # fmt: skip
    assert "outside the directories model files may be in" in str(error["message"])


def test_a_symlink_out_of_an_allowed_directory_is_400(server: Server, admin: str) -> None:
    models = server.data_dir / "models"
    models.mkdir(exist_ok=True)
    link = models / "escape.gguf"
    link.unlink(missing_ok=True)
    link.symlink_to("/etc/passwd")
    assert_error(add(server, admin, {"name": "x", "min_instances": 0, "path": str(link)}), 400,
                 "invalid_request_error", "path")  # fmt: skip


def test_a_model_file_in_an_allowed_directory_is_taken(server: Server, admin: str, tmp_path: Path) -> None:
    models = server.data_dir / "models"
    models.mkdir(exist_ok=True)
    inside = models / "inside.gguf"
    inside.write_bytes(b"GGUF")
    answer = add(server, admin, {"name": "inside", "min_instances": 0, "path": str(inside)})
    assert answer.status_code == 201, answer.text
    gone = httpx.delete(server.url + "/api/models/inside", headers={"Authorization": f"Bearer {admin}"}, timeout=60)
    assert gone.status_code == 200
