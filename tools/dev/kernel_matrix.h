/* The GGUF-like matrix the kernel microbenchmarks (kernel_rows.c, kernel_membench.c) time: n x k levels of 4 or 6
 * bits with Q4_K's or Q6_K's two-level scales (random, in a valid range), m rows of activations in [-1, 1), and
 * the outputs and scratch a call needs. */
#ifndef SPECEDGE_KERNEL_MATRIX_H
#define SPECEDGE_KERNEL_MATRIX_H
#include <stdio.h>
#include <stdlib.h>

#include "sek.h"

typedef struct {
    sek_weights w;
    uint8_t *levels;
    size_t lbytes; /* of levels */
    int64_t blk, nb, nsb;
    float *a, *y;
    void *scratch;
} bench_matrix;

/* 0, or 1 after saying why on stderr. */
static int bench_matrix_make(bench_matrix *bm, int bits, int64_t n, int64_t k, int64_t sblk, int64_t m) {
    const int64_t blk = bits == 4 ? 32 : 16, nb = k / blk, nsb = k / sblk;
    const size_t lbytes = (size_t)(n * k * bits / 8);
    uint8_t *levels = aligned_alloc(64, (lbytes + 63) / 64 * 64);
    int8_t *sc = malloc(n * nb), *mn = malloc(n * nb);
    uint16_t *d = malloc(n * nsb * 2), *dmin = malloc(n * nsb * 2);
    float *a = malloc(m * k * sizeof(float)), *y = malloc(m * n * sizeof(float));
    void *scratch = malloc(sek_sb_scratch_bytes(m, k, sblk, blk));
    if (!levels || !sc || !mn || !d || !dmin || !a || !y || !scratch) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    srand(1);
    for (size_t i = 0; i < lbytes; i++) levels[i] = (uint8_t)rand();
    for (int64_t i = 0; i < n * nb; i++) sc[i] = rand() % 64, mn[i] = rand() % 64;
    for (int64_t i = 0; i < n * nsb; i++) d[i] = 0x1000 + rand() % 100, dmin[i] = 0x1000;
    for (int64_t i = 0; i < m * k; i++) a[i] = (rand() % 1000) / 500.0f - 1.0f;
    sek_weights w = {0};
    w.b = levels, w.n = n, w.k = k, w.blk = blk, w.bits = bits, w.sc = sc, w.d = d, w.sblk = sblk;
    if (bits == 4) w.mn = mn, w.dmin = dmin;
    else w.zconst = 32;
    if (sek_check(&w)) {
        fprintf(stderr, "sek_check refused the weights\n");
        return 1;
    }
    *bm = (bench_matrix){w, levels, lbytes, blk, nb, nsb, a, y, scratch};
    return 0;
}
#endif
