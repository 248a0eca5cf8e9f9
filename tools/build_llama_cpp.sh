#!/usr/bin/env bash
# Build llama.cpp's own benchmark and speculation binaries natively (the peers of tools/bench_peers.py), plus
# llama-server (the concurrency peer for tools that measure serving) and llama-quantize (GGUFs of other block types,
# quantized by llama.cpp itself), from the llama.cpp source that the llama-cpp-python sdist on PyPI carries. Cached
# outside the repository:
#   $SPECEDGE_CACHE (default ~/.cache/specedge)/llama.cpp/<version>/build/bin/{llama-bench,llama-lookup,
#   llama-speculative-simple,llama-server,llama-quantize}
# Usage: tools/build_llama_cpp.sh [llama-cpp-python version, default 0.3.36]   (prints the bin directory)
#   SPECEDGE_LLAMA_ISA=avx2 builds ggml for AVX2 + FMA + F16C + BMI2 without AVX512 (GGML_NATIVE off) into
#   build-avx2/: llama.cpp as an AVX2-only CPU runs it, to set beside ours built with SPECEDGE_KERNEL_MARCH=haswell
#   on an AVX512 machine (the memory system stays this machine's: a proxy for an AVX2-only CPU, not a measurement of one).
#   On a CPU that exposes AMX, the native build turns ggml's AMX path off (it crashes in batched matmuls under some
#   hypervisors) and names this CPU's AVX512 / VNNI / BF16 extensions one by one instead.
set -euo pipefail
VER=${1:-0.3.36}
ROOT=${SPECEDGE_CACHE:-$HOME/.cache/specedge}/llama.cpp/$VER
ISA=${SPECEDGE_LLAMA_ISA:-native}
case "$ISA" in
    native) BUILD=$ROOT/build; ISA_FLAGS="-DGGML_NATIVE=ON"
            if grep -q -w amx_tile /proc/cpuinfo 2>/dev/null; then
                has() { grep -q -w "$1" /proc/cpuinfo && echo ON || echo OFF; }
                ISA_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
                ISA_FLAGS+=" -DGGML_AVX512=ON -DGGML_AVX512_VBMI=$(has avx512vbmi)"
                ISA_FLAGS+=" -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)"
                ISA_FLAGS+=" -DGGML_AVX_VNNI=$(has avx_vnni) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
            fi ;;
    avx2) BUILD=$ROOT/build-avx2
          ISA_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF" ;;
    *) echo "SPECEDGE_LLAMA_ISA must be native or avx2, got '$ISA'" >&2; exit 2 ;;
esac
BIN=$BUILD/bin
TARGETS="llama-bench llama-lookup llama-speculative-simple llama-server llama-quantize"
if [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-speculative-simple" ] && [ -x "$BIN/llama-server" ] &&
   [ -x "$BIN/llama-quantize" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$ROOT"
if [ ! -d "$ROOT/src" ]; then
    python3 -m pip download --no-deps --no-binary=:all: -q -d "$ROOT/sdist" "llama-cpp-python==$VER" >&2
    tar xzf "$ROOT"/sdist/llama_cpp_python-"$VER".tar.gz -C "$ROOT"
    mv "$ROOT/llama_cpp_python-$VER/vendor/llama.cpp" "$ROOT/src"
    rm -rf "$ROOT/llama_cpp_python-$VER" "$ROOT/sdist"
fi
# shellcheck disable=SC2086
cmake -S "$ROOT/src" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release $ISA_FLAGS -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON >&2
# shellcheck disable=SC2086
cmake --build "$BUILD" -j "$(nproc)" --target $TARGETS >&2
echo "$BIN"
