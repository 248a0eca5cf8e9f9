/* The SekMatMulSB kernel alone on a matrix far larger than the caches, split over threads as ONNX Runtime would
 * (contiguous runs of tiles), next to a bare read loop over the same bytes: how close the kernel gets to what the
 * memory delivers. Random GGUF-like Q4_K / Q6_K blocks; the numbers are not checked here (tests do that).
 *
 *   cc -O3 -march=native -std=c11 -D_GNU_SOURCE -pthread -I runtime/csrc tools/dev/kernel_membench.c \
 *      runtime/csrc/sek_gemm.c runtime/csrc/sek_gemm_neon.c -o /tmp/kernel_membench -lm
 *   /tmp/kernel_membench N BITS THREADS [ROWS] [REPEATS]     e.g. 160000 4 2 1 5
 *
 * Prints GB/s of weight bytes (levels and scales) per repeat, for the kernel and for the bare read loop. Compare
 * only numbers from one run: a shared VM's memory bandwidth moves by tens of percent within minutes. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernel_matrix.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct {
    const sek_rows *x;
    const sek_weights *w;
    float *y;
    int64_t t0, t1;
    const uint8_t *rd;
    size_t rd_bytes;
    uint64_t sum;
} Part;

static void *gemm_part(void *p) {
    Part *a = p;
    sek_gemm_tiles(a->x, a->w, a->y, a->w->n, a->t0, a->t1, 0);
    return NULL;
}

static void *read_part(void *p) { /* 8 independent sums: the loads, not an add chain, set the pace */
    Part *a = p;
    uint64_t s[8] = {0};
    const uint64_t *q = (const uint64_t *)a->rd;
    for (size_t i = 0; i + 8 <= a->rd_bytes / 8; i += 8)
        for (int j = 0; j < 8; j++) s[j] += q[i + j];
    for (int j = 0; j < 8; j++) a->sum += s[j];
    return NULL;
}

static double run(void *(*fn)(void *), Part *parts, int nth) {
    pthread_t th[64];
    const double t0 = now();
    for (int i = 0; i < nth; i++) pthread_create(&th[i], NULL, fn, &parts[i]);
    for (int i = 0; i < nth; i++) pthread_join(th[i], NULL);
    return now() - t0;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s N BITS(4|6) THREADS [ROWS] [REPEATS]\n", argv[0]);
        return 2;
    }
    const int64_t n = atoll(argv[1]) / 16 * 16, k = 1536, sblk = 256;
    const int bits = atoi(argv[2]), nth = atoi(argv[3]), m = argc > 4 ? atoi(argv[4]) : 1,
              reps = argc > 5 ? atoi(argv[5]) : 5;
    if ((bits != 4 && bits != 6) || nth < 1 || nth > 64 || m < 1 || n < 16) {
        fprintf(stderr, "BITS is 4 or 6, THREADS 1..64, ROWS >= 1, N >= 16\n");
        return 2;
    }
    bench_matrix bm;
    if (bench_matrix_make(&bm, bits, n, k, sblk, m)) return 1;
    const int64_t blk = bm.blk, nb = bm.nb, nsb = bm.nsb;
    const size_t lbytes = bm.lbytes;
    uint8_t *levels = bm.levels;
    float *a = bm.a, *y = bm.y;
    void *scratch = bm.scratch;
    sek_weights w = bm.w;
    sek_rows x;
    sek_quantize_sb(a, m, k, k, k, sblk, blk, scratch, &x, 0);
    const double bytes = (double)lbytes + n * nb * (bits == 4 ? 2 : 1) + n * nsb * (bits == 4 ? 4 : 2);
    Part parts[64];
    const int64_t tiles = n / 16;
    for (int i = 0; i < nth; i++)
        parts[i] = (Part){&x, &w, y, tiles * i / nth, tiles * (i + 1) / nth, levels + lbytes / nth * i,
                          lbytes / nth / 64 * 64, 0};
    printf("%lld x %lld, %d-bit, %d row(s), %d thread(s), %.0f MB of weights\n", (long long)n, (long long)k, bits,
           m, nth, bytes / 1e6);
    run(gemm_part, parts, nth); /* warm-up: first touches, thread start-up */
    run(read_part, parts, nth);
    printf("kernel GB/s:   ");
    for (int r = 0; r < reps; r++) printf(" %.1f", bytes / run(gemm_part, parts, nth) / 1e9);
    printf("\nbare read GB/s:");
    for (int r = 0; r < reps; r++) printf(" %.1f", (double)(lbytes / 64 * 64) / run(read_part, parts, nth) / 1e9);
    uint64_t sink = 0;
    for (int i = 0; i < nth; i++) sink += parts[i].sum;
    printf("\n(checksum %llu)\n", (unsigned long long)(sink & 0xff));
    return 0;
}
