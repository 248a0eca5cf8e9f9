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
 * Speed: a step is split into items of several queries (rows x query heads of one KV group, sek_attn_plan), and the
 * queries of an item that read the same rows of a chunk (the heads of one row) form tiles of up to SEK_QH: each K
 * and V vector is loaded and converted from the cache's type once for the whole tile, four keys' scores per query
 * and a slice of each query's value sums stay in registers (qk_tile, pv_slice), and each query's softmax runs over
 * fixed 64-slot trees (softmax_chunk). A query's operations never depend on what else its tile or item holds, so
 * the plan is free to follow the step's width. What it costs at depth: tools/dev/attn_bench.c, docs/benchmarks.md.
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

/* ---- vectors: 16 fp32 lanes (AVX-512), 8 (AVX2), 4 (NEON), or one (any other machine) ---- */
#if defined(__AVX512F__)
#define SEK_VW 16
#define SEK_QH 6 /* queries a tile holds: 4 keys' scores or 4 value vectors each in registers, with 4 rows' vectors */
typedef __m512 sek_vec;
#define VZERO _mm512_setzero_ps
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VSET1 _mm512_set1_ps
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VMUL _mm512_mul_ps
#define VADD _mm512_add_ps
#define VSUB _mm512_sub_ps
#define VMAX _mm512_max_ps
#elif defined(__AVX2__) && defined(__FMA__)
#define SEK_VW 8
#define SEK_QH 2 /* 16 ymm registers: 2 x 4 sums, 4 rows' vectors, a query's vector */
typedef __m256 sek_vec;
#define VZERO _mm256_setzero_ps
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VSET1 _mm256_set1_ps
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VMUL _mm256_mul_ps
#define VADD _mm256_add_ps
#define VSUB _mm256_sub_ps
#define VMAX _mm256_max_ps
#elif defined(SEK_ATTN_NEON)
#define SEK_VW 4
#define SEK_QH 6 /* 32 q registers, as AVX-512's 32 */
typedef float32x4_t sek_vec;
#define VZERO() vdupq_n_f32(0.f)
#define VLOAD vld1q_f32
#define VSTORE vst1q_f32
#define VSET1 vdupq_n_f32
#define VFMA(a, b, c) vfmaq_f32(c, a, b)
#define VMUL vmulq_f32
#define VADD vaddq_f32
#define VSUB vsubq_f32
#define VMAX vmaxq_f32
#else
#define SEK_VW 1
#define SEK_QH 6
typedef float sek_vec;
#define VZERO() 0.f
#define VLOAD(p) (*(p))
#define VSTORE(p, v) (*(p) = (v))
#define VSET1(x) (x)
#define VFMA(a, b, c) fmaf(a, b, c)
#define VMUL(a, b) ((a) * (b))
#define VADD(a, b) ((a) + (b))
#define VSUB(a, b) ((a) - (b))
#define VMAX(a, b) ((a) > (b) ? (a) : (b))
#endif

/* A vector's lanes summed as a fixed tree: i + (i + 8) (AVX-512), i + (i + 4), i + (i + 2), 0 + 1. */
static inline __attribute__((always_inline)) float vsum(sek_vec u) {
#if SEK_VW == 16
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1));
    const __m256 t3 = _mm256_add_ps(_mm512_castps512_ps256(u), hi);
    const __m128 t6 = _mm_add_ps(_mm256_castps256_ps128(t3), _mm256_extractf128_ps(t3, 1));
    const __m128 t8 = _mm_add_ps(t6, _mm_movehl_ps(t6, t6));
    return _mm_cvtss_f32(_mm_add_ss(t8, _mm_movehdup_ps(t8)));
#elif SEK_VW == 8
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#elif SEK_VW == 4
    return vaddvq_f32(u);
#else
    return u;
#endif
}

/* The largest of a vector's lanes (exact whatever the order). */
static inline __attribute__((always_inline)) float vmaxl(sek_vec u) {
#if SEK_VW == 16
    return _mm512_reduce_max_ps(u);
#elif SEK_VW == 8
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
#elif SEK_VW == 4
    return vmaxvq_f32(u);
#else
    return u;
#endif
}

/* out[c] = the lane sum of u[c] for four vectors at once, each by vsum's tree (the four trees' shuffles shared), so
 * a key's score has the same bits whichever keys share its pass. */
