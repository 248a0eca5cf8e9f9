/* Every ISA path of specedge's GEMM (runtime/csrc/sek_gemm.c) against its portable C reference, bitwise, and every
 * row of a many-row call against the same row alone (batch invariance), on pseudo-random packed weights and
 * activations with extreme blocks, in each weight format the kernel takes. Then a digest of the reference's outputs,
 * which is the same on every machine (the same integers and IEEE operations everywhere): equal digests from two
 * builds mean the two CPUs compute the same bits.
 *
 *   cc -O2 -std=c11 -D_GNU_SOURCE -march=native -I runtime/csrc tools/dev/sek_isa_check.c runtime/csrc/sek_gemm.c \
 *      runtime/csrc/sek_gemm_neon.c -o /tmp/sic -lm && /tmp/sic
 *   # Arm NEON without an Arm machine (Debian: gcc-aarch64-linux-gnu qemu-user), with and without dot products:
 *   aarch64-linux-gnu-gcc -static -O2 -std=c11 -D_GNU_SOURCE -march=armv8.2-a+dotprod -I runtime/csrc \
 *      tools/dev/sek_isa_check.c runtime/csrc/sek_gemm.c runtime/csrc/sek_gemm_neon.c -o /tmp/sic-arm -lm \
 *      && qemu-aarch64 -cpu max /tmp/sic-arm
 *
 * Prints one line per format, then "isas ...", "digest ..." and "ok"; exits 1 at the first disagreement.
 * tests/runtime/test_sek_kernel.py runs it (natively, and under qemu where the cross tools are installed).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sek.h"

int sek_gemm(const float *a, int64_t m, int64_t k, const sek_weights *w, float *y, int isa);

#define M_MAX 20 /* past one pass of every path: 16 rows streamed on AVX2, 10 on AVX-512 */

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t next(void) { /* xorshift64*: the same stream on every machine */
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return (uint32_t)((rng * 0x2545f4914f6cdd1dull) >> 32);
}
static float uniform(float lo, float hi) { return lo + (hi - lo) * (float)(next() >> 8) / 16777216.f; }
static uint16_t half_bits(void) { return (uint16_t)((next() & 1) << 15 | (5 + next() % 16) << 10 | (next() & 1023)); }

typedef struct {
    const char *name;
    int bits, blk, sblk, zconst, mins, byte_zp; /* sblk 0: one-level fp32 scales */
    int64_t n, kpad, k;                         /* k <= kpad: a partial last activation block */
} fmt;

static const fmt FORMATS[] = {
    {"4-bit, block 32, uint8 zero points", 4, 32, 0, 0, 0, 1, 48, 256, 256},
    {"4-bit, block 128, fp32 zero products, partial last block", 4, 128, 0, 0, 0, 0, 32, 512, 509},
    {"8-bit, block 64, uint8 zero points", 8, 64, 0, 0, 0, 1, 48, 256, 256},
    {"two-level 4-bit, block 32 / 256, mins (GGUF Q4_K)", 4, 32, 256, 0, 1, 0, 32, 512, 512},
    {"two-level 6-bit, block 16 / 256, zero 32 (GGUF Q6_K)", 6, 16, 256, 32, 0, 0, 32, 512, 500},
};

/* Activations: random rows, with a zero block, a block below the kernel's tiny threshold, one huge value, blocks
 * at +-127 after quantization (all equal magnitudes: the integer sums at their extremes), a NaN and an infinity. */
static void activations(float *a, int64_t m, int64_t k, int64_t ablk) {
    for (int64_t i = 0; i < m * k; i++) a[i] = uniform(-3.f, 3.f);
    if (m > 1) memset(a + 1 * k, 0, sizeof(float) * (size_t)(ablk < k ? ablk : k));
    if (m > 2)
        for (int64_t i = 0; i < ablk && i < k; i++) a[2 * k + i] = 1e-31f * uniform(-1.f, 1.f);
    if (m > 3) a[3 * k + k / 2] = 3e30f;
    if (m > 4)
        for (int64_t i = 0; i < k; i++) a[4 * k + i] = (next() & 1) ? 5.f : -5.f;
    if (m > 5) a[5 * k + k / 3] = NAN; /* that block's outputs NaN, the others' as usual */
    if (m > 6) a[6 * k + 2] = -INFINITY;
}

static int same(float x, float y) { /* bitwise, NaNs of any payload equal */
    uint32_t a, b;
    memcpy(&a, &x, 4);
    memcpy(&b, &y, 4);
    return a == b || (isnan(x) && isnan(y));
}

