"""Single-threaded speed of specedge's GEMM kernel on random weights, per weight type, ISA path and rows.

    python tools/dev/kernel_bench.py [--n 4096] [--k 1536] [--rows 1,5] [--isa best,avx2] [--repeats 5]
        [--types Q4_K,Q6_K,int4-b128]

Types: GGUF Q4_K and Q6_K blocks (`Kernel.gemm_sb`, SekMatMulSB: the exact form's body and every Q4_K_M file's
head) and int4-b128, one-level 4-bit blocks of 128 with a zero point (`Kernel.gemm`, SekMatMul: the body of the
fast form, `--no-gguf-exact --quant-block 128 --asymmetric`). The same C code ONNX Runtime runs, without its thread
pool, on one matrix [n, k] of each type, the best of ``repeats`` loops of 20 calls (one call for a matrix of over
64 MB). A 4096 x 1536 matrix stays in the cache: that measures the kernel's arithmetic; one far larger than the
last-level cache (e.g. --n 400000 for int4-b128, 300 MB) streams from memory, and the two side by side say whether
a width is bound by the kernel's arithmetic or by the memory (tools/dev/profile_step.py gives the whole model's
operators). GB/s counts the weight bytes read (levels and scales). Prints the CPU flags with the results: compare
only numbers from one run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from specedge.export.quant import GGUF_REPACKABLE, repack_gguf, sek_pack_sb
from specedge.runtime.cpu import cpu_features
from specedge.runtime.kernels import Kernel

FORMS = {"Q4_K": (4, 32, 0, (0, 2)), "Q6_K": (6, 16, 32, (208,))}  # bits, block, zero point, fp16 scale offsets
TYPES = (*FORMS, "int4-b128")


def random_rows(rng, type_name: str, n: int, k: int) -> np.ndarray:
    """Valid GGUF rows of random levels and scales (finite fp16 super-block scales)."""
    _, nbytes, _ = GGUF_REPACKABLE[type_name]
    raw = rng.integers(0, 256, size=(n, k // 256, nbytes), dtype=np.uint8)
    for at in FORMS[type_name][3]:
        raw[..., at:at + 2] = np.frombuffer(rng.uniform(-0.02, 0.02, raw.shape[0] * raw.shape[1])
                                            .astype(np.float16).tobytes(), np.uint8).reshape(n, k // 256, 2)
    return raw.reshape(n, -1)


def packed(kernel: Kernel, rng, type_name: str, n: int, k: int) -> tuple[Callable[[np.ndarray, str], np.ndarray], int]:
    """A function of (rows, isa) that runs the kernel on random weights of the type, and the weights' bytes."""
    if type_name == "int4-b128":  # any byte is two valid levels; scales and zero points at random
        tiles, kb = -(-n // 16), k // 128
        b = rng.integers(0, 256, size=tiles * kb * 128 * 8, dtype=np.uint8)
        s = rng.random((tiles, kb, 16), dtype=np.float32) * np.float32(0.01)
        z = rng.integers(0, 16, size=(tiles, kb, 16), dtype=np.uint8)
        return lambda x, isa: kernel.gemm(x, b, s, z, 16 * tiles, k, 128, 4, isa), b.nbytes + s.nbytes + z.nbytes
    bits, block, zp, _ = FORMS[type_name]
    p = repack_gguf(type_name, random_rows(rng, type_name, n, k))
    b, sc, d, mn, dmin, n_pad = sek_pack_sb(p)
    nbytes = sum(v.nbytes for v in (b, sc, d, mn, dmin) if v is not None)
    return lambda x, isa: kernel.gemm_sb(x, b, sc, d, mn, dmin, n_pad, p.k, block, bits, 256, zp, isa), nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=1536, help="a multiple of 256")
    ap.add_argument("--rows", default="1,5")
    ap.add_argument("--isa", default="best", help="comma list of best, scalar, avx2, avxvnni, vnni512")
    ap.add_argument("--types", default="Q4_K,Q6_K", help=f"comma list of {', '.join(TYPES)}")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    if a.k % 256:
        ap.error(f"--k must be a multiple of 256 (GGUF super-blocks), got {a.k}")
    types = a.types.split(",")
    if bad := [t for t in types if t not in TYPES]:
        ap.error(f"--types: unknown {', '.join(bad)} (allowed: {', '.join(TYPES)})")
    kernel, rng = Kernel(), np.random.default_rng(0)
    flags = " ".join(f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni")
                     if f in (cpu_features() or ()))
    print(f"CPU flags: {flags or 'unknown'}; kernel paths built: {kernel.isas()}; matrix {a.n} x {a.k}")
    print("| type | ISA | rows | ms per call | GB/s of weights |\n|---|---|---|---|---|")
    for type_name in types:
        run, nbytes = packed(kernel, rng, type_name, a.n, a.k)
        calls = 1 if nbytes > 64 << 20 else 20
        for isa in a.isa.split(","):
            for m in (int(r) for r in a.rows.split(",")):
                x = rng.standard_normal((m, a.k)).astype(np.float32)
                run(x, isa)
                best = float("inf")
                for _ in range(a.repeats):
                    t = time.perf_counter()
                    for _ in range(calls):
                        run(x, isa)
                    best = min(best, (time.perf_counter() - t) / calls)
                print(f"| {type_name} | {isa} | {m} | {best * 1e3:.3f} | {nbytes / best / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
