"""Our GGUF metadata reader (catalog.gguf_metadata), held to the gguf library's own reader: the same
values for every key of the embedded model and of a file the library writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from llmserver.models.files import (
    ModelFileError,
    embedded_model_path,
    estimate_mb,
    gguf_metadata,
    gguf_pooling,
    model_path,
)
from llmserver.pool.instance import llama_server_args
from llmserver.settings import ModelConfig


def library_values(path: Path) -> dict[str, Any]:
    """Every scalar and string value, as gguf's reader gives them (arrays left out, as ours skips them)."""
    values = {}
    for name, field in gguf.GGUFReader(path).fields.items():
        if name.startswith("GGUF.") or field.types[0] == gguf.GGUFValueType.ARRAY:
            continue
        values[name] = field.contents()
    return values


def written(path: Path, pooling: int | None) -> Path:
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_string("general.name", "tiny ünïcode")
    writer.add_uint32("bert.context_length", 512)
    writer.add_float32("bert.attention.layer_norm_epsilon", 1e-12)
    writer.add_bool("bert.attention.causal", False)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    writer.add_array("tokenizer.ggml.scores", [0.5, 0.25, 0.125])
    if pooling is not None:
        writer.add_uint32("bert.pooling_type", pooling)
    writer.add_tensor("token_embd.weight", np.zeros((3, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_embedded_models_metadata_matches_the_librarys() -> None:
    ours = gguf_metadata(embedded_model_path(), lambda key: True)
    theirs = library_values(embedded_model_path())
    assert ours.keys() == theirs.keys() and len(ours) > 20
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value) if isinstance(value, float) else ours[key] == value, key


def test_a_written_files_metadata_and_pooling(tmp_path: Path) -> None:
    path = written(tmp_path / "cls.gguf", pooling=2)
    assert gguf_metadata(path, lambda key: True) == pytest.approx(library_values(path))
    assert gguf_pooling(path) == "cls"
    assert gguf_pooling(written(tmp_path / "none.gguf", pooling=None)) is None
    assert gguf_pooling(embedded_model_path()) is None  # a chat model declares none


def test_an_embedding_model_pools_by_the_ggufs_declaration_else_mean(tmp_path: Path) -> None:
    def pooling(model: ModelConfig, file: Path) -> str:
        args = llama_server_args(Path("llama-server"), file, model, "127.0.0.1", 8080)
        return args[args.index("--pooling") + 1]

    embedding = ModelConfig(name="e", embedding=True)
    assert pooling(embedding, embedded_model_path()) == "mean"  # declares none: every request would fail
    assert pooling(embedding, written(tmp_path / "cls.gguf", pooling=2)) == "cls"
    assert pooling(ModelConfig(name="e", embedding=True, pooling="last"), embedded_model_path()) == "last"
    chat = llama_server_args(Path("llama-server"), embedded_model_path(), ModelConfig(name="c"), "127.0.0.1", 8080)
    assert "--pooling" not in chat


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(40))
    with pytest.raises(ModelFileError):
        gguf_metadata(tmp_path / "x.gguf", lambda key: True)
    (tmp_path / "short.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x00")
    with pytest.raises(ModelFileError):
        gguf_metadata(tmp_path / "short.gguf", lambda key: True)


def test_a_damaged_header_is_refused_without_reading_what_it_claims(tmp_path: Path) -> None:
    """A string length past the file's end (garbage after the magic): a clear error, never a read of
    that many bytes (it was a MemoryError in every supervisor tick), and the size estimate falls back."""
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    with pytest.raises(ModelFileError, match="header is damaged"):
        gguf_metadata(damaged, lambda key: True)
    model = ModelConfig(name="damaged", path=damaged)
    with pytest.raises(ModelFileError, match="not a readable GGUF file: its GGUF header is damaged"):
        model_path(model)
    assert estimate_mb(model, damaged) == int(damaged.stat().st_size / 2**20 * 1.1 + 64)  # from its size alone
    assert model_path(ModelConfig(name="whole", path=embedded_model_path())) == embedded_model_path()
