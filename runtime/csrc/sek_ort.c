/* ONNX Runtime custom-op glue for sek_gemm.c and sek_attn.c: ops of the domain ai.specedge on the CPU execution
 * provider.
 *
 *   Y[..., N'] = SekMatMul(A[..., K] fp32, B uint8 (packed levels), S fp32 (scales),
 *                          Z uint8 (zero points) or fp32 (z * s, for GGUF Q4_1 blocks),
 *                          [bias fp32 [N]], [residual fp32 [..., N']])
 *   attributes: K (A's last dimension), N (a multiple of 16), bits (4 | 8), block_size (16..256, a multiple of 16),
 *               activation (optional: 0 none, N' = N; 1 SwiGLU, N' = N / 2, N a multiple of 32)
 *   The output's epilogue, fused so that a layer is fewer nodes (each one costs a dispatch and a pass over its
 *   tensor): Y = A W^T, then Y + bias (the q|k|v bias), then the activation (SwiGLU: silu(Y[:, :N/2]) * Y[:, N/2:],
 *   the gate|up product; sek_act.c), then residual + Y (the residual stream). The two additions are the fp32
 *   additions the separate Add nodes computed, so a graph with them fused gives the same bits as one without.
 *
 *   Y[..., N] = SekMatMulSB(A[..., K] fp32, B uint8 (packed levels), SC int8 (block scales), D fp16 (super-block
 *                           scales), MN int8 (block mins, or no elements), DMIN fp16 (super-block min scales, or no
 *                           elements))                     two-level scales: GGUF Q4_K and Q6_K as they are
 *   attributes: K, N, bits (4 | 6), block_size, superblock (up to 256, an even number of blocks, dividing K),
 *               zero_point (0..64: w = d sc (q - zero_point) where there are no mins)
 *   Activations are quantized per (row, super-block) here, and each block's integer dot product is scaled by its
 *   integer sc before any fp32 operation (sek_gemm.c, tile_sb_scalar).
 *
 * A's rows are quantized once in the calling thread; column tiles are spread over the session's intra-op
 * thread pool (KernelContext_ParallelFor). The column split never changes a row's numbers (sek_gemm.c).
 *
 * ONNX Runtime's C API is used through its ABI, which is stable and append-only: OrtApi is a table of function
 * pointers, and the slots below are the positions of the functions we call in onnxruntime_c_api.h (the same
 * from API version 17, ONNX Runtime 1.17, to the newest). The header itself is not needed to build this file,
 * so a plain `cc` builds it on any machine that has the onnxruntime wheel (runtime/kernels.py).
 *
 *   SekAttention and SekRowAttention (sek_attn.c): attention with RoPE over an fp32, fp16 or int8 KV cache updated in
 *   place, for a step of one sequence's rows and for a step of rows that each name their sequence's KV slot; their contracts are
 *   above each op's glue below.
 *
 * Environment: SPECEDGE_SEK_ISA=scalar|avx2|avxvnni|vnni512|neon forces one code path (tests compare them bitwise).
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sek.h"

/* ---- the parts of the C API used here (opaque handles; OrtApi slots by position) ---- */
typedef struct OrtStatus OrtStatus;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef void *const *OrtApiTable;
typedef struct {
    OrtApiTable (*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

enum { API_VERSION = 17 }; /* the table we ask for; every slot below exists from 17 on */
enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2, ORT_RUNTIME_EXCEPTION = 6 };
enum { T_ANY = 0, T_FLOAT = 1, T_UINT8 = 2, T_INT8 = 3, T_INT64 = 7, T_FLOAT16 = 10 };

#define SLOT(api, i, T) ((T)((api)[i]))
#define CreateStatus(api) SLOT(api, 0, OrtStatus * (*)(int, const char *))
#define CreateCustomOpDomain(api) SLOT(api, 26, OrtStatus * (*)(const char *, OrtCustomOpDomain **))
#define CustomOpDomain_Add(api) SLOT(api, 27, OrtStatus * (*)(OrtCustomOpDomain *, const void *))
#define AddCustomOpDomain(api) SLOT(api, 28, OrtStatus * (*)(OrtSessionOptions *, OrtCustomOpDomain *))
#define GetTensorMutableData(api) SLOT(api, 51, OrtStatus * (*)(OrtValue *, void **))
#define GetTensorElementType(api) SLOT(api, 60, OrtStatus * (*)(const OrtTensorTypeAndShapeInfo *, int *))
#define GetDimensionsCount(api) SLOT(api, 61, OrtStatus * (*)(const OrtTensorTypeAndShapeInfo *, size_t *))
#define GetDimensions(api) SLOT(api, 62, OrtStatus * (*)(const OrtTensorTypeAndShapeInfo *, int64_t *, size_t))
#define GetTensorTypeAndShape(api) SLOT(api, 65, OrtStatus * (*)(const OrtValue *, OrtTensorTypeAndShapeInfo **))
#define KernelInfoGetAttribute_float(api) SLOT(api, 85, OrtStatus * (*)(const OrtKernelInfo *, const char *, float *))
#define KernelInfoGetAttribute_int64(api) SLOT(api, 86, OrtStatus * (*)(const OrtKernelInfo *, const char *, int64_t *))
#define KernelInfoGetAttributeArray_float(api) \
    SLOT(api, 162, OrtStatus * (*)(const OrtKernelInfo *, const char *, float *, size_t *))
#define KernelContext_GetInput(api) SLOT(api, 90, OrtStatus * (*)(const OrtKernelContext *, size_t, const OrtValue **))
#define KernelContext_GetOutput(api) \
    SLOT(api, 91, OrtStatus * (*)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **))
#define ReleaseStatus(api) SLOT(api, 93, void (*)(OrtStatus *))
#define ReleaseTensorTypeAndShapeInfo(api) SLOT(api, 99, void (*)(OrtTensorTypeAndShapeInfo *))
#define ReleaseCustomOpDomain(api) SLOT(api, 101, void (*)(OrtCustomOpDomain *))
#define KernelContext_ParallelFor(api) \
    SLOT(api, 274, OrtStatus * (*)(const OrtKernelContext *, void (*)(void *, size_t), size_t, size_t, void *))

