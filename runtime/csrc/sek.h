/* The interface between specedge's kernel files (sek_gemm.c, sek_attn.c) and their ONNX Runtime glue (sek_ort.c). */
#ifndef SEK_H
#define SEK_H
#include <stddef.h>
#include <stdint.h>

typedef struct {
    const int8_t *qa;   /* [M][K] */
    const float *sa;    /* [M][K/blk] */
    const float *sasum; /* [M][K/blk]: sa * sum(qa) over the block */
    int64_t m, k, blk;
    const int16_t *bsum; /* two-level scales: [M][K/bblk] sums of qa over each weight block (blk: the super-block) */
    int64_t bblk;
} sek_rows;

typedef struct {
    const uint8_t *b;  /* packed levels, laid out as sek_gemm.c's first comment says */
    const float *s;    /* [N/16][K/blk][16] */
    const uint8_t *z;  /* [N/16][K/blk][16] integer zero points, or NULL when zs is given */
    const float *zs;   /* [N/16][K/blk][16] z * s as fp32, for blocks whose zero is not an integer level (GGUF
                        * Q4_K / Q4_1: w = s q - dmin m); NULL when z is given */
    int64_t n, k, blk;
    int bits;
    /* two-level scales (see the top): when sc is set, s, z and zs are not read */
    const int8_t *sc;     /* [N/16][K/blk][16] integer block scales: s = d * sc */
    const uint16_t *d;    /* [N/16][K/sblk][16] IEEE halves */
    const int8_t *mn;     /* [N/16][K/blk][16] integer block mins: zs = dmin * mn; NULL: zs = zconst * s */
    const uint16_t *dmin; /* [N/16][K/sblk][16] IEEE halves */
    int64_t sblk;      /* a multiple of blk */
    int zconst;
} sek_weights;

int sek_isa_mask(void);
const char *sek_isa_name(int isa); /* SEK_ISA_* 1.. as SPECEDGE_SEK_ISA spells it; NULL past the last */
int sek_check(const sek_weights *w);
size_t sek_scratch_bytes(int64_t m, int64_t k, int64_t blk);
void sek_quantize(const float *a, int64_t m, int64_t k, int64_t lda, int64_t kpad, int64_t blk, void *scratch,
                  sek_rows *out, int isa);
size_t sek_sb_scratch_bytes(int64_t m, int64_t k, int64_t sblk, int64_t blk);
void sek_quantize_sb(const float *a, int64_t m, int64_t k, int64_t lda, int64_t kpad, int64_t sblk, int64_t blk,
                     void *scratch, sek_rows *out, int isa);
int sek_gemm_tiles(const sek_rows *x, const sek_weights *w, float *y, int64_t ldy, int64_t t0, int64_t t1, int isa);

/* The KV caches' element types: fp32; IEEE fp16 (written rounded to nearest even, read exactly); int8 rows, each row
 * of a head d int8 values and then its fp32 scale (d + 4 bytes: value i is q[i] * scale, scale = the row's largest
 * magnitude / 127, q[i] its value / scale rounded to nearest even). */