int main(void) {
    const int mask = sek_isa_mask();
    uint64_t digest = 0xcbf29ce484222325ull; /* FNV-1a over the reference's outputs */
    for (size_t f = 0; f < sizeof FORMATS / sizeof *FORMATS; f++) {
        const fmt *p = &FORMATS[f];
        const int64_t nt = p->n / 16, nb = p->kpad / p->blk, nsb = p->sblk ? p->kpad / p->sblk : 0;
        const size_t nbytes = (size_t)(p->n * p->kpad * p->bits / 8);
        uint8_t *b = malloc(nbytes), *z = malloc((size_t)(nt * nb * 16));
        float *s = malloc(sizeof(float) * (size_t)(nt * nb * 16)), *zs = malloc(sizeof(float) * (size_t)(nt * nb * 16));
        int8_t *sc = malloc((size_t)(nt * nb * 16)), *mn = malloc((size_t)(nt * nb * 16));
        uint16_t *d = malloc(2 * (size_t)(nt * (nsb + 1) * 16)), *dmin = malloc(2 * (size_t)(nt * (nsb + 1) * 16));
        for (size_t i = 0; i < nbytes; i++) b[i] = (uint8_t)next();
        for (int64_t i = 0; i < nt * nb * 16; i++) {
            z[i] = (uint8_t)(next() % (1u << p->bits));
            s[i] = uniform(-0.05f, 0.05f);
            zs[i] = uniform(-0.4f, 0.4f);
            sc[i] = (int8_t)next();
            mn[i] = (int8_t)next();
        }
        for (int64_t i = 0; i < nt * (nsb + 1) * 16; i++) d[i] = half_bits(), dmin[i] = half_bits();
        sek_weights w = {b, s, p->byte_zp ? z : NULL, p->byte_zp ? NULL : zs, p->n, p->kpad, p->blk, p->bits,
                         NULL, NULL, NULL, NULL, 0, 0};
        if (p->sblk) {
            w.s = NULL, w.z = NULL, w.zs = NULL, w.sc = sc, w.d = d, w.sblk = p->sblk, w.zconst = p->zconst;
            if (p->mins) w.mn = mn, w.dmin = dmin;
        }
        float *a = malloc(sizeof(float) * (size_t)(M_MAX * p->k)), *one = malloc(sizeof(float) * (size_t)p->n),
              *ref = malloc(sizeof(float) * (size_t)(M_MAX * p->n)), *y = malloc(sizeof(float) * (size_t)(M_MAX * p->n));
        activations(a, M_MAX, p->k, p->sblk ? p->sblk : p->blk);
        if (sek_gemm(a, M_MAX, p->k, &w, ref, 1)) {
            printf("FAIL %s: the reference refused the shapes\n", p->name);
            return 1;
        }
        for (int64_t i = 0; i < M_MAX * p->n; i++) {
            uint32_t bits;
            const float v = isnan(ref[i]) ? NAN : ref[i];
            memcpy(&bits, &v, 4);
            for (int byte = 0; byte < 4; byte++) digest = (digest ^ ((bits >> (8 * byte)) & 255)) * 0x100000001b3ull;
        }
        for (int isa = 1; sek_isa_name(isa); isa++) {
            if (!(mask & (1 << isa))) continue;
            for (int64_t m = 1; m <= M_MAX; m++) { /* every row count: each pass size and remainder of every path */
                sek_gemm(a, m, p->k, &w, y, isa);
                for (int64_t i = 0; i < m * p->n; i++)
                    if (!same(y[i], ref[i])) {
                        printf("FAIL %s: %s, %lld rows: row %lld column %lld is %.9g, the reference %.9g\n", p->name,
                               sek_isa_name(isa), (long long)m, (long long)(i / p->n), (long long)(i % p->n), y[i],
                               ref[i]);
                        return 1;
                    }
            }
            for (int64_t r = 0; r < M_MAX; r++) { /* each row alone */
                sek_gemm(a + r * p->k, 1, p->k, &w, one, isa);
                for (int64_t c = 0; c < p->n; c++)
                    if (!same(one[c], ref[r * p->n + c])) {
                        printf("FAIL %s: %s, row %lld alone differs at column %lld\n", p->name, sek_isa_name(isa),
                               (long long)r, (long long)c);
                        return 1;
                    }
            }
        }
        printf("%s: every path equals the reference\n", p->name);
        free(b), free(z), free(s), free(zs), free(sc), free(mn), free(d), free(dmin);
        free(a), free(ref), free(y), free(one);
    }
    printf("isas");
    for (int isa = 1; sek_isa_name(isa); isa++)
        if (mask & (1 << isa)) printf(" %s", sek_isa_name(isa));
    printf("\ndigest %016llx\nok\n", (unsigned long long)digest);
    return 0;
}
