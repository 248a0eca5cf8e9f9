/* specedge's row-invariant attention with an in-place KV cache (the ort-inplace contract of the specedge form).
 *
 * For a step of T new tokens at positions past_len .. past_len+T-1: RoPE (rotate-half) on q and k, the new k and v
 * rows written into the cache at past_len, then for each query row t and head h, causal attention over cache rows
 * 0 .. past_len+t with an online softmax in chunks of SEK_CHUNK positions.
 *
 * Every row's arithmetic depends only on its own q row, its position and the cache rows it reads (which the same
 * code wrote, whatever the width of the step that wrote them): a width-1 step gives the same bits as the same row
 * inside a wider step. ONNX Runtime's GroupQueryAttention computes a lone row by other kernels (a difference of
 * ~1e-6, measured), so the specedge form brings its own attention to let plain decoding run width 1 exactly.
 *
 * Speed: a step is split into items of several queries (rows x query heads of one KV group, sek_attn_plan), which
 * take the cache SEK_SUB rows at a time in turn, so each K and V row comes from memory once per item rather than
 * once per query head; the value sums stay in registers across a chunk's rows (pv_slice). Measured on Qwen2.5-
 * Coder-1.5B at 1,900 positions (AVX512 EPYC, 2 threads; docs/benchmarks.md): a 9-row step 98-106 ms against
 * 109-120 before. A query's scores are taken four keys at a time (dot4: its vector loaded once for the four, their
 * reduction trees sharing shuffles), and two queries with the same rows of a chunk take the value rows together
 * (pv_chunk2): each score and each sum keeps the bits it has alone. A 64-row step at 1,024 positions still runs at
 * about a third of the fp32 FMA rate (one thread: 5.5 ms a layer, 208 M multiply-adds).
 *
 * A row-addressed step (sek_row_attn_*) carries rows of several sequences, each naming its sequence's KV slot and its
 * position: the same per-query arithmetic over that slot's cache, in items that each hold queries of one row, so a
 * row's bits are those of its query in a step of its sequence alone.
 *
 * Used through sek_ort.c (ai.specedge::SekAttention, ai.specedge::SekRowAttention).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "sek.h"
#if defined(__x86_64__) && (defined(__AVX2__) || defined(__AVX512F__))
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define SEK_ATTN_NEON 1
#endif

#define SEK_CHUNK 64
#define SEK_Q_MAX 32 /* queries (row, head) per attention item, at most; and at most SEK_Q_MAX * 128 floats of them */

/* x's first r values rotated in place by the tables' row for its position (rotate-half: pairs i, i + r/2); the
 * rest of the head (a partial rotary, r < d) pass through. */
static void rope(float *x, const float *cs, const float *sn, int64_t r) {
    const int64_t h = r / 2;
    for (int64_t i = 0; i < h; i++) {
        const float a = x[i], b = x[i + h], c = cs[i], s = sn[i];
        x[i] = a * c - b * s;
        x[i + h] = b * c + a * s;
    }
}

/* The lane sums of a . b: two accumulators over alternate 16-lane chunks (AVX-512; the last odd chunk to the
 * first), one over 8-lane chunks (AVX2), two over 4-lane chunks (NEON). */
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 lanes512(const float *a, const float *b, int64_t d) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= d; i += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
    }
    if (i < d) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    return _mm512_add_ps(s0, s1);
}

/* A vector's 16 lanes summed as a tree: i + (i + 8), then i + (i + 4), i + (i + 2), 0 + 1 (GCC's
 * _mm512_reduce_add_ps, written out so that every compiler adds in this order and dot4's shared trees match it). */
static inline __attribute__((always_inline)) float hsum512(__m512 u) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1));
    const __m256 t3 = _mm256_add_ps(_mm512_castps512_ps256(u), hi);
    const __m128 t6 = _mm_add_ps(_mm256_castps256_ps128(t3), _mm256_extractf128_ps(t3, 1));
    const __m128 t8 = _mm_add_ps(t6, _mm_movehl_ps(t6, t6));
    return _mm_cvtss_f32(_mm_add_ss(t8, _mm_movehdup_ps(t8)));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) __m256 lanes256(const float *a, const float *b, int64_t d) {
    __m256 s0 = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    return s0;
}

/* 8 lanes as a tree: i + (i + 4), then i + (i + 2), 0 + 1. */
static inline __attribute__((always_inline)) float hsum256(__m256 u) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

static float dot(const float *a, const float *b, int64_t d) {
#if defined(__AVX512F__)
    if (d % 16 == 0) return hsum512(lanes512(a, b, d));
#elif defined(__AVX2__) && defined(__FMA__)
    if (d % 8 == 0) return hsum256(lanes256(a, b, d));
#elif defined(SEK_ATTN_NEON)
    if (d % 8 == 0) {
        float32x4_t s0 = vdupq_n_f32(0.f), s1 = vdupq_n_f32(0.f);
        for (int64_t i = 0; i < d; i += 8) {
            s0 = vfmaq_f32(s0, vld1q_f32(a + i), vld1q_f32(b + i));
            s1 = vfmaq_f32(s1, vld1q_f32(a + i + 4), vld1q_f32(b + i + 4));
        }
        return vaddvq_f32(vaddq_f32(s0, s1));
    }
#endif
    float s = 0.f;
    for (int64_t i = 0; i < d; i++) s = fmaf(a[i], b[i], s);
    return s;
}

/* out[0..3] = dot(a, b + c d) for the four rows c of b: each exactly dot()'s value (the same lane sums, the same
 * reduction tree), the four trees' shuffles shared, so a key's score has the same bits scored alone or in a four. */
