"""The limits on what a request may attach, in one place: each is a section of the settings
(`limits.images`, `limits.files`, `limits.files.archive`), and the very object the input services are
given. The defaults and descriptions here are the documented ones."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from llmserver.inputs.archives import ArchiveLimits

MIB = 1024 * 1024


class ImageLimits(BaseModel):
    """Images in a request (`image_url` parts): the settings section `limits.images`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_images: int = Field(default=4, ge=0, le=64, description="Images one request may carry (400 beyond).")
    max_bytes: int = Field(
        default=8 * MIB, ge=1024, description="Size of one image in bytes, before base64 (413 beyond)."
    )
    max_side: int = Field(
        default=768, ge=64, le=8192, description="Images are downscaled to this many pixels on their longer side."
    )
    max_pixels: int = Field(
        default=50_000_000,
        ge=1,
        description="Pixels an image may have, read from its header before decoding (400 beyond).",
    )
    # A 768-px image in 14-px patches is 55 x 55 = 3,025 tokens, with room for a model's separators.
    token_allowance: int = Field(
        default=4096,
        ge=1,
        description="Prompt tokens reserved from a key's quota per image until the instance has counted them.",
    )
    max_redirects: int = Field(default=3, ge=0, le=20, description="Redirects followed when fetching an image URL.")
    fetch_timeout: float = Field(
        default=20.0, gt=0, description="Seconds fetching one image URL may take, redirects included (400 beyond)."
    )
    fetch_allow_hosts: list[str] = Field(
        default_factory=list,
        description="host:port pairs image URLs may be fetched from although private. For tests only.",
    )


class FileLimits(BaseModel):
    """Files in a request (`file` parts) and the extraction of their text: the settings section
    `limits.files`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_files: int = Field(default=5, ge=0, le=64, description="Files one request may carry (400 beyond).")
    max_bytes: int = Field(
        default=15 * MIB, ge=1024, description="Size of one file in bytes, before base64 (413 beyond)."
    )
    max_chars: int = Field(
        default=40_000, ge=1, description="Characters of text kept per uploaded file (cut, visibly, beyond)."
    )
    extract_timeout: float = Field(
        default=60.0, gt=0, description="Seconds extracting the text of one uploaded file may take (422 beyond)."
    )
    extract_memory_mb: int = Field(
        default=1024, ge=64, description="Memory one file's extraction may use, in MiB, beyond its loaded code (422)."
    )
    extract_workers: int = Field(
        default=0, ge=0, description="Files extracted at once across all requests; 0: the number of CPUs."
    )
    archive: ArchiveLimits = Field(default_factory=ArchiveLimits, description="Uploaded ZIP archives.")
