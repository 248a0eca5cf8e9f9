/* specedge's row-invariant quantized GEMM for CPU decode and verify steps.
 *
 * Y[M, N] = A[M, K] @ W[N, K]^T, for the few rows of a decode or verify step (M = 1..16; more works).
 *
 * Weights: b-bit unsigned levels q (b = 4 or 8; 4 or 6 with two-level scales, below) in blocks of `blk` along K,
 * with a per-(column, block) fp32 scale s and uint8 zero point z: w = s * (q - z) — or, for blocks whose zero is
 * not an integer level (GGUF Q4_1), the fp32 product zs standing for z * s: w = s * q - zs.
 * Activations: quantized per (row, block) to int8, symmetric: sa = max|a| / 127, qa = round-half-even(a / sa)
 * (computed as a * (127 / max|a|), clamped to +-127, rounded whatever the FP rounding mode; a block with a NaN or
 * infinity makes its row's outputs NaN; a block below 1e-30 counts as zero).
 * Per (row, column, block): acc = sum_k qa * q, an exact int32. Then, block after block in order, in fp32:
 *     y = fma((float)acc, s * sa, y);   y = fma(-(z * s), sa * sum(qa), y)
 *
 * So a row's result depends on nothing but that row: the same whatever M is, whichever rows share a call,
 * and however columns are split among threads (batch-invariant by construction). The scalar, AVX2, AVX-VNNI,
 * AVX512-VNNI and Arm NEON (sek_gemm_neon.c) paths compute the same integers and the same fp32 operations in the
 * same order: their results are bitwise equal, across machines too (tests/runtime/test_sek_kernel.py,
 * tools/dev/sek_isa_check.c).
 *
 * Packed weights, one layout for every ISA: tiles of 16 columns; per tile, per block, 64-byte chunks:
 *   4-bit: blk/8 chunks; chunk j, byte 4c+t: low nibble q[c][8j+t], high nibble q[c][8j+4+t]
 *   6-bit: blk/16 groups of 3 chunks X, Y, Z; group h, byte 4c+t of each: bits 0-5 q[c][16h+t] (X),
 *          q[c][16h+4+t] (Y), q[c][16h+8+t] (Z), and bits 6-7 the top, middle and low two bits of q[c][16h+12+t]:
 *          three levels need only a mask
 *   8-bit: blk/4 chunks; chunk g, byte 4c+t: q[c][4g+t]
 * so one 64-byte chunk feeds a 512-bit dot-product instruction (16 columns x 4 k) against 4 activation bytes
 * broadcast. Scales: fp32 [N/16][K/blk][16]; zero points: uint8 (or zs: fp32) [N/16][K/blk][16].
 *
 * Two-level scales (GGUF's K-quants as the file holds them; sek_gemm_tiles with w->sc set): integer block scales sc
 * (int8 [N/16][K/blk][16]) under an fp16 scale d per super-block of sblk values (fp16 [N/16][K/sblk][16]), and
 * optionally integer block mins mn under dmin (same shapes): w = d sc q - dmin mn (GGUF Q4_K, 4-bit, 4.625 bits a
 * weight here; GGUF 4.5) or w = d sc (q - zconst) (Q6_K, 6-bit, zconst 32, 6.5625 bits as in GGUF). Activations
 * are then quantized per (row, super-block), and each block's exact dot product is scaled by its sc in int32:
 * the fp32 operations run once per super-block, not per block of 16 or 32 (tile_sb_scalar documents them).
 * Requires N % 16 == 0, blk % 16 == 0, blk <= 256; K is padded to whole blocks (zero weights, zero activations).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sek.h"
#include "sek_gemm_impl.h"
#if defined(__x86_64__) && (defined(__AVX2__) || defined(__AVX512F__))
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SEK_HAVE_VNNI512 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SEK_HAVE_AVX2 1
#if defined(__AVXVNNI__)
#define SEK_HAVE_AVXVNNI 1 /* AVX-VNNI: vpdpbusd on ymm without AVX-512 (Alder Lake and its N-series, Zen 5) */
#endif
#endif

#define SEK_RMAX 10 /* rows per pass (AVX512): a verify step of up to 10 rows unpacks each weight chunk once */
/* ... but a step of more than SEK_ONE_PASS rows (a prefill chunk, a 9- or 10-token verify) takes them SEK_RPASS at a
 * time: with 10 rows x 2 tiles, GCC 12 keeps part of the 20 accumulators and the row pointers on the stack and the
 * loop runs at 2/3 of vpdpbusd's rate. Passes of 6 run 1.4x faster at 64 rows and 1.15-1.3x at 9-10 (one thread,
 * in cache, Zen 5); a 64-token prefill chunk of Qwen 1.5B 0.78x the time (docs/benchmarks.md). The bits do not
 * change: a row's sums are its own whatever the pass. */
#define SEK_ONE_PASS 8
#define SEK_RPASS 6

/* Eight activation levels a[0..7] as two 4-byte words, each broadcast to every lane of a dot product. */
static inline void four_pair(const int8_t *a, int32_t *a0, int32_t *a1) {
    memcpy(a0, a, 4);
    memcpy(a1, a + 4, 4);
}

/* Which ISA paths this build has, as a bit mask of 1 << SEK_ISA_*. */
int sek_isa_mask(void) {
    int m = 1 << SEK_ISA_SCALAR;
#ifdef SEK_HAVE_AVX2
    m |= 1 << SEK_ISA_AVX2;
#endif
#ifdef SEK_HAVE_AVXVNNI
    m |= 1 << SEK_ISA_AVXVNNI;
#endif
#ifdef SEK_HAVE_VNNI512
    m |= 1 << SEK_ISA_VNNI512;
#endif
#ifdef SEK_HAVE_NEON
    m |= 1 << SEK_ISA_NEON;
#endif
    return m;
}

const char *sek_isa_name(int isa) {
    static const char *const names[] = {"scalar", "avx2", "vnni512", "neon", "avxvnni"};
    return isa >= SEK_ISA_SCALAR && isa <= SEK_ISA_AVXVNNI ? names[isa - SEK_ISA_SCALAR] : NULL;
}

/* The path SEK_ISA_BEST stands for: the widest this build has. */
static int best_isa(int isa) {
    if (isa != SEK_ISA_BEST) return isa;
    const int m = sek_isa_mask();
    return (m & (1 << SEK_ISA_VNNI512))   ? SEK_ISA_VNNI512
           : (m & (1 << SEK_ISA_AVXVNNI)) ? SEK_ISA_AVXVNNI
           : (m & (1 << SEK_ISA_AVX2))    ? SEK_ISA_AVX2
           : (m & (1 << SEK_ISA_NEON))    ? SEK_ISA_NEON
                                          : SEK_ISA_SCALAR;
}

size_t sek_scratch_bytes(int64_t m, int64_t k, int64_t blk) {
    return (size_t)(m * k) + 2 * sizeof(float) * (size_t)(m * (k / blk)) + 64;
}

/* ---------------------------------------------------------------- activations */

/* Round to nearest, ties to even, whatever the FP environment's rounding mode (|x| <= 128 here). */
static float round_even(float x) {
    const float t = (float)(int32_t)x; /* truncation: mode-independent */
    const float d = x - t;             /* exact for |x| < 2^23 */
    if (d > 0.5f || (d == 0.5f && ((int32_t)t & 1))) return t + 1.f;
    if (d < -0.5f || (d == -0.5f && ((int32_t)t & 1))) return t - 1.f;
    return t;
}


/* One (row, block) of activations -> int8 levels, sa = max|a| / 127, sasum = sa * sum(levels). Rounding is
 * nearest-even whatever the rounding mode, levels are clamped to +-127, a block holding a NaN or an infinity gets
 * sa = sasum = NaN (its products then carry the NaN into the output), and a block of magnitudes below SEK_TINY
 * counts as zero: the same rules on every path. */
