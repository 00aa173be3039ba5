from __future__ import annotations

import json
import socket
from pathlib import Path

import click
import pytest
from pydantic import BaseModel, SecretStr, ValidationError

from llmserver.commands import models_from_args
from llmserver.commands.config import markdown_reference, markdown_renamed
from llmserver.inputs.limits import FileLimits, ImageLimits
from llmserver.settings import (
    DEFAULT_MODEL_NAME,
    RENAMED,
    ModelConfig,
    Settings,
    env_name,
    load_settings,
    meant,
    setting_paths,
)


def test_defaults_serve_the_embedded_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMSERVER_DATA_DIR", raising=False)
    settings = load_settings()
    assert [m.name for m in settings.models] == [DEFAULT_MODEL_NAME]
    assert settings.models[0].path is None
    assert (settings.server.host, settings.server.port, settings.owned_by) == ("127.0.0.1", 8000, "5cbot_llm_server")
    assert settings.data_dir.name == "llmserver"


def test_file_then_env_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        'owned_by = "from-file"\n'
        '[server]\nport = 9000\nhost = "0.0.0.0"\n'
        '[[models]]\nname = "a"\npath = "/m/a.gguf"\nparallel = 2\n'
        '[[models]]\nname = "b"\npath = "/m/a.gguf"\n'
    )
    monkeypatch.setenv("LLMSERVER_OWNED_BY", "from-env")
    monkeypatch.setenv("LLMSERVER_SERVER__HOST", "10.0.0.1")
    settings = load_settings(config, server={"host": "127.0.0.2", "port": None})
    assert settings.server.port == 9000  # file
    assert settings.owned_by == "from-env"  # env beats file
    assert settings.server.host == "127.0.0.2"  # flag beats env
    assert settings.deprecations == ()
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
        "[limits]\ndefault_max_tokens = 900\nmax_tokens = 100\n",
        "default_max_tokens = 900\nmax_tokens_limit = 100\n",  # the old names, checked as the new
        "no_such_setting = 1\n",
        "[server]\nno_such_setting = 1\n",
        "[limits.images]\nmax_bytes = 10\n",
        "[instances]\ntls_cert = '/c.pem'\n",  # without its key
        "[server]\nworkers = 2\n",  # role all: every worker would start its own instances
        # SQLite: one gateway's file
        'role = "gateway"\n[server]\nworkers = 2\n[state]\nredis_url = "redis://127.0.0.1:6379"\n',
        'role = "gateway"\n[server]\nworkers = 0\n',
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
    paths = setting_paths()
    assert len(paths) > 80 and ("limits", "files", "archive", "max_depth") in paths
    for path in paths:
        assert f"| `{'.'.join(path)}` |" in table and f"`{env_name(path)}`" in table
    for name in ModelConfig.model_fields:
        assert f"`models[].{name}`" in table
    renamed = markdown_renamed()
    for old, path in RENAMED.items():
        assert f"| `{old}` | `{'.'.join(path)}`" in renamed


def test_every_old_name_leads_to_a_setting() -> None:
    assert set(RENAMED.values()) <= set(setting_paths())
    assert not RENAMED.keys() & {path[0] for path in setting_paths() if len(path) == 1}


def sample(path: tuple[str, ...]) -> tuple[object, str]:
    """A value for the setting at `path` other than its default (what the test expects to read back),
    and how the environment writes it."""
    special: dict[tuple[str, ...], object] = {
        ("server", "workers"): 1,  # more needs role gateway and PostgreSQL: checked in its own test
        ("router", "policy"): "least_loaded",
        ("prompt_cache", "isolation"): "shared",
        ("observability", "log_level"): "debug",
        ("observability", "log_format"): "json",
        ("node", "labels"): {"gpu": "a100"},
        ("limits", "images", "fetch_allow_hosts"): ["127.0.0.1:9"],
        ("limits", "default_max_tokens"): 100,
    }
    owner: type[BaseModel] = Settings
    for part in path[:-1]:
        owner = owner.model_fields[part].annotation  # type: ignore[assignment]
    field = owner.model_fields[path[-1]]
    if path in special:
        value = special[path]
    else:
        default = field.get_default(call_default_factory=True)
        if isinstance(default, bool):
            value = not default
        elif isinstance(default, int):
            value = default + 1 if default < 8 or path[-1].endswith("port") else default - 1
        elif isinstance(default, float):
            value = default + 0.5
        elif default is None and "Path" in str(field.annotation):
            value = Path("/etc/hosts")
        else:
            value = "x1" if default in ("", None) else f"{default}-1"
    written = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return value, written


def read_back(settings: Settings, path: tuple[str, ...]) -> object:
    value: object = settings
    for part in path:
        value = getattr(value, part)
    return value.get_secret_value() if isinstance(value, SecretStr) else value


def toml_value(value: object) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value) if isinstance(value, Path) else value)