enum { SEK_KV_F32 = 0, SEK_KV_F16 = 1, SEK_KV_I8 = 2 };
typedef struct {
    const float *qkv;         /* [T][(hq + 2 hkv) d] */
    void *k_cache, *v_cache;  /* [hkv][s_max] rows of d elements of kv_type (sek_kv_row_bytes) */
    const float *cos, *sin;   /* [positions][rot/2] */
    float *out;               /* [T][hq d] */
    int64_t t, hq, hkv, d, s_max, past_len;
    float scale;
    int64_t hs, rs; /* query heads and rows per item (sek_attn_plan) */
    int kv_type;    /* SEK_KV_* */
    int64_t window; /* a sliding window: the query at position p attends to p - window + 1 .. p (0: none) */
    float softcap;  /* scores s -> softcap tanh(s / softcap) before the softmax (0: none; Gemma 2) */
    int64_t rot;    /* the dims RoPE rotates, 2 x the tables' width: d, or fewer for a partial rotary (Phi-4) */
    const float *k_shift; /* [hkv][d] subtracted from each rotated key before it is stored (NULL: none): every
                           * score of a query moves by the same q . shift, so without a softcap the softmax is the
                           * same, and an fp16 or int8 cache spends its precision on what varies between keys */
} sek_attn_args;
/* A row-addressed step (sek_attn.c, SekRowAttention): row r writes cache row row_pos[r] of the sequence in KV slot
 * row_slot[r] (-1: padding, which reads and writes nothing; its output is zeros). A row with no parent
 * (row_parent NULL or row_parent[r] = -1) is the token at position row_pos[r] and attends to its slot's rows
 * 0 .. row_pos[r]. A tree row names the earlier row of the step its token follows (row_parent[r] = p < r, same
 * slot, row_pos[p] < row_pos[r]): up its parents to a row without one (its root, at depth 0) it is the token at
 * position row_pos[root] + depth, and attends to rows 0 .. row_pos[root] and its ancestors' and its own rows. The
 * caller has checked all of that, that real rows name slots 0 .. n_slots-1 and positions below s_max and the rotary
 * tables' length, no two the same, and that tree rows lie at most SEK_TREE_DEPTH below their root with d <= 128. */
#define SEK_TREE_DEPTH 64
typedef struct {
    const float *qkv;                  /* [R][(hq + 2 hkv) d] */
    void *k_cache, *v_cache;           /* [n_slots][hkv][s_max] rows of kv_type (sek_kv_row_bytes) */
    const int64_t *row_slot, *row_pos; /* [R] */
    const int64_t *row_parent;         /* [R], or NULL: no tree rows */
    const float *cos, *sin;            /* [positions][rot/2] */
    float *out;                        /* [R][hq d] */
    int64_t r, n_slots, hq, hkv, d, s_max;
    float scale;
    int64_t hs;          /* query heads per item (sek_row_attn_plan) */
    const int64_t *chunk; /* [chunks + 1]: the first row of each chunk of rows an item takes (sek_row_attn_plan) */
    int kv_type;          /* SEK_KV_* */
    int64_t window;       /* a sliding window, as sek_attn_args' (0: none) */
    float softcap;        /* soft-capped scores, as sek_attn_args' (0: none) */
    int64_t rot;          /* the dims RoPE rotates, as sek_attn_args' */
    const float *k_shift; /* as sek_attn_args' */
} sek_row_attn_args;
/* out[r][i] = silu(y[r][i]) * y[r][f + i] for m rows of 2f values (sek_act.c) */
void sek_swiglu(const float *y, int64_t m, int64_t f, float *out);
void sek_attn_store(const sek_attn_args *a);
/* Bytes of one cache row (a head's d elements) of kv_type; the fp16 conversions the caches use. */
size_t sek_kv_row_bytes(int kv_type, int64_t d);
uint16_t sek_f32_to_f16(float f);
float sek_f16_to_f32(uint16_t h);
/* How a step of t rows splits into items: hs query heads of one KV group x rs rows each, as many as fit while the
 * step keeps min_items items (or every query alone, if it cannot). Returns the number of items. */
int64_t sek_attn_plan(int64_t t, int64_t hq, int64_t hkv, int64_t d, int64_t min_items, int64_t *hs, int64_t *rs);
/* One item of the plan: rs rows x hs heads. */
void sek_attn_row(const sek_attn_args *a, int64_t item);
/* Row-addressed steps: the rows' k and v into their slots (once, before the items); how R rows split into items
 * (chunks of adjacent rows of one slot x hs query heads of one KV group each: chunk [R + 1] receives the chunks' first
 * rows; returns the number of items); one item. */
void sek_row_attn_store(const sek_row_attn_args *a);
int64_t sek_row_attn_plan(const int64_t *row_slot, int64_t r, int64_t hq, int64_t hkv, int64_t d, int64_t min_items,
                          int64_t *hs, int64_t *chunk);
void sek_row_attn_item(const sek_row_attn_args *a, int64_t item);
#endif
