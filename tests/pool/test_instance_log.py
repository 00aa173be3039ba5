"""An instance's log tail (GET /api/instances/{id}/log, a failed start's reason): bounded, and with
whatever may be a secret masked, however llama-server or a flag wrote it."""

from __future__ import annotations

from pathlib import Path

from llmserver.pool.instance import LOG_TAIL_BYTES, Instance
from llmserver.settings import ModelConfig


def instance(log: Path, key: str = "instance-key-0123456789") -> Instance:
    made = Instance(model=ModelConfig(name="m"), host="127.0.0.1", port=1, log_path=log)
    made.api_key = key
    return made


def test_keys_and_tokens_are_masked_in_every_shape(tmp_path: Path) -> None:
    log = tmp_path / "m.log"
    secrets = {
        "the instance's own key: instance-key-0123456789": "the instance's own key: ***",
        "Authorization: Bearer abc.def-123": "Authorization: Bearer ***",
        "curl -H 'Authorization: Bearer s3cr3t'": "curl -H 'Authorization: Bearer ***'",
        "print_info: EOS token        = 2 '<|im_end|>'": "print_info: EOS token        = 2 '<|im_end|>'",
        "--api-key=hunter2 --hf-token hf_abcdefghijklmnopqrstu": "--api-key=*** --hf-token ***",
        '{"api_key": "llms-AAAAAAAAAAAAAAAAAAAAAAAA", "n": 1}': '{"api_key": "***", "n": 1}',
        "a gateway key llms-AAAAAAAAAAAAAAAAAAAAAAAA in a prompt": "a gateway key *** in a prompt",
        "srv  log_server_r: request: POST /completion 200": "srv  log_server_r: request: POST /completion 200",
    }  # fmt: skip
    log.write_text("\n".join(secrets) + "\n")
    assert instance(log).log_tail(len(secrets)) == list(secrets.values())


def test_the_tail_reads_only_the_end_of_a_large_log_and_never_half_a_line(tmp_path: Path) -> None:
    log = tmp_path / "m.log"
    with log.open("w") as file:
        for n in range(3 * LOG_TAIL_BYTES // 20):
            file.write(f"line {n:>12}xxxx\n")  # 22 bytes: the window starts inside a line
    tail = instance(log).log_tail(100_000)
    assert tail[-1] == f"line {3 * LOG_TAIL_BYTES // 20 - 1:>12}xxxx"
    assert all(line.startswith("line ") and len(line) == 21 for line in tail)
    assert len(tail) == LOG_TAIL_BYTES // 22  # the window's whole lines
    assert instance(tmp_path / "none.log").log_tail() == []  # not written yet