@pytest.mark.parametrize("old", sorted(set(RENAMED) - {"instance_tls_cert", "instance_tls_key"}))
def test_an_old_name_is_read_with_one_warning(old: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = RENAMED[old]
    value, written = sample(path)
    monkeypatch.setenv(f"LLMSERVER_{old.upper()}", written)
    from_env = load_settings()
    assert read_back(from_env, path) == value
    assert from_env.deprecations == (f"LLMSERVER_{old.upper()} is deprecated: set {env_name(path)} instead",)
    monkeypatch.delenv(f"LLMSERVER_{old.upper()}")
    config = tmp_path / "c.toml"
    config.write_text(f"{old} = {toml_value(value)}\n")
    from_file = load_settings(config)
    assert read_back(from_file, path) == value
    section, name = ".".join(path[:-1]), path[-1]
    assert from_file.deprecations == (f"{config}: the setting {old} is deprecated: set {name} in [{section}] instead",)


def test_the_old_tls_pair_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMSERVER_INSTANCE_TLS_CERT", "/c.pem")
    monkeypatch.setenv("LLMSERVER_INSTANCE_TLS_KEY", "/k.pem")
    settings = load_settings()
    assert (settings.instances.tls_cert, settings.instances.tls_key) == (Path("/c.pem"), Path("/k.pem"))
    assert len(settings.deprecations) == 2


def test_a_new_name_wins_over_its_old_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "c.toml"
    config.write_text("port = 9001\n[server]\nport = 9002\n")
    assert load_settings(config).server.port == 9002  # the same source: the new name
    monkeypatch.setenv("LLMSERVER_PORT", "9003")
    assert load_settings(config).server.port == 9003  # the environment over the file, whatever its names
    monkeypatch.setenv("LLMSERVER_SERVER__PORT", "9004")
    assert load_settings(config).server.port == 9004
    assert load_settings(config, server={"port": 9005}).server.port == 9005  # a flag over all


def test_python_callers_may_still_give_old_names_silently() -> None:
    settings = Settings(host="0.0.0.0", max_image_bytes=4096, cache_isolation="shared")
    assert (settings.server.host, settings.limits.images.max_bytes) == ("0.0.0.0", 4096)
    assert settings.prompt_cache.isolation == "shared" and settings.deprecations == ()


def test_the_limits_sections_are_what_inputs_receive() -> None:
    settings = load_settings(limits={"images": {"max_bytes": 4096}, "files": {"archive": {"max_depth": 2}}})
    assert isinstance(settings.limits.images, ImageLimits) and settings.limits.images.max_bytes == 4096
    assert isinstance(settings.limits.files, FileLimits) and settings.limits.files.archive.max_depth == 2


def test_settings_are_read_only() -> None:
    settings = load_settings()
    with pytest.raises(ValidationError):
        settings.server.port = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        settings.models = []  # type: ignore[misc]


def test_derived_values_are_filled_in_once(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path)
    assert settings.state.database_url == f"sqlite:///{tmp_path / 'llmserver.db'}"
    assert settings.state.gateway_id == socket.gethostname()
    assert load_settings(state={"gateway_id": "g1"}).state.gateway_id == "g1"


def test_workers_need_a_gateway_on_postgresql() -> None:
    settings = load_settings(
        role="gateway", server={"workers": 2}, state={"database_url": "postgresql://u@db/llm", "redis_url": "redis://r"}
    )
    assert settings.server.workers == 2


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


def test_an_unknown_name_says_what_it_may_have_meant() -> None:
    assert meant(("models", 0, "ctx")) == ["ctx_size"]
    assert meant(("server", "prot")) == ["port"]
    assert meant(("limits", "images", "max_byte"))[0] == "max_bytes"
    assert meant(("max_image_byte",))[0] == "max_image_bytes"  # an old name, still read
    assert meant(("zzz",)) == []


def test_a_model_s_prices_cost_its_tokens_and_refuse_what_is_no_price() -> None:
    model = ModelConfig.model_validate({"name": "m", "prices": {"input": 3, "cached_input": 0.3, "output": 15}})
    assert model.prices is not None
    # 1,000 prompt tokens of which 400 from the cache, 200 completion tokens.
    assert model.prices.cost(1000, 400, 200) == pytest.approx((600 * 3 + 400 * 0.3 + 200 * 15) / 1e6)
    assert model.prices.cost(10, 50, 0) == pytest.approx(10 * 0.3 / 1e6)  # never more cached than read
    unset = ModelConfig.model_validate({"name": "m", "prices": {"input": 2, "output": 4}})
    assert unset.prices is not None and unset.prices.cost(100, 100, 0) == pytest.approx(100 * 2 / 1e6)
    for wrong in ({"input": -1, "output": 1}, {"input": 1}, {"input": 1, "output": 1, "per": "token"}):
        with pytest.raises(ValidationError):
            ModelConfig.model_validate({"name": "m", "prices": wrong})
    with pytest.raises(ValidationError):
        Settings(billing={"currency": "dollars"})
