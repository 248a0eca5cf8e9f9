"""specedge's own CPU kernel (runtime/csrc/sek_gemm.c, --quant-form specedge): it computes exactly the documented
arithmetic, every ISA path gives the same bits, a row never depends on the other rows of its step, and ONNX
Runtime runs it as ai.specedge::SekMatMul with clear errors for bad shapes."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from fractions import Fraction

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specedge.export.quant import Packed, QuantSpec, quantize, sek_pack
from specedge.runtime.errors import UnsupportedModelError
from specedge.runtime.kernels import Kernel, library_path, register

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the kernels are built with a POSIX C compiler")


@pytest.fixture(scope="module")
def kernel() -> Kernel:
    return Kernel()


def _matrix(rng, n: int, k: int, bits: int, block: int, symmetric: bool):
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    p = quantize(w, QuantSpec(bits, block, symmetric))
    b, s, z, n_pad = sek_pack(p)
    return p, (b, s, z, n_pad, p.b.shape[1] * block)


def _f32(x: Fraction) -> np.float32:
    """x rounded once to float32 (nearest, ties to even): the result of one fused operation."""
    f = np.float32(float(x))
    best = min((f, np.nextafter(f, np.float32(np.inf)), np.nextafter(f, np.float32(-np.inf))),
               key=lambda c: (abs(Fraction(float(c)) - x), int(np.float32(c).view(np.int32)) & 1))
    return np.float32(best)


def _reference(a: np.ndarray, p, block: int) -> np.ndarray:
    """The kernel's documented arithmetic, in exact rationals rounded where the C code rounds: activations to int8
    per (row, block) at sa = max|a| / 127, exact integer block sums, then per block
    y = fma(acc, s * sa, y); y = fma(-(z * s), sa * sum(qa), y)."""
    from specedge.export.quant import _unpack_nibbles

    q = (_unpack_nibbles(p.b) if p.bits == 4 else p.b).astype(np.int64)  # [N, kb, block]
    n, kb, _ = q.shape
    zp = (np.full((n, kb), 1 << (p.bits - 1)) if p.zero_points is None else
          (_unpack_nibbles(p.zero_points)[:, :kb] if p.bits == 4 else p.zero_points)).astype(np.int64)
    # the zero point's product with the scale: z * s in fp32, or with offsets (GGUF Q4_K) z * s - o rounded once
    zs_all = (np.float32(zp.astype(np.float32) * p.scales) if p.offsets is None
              else (zp * p.scales.astype(np.float64) - p.offsets.astype(np.float64)).astype(np.float32))
    return _reference_blocks(a, q, p.scales, zs_all, block)


def _reference_blocks(a: np.ndarray, q: np.ndarray, scales: np.ndarray, zs_all: np.ndarray, block: int) -> np.ndarray:
    """_reference's arithmetic for levels q [N, kb, block], fp32 scales s and zero-point products zs [N, kb]."""
    n, kb, _ = q.shape
    a_pad = np.zeros((a.shape[0], kb * block), np.float32)
    a_pad[:, : a.shape[1]] = a
    y = np.zeros((a.shape[0], n), np.float32)
    for r in range(a.shape[0]):
        for b in range(kb):
            blk = a_pad[r, b * block:(b + 1) * block]
            mx = np.float32(np.abs(blk).max())
            inv = np.float32(np.float32(127) / mx) if mx > 0 else np.float32(0)
            qa = np.rint(blk * inv).astype(np.int64)  # float32 product, then nearest-even
            sa = np.float32(mx / np.float32(127))
            sasum = np.float32(sa * np.float32(qa.sum()))
            for c in range(n):
                acc = int((qa * q[c, b]).sum())
                s = scales[c, b]
                y[r, c] = _f32(Fraction(float(np.float32(acc))) * Fraction(float(np.float32(s * sa)))
                               + Fraction(float(y[r, c])))
                y[r, c] = _f32(-Fraction(float(zs_all[c, b])) * Fraction(float(sasum)) + Fraction(float(y[r, c])))
    return y


@pytest.mark.parametrize("bits,block,symmetric", [(4, 32, True), (4, 64, False), (8, 16, True), (8, 32, False)])
def test_the_kernel_computes_exactly_the_documented_arithmetic_on_every_isa(kernel, bits, block, symmetric):
    rng = np.random.default_rng(bits * 1000 + block)
    n, k = 20, 3 * block - 8  # N not a whole tile, K not whole blocks: both padded
    p, (b, s, z, n_pad, k_pad) = _matrix(rng, n, k, bits, block, symmetric)
    a = rng.standard_normal((3, k)).astype(np.float32)
    a[1] *= 300.0  # an outlier row, and a zero row
    a[2] = 0.0
    ref = _reference(a, p, block)
    for isa in kernel.isas():
        y = kernel.gemm(a, b, s, z, n_pad, k_pad, block, bits, isa)[:, :n]
        assert np.array_equal(y, ref), (isa, np.abs(y - ref).max())