static void dot4(const float *a, const float *b, int64_t d, float out[4]) {
#if defined(__AVX512F__)
    if (d % 16 == 0) {
        /* lanes512's sums for the four keys, interleaved: each chunk of a loaded once for all four */
        __m512 s0[4], s1[4];
        for (int c = 0; c < 4; c++) s0[c] = s1[c] = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 32 <= d; i += 32) {
            const __m512 x0 = _mm512_loadu_ps(a + i), x1 = _mm512_loadu_ps(a + i + 16);
            for (int c = 0; c < 4; c++) {
                s0[c] = _mm512_fmadd_ps(x0, _mm512_loadu_ps(b + c * d + i), s0[c]);
                s1[c] = _mm512_fmadd_ps(x1, _mm512_loadu_ps(b + c * d + i + 16), s1[c]);
            }
        }
        if (i < d) {
            const __m512 x0 = _mm512_loadu_ps(a + i);
            for (int c = 0; c < 4; c++) s0[c] = _mm512_fmadd_ps(x0, _mm512_loadu_ps(b + c * d + i), s0[c]);
        }
        const __m512 u0 = _mm512_add_ps(s0[0], s1[0]), u1 = _mm512_add_ps(s0[1], s1[1]),
                     u2 = _mm512_add_ps(s0[2], s1[2]), u3 = _mm512_add_ps(s0[3], s1[3]);
        /* 128-bit blocks: [u0 lanes 0-7 + 8-15 | u1's], [u2's | u3's]: each key's i + (i + 8) */
        const __m512 v01 = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x44), _mm512_shuffle_f32x4(u0, u1, 0xEE));
        const __m512 v23 = _mm512_add_ps(_mm512_shuffle_f32x4(u2, u3, 0x44), _mm512_shuffle_f32x4(u2, u3, 0xEE));
        /* block k: key k's i + (i + 4) */
        const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, 0x88), _mm512_shuffle_f32x4(v01, v23, 0xDD));
        const __m512 e = _mm512_add_ps(w, _mm512_permute_ps(w, 0x4E));          /* lanes 0, 1: i + (i + 2) */
        const __m512 f = _mm512_add_ps(e, _mm512_permute_ps(e, 0xB1));          /* lane 0: 0 + 1 */
        _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0,
                                                                                          0, 0, 0, 0, 0, 0), f)));
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (d % 8 == 0) {
        __m256 u[4];
        for (int c = 0; c < 4; c++) u[c] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) { /* lanes256's sums for the four keys, each chunk of a loaded once */
            const __m256 x = _mm256_loadu_ps(a + i);
            for (int c = 0; c < 4; c++) u[c] = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + c * d + i), u[c]);
        }
        const __m256 u0 = u[0], u1 = u[1], u2 = u[2], u3 = u[3];
        /* halves: [u0's i + (i + 4) | u1's], [u2's | u3's] */
        const __m256 v01 = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
        const __m256 v23 = _mm256_add_ps(_mm256_permute2f128_ps(u2, u3, 0x20), _mm256_permute2f128_ps(u2, u3, 0x31));
        const __m256 e01 = _mm256_add_ps(v01, _mm256_permute_ps(v01, 0x4E)),
                     e23 = _mm256_add_ps(v23, _mm256_permute_ps(v23, 0x4E));
        const __m256 f01 = _mm256_add_ps(e01, _mm256_permute_ps(e01, 0xB1)),
                     f23 = _mm256_add_ps(e23, _mm256_permute_ps(e23, 0xB1));
        /* lane 0 of each half holds a key's score: u0, u1 (f01), u2, u3 (f23); g = [f01.0, f01.0, f23.0, f23.0 |
         * f01.4, f01.4, f23.4, f23.4] */
        const __m256 g = _mm256_shuffle_ps(f01, f23, 0x00);
        const __m128 lo = _mm256_castps256_ps128(g), hi = _mm256_extractf128_ps(g, 1);
        _mm_storeu_ps(out, _mm_shuffle_ps(_mm_unpacklo_ps(lo, hi), _mm_unpackhi_ps(lo, hi), 0x44));
        return;
    }
#endif
    for (int c = 0; c < 4; c++) out[c] = dot(a, b + c * d, d);
}

/* acc[d] = acc * alpha + p * v (alpha applied first); vectorized where d allows, same order per element. */
static void axpby(float *acc, float alpha, float p, const float *v, int64_t d) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 va = _mm512_set1_ps(alpha), vp = _mm512_set1_ps(p);
    for (; i + 16 <= d; i += 16)
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(vp, _mm512_loadu_ps(v + i), _mm512_mul_ps(_mm512_loadu_ps(acc + i), va)));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 va = _mm256_set1_ps(alpha), vp = _mm256_set1_ps(p);
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(vp, _mm256_loadu_ps(v + i), _mm256_mul_ps(_mm256_loadu_ps(acc + i), va)));
#elif defined(SEK_ATTN_NEON)
    for (; i + 4 <= d; i += 4)
        vst1q_f32(acc + i, vfmaq_n_f32(vmulq_n_f32(vld1q_f32(acc + i), alpha), vld1q_f32(v + i), p));
#endif
    for (; i < d; i++) acc[i] = fmaf(p, v[i], acc[i] * alpha);
}

/* p[j] = exp(x[j]) for j < n (x <= 0 here: scores minus their running maximum). Vectorized with a Cephes-style
 * range reduction and degree-6 polynomial (~2 ulp) where AVX512, AVX2 or NEON is available, libm's expf otherwise: the
 * same function for every row on a machine, so rows stay width-invariant. */
static void exp_block(const float *x, float *p, int64_t n) {
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 lo = _mm512_set1_ps(-87.0f), log2e = _mm512_set1_ps(1.44269504088896341f),
                 c1 = _mm512_set1_ps(0.693359375f), c2 = _mm512_set1_ps(-2.12194440e-4f);
    for (; j + 16 <= n; j += 16) {
        __m512 v = _mm512_max_ps(_mm512_loadu_ps(x + j), lo);
        const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_fnmadd_ps(k, c1, v);
        v = _mm512_fnmadd_ps(k, c2, v);
        __m512 y = _mm512_set1_ps(1.9875691500e-4f);
        y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(1.3981999507e-3f));
        y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(8.3334519073e-3f));
        y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(4.1665795894e-2f));
        y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(1.6666665459e-1f));
        y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(5.0000001201e-1f));
        y = _mm512_fmadd_ps(y, _mm512_mul_ps(v, v), _mm512_add_ps(v, _mm512_set1_ps(1.f)));
        _mm512_storeu_ps(p + j, _mm512_scalef_ps(y, k));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 lo = _mm256_set1_ps(-87.0f), log2e = _mm256_set1_ps(1.44269504088896341f),
                 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_max_ps(_mm256_loadu_ps(x + j), lo);
        const __m256 k = _mm256_round_ps(_mm256_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm256_fnmadd_ps(k, c1, v);
        v = _mm256_fnmadd_ps(k, c2, v);
        __m256 y = _mm256_set1_ps(1.9875691500e-4f);
        y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(1.3981999507e-3f));
        y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(8.3334519073e-3f));
        y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(4.1665795894e-2f));
        y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(1.6666665459e-1f));
        y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(5.0000001201e-1f));
        y = _mm256_fmadd_ps(y, _mm256_mul_ps(v, v), _mm256_add_ps(v, _mm256_set1_ps(1.f)));
        const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
        _mm256_storeu_ps(p + j, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
    }