static void quantize_block(const float *a, int64_t blk, int8_t *q, float *sa, float *sasum, int isa) {
    float mx = 0.f;
    int64_t i = 0;
    int32_t sum = 0;
    int bad = 0;
#ifdef SEK_HAVE_NEON
    if (isa == SEK_ISA_NEON && sek_quantize_block_neon(a, blk, q, sa, sasum)) return;
#endif
#ifdef SEK_HAVE_VNNI512
    if (isa == SEK_ISA_VNNI512) {
        __m512 vm = _mm512_setzero_ps();
        const __m512 big = _mm512_set1_ps(3.402823466e+38f);
        __mmask16 nonfinite = 0;
        for (; i < blk; i += 16) {
            const __m512 v = _mm512_abs_ps(_mm512_loadu_ps(a + i));
            nonfinite |= _mm512_cmp_ps_mask(v, big, _CMP_NLE_UQ); /* NaN or > FLT_MAX */
            vm = _mm512_max_ps(vm, v);
        }
        bad = nonfinite != 0;
        mx = _mm512_reduce_max_ps(vm);
        if (!bad && mx >= SEK_TINY) {
            const __m512 vinv = _mm512_set1_ps(127.f / mx), lim = _mm512_set1_ps(127.f);
            __m512i vs = _mm512_setzero_si512();
            for (i = 0; i < blk; i += 16) {
                __m512 x = _mm512_mul_ps(_mm512_loadu_ps(a + i), vinv);
                x = _mm512_min_ps(_mm512_max_ps(x, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
                const __m512i qi = _mm512_cvt_roundps_epi32(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                vs = _mm512_add_epi32(vs, qi);
                _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtsepi32_epi8(qi));
            }
            sum = _mm512_reduce_add_epi32(vs);
            *sa = mx / 127.f;
            *sasum = *sa * (float)sum;
            return;
        }
    } else
#endif
#ifdef SEK_HAVE_AVX2
    if (isa == SEK_ISA_AVX2 || isa == SEK_ISA_AVXVNNI) {
        const __m256 signbit = _mm256_set1_ps(-0.f), big = _mm256_set1_ps(3.402823466e+38f);
        __m256 vm = _mm256_setzero_ps(), nonfinite = _mm256_setzero_ps();
        for (; i < blk; i += 8) {
            const __m256 v = _mm256_andnot_ps(signbit, _mm256_loadu_ps(a + i));
            nonfinite = _mm256_or_ps(nonfinite, _mm256_cmp_ps(v, big, _CMP_NLE_UQ)); /* NaN or > FLT_MAX */
            vm = _mm256_max_ps(vm, v);
        }
        bad = _mm256_movemask_ps(nonfinite) != 0;
        float lanes[8];
        _mm256_storeu_ps(lanes, vm);
        for (int l = 0; l < 8; l++) mx = lanes[l] > mx ? lanes[l] : mx;
        if (!bad && mx >= SEK_TINY) {
            const __m256 vinv = _mm256_set1_ps(127.f / mx), lim = _mm256_set1_ps(127.f), nlim = _mm256_set1_ps(-127.f);
            __m256i vs = _mm256_setzero_si256();
            for (i = 0; i < blk; i += 8) {
                __m256 x = _mm256_mul_ps(_mm256_loadu_ps(a + i), vinv);
                x = _mm256_min_ps(_mm256_max_ps(x, nlim), lim);
                const __m256i qi = _mm256_cvttps_epi32(_mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                vs = _mm256_add_epi32(vs, qi);
                const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
                _mm_storel_epi64((__m128i *)(q + i), _mm_packs_epi16(w16, w16));
            }
            int32_t part[8];
            _mm256_storeu_si256((__m256i *)part, vs);
            for (int l = 0; l < 8; l++) sum += part[l]; /* exact integers: any order */
            *sa = mx / 127.f;
            *sasum = *sa * (float)sum;
            return;
        }
    } else
#endif
    {
        (void)isa;
        for (i = 0; i < blk; i++) {
            const float v = fabsf(a[i]);
            if (!(v <= 3.402823466e+38f)) bad = 1;
            mx = v > mx ? v : mx;
        }
        if (!bad && mx >= SEK_TINY) {
            const float inv = 127.f / mx;
            for (i = 0; i < blk; i++) {
                float x = a[i] * inv;
                x = x > 127.f ? 127.f : x < -127.f ? -127.f : x;
                const int32_t qi = (int32_t)round_even(x);
                q[i] = (int8_t)qi;
                sum += qi;
            }
            *sa = mx / 127.f;
            *sasum = *sa * (float)sum;
            return;
        }
    }
    memset(q, 0, (size_t)blk); /* a non-finite or negligible block */
    *sa = *sasum = bad ? NAN : 0.f;
}

/* A [m][k] fp32 (row stride lda) -> rows (qa, sa, sasum) laid out in scratch (sek_scratch_bytes(m, kpad, blk)),
 * kpad = k rounded up to whole blocks: a partial last block is quantized as if zero-padded (the weights' padding
 * is zero too). */
void sek_quantize(const float *a, int64_t m, int64_t k, int64_t lda, int64_t kpad, int64_t blk, void *scratch,
                  sek_rows *out, int isa) {
    const int64_t nb = kpad / blk;
    float *sa = (float *)scratch, *sasum = sa + m * nb;
    int8_t *qa = (int8_t *)(sasum + m * nb);
    float tail[SEK_BLK_MAX];
    isa = best_isa(isa);
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *src = a + r * lda + b * blk;
            if ((b + 1) * blk > k) { /* the partial last block */
                const int64_t have = k - b * blk > 0 ? k - b * blk : 0;
                memset(tail, 0, sizeof tail);
                memcpy(tail, src, (size_t)have * sizeof(float));
                src = tail;
            }
            quantize_block(src, blk, qa + r * kpad + b * blk, sa + r * nb + b, sasum + r * nb + b, isa);
        }
    out->qa = qa;
    out->sa = sa;
    out->sasum = sasum;
    out->bsum = NULL;
    out->bblk = 0;
    out->m = m;
    out->k = kpad;
    out->blk = blk;
}

/* Two-level scales (SekMatMulSB): activations per (row, super-block), and their exact sums per weight block (the
 * min or zero-point term needs them) after the rows in scratch (sek_sb_scratch_bytes). */
size_t sek_sb_scratch_bytes(int64_t m, int64_t k, int64_t sblk, int64_t blk) {
    return sek_scratch_bytes(m, k, sblk) + sizeof(int16_t) * (size_t)(m * (k / blk));
}

void sek_quantize_sb(const float *a, int64_t m, int64_t k, int64_t lda, int64_t kpad, int64_t sblk, int64_t blk,
                     void *scratch, sek_rows *out, int isa) {
    sek_quantize(a, m, k, lda, kpad, sblk, scratch, out, isa);
    const int64_t nb = kpad / blk;
    int16_t *bsum = (int16_t *)(out->qa + m * kpad); /* m * kpad is even: kpad is whole blocks of 16 */
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < nb; b++) {
            int32_t sum = 0;
            for (int64_t i = 0; i < blk; i++) sum += out->qa[r * kpad + b * blk + i];
            bsum[r * nb + b] = (int16_t)sum; /* |sum| <= 256 * 127 */
        }
    out->bsum = bsum;
    out->bblk = blk;
}

/* ---------------------------------------------------------------- scalar (the reference) */

/* acc[c] += the exact integer dot products of one block (levels at bp) with activations a, columns c of a tile. */
static void dot_scalar(const sek_weights *w, const uint8_t *bp, const int8_t *a, int32_t acc[SEK_TILE]) {
    const int64_t blk = w->blk;
    if (w->bits == 4) {
        for (int64_t j = 0; j < blk / 8; j++)
            for (int c = 0; c < SEK_TILE; c++)
                for (int t = 0; t < 4; t++) {
                    uint8_t v = bp[j * 64 + 4 * c + t];
                    acc[c] += (int32_t)(v & 15) * a[8 * j + t] + (int32_t)(v >> 4) * a[8 * j + 4 + t];
                }
    } else if (w->bits == 6) {
        for (int64_t h = 0; h < blk / 16; h++)
            for (int c = 0; c < SEK_TILE; c++)
                for (int t = 0; t < 4; t++) {
                    const uint8_t x = bp[3 * h * 64 + 4 * c + t], y = bp[(3 * h + 1) * 64 + 4 * c + t],
                                  z = bp[(3 * h + 2) * 64 + 4 * c + t];
                    acc[c] += (int32_t)(x & 63) * a[16 * h + t] + (int32_t)(y & 63) * a[16 * h + 4 + t] +
                              (int32_t)(z & 63) * a[16 * h + 8 + t] +
                              (int32_t)((x >> 6) << 4 | (y >> 6) << 2 | z >> 6) * a[16 * h + 12 + t];
                }
    } else {
        for (int64_t g = 0; g < blk / 4; g++)
            for (int c = 0; c < SEK_TILE; c++)
                for (int t = 0; t < 4; t++) acc[c] += (int32_t)bp[g * 64 + 4 * c + t] * a[4 * g + t];
    }
}

static void tile_scalar(const sek_rows *x, const sek_weights *w, float *y, int64_t ldy, int64_t tile) {
    const int64_t nb = w->k / w->blk, blk = w->blk, bstride = blk * SEK_TILE * w->bits / 8;
    for (int64_t r = 0; r < x->m; r++) {
        float acc_f[SEK_TILE] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *bp = w->b + (tile * nb + b) * bstride;
            const int8_t *a = x->qa + r * x->k + b * blk;
            int32_t acc[SEK_TILE] = {0};
            dot_scalar(w, bp, a, acc);
            const int64_t o = blk_off(w, tile, b);
            const float sa = x->sa[r * nb + b], sasum = x->sasum[r * nb + b];
            for (int c = 0; c < SEK_TILE; c++) {
                const float s = w->s[o + c], zs = w->zs ? w->zs[o + c] : (float)w->z[o + c] * s;
                acc_f[c] = fmaf((float)acc[c], s * sa, acc_f[c]);
                acc_f[c] = fmaf(-zs, sasum, acc_f[c]);
            }
        }
        memcpy(y + r * ldy + tile * SEK_TILE, acc_f, sizeof acc_f);
    }
}