static inline __attribute__((always_inline)) void sum4(const sek_vec *u, float out[4]) {
#if SEK_VW == 16
    /* 128-bit blocks: [u0 lanes 0-7 + 8-15 | u1's], [u2's | u3's]: each key's i + (i + 8) */
    const __m512 v01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    const __m512 v23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
    /* block k: key k's i + (i + 4) */
    const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, 0x88), _mm512_shuffle_f32x4(v01, v23, 0xDD));
    const __m512 e = _mm512_add_ps(w, _mm512_permute_ps(w, 0x4E)); /* lanes 0, 1: i + (i + 2) */
    const __m512 f = _mm512_add_ps(e, _mm512_permute_ps(e, 0xB1)); /* lane 0: 0 + 1 */
    _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0,
                                                                                      0, 0, 0, 0, 0), f)));
#elif SEK_VW == 8
    /* halves: [u0's i + (i + 4) | u1's], [u2's | u3's] */
    const __m256 v01 = _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
    const __m256 v23 = _mm256_add_ps(_mm256_permute2f128_ps(u[2], u[3], 0x20), _mm256_permute2f128_ps(u[2], u[3], 0x31));
    const __m256 e01 = _mm256_add_ps(v01, _mm256_permute_ps(v01, 0x4E)),
                 e23 = _mm256_add_ps(v23, _mm256_permute_ps(v23, 0x4E));
    const __m256 f01 = _mm256_add_ps(e01, _mm256_permute_ps(e01, 0xB1)),
                 f23 = _mm256_add_ps(e23, _mm256_permute_ps(e23, 0xB1));
    /* lane 0 of each half holds a key's score: u0, u1 (f01), u2, u3 (f23) */
    const __m256 g = _mm256_shuffle_ps(f01, f23, 0x00);
    const __m128 lo = _mm256_castps256_ps128(g), hi = _mm256_extractf128_ps(g, 1);
    _mm_storeu_ps(out, _mm_shuffle_ps(_mm_unpacklo_ps(lo, hi), _mm_unpackhi_ps(lo, hi), 0x44));
#elif SEK_VW == 4
    vst1q_f32(out, vpaddq_f32(vpaddq_f32(u[0], u[1]), vpaddq_f32(u[2], u[3]))); /* (0 + 1) + (2 + 3), as vaddvq */
#else
    for (int c = 0; c < 4; c++) out[c] = u[c];
#endif
}

/* p[j] = exp(x[j]) for j < n (x <= 0 here: scores minus their running maximum). Vectorized with a Cephes-style
 * range reduction and degree-6 polynomial (~2 ulp) where AVX512, AVX2 or NEON is available, libm's expf otherwise: the
 * same function for every row on a machine, so rows stay width-invariant. */
static __attribute__((noipa)) void exp_block(const float *x, float *p, int64_t n) {
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

/* Asks for rows j .. j+n-1 from pf (rb bytes a row; none if pf is NULL) into L2: the next chunk's, a few rows as
 * each of this chunk's is read, so the memory delivers them while this chunk's arithmetic runs rather than after it.
 * Into L1 instead (locality 3) measured slower on Zen 4 (tools/dev/attn_bench.c, depth 8,192). */
static inline __attribute__((always_inline)) void prefetch(const char *pf, int64_t j, int64_t n, size_t rb) {
    if (!pf) return;
    for (const char *p = pf + (size_t)j * rb, *e = p + (size_t)n * rb; p < e; p += 64) __builtin_prefetch(p, 0, 2);
}

/* A new row's k (rotated by its position, less the head's shift if there is one) and v into cache row `at`. */
static void kv_store(void *kc, void *vc, int type, int64_t at, const float *k, const float *v, const float *cs,
                     const float *sn, int64_t d, int64_t rot, const float *shift) {
    float r[512]; /* d <= 512 (checked by the callers) */
    memcpy(r, k, (size_t)d * sizeof(float));
    rope(r, cs, sn, rot);
    if (shift)
        for (int64_t i = 0; i < d; i++) r[i] -= shift[i];
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
                     a->rot, a->k_shift ? a->k_shift + h * a->d : NULL);
    }
}

/* ---- one chunk of the online softmax, for a tile of queries with the same rows ---- */

/* An int8 row's scale (sek.h: its fp32 after the d levels). */
static inline float i8_scale(const char *row, int64_t d) {
    float s;
    memcpy(&s, row + d, sizeof s);
    return s;
}