#elif defined(SEK_ATTN_NEON)
    const float32x4_t lo = vdupq_n_f32(-87.0f), c1 = vdupq_n_f32(0.693359375f), c2 = vdupq_n_f32(-2.12194440e-4f);
    for (; j + 4 <= n; j += 4) {
        float32x4_t v = vmaxq_f32(vld1q_f32(x + j), lo);
        const float32x4_t k = vrndnq_f32(vmulq_n_f32(v, 1.44269504088896341f));
        v = vfmsq_f32(v, k, c1);
        v = vfmsq_f32(v, k, c2);
        float32x4_t y = vdupq_n_f32(1.9875691500e-4f);
        y = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), y, v);
        y = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), y, v);
        y = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), y, v);
        y = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), y, v);
        y = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), y, v);
        y = vfmaq_f32(vaddq_f32(v, vdupq_n_f32(1.f)), y, vmulq_f32(v, v));
        const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(k), vdupq_n_s32(127)), 23);
        vst1q_f32(p + j, vmulq_f32(y, vreinterpretq_f32_s32(e)));
    }
#endif
    for (; j < n; j++) p[j] = expf(x[j]);
}

/* ---- the cache's elements: fp32, fp16, or int8 rows with their scale ---- */

size_t sek_kv_row_bytes(int kv_type, int64_t d) {
    return kv_type == SEK_KV_I8 ? (size_t)d + sizeof(float) : (size_t)d * (kv_type == SEK_KV_F16 ? 2 : 4);
}

/* f rounded to the nearest fp16, ties to even (IEEE 754's default; what F16C's vcvtps2ph and numpy's astype give),
 * in integer arithmetic alone: the floating-point environment (flush-to-zero, rounding mode) never changes a bit. A
 * NaN becomes the quiet NaN 0x7e00 with f's sign. */
uint16_t sek_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) return sign | 0x7e00u;     /* NaN */
    if (x >= 0x477ff000u) return sign | 0x7c00u;    /* 65520 and above (infinity too): infinity */
    if (x >= 0x38800000u) {                          /* 2^-14 and above: a normal fp16 */
        x += 0xc8000fffu + ((x >> 13) & 1u);        /* exponent rebased (-112 << 23), half an ulp less the tie bit */
        return sign | (uint16_t)(x >> 13);
    }
    const uint32_t shift = 126u - (x >> 23);        /* a subnormal fp16 (or 0): units of 2^-24 */
    if (shift > 24) return sign;
    const uint32_t m = (x & 0x7fffffu) | 0x800000u, half = 1u << (shift - 1), rest = m & ((half << 1) - 1u);
    uint32_t q = m >> shift;
    q += rest > half || (rest == half && (q & 1u));
    return sign | (uint16_t)q;                       /* 0x400 when it rounds up to 2^-14: that is its encoding */
}

/* The fp16 h as fp32 (exact). */
float sek_f16_to_f32(uint16_t h) {
    const uint32_t s = (uint32_t)(h & 0x8000u) << 16, m = h & 0x3ffu;
    uint32_t e = (h >> 10) & 0x1fu, x;
    if (e == 0x1f) {
        x = s | 0x7f800000u | (m << 13);
    } else if (e) {
        x = s | ((e + 112u) << 23) | (m << 13);
    } else if (!m) {
        x = s;
    } else { /* subnormal: m 2^-24, normalized */
        uint32_t n = m;
        e = 113;
        while (!(n & 0x400u)) n <<= 1, e--;
        x = s | (e << 23) | ((n & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

/* An int8 row of d values and its fp32 scale (sek.h): scale = max |x[i]| / 127, q[i] = x[i] / scale rounded to
 * nearest even (an integer part and a remainder, both exact: no rounding mode or conversion instruction decides a
 * bit), so a row is the same wherever and whenever it is written. A row of zeros has scale 0; a row holding an
 * infinity or a NaN has scale NaN, and reads as NaN (as its attention would be in fp32). */
static void kv_put_i8(int8_t *o, int64_t d, const float *x) {
    float amax = 0.f;
    int finite = 1;
    for (int64_t i = 0; i < d; i++) {
        const float a = fabsf(x[i]);
        finite &= a <= FLT_MAX;
        amax = a > amax ? a : amax;
    }
    const float s = finite ? amax / 127.f : NAN;
    for (int64_t i = 0; i < d; i++) {
        int q = 0;
        if (s > 0.f) { /* neither 0 nor NaN */
            const float y = x[i] / s;
            q = (int)y;
            const float f = y - (float)q;
            q += (f > 0.5f || (f == 0.5f && (q & 1))) - (f < -0.5f || (f == -0.5f && (q & 1)));
            q = q > 127 ? 127 : q < -127 ? -127 : q;
        }
        o[i] = (int8_t)q;
    }
    memcpy(o + d, &s, sizeof s);
}

/* Cache row `row` (of d elements) set to x. */
static void kv_put(void *cache, int type, int64_t row, int64_t d, const float *x) {
    char *at = (char *)cache + (size_t)row * sek_kv_row_bytes(type, d);
    if (type == SEK_KV_F16) {
        uint16_t *o = (uint16_t *)at;
        for (int64_t i = 0; i < d; i++) o[i] = sek_f32_to_f16(x[i]);
    } else if (type == SEK_KV_I8) {
        kv_put_i8((int8_t *)at, d, x);
    } else {
        memcpy(at, x, (size_t)d * sizeof(float));
    }
}

/* One int8 row as fp32: q[i] * scale, the same product on every path. */
static void i8_row(const int8_t *q, int64_t d, float *out) {
    float s;
    memcpy(&s, q + d, sizeof s);
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 vs = _mm512_set1_ps(s);
    for (; i + 16 <= d; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                    _mm_loadu_si128((const __m128i *)(q + i)))), vs));
#elif defined(__AVX2__)
    const __m256 vs = _mm256_set1_ps(s);
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                    _mm_loadl_epi64((const __m128i *)(q + i)))), vs));
#elif defined(SEK_ATTN_NEON)
    const float32x4_t vs = vdupq_n_f32(s);
    for (; i + 8 <= d; i += 8) {
        const int16x8_t w = vmovl_s8(vld1_s8(q + i));
        vst1q_f32(out + i, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), vs));
        vst1q_f32(out + i + 4, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(w))), vs));
    }
#endif
    for (; i < d; i++) out[i] = (float)q[i] * s;
}

/* n cache rows from `row` as fp32: the cache itself (fp32), else converted into buf [n][d] (fp16 exactly: every fp16
 * is an fp32; int8 as q * scale), so the arithmetic after it never knows which type the cache holds. */