/* OrtCustomOp, version 17: every member up to GetEndVersion (ONNX Runtime reads no further for 17). */
typedef struct {
    uint32_t version;
    void *(*CreateKernel)(const void *op, OrtApiTable api, const OrtKernelInfo *info);
    const char *(*GetName)(const void *op);
    const char *(*GetExecutionProviderType)(const void *op);
    int (*GetInputType)(const void *op, size_t index);
    size_t (*GetInputTypeCount)(const void *op);
    int (*GetOutputType)(const void *op, size_t index);
    size_t (*GetOutputTypeCount)(const void *op);
    void (*KernelCompute)(void *kernel, OrtKernelContext *ctx);
    void (*KernelDestroy)(void *kernel);
    int (*GetInputCharacteristic)(const void *op, size_t index);
    int (*GetOutputCharacteristic)(const void *op, size_t index);
    int (*GetInputMemoryType)(const void *op, size_t index);
    int (*GetVariadicInputMinArity)(const void *op);
    int (*GetVariadicInputHomogeneity)(const void *op);
    int (*GetVariadicOutputMinArity)(const void *op);
    int (*GetVariadicOutputHomogeneity)(const void *op);
    OrtStatus *(*CreateKernelV2)(const void *op, OrtApiTable api, const OrtKernelInfo *info, void **kernel);
    OrtStatus *(*KernelComputeV2)(void *kernel, OrtKernelContext *ctx);
    void *InferOutputShapeFn;
    int (*GetStartVersion)(const void *op);
    int (*GetEndVersion)(const void *op);
} SekCustomOp;

typedef struct {
    OrtApiTable api;
    int64_t k, n, bits, blk;
    int64_t sblk, zconst; /* SekMatMulSB; sblk 0 for SekMatMul */
    int64_t act;          /* SekMatMul's activation: 0 none, 1 SwiGLU */
    int isa;
} SekKernel;

enum { ACT_NONE = 0, ACT_SWIGLU = 1 };

static const SekCustomOp sek_matmul_sb_op;

__attribute__((format(printf, 3, 4))) static OrtStatus *fail(OrtApiTable api, int code, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return CreateStatus(api)(code, msg);
}

#define TRY(expr)                         \
    do {                                  \
        OrtStatus *st_ = (expr);          \
        if (st_) return st_;              \
    } while (0)

static OrtStatus *create_kernel(const void *op, OrtApiTable api, const OrtKernelInfo *info, void **out) {
    const int sb = op == (const void *)&sek_matmul_sb_op;
    const char *name = sb ? "SekMatMulSB" : "SekMatMul";
    SekKernel *k = calloc(1, sizeof *k);
    if (!k) return fail(api, ORT_FAIL, "%s: out of memory", name);
    k->api = api;
    OrtStatus *st = NULL;
    if ((st = KernelInfoGetAttribute_int64(api)(info, "K", &k->k)) ||
        (st = KernelInfoGetAttribute_int64(api)(info, "N", &k->n)) ||
        (st = KernelInfoGetAttribute_int64(api)(info, "bits", &k->bits)) ||
        (st = KernelInfoGetAttribute_int64(api)(info, "block_size", &k->blk)) ||
        (sb && (st = KernelInfoGetAttribute_int64(api)(info, "superblock", &k->sblk))) ||
        (sb && (st = KernelInfoGetAttribute_int64(api)(info, "zero_point", &k->zconst)))) {
        free(k);
        return st;
    }
    if (!sb && (st = KernelInfoGetAttribute_int64(api)(info, "activation", &k->act))) { /* optional: absent = 0 */
        ReleaseStatus(api)(st);
        k->act = ACT_NONE;
    }
    if (k->act != ACT_NONE && (k->act != ACT_SWIGLU || k->n % 32)) {
        OrtStatus *e = fail(api, ORT_INVALID_ARGUMENT, "SekMatMul: activation %lld with N %lld: 0 (none) or 1 "
                            "(SwiGLU, N a multiple of 32: the gate's and the up projection's halves)",
                            (long long)k->act, (long long)k->n);
        free(k);
        return e;
    }
    const int64_t kpad = k->blk > 0 && k->k > 0 && k->k < (1ll << 40) ? (k->k + k->blk - 1) / k->blk * k->blk : 0;
    static const int8_t one_sc = 1;
    static const uint16_t one_d = 0x3c00; /* 1.0 */
    /* a stand-in for the scales: sek_check judges the shapes */
    sek_weights w = {NULL, NULL, NULL, NULL, k->n, kpad, k->blk, (int)k->bits, NULL, NULL, NULL, NULL, 0, 0};
    if (sb) {
        w.sc = &one_sc;
        w.d = &one_d;
        w.sblk = k->sblk;
        w.zconst = k->zconst >= 0 && k->zconst <= 64 ? (int)k->zconst : -1; /* sek_check's bound */
    }
    if (k->k <= 0 || k->n > (1ll << 40) || k->sblk > (1ll << 40) || sek_check(&w)) {
        OrtStatus *e = fail(api, ORT_INVALID_ARGUMENT,
                            "%s: unsupported shape (N %lld must be a multiple of 16, K %lld > 0; bits %s; block_size a "
                            "multiple of 16 up to 256%s)", name, (long long)(k->n), (long long)(k->k),
                            sb ? "4 or 6" : "4 or 8",
                            sb ? "; superblock up to 256, an even number of blocks, dividing K; zero_point 0..64" : "");
        free(k);
        return e;
    }
    const char *isa = getenv("SPECEDGE_SEK_ISA");
    k->isa = !isa || !*isa ? 0 : -1;
    for (int i = 1; sek_isa_name(i) && k->isa < 0; i++)
        if (!strcmp(isa, sek_isa_name(i))) k->isa = i;
    if (k->isa < 0 || (k->isa > 0 && !(sek_isa_mask() & (1 << k->isa)))) {
        OrtStatus *e = fail(api, ORT_INVALID_ARGUMENT,
                            "%s: SPECEDGE_SEK_ISA names a path this build lacks (mask %lld; 2 scalar, 4 avx2, "
                            "8 vnni512, 16 neon, 32 avxvnni)", name, (long long)(sek_isa_mask()));
        free(k);
        return e;
    }
    *out = k;
    return NULL;
}

typedef struct {
    const sek_rows *x;
    const sek_weights *w;
    float *y;
    int isa;
    int64_t ntiles;
    const float *bias, *residual; /* added to the item's columns (NULL: none); residual only without activation */
} Job;

enum { TILES_PER_ITEM = 2 };

/* y[r][c] += add[r * ld + c] for every row, columns [c0, c1): one fp32 addition, as ONNX Runtime's Add did */
static void add_columns(float *y, int64_t m, int64_t n, int64_t c0, int64_t c1, const float *add, int64_t ld) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = c0; c < c1; c++) y[r * n + c] = y[r * n + c] + add[r * ld + c];
}

static void run_item(void *p, size_t i) {
    const Job *j = (const Job *)p;
    const int64_t t0 = (int64_t)i * TILES_PER_ITEM;
    const int64_t t1 = t0 + TILES_PER_ITEM < j->ntiles ? t0 + TILES_PER_ITEM : j->ntiles;
    sek_gemm_tiles(j->x, j->w, j->y, j->w->n, t0, t1, j->isa);
    if (j->bias) add_columns(j->y, j->x->m, j->w->n, t0 * 16, t1 * 16, j->bias, 0);
    if (j->residual) add_columns(j->y, j->x->m, j->w->n, t0 * 16, t1 * 16, j->residual, j->w->n);
}

