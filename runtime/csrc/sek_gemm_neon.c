/* specedge's row-invariant GEMM on Arm (AArch64) NEON: the same integers and fp32 operations, in the same order, as
 * sek_gemm.c's portable reference (whose first comment documents the arithmetic and the packed layout), so the
 * outputs are bitwise the reference's; with Armv8.2 dot products (sdot) or without them (Armv8.0). Checked under
 * qemu against the reference on x86 (tools/dev/sek_isa_check.c, tests/runtime/test_sek_kernel.py). Elsewhere this
 * file compiles to nothing. */
#include <stdint.h>
#include <string.h>

#include "sek_gemm_impl.h"
#ifdef SEK_HAVE_NEON
#include <arm_neon.h>

/* rows per pass: R x 4 int32 accumulators + R activation vectors + one unpacked chunk fit the 32 vector registers */
#define SEK_RN 5

/* acc += the four 4-byte dot products of w's lanes with lane `lane` (4 bytes) of a: sdot where the CPU has it (Armv8.2
 * dot products: Cortex-A55/A76/A78, Jetson Orin and Xavier, Raspberry Pi 5), else widening multiplies and pairwise
 * adds (Armv8.0: Cortex-A53/A57/A72, Jetson Nano and TX2, Raspberry Pi 4). Exact either way: levels are <= 63 here
 * (8-bit ones are split into nibbles), so every product fits int16 and every sum int32. */
#ifdef __ARM_FEATURE_DOTPROD
#define SEK_SDOT(acc, w, a, lane) vdotq_laneq_s32((acc), (w), (a), (lane))
#else
static inline __attribute__((always_inline)) int32x4_t sdot_v80(int32x4_t acc, int8x16_t w, int8x16_t a) {
    const int16x8_t lo = vmull_s8(vget_low_s8(w), vget_low_s8(a)), hi = vmull_s8(vget_high_s8(w), vget_high_s8(a));
    return vaddq_s32(acc, vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)));
}
#define SEK_SDOT(acc, w, a, lane) \
    sdot_v80((acc), (w), vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8(a), (lane))))
#endif

int sek_quantize_block_neon(const float *a, int64_t blk, int8_t *q, float *sa, float *sasum) {
    float32x4_t vm = vdupq_n_f32(0.f);
    uint32x4_t finite = vdupq_n_u32(~0u);
    for (int64_t i = 0; i < blk; i += 4) {
        const float32x4_t v = vabsq_f32(vld1q_f32(a + i));
        finite = vandq_u32(finite, vcleq_f32(v, vdupq_n_f32(3.402823466e+38f))); /* false for NaN and inf */
        vm = vmaxq_f32(vm, v);
    }
    const float mx = vmaxvq_f32(vm);
    if (vminvq_u32(finite) == 0 || !(mx >= SEK_TINY)) return 0;
    const float inv = 127.f / mx; /* the reference's operations: x = a * inv, clamped, rounded half to even */
    const float32x4_t lim = vdupq_n_f32(127.f), nlim = vdupq_n_f32(-127.f);
    int32x4_t vs = vdupq_n_s32(0);
    for (int64_t i = 0; i < blk; i += 8) {
        int32x4_t qi[2];
        for (int h = 0; h < 2; h++) {
            const float32x4_t x = vminq_f32(vmaxq_f32(vmulq_n_f32(vld1q_f32(a + i + 4 * h), inv), nlim), lim);
            qi[h] = vcvtq_s32_f32(vrndnq_f32(x)); /* FRINTN: ties to even whatever the rounding mode */
            vs = vaddq_s32(vs, qi[h]);
        }
        vst1_s8(q + i, vqmovn_s16(vcombine_s16(vqmovn_s32(qi[0]), vqmovn_s32(qi[1]))));
    }
    *sa = mx / 127.f;
    *sasum = *sa * (float)vaddvq_s32(vs);
    return 1;
}

/* Four consecutive int8 values (scales, mins) widened to int32. */
static inline __attribute__((always_inline)) int32x4_t widen4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(v)))));
}