static const float *kv_rows(const void *cache, int type, int64_t row, int64_t n, int64_t d, float *buf) {
    if (type == SEK_KV_F32) return (const float *)cache + row * d;
    if (type == SEK_KV_I8) {
        const size_t rb = sek_kv_row_bytes(type, d);
        for (int64_t j = 0; j < n; j++) i8_row((const int8_t *)cache + (size_t)(row + j) * rb, d, buf + j * d);
        return buf;
    }
    const uint16_t *h = (const uint16_t *)cache + row * d;
    const int64_t len = n * d;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= len; i += 16) _mm512_storeu_ps(buf + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#elif defined(__F16C__)
    for (; i + 8 <= len; i += 8) _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#elif defined(SEK_ATTN_NEON)
    for (; i + 4 <= len; i += 4) vst1q_f32(buf + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + i))));
#endif
    for (; i < len; i++) buf[i] = sek_f16_to_f32(h[i]);
    return buf;
}

/* Asks for n cache rows from `row` into L2 (those of the next chunk, a SEK_SUB block at a time as this chunk's are
 * read), so the memory delivers them while this chunk's arithmetic runs rather than after it. A prefetch never
 * reads past `end` (the rows the item reads). Measured on Zen 4 (tools/dev/attn_bench.c, depth 8,192): 5-10 %
 * off the step's attention; into L1 instead (locality 3) it is 20 % slower. */
static void prefetch_rows(const void *cache, int type, int64_t row, int64_t n, int64_t end_row, int64_t d) {
    if (row + n > end_row) n = end_row - row;
    if (n <= 0) return;
    const size_t rb = sek_kv_row_bytes(type, d);
    const char *p = (const char *)cache + (size_t)row * rb, *end = p + (size_t)n * rb;
    for (; p < end; p += 64) __builtin_prefetch(p, 0, 2);
}

/* A new row's k (rotated by its position) and v into cache row `at` of kv head h. */
static void kv_store(void *kc, void *vc, int type, int64_t at, const float *k, const float *v, const float *cs,
                     const float *sn, int64_t d, int64_t rot) {
    float r[512]; /* d <= 512 (checked by the callers) */
    memcpy(r, k, (size_t)d * sizeof(float));
    rope(r, cs, sn, rot);
    kv_put(kc, type, at, d, r);
    kv_put(vc, type, at, d, v);
}

/* Writes the step's new k and v rows (k rotated) into the cache. Call once per step before the rows. */
void sek_attn_store(const sek_attn_args *a) {
    const int64_t w = (a->hq + 2 * a->hkv) * a->d;
    for (int64_t t = 0; t < a->t; t++) {
        const int64_t pos = a->past_len + t;
        const float *row = a->qkv + t * w;
        for (int64_t h = 0; h < a->hkv; h++)
            kv_store(a->k_cache, a->v_cache, a->kv_type, h * a->s_max + pos, row + (a->hq + h) * a->d,
                     row + (a->hq + a->hkv + h) * a->d, a->cos + pos * (a->rot / 2), a->sin + pos * (a->rot / 2), a->d,
                     a->rot);
    }
}

/* acc[d] = the chunk's axpby sequence (acc * alpha + p[0] v[0], then + p[j] v[j] for each later row j), with the
 * accumulator held in registers across the chunk where the head dimension allows: per element the same fma's in
 * the same order as axpby (whose acc * 1 after the first row is acc itself), without storing and reloading acc at
 * every cache row. */
#if defined(__AVX512F__)
#define SEK_VW 16
typedef __m512 sek_vec;
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VSET1 _mm512_set1_ps
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VMUL _mm512_mul_ps
#elif defined(__AVX2__) && defined(__FMA__)
#define SEK_VW 8
typedef __m256 sek_vec;
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VSET1 _mm256_set1_ps
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VMUL _mm256_mul_ps
#elif defined(SEK_ATTN_NEON)
#define SEK_VW 4
typedef float32x4_t sek_vec;
#define VLOAD vld1q_f32
#define VSTORE vst1q_f32
#define VSET1 vdupq_n_f32
#define VFMA(a, b, c) vfmaq_f32(c, a, b)
#define VMUL vmulq_f32
#endif

#ifdef SEK_VW
#define SEK_PV_SLICE 8 /* vectors of acc held at once */
static inline __attribute__((always_inline)) void pv_slice(float *acc, const float *v, const float *p, int64_t cn,
                                                          float alpha, int64_t d, const int nv) {
    sek_vec a[SEK_PV_SLICE];
    for (int k = 0; k < nv; k++) a[k] = VMUL(VLOAD(acc + k * SEK_VW), VSET1(alpha));
    for (int64_t j = 0; j < cn; j++) {
        const sek_vec pj = VSET1(p[j]);
        for (int k = 0; k < nv; k++) a[k] = VFMA(pj, VLOAD(v + j * d + k * SEK_VW), a[k]);
    }
    for (int k = 0; k < nv; k++) VSTORE(acc + k * SEK_VW, a[k]);
}
#endif

#ifdef SEK_VW
/* pv_slice for two queries over the same value rows: each row's vectors loaded once for both, each query's
 * accumulators updated exactly as pv_slice updates them. */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define SEK_PV_SLICE2 4 /* 16 ymm registers: 2 x 4 accumulators, a row's vector, 2 broadcasts */
#else
#define SEK_PV_SLICE2 8
#endif
static inline __attribute__((always_inline)) void pv_slice2(float *acc0, float *acc1, const float *v, const float *p0,
                                                           const float *p1, int64_t cn, float alpha0, float alpha1,
                                                           int64_t d, const int nv) {
    sek_vec a0[SEK_PV_SLICE], a1[SEK_PV_SLICE]; /* nv <= 7 at every call (the rest of a head) or SEK_PV_SLICE2 */
    for (int k = 0; k < nv; k++) {
        a0[k] = VMUL(VLOAD(acc0 + k * SEK_VW), VSET1(alpha0));
        a1[k] = VMUL(VLOAD(acc1 + k * SEK_VW), VSET1(alpha1));
    }
    for (int64_t j = 0; j < cn; j++) {
        const sek_vec q0 = VSET1(p0[j]), q1 = VSET1(p1[j]);
        for (int k = 0; k < nv; k++) {
            const sek_vec x = VLOAD(v + j * d + k * SEK_VW);
            a0[k] = VFMA(q0, x, a0[k]);
            a1[k] = VFMA(q1, x, a1[k]);
        }
    }
    for (int k = 0; k < nv; k++) {
        VSTORE(acc0 + k * SEK_VW, a0[k]);
        VSTORE(acc1 + k * SEK_VW, a1[k]);
    }
}
#endif