static OrtStatus *tensor_info(OrtApiTable api, const OrtValue *v, int want_type, int64_t *dims, size_t *nd,
                              int64_t *count, int index, int *type_out) {
    OrtTensorTypeAndShapeInfo *info;
    TRY(GetTensorTypeAndShape(api)(v, &info));
    int type = 0;
    OrtStatus *st = GetTensorElementType(api)(info, &type);
    if (!st && want_type == T_ANY) want_type = type;
    if (!st) st = GetDimensionsCount(api)(info, nd);
    if (!st && *nd > 8) st = fail(api, ORT_INVALID_ARGUMENT, "specedge op: input %lld has %lld dimensions (at most 8)", (long long)(index), (long long)((int64_t)*nd));
    if (!st) st = GetDimensions(api)(info, dims, *nd);
    ReleaseTensorTypeAndShapeInfo(api)(info);
    if (st) return st;
    if (type != want_type)
        return fail(api, ORT_INVALID_ARGUMENT, "specedge op: input %lld has element type %lld (expected float32, float16, uint8, int8 or int64 as documented)", (long long)(index), (long long)(type));
    *type_out = type;
    *count = 1;
    for (size_t i = 0; i < *nd; i++) *count *= dims[i];
    return NULL;
}

/* Inputs 0..n-1 of a node: present, of the declared element types; their dims, ranks, element counts, data. */
typedef struct {
    int64_t dims[8];
    size_t nd;
    int64_t count;
    void *data;
    int type;
} Input;

static OrtStatus *read_inputs(OrtApiTable api, OrtKernelContext *ctx, const char *op, int n, const int *types,
                              Input *in) {
    for (int i = 0; i < n; i++) {
        const OrtValue *v;
        TRY(KernelContext_GetInput(api)(ctx, (size_t)i, &v));
        if (!v) return fail(api, ORT_INVALID_ARGUMENT, "%s: input %d is missing", op, i);
        TRY(tensor_info(api, v, types[i], in[i].dims, &in[i].nd, &in[i].count, i, &in[i].type));
        TRY(GetTensorMutableData(api)((OrtValue *)v, &in[i].data));
    }
    return NULL;
}

/* The weights' inputs of a node, checked against the kernel's attributes -> w. */
static OrtStatus *weights_of(const SekKernel *k, const Input *in, int64_t kpad, sek_weights *w) {
    OrtApiTable api = k->api;
    const int64_t nb = kpad / k->blk;
    *w = (sek_weights){(const uint8_t *)in[1].data, NULL, NULL, NULL, k->n, kpad, k->blk, (int)k->bits,
                       NULL, NULL, NULL, NULL, 0, 0};
    if (in[1].count != k->n * kpad * k->bits / 8)
        return fail(api, ORT_INVALID_ARGUMENT, "%s: packed weights hold %lld bytes, N x K at these bits needs %lld",
                    k->sblk ? "SekMatMulSB" : "SekMatMul", (long long)in[1].count, (long long)(k->n * kpad * k->bits / 8));
    if (!k->sblk) {
        if (in[3].type != T_UINT8 && in[3].type != T_FLOAT)
            return fail(api, ORT_INVALID_ARGUMENT, "SekMatMul: zero points are uint8 levels or fp32 products z * s, "
                        "not element type %d", in[3].type);
        if (in[2].count != k->n * nb || in[3].count != k->n * nb)
            return fail(api, ORT_INVALID_ARGUMENT, "SekMatMul: %lld scales and %lld zero points, N x blocks needs "
                        "%lld of each", (long long)in[2].count, (long long)in[3].count, (long long)(k->n * nb));
        const int byte_zp = in[3].type == T_UINT8;
        w->s = (const float *)in[2].data;
        w->z = byte_zp ? (const uint8_t *)in[3].data : NULL;
        w->zs = byte_zp ? NULL : (const float *)in[3].data;
        return NULL;
    }
    const int64_t nsb = kpad / k->sblk;
    const int mins = in[4].count != 0;
    if (in[2].count != k->n * nb || in[3].count != k->n * nsb || (mins && in[4].count != k->n * nb) ||
        in[5].count != (mins ? k->n * nsb : 0))
        return fail(api, ORT_INVALID_ARGUMENT, "SekMatMulSB: %lld block scales, %lld super-block scales, %lld mins and "
                    "%lld min scales; N x blocks is %lld, N x super-blocks %lld (mins and their scales both or neither)",
                    (long long)in[2].count, (long long)in[3].count, (long long)in[4].count, (long long)in[5].count,
                    (long long)(k->n * nb), (long long)(k->n * nsb));
    w->sc = (const int8_t *)in[2].data;
    w->d = (const uint16_t *)in[3].data;
    w->mn = mins ? (const int8_t *)in[4].data : NULL;
    w->dmin = mins ? (const uint16_t *)in[5].data : NULL;
    w->sblk = k->sblk;
    w->zconst = (int)k->zconst;
    return NULL;
}

/* SekMatMul's inputs 4 (bias [N]) and 5 (residual, as many values as the output), each optional. */
static OrtStatus *epilogue_inputs(OrtApiTable api, OrtKernelContext *ctx, int64_t n, int64_t out_count,
                                  const float **bias, const float **residual) {
    for (int i = 4; i < 6; i++) {
        const OrtValue *v = NULL;
        TRY(KernelContext_GetInput(api)(ctx, (size_t)i, &v));
        if (!v) continue;
        Input in;
        TRY(tensor_info(api, v, T_FLOAT, in.dims, &in.nd, &in.count, i, &in.type));
        if (in.count != (i == 4 ? n : out_count))
            return fail(api, ORT_INVALID_ARGUMENT, "SekMatMul: the %s holds %lld values, the output needs %lld",
                        i == 4 ? "bias" : "residual", (long long)in.count, (long long)(i == 4 ? n : out_count));
        TRY(GetTensorMutableData(api)((OrtValue *)v, &in.data));
        *(i == 4 ? bias : residual) = (const float *)in.data;
    }
    return NULL;
}

/* *buf holds at least `need` bytes afterwards (grown with realloc, kept between calls); 0 when out of memory. */
static int grow(void **buf, size_t *size, size_t need) {
    if (need <= *size) return 1;
    void *bigger = realloc(*buf, need);
    if (!bigger) return 0;
    *buf = bigger;
    *size = need;
    return 1;
}

