"""specedge's own CPU kernels (``--quant-form specedge``): built from C on first use, loaded into ONNX Runtime.

``csrc/sek_gemm.c`` is a quantized GEMM for the few rows of a decode or verify step whose rows are
batch-invariant by construction (exact integer block sums, then the same fp32 operations in the same order for
every row, whatever the step's width) and whose cost grows slowly with the width: each 64-byte chunk of weights
is unpacked once and used for up to 10 rows. ``csrc/sek_ort.c`` exposes it to ONNX Runtime as the custom ops
``ai.specedge::SekMatMul`` (fp32 block scales) and ``SekMatMulSB`` (GGUF K-quants' two-level scales), with
``SekAttention`` and ``SekRowAttention`` (row-addressed steps: each row names its KV slot and position) from
``csrc/sek_attn.c``, through the C API's stable ABI, so no ONNX Runtime header or SDK is needed.

Nothing is compiled at ``pip install``: the first ONNX Runtime session that needs the op runs the C compiler
(``cc``, or ``$CC``) once, with ``-O3 -march=native`` (``-mcpu=native`` on Arm: the kernels are tuned to this CPU:
AVX512-VNNI, AVX2 + FMA, Arm NEON with or without dot products, or portable C elsewhere), into
``~/.cache/specedge/kernels/<hash>/`` (``SPECEDGE_CACHE`` moves it). The hash covers the sources, the compiler's
version, the flags and the CPU's flags, so a home directory shared by two machines never loads a build made for the
other (a new specedge version builds anew; older builds in that directory can be deleted). A bundle in this form
on a machine without a C compiler is
refused with the way out (re-export with ``--quant-form matmulnbits``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from .cpu import cpu_features
from .errors import BackendUnavailableError

DOMAIN = "ai.specedge"
OP = "SekMatMul"
SOURCES = ("sek_gemm.c", "sek_gemm_neon.c", "sek_attn.c", "sek_act.c", "sek_ort.c")
HEADERS = ("sek.h", "sek_gemm_impl.h")
CFLAGS = ("-O3", "-shared", "-fPIC", "-fvisibility=hidden", "-std=c11", "-D_GNU_SOURCE")


def _march() -> str:
    """The target flag of the build: this CPU (-march=native; -mcpu=native on Arm, which GCC and Clang both take
    there: Clang refused -march=native on Arm before version 15), or -march=SPECEDGE_KERNEL_MARCH (e.g. haswell:
    AVX2 + FMA, no AVX-512 — how the tests exercise the AVX2 paths on an AVX-512 machine; alderlake: AVX2 +
    AVX-VNNI, the avxvnni path)."""
    if os.environ.get("SPECEDGE_KERNEL_MARCH"):
        return "-march=" + os.environ["SPECEDGE_KERNEL_MARCH"]
    return "-mcpu=native" if platform.machine().lower() in ("aarch64", "arm64") else "-march=native"


# SPECEDGE_SEK_ISA values, bit positions of the ISA mask
ISA_NAMES = {1: "scalar", 2: "avx2", 3: "vnni512", 4: "neon", 5: "avxvnni"}

_built: Path | None = None


def _src_dir() -> Path:
    return Path(__file__).resolve().parent / "csrc"


def cache_root() -> Path:
    """specedge's cache directory on this machine: SPECEDGE_CACHE, default ~/.cache/specedge."""
    return Path(os.environ.get("SPECEDGE_CACHE", "~/.cache/specedge")).expanduser()


def _cache_dir() -> Path:
    return cache_root() / "kernels"