static void pv_chunk(float *acc, const float *v, const float *p, int64_t cn, float alpha, int64_t d) {
#ifdef SEK_VW
    if (d % SEK_VW == 0) {
        int64_t i = 0;
        for (; i + SEK_PV_SLICE * SEK_VW <= d; i += SEK_PV_SLICE * SEK_VW)
            pv_slice(acc + i, v + i, p, cn, alpha, d, SEK_PV_SLICE);
        if (i < d) {
            const int nv = (int)((d - i) / SEK_VW);
            switch (nv) {
            case 1: pv_slice(acc + i, v + i, p, cn, alpha, d, 1); break;
            case 2: pv_slice(acc + i, v + i, p, cn, alpha, d, 2); break;
            case 3: pv_slice(acc + i, v + i, p, cn, alpha, d, 3); break;
            case 4: pv_slice(acc + i, v + i, p, cn, alpha, d, 4); break;
            case 5: pv_slice(acc + i, v + i, p, cn, alpha, d, 5); break;
            case 6: pv_slice(acc + i, v + i, p, cn, alpha, d, 6); break;
            default: pv_slice(acc + i, v + i, p, cn, alpha, d, 7); break;
            }
        }
        return;
    }
#endif
    for (int64_t j = 0; j < cn; j++) {
        axpby(acc, alpha, p[j], v + j * d, d);
        alpha = 1.f;
    }
}

/* pv_chunk for two queries with the same rows of the chunk: the same bits as two pv_chunk calls. */
static void pv_chunk2(float *acc0, float *acc1, const float *v, const float *p0, const float *p1, int64_t cn,
                      float alpha0, float alpha1, int64_t d) {
#ifdef SEK_VW
    if (d % SEK_VW == 0) {
        int64_t i = 0;
        for (; i + SEK_PV_SLICE2 * SEK_VW <= d; i += SEK_PV_SLICE2 * SEK_VW)
            pv_slice2(acc0 + i, acc1 + i, v + i, p0, p1, cn, alpha0, alpha1, d, SEK_PV_SLICE2);
        switch ((d - i) / SEK_VW) { /* the rest of a head (d = 64 with AVX-512: 4 vectors), as a slice of its own */
        case 0: break;
        case 1: pv_slice2(acc0 + i, acc1 + i, v + i, p0, p1, cn, alpha0, alpha1, d, 1); break;
        case 2: pv_slice2(acc0 + i, acc1 + i, v + i, p0, p1, cn, alpha0, alpha1, d, 2); break;
        case 3: pv_slice2(acc0 + i, acc1 + i, v + i, p0, p1, cn, alpha0, alpha1, d, 3); break;
        case 4: pv_slice2(acc0 + i, acc1 + i, v + i, p0, p1, cn, alpha0, alpha1, d, 4); break;
        case 5: pv_slice2(acc0 + i, acc1 + i, v + i, p0, p1, cn, alpha0, alpha1, d, 5); break;
        case 6: pv_slice2(acc0 + i, acc1 + i, v + i, p0, p1, cn, alpha0, alpha1, d, 6); break;
        default: pv_slice2(acc0 + i, acc1 + i, v + i, p0, p1, cn, alpha0, alpha1, d, 7); break;
        }
        return;
    }
#endif
    pv_chunk(acc0, v, p0, cn, alpha0, d);
    pv_chunk(acc1, v, p1, cn, alpha1, d);
}

/* The chunk's softmax part for np queries with the same cn rows of scores s: per query the chunk's maximum (scores in
 * order, as `s > max ? s : max`), the new running maximum, alpha (the earlier chunks' rescale; none before a query's
 * first chunk, where its maximum is still -inf), l * alpha, exp of the scores less the maximum into pr, and l plus
 * those exps in order. A query's first lo[i] rows lie before its sliding window: their scores are -inf, their exps
 * 0. The queries' chains of compares and adds run side by side (np a constant of each call: they stay in
 * registers), and each query's operations are those it has alone. */
static inline __attribute__((always_inline)) void softmax_rows(float (*s)[SEK_CHUNK], float (*pr)[SEK_CHUNK], int64_t cn,
                                                               const int64_t *lo, float *m, float *l, float *alpha,
                                                               const int np) {
    float mc[4], ls[4];
    for (int i = 0; i < np; i++) {
        mc[i] = -INFINITY;
        for (int64_t j = 0; j < lo[i]; j++) s[i][j] = -INFINITY;
    }
    for (int64_t j = 0; j < cn; j++)
        for (int i = 0; i < np; i++) mc[i] = s[i][j] > mc[i] ? s[i][j] : mc[i];
    for (int i = 0; i < np; i++) {
        const float m_new = mc[i] > m[i] ? mc[i] : m[i];
        alpha[i] = m[i] == -INFINITY ? 0.f : expf(m[i] - m_new);
        ls[i] = l[i] * alpha[i];
        for (int64_t j = 0; j < cn; j++) s[i][j] -= m_new;
        exp_block(s[i], pr[i], cn);
        for (int64_t j = 0; j < lo[i]; j++) pr[i][j] = 0.f; /* exp_block clamps at -87: exp(-inf) is not 0 there */
        m[i] = m_new;
    }
    for (int64_t j = 0; j < cn; j++)
        for (int i = 0; i < np; i++) ls[i] += pr[i][j];
    for (int i = 0; i < np; i++) l[i] = ls[i];
}

#define SEK_SUB 16 /* cache rows the queries of an item take in turn: 8 KB of K (or V) at d = 128, L1-resident */

/* One chunk (cache rows c0 .. c0+cn[p]-1 of kc, vc, which hold `type`) of the online softmax for the nq queries
 * (row, head) of an item, all of one KV group; m, l, acc carry each query's state (m -inf before its first chunk), a
 * query whose row ends before c0 or whose window starts after the chunk has cn[p] <= 0, and one whose window starts
 * inside it skips its first lo[p] rows (they weigh 0). Per query the arithmetic is a lone query's: scores dot(q, k) * scale, the chunk's
 * maximum, exp of the scores less the running maximum, the earlier chunks rescaled by alpha, then acc = acc * alpha
 * + p v row after row. Only the order across queries is the item's: they take SEK_SUB cache rows at a time in turn,
 * so those rows come from memory once for all of them (a group's cache at 1,900 positions is 2 MB a layer: more than
 * L2), and a cache of fp16 or int8 is converted SEK_SUB rows at a time into buf [SEK_SUB][d], which stays in L1
 * while the queries read it (a whole chunk's K and V as fp32 would be 64 KB at d = 128: more than L1; measured on
 * Zen 4 at depth 8,192, converting 16 rows at a time takes a fifth off the step's attention). The next chunk's rows,
 * up to row `end` (the rows the item reads), are prefetched meanwhile. */