/* SEK_VW elements of a cache row (d elements) from element i as fp32: fp32 as it is, fp16 exactly (every fp16 is an
 * fp32), int8 as q * scale, the same product on every path; so a cache of any type is read as the fp32 values it
 * holds. type is a constant wherever this is inlined. */
static inline __attribute__((always_inline)) sek_vec kv_vec(const char *row, const int type, int64_t i, int64_t d) {
    if (type == SEK_KV_F16) {
        const uint16_t *h = (const uint16_t *)row + i;
#if SEK_VW == 16
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
#elif SEK_VW == 8 && defined(__F16C__)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
#elif SEK_VW == 4
        return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h)));
#else
        float t[SEK_VW];
        for (int k = 0; k < SEK_VW; k++) t[k] = sek_f16_to_f32(h[k]);
        return VLOAD(t);
#endif
    }
    if (type == SEK_KV_I8) {
        const int8_t *q = (const int8_t *)row + i;
        const sek_vec sc = VSET1(i8_scale(row, d));
#if SEK_VW == 16
        return VMUL(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), sc);
#elif SEK_VW == 8
        return VMUL(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q))), sc);
#elif SEK_VW == 4 /* 8 bytes read, 4 used: at the row's last 4 levels the other 4 are its scale's */
        return VMUL(vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vld1_s8(q))))), sc);
#else
        return (float)q[0] * sc;
#endif
    }
    return VLOAD((const float *)row + i);
}

/* Element i of a cache row as kv_vec has it. */
static inline __attribute__((always_inline)) float kv_elem(const char *row, const int type, int64_t i, int64_t d) {
    if (type == SEK_KV_F16) return sek_f16_to_f32(((const uint16_t *)row)[i]);
    if (type == SEK_KV_I8) return (float)((const int8_t *)row)[i] * i8_scale(row, d);
    return ((const float *)row)[i];
}

#define SEK_NK 4 /* keys a score pass takes at once */
#define SEK_NV 4 /* value vectors a pass over the rows holds per query */

/* s[h][j] for the nh queries q [nh][d] and the chunk's rows j = j0 .. j1-1 (kb: its row 0, rb bytes a row): per
 * query and key, one fma chain a lane over the head's SEK_VW-wide pieces in order, sum4's tree over the lanes, then
 * the head's last d % SEK_VW elements one at a time, times `scale`. Each key's row is loaded (and converted) once
 * for all the queries; what a score is never depends on the other queries or keys. */
static inline __attribute__((always_inline)) void qk_tile(const float *q, const char *kb, size_t rb, const int type,
                                                         int64_t j0, int64_t j1, int64_t d, float scale,
                                                         float (*s)[SEK_CHUNK], const char *pf, const int nh) {
    const int64_t dv = d - d % SEK_VW;
    for (int64_t j = j0; j < j1; j += SEK_NK) {
        const int64_t nk = j1 - j < SEK_NK ? j1 - j : SEK_NK;
        prefetch(pf, j, nk, rb);
        const char *row[SEK_NK];
        for (int c = 0; c < SEK_NK; c++) row[c] = kb + (size_t)(j + (c < nk ? c : 0)) * rb; /* past j1: row j again */
        sek_vec acc[SEK_QH][SEK_NK];
        for (int h = 0; h < nh; h++)
            for (int c = 0; c < SEK_NK; c++) acc[h][c] = VZERO();
        for (int64_t i = 0; i < dv; i += SEK_VW) {
            sek_vec k[SEK_NK];
            for (int c = 0; c < SEK_NK; c++) k[c] = kv_vec(row[c], type, i, d);
            for (int h = 0; h < nh; h++) {
                const sek_vec x = VLOAD(q + h * d + i);
                for (int c = 0; c < SEK_NK; c++) acc[h][c] = VFMA(x, k[c], acc[h][c]);
            }
        }
        for (int h = 0; h < nh; h++) {
            float o[SEK_NK];
            sum4(acc[h], o);
            for (int64_t c = 0; c < nk; c++) {
                float t = o[c];
                for (int64_t i = dv; i < d; i++) t = fmaf(q[h * d + i], kv_elem(row[c], type, i, d), t);
                s[h][j + c] = t * scale;
            }
        }
    }
}