/* Two-level scales, the reference: per (row, column, super-block) the exact integers
 *     I = sum_j sc_j * dot_j        M = sum_j m_j * bsum_j      (m = mn, or sc where there are no mins)
 * then in fp32, super-block after super-block:
 *     with mins:    y = fma(I, d * sa, y);   y = fma(-M, dmin * sa, y)
 *     without:      y = fma(I - zconst * M, d * sa, y)
 * d and dmin converted from fp16 exactly, sa the row's activation scale for the super-block. */
static void tile_sb_scalar(const sek_rows *x, const sek_weights *w, float *y, int64_t ldy, int64_t tile) {
    const int64_t nb = w->k / w->blk, blk = w->blk, bstride = blk * SEK_TILE * w->bits / 8;
    const int64_t per = w->sblk / blk, nsb = w->k / w->sblk;
    for (int64_t r = 0; r < x->m; r++) {
        float yf[SEK_TILE] = {0};
        for (int64_t sb = 0; sb < nsb; sb++) {
            int32_t i1[SEK_TILE] = {0}, mm[SEK_TILE] = {0};
            for (int64_t b = sb * per; b < (sb + 1) * per; b++) {
                int32_t acc[SEK_TILE] = {0};
                dot_scalar(w, w->b + (tile * nb + b) * bstride, x->qa + r * x->k + b * blk, acc);
                const int64_t o = blk_off(w, tile, b);
                const int32_t bs = x->bsum[r * nb + b];
                for (int c = 0; c < SEK_TILE; c++) {
                    i1[c] += acc[c] * w->sc[o + c];
                    mm[c] += (w->mn ? w->mn[o + c] : w->sc[o + c]) * bs;
                }
            }
            const float sa = x->sa[r * nsb + sb];
            const int64_t so = (tile * nsb + sb) * SEK_TILE;
            for (int c = 0; c < SEK_TILE; c++) {
                const float ds = half_to_float(w->d[so + c]) * sa;
                if (w->mn) {
                    yf[c] = fmaf((float)i1[c], ds, yf[c]);
                    yf[c] = fmaf(-(float)mm[c], half_to_float(w->dmin[so + c]) * sa, yf[c]);
                } else {
                    yf[c] = fmaf((float)(i1[c] - w->zconst * mm[c]), ds, yf[c]);
                }
            }
        }
        memcpy(y + r * ldy + tile * SEK_TILE, yf, sizeof yf);
    }
}

/* ---------------------------------------------------------------- AVX512-VNNI */

#ifdef SEK_HAVE_VNNI512
/* A tile's block scales and zero-point products (as tile_scalar forms them). */
static inline __attribute__((always_inline)) void scales512(const sek_weights *w, int64_t tile, int64_t b, __m512 *s,
                                                           __m512 *zs) {
    const int64_t o = blk_off(w, tile, b);
    *s = _mm512_loadu_ps(w->s + o);
    *zs = w->zs ? _mm512_loadu_ps(w->zs + o)
                : _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w->z + o)))), *s);
}

/* acc[r][t] += the exact integer dot products of block b for R rows (qa, row stride K) and NT tiles from `tile`:
 * each 64-byte chunk of weights unpacked once for every row. */
static inline __attribute__((always_inline)) void dots512(const sek_weights *w, const int8_t *qa, int64_t K, int64_t b,
                                                         const int R, int64_t tile, const int NT,
                                                         __m512i acc[SEK_RMAX][2]) {
    const int64_t nb = w->k / w->blk, blk = w->blk, bstride = blk * SEK_TILE * w->bits / 8;
    const __m512i mask = _mm512_set1_epi8(15);
    const uint8_t *bp[2] = {w->b + (tile * nb + b) * bstride, NT == 2 ? w->b + ((tile + 1) * nb + b) * bstride : NULL};
    /* past the end of its tile, each stream's prefetch goes on in the next strip's tile of the same place (with two
     * tiles side by side, the lines right after tile t are tile t + 1's first, read by this strip already, and the
     * next strip's second tile started cold: 3 KB of a 12 KB tile at K = 1536) */
    const int64_t skip = b * bstride + SEK_AHEAD >= nb * bstride ? (NT - 1) * nb * bstride : 0;
    SEK_UNROLL
    for (int t = 0; t < NT; t++) prefetch_block_skip(bp[t], bstride, skip);
    if (w->bits == 4) {
        for (int64_t j = 0; j < blk / 8; j++) {
            __m512i lo[2], hi[2];
            SEK_UNROLL
            for (int t = 0; t < NT; t++) {
                __m512i v = _mm512_loadu_si512(bp[t] + j * 64);
                lo[t] = _mm512_and_si512(v, mask);
                hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
            }
            SEK_UNROLL
            for (int r = 0; r < R; r++) {
                const int8_t *a = qa + r * K + b * blk + 8 * j;
                int32_t a0, a1;
                four_pair(a, &a0, &a1);
                const __m512i va0 = _mm512_set1_epi32(a0), va1 = _mm512_set1_epi32(a1);
                SEK_UNROLL
                for (int t = 0; t < NT; t++) {
                    acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], lo[t], va0);
                    acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], hi[t], va1);
                }
            }
        }
    } else if (w->bits == 6) {
        const __m512i m63 = _mm512_set1_epi8(63), m30 = _mm512_set1_epi8(0x30), m0c = _mm512_set1_epi8(0x0c),
                      m03 = _mm512_set1_epi8(0x03);
        for (int64_t h = 0; h < blk / 16; h++) {
            __m512i q[2][2], top[2]; /* per tile: two levels' vectors at a time, the fourth's top four bits */
            SEK_UNROLL
            for (int t = 0; t < NT; t++) {
                const __m512i x = _mm512_loadu_si512(bp[t] + 3 * h * 64), y = _mm512_loadu_si512(bp[t] + (3 * h + 1) * 64);
                q[t][0] = _mm512_and_si512(x, m63);
                q[t][1] = _mm512_and_si512(y, m63);
                top[t] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(x, 2), m30),
                                         _mm512_and_si512(_mm512_srli_epi16(y, 4), m0c));
            }
            SEK_UNROLL
            for (int half = 0; half < 2; half++) { /* k = 16h + 8 half + 0..7 */
                if (half) {
                    SEK_UNROLL
                    for (int t = 0; t < NT; t++) {
                        const __m512i z = _mm512_loadu_si512(bp[t] + (3 * h + 2) * 64);
                        q[t][0] = _mm512_and_si512(z, m63);
                        q[t][1] = _mm512_or_si512(top[t], _mm512_and_si512(_mm512_srli_epi16(z, 6), m03));
                    }
                }
                SEK_UNROLL
                for (int r = 0; r < R; r++) {
                    const int8_t *a = qa + r * K + b * blk + 16 * h + 8 * half;
                    int32_t a0, a1;
                    four_pair(a, &a0, &a1);
                    const __m512i va0 = _mm512_set1_epi32(a0), va1 = _mm512_set1_epi32(a1);
                    SEK_UNROLL
                    for (int t = 0; t < NT; t++) {
                        acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], q[t][0], va0);
                        acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], q[t][1], va1);
                    }
                }
            }
        }
    } else {
        for (int64_t g = 0; g < blk / 4; g++) {
            __m512i v[2];
            SEK_UNROLL
            for (int t = 0; t < NT; t++) v[t] = _mm512_loadu_si512(bp[t] + g * 64);
            SEK_UNROLL
            for (int r = 0; r < R; r++) {
                int32_t a0;
                memcpy(&a0, qa + r * K + b * blk + 4 * g, 4);
                const __m512i va = _mm512_set1_epi32(a0);
                SEK_UNROLL
                for (int t = 0; t < NT; t++) acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], v[t], va);
            }
        }
    }
}

/* R rows x NT tiles (1 or 2) of 16 columns; R and NT are constants at every call site (inlined per value). */
static inline __attribute__((always_inline)) void strip_vnni512(const sek_rows *x, const sek_weights *w, float *y,
                                                               int64_t ldy, int64_t r0, const int R, int64_t tile,
                                                               const int NT) {
    const int64_t nb = w->k / w->blk, K = x->k;
    const int8_t *qa = x->qa + r0 * K;
    const float *sa = x->sa + r0 * nb, *sasum = x->sasum + r0 * nb;
    /* the fp32 sums live in memory between blocks: the hot loop keeps only R x NT int32 accumulators, 2 x NT
     * unpacked chunks and 2 broadcasts in the 32 zmm registers (R = 10, NT = 2: 26) */
    float yv[SEK_RMAX][2][SEK_TILE] __attribute__((aligned(64)));
    memset(yv, 0, sizeof yv);
    for (int64_t b = 0; b < nb; b++) {
        __m512i acc[SEK_RMAX][2];
        SEK_UNROLL
        for (int r = 0; r < R; r++)
            SEK_UNROLL
            for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_si512();
        dots512(w, qa, K, b, R, tile, NT, acc);
        SEK_UNROLL
        for (int t = 0; t < NT; t++) {
            __m512 s, zs;
            scales512(w, tile + t, b, &s, &zs);
            SEK_UNROLL
            for (int r = 0; r < R; r++) {
                const __m512 ss = _mm512_mul_ps(s, _mm512_set1_ps(sa[r * nb + b]));
                __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][t]), ss, _mm512_load_ps(yv[r][t]));
                _mm512_store_ps(yv[r][t], _mm512_fnmadd_ps(zs, _mm512_set1_ps(sasum[r * nb + b]), v));
            }
        }
    }
    SEK_UNROLL
    for (int r = 0; r < R; r++)
        SEK_UNROLL
        for (int t = 0; t < NT; t++) memcpy(y + (r0 + r) * ldy + (tile + t) * SEK_TILE, yv[r][t], sizeof yv[r][t]);
}

