"""Single-threaded speed of specedge's SekMatMulSB kernel on random GGUF Q4_K / Q6_K blocks, per ISA path and rows.

    python tools/kernel_bench.py [--n 4096] [--k 1536] [--rows 1,5] [--isa best,avx2] [--repeats 5]

Times `Kernel.gemm_sb` (runtime/kernels.py: the same C code ONNX Runtime runs, without its thread pool) on one
matrix [n, k] of each type, the best of ``repeats`` loops of 20 calls. A 4096 x 1536 matrix stays in the cache:
this measures the kernel's arithmetic, not memory bandwidth (tools/profile_step.py gives the whole model's).
Prints the CPU flags with the results: compare only numbers from one run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from specedge.export.quant import GGUF_REPACKABLE, repack_gguf, sek_pack_sb
from specedge.runtime.cpu import cpu_features
from specedge.runtime.kernels import Kernel

FORMS = {"Q4_K": (4, 32, 0, (0, 2)), "Q6_K": (6, 16, 32, (208,))}  # bits, block, zero point, fp16 scale offsets


def random_rows(rng, type_name: str, n: int, k: int) -> np.ndarray:
    """Valid GGUF rows of random levels and scales (finite fp16 super-block scales)."""
    _, nbytes, _ = GGUF_REPACKABLE[type_name]
    raw = rng.integers(0, 256, size=(n, k // 256, nbytes), dtype=np.uint8)
    for at in FORMS[type_name][3]:
        raw[..., at:at + 2] = np.frombuffer(rng.uniform(-0.02, 0.02, raw.shape[0] * raw.shape[1])
                                            .astype(np.float16).tobytes(), np.uint8).reshape(n, k // 256, 2)
    return raw.reshape(n, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=1536, help="a multiple of 256")
    ap.add_argument("--rows", default="1,5")
    ap.add_argument("--isa", default="best", help="comma list of best, scalar, avx2, avxvnni, vnni512")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    if a.k % 256:
        ap.error(f"--k must be a multiple of 256 (GGUF super-blocks), got {a.k}")
    kernel, rng = Kernel(), np.random.default_rng(0)
    flags = " ".join(f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni")
                     if f in (cpu_features() or ()))
    print(f"CPU flags: {flags or 'unknown'}; kernel paths built: {kernel.isas()}; matrix {a.n} x {a.k}")
    print("| type | ISA | rows | ms per call |\n|---|---|---|---|")
    for type_name, (bits, block, zp, _) in FORMS.items():
        p = repack_gguf(type_name, random_rows(rng, type_name, a.n, a.k))
        b, sc, d, mn, dmin, n_pad = sek_pack_sb(p)
        for isa in a.isa.split(","):
            for m in (int(r) for r in a.rows.split(",")):
                x = rng.standard_normal((m, p.k)).astype(np.float32)
                run = lambda: kernel.gemm_sb(x, b, sc, d, mn, dmin, n_pad, p.k, block, bits, 256, zp, isa)  # noqa: E731
                run()
                best = float("inf")
                for _ in range(a.repeats):
                    t = time.perf_counter()
                    for _ in range(20):
                        run()
                    best = min(best, (time.perf_counter() - t) / 20)
                print(f"| {type_name} | {isa} | {m} | {best * 1e3:.3f} |", flush=True)


if __name__ == "__main__":
    main()
