"""The limits on what a request may attach, in one place. The defaults here are the documented ones;
`Settings` exposes every field (its defaults read from these classes) and builds the objects the
input services are given."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserver.inputs.archives import ArchiveLimits

MIB = 1024 * 1024


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 4  # per request
    max_bytes: int = 8 * MIB  # per image, raw (before base64)
    max_side: int = 768  # the longer side after downscaling
    max_pixels: int = 50_000_000  # read from the header before decoding: a 20000 x 20000 bomb is refused
    # What one image may add to the prompt, for the quota's bound before the instance counts it:
    # a 768-px image in 14-px patches is 55 x 55 = 3,025 tokens, with room for a model's separators.
    token_allowance: int = 4096
    max_redirects: int = 3  # followed when fetching an image URL, each one checked
    max_url_length: int = 2048


@dataclass(frozen=True)
class FileLimits:
    max_files: int = 5  # per request
    max_bytes: int = 15 * MIB  # per file, raw (before base64)
    max_chars: int = 40_000  # extracted text per uploaded file; cut beyond, visibly
    archive: ArchiveLimits = field(default_factory=ArchiveLimits)
