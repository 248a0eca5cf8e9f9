/* What sek_gemm.c shares with its per-ISA files (sek_gemm_neon.c): the tile geometry, the weight layout's offsets,
 * the prefetch, and the paths' numbering. Internal: not part of the kernel's interface (sek.h). */
#ifndef SEK_GEMM_IMPL_H
#define SEK_GEMM_IMPL_H
#include <stdint.h>
#include <string.h>

#include "sek.h"

#if defined(__aarch64__) && defined(__ARM_NEON)
#define SEK_HAVE_NEON 1
#endif

#define SEK_TILE 16
#define SEK_BLK_MAX 256
/* the row and tile loops run a constant number of times per inlined copy: unrolled, their accumulators stay in
 * registers (GCC's default peeling stops short of 9-10 rows, and a 9-row step then cost ~2x per row) */
#if defined(__clang__)
#define SEK_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define SEK_UNROLL _Pragma("GCC unroll 16")
#else
#define SEK_UNROLL
#endif

enum { SEK_ISA_BEST = 0, SEK_ISA_SCALAR = 1, SEK_ISA_AVX2 = 2, SEK_ISA_VNNI512 = 3, SEK_ISA_NEON = 4, SEK_ISA_AVXVNNI = 5 };

/* The weights stream from DRAM once per step, and the hot loops do enough work per 64-byte line that the core's
 * out-of-order window alone keeps too few lines in flight: one thread read Q4_K blocks at ~15 GB/s where a bare
 * read loop reaches 21-25 (tools/dev/kernel_membench.c). Each block first asks for the lines SEK_AHEAD bytes further
 * on in its tile, into L2 (a hint: it never faults, past the end of the weights included). Measured on an
 * AVX512-VNNI EPYC, one process alternating the distance per burst (0 / 2048 / 3072 / 4096 / 6144 bytes): the exact
 * Qwen2.5-Coder-1.5B step at T = 1 went from 37.1 to 35.2 ms, at T = 5 from 52.6 to 43.9, at T = 9 from 77.1 to
 * 71.1; the AVX2 path's T = 5 from 90.6 to 72.2 (3072 was the best of those distances at T = 1; 0 against 3072 at
 * the other widths). */
#define SEK_AHEAD 3072
/* The same, `skip` bytes further still: a strip reading NT tiles side by side, near the end of its tiles, asks for
 * the start of the next strip's tiles, not for the tiles beside it, which it has read already. */
static inline __attribute__((always_inline)) void prefetch_block_skip(const uint8_t *p, int64_t bytes, int64_t skip) {
    /* integer arithmetic: a pointer past the end of the weights would be undefined behaviour, a hint is not */
    const uintptr_t at = (uintptr_t)p + SEK_AHEAD + (uintptr_t)skip;
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const void *)(at + (uintptr_t)o), 0, 2);
}
static inline __attribute__((always_inline)) void prefetch_block(const uint8_t *p, int64_t bytes) {
    prefetch_block_skip(p, bytes, 0);
}

/* Marks an inner loop's body for llvm-mca in an analysis build (-DSEK_MCA: tools/dev/kernel_mca.py); nothing
 * otherwise. */
#ifdef SEK_MCA
#define SEK_MCA_BEGIN(name) __asm__ volatile("# LLVM-MCA-BEGIN " name)
#define SEK_MCA_END(name) __asm__ volatile("# LLVM-MCA-END " name)
#else
#define SEK_MCA_BEGIN(name)
#define SEK_MCA_END(name)
#endif

/* Block b of tile `tile`: where its scale parts are. */
static inline int64_t blk_off(const sek_weights *w, int64_t tile, int64_t b) { return (tile * (w->k / w->blk) + b) * 16; }
static inline int64_t sblk_off(const sek_weights *w, int64_t tile, int64_t b) {
    return (tile * (w->k / w->sblk) + b * w->blk / w->sblk) * 16;
}

/* An IEEE half (GGUF's d and dmin) as a float: exact. */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
    uint32_t bits;
    if (e == 31) {
        bits = sign | 0x7f800000u | m << 13; /* inf, NaN */
    } else if (e) {
        bits = sign | (e + 112) << 23 | m << 13;
    } else { /* zero or subnormal: m * 2^-24, exact in fp32 */
        const float v = (float)m * 5.9604644775390625e-8f;
        memcpy(&bits, &v, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#define SEK_TINY 1e-30f /* a block with max|a| below this is quantized as zero (127 / max would overflow near 4e-37) */

#ifdef SEK_HAVE_NEON
/* Columns [16 * t0, 16 * t1) of Y for every row of x, on Arm NEON (sek_gemm_neon.c). */
void sek_tiles_neon(const sek_rows *x, const sek_weights *w, float *y, int64_t ldy, int64_t t0, int64_t t1);
/* One block of activations quantized as sek_gemm.c's quantize_block does, on NEON: 1 when done; 0 for a block
 * holding a NaN or an infinity, or below SEK_TINY, which the caller's portable rules then take. */
int sek_quantize_block_neon(const float *a, int64_t blk, int8_t *q, float *sa, float *sasum);
#endif
#endif