/* Dims i0 .. i0 + nv SEK_VW - 1 of the nh queries' value sums acc [nh][d]: acc * alpha[h], then + w[h][j] v_j for
 * the chunk's rows j = j0 .. j1-1 in order (vb: its row 0), the sums held in registers across the rows and each
 * row's vectors loaded (and converted) once for all the queries. */
static inline __attribute__((always_inline)) void pv_slice(float *acc, const char *vb, size_t rb, const int type,
                                                          int64_t j0, int64_t j1, int64_t d, int64_t i0,
                                                          float (*w)[SEK_CHUNK], const float *alpha, const char *pf,
                                                          const int nh, const int nv) {
    sek_vec a[SEK_QH][SEK_NV];
    for (int h = 0; h < nh; h++)
        for (int v = 0; v < nv; v++) a[h][v] = VMUL(VLOAD(acc + h * d + i0 + v * SEK_VW), VSET1(alpha[h]));
    for (int64_t j = j0; j < j1; j++) {
        const char *row = vb + (size_t)j * rb;
        prefetch(pf, j, 1, rb);
        sek_vec x[SEK_NV];
        for (int v = 0; v < nv; v++) x[v] = kv_vec(row, type, i0 + v * SEK_VW, d);
        for (int h = 0; h < nh; h++) {
            const sek_vec p = VSET1(w[h][j]);
            for (int v = 0; v < nv; v++) a[h][v] = VFMA(p, x[v], a[h][v]);
        }
    }
    for (int h = 0; h < nh; h++)
        for (int v = 0; v < nv; v++) VSTORE(acc + h * d + i0 + v * SEK_VW, a[h][v]);
}

/* Every dim of the nh queries' value sums, as pv_slice does it (the head's last d % SEK_VW dims one at a time, in
 * the same order: acc * alpha, then one fma a row). */
static inline __attribute__((always_inline)) void pv_tile(float *acc, const char *vb, size_t rb, const int type,
                                                         int64_t j0, int64_t j1, int64_t d, float (*w)[SEK_CHUNK],
                                                         const float *alpha, const char *pf, const int nh) {
    const int64_t dv = d - d % SEK_VW;
    int64_t i = 0;
    for (; i + SEK_NV * SEK_VW <= dv; i += SEK_NV * SEK_VW) {
        pv_slice(acc, vb, rb, type, j0, j1, d, i, w, alpha, pf, nh, SEK_NV);
        pf = NULL; /* the first slice asks for the next chunk's rows */
    }
    switch ((dv - i) / SEK_VW) {
    case 1: pv_slice(acc, vb, rb, type, j0, j1, d, i, w, alpha, pf, nh, 1); break;
    case 2: pv_slice(acc, vb, rb, type, j0, j1, d, i, w, alpha, pf, nh, 2); break;
    case 3: pv_slice(acc, vb, rb, type, j0, j1, d, i, w, alpha, pf, nh, 3); break;
    default: break;
    }
    for (i = dv; i < d; i++)
        for (int h = 0; h < nh; h++) {
            float t = acc[h * d + i] * alpha[h];
            for (int64_t j = j0; j < j1; j++) t = fmaf(w[h][j], kv_elem(vb + (size_t)j * rb, type, i, d), t);
            acc[h * d + i] = t;
        }
}

/* One query's online-softmax step over its scores s[lo .. cn-1] of a chunk (s: SEK_CHUNK slots, the rest set to
 * -inf here): the chunk's maximum, the new running maximum m, alpha (the earlier chunks' rescale; 0 before the
 * query's first chunk, where m is still -inf), the exps of the scores less m into w (exactly 0 outside lo .. cn-1:
 * exp_block clamps at -87), and l = l * alpha + their sum, a fixed tree over the SEK_CHUNK slots. */
