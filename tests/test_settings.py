from __future__ import annotations

from pathlib import Path

import click
import pytest
from pydantic import ValidationError

from llmserver.commands import models_from_args
from llmserver.commands.config import markdown_reference
from llmserver.settings import DEFAULT_MODEL_NAME, ModelConfig, Settings, load_settings


def test_defaults_serve_the_embedded_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMSERVER_DATA_DIR", raising=False)
    settings = load_settings()
    assert [m.name for m in settings.models] == [DEFAULT_MODEL_NAME]
    assert settings.models[0].path is None
    assert (settings.host, settings.port, settings.owned_by) == ("127.0.0.1", 8000, "5cbot_llm_server")
    assert settings.data_dir.name == "llmserver"


def test_file_then_env_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        'port = 9000\nowned_by = "from-file"\nhost = "0.0.0.0"\n'
        '[[models]]\nname = "a"\npath = "/m/a.gguf"\nparallel = 2\n'
        '[[models]]\nname = "b"\npath = "/m/a.gguf"\n'
    )
    monkeypatch.setenv("LLMSERVER_OWNED_BY", "from-env")
    monkeypatch.setenv("LLMSERVER_HOST", "10.0.0.1")
    settings = load_settings(config, host="127.0.0.2", port=None)
    assert settings.port == 9000  # file
    assert settings.owned_by == "from-env"  # env beats file
    assert settings.host == "127.0.0.2"  # flag beats env
    assert [(m.name, m.parallel) for m in settings.models] == [("a", 2), ("b", 4)]
    assert isinstance(settings, Settings) and type(settings) is Settings