static OrtStatus *compute(void *kernel, OrtKernelContext *ctx) {
    const SekKernel *k = (const SekKernel *)kernel;
    OrtApiTable api = k->api;
    const char *name = k->sblk ? "SekMatMulSB" : "SekMatMul";
    static const int types[4] = {T_FLOAT, T_UINT8, T_FLOAT, T_ANY};
    static const int sb_types[6] = {T_FLOAT, T_UINT8, T_INT8, T_FLOAT16, T_INT8, T_FLOAT16};
    Input in[6];
    TRY(read_inputs(api, ctx, name, k->sblk ? 6 : 4, k->sblk ? sb_types : types, in));
    const Input *A = &in[0];
    const int64_t kpad = (k->k + k->blk - 1) / k->blk * k->blk;
    if (A->nd < 1 || A->dims[A->nd - 1] != k->k)
        return fail(api, ORT_INVALID_ARGUMENT, "%s: A's last dimension is %lld, the weights take K = %lld", name,
                    (long long)(A->nd ? A->dims[A->nd - 1] : -1), (long long)k->k);
    sek_weights w;
    TRY(weights_of(k, in, kpad, &w));
    const int64_t m = A->count / k->k, n_out = k->act == ACT_SWIGLU ? k->n / 2 : k->n;
    const float *bias = NULL, *residual = NULL;
    if (!k->sblk) /* the optional epilogue inputs: absent, or an empty name in the node (NULL here) */
        TRY(epilogue_inputs(api, ctx, k->n, m * n_out, &bias, &residual));
    int64_t odims[8];
    memcpy(odims, A->dims, A->nd * sizeof(int64_t));
    odims[A->nd - 1] = n_out;
    OrtValue *out;
    TRY(KernelContext_GetOutput(api)(ctx, 0, odims, A->nd, &out));
    if (!out) return fail(api, ORT_RUNTIME_EXCEPTION, "%s: no output tensor", name);
    void *y;
    TRY(GetTensorMutableData(api)(out, &y));
    if (m == 0) return NULL;
    /* per-thread buffers grown as needed (no allocation per call in a decode loop): the quantized rows, and with an
     * activation the product before it (the activation then writes the output) */
    static _Thread_local void *scratch = NULL, *pre = NULL;
    static _Thread_local size_t scratch_size = 0, pre_size = 0;
    const size_t need = k->sblk ? sek_sb_scratch_bytes(m, kpad, k->sblk, k->blk) : sek_scratch_bytes(m, kpad, k->blk);
    if (!grow(&scratch, &scratch_size, need) ||
        (k->act != ACT_NONE && !grow(&pre, &pre_size, (size_t)(m * k->n) * sizeof(float))))
        return fail(api, ORT_FAIL, "%s: out of memory", name);
    sek_rows x;
    if (k->sblk) /* activations per super-block, with their sums per block */
        sek_quantize_sb((const float *)A->data, m, k->k, k->k, kpad, k->sblk, k->blk, scratch, &x, k->isa);
    else
        sek_quantize((const float *)A->data, m, k->k, k->k, kpad, k->blk, scratch, &x, k->isa);
    Job job = {&x, &w, k->act == ACT_NONE ? (float *)y : (float *)pre, k->isa, k->n / 16, bias,
               k->act == ACT_NONE ? residual : NULL};
    const size_t items = (size_t)((job.ntiles + TILES_PER_ITEM - 1) / TILES_PER_ITEM);
    TRY(KernelContext_ParallelFor(api)(ctx, run_item, items, 0, &job));
    if (k->act == ACT_SWIGLU) {
        sek_swiglu((const float *)pre, m, n_out, (float *)y);
        if (residual) add_columns((float *)y, m, n_out, 0, n_out, residual, n_out);
    }
    return NULL;
}

static void destroy(void *kernel) { free(kernel); }
static const char *op_name(const void *op) { (void)op; return "SekMatMul"; }
static const char *op_ep(const void *op) { (void)op; return NULL; } /* NULL: the CPU execution provider */
static int in_type(const void *op, size_t i) { (void)op; return i == 1 ? T_UINT8 : i == 3 ? T_ANY : T_FLOAT; }
static size_t in_count(const void *op) { (void)op; return 6; }
static int optional_epilogue(const void *op, size_t i) { (void)op; return i >= 4; } /* 1: INPUT_OUTPUT_OPTIONAL */
static int out_type(const void *op, size_t i) { (void)op; (void)i; return T_FLOAT; }
static size_t out_count(const void *op) { (void)op; return 1; }
static int required(const void *op, size_t i) { (void)op; (void)i; return 0; }
static int mem_default(const void *op, size_t i) { (void)op; (void)i; return 0; }
static int one(const void *op) { (void)op; return 1; }

/* What every op here shares: CPU, one output per declared type (each op says which), no variadic arity, no end version (each op says
 * which of its inputs are required). */
#define SEK_OP_COMMON                                                                                             \
    .version = API_VERSION, .GetExecutionProviderType = op_ep, .KernelDestroy = destroy,                         \
    .GetOutputCharacteristic = required, .GetInputMemoryType = mem_default,                                       \
    .GetVariadicInputMinArity = one, .GetVariadicInputHomogeneity = one, .GetVariadicOutputMinArity = one,         \
    .GetVariadicOutputHomogeneity = one, .GetStartVersion = one

static const char *sb_name(const void *op) { (void)op; return "SekMatMulSB"; }
static int sb_in_type(const void *op, size_t i) {
    (void)op;
    return i == 1 ? T_UINT8 : i == 2 || i == 4 ? T_INT8 : i == 0 ? T_FLOAT : T_FLOAT16;
}
static size_t sb_in_count(const void *op) { (void)op; return 6; }

static const SekCustomOp sek_matmul_sb_op = {
    SEK_OP_COMMON,
    .GetInputCharacteristic = required,
    .GetName = sb_name,
    .GetInputType = sb_in_type,
    .GetInputTypeCount = sb_in_count,
    .GetOutputType = out_type,
    .GetOutputTypeCount = out_count,
    .CreateKernelV2 = create_kernel,
    .KernelComputeV2 = compute,
};

static const SekCustomOp sek_matmul_op = {
    SEK_OP_COMMON,
    .GetInputCharacteristic = optional_epilogue,
    .GetName = op_name,
    .GetInputType = in_type,
    .GetInputTypeCount = in_count,
    .GetOutputType = out_type,
    .GetOutputTypeCount = out_count,
    .CreateKernelV2 = create_kernel,
    .KernelComputeV2 = compute,
};

