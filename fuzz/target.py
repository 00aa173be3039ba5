"""One harness under atheris: `python -m fuzz.target NAME [libFuzzer arguments]` (fuzz/run.py runs it)."""

from __future__ import annotations

import sys

import atheris

# Our code, and the pure-Python image plugins of Pillow (their C decoders are not instrumented).
with atheris.instrument_imports(include=["llmserver", "PIL"]):
    from PIL import Image

    from fuzz.harnesses import HARNESSES

    Image.init()  # the format plugins, imported now so that they are instrumented too


def main() -> None:
    name = sys.argv.pop(1)
    atheris.Setup(sys.argv, HARNESSES[name])
    atheris.Fuzz()


if __name__ == "__main__":
    main()