static void attend_chunk(const float *q, const void *kc, const void *vc, int type, int64_t c0, int64_t end,
                         const int64_t *cn, const int64_t *lo, int64_t d, float scale, float softcap, int64_t nq,
                         float *m, float *l, float *acc, float *buf) {
    float s[SEK_Q_MAX][SEK_CHUNK], pr[SEK_Q_MAX][SEK_CHUNK], alpha[SEK_Q_MAX];
    int64_t cmax = 0;
    for (int64_t p = 0; p < nq; p++) cmax = cn[p] > cmax ? cn[p] : cmax;
    for (int64_t j0 = 0; j0 < cmax; j0 += SEK_SUB) {
        prefetch_rows(kc, type, c0 + SEK_CHUNK + j0, SEK_SUB, end, d);
        const float *k = kv_rows(kc, type, c0 + j0, cmax - j0 < SEK_SUB ? cmax - j0 : SEK_SUB, d, buf) - j0 * d;
        for (int64_t p = 0; p < nq; p++) {
            const int64_t j1 = j0 + SEK_SUB < cn[p] ? j0 + SEK_SUB : cn[p];
            int64_t j = j0;
            for (; j + 4 <= j1; j += 4) {
                float o[4];
                dot4(q + p * d, k + j * d, d, o);
                for (int c = 0; c < 4; c++) s[p][j + c] = o[c] * scale;
            }
            for (; j < j1; j++) s[p][j] = dot(q + p * d, k + j * d, d) * scale;
            if (softcap > 0.f) /* c tanh(s / c), libm's tanhf: the same function for every row */
                for (j = j0; j < j1; j++) s[p][j] = softcap * tanhf(s[p][j] / softcap);
        }
    }
    for (int64_t p = 0; p < nq;) { /* queries with the same rows of the chunk, four or two at a time where they can */
        int64_t np = 1;
        while (np < 4 && p + np < nq && cn[p + np] == cn[p]) np++;
        np = np == 4 ? 4 : np >= 2 ? 2 : 1;
        if (cn[p] > 0 && np == 4) softmax_rows(s + p, pr + p, cn[p], lo + p, m + p, l + p, alpha + p, 4);
        else if (cn[p] > 0 && np == 2) softmax_rows(s + p, pr + p, cn[p], lo + p, m + p, l + p, alpha + p, 2);
        else if (cn[p] > 0) softmax_rows(s + p, pr + p, cn[p], lo + p, m + p, l + p, alpha + p, 1);
        p += np;
    }
    for (int64_t j0 = 0; j0 < cmax; j0 += SEK_SUB) {
        prefetch_rows(vc, type, c0 + SEK_CHUNK + j0, SEK_SUB, end, d);
        const float *v = kv_rows(vc, type, c0 + j0, cmax - j0 < SEK_SUB ? cmax - j0 : SEK_SUB, d, buf);
        for (int64_t p = 0; p < nq; p++) { /* rows after the chunk's first: alpha 1 (acc * 1, as axpby does) */
            const int64_t n = (j0 + SEK_SUB < cn[p] ? j0 + SEK_SUB : cn[p]) - j0; /* query p's rows from j0 */
            if (n <= 0) continue;
            if (p + 1 < nq && (j0 + SEK_SUB < cn[p + 1] ? j0 + SEK_SUB : cn[p + 1]) - j0 == n) {
                pv_chunk2(acc + p * d, acc + (p + 1) * d, v, pr[p] + j0, pr[p + 1] + j0, n,
                          j0 ? 1.f : alpha[p], j0 ? 1.f : alpha[p + 1], d);
                p++; /* two queries with the same rows of this chunk (heads of one row): one pass over them */
            } else {
                pv_chunk(acc + p * d, v, pr[p] + j0, n, j0 ? 1.f : alpha[p], d);
            }
        }
    }
}

/* Query p's rows of the chunk at c0 (cn: none if <= 0) and how many of them lie before its window (lo), for rows
 * start[p] .. n[p]-1. The chunks are the cache's, at multiples of SEK_CHUNK whatever the item: a query's chunks and
 * what it reads of each never depend on the other queries. */
static void chunk_rows(const int64_t *n, const int64_t *start, int64_t c0, int64_t nq, int64_t *cn, int64_t *lo) {
    for (int64_t p = 0; p < nq; p++) {
        cn[p] = c0 + SEK_CHUNK <= start[p] ? 0 : n[p] - c0 < SEK_CHUNK ? n[p] - c0 : SEK_CHUNK;
        lo[p] = start[p] > c0 ? start[p] - c0 : 0;
    }
}

/* The first chunk any of the nq queries reads: the one holding the earliest window start. */
static int64_t first_chunk(const int64_t *start, int64_t nq) {
    int64_t s0 = start[0];
    for (int64_t p = 1; p < nq; p++) s0 = start[p] < s0 ? start[p] : s0;
    return s0 / SEK_CHUNK * SEK_CHUNK;
}

/* The nq queries q [nq][d] of an item (rotated; all of one KV group, whose cache rows kc, vc [s_max][d] they read),
 * query p over cache rows start[p] .. n[p]-1 (nmax the largest n; start 0 but for a sliding window): the online
 * softmax chunk after chunk -> each query's sum of exps l[p] and its unnormalized value sum acc [nq][d]. */
static void attend(const float *q, const void *kc, const void *vc, int type, const int64_t *n, const int64_t *start,
                   int64_t nmax, int64_t d, float scale, float softcap, int64_t nq, float *m, float *l, float *acc) {
    int64_t cn[SEK_Q_MAX], lo[SEK_Q_MAX];
    float buf[type != SEK_KV_F32 ? SEK_SUB * d : 1];
    for (int64_t p = 0; p < nq; p++) {
        m[p] = -INFINITY;
        l[p] = 0.f;
    }
    memset(acc, 0, (size_t)(nq * d) * sizeof(float));
    for (int64_t c0 = first_chunk(start, nq); c0 < nmax; c0 += SEK_CHUNK) {
        chunk_rows(n, start, c0, nq, cn, lo);
        attend_chunk(q, kc, vc, type, c0, nmax, cn, lo, d, scale, softcap, nq, m, l, acc, buf);
    }
}

/* attend for queries whose rows are not all the cache's first ones (tree rows): query p's row i is cache row i for
 * i < direct[p], then tail[p][i - direct[p]]; queries come in groups of hs (the heads of one step row) that share n,
 * direct and tail. A chunk whose rows are all direct runs for every such query at once, as attend runs it; a chunk
 * with tail rows is gathered once per group into kg, vg [SEK_CHUNK][d] and runs for that group alone. attend_chunk's
 * arithmetic per query never depends on the other queries, so each query has the bits attend gives it over a cache
 * that holds its rows in order: those of the same tokens decoded as one chain. */
