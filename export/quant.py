"""Block quantization into ONNX Runtime's ``MatMulNBits`` layout, and exact GGUF re-packing.

MatMulNBits (com.microsoft) computes ``Y = A @ dequant(B).T`` with, for output row n and
input block j (``block`` consecutive input features):

    dequant(B)[n, j*block + i] = (q[n, j, i] - zp[n, j]) * scales[n, j]

* ``B`` uint8 [N, k_blocks, block*bits/8]; 4-bit values two per byte, element 2i in the low
  nibble and 2i+1 in the high nibble.
* ``scales`` float32 [N, k_blocks].
* ``zero_points`` uint8, optional: absent means the midpoint 2^(bits-1) (8 or 128) — the
  symmetric form. Present (asymmetric): [N, ceil(k_blocks/2)] packed like B for 4 bits,
  [N, k_blocks] for 8 bits. Float zero points are never produced: ONNX Runtime runs them on
  a path 50-100x slower on CPU.

K (input features) need not be a multiple of ``block``: the last block is zero-padded here
and the op reads only K columns of A.

GGUF Q4_0 (value = (q - 8) * d, 32 per block) and Q8_0 (value = q * d) are exactly this
symmetric form with block 32, only with a different nibble order (Q4_0 holds elements i and
i+16 in byte i) and a signed 8-bit q; :func:`repack_gguf` converts their bytes without
touching a value, and carries the other types of GGUF_REPACKABLE as exactly (with per-block
offsets, and the K-quants' two-level scales beside). A type outside it is dequantized, then
re-quantized (:func:`quantize`), and the export names it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specedge.runtime.errors import UnsupportedModelError

ACCURACY_LEVELS = (0, 1, 2, 3, 4)  # MatMulNBits: minimum compute precision; 4 = int8 compute (fast on CPU)


@dataclass(frozen=True)
class QuantSpec:
    bits: int  # 4 | 8 (MatMulNBits); 7: the integer-GEMM form's channels next to 8-bit activations
    block: int = 32
    symmetric: bool = True
    accuracy_level: int = 4
    positive_scales: bool = False  # symmetric only: the extreme maps to -2^(b-1) if negative, +2^(b-1)-1 if positive
    search: bool = True  # per block, the scale of least squared error among a grid around round-to-nearest's

    def __post_init__(self) -> None:
        if self.bits not in (4, 7, 8):
            raise UnsupportedModelError(f"weights are 4 or 8 bits here (7: integer GEMM), got {self.bits}")
        if self.block < 16 or self.block & (self.block - 1):
            raise UnsupportedModelError(f"quantization block size must be a power of two >= 16, got {self.block}")
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise UnsupportedModelError(f"accuracy_level must be one of {ACCURACY_LEVELS}, got {self.accuracy_level}")


@dataclass
class SuperBlocks:
    """A GGUF K-quant's scales as the file holds them, next to the same matrix's MatMulNBits form (Packed): an
    integer scale sc (and min mn) per block under an fp32 d (and dmin) per super-block of ``superblock`` values,
    w = d sc q - dmin mn (Q4_K) or d sc (q - zero_point) (Q6_K). specedge's kernel reads them so (SekMatMulSB):
    fewer bytes than fp32 block scales, and no rounding of a product."""

    sc: np.ndarray  # int8 [N, k_blocks]
    d: np.ndarray  # float32 [N, k_superblocks], fp16 values
    mn: np.ndarray | None  # int8 [N, k_blocks] (Q4_K), or None
    dmin: np.ndarray | None  # float32 [N, k_superblocks], with mn
    bits: int  # the levels' width: 4 (Q4_K), 6 (Q6_K)
    superblock: int = 256
    zero_point: int = 0  # w = d sc (q - zero_point) where there are no mins
    level_offset: int = 0  # Packed.b's levels are the native ones plus this (Q6_K: 96, as 8-bit MatMulNBits)

    def key(self) -> tuple:
        return (self.bits, self.superblock, self.zero_point, self.level_offset, self.mn is None)


@dataclass
class Packed:
    """One weight matrix [N out, K in] in MatMulNBits form."""

    b: np.ndarray  # uint8 [N, k_blocks, block * bits / 8]
    scales: np.ndarray  # float32 [N, k_blocks]
    zero_points: np.ndarray | None  # uint8, see module docstring; None = symmetric
    k: int  # input features
    bits: int
    block: int
    offsets: np.ndarray | None = None  # float32 [N, k_blocks]: w = scale * (q - zp) + offset (GGUF Q4_1/Q4_K)
    superblocks: SuperBlocks | None = None  # GGUF Q4_K/Q6_K: the same weights' two-level scales

    @property
    def n(self) -> int:
        return self.b.shape[0]


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 [..., 2m] values < 16 -> [..., m]: element 2i low nibble, 2i+1 high nibble."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def _unpack_nibbles(b: np.ndarray) -> np.ndarray:
    out = np.empty((*b.shape[:-1], b.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2], out[..., 1::2] = b & 0x0F, b >> 4
    return out


# Scale search: each block tries round-to-nearest's scale times these factors (1.0, plain round-to-nearest,
# included), refits the scale by least squares to the levels it got (s = sum(x q) / sum(q q): the best scale
# for those levels), and keeps the candidate of least squared error. Smaller factors clip the block's
# extreme to buy finer steps for the rest: ~9 % less squared error on gaussian int4 (tests/export/test_quant.py),
# 7-15 % less RMS error on Qwen's Q4_K/Q6_K weights re-quantized at blocks 32-128 (docs/benchmarks.md).
SEARCH_FACTORS = (1.0, 0.80, 0.84, 0.88, 0.91, 0.94, 0.97, 1.03)
_SEARCH_ROWS = 256  # rows per chunk: a chunk's candidates stay in cache


def _levels(x: np.ndarray, scales: np.ndarray, zp: np.ndarray, qmax: int) -> np.ndarray:
    """Integer levels q - zp (float32) of x [R, kb, block] at scales/zp [R, kb]."""
    safe = np.where(scales == 0, 1.0, scales).astype(np.float32)
    q = np.clip(np.round(x / safe[..., None]) + zp[..., None], 0, qmax)
    return q - zp[..., None]


def _quantize_rows(x: np.ndarray, spec: QuantSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [R, kb, block] -> (levels q - zp, scales, zp), each block at its best candidate scale."""
    qmax, mid = (1 << spec.bits) - 1, 1 << (spec.bits - 1)
    if spec.symmetric:
        idx = np.abs(x).argmax(axis=-1)[..., None]
        extreme = np.take_along_axis(x, idx, axis=-1)[..., 0]  # [R, k_blocks], signed
        base = extreme / -mid
        if spec.positive_scales:  # TensorRT takes only scales > 0: a positive extreme maps to the top level
            base = np.where(extreme > 0, extreme / (mid - 1), base)
        zp = np.full(base.shape, mid, dtype=np.float32)
    else:
        lo, hi = np.minimum(x.min(axis=-1), 0.0), np.maximum(x.max(axis=-1), 0.0)  # 0 stays exact
        base = (hi - lo) / qmax
    best = None
    for f in SEARCH_FACTORS if spec.search else (1.0,):
        s = (base * f).astype(np.float32)
        if not spec.symmetric:
            zp = np.clip(np.round(-lo / np.where(s == 0, 1.0, s)), 0, qmax).astype(np.float32)
        v = _levels(x, s, zp, qmax)
        if spec.search:  # least-squares scale for these levels; x . v has the sign of s, so s keeps its sign
            vv = (v * v).sum(-1)
            s = np.where(vv > 0, (x * v).sum(-1) / np.where(vv > 0, vv, 1.0), s).astype(np.float32)
        err = ((x - s[..., None] * v) ** 2).sum(-1) if spec.search else None
        if best is None:
            best = [v, s, zp, err]
            continue
        better = err < best[3]
        best[0] = np.where(better[..., None], v, best[0])
        best[1], best[2], best[3] = (np.where(better, new, old) for new, old in zip((s, zp, err), best[1:]))
    return best[0], best[1], best[2]