/* Two-level scales: tile_sb_scalar's arithmetic for R rows (R <= SEK_RMAX_SB) of NT tiles (1 or 2): the integer
 * sums I and M in registers, each block's dot products fed to I through one vpmulld. */
#define SEK_RMAX_SB 5 /* R x NT x (dot products + I) + unpacked chunks + broadcasts <= 32 zmm registers */
/* Steps of 7 to 10 rows take one tile at a time, all their rows in one pass (10 x (dot products + I) + 3 chunks +
 * 2 broadcasts <= 32; the mins' sums M take the dot products' registers after them), so a chunk is unpacked once
 * rather than once per pass of 5: Qwen 1.5B's Q6_K head made a 9-row step 7 % cheaper (one process, the two builds
 * alternated). At 6 rows two tiles a pass (5 rows, then 1 from L2) stayed faster. */
static inline __attribute__((always_inline)) void strip_sb_vnni512(const sek_rows *x, const sek_weights *w, float *y,
                                                                  int64_t ldy, int64_t r0, const int R, int64_t tile,
                                                                  const int NT) {
    const int64_t nb = w->k / w->blk, per = w->sblk / w->blk, nsb = w->k / w->sblk, K = x->k;
    const int8_t *qa = x->qa + r0 * K;
    const int16_t *bsum = x->bsum + r0 * nb;
    const float *sa = x->sa + r0 * nsb;
    static const int16_t interleave[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                           8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i idx = _mm512_loadu_si512(interleave);
    const int8_t *mv = w->mn ? w->mn : w->sc;
    float yv[SEK_RMAX][2][SEK_TILE] __attribute__((aligned(64)));
    memset(yv, 0, sizeof yv);
    for (int64_t sb = 0; sb < nsb; sb++) {
        __m512i i1[SEK_RMAX][2], mm[SEK_RMAX][2];
        SEK_UNROLL
        for (int r = 0; r < R; r++)
            SEK_UNROLL
            for (int t = 0; t < NT; t++) i1[r][t] = mm[r][t] = _mm512_setzero_si512();
        for (int64_t b = sb * per; b < (sb + 1) * per; b++) {
            __m512i acc[SEK_RMAX][2];
            SEK_UNROLL
            for (int r = 0; r < R; r++)
                SEK_UNROLL
                for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_si512();
            dots512(w, qa, K, b, R, tile, NT, acc);
            SEK_UNROLL
            for (int t = 0; t < NT; t++) {
                const __m512i scv =
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w->sc + blk_off(w, tile + t, b))));
                SEK_UNROLL
                for (int r = 0; r < R; r++) i1[r][t] = _mm512_add_epi32(i1[r][t], _mm512_mullo_epi32(acc[r][t], scv));
            }
        }
        for (int64_t b = sb * per; b < (sb + 1) * per; b += 2) { /* M: blocks in pairs, one vpmaddwd per pair */
            SEK_UNROLL
            for (int t = 0; t < NT; t++) {
                const __m256i m0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(mv + blk_off(w, tile + t, b))));
                const __m256i m1 =
                    _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(mv + blk_off(w, tile + t, b + 1))));
                const __m512i m2 = _mm512_permutex2var_epi16(_mm512_castsi256_si512(m0), idx, _mm512_castsi256_si512(m1));
                SEK_UNROLL
                for (int r = 0; r < R; r++) {
                    const uint32_t pair =
                        (uint32_t)(uint16_t)bsum[r * nb + b] | (uint32_t)(uint16_t)bsum[r * nb + b + 1] << 16;
                    mm[r][t] = _mm512_add_epi32(mm[r][t], _mm512_madd_epi16(m2, _mm512_set1_epi32((int32_t)pair)));
                }
            }
        }
        SEK_UNROLL
        for (int t = 0; t < NT; t++) {
            const int64_t so = ((tile + t) * nsb + sb) * SEK_TILE;
            const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->d + so)));
            const __m512 dmv = w->mn ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->dmin + so))) : dv;
            const __m512i zc = _mm512_set1_epi32(w->zconst);
            SEK_UNROLL
            for (int r = 0; r < R; r++) {
                const __m512 sar = _mm512_set1_ps(sa[r * nsb + sb]);
                __m512 v = _mm512_load_ps(yv[r][t]);
                if (w->mn) {
                    v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1[r][t]), _mm512_mul_ps(dv, sar), v);
                    v = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mm[r][t]), _mm512_mul_ps(dmv, sar), v);
                } else {
                    const __m512i acc = _mm512_sub_epi32(i1[r][t], _mm512_mullo_epi32(mm[r][t], zc));
                    v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(dv, sar), v);
                }
                _mm512_store_ps(yv[r][t], v);
            }
        }
    }
    SEK_UNROLL
    for (int r = 0; r < R; r++)
        SEK_UNROLL
        for (int t = 0; t < NT; t++) memcpy(y + (r0 + r) * ldy + (tile + t) * SEK_TILE, yv[r][t], sizeof yv[r][t]);
}

#define SEK_PAIR_K 4096 /* rows of weights at least this long are read two tiles at a time whatever the rows */
#define SEK_PAIR_ROWS 6 /* and so are steps of more rows than this (more than SEK_PAIR_ROWS_SB: two-level scales) */
#define SEK_PAIR_ROWS_SB 2
/* Tiles [t0, t1) in pairs (or one at a time: see `single`), the rows in passes of up to SEK_RMAX (SEK_RPASS past
 * SEK_ONE_PASS rows; SEK_RMAX_SB with two-level scales, except a step of 7 to 10 rows: one tile, every row). Past
 * SEK_RMAX rows (a prefill chunk) two-level scales take passes of SEK_RMAX_SB over tile pairs: a 64-row Q6_K product
 * 0.78-0.89x the time of 10-row passes over single tiles, Q4_K 0.91-0.96x (one thread, in cache, Zen 5). */
static void tiles_vnni512(const sek_rows *x, const sek_weights *w, float *y, int64_t ldy, int64_t t0, int64_t t1) {
    const int sb = w->sc != NULL, wide_sb = sb && x->m > SEK_RMAX_SB + 1 && x->m <= SEK_RMAX;
    const int rmax = sb ? (wide_sb ? SEK_RMAX : SEK_RMAX_SB) : x->m <= SEK_ONE_PASS ? SEK_RMAX : SEK_RPASS;
    /* Two tiles side by side share each activation broadcast, which pays at many rows and along long rows of
     * weights; a short row of weights (K < SEK_PAIR_K) read by few rows goes faster as one stream, a tile at a time
     * (one thread, out of cache, K = 896 / 1536: 8-25 % faster at 1-5 rows, the Q6_K head's blocks 20-23 % at 1-2
     * rows and Q4_K's 12-15 %, Q4_K 16 % slower at 5; K = 4864 / 8960: 3-13 % slower). The same integer sums and
     * fp32 operations per column either way: the bits do not change. */
    const int single = w->k < SEK_PAIR_K && x->m <= (sb ? SEK_PAIR_ROWS_SB : SEK_PAIR_ROWS);
    for (int64_t t = t0; t < t1; t += wide_sb || single ? 1 : 2) {
        const int nt = t1 - t >= 2 && !wide_sb && !single ? 2 : 1;
        for (int64_t r0 = 0; r0 < x->m; r0 += rmax) {
            const int R = x->m - r0 < rmax ? (int)(x->m - r0) : rmax;
#define SEK_CASE(RR)                                                                                       \
    case RR:                                                                                               \
        if (sb && RR <= SEK_RMAX_SB && nt == 2) {                                                          \
            const int rs = RR <= SEK_RMAX_SB ? RR : SEK_RMAX_SB; /* (constant: other values never run) */ \
            strip_sb_vnni512(x, w, y, ldy, r0, rs, t, 2);                                                  \
        } else if (sb) {                                                                                   \
            strip_sb_vnni512(x, w, y, ldy, r0, RR, t, 1);                                                  \
        } else if (!sb) {                                                                                  \
            if (nt == 2)                                                                                   \
                strip_vnni512(x, w, y, ldy, r0, RR, t, 2);                                                 \
            else                                                                                           \
                strip_vnni512(x, w, y, ldy, r0, RR, t, 1);                                                 \
        }                                                                                                  \
        break;
            switch (R) {
                SEK_CASE(1) SEK_CASE(2) SEK_CASE(3) SEK_CASE(4) SEK_CASE(5) SEK_CASE(6) SEK_CASE(7) SEK_CASE(8)
                SEK_CASE(9) SEK_CASE(10)
            }
#undef SEK_CASE
        }
    }
}
#endif

