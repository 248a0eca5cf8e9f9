"""What the CPU this process runs on offers, read from Linux's /proc/cpuinfo (elsewhere: os.cpu_count, no flags)."""

from __future__ import annotations

import os
import platform

INT16_MAX = 32767  # x86 uint8 x int8 kernels without VNNI add two products into a saturating int16 (vpmaddubsw)


def _cpuinfo_lines() -> list[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return None


def cpu_features() -> set[str] | None:
    """The x86 flags / Arm features the kernel lists, or None where they cannot be read."""
    lines = _cpuinfo_lines()
    if lines is None:
        return None
    have: set[str] = set()
    for line in lines:
        if line.startswith(("flags", "Features")):
            have.update(line.split(":", 1)[1].split())
    return have


def cpu_name() -> str:
    for line in _cpuinfo_lines() or []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
              "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16", "neon", "asimd", "asimddp", "sve")


def cpu_flags() -> str:
    """The SIMD features that decide which ONNX Runtime kernels run (x86 flags / Arm features), as listed."""
    have = cpu_features()
    if have is None:
        return "unknown"
    return " ".join(f for f in SIMD_FLAGS if f in have) or "none of " + ",".join(SIMD_FLAGS[:4])


def physical_cores() -> int:
    lines = _cpuinfo_lines() or []
    cores = {line.split(":")[1].strip() for line in lines if line.startswith("core id")}
    return max(1, min(len(cores), os.cpu_count() or 1)) if cores else (os.cpu_count() or 1)


def int16_pair_saturation() -> bool | None:
    """Whether ONNX Runtime's uint8 x int8 integer GEMM on this CPU adds products in saturating int16 pairs:
    x86 without VNNI (AVX2, AVX-512 before Cascade Lake) uses vpmaddubsw; VNNI (vpdpbusd) and Arm dot products
    accumulate in int32. None where the flags cannot be read."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return False
    have = cpu_features()
    if not have:
        return None
    return not ({"avx512_vnni", "avx_vnni"} & have)