def test_admin_key_from_environment_is_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMSERVER_ADMIN_KEY", "s3cret-admin")
    settings = load_settings()
    assert settings.admin_key is not None
    assert settings.admin_key.get_secret_value() == "s3cret-admin"
    assert "s3cret-admin" not in settings.model_dump_json()


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_settings(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    "config",
    [
        '[[models]]\nname = "a"\n[[models]]\nname = "a"\n',  # duplicate names
        '[[models]]\nname = "bad name"\n',
        '[[models]]\nname = "a"\nparallel = 0\n',
        '[[models]]\nname = "a"\nunknown = 1\n',
        "default_max_tokens = 900\nmax_tokens_limit = 100\n",
        "no_such_setting = 1\n",
        "workers = 2\n",  # role all: every worker would start its own instances
        'workers = 2\nrole = "gateway"\nredis_url = "redis://127.0.0.1:6379"\n',  # SQLite: one gateway's file
        'workers = 0\nrole = "gateway"\n',
    ],
)
def test_invalid_settings_are_rejected(tmp_path: Path, config: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(config)
    with pytest.raises(ValidationError):
        load_settings(path)


def test_model_args() -> None:
    configured = [ModelConfig(name="mine", path=Path("/x/mine.gguf"))]
    assert models_from_args((), configured) is None
    chosen = models_from_args(("mine", DEFAULT_MODEL_NAME, "/tmp/Other-Model.gguf"), configured)
    assert chosen is not None
    assert [(m.name, m.path) for m in chosen] == [
        ("mine", Path("/x/mine.gguf")),
        (DEFAULT_MODEL_NAME, None),
        ("Other-Model", Path("/tmp/Other-Model.gguf")),
    ]
    with pytest.raises(click.BadParameter):
        models_from_args(("nonsense",), configured)


def test_reference_table_lists_every_setting() -> None:
    table = markdown_reference()
    for name in Settings.model_fields:
        if name != "models":
            assert f"`{name}`" in table
    for name in ModelConfig.model_fields:
        assert f"`models[].{name}`" in table


def test_workers_need_a_gateway_on_postgresql() -> None:
    settings = load_settings(workers=2, role="gateway", database_url="postgresql://u@db/llm", redis_url="redis://r")
    assert settings.workers == 2


def test_llama_server_knobs_become_its_flags(tmp_path: Path) -> None:
    from llmserver.pool.instance import llama_server_args

    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF")
    model = ModelConfig(
        name="m", n_gpu_layers="all", flash_attn="on", cache_type_k="q8_0", cache_type_v="q8_0", batch_size=1024,
        ubatch_size=256, rope_scaling="yarn", rope_freq_base=10000.0, rope_freq_scale=0.5, load_mode="mlock",
        draft_model=draft, draft_max=8, llama_server_args=["--override-kv", "llama.expert_used_count=int:2"],
    )  # fmt: skip
    args = llama_server_args(Path("llama-server"), Path("m.gguf"), model, "127.0.0.1", 8080)
    tail = args[args.index("--n-gpu-layers") :]
    assert tail == [
        "--n-gpu-layers", "all", "--flash-attn", "on", "--cache-type-k", "q8_0", "--cache-type-v", "q8_0",
        "--batch-size", "1024", "--ubatch-size", "256", "--rope-scaling", "yarn", "--rope-freq-base", "10000.0",
        "--rope-freq-scale", "0.5", "--load-mode", "mlock", "--spec-draft-model", str(draft), "--spec-draft-n-max",
        "8", "--override-kv", "llama.expert_used_count=int:2",
    ]  # fmt: skip
    assert "--n-gpu-layers" not in llama_server_args(Path("l"), Path("m.gguf"), ModelConfig(name="m"), "h", 1)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"llama_server_args": ["--port", "9"]}, "--port is not a llama-server flag that llmserver passes on"),
        ({"llama_server_args": ["--api-key=x"]}, "takes no --flag=value"),
        ({"llama_server_args": ["-c", "99"]}, "-c is not a llama-server flag"),
        ({"llama_server_args": ["--path", "/"]}, "--path is not a llama-server flag"),
        # issue 54: each of these was accepted and run (llama.cpp reads `_` in a long flag as `-`)
        ({"llama_server_args": ["--api_key", "K"]}, "--api_key is not a llama-server flag"),
        ({"llama_server_args": ["--tools", "read_file,exec_shell_command"]}, "--tools is not a llama-server flag"),
        ({"llama_server_args": ["--log_file", "/tmp/x"]}, "--log_file is not a llama-server flag"),
        ({"llama_server_args": ["--cache_ram", "512"]}, "--cache_ram is not a llama-server flag"),
        ({"llama_server_args": ["--slot-save-path", "/tmp"]}, "--slot-save-path is not a llama-server flag"),
        ({"llama_server_args": ["--props"]}, "--props is not a llama-server flag"),
        ({"llama_server_args": ["--temp"]}, "--temp needs a value"),
        ({"llama_server_args": ["0.5"]}, "'0.5' follows no flag that takes a value"),
        ({"llama_server_args": ["--no-warmup", "--api-key", "k"]}, "--api-key is not a llama-server flag"),
        ({"llama_server_args": ["--cache_type_k", "q4_0"]}, "--cache-type-k: use the model setting cache_type_k"),
        ({"llama_server_args": ["-ctk", "q4_0"]}, "-ctk: use the model setting cache_type_k"),
        ({"llama_server_args": ["--n-gpu-layers=99"]}, "--n-gpu-layers: use the model setting n_gpu_layers"),
        ({"cache_type_k": "q3_k"}, "cache_type_k"),
        ({"embedding": True, "batch_size": 64}, "an embedding model's batch is its ctx_size"),
        ({"draft_max": 4}, "draft_max needs draft_model"),
    ],
)
def test_llama_server_knobs_are_checked(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError) as refused:
        ModelConfig(name="m", **fields)  # type: ignore[arg-type]
    assert message in str(refused.value)


def test_allowed_llama_server_flags_pass_with_their_values() -> None:
    args = ["--temp", "0.2", "--top_k", "5", "--no-warmup", "-s", "-1", "--override-kv", "a=int:2", "--swa-full"]
    assert ModelConfig(name="m", llama_server_args=args).llama_server_args == args