static void attend_tail(const float *q, const void *kc, const void *vc, int type, const int64_t *n,
                        const int64_t *start, const int64_t *direct, const int64_t *tail, int64_t tail_stride,
                        int64_t nmax, int64_t d, float scale, float softcap, int64_t nq, int64_t hs, float *m,
                        float *l, float *acc, float *kg, float *vg) {
    int64_t cn[SEK_Q_MAX] = {0}, lo[SEK_Q_MAX] = {0}, len[SEK_Q_MAX]; /* cn, lo: set before use (GCC cannot tell) */
    float buf[type != SEK_KV_F32 ? SEK_SUB * d : 1];
    for (int64_t p = 0; p < nq; p++) {
        m[p] = -INFINITY;
        l[p] = 0.f;
    }
    memset(acc, 0, (size_t)(nq * d) * sizeof(float));
    for (int64_t c0 = first_chunk(start, nq); c0 < nmax; c0 += SEK_CHUNK) {
        int gathered = 0;
        chunk_rows(n, start, c0, nq, cn, lo);
        for (int64_t p = 0; p < nq; p++) {
            len[p] = cn[p]; /* the rows of a gathered chunk, with lo[p] before the window */
            if (cn[p] > 0 && c0 + cn[p] > direct[p]) cn[p] = 0, gathered = 1;
        }
        attend_chunk(q, kc, vc, type, c0, nmax, cn, lo, d, scale, softcap, nq, m, l, acc, buf);
        for (int64_t p = 0; gathered && p < nq; p += hs) {
            const int64_t rows = len[p];
            if (rows <= 0 || c0 + rows <= direct[p]) continue;
            for (int64_t j = 0; j < rows; j++) {
                const int64_t i = c0 + j, row = i < direct[p] ? i : tail[p * tail_stride + i - direct[p]];
                memcpy(kg + j * d, kv_rows(kc, type, row, 1, d, buf), (size_t)d * sizeof(float));
                memcpy(vg + j * d, kv_rows(vc, type, row, 1, d, buf), (size_t)d * sizeof(float));
            }
            attend_chunk(q + p * d, kg, vg, SEK_KV_F32, 0, 0, len + p, lo + p, d, scale, softcap, hs, m + p, l + p,
                         acc + p * d, buf);
        }
    }
}

/* The most heads of a KV group an item of one row's queries can hold while a step of t rows keeps min_items items
 * (1 if it cannot). */
static int64_t heads_per_item(int64_t t, int64_t hq, int64_t hkv, int64_t d, int64_t min_items) {
    const int64_t group = hq / hkv;
    for (int64_t h = group; h > 1; h--)
        if (group % h == 0 && h <= SEK_Q_MAX && h * d <= SEK_Q_MAX * 128 && t * hkv * (group / h) >= min_items)
            return h;
    return 1;
}

int64_t sek_attn_plan(int64_t t, int64_t hq, int64_t hkv, int64_t d, int64_t min_items, int64_t *hs, int64_t *rs) {
    *hs = heads_per_item(t, hq, hkv, d, min_items);
    *rs = 1;
    const int64_t group = hq / hkv;
    const int64_t blocks = hkv * (group / *hs);
    for (int64_t r = t; r > 1; r--) /* then the most rows */
        if (r * *hs <= SEK_Q_MAX && r * *hs * d <= SEK_Q_MAX * 128 && blocks * ((t + r - 1) / r) >= min_items) {
            *rs = r;
            break;
        }
    return blocks * ((t + *rs - 1) / *rs);
}

/* The first position a query at `pos` attends to: pos - window + 1 with a sliding window (window > 0), else 0. */
static int64_t window_start(int64_t window, int64_t pos) {
    return window > 0 && pos >= window ? pos - window + 1 : 0;
}

/* An item of sek_attn_plan's: rows rb*rs .. (rb+1)*rs-1 (those the step has) x query heads hb*hs .. (hb+1)*hs-1,
 * item = rb * (hq / hs) + hb; the heads lie in one KV group (hs divides hq / hkv). Every query's arithmetic is
 * attend_chunk's, chunk after chunk, whatever the item holds: the same bits as a query alone, so the plan is free
 * to follow the step's width. */
void sek_attn_row(const sek_attn_args *a, int64_t item) {
    const int64_t hs = a->hs, d = a->d, hb = item % (a->hq / hs), rb = item / (a->hq / hs);
    const int64_t h0 = hb * hs, g = h0 / (a->hq / a->hkv), t0 = rb * a->rs;
    const int64_t rows = a->t - t0 < a->rs ? a->t - t0 : a->rs, nq = rows * hs;
    if (nq <= 0) return; /* an item past the step's rows (sek_attn_plan never makes one) */
    float q[SEK_Q_MAX * 128], acc[SEK_Q_MAX * 128], m[SEK_Q_MAX], l[SEK_Q_MAX];
    int64_t n[SEK_Q_MAX], start[SEK_Q_MAX], nmax = 0;
    for (int64_t p = 0; p < nq; p++) { /* query p: row t0 + p / hs, head h0 + p % hs */
        const int64_t t = t0 + p / hs, h = h0 + p % hs, pos = a->past_len + t;
        memcpy(q + p * d, a->qkv + t * (a->hq + 2 * a->hkv) * d + h * d, (size_t)d * sizeof(float));
        rope(q + p * d, a->cos + pos * (a->rot / 2), a->sin + pos * (a->rot / 2), a->rot);
        n[p] = pos + 1;
        start[p] = window_start(a->window, pos);
        nmax = n[p] > nmax ? n[p] : nmax;
    }
    const size_t at = (size_t)(g * a->s_max) * sek_kv_row_bytes(a->kv_type, d);
    attend(q, (const char *)a->k_cache + at, (const char *)a->v_cache + at, a->kv_type, n, start, nmax, d, a->scale,
           a->softcap, nq, m, l, acc);
    for (int64_t p = 0; p < nq; p++) {
        float *o = a->out + (t0 + p / hs) * a->hq * d + (h0 + p % hs) * d;
        const float inv = 1.f / l[p];
        for (int64_t k = 0; k < d; k++) o[k] = acc[p * d + k] * inv;
    }
}

/* ---- row-addressed steps (ai.specedge::SekRowAttention): each row names its sequence's KV slot and position ---- */

/* Writes each real row's k (rotated by its position) and v into its slot's cache at its position. Call once per step
 * before the items: a row reads the rows of its slot that the step writes, whatever their order in the step. */
