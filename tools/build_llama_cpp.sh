#!/usr/bin/env bash
# Build llama.cpp's own benchmark and speculation binaries natively (the peers of tools/bench_peers.py) from the
# llama.cpp source that the llama-cpp-python sdist on PyPI carries. Cached outside the repository:
#   $SPECEDGE_CACHE (default ~/.cache/specedge)/llama.cpp/<version>/build/bin/{llama-bench,llama-lookup,
#   llama-speculative-simple}
# Usage: tools/build_llama_cpp.sh [llama-cpp-python version, default 0.3.36]   (prints the bin directory)
set -euo pipefail
VER=${1:-0.3.36}
ROOT=${SPECEDGE_CACHE:-$HOME/.cache/specedge}/llama.cpp/$VER
BIN=$ROOT/build/bin
TARGETS="llama-bench llama-lookup llama-speculative-simple"
if [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-speculative-simple" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$ROOT"
if [ ! -d "$ROOT/src" ]; then
    python3 -m pip download --no-deps --no-binary=:all: -q -d "$ROOT/sdist" "llama-cpp-python==$VER" >&2
    tar xzf "$ROOT"/sdist/llama_cpp_python-"$VER".tar.gz -C "$ROOT"
    mv "$ROOT/llama_cpp_python-$VER/vendor/llama.cpp" "$ROOT/src"
    rm -rf "$ROOT/llama_cpp_python-$VER" "$ROOT/sdist"
fi
cmake -S "$ROOT/src" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >&2
# shellcheck disable=SC2086
cmake --build "$ROOT/build" -j "$(nproc)" --target $TARGETS >&2
echo "$BIN"