def quantize(w: np.ndarray, spec: QuantSpec) -> Packed:
    """Block quantization of w [N out, K in] (float32).

    Symmetric: round-to-nearest maps the value of largest magnitude m to the lowest level (scale = m / -2^(bits-1),
    the Q4_0 rule), so the full range of levels is used. Asymmetric: min and max of the block map to 0 and
    2^bits - 1 with an integer zero point. With ``spec.search`` (default) each block then takes the least-squares
    scale of the best candidate around that one (SEARCH_FACTORS).
    """
    N, K = w.shape
    kb = -(-K // spec.block)
    x = np.zeros((N, kb * spec.block), dtype=np.float32)
    x[:, :K] = w
    x = x.reshape(N, kb, spec.block)  # [N, k_blocks, block]
    q = np.empty(x.shape, dtype=np.uint8)
    scales = np.empty((N, kb), dtype=np.float32)
    zp = np.empty((N, kb), dtype=np.float32)
    for r in range(0, N, _SEARCH_ROWS):
        v, scales[r: r + _SEARCH_ROWS], zp[r: r + _SEARCH_ROWS] = _quantize_rows(x[r: r + _SEARCH_ROWS], spec)
        q[r: r + _SEARCH_ROWS] = v + zp[r: r + _SEARCH_ROWS, :, None]
    b = _pack_nibbles(q) if spec.bits == 4 else q
    zero_points = None
    if not spec.symmetric:
        zq = zp.astype(np.uint8)
        if spec.bits == 4:
            zq = _pack_nibbles(np.pad(zq, ((0, 0), (0, kb % 2))))
        zero_points = np.ascontiguousarray(zq)
    return Packed(np.ascontiguousarray(b), scales, zero_points, K, spec.bits, spec.block)


def dequantize(p: Packed) -> np.ndarray:
    """Packed -> float32 [N, K]: the reference for what MatMulNBits computes."""
    q = (_unpack_nibbles(p.b) if p.bits == 4 else p.b).astype(np.float32)  # [N, k_blocks, block]
    kb = q.shape[1]
    if p.zero_points is None:
        zp = np.full((p.n, kb), 1 << (p.bits - 1), dtype=np.float32)
    else:
        zp = (_unpack_nibbles(p.zero_points)[:, :kb] if p.bits == 4 else p.zero_points).astype(np.float32)
    w = (q - zp[..., None]) * p.scales[..., None]
    if p.offsets is not None:
        w = w + p.offsets[..., None]
    return w.reshape(p.n, -1)[:, : p.k]


# GGUF block layouts: type -> (elements per block, bytes per block, bits). Q4_0 / Q8_0 are symmetric and map
# onto MatMulNBits as they are; Q4_1 (w = d q + m) and Q4_K (256-value super-blocks of eight 32-value sub-blocks,
# w = d sc_j q - dmin m_j) are symmetric int4 with zero point 8 plus a per-block offset:
#     w = s (q - 8) + o,   s = d (Q4_1) or d sc_j (Q4_K),   o = m + 8 s (Q4_1) or 8 s - dmin m_j (Q4_K)
# carried exactly (to one fp32 rounding of o) as Packed.offsets; the graph adds sum_b o_b (sum of x over block b).
# Q6_K (w = d sc_j (q - 32), 6-bit q, a signed 8-bit scale per 16 values) is exact as 8-bit with block 16.
# The other types are carried at 8 bits, every value exactly what gguf's dequantization gives (the scales and
# offsets below are exact fp32 products of an fp16 and a small integer):
#     Q5_0  w = d (q - 16)                     symmetric, block 32
#     Q5_1  w = d q + m                        level q (stored q + 128), offset m, block 32
#     Q5_K  w = d sc_j q - dmin m_j            level q, scale d sc_j, offset -dmin m_j, block 32
#     Q3_K  w = d (sc_j - 32) q, q in -4..3    symmetric, block 16
#     Q2_K  w = d sc_j q - dmin m_j, q 0..3    level q, scale d sc_j, offset -dmin m_j, block 16
#     IQ4_NL / IQ4_XS  w = d_j kvalues[q]      the codebook's int8 value as the level, block 32
# The K-quants also keep their two-level scales (Packed.superblocks) for specedge's kernel: Q5_K as 6-bit levels
# with mins, Q3_K as 6-bit levels at zero point 32 (Q6_K's form), Q2_K as 4-bit levels with mins.
GGUF_REPACKABLE = {"Q4_0": (32, 18, 4), "Q8_0": (32, 34, 8), "Q4_1": (32, 20, 4), "Q4_K": (256, 144, 4),
                   "Q6_K": (256, 210, 8), "Q5_0": (32, 22, 8), "Q5_1": (32, 24, 8), "Q5_K": (256, 176, 8),
                   "Q3_K": (256, 110, 8), "Q2_K": (256, 84, 8), "IQ4_NL": (32, 18, 8), "IQ4_XS": (256, 136, 8)}
GGUF_OFFSET_TYPES = ("Q4_1", "Q4_K", "Q5_1", "Q5_K", "Q2_K")  # need Packed.offsets
# IQ4_NL / IQ4_XS: the 16 levels a 4-bit index selects (ggml's kvalues_iq4nl)
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int16)


