/* What each extra row of a multi-row step costs in specedge's GEMM, against the bound the ISA path's multiplies set.
 * One thread, a GGUF-like Q4_K or Q6_K matrix small enough to stay in L2 (the arithmetic, not the memory), every row
 * count asked; cycles from a calibrated chain of dependent adds (one a cycle on every x86 and Arm core), so the
 * numbers read the same on a VM whose clock is unknown.
 *
 *   cc -O3 -march=native -std=c11 -D_GNU_SOURCE -I runtime/csrc tools/dev/kernel_rows.c runtime/csrc/sek_gemm.c \
 *      runtime/csrc/sek_gemm_neon.c -o kernel_rows -lm
 *   ./kernel_rows [BITS=4|6] [ROWS=1,2,3,4,5,6,7,8,9,16,64] [ISA=best|scalar|avx2|avxvnni|vnni512|neon] [N=512]
 *   (SPECEDGE_KERNEL_MARCH's proxy by hand: -march=haswell gives the AVX2 path on any x86-64 machine)
 *
 * Prints, per row count, cycles per call and per (row, 64-byte weight chunk) -- one chunk is 16 columns x 8 levels
 * of k for 4-bit weights, 16 x 5.33 for 6-bit -- and the marginal cycles a row adds over the single-row call, next
 * to the multiplies' bound for that path: vpmaddubsw + vpmaddwd on AVX2 (4.5 per 4-bit chunk and row, 4 per 6-bit
 * one, at two multiplies a cycle: Skylake and Zen 3-4 have two such ports, Haswell one, which doubles its bound);
 * for other paths the column says "-". The best of REPEATS (7) bursts each. */
#include <stdint.h>
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

/* The clock in cycles per second: a chain of 2^29 dependent adds runs at one a cycle (four a loop iteration, so the
 * loop's own counter and branch run beside the chain). */
static double cycles_per_second(void) {
    double best = 1e30;
    for (int rep = 0; rep < 5; rep++) {
        uint64_t x = (uint64_t)rep;
        const double t = now();
        for (long i = 0; i < (1L << 27); i++) /* not folded: the compiler sees no adds */
            __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
        const double s = now() - t;
        if (s < best) best = s;
    }
    return (double)(1L << 29) / best;
}

static int isa_of(const char *s) {
    static const char *const names[] = {"best", "scalar", "avx2", "vnni512", "neon", "avxvnni"};
    for (int i = 0; i < 6; i++)
        if (!strcmp(s, names[i])) return i;
    return -1;
}

int main(int argc, char **argv) {
    const int bits = argc > 1 ? atoi(argv[1]) : 4;
    const char *rows = argc > 2 ? argv[2] : "1,2,3,4,5,6,7,8,9,16,64";
    const int isa = isa_of(argc > 3 ? argv[3] : "best");
    const int64_t n = (argc > 4 ? atoll(argv[4]) : 512) / 16 * 16, k = 1536, sblk = 256;
    if ((bits != 4 && bits != 6) || isa < 0 || n < 16) {
        fprintf(stderr, "usage: %s [BITS 4|6] [ROWS e.g. 1,5,9] [ISA best|scalar|avx2|avxvnni|vnni512|neon] [N]\n",
                argv[0]);
        return 2;
    }
    if (isa > 0 && !(sek_isa_mask() & (1 << isa))) {
        fprintf(stderr, "this build has no %s path (built: mask %d)\n", argv[3], sek_isa_mask());
        return 2;
    }
    const int64_t mmax = 256;
    bench_matrix bm;
    if (bench_matrix_make(&bm, bits, n, k, sblk, mmax)) return 1;
    const int64_t blk = bm.blk;
    const size_t lbytes = bm.lbytes;
    float *a = bm.a, *y = bm.y;
    void *scratch = bm.scratch;
    sek_weights w = bm.w;
    const double hz = cycles_per_second(), chunks = (double)lbytes / 64;
    /* multiplies per (row, chunk) and how many a cycle the path's best cores issue */
    const int avx2 = isa == 2 || (isa == 0 && (sek_isa_mask() & 0x2c) == 0x4); /* best: AVX2, no VNNI path */
    const double bound = avx2 ? (bits == 4 ? 4.5 : 4.0) / 2 : 0;
    printf("%lld x %lld, %d-bit, ISA %s (mask %d), %.0f KB of levels, clock %.2f GHz (add chain)\n", (long long)n,
           (long long)k, bits, argc > 3 ? argv[3] : "best", sek_isa_mask(), lbytes / 1e3, hz / 1e9);
    printf("| rows | cycles per call | per row and chunk | marginal per row and chunk | multiply bound |\n");
    printf("|---|---|---|---|---|\n");
    double one = 0;
    char list[256];
    snprintf(list, sizeof list, "%s", rows);
    for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
        const int m = atoi(tok);
        if (m < 1 || m > mmax) {
            fprintf(stderr, "rows are 1..%lld, got %s\n", (long long)mmax, tok);
            return 2;
        }
        sek_rows x;
        sek_quantize_sb(a, m, k, k, k, sblk, blk, scratch, &x, isa);
        const int calls = m < 16 ? 200 : 20;
        double best = 1e30;
        for (int rep = 0; rep < 8; rep++) { /* the first burst warms the caches */
            const double t = now();
            for (int c = 0; c < calls; c++) sek_gemm_tiles(&x, &w, y, n, 0, n / 16, isa);
            const double s = (now() - t) / calls;
            if (rep && s < best) best = s;
        }
        const double cyc = best * hz;
        if (m == 1) one = cyc;
        char marg[32] = "-", bnd[32] = "-";
        if (one > 0 && m > 1) snprintf(marg, sizeof marg, "%.2f", (cyc - one) / (m - 1) / chunks);
        if (bound > 0) snprintf(bnd, sizeof bnd, "%.2f", bound);
        printf("| %d | %.0f | %.2f | %s | %s |\n", m, cyc, cyc / m / chunks, marg, bnd);
        fflush(stdout);
    }
    return 0;
}