/* The 16 activation bytes at offset `at` of each of R rows (row stride K). */
static inline __attribute__((always_inline)) void rows16(int8x16_t a[SEK_RN], const int8_t *qa, int64_t K, int64_t at,
                                                        const int R) {
    SEK_UNROLL
    for (int r = 0; r < R; r++) a[r] = vld1q_s8(qa + r * K + at);
}

/* The low and high nibbles of the 16 bytes at p, as levels 0..15. */
static inline __attribute__((always_inline)) void nibbles(const uint8_t *p, int8x16_t *lo, int8x16_t *hi) {
    const uint8x16_t v = vld1q_u8(p);
    *lo = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(15)));
    *hi = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
}

/* acc[r][i] += the exact integer dot products of block b for R rows (qa, row stride K), columns 4i..4i+3 of a tile:
 * each 16-byte quarter of a 64-byte chunk (four columns x 4 k) is unpacked once for every row. */
static inline __attribute__((always_inline)) void dots_neon(const sek_weights *w, const int8_t *qa, int64_t K,
                                                           int64_t b, const int R, int64_t tile,
                                                           int32x4_t acc[SEK_RN][4]) {
    const int64_t nb = w->k / w->blk, blk = w->blk, bstride = blk * SEK_TILE * w->bits / 8;
    const uint8_t *bp = w->b + (tile * nb + b) * bstride;
    prefetch_block(bp, bstride);
    if (w->bits == 4) { /* chunk j: k = 8j + 0..3 (low nibbles), 8j + 4..7 (high); two chunks per activation load */
        for (int64_t j = 0; j < blk / 8; j += 2) {
            int8x16_t a[SEK_RN];
            rows16(a, qa, K, b * blk + 8 * j, R);
            SEK_UNROLL
            for (int jj = 0; jj < 2; jj++)
                SEK_UNROLL
                for (int i = 0; i < 4; i++) {
                    int8x16_t lo, hi;
                    nibbles(bp + (j + jj) * 64 + 16 * i, &lo, &hi);
                    SEK_UNROLL
                    for (int r = 0; r < R; r++) {
                        acc[r][i] = SEK_SDOT(acc[r][i], lo, a[r], 2 * jj);
                        acc[r][i] = SEK_SDOT(acc[r][i], hi, a[r], 2 * jj + 1);
                    }
                }
        }
    } else if (w->bits == 6) { /* group h of chunks X, Y, Z: k = 16h + 0..3, 4..7, 8..11; 12..15 from the top bits */
        for (int64_t h = 0; h < blk / 16; h++) {
            int8x16_t a[SEK_RN];
            rows16(a, qa, K, b * blk + 16 * h, R);
            SEK_UNROLL
            for (int i = 0; i < 4; i++) {
                const uint8_t *c0 = bp + 3 * h * 64 + 16 * i;
                const uint8x16_t x = vld1q_u8(c0), y = vld1q_u8(c0 + 64), z = vld1q_u8(c0 + 128), m63 = vdupq_n_u8(63);
                const int8x16_t q[4] = {
                    vreinterpretq_s8_u8(vandq_u8(x, m63)), vreinterpretq_s8_u8(vandq_u8(y, m63)),
                    vreinterpretq_s8_u8(vandq_u8(z, m63)),
                    vreinterpretq_s8_u8(vorrq_u8(vorrq_u8(vshlq_n_u8(vshrq_n_u8(x, 6), 4),
                                                          vshlq_n_u8(vshrq_n_u8(y, 6), 2)),
                                                 vshrq_n_u8(z, 6)))};
                SEK_UNROLL
                for (int r = 0; r < R; r++) {
                    acc[r][i] = SEK_SDOT(acc[r][i], q[0], a[r], 0);
                    acc[r][i] = SEK_SDOT(acc[r][i], q[1], a[r], 1);
                    acc[r][i] = SEK_SDOT(acc[r][i], q[2], a[r], 2);
                    acc[r][i] = SEK_SDOT(acc[r][i], q[3], a[r], 3);
                }
            }
        }
    } else { /* 8-bit, chunk g: k = 4g + 0..3; a level is lo + 16 hi, its nibbles dotted apart; four chunks a load */
        for (int64_t g = 0; g < blk / 4; g += 4) {
            int8x16_t a[SEK_RN];
            rows16(a, qa, K, b * blk + 4 * g, R);
            SEK_UNROLL
            for (int gg = 0; gg < 4; gg++)
                SEK_UNROLL
                for (int i = 0; i < 4; i++) {
                    int8x16_t lo, hi;
                    nibbles(bp + (g + gg) * 64 + 16 * i, &lo, &hi);
                    SEK_UNROLL
                    for (int r = 0; r < R; r++) {
                        const int32x4_t dh = SEK_SDOT(vdupq_n_s32(0), hi, a[r], gg);
                        acc[r][i] = vaddq_s32(SEK_SDOT(acc[r][i], lo, a[r], gg), vshlq_n_s32(dh, 4));
                    }
                }
        }
    }
}

