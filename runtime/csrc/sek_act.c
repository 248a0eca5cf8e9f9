/* The elementwise work fused into SekMatMul's output (sek_ort.c): SwiGLU, silu(gate) * up.
 *
 * silu(g) = g / (1 + e^-g), with e^x computed here rather than by libm, so the loop vectorizes (a libm call per
 * element cost more than the op it replaces) and gives the same bits whatever the vector width: each element runs
 * the same IEEE operations (no contraction: the library is built as ISO C, -ffp-contract=off), one after another —
 * a row's result depends on nothing but that row.
 *
 * e^x: x clamped to [-88, 88]; n = round(x log2 e) (the 1.5 * 2^23 shift: round to nearest even);
 * r = x - n ln2 (two-part ln2, |r| <= 0.35); e^r by its Taylor polynomial to degree 7 (relative error below 2e-8,
 * under float's rounding); times 2^n built in the exponent bits (n in -127..127; 2^-127 reads as 0, where
 * silu's value is g / (1 + 0) = g anyway). */
#include <stdint.h>
#include <string.h>

#include "sek.h"

static inline float exp_clamped(float x) {
    x = x < -88.0f ? -88.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float shift = 12582912.0f; /* 1.5 * 2^23 */
    const float n = (x * 1.44269504088896341f + shift) - shift;
    const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return p * two_n;
}

void sek_swiglu(const float *y, int64_t m, int64_t f, float *out) {
    for (int64_t r = 0; r < m; r++) {
        const float *gate = y + r * 2 * f, *up = gate + f;
        float *o = out + r * f;
        for (int64_t i = 0; i < f; i++) {
            const float g = gate[i];
            o[i] = g / (1.0f + exp_clamped(-g)) * up[i];
        }
    }
}
