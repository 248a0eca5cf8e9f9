#!/usr/bin/env bash
# Run specedge's runtime as an AArch64 (Jetson, Raspberry Pi) process on an x86 Debian machine, under qemu's user-mode
# emulation: an arm64 Python from Debian's packages, arm64 wheels of the runtime's dependencies from PyPI, and
# specedge's kernels built by the cross compiler for Armv8.2 with dot products (SPECEDGE_KERNEL_MARCH). It checks
# that the Arm paths work end to end (the NEON GEMM inside ONNX Runtime, speculative = plain); it times nothing
# that means anything (emulation).
#
#   tools/dev/arm_qemu.sh setup DIR                      # once: ~150 MB into DIR (needs root for apt, network)
#   tools/dev/arm_qemu.sh run DIR SCRIPT.py ARGS...      # the script under emulated aarch64, this checkout importable
#   tools/dev/arm_qemu.sh run DIR -m specedge.runtime.cli BUNDLE "prompt" --no-spec
#
# Needs Debian's qemu-user, gcc-aarch64-linux-gnu and libc6-dev-arm64-cross (setup installs them).
set -euo pipefail
cmd=${1:?usage: arm_qemu.sh setup DIR | run DIR ARGS...}
dir=$(realpath -m "${2:?DIR}")
shift 2
repo=$(cd "$(dirname "$0")/../.." && pwd)

if [ "$cmd" = setup ]; then
    mkdir -p "$dir/debs" "$dir/root/proc" "$dir/pkg/specedge"
    dpkg --add-architecture arm64
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross >/dev/null
    (cd "$dir/debs" && apt-get download -q python3.11-minimal:arm64 libpython3.11-minimal:arm64 \
        libpython3.11-stdlib:arm64 libc6:arm64 zlib1g:arm64 libexpat1:arm64 libffi8:arm64 libssl3:arm64 \
        libbz2-1.0:arm64 liblzma5:arm64 libgcc-s1:arm64 libstdc++6:arm64 libuuid1:arm64 libsqlite3-0:arm64 \
        libncursesw6:arm64 libtinfo6:arm64 libreadline8:arm64 libcrypt1:arm64 libnsl2:arm64 libtirpc3:arm64 \
        libdb5.3:arm64 libgssapi-krb5-2:arm64)
    for d in "$dir"/debs/*.deb; do dpkg -x "$d" "$dir/root"; done
    # ONNX Runtime's CPU detection reads /proc/cpuinfo, and qemu shows the host's (x86) one, on which it crashes:
    # a Cortex-A78 (Jetson Orin's core) stands in, through qemu's -L path prefix
    for i in 0 1; do
        printf 'processor\t: %s\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid' "$i"
        printf ' asimdrdm lrcpc dcpop asimddp\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x1\n'
        printf 'CPU part\t: 0xd41\nCPU revision\t: 1\n\n'
    done >"$dir/root/proc/cpuinfo"
    py=$(command -v python3)
    "$py" -m pip install -q --target "$dir/site" --platform manylinux2014_aarch64 --platform manylinux_2_28_aarch64 \
        --python-version 3.11 --implementation cp --only-binary=:all: numpy onnxruntime tokenizers jinja2 click
    echo "arm64 environment ready in $dir"
elif [ "$cmd" = run ]; then
    # this checkout as the specedge package (its package-dir mapping, as links)
    for part in runtime export configs; do ln -sfn "$repo/$part" "$dir/pkg/specedge/$part"; done
    exec env PYTHONPATH="$dir/site:$dir/pkg" CC=aarch64-linux-gnu-gcc \
        SPECEDGE_KERNEL_MARCH="${SPECEDGE_KERNEL_MARCH:-armv8.2-a+dotprod}" SPECEDGE_CACHE="$dir/cache" \
        qemu-aarch64 -cpu max -L "$dir/root" "$dir/root/usr/bin/python3.11" "$@"
else
    echo "usage: arm_qemu.sh setup DIR | run DIR ARGS..." >&2
    exit 2
fi