@pytest.mark.parametrize("block", [16, 48, 128, 256])
def test_extreme_blocks_sum_exactly_on_every_isa(kernel, block):
    """Levels at 15 and activations at +-127 throughout: the largest integer sums the 4-bit paths form (the AVX2
    path adds u8 x s8 pairs in int16 over up to four 8-k chunks before widening them: a group of five would wrap
    here). Blocks of 16 and 48 hold 2 and 6 chunks: a short group, and a partial last one."""
    n, k = 16, 2 * block
    # every level 15 (two per byte) under scales and zero points of the kernel's form (built here: the quantizer
    # takes powers of two, the kernel any multiple of 16)
    p = Packed(b=np.full((n, 2, block // 2), 0xFF, np.uint8), scales=np.full((n, 2), 0.03125, np.float32),
               zero_points=np.full((n, 1), 0x38, np.uint8), k=k, bits=4, block=block)
    b, s, z, n_pad = sek_pack(p)
    a = np.ones((2, k), np.float32)
    a[1] = -1.0
    ref = _reference(a, p, block)
    for isa in kernel.isas():
        y = kernel.gemm(a, b, s, z, n_pad, k, block, 4, isa)[:, :n]
        assert np.array_equal(y, ref), (isa, np.abs(y - ref).max())


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_never_depend_on_the_other_rows_or_the_isa(kernel, bits):
    rng = np.random.default_rng(bits)
    p, (b, s, z, n_pad, k_pad) = _matrix(rng, 96, 384, bits, 128, False)
    a = rng.standard_normal((19, 384)).astype(np.float32)  # more rows than one pass of the widest path (8)
    full = {isa: kernel.gemm(a, b, s, z, n_pad, k_pad, 128, bits, isa) for isa in kernel.isas()}
    first = next(iter(full.values()))
    assert all(np.array_equal(first, y) for y in full.values()), "ISA paths differ"
    for isa in kernel.isas():
        for m in (1, 2, 3, 5, 8, 9, 17):
            part = kernel.gemm(a[:m], b, s, z, n_pad, k_pad, 128, bits, isa)
            assert np.array_equal(part, full[isa][:m]), (isa, m)
        alone = kernel.gemm(a[7:8], b, s, z, n_pad, k_pad, 128, bits, isa)
        assert np.array_equal(alone[0], full[isa][7])


def test_nan_propagates_tiny_blocks_count_as_zero_and_the_rounding_mode_does_not_matter(kernel):
    """A NaN or infinity in a row makes that row's outputs NaN (not a large finite number), a block far below any
    real activation counts as zero, and levels are rounded to nearest-even whatever the FP rounding mode the host
    set — on every ISA path alike, other rows untouched."""
    import ctypes.util

    rng = np.random.default_rng(12)
    p, (b, s, z, n_pad, k_pad) = _matrix(rng, 32, 256, 4, 128, False)
    a = rng.standard_normal((4, 256)).astype(np.float32)
    a[1, 5], a[2, 200] = np.nan, np.inf
    a[3, :128] = 1e-33  # a negligible block
    outs = {isa: kernel.gemm(a, b, s, z, n_pad, k_pad, 128, 4, isa) for isa in kernel.isas()}
    ref = kernel.gemm(a[[0]], b, s, z, n_pad, k_pad, 128, 4)
    for isa, y in outs.items():
        assert np.isnan(y[1]).all() and np.isnan(y[2]).all(), isa
        assert np.array_equal(y[0], ref[0]), isa
        assert np.array_equal(y[3], kernel.gemm(np.concatenate([np.zeros(128, np.float32), a[3, 128:]])[None],
                                                b, s, z, n_pad, k_pad, 128, 4, isa)[0]), isa
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    clean = rng.standard_normal((3, 256)).astype(np.float32)
    clean[:, 7] = 3.0  # an exact maximum: a * (127 / max) lands on 127 (and past it when rounding upward)
    want = {isa: kernel.gemm(clean, b, s, z, n_pad, k_pad, 128, 4, isa) for isa in kernel.isas()}
    # FE_UPWARD, FE_DOWNWARD, FE_TOWARDZERO: glibc's values on x86 (the MXCSR/x87 bits) and on Arm (FPCR's RMode)
    modes = ((0x400000, 0x800000, 0xC00000) if platform.machine().lower() in ("aarch64", "arm64")
             else (0x800, 0x400, 0xC00))
    for mode in modes:
        assert libm.fesetround(mode) == 0
        try:
            got = {isa: kernel.gemm(clean, b, s, z, n_pad, k_pad, 128, 4, isa) for isa in kernel.isas()}
        finally:
            libm.fesetround(0)
        for isa in kernel.isas():  # the levels, hence the integer sums, are the same (the fp32 epilogue may round
            # by the mode: compare against the default-mode result loosely, and the paths with each other exactly)
            assert np.allclose(got[isa], want[isa], rtol=1e-5, atol=1e-5), (mode, isa)
        first = next(iter(got.values()))
        assert all(np.array_equal(first, g) for g in got.values()), mode


def test_the_kernel_is_close_to_the_dequantized_product(kernel):
    rng = np.random.default_rng(5)
    p, (b, s, z, n_pad, k_pad) = _matrix(rng, 64, 512, 4, 128, False)
    from specedge.export.quant import dequantize

    a = rng.standard_normal((4, 512)).astype(np.float32)
    ref = a @ dequantize(p).T
    y = kernel.gemm(a, b, s, z, n_pad, k_pad, 128, 4)
    assert np.abs(y - ref).max() / np.abs(ref).max() < 0.02  # 8-bit activations per 128-block


def test_packing_refuses_what_the_kernel_cannot_hold():
    w = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    with pytest.raises(UnsupportedModelError, match="16..256"):
        sek_pack(quantize(w[:, :64], QuantSpec(4, 512)))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q4_1"])
def test_gguf_blocks_with_offsets_run_exactly_through_the_kernel(kernel, type_name):
    """GGUF Q4_K / Q4_1 (w = d sc q - dmin m) are carried with their zero-point products in fp32: the kernel's
    arithmetic on them is exactly the documented one (exact-rational reference), and the weights it stands for are
    gguf's own dequantization up to one fp32 rounding of the offset."""
    import gguf
    from gguf.quants import dequantize as gguf_dequantize

    from specedge.export.quant import GGUF_REPACKABLE, repack_gguf

    block, nbytes, _ = GGUF_REPACKABLE[type_name]
    rng = np.random.default_rng(3)
    n, kb = 32, 1 if type_name == "Q4_K" else 4
    raw = rng.integers(0, 256, size=(n, kb, nbytes), dtype=np.uint8)
    for a in (0, 2):  # finite fp16 d and dmin / m
        raw[..., a:a + 2] = np.frombuffer(rng.uniform(-0.02, 0.02, n * kb).astype(np.float16).tobytes(),
                                          np.uint8).reshape(n, kb, 2)
    raw = raw.reshape(n, kb * nbytes)
    ref_w = gguf_dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(n, -1)
    p = repack_gguf(type_name, raw)
    b, s, zs, n_pad = sek_pack(p)
    assert zs.dtype == np.float32
    from specedge.export.quant import _unpack_nibbles

    q = _unpack_nibbles(p.b).astype(np.float64)  # [N, kb32, 32]
    w = q * p.scales[..., None] - zs.transpose(0, 2, 1).reshape(n_pad, -1)[:n, :, None]  # what the kernel stands for
    np.testing.assert_allclose(w.reshape(n, -1), ref_w, rtol=0, atol=1e-6 * np.abs(ref_w).max())
    a = rng.standard_normal((3, p.k)).astype(np.float32)
    ref = _reference(a, p, 32)
    for isa in kernel.isas():
        assert np.array_equal(kernel.gemm(a, b, s, zs, n_pad, p.k, 32, 4, isa)[:, :n], ref), isa
    y = _session(_model(b, s, zs, p.k, n_pad, 4, 32)).run(None, {"x": a[None]})[0][0]  # fp32 zero points in ORT
    assert np.array_equal(y[:, :n], ref)


# where a GGUF type keeps its fp16 fields (d, and dmin / m), by byte within its block
GGUF_FP16 = {"Q4_K": (0, 2), "Q6_K": (208,), "Q5_K": (0, 2), "Q3_K": (108,), "Q2_K": (80, 82), "Q5_1": (0, 2),
             "IQ4_NL": (0,), "IQ4_XS": (0,)}
# the kernel's form of each: level bits, block, zero point, bits a weight
K_QUANT_FORM = {"Q4_K": (4, 32, 0, 4.625), "Q6_K": (6, 16, 32, 6.5625), "Q5_K": (6, 32, 0, 6.625),
                "Q3_K": (6, 16, 32, 6.5625), "Q2_K": (4, 16, 0, 5.125)}


def _k_quant_rows(rng, type_name: str, n: int, superblocks: int) -> np.ndarray:
    """Random valid GGUF rows (any bits are valid levels, scales and indices; d and dmin finite fp16)."""
    from specedge.export.quant import GGUF_REPACKABLE

    _, nbytes, _ = GGUF_REPACKABLE[type_name]
    raw = rng.integers(0, 256, size=(n, superblocks, nbytes), dtype=np.uint8)
    for at in GGUF_FP16[type_name]:
        raw[..., at:at + 2] = np.frombuffer(rng.uniform(-0.02, 0.02, n * superblocks).astype(np.float16).tobytes(),
                                            np.uint8).reshape(n, superblocks, 2)
    return raw.reshape(n, superblocks * nbytes)


@pytest.mark.parametrize("type_name", ["Q5_1", "IQ4_NL", "IQ4_XS"])
def test_gguf_types_carried_at_8_bits_run_exactly_through_the_kernel(kernel, type_name):
    """GGUF Q5_1 (w = d q + m) and IQ4_NL / IQ4_XS (w = d_j kvalues[q]) through SekMatMul at 8 bits: the levels,
    scales and zero-point products it reads stand for gguf's own dequantization bit for bit (Q5_1's levels under
    zero point 0, so zs = -m exactly), the kernel computes exactly its documented arithmetic on every ISA path, and
    a row never depends on the other rows of its step."""
    import gguf
    from gguf.quants import dequantize as gguf_dequantize

    from specedge.export.quant import repack_gguf

    rng = np.random.default_rng(11)
    n = 24
    raw = _k_quant_rows(rng, type_name, n, 2)
    ref_w = gguf_dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(n, -1)
    p = repack_gguf(type_name, raw)
    b, s, z, n_pad = sek_pack(p)
    tiles = lambda v: v.transpose(0, 2, 1).reshape(n_pad, -1)[:n]  # noqa: E731  [N/16, blocks, 16] -> [N, blocks]
    q = b.reshape(n_pad // 16, -1, p.block // 4, 16, 4).transpose(0, 3, 1, 2, 4).reshape(n_pad, -1, p.block)[:n]
    if type_name == "Q5_1":
        assert z.dtype == np.float32 and q.max() < 32  # zs: fp32, levels stored as they are
        w = q.astype(np.float32) * tiles(s)[..., None] - tiles(z)[..., None]
    else:
        assert z.dtype == np.uint8 and (tiles(z) == 128).all()
        w = (q.astype(np.float32) - 128) * tiles(s)[..., None]
    np.testing.assert_array_equal(w.reshape(n, -1), ref_w)
    a = rng.standard_normal((9, p.k)).astype(np.float32)
    a[1] *= 300.0
    zs = tiles(z).astype(np.float32) * (1 if z.dtype == np.float32 else tiles(s))
    ref = _reference_blocks(a[:3], q.astype(np.int64), tiles(s), np.float32(zs), p.block)
    for isa in kernel.isas():
        full = kernel.gemm(a, b, s, z, n_pad, p.k, p.block, 8, isa)
        assert np.array_equal(full[:3, :n], ref), isa
        for t in (1, 2, 5):
            part = kernel.gemm(a[3:3 + t], b, s, z, n_pad, p.k, p.block, 8, isa)
            assert np.array_equal(part, full[3:3 + t]), (isa, t)


@pytest.mark.parametrize("type_name", sorted(K_QUANT_FORM))
def test_gguf_k_quants_run_with_their_own_two_level_scales_exactly(kernel, type_name, tmp_path):
    """GGUF K-quants through SekMatMulSB: Q4_K (w = d sc q - dmin m, 4-bit), Q6_K (w = d sc (q - 32), 6-bit), Q5_K
    (5-bit levels with mins, held at 6 bits), Q3_K (3-bit levels in Q6_K's form) and Q2_K (2-bit levels with mins,
    held at 4 bits in blocks of 16). The packed levels and integer scales stand for exactly gguf's own
    dequantization (d sc and dmin m are exact fp32 products), the kernel computes exactly its documented two-level
    arithmetic (_reference_sb) on every ISA path, a row never depends on the other rows, and ONNX Runtime's op
    gives the same bits."""
    import gguf
    from gguf.quants import dequantize as gguf_dequantize

    from specedge.export.quant import repack_gguf, sek_pack_sb

    rng = np.random.default_rng(7)
    n, nsb = 40, 2  # N not a whole tile
    raw = _k_quant_rows(rng, type_name, n, nsb)
    at = GGUF_FP16[type_name][0]  # d: subnormal and signed-zero fp16 values too (the C path converts them)
    raw[0, at:at + 2] = np.frombuffer(np.float16(-3e-6).tobytes(), np.uint8)
    raw[1, at:at + 2] = np.frombuffer(np.float16(-0.0).tobytes(), np.uint8)
    ref_w = gguf_dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(n, -1)  # fp32, rounded once
    p = repack_gguf(type_name, raw)
    b, sc, d, mn, dmin, n_pad = sek_pack_sb(p)
    bits, block, zp, per_weight = K_QUANT_FORM[type_name]
    assert (mn is None) == (zp == 32) and b.size == n_pad * p.k * bits // 8 and d.dtype == np.float16
    assert b.nbytes + sc.nbytes + d.nbytes + (0 if mn is None else mn.nbytes + dmin.nbytes) == \
        n_pad * p.k * per_weight / 8  # bits a weight (GGUF: Q4_K 4.5, Q6_K 6.5625, Q5_K 5.5, Q3_K 3.4375, Q2_K 2.625)
    # the weights the kernel stands for, from what it reads (its layout undone)
    tiles = lambda v: v.transpose(0, 2, 1).reshape(n_pad, -1)[:n]  # noqa: E731  [N/16, blocks, 16] -> [N, blocks]
    s_blk = np.float32(np.repeat(tiles(d), 256 // block, axis=1) * tiles(sc).astype(np.float32))
    zs_blk = (np.float32(np.repeat(tiles(dmin), 256 // block, axis=1) * tiles(mn).astype(np.float32)) if mn is not None
              else np.float32(np.float32(zp) * s_blk))
    if bits == 4:
        low = b.reshape(n_pad // 16, -1, block // 8, 16, 4)  # [tile, kb, j, c, t]
        q = np.stack([low & 15, low >> 4], axis=-2).reshape(n_pad // 16, -1, block // 8, 16, 8)  # [.., j, c, k8]
        q = q.transpose(0, 3, 1, 2, 4).reshape(n_pad, -1, block).astype(np.int64)  # [N, kb, block]
    else:  # groups of three chunks: bits 0-5 three levels, bits 6-7 two bits each of the fourth
        g = b.reshape(n_pad // 16, -1, block // 16, 3, 16, 4).astype(np.int64)  # [tile, kb, h, X/Y/Z, c, t]
        fourth = (g[:, :, :, 0] >> 6) << 4 | (g[:, :, :, 1] >> 6) << 2 | g[:, :, :, 2] >> 6
        q = np.concatenate([g & 63, fourth[:, :, :, None]], axis=3)  # [tile, kb, h, i, c, t]: k = 16h + 4i + t
        q = q.transpose(0, 4, 1, 2, 3, 5).reshape(n_pad, -1, block)
    q = q[:n]
    w = q * s_blk[..., None].astype(np.float64) - zs_blk[..., None].astype(np.float64)
    np.testing.assert_array_equal(w.reshape(n, -1).astype(np.float32), ref_w)  # exact products, one rounding
    a = rng.standard_normal((3, p.k)).astype(np.float32)
    a[1] *= 300.0
    ref = _reference_sb(a, q, tiles(sc), None if mn is None else tiles(mn), tiles(d),
                        None if mn is None else tiles(dmin), block, zp)
    assert np.abs(ref - a @ w.reshape(n, -1).T).max() < 0.02 * np.abs(a @ w.reshape(n, -1).T).max()
    for isa in kernel.isas():
        y = kernel.gemm_sb(a, b, sc, d, mn, dmin, n_pad, p.k, block, bits, 256, zp, isa)
        assert np.array_equal(y[:, :n], ref), (isa, np.abs(y[:, :n] - ref).max())
    many = rng.standard_normal((11, p.k)).astype(np.float32)
    full = kernel.gemm_sb(many, b, sc, d, mn, dmin, n_pad, p.k, block, bits, 256, zp)
    for m in (1, 4, 10):
        assert np.array_equal(kernel.gemm_sb(many[m - 1:m], b, sc, d, mn, dmin, n_pad, p.k, block, bits, 256, zp)[0],
                              full[m - 1]), m
    for t in (5, 6, 7, 9):  # steps taken two tiles a pass (5 rows at a time) or one tile with every row
        assert np.array_equal(kernel.gemm_sb(many[2:2 + t], b, sc, d, mn, dmin, n_pad, p.k, block, bits, 256, zp),
                              full[2:2 + t]), t
    for isa in kernel.isas():  # every path's passes of 4 or 5 rows, and their remainders
        for t in (4, 5, 6, 9, 11):
            assert np.array_equal(kernel.gemm_sb(many[:t], b, sc, d, mn, dmin, n_pad, p.k, block, bits, 256, zp, isa),
                                  full[:t]), (isa, t)
    y = _session(_model_sb(b, sc, d, mn, dmin, p.k, n_pad, bits, block, zp)).run(None, {"x": a[None]})[0][0]
    assert np.array_equal(y[:, :n], ref)


def _reference_sb(a, q, sc, mn, d, dmin, block: int, zconst: int, sblk: int = 256) -> np.ndarray:
    """SekMatMulSB's documented arithmetic (tile_sb_scalar), in exact integers and rationals rounded where the C code
    rounds: activations to int8 per (row, super-block) as in _reference; per super-block the exact sums
    I = sum_j sc_j dot_j and M = sum_j m_j bsum_j (m = mn, or sc without mins), then
    y = fma(I, d sa, y); y = fma(-M, dmin sa, y) — or, without mins, y = fma(I - zconst M, d sa, y)."""
    n, kb, _ = q.shape
    per = sblk // block
    y = np.zeros((a.shape[0], n), np.float32)
    for r in range(a.shape[0]):
        for sb in range(kb // per):
            x = a[r, sb * sblk:(sb + 1) * sblk]
            mx = np.float32(np.abs(x).max())
            inv = np.float32(np.float32(127) / mx) if mx > 0 else np.float32(0)
            qa = np.rint(x * inv).astype(np.int64).reshape(per, block)
            sa = np.float32(mx / np.float32(127))
            for c in range(n):
                bj = range(sb * per, (sb + 1) * per)
                i1 = sum(int(sc[c, j]) * int((qa[j - sb * per] * q[c, j]).sum()) for j in bj)
                m = mn if mn is not None else sc
                mm = sum(int(m[c, j]) * int(qa[j - sb * per].sum()) for j in bj)
                ds = np.float32(np.float32(d[c, sb]) * sa)
                if mn is not None:
                    y[r, c] = _f32(Fraction(float(np.float32(i1))) * Fraction(float(ds)) + Fraction(float(y[r, c])))
                    dms = np.float32(np.float32(dmin[c, sb]) * sa)
                    y[r, c] = _f32(-Fraction(float(np.float32(mm))) * Fraction(float(dms)) + Fraction(float(y[r, c])))
                else:
                    y[r, c] = _f32(Fraction(float(np.float32(i1 - zconst * mm))) * Fraction(float(ds))
                                   + Fraction(float(y[r, c])))
    return y


def _model_sb(b, sc, d, mn, dmin, k: int, n: int, bits: int, block: int, zero_point: int, **attrs) -> bytes:
    empty_i8, empty_f = np.zeros(0, np.int8), np.zeros(0, np.float16)
    inits = ((b, "b"), (sc, "sc"), (d, "d"), (empty_i8 if mn is None else mn, "mn"),
             (empty_f if dmin is None else dmin, "dmin"))
    node = helper.make_node("SekMatMulSB", ["x", "b", "sc", "d", "mn", "dmin"], ["y"], domain="ai.specedge",
                            **{"K": k, "N": n, "bits": bits, "block_size": block, "superblock": 256,
                               "zero_point": zero_point, **attrs})
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", n])],
                          [numpy_helper.from_array(v, name) for v, name in inits])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                               helper.make_opsetid("ai.specedge", 1)]).SerializeToString()


def _model(b, s, z, k: int, n: int, bits: int, block: int, **attrs) -> bytes:
    node = helper.make_node("SekMatMul", ["x", "b", "s", "z"], ["y"], domain="ai.specedge",
                            **{"K": k, "N": n, "bits": bits, "block_size": block, **attrs})
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", n])],
                          [numpy_helper.from_array(v, name) for v, name in ((b, "b"), (s, "s"), (z, "z"))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                               helper.make_opsetid("ai.specedge", 1)]).SerializeToString()


def _session(model: bytes, threads: int = 2) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    register(so)
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def test_onnx_runtime_runs_the_op_row_invariantly_on_its_thread_pool(kernel):
    rng = np.random.default_rng(7)
    p, (b, s, z, n_pad, k_pad) = _matrix(rng, 200, 300, 4, 64, False)
    sess = _session(_model(b, s, z, 300, n_pad, 4, 64))
    x = rng.standard_normal((1, 9, 300)).astype(np.float32)
    y = sess.run(None, {"x": x})[0]
    assert y.shape == (1, 9, n_pad)
    assert np.array_equal(y[0], kernel.gemm(x[0], b, s, z, n_pad, k_pad, 64, 4))  # threads split columns only
    for t in range(1, 9):
        assert np.array_equal(sess.run(None, {"x": x[:, :t]})[0], y[:, :t]), t
    assert np.array_equal(_session(_model(b, s, z, 300, n_pad, 4, 64), threads=1).run(None, {"x": x})[0], y)


def _fused_model(b, s, z, k: int, n: int, bits: int, block: int, bias=None, residual_width: int | None = None,
                 fused: bool = True, **attrs) -> bytes:
    """SekMatMul with its epilogue (bias, SwiGLU via ``activation=1``, residual input "r") fused into the op, or
    (``fused=False``) the same as the separate nodes a graph had before: Add bias, then Add(r, y)."""
    inits = [(b, "b"), (s, "s"), (z, "z")] + ([(bias, "bias")] if bias is not None else [])
    n_out = n // 2 if attrs.get("activation") == 1 else n
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", k])]
    if residual_width is not None:
        ins.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, "T", residual_width]))
    if fused:
        extra = ["bias" if bias is not None else "", "r" if residual_width is not None else ""]
        while extra and not extra[-1]:
            extra.pop()
        nodes = [helper.make_node("SekMatMul", ["x", "b", "s", "z", *extra], ["y"], domain="ai.specedge",
                                  **{"K": k, "N": n, "bits": bits, "block_size": block, **attrs})]
    else:
        nodes = [helper.make_node("SekMatMul", ["x", "b", "s", "z"], ["mm"], domain="ai.specedge",
                                  **{"K": k, "N": n, "bits": bits, "block_size": block})]
        last = "mm"
        if bias is not None:
            nodes.append(helper.make_node("Add", [last, "bias"], ["mb"]))
            last = "mb"
        nodes.append(helper.make_node("Add", ["r", last], ["y"]) if residual_width is not None
                     else helper.make_node("Identity", [last], ["y"]))
    g = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", n_out])],
                          [numpy_helper.from_array(v, name) for v, name in inits])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                               helper.make_opsetid("ai.specedge", 1)]).SerializeToString()


def test_the_fused_bias_and_residual_give_the_bits_of_separate_add_nodes():
    rng = np.random.default_rng(17)
    p, (b, s, z, n_pad, k_pad) = _matrix(rng, 96, 256, 4, 128, False)
    bias = rng.standard_normal(n_pad).astype(np.float32)
    x = rng.standard_normal((1, 7, 256)).astype(np.float32)
    r = rng.standard_normal((1, 7, n_pad)).astype(np.float32) * 3
    for with_bias in (True, False):
        bb = bias if with_bias else None
        fused = _session(_fused_model(b, s, z, 256, n_pad, 4, 128, bb, n_pad)).run(None, {"x": x, "r": r})[0]
        apart = _session(_fused_model(b, s, z, 256, n_pad, 4, 128, bb, n_pad,
                                      fused=False)).run(None, {"x": x, "r": r})[0]
        assert np.array_equal(fused, apart), with_bias
    only_bias = _session(_fused_model(b, s, z, 256, n_pad, 4, 128, bias)).run(None, {"x": x})[0]
    plain = _session(_model(b, s, z, 256, n_pad, 4, 128)).run(None, {"x": x})[0]
    assert np.array_equal(only_bias, plain + bias)


def test_the_fused_swiglu_is_silu_of_the_gate_times_up_and_row_invariant():
    rng = np.random.default_rng(18)
    p, (b, s, z, n_pad, k_pad) = _matrix(rng, 128, 256, 4, 64, False)
    x = rng.standard_normal((1, 9, 256)).astype(np.float32) * 4
    r = rng.standard_normal((1, 9, 64)).astype(np.float32)
    sess = _session(_fused_model(b, s, z, 256, n_pad, 4, 64, None, 64, activation=1))
    y = sess.run(None, {"x": x, "r": r})[0]
    assert y.shape == (1, 9, 64)
    pre = _session(_model(b, s, z, 256, n_pad, 4, 64)).run(None, {"x": x})[0].astype(np.float64)
    gate, up = pre[..., :64], pre[..., 64:]
    want = gate / (1 + np.exp(-gate)) * up + r
    np.testing.assert_allclose(y, want, rtol=2e-6, atol=1e-6 * np.abs(want).max())
    for t in range(1, 9):  # every row alone and in windows: the same bits
        for start in range(0, 9 - t + 1, 3):
            part = sess.run(None, {"x": x[:, start:start + t], "r": r[:, start:start + t]})[0]
            assert np.array_equal(part, y[:, start:start + t]), (t, start)


def test_the_fused_epilogue_refuses_what_it_cannot_hold():
    rng = np.random.default_rng(19)
    p, (b, s, z, n_pad, k_pad) = _matrix(rng, 48, 128, 4, 64, False)
    x = np.zeros((1, 2, 128), np.float32)
    with pytest.raises(Exception, match="activation 1 with N 48: 0 .none. or 1 .SwiGLU, N a multiple of 32"):
        _session(_fused_model(b, s, z, 128, n_pad, 4, 64, activation=1))
    with pytest.raises(Exception, match="activation 3"):
        _session(_fused_model(b, s, z, 128, n_pad, 4, 64, activation=3))
    with pytest.raises(Exception, match="the bias holds 47 values, the output needs 48"):
        _session(_fused_model(b, s, z, 128, n_pad, 4, 64, np.zeros(47, np.float32))).run(None, {"x": x})
    with pytest.raises(Exception, match="the residual holds 94 values, the output needs 96"):
        _session(_fused_model(b, s, z, 128, n_pad, 4, 64, None, 47)).run(
            None, {"x": x, "r": np.zeros((1, 2, 47), np.float32)})


def test_onnx_runtime_reports_bad_shapes_clearly():
    rng = np.random.default_rng(8)
    p, (b, s, z, n_pad, k_pad) = _matrix(rng, 32, 128, 4, 64, True)
    with pytest.raises(Exception, match="multiple of 16"):
        _session(_model(b, s, z, 128, 40, 4, 64))
    with pytest.raises(Exception, match="packed weights hold"):  # the attributes promise more than the tensors hold
        _session(_model(b, s, z, 128, 64, 4, 64)).run(None, {"x": np.zeros((1, 2, 128), np.float32)})
    good = _model(b, s, z, 128, n_pad, 4, 64)
    bad_k = helper.make_model(helper.make_graph(
        [helper.make_node("SekMatMul", ["x", "b", "s", "z"], ["y"], domain="ai.specedge", K=128, N=n_pad, bits=4,
                          block_size=64)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", "K"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", n_pad])],
        [numpy_helper.from_array(v, name) for v, name in ((b, "b"), (s, "s"), (z, "z"))]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.specedge", 1)])
    with pytest.raises(Exception, match="last dimension is 100, the weights take K = 128"):
        _session(bad_k.SerializeToString()).run(None, {"x": np.zeros((1, 2, 100), np.float32)})
    assert _session(good).run(None, {"x": np.zeros((1, 2, 128), np.float32)})[0].shape == (1, 2, n_pad)


def test_onnx_runtime_reports_bad_two_level_inputs_clearly():
    """SekMatMulSB refuses attributes its integer sums cannot hold and tensors that do not match them, by name."""
    from specedge.export.quant import repack_gguf, sek_pack_sb

    rng = np.random.default_rng(9)
    b, sc, d, mn, dmin, n_pad = sek_pack_sb(repack_gguf("Q4_K", _k_quant_rows(rng, "Q4_K", 32, 1)))
    x = np.zeros((1, 2, 256), np.float32)
    with pytest.raises(Exception, match="SekMatMulSB: unsupported shape.*zero_point 0..64"):
        _session(_model_sb(b, sc, d, None, None, 256, n_pad, 4, 32, 200))  # zero point past the int32 bound
    with pytest.raises(Exception, match="SekMatMulSB: unsupported shape"):
        _session(_model_sb(b, sc, d, mn, dmin, 256, n_pad, 8, 32, 0))  # 8-bit levels: not a K-quant form here
    with pytest.raises(Exception, match="mins and their scales both or neither"):
        _session(_model_sb(b, sc, d, mn, None, 256, n_pad, 4, 32, 0)).run(None, {"x": x})
    with pytest.raises(Exception, match="SekMatMulSB: packed weights hold"):
        _session(_model_sb(b, sc, d, mn, dmin, 256, 2 * n_pad, 4, 32, 0)).run(None, {"x": x})
    assert _session(_model_sb(b, sc, d, mn, dmin, 256, n_pad, 4, 32, 0)).run(None, {"x": x})[0].shape == (1, 2, n_pad)


def test_every_isa_path_gives_onnx_runtime_the_same_bits(kernel, tmp_path):
    """SPECEDGE_SEK_ISA forces one path in the op (read when a session is created): run each in a fresh process."""
    rng = np.random.default_rng(9)
    p, (b, s, z, n_pad, k_pad) = _matrix(rng, 48, 256, 8, 128, False)
    (tmp_path / "m.onnx").write_bytes(_model(b, s, z, 256, n_pad, 8, 128))
    np.save(tmp_path / "x.npy", rng.standard_normal((1, 5, 256)).astype(np.float32))
    script = (f"import numpy as np, onnxruntime as ort\nfrom specedge.runtime.kernels import register\n"
              f"so = ort.SessionOptions(); register(so)\n"
              f"s = ort.InferenceSession(r'{tmp_path / 'm.onnx'}', so, providers=['CPUExecutionProvider'])\n"
              f"np.save(r'{tmp_path}/y_' + __import__('os').environ['SPECEDGE_SEK_ISA'] + '.npy', "
              f"s.run(None, {{'x': np.load(r'{tmp_path / 'x.npy'}')}})[0])\n")
    for isa in kernel.isas():
        subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ, "SPECEDGE_SEK_ISA": isa})
    ys = [np.load(tmp_path / f"y_{isa}.npy") for isa in kernel.isas()]
    assert all(np.array_equal(ys[0], y) for y in ys[1:])
    bad = subprocess.run([sys.executable, "-c", script], env={**os.environ, "SPECEDGE_SEK_ISA": "sse9"},
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "SPECEDGE_SEK_ISA names a path this build lacks" in bad.stderr


def test_the_library_is_built_once_per_machine_and_source(monkeypatch, tmp_path):
    first = library_path()
    assert first.is_file() and first.parent.parent.name == "kernels"
    import specedge.runtime.kernels as kernels

    monkeypatch.setattr(kernels, "_built", None)
    assert library_path() == first  # found in the cache, not rebuilt
    monkeypatch.setattr(kernels, "_built", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    from specedge.runtime.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match="does not run"):
        library_path()


def _attention_model(op: str, hq: int, hkv: int, d: int, kv: int = TensorProto.FLOAT, window: int = 0,
                     softcap: float = 0.0, rot: int = 0, k_shift=None) -> bytes:
    """One attention node; its caches (pk, pv and the presents) of element type kv (float, float16, or int8: rows of
    d values and a 4-byte scale); a sliding window of `window` positions (0: none); soft-capped scores (0: none);
    rotary tables for the first `rot` dims of a head (0: all); SekAttention's key shift (hkv x d values; None:
    none)."""
    F = TensorProto.FLOAT
    D = d + 4 if kv == TensorProto.INT8 else d
    if op == "SekAttention":
        ins, dom, attrs = ["qkv", "pk", "pv", "past_len", "cos", "sin"], "ai.specedge", {}
        attrs.update({"window": window} if window else {})
        attrs.update({"softcap": softcap} if softcap else {})
        attrs.update({"k_shift": [float(x) for x in np.ravel(k_shift)]} if k_shift is not None else {})
    else:  # ONNX Runtime's own, the reference for the same contract
        ins, dom = ["qkv", "", "", "pk", "pv", "seqlens_k", "total", "cos", "sin"], "com.microsoft"
        attrs = {"do_rotary": 1, "rotary_interleaved": 0, **({"local_window_size": window} if window else {}),
                 **({"softcap": softcap} if softcap else {})}
    node = helper.make_node(op, ins, ["out", "presk", "presv"], domain=dom, num_heads=hq, kv_num_heads=hkv,
                            scale=float(1 / np.sqrt(d)), **attrs)
    vi = helper.make_tensor_value_info
    inputs = [vi("qkv", F, [1, "T", (hq + 2 * hkv) * d]), vi("pk", kv, [1, hkv, "S", D]),
              vi("pv", kv, [1, hkv, "S", D]), vi("cos", F, ["P", (rot or d) // 2]),
              vi("sin", F, ["P", (rot or d) // 2])]
    inputs += ([vi("past_len", TensorProto.INT64, [1])] if op == "SekAttention" else
               [vi("seqlens_k", TensorProto.INT32, [1]), vi("total", TensorProto.INT32, [])])
    g = helper.make_graph([node], "g", inputs, [vi("out", F, None), vi("presk", kv, None), vi("presv", kv, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(dom, 1)]
                             ).SerializeToString()


def _attention_case(rng, hq: int, hkv: int, d: int, S: int, past: int, T: int, scale: float = 1.0):
    """Caches [1, hkv, S, d] holding `past` random rows, rotary tables for S positions, and a qkv of T rows."""
    cache = [np.zeros((1, hkv, S, d), np.float32) for _ in range(2)]
    for c in cache:
        c[:, :, :past] = rng.standard_normal((1, hkv, past, d))
    ang = np.arange(S)[:, None] / (10000 ** (np.arange(d // 2) / (d // 2)))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    qkv = (scale * rng.standard_normal((1, T, (hq + 2 * hkv) * d))).astype(np.float32)
    return cache, cos, sin, qkv


def test_specedge_attention_matches_onnx_runtime_and_is_row_invariant_at_width_one():
    hq, hkv, d, S, past = 6, 2, 32, 160, 130  # past spans several of the online softmax's 64-position chunks
    cache, cos, sin, qkv = _attention_case(np.random.default_rng(11), hq, hkv, d, S, past, 5)
    sek, gqa = _session(_attention_model("SekAttention", hq, hkv, d)), _session(_attention_model(
        "GroupQueryAttention", hq, hkv, d))

    def run_sek(t: int, start: int = 0):
        return sek.run(None, {"qkv": qkv[:, start:start + t], "pk": cache[0], "pv": cache[1], "cos": cos, "sin": sin,
                              "past_len": np.array([past + start], np.int64)})

    out, pk, pv = run_sek(5)
    ref, rk, rv = gqa.run(None, {"qkv": qkv, "pk": cache[0], "pv": cache[1], "cos": cos, "sin": sin,
                                 "seqlens_k": np.array([past + 4], np.int32), "total": np.array(past + 5, np.int32)})
    assert np.abs(out - ref).max() < 1e-5 * np.abs(ref).max()
    assert np.allclose(pk[:, :, : past + 5], rk[:, :, : past + 5], atol=1e-6)
    assert np.array_equal(pv[:, :, : past + 5], rv[:, :, : past + 5])
    assert np.array_equal(pk[:, :, :past], cache[0][:, :, :past])  # the past is kept (not bound in place: copied)
    # a row fed alone (width 1, the new rows before it already in the cache) or inside any wider step: same bits
    cache[0][:, :, past: past + 5], cache[1][:, :, past: past + 5] = pk[:, :, past: past + 5], pv[:, :, past: past + 5]
    for t in range(5):
        assert np.array_equal(run_sek(1, t)[0][0, 0], out[0, t]), t
    assert np.array_equal(run_sek(3, 2)[0][0], out[0, 2:5])
    for bad in (S - 2, 2 ** 63 - 1, -1):  # too far; past_len + T would overflow int64; negative
        with pytest.raises(Exception, match="do not fit the cache"):
            sek.run(None, {"qkv": qkv, "pk": cache[0], "pv": cache[1], "cos": cos, "sin": sin,
                           "past_len": np.array([bad], np.int64)})


def test_specedge_attention_groups_queries_without_changing_a_row():
    """Items of several (row, head) queries of one KV group, their number following the step's width and the CPUs:
    every row equals itself alone, in windows of other widths, at Qwen2.5-1.5B's shape (12 query heads on 2 KV
    heads, d 128), past a cache spanning several chunks and more rows than one item holds (9 x 6 queries)."""
    hq, hkv, d, S, past, T = 12, 2, 128, 320, 250, 9
    cache, cos, sin, qkv = _attention_case(np.random.default_rng(5), hq, hkv, d, S, past, T, scale=2.0)
    sek, gqa = _session(_attention_model("SekAttention", hq, hkv, d)), _session(_attention_model(
        "GroupQueryAttention", hq, hkv, d))
    out, pk, pv = sek.run(None, {"qkv": qkv, "pk": cache[0].copy(), "pv": cache[1].copy(), "cos": cos, "sin": sin,
                                 "past_len": np.array([past], np.int64)})
    ref = gqa.run(None, {"qkv": qkv, "pk": cache[0], "pv": cache[1], "cos": cos, "sin": sin,
                         "seqlens_k": np.array([past + T - 1], np.int32), "total": np.array(past + T, np.int32)})[0]
    assert np.abs(out - ref).max() < 1e-5 * np.abs(ref).max()
    for start, width in [(t, 1) for t in range(T)] + [(0, 2), (1, 3), (4, 5), (2, 7)]:
        o = sek.run(None, {"qkv": qkv[:, start:start + width], "pk": pk, "pv": pv, "cos": cos, "sin": sin,
                           "past_len": np.array([past + start], np.int64)})[0]
        assert np.array_equal(o[0], out[0, start:start + width]), (start, width)


def _windowed_reference(qkv, pk, pv, cos, sin, hq: int, hkv: int, d: int, past: int, window: int,
                        softcap: float = 0.0) -> np.ndarray:
    """Attention in numpy (float64) over the written caches pk, pv [1, hkv, S, d]: row t (position p = past + t),
    its query rotated by rotate-half RoPE at p, attends to the positions p - window + 1 .. p (0 .. p without one);
    with a softcap c, each score s as c tanh(s / c)."""
    T, g = qkv.shape[1], hq // hkv
    out = np.zeros((T, hq * d))
    for t in range(T):
        p = past + t
        lo = max(0, p - window + 1) if window else 0
        c, s_ = cos[p].astype(np.float64), sin[p].astype(np.float64)
        for h in range(hq):
            q = qkv[0, t, h * d:(h + 1) * d].astype(np.float64)
            q = np.concatenate([q[:d // 2] * c - q[d // 2:] * s_, q[d // 2:] * c + q[:d // 2] * s_])
            k, v = pk[0, h // g, lo:p + 1].astype(np.float64), pv[0, h // g, lo:p + 1].astype(np.float64)
            sc = k @ q / np.sqrt(d)
            sc = softcap * np.tanh(sc / softcap) if softcap else sc
            w = np.exp(sc - sc.max())
            out[t, h * d:(h + 1) * d] = w @ v / w.sum()
    return out


def _gqa_run(model: bytes, qkv, cache, cos, sin, past: int) -> np.ndarray:
    """ONNX Runtime's GroupQueryAttention over a step of qkv's rows at past_len `past`: its output."""
    T = qkv.shape[1]
    return _session(model).run(None, {"qkv": qkv, "pk": cache[0], "pv": cache[1], "cos": cos, "sin": sin,
                                      "seqlens_k": np.array([past + T - 1], np.int32),
                                      "total": np.array(past + T, np.int32)})[0]


def _assert_rows_alone(sek, qkv, pk, pv, cos, sin, past: int, out) -> None:
    """Each row of the step fed alone (width 1, over the caches the whole step wrote) has its bits in `out`."""
    for t in range(qkv.shape[1]):
        o = sek.run(None, {"qkv": qkv[:, t:t + 1], "pk": pk, "pv": pv, "cos": cos, "sin": sin,
                           "past_len": np.array([past + t], np.int64)})[0]
        assert np.array_equal(o[0, 0], out[0, t]), t


@pytest.mark.parametrize("window", [1, 16, 40, 64, 100, 500])
def test_specedge_attention_with_a_sliding_window_matches_and_keeps_every_row(window):
    """A sliding window of W positions (a query at p attends to p - W + 1 .. p, as transformers' and llama.cpp's
    local layers do): SekAttention matches a float64 reference and ONNX Runtime's GroupQueryAttention with
    local_window_size W - 1, over a past spanning several 64-position chunks (windows inside one chunk, across
    chunk boundaries, and longer than the context), and every row has the same bits at width 1 as in wider steps."""
    hq, hkv, d, S, past, T = 6, 2, 32, 256, 150, 7
    cache, cos, sin, qkv = _attention_case(np.random.default_rng(window), hq, hkv, d, S, past, T)
    sek = _session(_attention_model("SekAttention", hq, hkv, d, window=window))
    out, pk, pv = sek.run(None, {"qkv": qkv, "pk": cache[0].copy(), "pv": cache[1].copy(), "cos": cos, "sin": sin,
                                 "past_len": np.array([past], np.int64)})
    ref = _windowed_reference(qkv, pk, pv, cos, sin, hq, hkv, d, past, window)
    assert np.abs(out[0] - ref).max() < 1e-5 * np.abs(ref).max()
    full = _session(_attention_model("SekAttention", hq, hkv, d)).run(
        None, {"qkv": qkv, "pk": cache[0].copy(), "pv": cache[1].copy(), "cos": cos, "sin": sin,
               "past_len": np.array([past], np.int64)})[0]
    assert (np.abs(full - out).max() > 1e-3) == (window < past)  # the window changes what the rows attend to
    g = _gqa_run(_attention_model("GroupQueryAttention", hq, hkv, d, window=window), qkv, cache, cos, sin, past)
    assert np.abs(out - g).max() < 1e-5 * np.abs(g).max()
    for start, width in [(t, 1) for t in range(T)] + [(1, 3), (2, 5)]:
        o = sek.run(None, {"qkv": qkv[:, start:start + width], "pk": pk, "pv": pv, "cos": cos, "sin": sin,
                           "past_len": np.array([past + start], np.int64)})[0]
        assert np.array_equal(o[0], out[0, start:start + width]), (start, width)
    outside = past - window + 1  # rows before every query's window: they weigh exactly 0, however large
    if outside > 0:
        far = pv.copy()
        far[:, :, :outside] = 1e35
        o = sek.run(None, {"qkv": qkv[:, :1], "pk": pk, "pv": far, "cos": cos, "sin": sin,
                           "past_len": np.array([past], np.int64)})[0]
        assert np.array_equal(o[0, 0], out[0, 0])


def test_a_negative_window_is_refused():
    with pytest.raises(Exception, match="window"):
        _session(_attention_model("SekAttention", 2, 1, 16, window=-3))
    with pytest.raises(Exception, match="softcap"):
        _session(_attention_model("SekAttention", 2, 1, 16, softcap=-1.0))


@pytest.mark.parametrize("rot", [8, 16])
def test_a_partial_rotary_turns_the_first_dims_and_matches(rot):
    """Rotary tables for a head's first `rot` of its 32 dims (Phi-4-mini's partial rotary): the written keys keep
    their other dims as they came, and SekAttention matches GroupQueryAttention (whose tables must be a multiple of 8
    wide) and keeps every row's bits at width 1."""
    hq, hkv, d, S, past, T = 6, 2, 32, 256, 150, 4
    cache, _, _, qkv = _attention_case(np.random.default_rng(rot), hq, hkv, d, S, past, T)
    ang = np.arange(S)[:, None] / (10000 ** (np.arange(rot // 2) / (rot // 2)))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    sek = _session(_attention_model("SekAttention", hq, hkv, d, rot=rot))
    out, pk, pv = sek.run(None, {"qkv": qkv, "pk": cache[0].copy(), "pv": cache[1].copy(), "cos": cos, "sin": sin,
                                 "past_len": np.array([past], np.int64)})
    k_new = qkv[0, :, hq * d:(hq + hkv) * d].reshape(T, hkv, d).transpose(1, 0, 2)
    assert np.array_equal(pk[0, :, past:past + T, rot:], k_new[:, :, rot:])
    assert not np.allclose(pk[0, :, past + 1:past + T, :rot], k_new[:, 1:, :rot])
    if rot % 16 == 0:
        g = _gqa_run(_attention_model("GroupQueryAttention", hq, hkv, d, rot=rot), qkv, cache, cos, sin, past)
        assert np.abs(out - g).max() < 1e-5 * np.abs(g).max()
    _assert_rows_alone(sek, qkv, pk, pv, cos, sin, past, out)


@pytest.mark.parametrize("window", [0, 40])
def test_soft_capped_scores_match_and_keep_every_row(window):
    """Gemma 2's soft-capped scores (c tanh(s / c), c = 1.5 here: far from no cap): SekAttention matches the
    float64 reference and GroupQueryAttention's softcap, with and without a window, and every row keeps its bits at
    width 1."""
    hq, hkv, d, S, past, T = 6, 2, 32, 256, 150, 5
    cache, cos, sin, qkv = _attention_case(np.random.default_rng(7), hq, hkv, d, S, past, T, scale=3.0)
    sek = _session(_attention_model("SekAttention", hq, hkv, d, window=window, softcap=1.5))
    out, pk, pv = sek.run(None, {"qkv": qkv, "pk": cache[0].copy(), "pv": cache[1].copy(), "cos": cos, "sin": sin,
                                 "past_len": np.array([past], np.int64)})
    ref = _windowed_reference(qkv, pk, pv, cos, sin, hq, hkv, d, past, window, softcap=1.5)
    assert np.abs(out[0] - ref).max() < 1e-5 * np.abs(ref).max()
    uncapped = _windowed_reference(qkv, pk, pv, cos, sin, hq, hkv, d, past, window)
    assert np.abs(uncapped - ref).max() > 1e-2 * np.abs(ref).max()  # the cap matters at this scale
    g = _gqa_run(_attention_model("GroupQueryAttention", hq, hkv, d, window=window, softcap=1.5), qkv, cache, cos,
                 sin, past)
    assert np.abs(out - g).max() < 1e-5 * np.abs(g).max()
    _assert_rows_alone(sek, qkv, pk, pv, cos, sin, past, out)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the AVX2 build needs an x86 CPU")
def test_an_avx2_build_gives_the_same_matmul_bits_and_its_attention_matches(kernel, tmp_path):
    """The library built for an AVX2 + FMA CPU (no AVX-512: SPECEDGE_KERNEL_MARCH=haswell), in a fresh process: its
    SekMatMul gives the native build's bits, and its SekAttention (AVX2 exp and dot paths) matches ONNX Runtime's and
    reads fp16 and int8 caches exactly."""
    import json

    rng = np.random.default_rng(13)
    p, (b, s, z, n_pad, k_pad) = _matrix(rng, 64, 384, 4, 128, False)
    a = rng.standard_normal((5, 384)).astype(np.float32)
    np.savez(tmp_path / "m.npz", b=b, s=s, z=z, a=a)
    script = f"""
import json, numpy as np
from specedge.runtime.kernels import Kernel
from tests.runtime.test_sek_kernel import _attention_model, _session
k = Kernel()
m = np.load(r"{tmp_path / 'm.npz'}")
y = k.gemm(m["a"], m["b"], m["s"], m["z"], {n_pad}, {k_pad}, 128, 4)
np.save(r"{tmp_path / 'y.npy'}", y)
hq, hkv, d, S, past = 6, 2, 32, 160, 130
rng = np.random.default_rng(1)
pk, pv = rng.standard_normal((2, 1, hkv, S, d)).astype(np.float32)
ang = np.arange(S)[:, None] / (10000 ** (np.arange(d // 2) / (d // 2)))
cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
qkv = rng.standard_normal((1, 3, (hq + 2 * hkv) * d)).astype(np.float32)
o = _session(_attention_model("SekAttention", hq, hkv, d)).run(None, dict(qkv=qkv, pk=pk.copy(), pv=pv.copy(),
    cos=cos, sin=sin, past_len=np.array([past], np.int64)))[0]
r = _session(_attention_model("GroupQueryAttention", hq, hkv, d)).run(None, dict(qkv=qkv, pk=pk.copy(), pv=pv.copy(),
    cos=cos, sin=sin, seqlens_k=np.array([past + 2], np.int32), total=np.array(past + 3, np.int32)))[0]
from tests.runtime.test_sek_row_attention import fp16_against_fp32, int8_against_fp32
exact16, rel16 = fp16_against_fp32(12, 2, 128, seed=3)
exact8, rel8 = int8_against_fp32(12, 2, 128, seed=3)
print(json.dumps(dict(isas=k.isas(), rel=float(np.abs(o - r).max() / np.abs(r).max()), exact16=exact16, rel16=rel16,
                      exact8=exact8, rel8=rel8)))
"""
    env = {**os.environ, "SPECEDGE_KERNEL_MARCH": "haswell", "SPECEDGE_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "vnni512" not in out["isas"] and "avx2" in out["isas"], out
    assert out["rel"] < 1e-5, out
    assert out["exact16"] and out["rel16"] < 2e-3, out  # fp16 caches read through F16C: exactly their values
    assert out["exact8"] and out["rel8"] < 3e-2, out  # int8 caches read through AVX2: q * scale
    assert np.array_equal(np.load(tmp_path / "y.npy"), kernel.gemm(a, b, s, z, n_pad, k_pad, 128, 4))


def test_the_memory_bench_builds_against_the_kernel_and_runs(tmp_path):
    """tools/dev/kernel_membench.c (the kernel over DRAM next to a bare read loop) compiles against the kernel's own
    header and runs: a tool the benchmarks page quotes must not rot."""
    from pathlib import Path

    from specedge.runtime.kernels import _march, compiler

    root = Path(__file__).resolve().parents[2]
    exe = tmp_path / "membench"
    csrc = root / "runtime" / "csrc"
    subprocess.run([*compiler(), "-O3", _march(), "-std=c11", "-D_GNU_SOURCE", "-pthread", "-I", str(csrc),
                    str(root / "tools" / "dev" / "kernel_membench.c"), str(csrc / "sek_gemm.c"),
                    str(csrc / "sek_gemm_neon.c"), "-o", str(exe), "-lm"],
                   check=True, capture_output=True)
    for bits in ("4", "6"):
        out = subprocess.run([str(exe), "1600", bits, "2", "3", "1"], check=True, capture_output=True, text=True).stdout
        assert f"{bits}-bit, 3 row(s), 2 thread(s)" in out and "kernel GB/s:" in out and "bare read GB/s:" in out
    bad = subprocess.run([str(exe), "1600", "5", "1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "BITS is 4 or 6" in bad.stderr


def test_the_rows_bench_builds_against_the_kernel_and_runs(tmp_path):
    """tools/dev/kernel_rows.c (cycles per extra row against the multiplies' bound, quoted by docs/cpu-kernels.md)
    compiles against the kernel and prints a row per row count asked; bad arguments get its usage."""
    from pathlib import Path

    from specedge.runtime.kernels import _march, compiler

    root = Path(__file__).resolve().parents[2]
    exe = tmp_path / "kernel_rows"
    csrc = root / "runtime" / "csrc"
    subprocess.run([*compiler(), "-O3", _march(), "-std=c11", "-D_GNU_SOURCE", "-I", str(csrc),
                    str(root / "tools" / "dev" / "kernel_rows.c"), str(csrc / "sek_gemm.c"),
                    str(csrc / "sek_gemm_neon.c"), "-o", str(exe), "-lm"],
                   check=True, capture_output=True)
    for bits in ("4", "6"):
        out = subprocess.run([str(exe), bits, "1,3", "best", "64"], check=True, capture_output=True, text=True).stdout
        rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "rows" not in line]
        assert f"{bits}-bit" in out and rows == ["1", "3"], out
    bad = subprocess.run([str(exe), "5"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


def _isa_check(cc: list[str], flags: list[str], exe, runner: list[str] = ()) -> tuple[str, str]:
    """Build tools/dev/sek_isa_check.c against the kernel and run it: (the ISA paths it compared, the reference's
    digest)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    csrc = root / "runtime" / "csrc"
    sources = [root / "tools" / "dev" / "sek_isa_check.c", csrc / "sek_gemm.c", csrc / "sek_gemm_neon.c"]
    subprocess.run([*cc, "-O2", *flags, "-std=c11", "-D_GNU_SOURCE", "-I", str(csrc), *map(str, sources), "-o",
                    str(exe), "-lm"], check=True, capture_output=True)
    r = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("ok"), r.stdout + r.stderr
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line.startswith(("isas ", "digest ")))
    return lines["isas"], lines["digest"]


def test_every_isa_path_of_this_cpu_equals_the_c_reference_in_every_weight_format(tmp_path):
    """tools/dev/sek_isa_check.c on this CPU: every path this build has, at 1..20 rows, bitwise the portable reference
    (one- and two-level scales, 4/6/8-bit, zero points as bytes and as fp32 products, a partial last block, extreme
    activation blocks), and every row the same alone as among the others."""
    from specedge.runtime.kernels import _march, compiler

    isas, digest = _isa_check(compiler(), [_march()], tmp_path / "isa_check")
    assert "scalar" in isas.split() and len(digest) == 16


def _has_avx_vnni() -> bool:
    from specedge.runtime.cpu import cpu_features

    return platform.machine().lower() in ("x86_64", "amd64") and "avx_vnni" in (cpu_features() or ())


@pytest.mark.skipif(not _has_avx_vnni(), reason="the AVX-VNNI path runs only on a CPU with AVX-VNNI (Alder Lake and "
                                                "later Intel cores, Intel N100-N305, AMD Zen 5)")
def test_the_avx_vnni_path_computes_the_same_bits_as_this_cpu(tmp_path):
    """The AVX-VNNI path (vpdpbusd on 256-bit registers, for CPUs without AVX-512: Intel Alder Lake and its
    N-series), in a build for such a CPU (-march=alderlake: AVX2 + AVX-VNNI, 16 vector registers): it equals the
    reference at 1..20 rows in every weight format, and the reference's outputs are this CPU's native build's. The
    whole kernel library builds for it without warnings."""
    from pathlib import Path

    from specedge.runtime.kernels import CFLAGS, SOURCES, _march, compiler

    probe = subprocess.run([*compiler(), "-march=alderlake", "-E", "-x", "c", "-"], input="", capture_output=True,
                           text=True)
    if probe.returncode != 0:
        pytest.skip(f"this C compiler does not know -march=alderlake (GCC 11+, Clang 12+): {probe.stderr[-200:]}")
    _, here = _isa_check(compiler(), [_march()], tmp_path / "isa_check")
    isas, there = _isa_check(compiler(), ["-march=alderlake"], tmp_path / "isa_check_adl")
    assert isas.split() == ["scalar", "avx2", "avxvnni"] and there == here
    csrc = Path(__file__).resolve().parents[2] / "runtime" / "csrc"
    subprocess.run([*compiler(), *CFLAGS, "-march=alderlake", "-Werror", "-Wall", "-o",
                    str(tmp_path / "libspecedge_kernels.so"), *(str(csrc / s) for s in SOURCES), "-lm"],
                   check=True, capture_output=True)


_CROSS = ("aarch64-linux-gnu-gcc", "qemu-aarch64")


@pytest.mark.skipif(not all(shutil.which(t) for t in _CROSS),
                    reason="the Arm check needs a cross compiler and an emulator: aarch64-linux-gnu-gcc and "
                           "qemu-aarch64 (Debian: apt install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user; "
                           ".ci/run installs them where it can)")
@pytest.mark.parametrize("march", ["armv8.2-a+dotprod", "armv8-a"])
def test_the_arm_neon_path_computes_the_same_bits_as_this_cpu(tmp_path, march):
    """The NEON path (sdot with Armv8.2 dot products — Jetson Orin, Raspberry Pi 5 — or widening multiplies on
    Armv8.0 — Jetson Nano, Raspberry Pi 4), built for Arm and run under qemu: it equals the reference there, and
    the reference's outputs there are bitwise this CPU's. The whole kernel library builds for Arm too."""
    from pathlib import Path

    from specedge.runtime.kernels import CFLAGS, SOURCES, _march, compiler

    _, here = _isa_check(compiler(), [_march()], tmp_path / "isa_check")
    isas, there = _isa_check(["aarch64-linux-gnu-gcc"], ["-static", f"-march={march}"], tmp_path / "isa_check_arm",
                             runner=["qemu-aarch64", "-cpu", "max"])
    assert isas.split() == ["scalar", "neon"] and there == here
    csrc = Path(__file__).resolve().parents[2] / "runtime" / "csrc"
    subprocess.run(["aarch64-linux-gnu-gcc", *CFLAGS, f"-march={march}", "-Werror", "-Wall", "-o",
                    str(tmp_path / "libspecedge_kernels.so"), *(str(csrc / s) for s in SOURCES), "-lm"],
                   check=True, capture_output=True)


def test_a_kernel_library_built_elsewhere_can_be_used_by_name(monkeypatch, tmp_path):
    """Tools that time two kernel builds in one process (tools/verify_cost.py, tools/dev/ab_decode.py --lib) name a
    library file; the bundles loaded after that take their kernels from it, and a missing file is refused by name."""
    from specedge.runtime import kernels

    monkeypatch.setattr(kernels, "_built", None)
    lib = tmp_path / "libspecedge_kernels.so"
    with pytest.raises(FileNotFoundError, match="no such file"):
        kernels.use_library(lib)
    lib.write_bytes(b"\x7fELF")
    assert kernels.use_library(lib) == lib and kernels.library_path() == lib
