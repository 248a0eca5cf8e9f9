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
 * Used through sek_ort.c (ai.specedge::SekAttention).
 */
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
#define SEK_DMAX 512


/* x [d] rotated in place by position pos (rotate-half: pairs i, i + d/2). */
static void rope(float *x, const float *cs, const float *sn, int64_t d) {
    const int64_t h = d / 2;
    for (int64_t i = 0; i < h; i++) {
        const float a = x[i], b = x[i + h], c = cs[i], s = sn[i];
        x[i] = a * c - b * s;
        x[i + h] = b * c + a * s;
    }
}

static float dot(const float *a, const float *b, int64_t d) {
#if defined(__AVX512F__)
    if (d % 16 == 0) {
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 32 <= d; i += 32) {
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
            s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
        }
        if (i < d) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (d % 8 == 0) {
        __m256 s0 = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
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

/* Writes the step's new k and v rows (k rotated) into the cache. Call once per step before the rows. */
void sek_attn_store(const sek_attn_args *a) {
    const int64_t w = (a->hq + 2 * a->hkv) * a->d;
    for (int64_t t = 0; t < a->t; t++) {
        const int64_t pos = a->past_len + t;
        const float *row = a->qkv + t * w;
        for (int64_t h = 0; h < a->hkv; h++) {
            float *k = a->k_cache + (h * a->s_max + pos) * a->d;
            memcpy(k, row + (a->hq + h) * a->d, (size_t)a->d * sizeof(float));
            rope(k, a->cos + pos * (a->d / 2), a->sin + pos * (a->d / 2), a->d);
            memcpy(a->v_cache + (h * a->s_max + pos) * a->d, row + (a->hq + a->hkv + h) * a->d,
                   (size_t)a->d * sizeof(float));
        }
    }
}

/* One (row, query head) item: item = t * hq + h. */
void sek_attn_row(const sek_attn_args *a, int64_t item) {
    const int64_t t = item / a->hq, h = item % a->hq, d = a->d, g = h / (a->hq / a->hkv);
    const int64_t pos = a->past_len + t, n = pos + 1;
    float q[SEK_DMAX], acc[SEK_DMAX], s[SEK_CHUNK], pr[SEK_CHUNK];
    memcpy(q, a->qkv + t * (a->hq + 2 * a->hkv) * d + h * d, (size_t)d * sizeof(float));
    rope(q, a->cos + pos * (d / 2), a->sin + pos * (d / 2), d);
    memset(acc, 0, (size_t)d * sizeof(float));
    const float *kc = a->k_cache + g * a->s_max * d, *vc = a->v_cache + g * a->s_max * d;
    float m = -INFINITY, l = 0.f;
    for (int64_t c0 = 0; c0 < n; c0 += SEK_CHUNK) {
        const int64_t cn = n - c0 < SEK_CHUNK ? n - c0 : SEK_CHUNK;
        float mc = -INFINITY;
        for (int64_t j = 0; j < cn; j++) {
            s[j] = dot(q, kc + (c0 + j) * d, d) * a->scale;
            mc = s[j] > mc ? s[j] : mc;
        }
        const float m_new = mc > m ? mc : m;
        float alpha = c0 == 0 ? 0.f : expf(m - m_new); /* the earlier chunks' rescale (none before the first) */
        l *= alpha;
        for (int64_t j = 0; j < cn; j++) s[j] -= m_new;
        exp_block(s, pr, cn);
        for (int64_t j = 0; j < cn; j++) {
            l += pr[j];
            axpby(acc, alpha, pr[j], vc + (c0 + j) * d, d);
            alpha = 1.f;
        }
        m = m_new;
    }
    float *o = a->out + t * a->hq * d + h * d;
    const float inv = 1.f / l;
    for (int64_t i = 0; i < d; i++) o[i] = acc[i] * inv;
}