/* ---------------------------------------------------------------- AVX2 (+FMA), and AVX-VNNI */
/* One code for both: `vnni` (a constant at every call) picks how four u8 x s8 products are added into an int32
 * lane: vpdpbusd (AVX-VNNI, on ymm without AVX-512: Alder Lake and its N-series, Zen 5), or vpmaddubsw + vpmaddwd
 * (AVX2). They give the same integers here (no pair sum can saturate, below), so the two paths are bitwise equal. */

#ifdef SEK_HAVE_AVX2
/* Rows per pass, every format (a 5-token verify in one pass). 5 rather than 4: a Qwen2.5-Coder-1.5B T = 5 step on
 * Q4_K runs 4-7 % faster, built for Haswell on a Zen 5, and a Q6_K matrix's 5 rows 12-14 % (llvm-mca: 10 % fewer
 * cycles on Haswell and Zen 2, 16 % on Skylake, 1 % on Zen 3; 8-bit -2..+4 %). Five rows' sums do not all fit 16
 * registers beside 6- and 8-bit levels: the compiler keeps some on the stack, off the multiply ports. */
#define SEK_R2 5
#ifdef SEK_HAVE_AVXVNNI
static inline __attribute__((always_inline)) __m256i dp256(__m256i acc, __m256i u, __m256i s) {
    return _mm256_dpbusd_avx_epi32(acc, u, s);
}
#else /* never called in a build without AVX-VNNI (sek_isa_mask leaves it out); the same integers, for the compiler */
static inline __attribute__((always_inline)) __m256i dp256(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif
/* acc + u0.s0 + u1.s1 (4-byte dot products per lane). The two products go into a fresh sum added to acc last:
 * chained into acc, each chunk would wait for the previous chunk's two vpdpbusd latencies (measured 1.1-1.3x slower
 * at 4-9 rows with 16 registers). */
static inline __attribute__((always_inline)) __m256i dp2_256(__m256i acc, __m256i u0, __m256i s0, __m256i u1,
                                                             __m256i s1) {
    return _mm256_add_epi32(acc, dp256(dp256(_mm256_setzero_si256(), u0, s0), u1, s1));
}
/* Columns 8h..8h+7 of a tile's block scales and zero-point products (as tile_scalar forms them). */
static inline __attribute__((always_inline)) void scales256(const sek_weights *w, int64_t tile, int64_t b, int h,
                                                           __m256 *s, __m256 *zs) {
    const int64_t o = blk_off(w, tile, b) + 8 * h;
    *s = _mm256_loadu_ps(w->s + o);
    *zs = w->zs ? _mm256_loadu_ps(w->zs + o)
                : _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w->z + o)))), *s);
}
/* acc[r][h] += the exact integer dot products of block b for R rows (qa, row stride K), columns 8h..8h+7 of a
 * tile. maddubs (u8 x s8 pairs -> s16) cannot saturate here: 4-bit levels give pairs <= 2 * 15 * 127, 6-bit ones
 * 2 * 63 * 127 (two such pairs added: 4 * 63 * 127 < 2^15), and 8-bit levels are split into their two nibbles. */
static inline __attribute__((always_inline)) void dots256(const sek_weights *w, const int8_t *qa, int64_t K, int64_t b,
                                                         const int R, int64_t tile, __m256i acc[SEK_R2][2],
                                                         const int vnni) {
    const int64_t nb = w->k / w->blk, blk = w->blk, bstride = blk * SEK_TILE * w->bits / 8;
    const __m256i mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const uint8_t *bp = w->b + (tile * nb + b) * bstride;
    prefetch_block(bp, bstride);
    if (w->bits == 4 && !vnni) {
        /* AVX2 without VNNI: the pair sums of vpmaddubsw added in int16 over up to 4 chunks before one vpmaddwd widens
         * them. A pair sum is at most 2 * 15 * 127 = 3810, a chunk's two 7620, four chunks 30480 < 2^15: the integers
         * are those of a widening per chunk. Multiplies per row, chunk and tile half: 2.25, not 3 -- the bound on
         * AVX2-only cores, whose one or two vector multiply ports run vpmaddubsw and vpmaddwd alike. At 5 rows the
         * int16 sums do not all fit the 16 registers; they go to the stack once per chunk, off the multiply ports.
         * llvm-mca's models, cycles per chunk at rows 1 / 4 / 5, a widening per chunk (5 rows a tile half at a time)
         * -> this (tools/dev/kernel_mca.py; the widenings, once per 4 chunks, not counted): Haswell 9.1 / 26.1
         * / 32.2 -> 6.1 / 19.1 / 23.1, Skylake 6.1 / 17-18 / 22 -> 5.4 / 14.1 / 17.1, Zen 2 6.3 / 24.1 / 30.2 ->
         * 5.6 / 16.3 / 20.1, Zen 3 4.6 / 15.0 / 22 -> 4.1 / 13.5 / 17.9. A model, not a measurement of an AVX2-only
         * machine. On a Zen 5 (which takes the AVX512-VNNI path itself) this path measures the same as a widening per
         * chunk at 1-4 rows and 0-5 % slower at 5. */
        const int64_t nch = blk / 8, G = nch < 4 ? nch : 4;
        for (int64_t j0 = 0; j0 < nch; j0 += G) {
            __m256i s16[SEK_R2][2];
            SEK_UNROLL
            for (int r = 0; r < R; r++) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
            for (int64_t j = j0; j < j0 + G && j < nch; j++) {
                SEK_MCA_BEGIN("avx2_q4");
                __m256i lo[2], hi[2];
                SEK_UNROLL
                for (int h = 0; h < 2; h++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(bp + j * 64 + 32 * h));
                    lo[h] = _mm256_and_si256(v, mask);
                    hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                }
                SEK_UNROLL
                for (int r = 0; r < R; r++) {
                    int32_t a0, a1;
                    four_pair(qa + r * K + b * blk + 8 * j, &a0, &a1);
                    const __m256i va0 = _mm256_set1_epi32(a0), va1 = _mm256_set1_epi32(a1);
                    SEK_UNROLL
                    for (int h = 0; h < 2; h++)
                        s16[r][h] = _mm256_add_epi16(s16[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], va0),
                                                                                 _mm256_maddubs_epi16(hi[h], va1)));
                }
                SEK_MCA_END("avx2_q4");
            }
            SEK_UNROLL
            for (int r = 0; r < R; r++)
                SEK_UNROLL
                for (int h = 0; h < 2; h++) acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(s16[r][h], ones));
        }
    } else if (w->bits == 4) { /* AVX-VNNI: both halves at once, a row's broadcasts shared */
        for (int64_t j = 0; j < blk / 8; j++) {
            __m256i lo[2], hi[2];
            SEK_UNROLL
            for (int h = 0; h < 2; h++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(bp + j * 64 + 32 * h));
                lo[h] = _mm256_and_si256(v, mask);
                hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            }
            SEK_UNROLL
            for (int r = 0; r < R; r++) {
                const int8_t *a = qa + r * K + b * blk + 8 * j;
                int32_t a0, a1;
                four_pair(a, &a0, &a1);
                const __m256i va0 = _mm256_set1_epi32(a0), va1 = _mm256_set1_epi32(a1);
                SEK_UNROLL
                for (int h = 0; h < 2; h++) acc[r][h] = dp2_256(acc[r][h], lo[h], va0, hi[h], va1);
            }
        }
    } else if (w->bits == 6) {
        const __m256i m63 = _mm256_set1_epi8(63), m30 = _mm256_set1_epi8(0x30), m0c = _mm256_set1_epi8(0x0c),
                      m03 = _mm256_set1_epi8(0x03);
        for (int64_t hh = 0; hh < blk / 16; hh++) {
            SEK_UNROLL
            for (int half = 0; half < 2; half++) { /* k = 16hh + 8 half + 0..7 */
                __m256i lo[2], hi[2];
                SEK_UNROLL
                for (int h = 0; h < 2; h++) {
                    const uint8_t *c0 = bp + 3 * hh * 64 + 32 * h;
                    const __m256i x = _mm256_loadu_si256((const __m256i *)c0), y = _mm256_loadu_si256((const __m256i *)(c0 + 64));
                    if (!half) {
                        lo[h] = _mm256_and_si256(x, m63);
                        hi[h] = _mm256_and_si256(y, m63);
                    } else {
                        const __m256i z = _mm256_loadu_si256((const __m256i *)(c0 + 128));
                        lo[h] = _mm256_and_si256(z, m63);
                        hi[h] = _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(x, 2), m30),
                                                                _mm256_and_si256(_mm256_srli_epi16(y, 4), m0c)),
                                                _mm256_and_si256(_mm256_srli_epi16(z, 6), m03));
                    }
                }
                SEK_UNROLL
                for (int r = 0; r < R; r++) {
                    const int8_t *a = qa + r * K + b * blk + 16 * hh + 8 * half;
                    int32_t a0, a1;
                    four_pair(a, &a0, &a1);
                    const __m256i va0 = _mm256_set1_epi32(a0), va1 = _mm256_set1_epi32(a1);
                    SEK_UNROLL
                    for (int h = 0; h < 2; h++) { /* 6-bit levels: 4 * 63 * 127 < 2^15, no saturation */
                        if (vnni) {
                            acc[r][h] = dp2_256(acc[r][h], lo[h], va0, hi[h], va1);
                            continue;
                        }
                        __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], va0), _mm256_maddubs_epi16(hi[h], va1));
                        acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(p, ones));
                    }
                }
            }
        }
    } else {
        for (int64_t g = 0; g < blk / 4; g++) {
            __m256i lo[2], hi[2];
            SEK_UNROLL
            for (int h = 0; h < 2; h++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(bp + g * 64 + 32 * h));
                lo[h] = vnni ? v : _mm256_and_si256(v, mask); /* vpdpbusd takes whole bytes: 4 * 255 * 127 < 2^31 */
                hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            }
            SEK_UNROLL
            for (int r = 0; r < R; r++) {
                int32_t a0;
                memcpy(&a0, qa + r * K + b * blk + 4 * g, 4);
                const __m256i va = _mm256_set1_epi32(a0);
                SEK_UNROLL
                for (int h = 0; h < 2; h++) {
                    if (vnni) {
                        acc[r][h] = dp256(acc[r][h], lo[h], va);
                        continue;
                    }
                    __m256i dlo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo[h], va), ones);
                    __m256i dhi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi[h], va), ones);
                    acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_add_epi32(dlo, _mm256_slli_epi32(dhi, 4)));
                }
            }
        }
    }
}