/* R rows x one tile: tile_scalar's fp32 operations, four columns at a time (the sums in memory between blocks). */
static inline __attribute__((always_inline)) void tile_neon(const sek_rows *x, const sek_weights *w, float *y,
                                                           int64_t ldy, int64_t r0, const int R, int64_t tile) {
    const int64_t nb = w->k / w->blk, K = x->k;
    const int8_t *qa = x->qa + r0 * K;
    const float *sa = x->sa + r0 * nb, *sasum = x->sasum + r0 * nb;
    float yv[SEK_RN][SEK_TILE] __attribute__((aligned(16)));
    memset(yv, 0, sizeof yv);
    for (int64_t b = 0; b < nb; b++) {
        int32x4_t acc[SEK_RN][4];
        SEK_UNROLL
        for (int r = 0; r < R; r++)
            SEK_UNROLL
            for (int i = 0; i < 4; i++) acc[r][i] = vdupq_n_s32(0);
        dots_neon(w, qa, K, b, R, tile, acc);
        const int64_t o = blk_off(w, tile, b);
        SEK_UNROLL
        for (int i = 0; i < 4; i++) {
            const float32x4_t s = vld1q_f32(w->s + o + 4 * i);
            float32x4_t zs;
            if (w->zs) {
                zs = vld1q_f32(w->zs + o + 4 * i);
            } else {
                const uint8_t *z = w->z + o + 4 * i;
                const float zf[4] = {(float)z[0], (float)z[1], (float)z[2], (float)z[3]};
                zs = vmulq_f32(vld1q_f32(zf), s);
            }
            SEK_UNROLL
            for (int r = 0; r < R; r++) {
                const float32x4_t v = vfmaq_f32(vld1q_f32(yv[r] + 4 * i), vcvtq_f32_s32(acc[r][i]),
                                                vmulq_n_f32(s, sa[r * nb + b]));
                vst1q_f32(yv[r] + 4 * i, vfmsq_f32(v, zs, vdupq_n_f32(sasum[r * nb + b])));
            }
        }
    }
    SEK_UNROLL
    for (int r = 0; r < R; r++) memcpy(y + (r0 + r) * ldy + tile * SEK_TILE, yv[r], sizeof yv[r]);
}