/* ---------------------------------------------------------------- SekAttention
 *   out [1, T, hq d], present_key, present_value [1, hkv, S, d] =
 *       SekAttention(qkv [1, T, (hq + 2 hkv) d], past_key, past_value [1, hkv, S, d], past_len int64 [1],
 *                    cos, sin [positions, d/2])
 *       attributes: num_heads, kv_num_heads, scale, window (optional), softcap (optional: the scores s as
 *       softcap tanh(s / softcap) before the softmax, as GroupQueryAttention's softcap; Gemma 2), k_shift
 *       (optional: kv_heads x d floats, a head's shift subtracted from each of its keys after RoPE, before the row
 *       is stored; not with softcap, whose scores a shift would change)
 * window W > 0: a sliding window, the query at position p attends to positions p - W + 1 .. p only (a local layer's
 * attention; absent or 0, to 0 .. p). present is the cache itself when the caller binds it to the past's buffer (the runtime does); otherwise the past
 * is copied into it first. The caches are float32, float16 or int8; int8 caches are [1, hkv, S, d + 4], each row d
 * int8 values and their fp32 scale (sek.h). */
typedef struct {
    OrtApiTable api;
    int64_t hq, hkv;
    float scale;
    int64_t window; /* the optional attribute `window` (0: none) */
    float softcap;  /* the optional attribute `softcap` (0: none) */
    size_t n_shift; /* the optional attribute `k_shift`'s length (0: none) */
    float k_shift[]; /* its values */
} SekAttnKernel;

static const SekCustomOp sek_row_attention_op, sek_row_attention_f16_op, sek_row_attention_i8_op;

static OrtStatus *attn_create(const void *op, OrtApiTable api, const OrtKernelInfo *info, void **out) {
    const char *name = op == (const void *)&sek_row_attention_op || op == (const void *)&sek_row_attention_f16_op ||
                               op == (const void *)&sek_row_attention_i8_op
                           ? "SekRowAttention" : "SekAttention";
    size_t n_shift = 0;
    OrtStatus *st = KernelInfoGetAttributeArray_float(api)(info, "k_shift", NULL, &n_shift);
    if (st) { /* optional: absent is none */
        ReleaseStatus(api)(st);
        n_shift = 0;
    }
    SekAttnKernel *k = calloc(1, sizeof *k + n_shift * sizeof(float));
    if (!k) return fail(api, ORT_FAIL, "%s: out of memory", name);
    k->api = api;
    k->n_shift = n_shift;
    if (n_shift && (st = KernelInfoGetAttributeArray_float(api)(info, "k_shift", k->k_shift, &k->n_shift))) {
        free(k);
        return st;
    }
    if ((st = KernelInfoGetAttribute_int64(api)(info, "num_heads", &k->hq)) ||
        (st = KernelInfoGetAttribute_int64(api)(info, "kv_num_heads", &k->hkv)) ||
        (st = KernelInfoGetAttribute_float(api)(info, "scale", &k->scale))) {
        free(k);
        return st;
    }
    if (k->hq <= 0 || k->hkv <= 0 || k->hq % k->hkv) {
        OrtStatus *e = fail(api, ORT_INVALID_ARGUMENT, "%s: num_heads %lld must be a multiple of kv_num_heads %lld",
                            name, (long long)(k->hq), (long long)(k->hkv));
        free(k);
        return e;
    }
    if ((st = KernelInfoGetAttribute_int64(api)(info, "window", &k->window))) { /* optional: absent is none */
        ReleaseStatus(api)(st);
        k->window = 0;
    }
    if ((st = KernelInfoGetAttribute_float(api)(info, "softcap", &k->softcap))) { /* optional: absent is none */
        ReleaseStatus(api)(st);
        k->softcap = 0.f;
    }
    if (!(k->softcap >= 0.f) || isinf(k->softcap)) {
        OrtStatus *e = fail(api, ORT_INVALID_ARGUMENT, "%s: softcap %g; a soft cap on the scores is a finite number "
                            "> 0, or 0 (absent) for none", name, (double)k->softcap);
        free(k);
        return e;
    }
    if (k->window < 0) {
        OrtStatus *e = fail(api, ORT_INVALID_ARGUMENT, "%s: window %lld; a sliding window is a number of positions "
                            "> 0, or 0 (absent) for none", name, (long long)k->window);
        free(k);
        return e;
    }
    int finite = 1;
    for (size_t i = 0; i < k->n_shift; i++) finite &= isfinite(k->k_shift[i]) != 0;
    if (!finite || (k->n_shift && (k->softcap > 0.f || k->n_shift % (size_t)k->hkv))) {
        OrtStatus *e = fail(api, ORT_INVALID_ARGUMENT, "%s: k_shift of %zu values%s; a key shift is kv_num_heads "
                            "(%lld) x head dim finite values, and is not allowed with softcap (its scores would "
                            "change)", name, k->n_shift, finite ? "" : " not all finite", (long long)k->hkv);
        free(k);
        return e;
    }
    *out = k;
    return NULL;
}

/* Items the attention should split a step into: the CPUs online (once), so that grouping a KV group's query heads
 * into one item (which reads the group's cache once for all of them) still leaves every thread a share. The
 * grouping never changes a row's numbers (sek_attn.c). */
static int64_t online_cpus(void) {
    static int64_t n = 0;
    if (!n) {
        const long c = sysconf(_SC_NPROCESSORS_ONLN);
        n = c > 0 ? c : 1;
    }
    return n;
}

/* The attention ops' outputs: out [1, rows, width] and the two caches shaped as the pasts (in[1], in[2]), which
 * start as copies of the pasts unless they are bound to the same buffers (in place, as the runtime binds them). */
static OrtStatus *attn_outputs(OrtApiTable api, OrtKernelContext *ctx, const char *op, int64_t rows, int64_t width,
                               const Input *in, void **o) {
    const int64_t odims[3] = {1, rows, width};
    OrtValue *out[3];
    TRY(KernelContext_GetOutput(api)(ctx, 0, odims, 3, &out[0]));
    TRY(KernelContext_GetOutput(api)(ctx, 1, in[1].dims, 4, &out[1]));
    TRY(KernelContext_GetOutput(api)(ctx, 2, in[2].dims, 4, &out[2]));
    for (int i = 0; i < 3; i++) {
        if (!out[i]) return fail(api, ORT_RUNTIME_EXCEPTION, "%s: no output tensor", op);
        TRY(GetTensorMutableData(api)(out[i], &o[i]));
    }
    for (int i = 1; i < 3; i++) /* not bound in place: start from a copy of the past */
        if (o[i] != in[i].data && in[i].count)
            memcpy(o[i], in[i].data, (size_t)in[i].count * (in[i].type == T_FLOAT16 ? 2 : in[i].type == T_INT8 ? 1 : 4));
    return NULL;
}

/* The caches' element type (SEK_KV_*): past key and value both float32, both float16 or both int8; and the head
 * dimension d of their rows (int8 rows: d values, then the row's fp32 scale in 4 more, sek.h). */