/* AVX2 without VNNI, SEK_HALF_FROM rows or more: the weights stay in registers and the rows stream past them. Two
 * chunks of a tile, both 8-column halves (16 values of k for 4-bit levels and for 6-bit ones), are unpacked once into
 * 8 registers; then each row in turn broadcasts its activations once for both halves, takes its dot products with
 * them into one int16 sum per half and adds those, widened, to its int32 sums in memory. Nothing a row holds
 * outlives its own few instructions, so any number of rows runs in one pass without spilling, and no chunk is
 * unpacked twice -- where whole tiles in register-resident passes of SEK_R2 rows unpacked every chunk again from the
 * 6th row on and kept five rows' sums on the stack. A row's vector work per chunk is then what the multiplies need
 * and little more: 2 broadcasts, 4 vpmaddubsw, 1 vpmaddwd and 4 adds (tools/dev/kernel_rows.c). */
#define SEK_HALF_FROM 2 /* from two rows on, faster than register passes of whole tiles (tools/dev/kernel_rows.c) */
#define SEK_RH 16 /* rows per pass (a 64-row prefill chunk: 4 passes), for the stack's per-row sums */
/* The int16 pairs (v, v) in each 32-bit lane, for the 8 int8 values at p: a vpmaddwd against them multiplies a
 * column's two pair sums by its own v and adds them, an exact int32. */
static inline __attribute__((always_inline)) __m256i pairs256(const int8_t *p) {
    const __m128i x = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_set_m128i(_mm_unpackhi_epi16(x, x), _mm_unpacklo_epi16(x, x));
}
/* G 4-bit chunks from chunk j0 of one tile (bp: its block's first chunk), both 8-column halves, against m rows. A
 * row's two broadcasts of each chunk's activations serve both halves, and its products go into one int16 sum per
 * half. `carry` (a constant) says where that sum goes: 0, out[r * ostride + 8h + 0..7] += mul[h] * the sum, widened
 * in vpmaddwd; 1, into c16[r][h] for the next chunks' call; 2, added to c16[r][h] and then widened into out. A
 * row's int16 sum over 4 chunks is at most 4 * 2 * 2 * 15 * 127 = 30480 < 2^15: the integers are those of a
 * widening per chunk, with one vpmaddwd per half every 4 chunks rather than every 2. */
static inline __attribute__((always_inline)) void q4_rows256(const uint8_t *bp, int64_t j0, const int G,
                                                            const int8_t *ab, int64_t K, int64_t m, const __m256i *mul,
                                                            int32_t *out, int64_t ostride, __m256i (*c16)[2],
                                                            const int carry) {
    const __m256i mask = _mm256_set1_epi8(15);
    __m256i lo[2][2], hi[2][2];
    SEK_UNROLL
    for (int g = 0; g < G; g++)
        SEK_UNROLL
        for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(bp + (j0 + g) * 64 + 32 * h));
            lo[g][h] = _mm256_and_si256(v, mask);
            hi[g][h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        }
    const __m256i mul0 = mul[0], mul1 = mul[1];
    for (int64_t r = 0; r < m; r++) {
        SEK_MCA_BEGIN("avx2_q4_row");
        const int8_t *a = ab + r * K + 8 * j0;
        __m256i s0 = _mm256_setzero_si256(), s1 = s0;
        SEK_UNROLL
        for (int g = 0; g < G; g++) {
            int32_t a0, a1;
            four_pair(a + 8 * g, &a0, &a1);
            const __m256i va0 = _mm256_set1_epi32(a0), va1 = _mm256_set1_epi32(a1);
            const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[g][0], va0), _mm256_maddubs_epi16(hi[g][0], va1));
            const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[g][1], va0), _mm256_maddubs_epi16(hi[g][1], va1));
            s0 = g ? _mm256_add_epi16(s0, p0) : p0;
            s1 = g ? _mm256_add_epi16(s1, p1) : p1;
        }
        if (carry == 1) {
            c16[r][0] = s0;
            c16[r][1] = s1;
            SEK_MCA_END("avx2_q4_row");
            continue;
        }
        if (carry == 2) {
            s0 = _mm256_add_epi16(s0, c16[r][0]);
            s1 = _mm256_add_epi16(s1, c16[r][1]);
        }
        __m256i *o = (__m256i *)(out + r * ostride);
        _mm256_storeu_si256(o, _mm256_add_epi32(_mm256_loadu_si256(o), _mm256_madd_epi16(s0, mul0)));
        _mm256_storeu_si256(o + 1, _mm256_add_epi32(_mm256_loadu_si256(o + 1), _mm256_madd_epi16(s1, mul1)));
        SEK_MCA_END("avx2_q4_row");
    }
}
/* out[r * ostride + 0..15] += mul[h] * the exact integer dot products of block b for m rows (qa, row stride K) with
 * a tile's two 8-column halves h, 4- or 6-bit levels; mul: the columns' integer block scales as pairs256 gives them
 * (two-level scales) or ones. The integers are dots256's -- the same pair sums, int16 sums of at most 2 chunks of
 * 4-bit levels, one 6-bit pair sum of two chunks at a time -- times the scale in vpmaddwd rather than in a vpmulld
 * after it: a column's sum over 16 values of 6-bit levels is at most 16 * 63 * 127 and over 16 of 4-bit ones
 * 16 * 15 * 127, times |sc| <= 128 far below 2^31, and so the same int32. */