def _q4k_scales_mins(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 packed bytes per super-block -> 6-bit scales and mins [.., 8] (ggml's get_scale_min_k4)."""
    sc = sc.astype(np.uint8)
    lo, hi = sc[..., 0:4], sc[..., 8:12]
    scales = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mins = np.concatenate([sc[..., 4:8] & 63, (hi >> 4) | ((sc[..., 4:8] >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def repack_gguf(type_name: str, raw: np.ndarray, k: int | None = None) -> Packed:
    """GGUF rows of a type in GGUF_REPACKABLE (uint8 [N, row bytes]) -> Packed, exact (see GGUF_REPACKABLE).
    K (inputs per row) follows from the row bytes; ``k``, if given, is checked against it."""
    if type_name not in GGUF_REPACKABLE:
        raise UnsupportedModelError(f"GGUF {type_name} has no exact MatMulNBits form; only {sorted(GGUF_REPACKABLE)}")
    block, nbytes, bits = GGUF_REPACKABLE[type_name]
    kb, rem = divmod(raw.shape[1], nbytes)
    if rem or (k is not None and k != kb * block):
        raise UnsupportedModelError(f"GGUF {type_name} rows of {raw.shape[1]} bytes do not hold "
                                    f"{k if k is not None else 'whole blocks of'} {block}-value blocks")
    k = kb * block
    N = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(N, kb, nbytes)  # [N, k_blocks, bytes]
    f16 = lambda a, b: blocks[..., a:b].copy().view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    offsets = None
    if type_name == "Q6_K":
        ql, qh = blocks[..., 0:128], blocks[..., 128:192]
        sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)  # [N, kb, 16]
        d = blocks[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, kb]
        halves = []
        for h in range(2):
            lo, hi, top = ql[..., 64 * h: 64 * h + 32], ql[..., 64 * h + 32: 64 * h + 64], qh[..., 32 * h: 32 * h + 32]
            halves += [(lo & 0x0F) | ((top & 3) << 4), (hi & 0x0F) | (((top >> 2) & 3) << 4),
                       (lo >> 4) | (((top >> 4) & 3) << 4), (hi >> 4) | (((top >> 6) & 3) << 4)]
        q = np.concatenate(halves, axis=-1).astype(np.uint16)  # [N, kb, 256] 6-bit values in element order
        b = (q + 96).astype(np.uint8).reshape(N, kb * 16, 16)  # (q - 32) + 128: MatMulNBits' 8-bit zero point
        scales = (d[..., None] * sc).reshape(N, kb * 16).astype(np.float32)
        sb = SuperBlocks(sc.reshape(N, kb * 16).astype(np.int8), d, None, None, 6, zero_point=32, level_offset=96)
        return Packed(np.ascontiguousarray(b), scales, None, k, 8, 16, superblocks=sb)
    if type_name in _EIGHT_BIT_CARRIED:
        return _EIGHT_BIT_CARRIED[type_name](blocks, k)
    if type_name == "Q8_0":
        b = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # signed q -> q + 128
        return Packed(np.ascontiguousarray(b), f16(0, 2), None, k, bits, block)
    if type_name == "Q5_0":  # d, 4 bytes of fifth bits, 16 of nibbles: w = d (q - 16), q in 0..31
        qh = blocks[..., 2:6].copy().view("<u4")[..., 0]  # [N, kb]: bit j is element j's fifth bit
        qs = blocks[..., 6:22]
        low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)  # elements 0..15, then 16..31
        high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)
        b = (low + (high << 4) - 16 + 128).astype(np.uint8)  # q - 16 in -16..15 at MatMulNBits' 8-bit zero point
        return Packed(np.ascontiguousarray(b), f16(0, 2), None, k, bits, block)
    if type_name == "Q4_K":
        d, dmin = f16(0, 2), f16(2, 4)  # [N, kb]
        sc, mn = _q4k_scales_mins(blocks[..., 4:16])  # [N, kb, 8]
        qs = blocks[..., 16:].reshape(N, kb, 4, 32)  # 4 groups of 32 bytes: sub-blocks 2g (low), 2g+1 (high)
        q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(N, kb * 8, 32)  # [N, 32-blocks, 32] element order
        scales = (d[..., None] * sc).reshape(N, kb * 8)
        offsets = (8.0 * scales - (dmin[..., None] * mn).reshape(N, kb * 8)).astype(np.float32)
        sb = SuperBlocks(sc.reshape(N, kb * 8).astype(np.int8), d, mn.reshape(N, kb * 8).astype(np.int8), dmin, 4)
        return Packed(np.ascontiguousarray(_pack_nibbles(q)), scales.astype(np.float32), None, k, bits, 32, offsets,
                      sb)
    first_q = 4 if type_name == "Q4_1" else 2
    scales = f16(0, 2)
    if type_name == "Q4_1":
        offsets = (f16(2, 4) + 8.0 * scales).astype(np.float32)
    qs = blocks[..., first_q:]
    # GGUF: byte i holds element i (low) and i+16 (high); MatMulNBits: elements 2i, 2i+1
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [N, k_blocks, 32] in element order
    return Packed(np.ascontiguousarray(_pack_nibbles(q)), scales, None, k, bits, block, offsets)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of every block [N, kb, bytes] -> float32 [N, kb]."""
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _bits_of(qh: np.ndarray, count: int) -> np.ndarray:
    """uint8 [.., 32] of high-bit masks -> [.., count // 32, 32]: plane i holds bit i of each byte."""
    return (qh[..., None, :] >> np.arange(count // 32, dtype=np.uint8)[:, None]) & 1


def _carried8(levels: np.ndarray, scales: np.ndarray, k: int, block: int, offsets: np.ndarray | None = None,
              superblocks: SuperBlocks | None = None) -> Packed:
    """Signed levels [N, k_blocks, block] (-128..127) -> an 8-bit symmetric Packed (stored level + 128)."""
    n = levels.shape[0]
    b = (levels.astype(np.int16) + 128).astype(np.uint8).reshape(n, -1, block)
    return Packed(np.ascontiguousarray(b), np.ascontiguousarray(scales, dtype=np.float32).reshape(n, -1), None, k, 8,
                  block, None if offsets is None else np.ascontiguousarray(offsets, dtype=np.float32).reshape(n, -1),
                  superblocks)


def _repack_q5_1(blocks: np.ndarray, k: int) -> Packed:  # d, m, 4 bytes of fifth bits, 16 of nibbles: w = d q + m
    qh = blocks[..., 4:8].copy().view("<u4")[..., 0]
    qs = blocks[..., 8:24]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)
    high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)
    return _carried8(low + (high << 4), _f16(blocks, 0), k, 32, _f16(blocks, 2))


def _repack_q5_k(blocks: np.ndarray, k: int) -> Packed:
    """d, dmin, 12 bytes of 6-bit scales and mins, 32 bytes of fifth bits, 128 of nibbles: sub-block 2g holds the
    low nibbles of bytes 32g..32g+31, 2g+1 their high ones; bit j of qh[l] is sub-block j's fifth bit of element l."""
    n, kb, _ = blocks.shape
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _q4k_scales_mins(blocks[..., 4:16])  # [N, kb, 8]
    qs = blocks[..., 48:176].reshape(n, kb, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, kb, 8, 32)
    q = low.astype(np.int16) | (_bits_of(blocks[..., 16:48], 256).astype(np.int16) << 4)
    scales, mins = d[..., None] * sc, dmin[..., None] * mn  # exact: fp16 times a 6-bit integer
    sb = SuperBlocks(sc.reshape(n, -1).astype(np.int8), d, mn.reshape(n, -1).astype(np.int8), dmin, 6,
                     level_offset=128)
    return _carried8(q, scales, k, 32, -mins, sb)


def _repack_q3_k(blocks: np.ndarray, k: int) -> Packed:
    """32 bytes of high-bit masks, 64 of 2-bit pairs, 12 of 6-bit scales, d: element e = 128h + 32j + l has its low
    bits at (qs[32h + l] >> 2j) & 3 and its high bit at bit e // 32 of hmask[l]; level = low - 4 (1 - high)."""
    n, kb, _ = blocks.shape
    low = (blocks[..., 32:96].reshape(n, kb, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    high = _bits_of(blocks[..., 0:32], 256)  # [N, kb, 8, 32]
    q = low.reshape(n, kb, 8, 32).astype(np.int16) - 4 * (1 - high.astype(np.int16))
    sc = blocks[..., 96:108]
    lo = (sc[..., 0:8, None] >> np.array([0, 4], dtype=np.uint8)).transpose(0, 1, 3, 2).reshape(n, kb, 16) & 0x0F
    hi = (sc[..., 8:12, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)).transpose(0, 1, 3, 2).reshape(n, kb, 16) & 3
    s = (lo | (hi << 4)).astype(np.int16) - 32  # [N, kb, 16], -32..31
    d = _f16(blocks, 108)
    sb = SuperBlocks(s.reshape(n, -1).astype(np.int8), d, None, None, 6, zero_point=32, level_offset=96)
    return _carried8(q.reshape(n, kb * 16, 16), d[..., None] * s.astype(np.float32), k, 16, None, sb)


def _repack_q2_k(blocks: np.ndarray, k: int) -> Packed:
    """16 bytes of 4-bit scale (low) and min (high) pairs, 64 of 2-bit levels, d, dmin: element e = 128h + 32j + l
    is (qs[32h + l] >> 2j) & 3, in block e // 16."""
    n, kb, _ = blocks.shape
    q = (blocks[..., 16:80].reshape(n, kb, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    sc, mn = (blocks[..., 0:16] & 0x0F).astype(np.float32), (blocks[..., 0:16] >> 4).astype(np.float32)
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    sb = SuperBlocks(sc.reshape(n, -1).astype(np.int8), d, mn.reshape(n, -1).astype(np.int8), dmin, 4,
                     level_offset=128)
    return _carried8(q.reshape(n, kb * 16, 16), d[..., None] * sc, k, 16, -(dmin[..., None] * mn), sb)


def _iq4_levels(nibbles: np.ndarray) -> np.ndarray:
    """[.., 16] bytes of two indices each -> the codebook's levels [.., 32]: element j (low), j + 16 (high)."""
    return IQ4_LEVELS[np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)]


def _repack_iq4_nl(blocks: np.ndarray, k: int) -> Packed:  # d, 16 bytes of indices: w = d kvalues[q]
    return _carried8(_iq4_levels(blocks[..., 2:18]), _f16(blocks, 0), k, 32)


def _repack_iq4_xs(blocks: np.ndarray, k: int) -> Packed:
    """d, 2 bytes of the 32-blocks' high scale bits, 4 of their low nibbles, 128 of indices: block i's scale is
    d (ls_i - 32), ls_i = ((scales_l[i / 2] >> 4 (i % 2)) & 15) | (((scales_h >> 2i) & 3) << 4)."""
    n, kb, _ = blocks.shape
    sh = blocks[..., 2:4].copy().view("<u2")[..., 0]  # [N, kb]
    sl = blocks[..., 4:8]
    lo = (sl[..., None] >> np.array([0, 4], dtype=np.uint8)).reshape(n, kb, 8) & 0x0F
    hi = (sh[..., None] >> (2 * np.arange(8, dtype=np.uint16))) & 3
    ls = (lo.astype(np.int16) | (hi.astype(np.int16) << 4)) - 32
    levels = _iq4_levels(blocks[..., 8:136].reshape(n, kb, 8, 16))
    return _carried8(levels.reshape(n, kb * 8, 32), _f16(blocks, 0)[..., None] * ls.astype(np.float32), k, 32)


_EIGHT_BIT_CARRIED = {"Q5_1": _repack_q5_1, "Q5_K": _repack_q5_k, "Q3_K": _repack_q3_k, "Q2_K": _repack_q2_k,
                      "IQ4_NL": _repack_iq4_nl, "IQ4_XS": _repack_iq4_xs}


def concat_rows(parts: list[Packed]) -> Packed:
    """Stack matrices along N (fused q|k|v, gate|up); all must share K, bits, block and symmetry."""
    p0 = parts[0]
    if any((p.k, p.bits, p.block, p.zero_points is None) != (p0.k, p0.bits, p0.block, p0.zero_points is None)
           for p in parts):
        raise ValueError("concat_rows needs parts with the same K, bits, block and symmetry")
    zps = None if p0.zero_points is None else np.concatenate([p.zero_points for p in parts])
    offsets = None
    if any(p.offsets is not None for p in parts):  # a part without offsets contributes zeros
        offsets = np.concatenate([p.offsets if p.offsets is not None else np.zeros_like(p.scales) for p in parts])
    sbs = [p.superblocks for p in parts]
    superblocks = None
    if all(sb is not None and sb.key() == sbs[0].key() for sb in sbs):
        cat = lambda f: None if getattr(sbs[0], f) is None else np.concatenate([getattr(sb, f) for sb in sbs])  # noqa: E731
        s0 = sbs[0]
        superblocks = SuperBlocks(cat("sc"), cat("d"), cat("mn"), cat("dmin"), s0.bits, s0.superblock, s0.zero_point,
                                  s0.level_offset)
    return Packed(np.concatenate([p.b for p in parts]), np.concatenate([p.scales for p in parts]), zps,
                  p0.k, p0.bits, p0.block, offsets, superblocks)


def positive_scales(p: Packed) -> Packed:
    """The same weights with every block scale > 0 (TensorRT's ONNX parser refuses a DequantizeLinear scale
    <= 0), exactly: a symmetric block with s < 0 stores u' = (2^b - 1) - u (the bitwise NOT of each stored
    value, so q' = -q - 1) under a = -s and adds a to the block's offset, since
        s (u - z) = a (z - u) = a (u' - z) + a        (z = 2^(b-1), u' = 2^b - 1 - u);
    a block with s == 0 (all zeros) gets s = 1 and q = 0. Blocks with s > 0 are untouched."""
    if p.zero_points is not None:
        raise ValueError("positive_scales needs a symmetric Packed (TensorRT takes only zero zero-points)")
    neg, zero = p.scales < 0, p.scales == 0
    if not (neg.any() or zero.any()):
        return p
    b = p.b.copy()
    b[neg] = ~b[neg]  # per stored value: 4-bit nibbles and 8-bit bytes alike
    mid = 1 << (p.bits - 1)
    b[zero] = (mid | (mid << 4)) if p.bits == 4 else mid  # q = 0
    offsets = p.offsets  # all-zero blocks need none; flipped blocks carry their sign here
    if neg.any():
        offsets = p.offsets.copy() if p.offsets is not None else np.zeros_like(p.scales)
        offsets[neg] += -p.scales[neg]
    scales = np.where(neg, -p.scales, np.where(zero, np.float32(1.0), p.scales)).astype(np.float32)
    return Packed(b, scales, None, p.k, p.bits, p.block, offsets)


def signed_values(p: Packed) -> np.ndarray:
    """Packed (symmetric) -> int8 [N, K]: the signed levels q = u - 2^(bits-1) that DequantizeLinear reads."""
    if p.zero_points is not None:
        raise ValueError("signed_values needs a symmetric Packed")
    u = _unpack_nibbles(p.b) if p.bits == 4 else p.b
    return (u.reshape(p.n, -1)[:, : p.k].astype(np.int16) - (1 << (p.bits - 1))).astype(np.int8)


def pack_int4(q: np.ndarray) -> bytes:
    """int8 values in [-8, 7] -> ONNX INT4 raw bytes: flattened row-major, element 2i in the low nibble of byte i
    (an odd count gets a zero high nibble)."""
    u = (q.reshape(-1).astype(np.int16) & 0x0F).astype(np.uint8)
    if u.size % 2:
        u = np.append(u, np.uint8(0))
    return _pack_nibbles(u).tobytes()


def quantize_channels(w: np.ndarray, bits: int = 8, search: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """w [N out, K in] float32 -> (q int8 [N, K] in -2^(bits-1)..2^(bits-1)-1, scales float32 [N]): symmetric,
    one scale per output channel, w ~ q * scale — the weight side of the integer-GEMM form (``intgemm``). The
    value of largest magnitude maps to the lowest level as in the block form, and the least-squares scale search
    (SEARCH_FACTORS) runs per channel.

    bits 7 or 8: x86 CPUs without VNNI (AVX2, AVX-512 before Cascade Lake) run ONNX Runtime's uint8 x int8 GEMM
    with vpmaddubsw, which adds two products into a saturating int16. The form keeps every pair sum in range
    (WeightFormat.intgemm_pair_bound): 7-bit weights (-64..63) next to 8-bit activations (uint8 up to 255:
    255 * 64 * 2 = 32640), or 8-bit weights next to 7-bit activation parts (up to 127: 127 * 128 * 2 = 32512).
    Then every kernel (AVX2, VNNI, Arm dot products; GEMV or GEMM) returns the same exact sums. Full ranges on
    both sides would saturate on those CPUs and make a row's logits depend on the kernel, i.e. on the width."""
    N, K = w.shape
    q = np.empty((N, K), dtype=np.int8)
    scales = np.empty(N, dtype=np.float32)
    spec = QuantSpec(bits, search=search)
    for r in range(0, N, _SEARCH_ROWS):
        v, s, _ = _quantize_rows(np.asarray(w[r: r + _SEARCH_ROWS], dtype=np.float32)[:, None, :], spec)
        q[r: r + _SEARCH_ROWS], scales[r: r + _SEARCH_ROWS] = v[:, 0], s[:, 0]
    return q, scales


SEK_TILE = 16  # columns per tile of the specedge kernel's layout (runtime/csrc/sek_gemm.c)


def sek_pack(p: Packed) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A MatMulNBits-form matrix in the layout of specedge's kernel (runtime/csrc/sek_gemm.c): tiles of 16
    output columns; per tile and block, 64-byte chunks — 4-bit: chunk j, byte 4c+t holds column c's level at
    k = 8j+t (low nibble) and 8j+4+t (high); 8-bit: chunk g, byte 4c+t holds k = 4g+t. Scales fp32 and zero
    points uint8, both [N/16, k_blocks, 16] (a symmetric matrix gets its implicit 2^(bits-1)). A matrix with float
    offsets (GGUF Q4_1/Q4_K: w = s (q - z) + o) gets fp32 zero-point products instead, zs = z s - o (computed in
    float64, rounded once: w = s q - zs; for Q4_K, zs is dmin m up to that rounding of o); 8-bit levels q - 128
    that are never negative are stored as q - 128 under z = 0, so that zs = -o exactly. N is padded to whole
    tiles with zero columns (scale 0); the graph slices them off. Returns (b, scales, zero points, padded N)."""
    if p.block % 16 or not 16 <= p.block <= 256:
        raise UnsupportedModelError("the specedge kernel takes blocks of 16..256 values (multiples of 16), "
                                    f"got {p.block}")
    q = _unpack_nibbles(p.b) if p.bits == 4 else p.b  # [N, kb, block]
    n, kb, blk = q.shape
    if p.zero_points is None:
        zp = np.full((n, kb), 1 << (p.bits - 1), dtype=np.uint8)
    else:
        zp = (_unpack_nibbles(p.zero_points)[:, :kb] if p.bits == 4 else p.zero_points).astype(np.uint8)
    scales = p.scales
    if p.offsets is not None:
        if p.bits == 8 and p.zero_points is None and q.min(initial=255) >= 128:
            # 8-bit levels that are all >= 0 (GGUF Q5_1, Q5_K, Q2_K): stored as they are under zero point 0, so
            # zs = -o exactly and the kernel's weights are gguf's own bit for bit
            q, zp = q - np.uint8(128), np.zeros_like(zp)
        zp = (zp.astype(np.float64) * scales.astype(np.float64) - p.offsets.astype(np.float64)).astype(np.float32)
    n_pad = -(-n // SEK_TILE) * SEK_TILE
    if n_pad != n:
        q = np.concatenate([q, np.zeros((n_pad - n, kb, blk), np.uint8)])
        zp = np.concatenate([zp, np.zeros((n_pad - n, kb), zp.dtype)])
        scales = np.concatenate([scales, np.zeros((n_pad - n, kb), np.float32)])
    tiles = n_pad // SEK_TILE
    if p.bits == 4:  # [tile, c, kb, j, half, t] -> [tile, kb, j, c, t, half]
        x = q.reshape(tiles, SEK_TILE, kb, blk // 8, 2, 4).transpose(0, 2, 3, 1, 5, 4)
        b = (x[..., 0] | (x[..., 1] << 4)).astype(np.uint8)
    else:  # [tile, c, kb, g, t] -> [tile, kb, g, c, t]
        b = q.reshape(tiles, SEK_TILE, kb, blk // 4, 4).transpose(0, 2, 3, 1, 4)
    per_tile = lambda v: np.ascontiguousarray(v.reshape(tiles, SEK_TILE, kb).transpose(0, 2, 1))  # noqa: E731
    return (np.ascontiguousarray(b).reshape(-1), per_tile(scales.astype(np.float32)), per_tile(zp), n_pad)


def _sek_tiles(a: np.ndarray, n_pad: int) -> np.ndarray:
    """[N, blocks] per-column values -> [N/16, blocks, 16] (columns padded with zeros to whole tiles)."""
    a = np.concatenate([a, np.zeros((n_pad - a.shape[0], a.shape[1]), a.dtype)]) if n_pad != a.shape[0] else a
    return np.ascontiguousarray(a.reshape(n_pad // SEK_TILE, SEK_TILE, -1).transpose(0, 2, 1))


def sek_pack_sb(p: Packed) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None, int]:
    """A matrix with two-level scales (p.superblocks: GGUF Q4_K, Q6_K) in the layout of specedge's kernel
    (SekMatMulSB): the levels as sek_pack lays them out at 4 bits; at 6 bits, per (tile, block), block/16 groups of
    three 64-byte chunks X, Y, Z: group h, byte 4c+t holds in bits 0-5 column c's level at k = 16h+t (X), 16h+4+t
    (Y), 16h+8+t (Z), and in bits 6-7 the top, middle and low two bits of its level at k = 16h+12+t. Returns (b, sc,
    d, mn, dmin, padded N); sc/mn int8 [N/16, k_blocks, 16], d/dmin fp16 [N/16, k_superblocks, 16]."""
    sb = p.superblocks
    if sb is None:
        raise ValueError("sek_pack_sb needs a matrix with super-block scales (GGUF Q4_K / Q6_K)")
    q = _unpack_nibbles(p.b) if p.bits == 4 else p.b  # [N, kb, block], stored levels
    if sb.level_offset:
        q = (q.astype(np.int16) - sb.level_offset).astype(np.uint8)
    n, kb, blk = q.shape
    n_pad = -(-n // SEK_TILE) * SEK_TILE
    if n_pad != n:
        q = np.concatenate([q, np.zeros((n_pad - n, kb, blk), np.uint8)])
    tiles = n_pad // SEK_TILE
    if sb.bits == 4:
        low = q.reshape(tiles, SEK_TILE, kb, blk // 8, 2, 4).transpose(0, 2, 3, 1, 5, 4)  # [tile, kb, j, c, t, half]
        parts = [(low[..., 0] | (low[..., 1] << 4)).reshape(tiles, kb, -1)]
    elif sb.bits == 6:  # [tile, kb, h, i, c, t]: level i of group h at k = 16h + 4i + t
        v = q.reshape(tiles, SEK_TILE, kb, blk // 16, 4, 4).transpose(0, 2, 3, 4, 1, 5).astype(np.uint8)
        x, y, z, w = v[:, :, :, 0], v[:, :, :, 1], v[:, :, :, 2], v[:, :, :, 3]
        xyz = np.stack([x | ((w >> 4) << 6), y | (((w >> 2) & 3) << 6), z | ((w & 3) << 6)], axis=3)
        parts = [xyz.reshape(tiles, kb, -1)]
    else:
        raise ValueError(f"super-block levels are 4 or 6 bits, got {sb.bits}")
    b = np.concatenate(parts, axis=2).astype(np.uint8).reshape(-1)
    mins = (None, None) if sb.mn is None else (_sek_tiles(sb.mn, n_pad), _sek_tiles(_halves(sb.dmin), n_pad))
    return b, _sek_tiles(sb.sc, n_pad), _sek_tiles(_halves(sb.d), n_pad), *mins, n_pad


def _halves(x: np.ndarray) -> np.ndarray:
    """GGUF's fp16 super-block scales, held as float32, back in fp16 (refused if any would round)."""
    h = x.astype(np.float16)
    if not np.array_equal(h.astype(np.float32), x, equal_nan=True):
        raise ValueError("super-block scales must be fp16 values (GGUF's d and dmin)")
    return h


def rel_error(w: np.ndarray, approx: np.ndarray) -> float:
    """||approx - w|| / ||w||: what quantization moved the weights by."""
    d = approx - w
    return float(np.sqrt((d * d).sum() / max((w * w).sum(), 1e-30)))


def rel_rms_error(w: np.ndarray, p: Packed) -> float:
    """rel_error of a Packed matrix."""
    return rel_error(w, dequantize(p))


WEIGHT_FORMATS = ("fp32", "fp16", "int8", "int4")
QUANT_FORMS = ("matmulnbits", "qdq", "intgemm", "specedge")
QDQ_OPSET = 21  # DequantizeLinear with int4 and block_size


@dataclass(frozen=True)
class WeightFormat:
    """How one model's weights are stored in its graph (``--weights`` / ``--draft-weights``).

    fp32: plain MatMul. int8 / int4: every linear layer is a MatMulNBits; the lm_head is int8
    unless ``lm_head`` says otherwise (it is the largest matrix, and its error goes straight into
    the logits the acceptance rule compares; "gguf": a GGUF source's own output.weight blocks, as
    the file holds them, whatever the rest of the format); the embedding table is stored fp16 and
    gathered row by row (a lookup reads one row per token, so it costs memory, not bandwidth).
    """

    name: str = "fp32"
    block: int = 32
    symmetric: bool = True
    accuracy_level: int = 4
    lm_head: str = "auto"  # auto | fp32 | int8 | int4 | gguf
    embedding: str = "fp16"  # quantized formats: fp16 | fp32 gather table
    # carry GGUF blocks exactly where MatMulNBits can hold them (Q4_0, Q4_1, Q4_K as int4 (+ float offsets),
    # Q8_0 and Q6_K as int8, whatever width was asked) vs carry only Q4_0/Q8_0 at the asked width, re-quantize rest
    gguf_exact: bool = True
    # how a quantized matrix is written: com.microsoft MatMulNBits, or standard ONNX (opset 21) DequantizeLinear
    # (int4/int8 blocked, symmetric, scales > 0) feeding MatMul — what TensorRT 10 parses as weight-only INT4,
    # and what ONNX Runtime (>= 1.25: runtime.backends.ort.QDQ_MIN_ORT) fuses back into MatMulNBits at load
    # (same kernel, bitwise equal)
    # intgemm: every 8-bit matrix (all of an int8 model; an int4 model's int8 lm_head and its Q6_K parts) is
    # int8 per output channel, run by MatMulInteger on activations quantized to int8 per row, then scaled:
    # exact integer sums, so a row's result never depends on the step's width on any CPU, and MLAS's integer
    # GEMM reads the weights once per step whatever the width (a cheap multi-token step); 4-bit matrices stay
    # MatMulNBits. ONNX Runtime only (TensorRT builds Q/DQ, not MatMulInteger).
    form: str = "matmulnbits"
    # intgemm: 8 = one uint8 row per activation row (weights 7-bit); 16 = two 7-bit parts, the row and its rounding
    # residual, stacked in the same MatMulInteger call (~13-bit activations, weights 8-bit, for models with
    # activation outliers; the step runs 2T rows). Both keep int16 pair sums exact: quantize_channels
    intgemm_activation_bits: int = 8
    # intgemm: 8-bit weights and 8-bit activation parts, for CPUs whose integer dot products accumulate in int32
    # (x86 with AVX512-VNNI / AVX-VNNI, Arm): int16 pair sums can saturate elsewhere, and the runtime refuses there
    intgemm_full_range: bool = False
    # intgemm, int8 models: SmoothQuant's alpha (0 = off): each linear input channel's range is moved into the
    # weights by max|x|^alpha / max|W|^(1 - alpha), measured on a calibration text (export/smooth.py)
    intgemm_smooth: float = 0.0
    # specedge: every quantized matrix (4- and 8-bit blocks, the lm_head included) runs specedge's own kernel,
    # ai.specedge::SekMatMul (runtime/csrc/sek_gemm.c, built on first use): rows batch-invariant at every width,
    # odd ones and width 1 included, and a multi-token step that reads each weight once. GGUF blocks are carried
    # as in the MatMulNBits form (Q4_1/Q4_K's offsets folded into fp32 zero-point products); CPU ONNX Runtime only.

    def __post_init__(self) -> None:
        if self.name not in WEIGHT_FORMATS:
            raise UnsupportedModelError(f"--weights {self.name!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
        if self.name == "fp16":
            raise UnsupportedModelError(
                "--weights fp16 is not implemented: fp16 graphs belong to the TensorRT build (its own issue); "
                "ONNX Runtime on CPU has no fast fp16 MatMul — use fp32, int8 or int4")
        if self.lm_head not in ("auto", "fp32", "int8", "int4", "gguf"):
            raise UnsupportedModelError(f"lm_head format {self.lm_head!r}: choose auto, fp32, int8, int4 or gguf")
        if self.lm_head == "gguf" and not self.quantized:
            raise UnsupportedModelError("--lm-head gguf carries a GGUF's own quantized output.weight blocks: it needs "
                                        "--weights int8 or int4 (an fp32 bundle's head is fp32)")
        if self.embedding not in ("fp16", "fp32"):
            raise UnsupportedModelError(f"embedding format {self.embedding!r}: choose fp16 or fp32")
        if self.form not in QUANT_FORMS:
            raise UnsupportedModelError(f"quantized form {self.form!r}: choose one of {', '.join(QUANT_FORMS)}")
        if self.form == "qdq" and not self.symmetric:
            raise UnsupportedModelError("--quant-form qdq needs symmetric blocks: TensorRT's DequantizeLinear takes "
                                        "only zero zero-points (drop --asymmetric, or use --quant-form matmulnbits)")
        if self.intgemm_activation_bits not in (8, 16):
            raise UnsupportedModelError("integer-GEMM activations are 8 or 16 bits, "
                                        f"got {self.intgemm_activation_bits}")
        if self.intgemm_activation_bits == 16 and self.form != "intgemm":
            raise UnsupportedModelError("--intgemm-activations 16 needs --quant-form intgemm")
        if self.intgemm_full_range and self.form != "intgemm":
            raise UnsupportedModelError("--intgemm-full-range needs --quant-form intgemm")
        if not 0.0 <= self.intgemm_smooth < 1.0:
            raise UnsupportedModelError(f"--intgemm-smooth is an alpha in [0, 1) (0: off), got {self.intgemm_smooth}")
        if self.intgemm_smooth and not (self.form == "intgemm" and self.name == "int8"):
            raise UnsupportedModelError("--intgemm-smooth needs --weights int8 --quant-form intgemm (every matrix "
                                        "re-quantized from the smoothed float weights)")
        if self.form == "specedge" and self.quantized:
            if self.lm_head == "fp32":
                raise UnsupportedModelError(
                    "--quant-form specedge runs every matrix through its own row-invariant kernel; an fp32 lm_head "
                    "would be a MatMul whose width-1 rows round differently: use --lm-head int8 (or int4)")
            if not 16 <= self.block <= 256:
                raise UnsupportedModelError(f"--quant-form specedge takes blocks of 16..256 values, got {self.block}")
        if self.quantized:
            QuantSpec(8, self.block, self.symmetric, self.accuracy_level)  # validates block and level

    @property
    def quantized(self) -> bool:
        return self.name in ("int8", "int4")

    @property
    def qdq(self) -> bool:
        return self.quantized and self.form == "qdq"

    @property
    def intgemm(self) -> bool:
        return self.quantized and self.form == "intgemm"

    @property
    def specedge(self) -> bool:
        return self.quantized and self.form == "specedge"

    @property
    def intgemm_weight_bits(self) -> int:
        return 7 if self.intgemm_activation_bits == 8 and not self.intgemm_full_range else 8

    @property
    def intgemm_activation_levels(self) -> int:
        """L: an activation part is round(x / s) in -L..L with s = max|x| / L, stored as uint8 + (L + 1)."""
        return 127 if self.intgemm_activation_bits == 8 or self.intgemm_full_range else 63

    @property
    def intgemm_pair_bound(self) -> int:
        """The largest |a1 w1 + a2 w2| the integer GEMM can meet (a: stored uint8 activations, w: int8 weights):
        <= 32767 (no kernel's int16 pair sum saturates: quantize_channels) unless ``intgemm_full_range``."""
        return 2 * (2 * self.intgemm_activation_levels + 1) * (1 << (self.intgemm_weight_bits - 1))

    @property
    def even_widths(self) -> bool:
        """Whether a target in this format must step at even widths only: MatMulNBits computes rows in pairs
        and an odd last row through a kernel that rounds differently (docs/exactness.md). An int8 model in the
        integer-GEMM form has no MatMulNBits left (unless its lm_head is int4)."""
        all_integer = self.intgemm and self.name == "int8" and self.lm_head in ("auto", "int8", "fp32")
        return self.quantized and not all_integer and not self.specedge

    def _spec(self, bits: int) -> QuantSpec:
        return QuantSpec(bits, self.block, self.symmetric, self.accuracy_level, positive_scales=self.qdq)

    def linear_spec(self) -> QuantSpec | None:
        return self._spec(int(self.name[3:])) if self.quantized else None

    def lm_head_spec(self) -> QuantSpec | None:
        """The head's spec; "gguf" runs under the int8 one (its carried blocks keep their own bits and block)."""
        name = ("int8" if self.quantized else "fp32") if self.lm_head in ("auto", "gguf") else self.lm_head
        return None if name == "fp32" else self._spec(int(name[3:]))