static OrtStatus *cache_type(OrtApiTable api, const char *op, const Input *in, int *kv_type, int64_t *d) {
    if (in[1].type != in[2].type || (in[1].type != T_FLOAT && in[1].type != T_FLOAT16 && in[1].type != T_INT8))
        return fail(api, ORT_INVALID_ARGUMENT, "%s: the caches' element types are %lld and %lld; both float32 (1), "
                    "both float16 (10) or both int8 (3)", op, (long long)in[1].type, (long long)in[2].type);
    *kv_type = in[1].type == T_FLOAT16 ? SEK_KV_F16 : in[1].type == T_INT8 ? SEK_KV_I8 : SEK_KV_F32;
    *d = in[1].nd == 4 ? in[1].dims[3] - (*kv_type == SEK_KV_I8 ? (int64_t)sizeof(float) : 0) : 0;
    return NULL;
}

static void attn_item(void *p, size_t i) { sek_attn_row((const sek_attn_args *)p, (int64_t)i); }

static OrtStatus *attn_compute(void *kernel, OrtKernelContext *ctx) {
    const SekAttnKernel *k = (const SekAttnKernel *)kernel;
    OrtApiTable api = k->api;
    static const int types[6] = {T_FLOAT, T_ANY, T_ANY, T_INT64, T_FLOAT, T_FLOAT};
    Input in[6];
    TRY(read_inputs(api, ctx, "SekAttention", 6, types, in));
    int kv_type = SEK_KV_F32;
    int64_t d = 0;
    TRY(cache_type(api, "SekAttention", in, &kv_type, &d));
    if (in[0].nd != 3 || in[0].dims[0] != 1 || in[1].nd != 4 || in[1].dims[0] != 1 || in[2].nd != 4 || in[4].nd != 2 ||
        in[3].count != 1)
        return fail(api, ORT_INVALID_ARGUMENT, "SekAttention: expects qkv [1, T, W] (got rank %lld), caches "
                    "[1, kv_heads, S, d] (rank %lld), past_len [1], cos/sin [positions, r/2], r <= d",
                    (long long)in[0].nd, (long long)in[1].nd);
    const int64_t T = in[0].dims[1], S = in[1].dims[2], positions = in[4].dims[0];
    if (in[1].dims[1] != k->hkv || in[0].dims[2] != (k->hq + 2 * k->hkv) * d || d <= 0 || d % 2 || d > 512 ||
        memcmp(in[2].dims, in[1].dims, 4 * sizeof(int64_t)) || in[4].dims[1] < 1 || in[4].dims[1] > d / 2 ||
        in[5].nd != 2 || memcmp(in[5].dims, in[4].dims, 2 * sizeof(int64_t)))
        return fail(api, ORT_INVALID_ARGUMENT, "SekAttention: qkv width %lld or head dim %lld disagree with the "
                    "heads, the caches or the rotary tables", (long long)in[0].dims[2], (long long)d);
    if (k->n_shift && k->n_shift != (size_t)(k->hkv * d))
        return fail(api, ORT_INVALID_ARGUMENT, "SekAttention: k_shift holds %zu values; kv_num_heads x head dim is "
                    "%lld", k->n_shift, (long long)(k->hkv * d));
    const int64_t past_len = *(const int64_t *)in[3].data;
    if (past_len < 0 || T > S || T > positions || past_len > S - T || past_len > positions - T) /* no overflow */
        return fail(api, ORT_INVALID_ARGUMENT, "SekAttention: positions up to %lld do not fit the cache (%lld rows)",
                    (long long)(past_len + T), (long long)(S < positions ? S : positions));
    void *o[3];
    TRY(attn_outputs(api, ctx, "SekAttention", T, k->hq * d, in, o));
    sek_attn_args a = {(const float *)in[0].data, o[1], o[2], (const float *)in[4].data, (const float *)in[5].data,
                       (float *)o[0], T, k->hq, k->hkv, d, S, past_len, k->scale, 1, 1, kv_type, k->window,
                       k->softcap, 2 * in[4].dims[1], k->n_shift ? k->k_shift : NULL};
    if (T == 0) return NULL;
    const int64_t items = sek_attn_plan(T, k->hq, k->hkv, d, online_cpus(), &a.hs, &a.rs);
    sek_attn_store(&a);
    return KernelContext_ParallelFor(api)(ctx, attn_item, (size_t)items, 0, &a);
}

static const char *attn_name(const void *op) { (void)op; return "SekAttention"; }
static const SekCustomOp sek_attention_f16_op, sek_row_attention_f16_op, sek_attention_i8_op, sek_row_attention_i8_op;
/* The caches' element type of an attention op: each op has one registration per type, under the same name. */
static int attn_cache_type(const void *op) {
    if (op == (const void *)&sek_attention_f16_op || op == (const void *)&sek_row_attention_f16_op) return T_FLOAT16;
    return op == (const void *)&sek_attention_i8_op || op == (const void *)&sek_row_attention_i8_op ? T_INT8 : T_FLOAT;
}
static int attn_in_type(const void *op, size_t i) { return i == 3 ? T_INT64 : i == 1 || i == 2 ? attn_cache_type(op) : T_FLOAT; }
static size_t attn_in_count(const void *op) { (void)op; return 6; }
static size_t attn_out_count(const void *op) { (void)op; return 3; }
static int attn_out_type(const void *op, size_t i) { return i ? attn_cache_type(op) : T_FLOAT; } /* presents: the caches' */

#define SEK_ATTENTION_OP                                                                                           \
    SEK_OP_COMMON, .GetInputCharacteristic = required, .GetName = attn_name, .GetInputType = attn_in_type,        \
    .GetInputTypeCount = attn_in_count, .GetOutputType = attn_out_type, .GetOutputTypeCount = attn_out_count,     \
    .CreateKernelV2 = attn_create, .KernelComputeV2 = attn_compute
static const SekCustomOp sek_attention_op = {SEK_ATTENTION_OP}, sek_attention_f16_op = {SEK_ATTENTION_OP},
                         sek_attention_i8_op = {SEK_ATTENTION_OP};