def compiler() -> list[str]:
    """The C compiler command: $CC (split like a shell would: "ccache gcc" works), else cc, gcc or clang."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise BackendUnavailableError(
            "this bundle runs specedge's own CPU kernels (--quant-form specedge), which are compiled on first use, "
            "and no C compiler was found (cc, gcc, clang or $CC). Install one (Debian/Ubuntu: apt install gcc), or "
            "re-export the bundle with --quant-form matmulnbits (ONNX Runtime's own kernels)")
    return [cc]


def use_library(path: str | Path) -> Path:
    """Take the kernels of the bundles loaded from now on from ``path``, a library ``library_path()`` built (from
    another checkout, or with another SPECEDGE_KERNEL_MARCH), instead of this checkout's: tools that time two builds
    side by side in one process. Sessions already open keep the library they registered."""
    global _built
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file (build one with specedge.runtime.kernels.library_path())")
    _built = p
    return p


def library_path() -> Path:
    """The built kernel library for this machine, compiling it first if needed (once per sources/CPU)."""
    global _built
    if _built is not None and _built.is_file():
        return _built
    cc = compiler()
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BackendUnavailableError(f"the C compiler {' '.join(cc)} does not run ({e}); set CC to a working one") \
            from None
    srcs = [_src_dir() / s for s in SOURCES]
    h = hashlib.sha256()
    for hdr in HEADERS:
        h.update((_src_dir() / hdr).read_bytes())
    # -march=native: the build is this CPU's. Where /proc/cpuinfo cannot be read the platform strings stand in.
    cpu = " ".join(sorted(cpu_features() or ())) or f"{platform.platform()} {platform.processor()} {platform.node()}"
    flags = (*CFLAGS, _march())
    for part in [*(p.read_bytes() for p in srcs), version.encode(), " ".join(flags).encode(), cpu.encode()]:
        h.update(part)
        h.update(b"\0")
    out = _cache_dir() / h.hexdigest()[:16] / "libspecedge_kernels.so"
    if not out.is_file():
        cmd = [*cc, *flags, "-o", "LIB", *map(str, srcs), "-lm"]
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
                tmp_lib = Path(tmp) / out.name
                cmd[cmd.index("LIB")] = str(tmp_lib)
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if r.returncode != 0:
                    raise BackendUnavailableError(
                        f"building specedge's CPU kernels failed ({' '.join(cmd)}):\n{(r.stderr or r.stdout)[-2000:]}\n"
                        "Re-export the bundle with --quant-form matmulnbits to run without them")
                os.replace(tmp_lib, out)  # atomic: a concurrent first use sees no library or the whole one
        except OSError as e:
            raise BackendUnavailableError(f"cannot build specedge's CPU kernels into {out.parent} ({e}); set "
                                          "SPECEDGE_CACHE to a writable directory") from None
        except subprocess.TimeoutExpired:
            raise BackendUnavailableError(f"building specedge's CPU kernels took over 10 minutes ({' '.join(cmd)})") \
                from None
    _built = out
    return out


def register(session_options) -> None:
    """Make the ``ai.specedge`` ops available to sessions created with these ONNX Runtime options."""
    try:
        session_options.register_custom_ops_library(str(library_path()))
    except BackendUnavailableError:
        raise
    except Exception as e:  # onnxruntime's own exception types
        raise BackendUnavailableError(f"ONNX Runtime could not load specedge's kernel library {library_path()}: {e}") \
            from None


class Kernel:
    """The same C code through ctypes, for tests and tools: ``gemm(a, packed, isa)`` without ONNX Runtime."""

    class _Weights(ctypes.Structure):
        _fields_ = [("b", ctypes.c_void_p), ("s", ctypes.c_void_p), ("z", ctypes.c_void_p), ("zs", ctypes.c_void_p),
                    ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("blk", ctypes.c_int64), ("bits", ctypes.c_int),
                    ("sc", ctypes.c_void_p), ("d", ctypes.c_void_p), ("mn", ctypes.c_void_p), ("dmin", ctypes.c_void_p),
                    ("sblk", ctypes.c_int64), ("zconst", ctypes.c_int)]

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(str(library_path()))
        self.lib.sek_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(self._Weights),
                                      ctypes.c_void_p, ctypes.c_int]
        self.lib.sek_gemm.restype = ctypes.c_int

    def isas(self) -> list[str]:
        mask = self.lib.specedge_kernels_isa_mask()
        return [name for bit, name in ISA_NAMES.items() if mask & (1 << bit)]

    def gemm(self, a, b, s, z, n: int, k_pad: int, block: int, bits: int, isa: str = "best"):
        """a [M, K] float32 (K <= k_pad) @ the packed weights -> [M, n] float32 (z: uint8 zero points, or fp32
        zero-point products, as quant.sek_pack made them)."""
        byte_zp = z.dtype == np.uint8
        return self._run(a, self._Weights(b.ctypes.data, s.ctypes.data, z.ctypes.data if byte_zp else None,
                                          None if byte_zp else z.ctypes.data, n, k_pad, block, bits), isa)

    def gemm_sb(self, a, b, sc, d, mn, dmin, n: int, k_pad: int, block: int, bits: int, superblock: int,
                zero_point: int = 0, isa: str = "best"):
        """The same with two-level scales (quant.sek_pack_sb): sc int8, d fp16, and
        mins mn int8 under dmin fp16, or None for both (then zs = zero_point * s)."""
        w = self._Weights(b.ctypes.data, None, None, None, n, k_pad, block, bits, sc.ctypes.data, d.ctypes.data,
                          None if mn is None else mn.ctypes.data, None if dmin is None else dmin.ctypes.data,
                          superblock, zero_point)
        return self._run(a, w, isa)

    def _run(self, a, w, isa: str):
        a = np.ascontiguousarray(a, dtype=np.float32)
        y = np.empty((a.shape[0], w.n), dtype=np.float32)
        code = {"best": 0, **{v: k for k, v in ISA_NAMES.items()}}[isa]
        rc = self.lib.sek_gemm(a.ctypes.data, a.shape[0], a.shape[1], ctypes.byref(w), y.ctypes.data, code)
        if rc:
            raise ValueError(f"sek_gemm failed ({rc}: -1 no such ISA in this build, -2 bad shapes, -3 out of memory)")
        return y