static inline __attribute__((always_inline)) void dots_rows256(const sek_weights *w, const int8_t *qa, int64_t K,
                                                              int64_t b, int64_t m, int64_t tile, const __m256i *mul,
                                                              int32_t *out, int64_t ostride) {
    const int64_t nb = w->k / w->blk, blk = w->blk, bstride = blk * SEK_TILE * w->bits / 8;
    const uint8_t *bp = w->b + (tile * nb + b) * bstride;
    const int8_t *ab = qa + b * blk;
    if (w->bits == 4) {
        __m256i c16[SEK_RH][2]; /* blk % 16 == 0: chunks in fours, then a last two */
        int64_t j0 = 0;
        for (; j0 + 4 <= blk / 8; j0 += 4) {
            q4_rows256(bp, j0, 2, ab, K, m, mul, out, ostride, c16, 1);
            q4_rows256(bp, j0 + 2, 2, ab, K, m, mul, out, ostride, c16, 2);
        }
        if (j0 < blk / 8) q4_rows256(bp, j0, 2, ab, K, m, mul, out, ostride, c16, 0);
        return;
    }
    const __m256i m63 = _mm256_set1_epi8(63), m30 = _mm256_set1_epi8(0x30), m0c = _mm256_set1_epi8(0x0c),
                  m03 = _mm256_set1_epi8(0x03);
    const __m256i mul0 = mul[0], mul1 = mul[1];
    for (int64_t hh = 0; hh < blk / 16; hh++) { /* 6-bit */
        __m256i lo0[2], hi0[2], lo1[2], hi1[2];
        SEK_UNROLL
        for (int h = 0; h < 2; h++) {
            const uint8_t *c0 = bp + 3 * hh * 64 + 32 * h;
            const __m256i xx = _mm256_loadu_si256((const __m256i *)c0), yy = _mm256_loadu_si256((const __m256i *)(c0 + 64)),
                          zz = _mm256_loadu_si256((const __m256i *)(c0 + 128));
            lo0[h] = _mm256_and_si256(xx, m63);
            hi0[h] = _mm256_and_si256(yy, m63);
            lo1[h] = _mm256_and_si256(zz, m63);
            hi1[h] = _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(xx, 2), m30),
                                                     _mm256_and_si256(_mm256_srli_epi16(yy, 4), m0c)),
                                     _mm256_and_si256(_mm256_srli_epi16(zz, 6), m03));
        }
        for (int64_t r = 0; r < m; r++) {
            SEK_MCA_BEGIN("avx2_q6_row");
            const int8_t *a = ab + r * K + 16 * hh;
            int32_t a0, a1, a2, a3;
            four_pair(a, &a0, &a1);
            four_pair(a + 8, &a2, &a3);
            const __m256i v0 = _mm256_set1_epi32(a0), v1 = _mm256_set1_epi32(a1), v2 = _mm256_set1_epi32(a2),
                          v3 = _mm256_set1_epi32(a3);
            __m256i *o = (__m256i *)(out + r * ostride);
            const __m256i p00 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0[0], v0), _mm256_maddubs_epi16(hi0[0], v1));
            const __m256i p10 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1[0], v2), _mm256_maddubs_epi16(hi1[0], v3));
            _mm256_storeu_si256(o, _mm256_add_epi32(_mm256_loadu_si256(o), _mm256_add_epi32(_mm256_madd_epi16(p00, mul0),
                                                                                             _mm256_madd_epi16(p10, mul0))));
            const __m256i p01 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0[1], v0), _mm256_maddubs_epi16(hi0[1], v1));
            const __m256i p11 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1[1], v2), _mm256_maddubs_epi16(hi1[1], v3));
            _mm256_storeu_si256(o + 1, _mm256_add_epi32(_mm256_loadu_si256(o + 1),
                                                        _mm256_add_epi32(_mm256_madd_epi16(p01, mul1),
                                                                         _mm256_madd_epi16(p11, mul1))));
            SEK_MCA_END("avx2_q6_row");
        }
    }
}

/* R rows x one tile (two 8-column halves), R a constant: the rows' sums in registers (dots256). */
static inline __attribute__((always_inline)) void tile_avx2(const sek_rows *x, const sek_weights *w, float *y,
                                                           int64_t ldy, int64_t r0, const int R, int64_t tile,
                                                           const int vnni) {
    const int64_t nb = w->k / w->blk, K = x->k;
    const int8_t *qa = x->qa + r0 * K;
    const float *sa = x->sa + r0 * nb, *sasum = x->sasum + r0 * nb;
    __m256 yv[SEK_R2][2];
    SEK_UNROLL
    for (int r = 0; r < R; r++) yv[r][0] = yv[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i acc[SEK_R2][2];
        SEK_UNROLL
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        dots256(w, qa, K, b, R, tile, acc, vnni);
        SEK_UNROLL
        for (int h = 0; h < 2; h++) {
            __m256 s, zs;
            scales256(w, tile, b, h, &s, &zs);
            SEK_UNROLL
            for (int r = 0; r < R; r++) {
                const __m256 ss = _mm256_mul_ps(s, _mm256_set1_ps(sa[r * nb + b]));
                yv[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), ss, yv[r][h]);
                yv[r][h] = _mm256_fnmadd_ps(zs, _mm256_set1_ps(sasum[r * nb + b]), yv[r][h]);
            }
        }
    }
    SEK_UNROLL
    for (int r = 0; r < R; r++)
        SEK_UNROLL
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + (r0 + r) * ldy + tile * SEK_TILE + 8 * h, yv[r][h]);
}

/* m rows (up to SEK_RH, a variable) x one tile, the rows streamed past the weights (dots_rows256): the integer sums
 * and the fp32 results in memory, and each block's epilogue a loop over the rows -- tile_avx2's operations, row by
 * row. */
static __attribute__((noinline)) void tile_rows_avx2(const sek_rows *x, const sek_weights *w, float *y, int64_t ldy,
                                                     int64_t r0, int64_t m, int64_t tile) {
    const int64_t nb = w->k / w->blk, K = x->k, bstride = w->blk * SEK_TILE * w->bits / 8;
    const int8_t *qa = x->qa + r0 * K;
    const float *sa = x->sa + r0 * nb, *sasum = x->sasum + r0 * nb;
    float yv[SEK_RH][SEK_TILE] __attribute__((aligned(32)));
    int32_t ih[SEK_RH][SEK_TILE] __attribute__((aligned(32)));
    memset(yv, 0, sizeof yv[0] * m);
    const __m256i ones[2] = {_mm256_set1_epi16(1), _mm256_set1_epi16(1)};
    for (int64_t b = 0; b < nb; b++) {
        memset(ih, 0, sizeof ih[0] * m);
        prefetch_block(w->b + (tile * nb + b) * bstride, bstride);
        dots_rows256(w, qa, K, b, m, tile, ones, ih[0], SEK_TILE);
        SEK_UNROLL
        for (int h = 0; h < 2; h++) {
            __m256 s, zs;
            scales256(w, tile, b, h, &s, &zs);
            for (int64_t r = 0; r < m; r++) {
                const __m256 ss = _mm256_mul_ps(s, _mm256_set1_ps(sa[r * nb + b]));
                __m256 v = _mm256_load_ps(yv[r] + 8 * h);
                v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256((const __m256i *)(ih[r] + 8 * h))), ss, v);
                _mm256_store_ps(yv[r] + 8 * h, _mm256_fnmadd_ps(zs, _mm256_set1_ps(sasum[r * nb + b]), v));
            }
        }
    }
    for (int64_t r = 0; r < m; r++) memcpy(y + (r0 + r) * ldy + tile * SEK_TILE, yv[r], sizeof yv[r]);
}

/* A super-block's float epilogue for R rows of one tile (tile_sb_scalar's order of fp32 operations), one 8-column
 * half at a time: M = sum_j m_j * bsum_j in vpmaddwd over pairs of blocks, then the row's two fused multiply-adds.
 * The rows are a loop whose body is a few instructions, whatever R is: copies unrolled for a row count that is only
 * known at run time cost a chain of compares per row and kept every row's M on the stack. */
static inline __attribute__((always_inline)) void sb_epilogue256(const sek_weights *w, int64_t tile, int64_t sb,
                                                                const int16_t *bsum, int64_t nb, const float *sa,
                                                                int64_t nsb, int64_t R, int32_t (*i1)[SEK_TILE],
                                                                float (*yv)[SEK_TILE]) {
    const int64_t per = w->sblk / w->blk, b0 = sb * per, npair = per / 2, so = (tile * nsb + sb) * SEK_TILE;
    const int8_t *mv = w->mn ? w->mn : w->sc;
    SEK_UNROLL
    for (int h = 0; h < 2; h++) {
        __m256i m2[SEK_BLK_MAX / 32]; /* blocks in pairs: one vpmaddwd per pair */
        for (int64_t q = 0; q < npair; q++) {
            const __m128i m0 = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(mv + blk_off(w, tile, b0 + 2 * q) + 8 * h)));
            const __m128i m1 = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(mv + blk_off(w, tile, b0 + 2 * q + 1) + 8 * h)));
            m2[q] = _mm256_set_m128i(_mm_unpackhi_epi16(m0, m1), _mm_unpacklo_epi16(m0, m1));
        }
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->d + so + 8 * h)));
        const __m256 dmv = w->mn ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->dmin + so + 8 * h))) : dv;
        const __m256i zc = _mm256_set1_epi32(w->zconst);
        for (int64_t r = 0; r < R; r++) {
            const int16_t *bs = bsum + r * nb + b0;
            __m256i mm = _mm256_setzero_si256();
            for (int64_t q = 0; q < npair; q++) { /* bsum_j, bsum_j+1 as one little-endian int32: the pair's lanes */
                int32_t pair;
                memcpy(&pair, bs + 2 * q, 4);
                mm = _mm256_add_epi32(mm, _mm256_madd_epi16(m2[q], _mm256_set1_epi32(pair)));
            }
            const __m256 sar = _mm256_set1_ps(sa[r * nsb + sb]);
            const __m256i ii = _mm256_load_si256((const __m256i *)(i1[r] + 8 * h));
            __m256 v = _mm256_load_ps(yv[r] + 8 * h);
            if (w->mn) {
                v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ii), _mm256_mul_ps(dv, sar), v);
                v = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mm), _mm256_mul_ps(dmv, sar), v);
            } else {
                const __m256i acc = _mm256_sub_epi32(ii, _mm256_mullo_epi32(mm, zc));
                v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(dv, sar), v);
            }
            _mm256_store_ps(yv[r] + 8 * h, v);
        }
    }
}