/* ---------------------------------------------------------------- SekRowAttention
 *   out [1, R, hq d], present_key, present_value [N, hkv, S, d] =
 *       SekRowAttention(qkv [1, R, (hq + 2 hkv) d], past_key, past_value [N, hkv, S, d], row_slot int64 [R],
 *                       row_pos int64 [R], cos, sin [positions, d/2])
 *       attributes: num_heads, kv_num_heads, scale, window, softcap, k_shift (optional: SekAttention's)
 * A step of R rows from up to N sequences, each in its own KV slot: row r is the token at position row_pos[r] of the
 * sequence in slot row_slot[r]. Every real row's k and v are written into its slot at its position, then each row's
 * query attends over its slot's rows 0 .. row_pos[r] (so a slot's rows at consecutive positions form a causal chain,
 * as SekAttention's T rows do). A row of slot -1 is padding: it writes nothing, its position is not read, its output
 * is zeros. Each real row's output has the bits SekAttention gives that query in a step of its slot alone (sek_attn.c),
 * whatever else the step holds and in whatever order. Real rows name slots 0 .. N-1 and positions below S and the
 * rotary tables' length, no two the same (slot, position). present is the cache itself when bound to the past's
 * buffer; otherwise the past is copied into it first.
 * The optional input 7, row_parent int64 [R], makes tree rows (sek.h): row r with row_parent[r] = p >= 0 is a token
 * that follows row p's, written at row_pos[r] and attending to its root's rows 0 .. row_pos[root] and its ancestors'
 * rows, at position row_pos[root] + its depth: the bits of the same tokens decoded as one chain. */

typedef struct {
    int64_t key, row; /* key: slot S + pos */
} RowKey;

static int row_key_order(const void *x, const void *y) {
    const RowKey *a = (const RowKey *)x, *b = (const RowKey *)y;
    return a->key != b->key ? (a->key < b->key ? -1 : 1) : (a->row < b->row ? -1 : a->row > b->row);
}

/* Every real row's slot and position in range, and no (slot, position) written twice; a tree row's parent an earlier
 * real row of its slot at a lower position, at most SEK_TREE_DEPTH rows below its root, with d <= 128. */
static OrtStatus *check_rows(OrtApiTable api, const int64_t *slot, const int64_t *pos, const int64_t *parent,
                             int64_t R, int64_t N, int64_t S, int64_t positions, int64_t d) {
    const int64_t limit = S < positions ? S : positions;
    int64_t real = 0;
    for (int64_t r = 0; parent && r < R; r++) {
        const int64_t p = parent[r];
        if (p == -1) continue;
        if (p < -1 || p >= r || slot[r] < 0 || slot[p] != slot[r] || pos[p] >= pos[r])
            return fail(api, ORT_INVALID_ARGUMENT, "SekRowAttention: row %lld (slot %lld, position %lld) names row "
                        "%lld as its parent; a parent is -1 (none) or an earlier row of the same slot at a lower "
                        "position", (long long)r, (long long)slot[r], (long long)pos[r], (long long)p);
        int64_t depth = 1;
        for (int64_t u = p; parent[u] >= 0; u = parent[u]) depth++;
        if (depth > SEK_TREE_DEPTH)
            return fail(api, ORT_INVALID_ARGUMENT, "SekRowAttention: row %lld lies %lld rows below its root; tree rows "
                        "lie at most %d below it", (long long)r, (long long)depth, SEK_TREE_DEPTH);
        if (d > 128)
            return fail(api, ORT_INVALID_ARGUMENT, "SekRowAttention: row %lld is a tree row, and the head dim is %lld; "
                        "tree rows need a head dim of at most 128", (long long)r, (long long)d);
    }
    for (int64_t r = 0; r < R; r++) {
        if (slot[r] < -1 || slot[r] >= N)
            return fail(api, ORT_INVALID_ARGUMENT, "SekRowAttention: row %lld names KV slot %lld; the caches hold %lld "
                        "slots (0..%lld), and -1 marks padding", (long long)r, (long long)slot[r], (long long)N,
                        (long long)(N - 1));
        if (slot[r] < 0) continue;
        if (pos[r] < 0 || pos[r] >= limit)
            return fail(api, ORT_INVALID_ARGUMENT, "SekRowAttention: row %lld (slot %lld) is at position %lld; positions "
                        "are 0..%lld (the caches hold %lld rows, the rotary tables %lld)", (long long)r,
                        (long long)slot[r], (long long)pos[r], (long long)(limit - 1), (long long)S,
                        (long long)positions);
        real++;
    }
    static _Thread_local void *keys = NULL;
    static _Thread_local size_t keys_size = 0;
    if (real < 2) return NULL;
    if (!grow(&keys, &keys_size, (size_t)real * sizeof(RowKey)))
        return fail(api, ORT_FAIL, "SekRowAttention: out of memory");
    RowKey *k = (RowKey *)keys;
    int64_t n = 0;
    for (int64_t r = 0; r < R; r++)
        if (slot[r] >= 0) k[n++] = (RowKey){slot[r] * S + pos[r], r};
    qsort(k, (size_t)n, sizeof *k, row_key_order);
    for (int64_t i = 1; i < n; i++)
        if (k[i].key == k[i - 1].key)
            return fail(api, ORT_INVALID_ARGUMENT, "SekRowAttention: rows %lld and %lld both write slot %lld at position "
                        "%lld; a step writes each (slot, position) once", (long long)k[i - 1].row, (long long)k[i].row,
                        (long long)slot[k[i].row], (long long)pos[k[i].row]);
    return NULL;
}

static void row_attn_item(void *p, size_t i) { sek_row_attn_item((const sek_row_attn_args *)p, (int64_t)i); }