/* Two-level scales: tile_sb_scalar's arithmetic for R rows of one tile (I and M in memory between blocks). */
static inline __attribute__((always_inline)) void tile_sb_neon(const sek_rows *x, const sek_weights *w, float *y,
                                                              int64_t ldy, int64_t r0, const int R, int64_t tile) {
    const int64_t nb = w->k / w->blk, per = w->sblk / w->blk, nsb = w->k / w->sblk, K = x->k;
    const int8_t *qa = x->qa + r0 * K;
    const int16_t *bsum = x->bsum + r0 * nb;
    const float *sa = x->sa + r0 * nsb;
    const int8_t *mv = w->mn ? w->mn : w->sc;
    float yv[SEK_RN][SEK_TILE] __attribute__((aligned(16)));
    int32_t i1[SEK_RN][SEK_TILE] __attribute__((aligned(16))), mm[SEK_RN][SEK_TILE] __attribute__((aligned(16)));
    memset(yv, 0, sizeof yv);
    for (int64_t sb = 0; sb < nsb; sb++) {
        memset(i1, 0, sizeof i1);
        memset(mm, 0, sizeof mm);
        for (int64_t b = sb * per; b < (sb + 1) * per; b++) {
            int32x4_t acc[SEK_RN][4];
            SEK_UNROLL
            for (int r = 0; r < R; r++)
                SEK_UNROLL
                for (int i = 0; i < 4; i++) acc[r][i] = vdupq_n_s32(0);
            dots_neon(w, qa, K, b, R, tile, acc);
            const int64_t o = blk_off(w, tile, b);
            SEK_UNROLL
            for (int i = 0; i < 4; i++) {
                const int32x4_t scv = widen4(w->sc + o + 4 * i), mvv = widen4(mv + o + 4 * i);
                SEK_UNROLL
                for (int r = 0; r < R; r++) {
                    vst1q_s32(i1[r] + 4 * i, vmlaq_s32(vld1q_s32(i1[r] + 4 * i), acc[r][i], scv));
                    vst1q_s32(mm[r] + 4 * i, vmlaq_n_s32(vld1q_s32(mm[r] + 4 * i), mvv, bsum[r * nb + b]));
                }
            }
        }
        const int64_t so = (tile * nsb + sb) * SEK_TILE;
        float dv[SEK_TILE], dmv[SEK_TILE];
        for (int c = 0; c < SEK_TILE; c++) {
            dv[c] = half_to_float(w->d[so + c]);
            dmv[c] = w->mn ? half_to_float(w->dmin[so + c]) : 0.f;
        }
        SEK_UNROLL
        for (int r = 0; r < R; r++) {
            const float s = sa[r * nsb + sb];
            SEK_UNROLL
            for (int i = 0; i < 4; i++) {
                const float32x4_t ds = vmulq_n_f32(vld1q_f32(dv + 4 * i), s);
                const int32x4_t ii = vld1q_s32(i1[r] + 4 * i), m = vld1q_s32(mm[r] + 4 * i);
                float32x4_t v = vld1q_f32(yv[r] + 4 * i);
                if (w->mn) {
                    v = vfmaq_f32(v, vcvtq_f32_s32(ii), ds);
                    v = vfmsq_f32(v, vcvtq_f32_s32(m), vmulq_n_f32(vld1q_f32(dmv + 4 * i), s));
                } else {
                    v = vfmaq_f32(v, vcvtq_f32_s32(vmlsq_n_s32(ii, m, w->zconst)), ds);
                }
                vst1q_f32(yv[r] + 4 * i, v);
            }
        }
    }
    SEK_UNROLL
    for (int r = 0; r < R; r++) memcpy(y + (r0 + r) * ldy + tile * SEK_TILE, yv[r], sizeof yv[r]);
}

/* Tiles [t0, t1), the rows in passes of up to SEK_RN. */
void sek_tiles_neon(const sek_rows *x, const sek_weights *w, float *y, int64_t ldy, int64_t t0, int64_t t1) {
    const int sb = w->sc != NULL;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t r0 = 0; r0 < x->m; r0 += SEK_RN) {
            const int R = x->m - r0 < SEK_RN ? (int)(x->m - r0) : SEK_RN;
#define SEK_CASE(RR)                                      \
    case RR:                                              \
        if (sb)                                           \
            tile_sb_neon(x, w, y, ldy, r0, RR, t);        \
        else                                              \
            tile_neon(x, w, y, ldy, r0, RR, t);           \
        break;
            switch (R) { SEK_CASE(1) SEK_CASE(2) SEK_CASE(3) SEK_CASE(4) SEK_CASE(5) }
#undef SEK_CASE
        }
}
#endif