/* Two-level scales: tile_sb_scalar's arithmetic for R rows of one tile (the integer sums in memory: 16 registers). */
static inline __attribute__((always_inline)) void tile_sb_avx2(const sek_rows *x, const sek_weights *w, float *y,
                                                              int64_t ldy, int64_t r0, const int R, int64_t tile,
                                                              const int vnni, const int half) {
    const int64_t nb = w->k / w->blk, per = w->sblk / w->blk, nsb = w->k / w->sblk, K = x->k;
    const int8_t *qa = x->qa + r0 * K;
    const int16_t *bsum = x->bsum + r0 * nb;
    const float *sa = x->sa + r0 * nsb;
    float yv[SEK_RH][SEK_TILE] __attribute__((aligned(32)));
    int32_t i1[SEK_RH][SEK_TILE] __attribute__((aligned(32)));
    memset(yv, 0, sizeof yv[0] * R);
    for (int64_t sb = 0; sb < nsb; sb++) {
        memset(i1, 0, sizeof i1[0] * R);
        for (int64_t b = sb * per; b < (sb + 1) * per; b++) {
            if (half) { /* the block's scales in its products' vpmaddwd (dots_rows256) */
                const int64_t bstride = w->blk * SEK_TILE * w->bits / 8;
                prefetch_block(w->b + (tile * nb + b) * bstride, bstride);
                const __m256i mul[2] = {pairs256(w->sc + blk_off(w, tile, b)), pairs256(w->sc + blk_off(w, tile, b) + 8)};
                dots_rows256(w, qa, K, b, R, tile, mul, i1[0], SEK_TILE);
                continue;
            }
            __m256i acc[SEK_R2][2];
            SEK_UNROLL
            for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
            dots256(w, qa, K, b, R, tile, acc, vnni);
            SEK_UNROLL
            for (int h = 0; h < 2; h++) {
                const __m256i scv = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w->sc + blk_off(w, tile, b) + 8 * h)));
                SEK_UNROLL
                for (int r = 0; r < R; r++) {
                    __m256i *dst = (__m256i *)(i1[r] + 8 * h);
                    _mm256_store_si256(dst, _mm256_add_epi32(_mm256_load_si256(dst), _mm256_mullo_epi32(acc[r][h], scv)));
                }
            }
        }
        sb_epilogue256(w, tile, sb, bsum, nb, sa, nsb, R, i1, yv);
    }
    SEK_UNROLL
    for (int r = 0; r < R; r++) memcpy(y + (r0 + r) * ldy + tile * SEK_TILE, yv[r], sizeof yv[r]);
}

/* tile_sb_avx2 for m rows streamed past the weights (m a variable), compiled on its own: inlined into the tile loop
 * beside the register passes, its loops measured 4-11 % slower at 2-9 rows (register allocation across all of them). */
static __attribute__((noinline)) void tile_sb_rows_avx2(const sek_rows *x, const sek_weights *w, float *y, int64_t ldy,
                                                        int64_t r0, int64_t m, int64_t tile) {
    tile_sb_avx2(x, w, y, ldy, r0, (int)m, tile, 0, 1);
}

/* Tiles [t0, t1). The rows go in passes of up to SEK_R2 whole tiles, or, on AVX2 without VNNI from SEK_HALF_FROM rows
 * on (4- and 6-bit levels), in as few passes of up to SEK_RH rows streamed past each two chunks' levels as hold
 * them, of sizes that differ by one at most. */
static inline __attribute__((always_inline)) void tiles_avx2_any(const sek_rows *x, const sek_weights *w, float *y,
                                                                int64_t ldy, int64_t t0, int64_t t1, const int vnni) {
    const int sb = w->sc != NULL, half = !vnni && w->bits != 8 && x->m >= SEK_HALF_FROM;
    const int64_t passes = half ? (x->m + SEK_RH - 1) / SEK_RH : (x->m + SEK_R2 - 1) / SEK_R2;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t p = 0, r0 = 0; p < passes; p++) {
            const int R = half ? (int)(x->m / passes + (p < x->m % passes)) : (x->m - r0 < SEK_R2 ? (int)(x->m - r0) : SEK_R2);
#define SEK_CASE(RR, H)                                      \
    case RR:                                                 \
        if (sb)                                              \
            tile_sb_avx2(x, w, y, ldy, r0, RR, t, vnni, H);  \
        else                                                 \
            tile_avx2(x, w, y, ldy, r0, RR, t, vnni);        \
        break;
            if (half) { /* the rows' count a variable: their sums live in memory (dots_rows256) */
                if (sb)
                    tile_sb_rows_avx2(x, w, y, ldy, r0, R, t);
                else
                    tile_rows_avx2(x, w, y, ldy, r0, R, t);
            } else {
                switch (R) { SEK_CASE(1, 0) SEK_CASE(2, 0) SEK_CASE(3, 0) SEK_CASE(4, 0) SEK_CASE(5, 0) }
            }
#undef SEK_CASE
            r0 += R;
        }
}
static void tiles_avx2(const sek_rows *x, const sek_weights *w, float *y, int64_t ldy, int64_t t0, int64_t t1) {
    tiles_avx2_any(x, w, y, ldy, t0, t1, 0);
}
#ifdef SEK_HAVE_AVXVNNI
static void tiles_avxvnni(const sek_rows *x, const sek_weights *w, float *y, int64_t ldy, int64_t t0, int64_t t1) {
    tiles_avx2_any(x, w, y, ldy, t0, t1, 1);
}
#endif
#endif

/* Columns [16 * t0, 16 * t1) of Y (row stride ldy) for every row of x. isa: SEK_ISA_*; BEST picks the widest
 * path this build has. Returns 0, or -1 for an ISA this build does not have. */
int sek_gemm_tiles(const sek_rows *x, const sek_weights *w, float *y, int64_t ldy, int64_t t0, int64_t t1, int isa) {
    isa = best_isa(isa);
    const int sb = w->sc != NULL;
    switch (isa) {
#ifdef SEK_HAVE_VNNI512
    case SEK_ISA_VNNI512: tiles_vnni512(x, w, y, ldy, t0, t1); return 0;
#endif
#ifdef SEK_HAVE_AVX2
    case SEK_ISA_AVX2: tiles_avx2(x, w, y, ldy, t0, t1); return 0;
#endif
#ifdef SEK_HAVE_AVXVNNI
    case SEK_ISA_AVXVNNI: tiles_avxvnni(x, w, y, ldy, t0, t1); return 0;
#endif
#ifdef SEK_HAVE_NEON
    case SEK_ISA_NEON: sek_tiles_neon(x, w, y, ldy, t0, t1); return 0;
#endif
    case SEK_ISA_SCALAR:
        for (int64_t t = t0; t < t1; t++) (sb ? tile_sb_scalar : tile_scalar)(x, w, y, ldy, t);
        return 0;
    default: return -1;
    }
}

/* Shapes this kernel takes: 0, or -2. */
int sek_check(const sek_weights *w) {
    if (w->n <= 0 || w->n % SEK_TILE || w->blk < 16 || w->blk > SEK_BLK_MAX || w->blk % 16 || w->k <= 0 ||
        w->k % w->blk || (w->bits != 4 && w->bits != 6 && w->bits != 8))
        return -2;
    /* two-level scales: the bounds that keep the integer sums I and M exact in int32 (super-blocks <= 256 values,
     * levels <= 6 bits, int8 scales and mins, zconst <= 64), and blocks in pairs */
    if (w->sc && (!w->d || (!w->mn) != (!w->dmin) || (w->bits != 4 && w->bits != 6) || w->sblk > SEK_BLK_MAX ||
                  w->sblk % w->blk || (w->sblk / w->blk) % 2 || w->k % w->sblk || w->zconst < 0 || w->zconst > 64))
        return -2;
    if (!w->sc && w->bits == 6) return -2; /* 6-bit levels come with two-level scales (GGUF Q6_K) only */
    return 0;
}

/* The whole product in the calling thread (tests and tools): A [m][k] (k <= w->k, the rest zero-padded).
 * Returns 0, -1 (ISA), -2 (shapes), -3 (out of memory). */
__attribute__((visibility("default"))) int sek_gemm(const float *a, int64_t m, int64_t k, const sek_weights *w,
                                                     float *y, int isa) {
    const int64_t ablk = w->sc ? w->sblk : w->blk; /* activation blocks */
    if (sek_check(w) || k > w->k || w->k - k >= ablk) return -2;
    void *scratch = malloc(w->sc ? sek_sb_scratch_bytes(m, w->k, w->sblk, w->blk) : sek_scratch_bytes(m, w->k, w->blk));
    if (!scratch) return -3;
    sek_rows x;
    if (w->sc)
        sek_quantize_sb(a, m, k, k, w->k, w->sblk, w->blk, scratch, &x, isa);
    else
        sek_quantize(a, m, k, k, w->k, w->blk, scratch, &x, isa);
    int rc = sek_gemm_tiles(&x, w, y, w->n, 0, w->n / SEK_TILE, isa);
    free(scratch);
    return rc;
}
