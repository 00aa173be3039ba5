"""Fetch the web console's one third-party asset, libsodium's JavaScript build, from npm's registry.

The console decrypts async results in the browser (XChaCha20-Poly1305), with libsodium.js: two files
from two npm packages, pinned here with the registry's published SHA-512 of each tarball. They go
into the package (src/llmserver/console/static/vendor/), so that the server never needs the internet.
Run by scripts/setup.sh; safe to run again (a file already there with the right version is kept).
Set NPM_REGISTRY to use a mirror of the registry.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import sys
import tarfile
import urllib.request
from pathlib import Path

VENDOR = Path(__file__).resolve().parent.parent / "src" / "llmserver" / "console" / "static" / "vendor"
VERSION = "0.7.15"
PACKAGES = {
    # package: (file in its tarball, file here, the registry's dist.integrity)
    "libsodium": (
        "package/dist/modules/libsodium.js",
        "libsodium.js",
        "sha512-sZwRknt/tUpE2AwzHq3jEyUU5uvIZHtSssktXq7owd++3CSgn8RGrv6UZJJBpP7+iBghBqe7Z06/2M31rI2NKw==",
    ),
    "libsodium-wrappers": (
        "package/dist/modules/libsodium-wrappers.js",
        "libsodium-wrappers.js",
        "sha512-E4anqJQwcfiC6+Yrl01C1m8p99wEhLmJSs0VQqST66SbQXXBoaJY0pF4BNjRYa/sOQAxx6lXAaAFIlx+15tXJQ==",
    ),
}


def fetch(package: str, member: str, target: str, integrity: str) -> None:
    registry = os.environ.get("NPM_REGISTRY", "https://registry.npmjs.org").rstrip("/")
    url = f"{registry}/{package}/-/{package}-{VERSION}.tgz"
    with urllib.request.urlopen(url, timeout=120) as answer:
        tarball = answer.read()
    digest = "sha512-" + base64.b64encode(hashlib.sha512(tarball).digest()).decode()
    if digest != integrity:
        sys.exit(f"fetch_assets: {url} does not match its published hash: refusing it")
    with tarfile.open(fileobj=io.BytesIO(tarball)) as archive:
        content = archive.extractfile(member)
        licence = archive.extractfile("package/LICENSE")
        assert content is not None and licence is not None, f"{member} missing from {url}"
        (VENDOR / target).write_bytes(content.read())
        (VENDOR / f"{target}.LICENSE").write_bytes(licence.read())


def main() -> None:
    VENDOR.mkdir(parents=True, exist_ok=True)
    stamp = VENDOR / "VERSION"
    present = all((VENDOR / target).exists() for _, target, _ in PACKAGES.values())
    if present and stamp.exists() and stamp.read_text().strip() == VERSION:
        return
    for package, (member, target, integrity) in PACKAGES.items():
        print(f"setup: fetching {package} {VERSION} from npm's registry for the console")
        fetch(package, member, target, integrity)
    stamp.write_text(VERSION + "\n")


if __name__ == "__main__":
    main()
