"""axe-core, Deque's accessibility checker, for the console tests: its one-file build from npm's registry
(pinned, checked against the registry's published SHA-512), fetched once into pytest's cache folder and
injected into the page under test. It is never part of the console itself."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import tarfile
import urllib.request
from pathlib import Path
from typing import Any

VERSION = "4.14.1"
INTEGRITY = "sha512-FHfa+lmNjQZfJz1q8wKqIDwC6DExcHt/pkjNQb09a3NPjCKg2rhu5qb2S4r76ASyFNNtuFooJpZe37OgudVGtQ=="
CACHE = Path(__file__).resolve().parents[2] / ".pytest_cache" / "axe-core"


def source() -> str:
    """axe.min.js of the pinned release."""
    cached = CACHE / f"axe-{VERSION}.min.js"
    if not cached.exists():
        registry = os.environ.get("NPM_REGISTRY", "https://registry.npmjs.org").rstrip("/")
        with urllib.request.urlopen(f"{registry}/axe-core/-/axe-core-{VERSION}.tgz", timeout=120) as answer:
            tarball = answer.read()
        digest = "sha512-" + base64.b64encode(hashlib.sha512(tarball).digest()).decode()
        assert digest == INTEGRITY, "axe-core's tarball does not match its published hash"
        with tarfile.open(fileobj=io.BytesIO(tarball)) as archive:
            member = archive.extractfile("package/axe.min.js")
            assert member is not None
            CACHE.mkdir(parents=True, exist_ok=True)
            cached.write_bytes(member.read())
    return cached.read_text()


def violations(page: Any) -> list[dict[str, Any]]:
    """The serious and critical violations of WCAG 2.x A and AA rules on the page as it is now."""
    if not page.evaluate("() => typeof window.axe === 'object'"):
        # Through the DevTools protocol, not a <script>: the console's CSP allows only its own scripts.
        page.evaluate(source())
    found = page.evaluate(
        "async () => (await axe.run(document, { runOnly: ['wcag2a', 'wcag2aa', 'wcag21a', 'wcag21aa'] }))"
        ".violations.map((v) => ({ id: v.id, impact: v.impact, help: v.help,"
        " nodes: v.nodes.map((n) => n.target.join(' ')).slice(0, 5) }))"
    )
    return [v for v in found if v["impact"] in ("serious", "critical")]