static void softmax_chunk(float *s, float *w, int64_t lo, int64_t cn, float *m, float *l, float *alpha) {
    for (int64_t j = 0; j < lo; j++) s[j] = -INFINITY;
    for (int64_t j = cn; j < SEK_CHUNK; j++) s[j] = -INFINITY;
    sek_vec mx = VLOAD(s);
    for (int k = SEK_VW; k < SEK_CHUNK; k += SEK_VW) mx = VMAX(mx, VLOAD(s + k));
    const float mc = vmaxl(mx), m_new = mc > *m ? mc : *m;
    *alpha = *m == -INFINITY ? 0.f : expf(*m - m_new);
    const sek_vec mv = VSET1(m_new);
    for (int k = 0; k < SEK_CHUNK; k += SEK_VW) VSTORE(s + k, VSUB(VLOAD(s + k), mv));
    exp_block(s, w, SEK_CHUNK);
    for (int64_t j = 0; j < lo; j++) w[j] = 0.f;
    for (int64_t j = cn; j < SEK_CHUNK; j++) w[j] = 0.f;
    sek_vec t[SEK_CHUNK / SEK_VW];
    for (int k = 0; k < SEK_CHUNK / SEK_VW; k++) t[k] = VLOAD(w + k * SEK_VW);
    for (int n = SEK_CHUNK / SEK_VW; n > 1; n /= 2)
        for (int k = 0; k < n / 2; k++) t[k] = VADD(t[2 * k], t[2 * k + 1]);
    *l = *l * *alpha + vsum(t[0]);
    *m = m_new;
}

/* A chunk for the nh queries q [nh][d] of a tile, which read the same rows lo .. cn-1 of it (kb, vb: the chunk's
 * row 0 of K and V): their scores, soft-capped (c tanh(s / c), libm's tanhf) where softcap > 0, each query's
 * softmax step, then the value sums. */
static inline __attribute__((always_inline)) void tile_chunk(const float *q, const char *kb, const char *vb,
                                                            size_t rb, const int type, int64_t lo, int64_t cn,
                                                            int64_t d, float scale, float softcap, float *m, float *l,
                                                            float *acc, const char *pk, const char *pv,
                                                            const int nh) {
    float s[SEK_QH][SEK_CHUNK], w[SEK_QH][SEK_CHUNK], alpha[SEK_QH];
    qk_tile(q, kb, rb, type, lo, cn, d, scale, s, pk, nh);
    for (int h = 0; h < nh; h++) {
        if (softcap > 0.f)
            for (int64_t j = lo; j < cn; j++) s[h][j] = softcap * tanhf(s[h][j] / softcap);
        softmax_chunk(s[h], w[h], lo, cn, m + h, l + h, alpha + h);
    }
    pv_tile(acc, vb, rb, type, lo, cn, d, w, alpha, pv, nh);
}

#define SEK_TILE_CASE(T, N)                                                                                            \
    case N: tile_chunk(q, kb, vb, rb, T, lo, cn, d, scale, softcap, m, l, acc, pk, pv, N); break;
#if SEK_QH > 2
#define SEK_TILE_CASES(T)                                                                                              \
    SEK_TILE_CASE(T, 1) SEK_TILE_CASE(T, 2) SEK_TILE_CASE(T, 3) SEK_TILE_CASE(T, 4) SEK_TILE_CASE(T, 5)              \
    SEK_TILE_CASE(T, 6)
#else
#define SEK_TILE_CASES(T) SEK_TILE_CASE(T, 1) SEK_TILE_CASE(T, 2)
#endif

/* tile_chunk for a tile of nh <= SEK_QH queries, compiled for each cache type and tile size. */
static void tile(const float *q, const char *kb, const char *vb, size_t rb, int type, int64_t lo, int64_t cn,
                 int64_t d, float scale, float softcap, float *m, float *l, float *acc, const char *pk,
                 const char *pv, int nh) {
    if (type == SEK_KV_F16) {
        switch (nh) { SEK_TILE_CASES(SEK_KV_F16) }
    } else if (type == SEK_KV_I8) {
        switch (nh) { SEK_TILE_CASES(SEK_KV_I8) }
    } else {
        switch (nh) { SEK_TILE_CASES(SEK_KV_F32) }
    }
}

/* One chunk (cache rows c0 .. c0+cn[p]-1 of kc, vc, which hold `type`) of the online softmax for the nq queries
 * (row, head) of an item, all of one KV group; m, l, acc carry each query's state (m -inf before its first chunk), a
 * query whose row ends before c0 or whose window starts after the chunk has cn[p] <= 0, and one whose window starts
 * inside it skips its first lo[p] rows. Queries next to each other with the same rows of the chunk (the heads of one
 * row) form tiles of up to SEK_QH, which take the chunk's K and V rows from memory once for all of them; a query's
 * arithmetic is tile_chunk's whatever its tile holds, so its bits are those it has alone. The first tile asks for
 * the next chunk's rows (when that chunk lies whole below row `end`, the rows the item reads) as it reads this
 * chunk's. */