/* Row r's position (its rotary angle): row_pos[r] without a parent, else its root's row_pos plus its depth. With
 * `tail`, its ancestors' and its own cache rows from the root down (depth of them, root excluded); `root` its root. */
static int64_t row_position(const sek_row_attn_args *a, int64_t r, int64_t *tail, int64_t *root) {
    int64_t depth = 0, up[SEK_TREE_DEPTH];
    while (a->row_parent && a->row_parent[r] >= 0 && depth < SEK_TREE_DEPTH) {
        up[depth++] = a->row_pos[r];
        r = a->row_parent[r];
    }
    for (int64_t i = 0; tail && i < depth; i++) tail[i] = up[depth - 1 - i];
    if (root) *root = r;
    return a->row_pos[r] + depth;
}

void sek_row_attn_store(const sek_row_attn_args *a) {
    const int64_t w = (a->hq + 2 * a->hkv) * a->d;
    for (int64_t r = 0; r < a->r; r++) {
        const int64_t slot = a->row_slot[r], at_row = a->row_pos[r];
        if (slot < 0) continue; /* padding */
        const int64_t pos = row_position(a, r, NULL, NULL);
        const float *row = a->qkv + r * w;
        for (int64_t h = 0; h < a->hkv; h++)
            kv_store(a->k_cache, a->v_cache, a->kv_type, (slot * a->hkv + h) * a->s_max + at_row,
                     row + (a->hq + h) * a->d, row + (a->hq + a->hkv + h) * a->d, a->cos + pos * (a->rot / 2),
                     a->sin + pos * (a->rot / 2), a->d, a->rot);
    }
}

/* Runs of rows: rows next to each other in the step with the same slot (a sequence's draft, say) join one run, cut
 * into chunks of at most rs rows; padding rows are chunks of one. chunk[c] .. chunk[c+1]-1 are chunk c's rows. */
static int64_t row_chunks(const int64_t *slot, int64_t r, int64_t rs, int64_t *chunk) {
    int64_t c = 0;
    for (int64_t i = 0; i < r; c++) {
        if (chunk) chunk[c] = i;
        int64_t j = i + 1;
        while (j < r && j - i < rs && slot[i] >= 0 && slot[j] == slot[i]) j++;
        i = j;
    }
    if (chunk) chunk[c] = r;
    return c;
}

int64_t sek_row_attn_plan(const int64_t *row_slot, int64_t r, int64_t hq, int64_t hkv, int64_t d, int64_t min_items,
                          int64_t *hs, int64_t *chunk) {
    *hs = heads_per_item(r, hq, hkv, d, min_items);
    const int64_t blocks = hq / *hs;
    int64_t rs = 1;
    for (int64_t n = r; n > 1; n--) /* the most rows of one slot an item can hold while the step keeps enough items */
        if (n * *hs <= SEK_Q_MAX && n * *hs * d <= SEK_Q_MAX * 128 &&
            blocks * row_chunks(row_slot, r, n, NULL) >= min_items) {
            rs = n;
            break;
        }
    return blocks * row_chunks(row_slot, r, rs, chunk);
}

/* An item of sek_row_attn_plan's: the rows of chunk item / (hq / hs) (one slot's, or one padding row) x query heads
 * hb*hs .. (hb+1)*hs-1, hb = item % (hq / hs), all of one KV group of the slot. Each query runs attend's arithmetic
 * over its slot's rows 0 .. its position, the same as sek_attn_row's for that query in a step of that slot alone (a
 * B = 1 cache holding the same rows, past_len + t = pos): what else the step or the item holds never changes a
 * query's bits. A padding row's output is zeros. */
void sek_row_attn_item(const sek_row_attn_args *a, int64_t item) {
    const int64_t hs = a->hs, d = a->d, c = item / (a->hq / hs), h0 = item % (a->hq / hs) * hs;
    const int64_t r0 = a->chunk[c], rows = a->chunk[c + 1] - r0, slot = a->row_slot[r0], nq = rows * hs;
    if (slot < 0) {
        memset(a->out + r0 * a->hq * d + h0 * d, 0, (size_t)(hs * d) * sizeof(float));
        return;
    }
    float q[SEK_Q_MAX * 128], acc[SEK_Q_MAX * 128], m[SEK_Q_MAX], l[SEK_Q_MAX];
    int64_t n[SEK_Q_MAX], start[SEK_Q_MAX], direct[SEK_Q_MAX], nmax = 0, tree = 0;
    int64_t tail[SEK_Q_MAX * SEK_TREE_DEPTH]; /* tree rows: each query's ancestors' rows (row_position) */
    for (int64_t p = 0; p < nq; p++) { /* query p: row r0 + p / hs, head h0 + p % hs */
        const int64_t r = r0 + p / hs;
        int64_t root;
        const int64_t pos = row_position(a, r, tail + p * SEK_TREE_DEPTH, &root);
        memcpy(q + p * d, a->qkv + r * (a->hq + 2 * a->hkv) * d + (h0 + p % hs) * d, (size_t)d * sizeof(float));
        rope(q + p * d, a->cos + pos * (a->rot / 2), a->sin + pos * (a->rot / 2), a->rot);
        n[p] = pos + 1;
        start[p] = window_start(a->window, pos);
        direct[p] = a->row_pos[root] + 1; /* rows 0 .. row_pos[root], then the tail */
        tree |= direct[p] != n[p];
        nmax = n[p] > nmax ? n[p] : nmax;
    }
    const int64_t g = h0 / (a->hq / a->hkv);
    const size_t at = (size_t)((slot * a->hkv + g) * a->s_max) * sek_kv_row_bytes(a->kv_type, d);
    const void *kc = (const char *)a->k_cache + at, *vc = (const char *)a->v_cache + at;
    if (tree) {
        float kg[SEK_CHUNK * 128], vg[SEK_CHUNK * 128]; /* d <= 128 for tree rows (checked by the caller) */
        attend_tail(q, kc, vc, a->kv_type, n, start, direct, tail, SEK_TREE_DEPTH, nmax, d, a->scale, a->softcap, nq,
                    hs, m, l, acc, kg, vg);
    } else {
        attend(q, kc, vc, a->kv_type, n, start, nmax, d, a->scale, a->softcap, nq, m, l, acc);
    }
    for (int64_t p = 0; p < nq; p++) {
        float *o = a->out + (r0 + p / hs) * a->hq * d + (h0 + p % hs) * d;
        const float inv = 1.f / l[p];
        for (int64_t k = 0; k < d; k++) o[k] = acc[p * d + k] * inv;
    }
}