static OrtStatus *row_attn_compute(void *kernel, OrtKernelContext *ctx) {
    const SekAttnKernel *k = (const SekAttnKernel *)kernel;
    OrtApiTable api = k->api;
    static const int types[7] = {T_FLOAT, T_ANY, T_ANY, T_INT64, T_INT64, T_FLOAT, T_FLOAT};
    Input in[8];
    TRY(read_inputs(api, ctx, "SekRowAttention", 7, types, in));
    int kv_type = SEK_KV_F32;
    int64_t d = 0;
    TRY(cache_type(api, "SekRowAttention", in, &kv_type, &d));
    const OrtValue *pv = NULL; /* row_parent: optional (a node without it has no tree rows) */
    TRY(KernelContext_GetInput(api)(ctx, 7, &pv));
    const int64_t *parent = NULL;
    if (pv) {
        TRY(tensor_info(api, pv, T_INT64, in[7].dims, &in[7].nd, &in[7].count, 7, &in[7].type));
        TRY(GetTensorMutableData(api)((OrtValue *)pv, &in[7].data));
        if (in[7].nd != 1 || in[7].dims[0] != in[0].dims[1])
            return fail(api, ORT_INVALID_ARGUMENT, "SekRowAttention: row_parent holds %lld values (rank %lld); qkv "
                        "has %lld rows, one per row", (long long)(in[7].nd ? in[7].dims[0] : 0), (long long)in[7].nd,
                        (long long)in[0].dims[1]);
        parent = (const int64_t *)in[7].data;
    }
    if (in[0].nd != 3 || in[0].dims[0] != 1 || in[1].nd != 4 || in[2].nd != 4 || in[3].nd != 1 || in[4].nd != 1 ||
        in[5].nd != 2 || in[6].nd != 2)
        return fail(api, ORT_INVALID_ARGUMENT, "SekRowAttention: expects qkv [1, R, W], caches [N, kv_heads, S, d], "
                    "row_slot and row_pos [R], cos/sin [positions, d/2]; got ranks %lld, %lld, %lld, %lld, %lld, %lld, "
                    "%lld", (long long)in[0].nd, (long long)in[1].nd, (long long)in[2].nd, (long long)in[3].nd,
                    (long long)in[4].nd, (long long)in[5].nd, (long long)in[6].nd);
    const int64_t R = in[0].dims[1], N = in[1].dims[0], S = in[1].dims[2];
    const int64_t positions = in[5].dims[0];
    if (in[1].dims[1] != k->hkv || d <= 0 || d % 2 || d > 512 || in[0].dims[2] != (k->hq + 2 * k->hkv) * d ||
        memcmp(in[2].dims, in[1].dims, 4 * sizeof(int64_t)) || in[5].dims[1] < 1 || in[5].dims[1] > d / 2 ||
        memcmp(in[6].dims, in[5].dims, 2 * sizeof(int64_t)))
        return fail(api, ORT_INVALID_ARGUMENT, "SekRowAttention: qkv width %lld, caches [%lld, %lld, %lld, %lld], "
                    "rotary tables [%lld, %lld]: with num_heads %lld and kv_num_heads %lld the caches are [N, %lld, S, "
                    "d] alike, d even and at most 512, the width (%lld + 2 x %lld) d, the tables [positions, r/2], r <= d",
                    (long long)in[0].dims[2], (long long)N, (long long)in[1].dims[1], (long long)S, (long long)d,
                    (long long)positions, (long long)in[5].dims[1], (long long)k->hq, (long long)k->hkv,
                    (long long)k->hkv, (long long)k->hq, (long long)k->hkv);
    if (in[3].dims[0] != R || in[4].dims[0] != R)
        return fail(api, ORT_INVALID_ARGUMENT, "SekRowAttention: row_slot holds %lld values and row_pos %lld; qkv has "
                    "%lld rows, one of each per row", (long long)in[3].dims[0], (long long)in[4].dims[0], (long long)R);
    const int64_t *slot = (const int64_t *)in[3].data, *pos = (const int64_t *)in[4].data;
    TRY(check_rows(api, slot, pos, parent, R, N, S, positions, d));
    if (k->n_shift && k->n_shift != (size_t)(k->hkv * d))
        return fail(api, ORT_INVALID_ARGUMENT, "SekRowAttention: k_shift holds %zu values; kv_num_heads x head dim is "
                    "%lld", k->n_shift, (long long)(k->hkv * d));
    void *o[3];
    TRY(attn_outputs(api, ctx, "SekRowAttention", R, k->hq * d, in, o));
    if (R == 0) return NULL;
    int64_t *chunk = malloc((size_t)(R + 1) * sizeof(int64_t));
    if (!chunk) return CreateStatus(api)(ORT_FAIL, "SekRowAttention: out of memory");
    sek_row_attn_args a = {(const float *)in[0].data, o[1], o[2], slot, pos, parent, (const float *)in[5].data,
                           (const float *)in[6].data, (float *)o[0], R, N, k->hq, k->hkv, d, S, k->scale, 1, chunk,
                           kv_type, k->window, k->softcap, 2 * in[5].dims[1], k->n_shift ? k->k_shift : NULL};
    const int64_t items = sek_row_attn_plan(slot, R, k->hq, k->hkv, d, online_cpus(), &a.hs, chunk);
    sek_row_attn_store(&a);
    OrtStatus *st = KernelContext_ParallelFor(api)(ctx, row_attn_item, (size_t)items, 0, &a);
    free(chunk);
    return st;
}

static const char *row_attn_name(const void *op) { (void)op; return "SekRowAttention"; }
static int row_attn_in_type(const void *op, size_t i) {
    return i == 3 || i == 4 || i == 7 ? T_INT64 : i == 1 || i == 2 ? attn_cache_type(op) : T_FLOAT;
}
static size_t row_attn_in_count(const void *op) { (void)op; return 8; }
static int row_attn_optional(const void *op, size_t i) { (void)op; return i == 7; } /* row_parent */

#define SEK_ROW_ATTENTION_OP                                                                                       \
    SEK_OP_COMMON, .GetInputCharacteristic = row_attn_optional, .GetName = row_attn_name,                         \
    .GetInputType = row_attn_in_type, .GetInputTypeCount = row_attn_in_count, .GetOutputType = attn_out_type,     \
    .GetOutputTypeCount = attn_out_count, .CreateKernelV2 = attn_create, .KernelComputeV2 = row_attn_compute
static const SekCustomOp sek_row_attention_op = {SEK_ROW_ATTENTION_OP},
                         sek_row_attention_f16_op = {SEK_ROW_ATTENTION_OP}, sek_row_attention_i8_op = {SEK_ROW_ATTENTION_OP};

/* Called by ONNX Runtime (SessionOptions.register_custom_ops_library). The op and its domain live as long as
 * the process: ONNX Runtime keeps the pointers. */
__attribute__((visibility("default"))) OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    OrtApiTable api = base->GetApi(API_VERSION);
    if (!api) {
        OrtApiTable v1 = base->GetApi(1);
        return v1 ? CreateStatus(v1)(ORT_FAIL, "specedge kernels need ONNX Runtime >= 1.17 (C API version 17)") : NULL;
    }
    OrtCustomOpDomain *domain = NULL;
    TRY(CreateCustomOpDomain(api)("ai.specedge", &domain));
    OrtStatus *st = CustomOpDomain_Add(api)(domain, &sek_matmul_op);
    if (!st) st = CustomOpDomain_Add(api)(domain, &sek_matmul_sb_op);
    if (!st) st = CustomOpDomain_Add(api)(domain, &sek_attention_op);
    if (!st) st = CustomOpDomain_Add(api)(domain, &sek_row_attention_op);
    if (!st) st = CustomOpDomain_Add(api)(domain, &sek_attention_f16_op);
    if (!st) st = CustomOpDomain_Add(api)(domain, &sek_row_attention_f16_op);
    if (!st) st = CustomOpDomain_Add(api)(domain, &sek_attention_i8_op);
    if (!st) st = CustomOpDomain_Add(api)(domain, &sek_row_attention_i8_op);
    if (!st) st = AddCustomOpDomain(api)(options, domain);
    if (st) ReleaseCustomOpDomain(api)(domain); /* on success the options use it: it lives as long as the process */
    return st;
}

/* ctypes entry for tools and tests: which ISA paths this build has (bit 1 scalar, 2 avx2, 3 vnni512, 4 neon). */
__attribute__((visibility("default"))) int specedge_kernels_isa_mask(void) { return sek_isa_mask(); }