static void attend_chunk(const float *q, const void *kc, const void *vc, int type, int64_t c0, int64_t end,
                         const int64_t *cn, const int64_t *lo, int64_t d, float scale, float softcap, int64_t nq,
                         float *m, float *l, float *acc) {
    const size_t rb = sek_kv_row_bytes(type, d);
    const char *kb = (const char *)kc + (size_t)c0 * rb, *vb = (const char *)vc + (size_t)c0 * rb;
    const int ahead = c0 + 2 * SEK_CHUNK <= end; /* the next chunk is whole and read */
    const char *pk = ahead ? kb + SEK_CHUNK * rb : NULL, *pv = ahead ? vb + SEK_CHUNK * rb : NULL;
    for (int64_t p = 0; p < nq;) {
        int64_t nt = 1;
        while (nt < SEK_QH && p + nt < nq && cn[p + nt] == cn[p] && lo[p + nt] == lo[p]) nt++;
        if (cn[p] > lo[p]) {
            tile(q + p * d, kb, vb, rb, type, lo[p], cn[p], d, scale, softcap, m + p, l + p, acc + p * d, pk, pv,
                 (int)nt);
            pk = pv = NULL; /* the first tile asks for them */
        }
        p += nt;
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
    for (int64_t p = 0; p < nq; p++) {
        m[p] = -INFINITY;
        l[p] = 0.f;
    }
    memset(acc, 0, (size_t)(nq * d) * sizeof(float));
    for (int64_t c0 = first_chunk(start, nq); c0 < nmax; c0 += SEK_CHUNK) {
        chunk_rows(n, start, c0, nq, cn, lo);
        attend_chunk(q, kc, vc, type, c0, nmax, cn, lo, d, scale, softcap, nq, m, l, acc);
    }
}

/* attend for queries whose rows are not all the cache's first ones (tree rows): query p's row i is cache row i for
 * i < direct[p], then tail[p][i - direct[p]]; queries come in groups of hs (the heads of one step row) that share n,
 * direct and tail. A chunk whose rows are all direct runs for every such query at once, as attend runs it; a chunk
 * with tail rows is gathered once per group into kg, vg (SEK_CHUNK cache rows, as the cache holds them) and runs for
 * that group alone. attend_chunk's
 * arithmetic per query never depends on the other queries, so each query has the bits attend gives it over a cache
 * that holds its rows in order: those of the same tokens decoded as one chain. */
static void attend_tail(const float *q, const void *kc, const void *vc, int type, const int64_t *n,
                        const int64_t *start, const int64_t *direct, const int64_t *tail, int64_t tail_stride,
                        int64_t nmax, int64_t d, float scale, float softcap, int64_t nq, int64_t hs, float *m,
                        float *l, float *acc, char *kg, char *vg) {
    int64_t cn[SEK_Q_MAX] = {0}, lo[SEK_Q_MAX] = {0}, len[SEK_Q_MAX]; /* cn, lo: set before use (GCC cannot tell) */
    const size_t rb = sek_kv_row_bytes(type, d);
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
        attend_chunk(q, kc, vc, type, c0, nmax, cn, lo, d, scale, softcap, nq, m, l, acc);
        for (int64_t p = 0; gathered && p < nq; p += hs) {
            const int64_t rows = len[p];
            if (rows <= 0 || c0 + rows <= direct[p]) continue;
            for (int64_t j = 0; j < rows; j++) {
                const int64_t i = c0 + j, row = i < direct[p] ? i : tail[p * tail_stride + i - direct[p]];
                memcpy(kg + (size_t)j * rb, (const char *)kc + (size_t)row * rb, rb);
                memcpy(vg + (size_t)j * rb, (const char *)vc + (size_t)row * rb, rb);
            }
            attend_chunk(q + p * d, kg, vg, type, 0, 0, len + p, lo + p, d, scale, softcap, hs, m + p, l + p,
                         acc + p * d);
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
                     a->sin + pos * (a->rot / 2), a->d, a->rot, a->k_shift ? a->k_shift + h * a->d : NULL);
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
        char kg[SEK_CHUNK * 128 * sizeof(float)], vg[SEK_CHUNK * 128 * sizeof(float)]; /* d <= 128 for tree rows */
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
