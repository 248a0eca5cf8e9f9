/* What a decode step's attention costs at depth, per KV cache type: specedge's SekAttention kernel alone, for a
 * model's layers over caches of their full size (so memory traffic is what a real step sees), one row (T=1) or a few.
 *
 *   cc -O3 -march=native -std=c11 -D_GNU_SOURCE -pthread -I runtime/csrc tools/dev/attn_bench.c \
 *      runtime/csrc/sek_attn.c -o attn_bench -lm
 *   ./attn_bench [DEPTHS=128,2048,8192] [TYPES=f32,f16,i8] [T=1] [THREADS=2] [LAYERS=28] [HQ=12] [HKV=2] [D=128]
 *
 * Defaults are Qwen2.5-Coder-1.5B's shape. Prints, per type and depth, ms per step (all layers; the best of 5) and
 * the bytes of K and V the step reads per ms (GB/s), so the kernel's rate can be set beside the machine's memory.
 * Items run as the ONNX op runs them: sek_attn_plan's split for THREADS, items dealt to threads in turn. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sek.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint64_t rng = 88172645463325252ull;
static float frand(void) { /* uniform in [-1, 1) */
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((rng >> 40) * (1.0 / (1ull << 23)) - 1.0);
}

static void fill(void *cache, int type, int64_t rows, int64_t d) {
    const size_t rb = sek_kv_row_bytes(type, d);
    for (int64_t r = 0; r < rows; r++) {
        char *row = (char *)cache + (size_t)r * rb;
        if (type == SEK_KV_F32)
            for (int64_t i = 0; i < d; i++) ((float *)row)[i] = frand();
        else if (type == SEK_KV_F16)
            for (int64_t i = 0; i < d; i++) ((uint16_t *)row)[i] = sek_f32_to_f16(frand());
        else {
            for (int64_t i = 0; i < d; i++) ((int8_t *)row)[i] = (int8_t)(frand() * 127.f);
            const float s = 1.f / 127.f;
            memcpy(row + d, &s, sizeof s);
        }
    }
}

typedef struct {
    sek_attn_args *layers;
    int64_t layers_n, items, threads, me;
} job;

static void *run(void *p) {
    const job *j = p;
    for (int64_t l = 0; l < j->layers_n; l++)
        for (int64_t it = j->me; it < j->items; it += j->threads) sek_attn_row(&j->layers[l], it);
    return NULL;
}

static int64_t env(const char *name, int64_t dflt) {
    const char *v = getenv(name);
    return v && *v ? strtoll(v, NULL, 10) : dflt;
}

int main(void) {
    const char *depths_s = getenv("DEPTHS") ? getenv("DEPTHS") : "128,2048,8192";
    const char *types_s = getenv("TYPES") ? getenv("TYPES") : "f32,f16,i8";
    const int64_t t = env("T", 1), threads = env("THREADS", 2), nl = env("LAYERS", 28), hq = env("HQ", 12),
                  hkv = env("HKV", 2), d = env("D", 128);
    if (t < 1 || threads < 1 || threads > 64 || nl < 1 || hkv < 1 || hq % hkv || d < 16 || d > 512 || d % 2) {
        fprintf(stderr, "attn_bench: T, THREADS (1-64), LAYERS >= 1; HQ a multiple of HKV; D even, 16-512\n");
        return 2;
    }
    printf("layers %lld, hq %lld, hkv %lld, d %lld, T %lld, threads %lld\n", (long long)nl, (long long)hq,
           (long long)hkv, (long long)d, (long long)t, (long long)threads);
    printf("%-5s %8s %10s %8s\n", "type", "depth", "ms/step", "GB/s");
    char types[256];
    snprintf(types, sizeof types, "%s", types_s);
    for (char *ts = strtok(types, ","); ts; ts = strtok(NULL, ",")) {
        const int type = !strcmp(ts, "f32") ? SEK_KV_F32 : !strcmp(ts, "f16") ? SEK_KV_F16 : !strcmp(ts, "i8") ? SEK_KV_I8 : -1;
        if (type < 0) {
            fprintf(stderr, "attn_bench: type %s: one of f32, f16, i8\n", ts);
            return 2;
        }
        char depths[256];
        snprintf(depths, sizeof depths, "%s", depths_s);
        char *save = NULL;
        for (char *ds = strtok_r(depths, ",", &save); ds; ds = strtok_r(NULL, ",", &save)) {
            const int64_t depth = strtoll(ds, NULL, 10), s_max = depth + t;
            if (depth < 0) {
                fprintf(stderr, "attn_bench: depth %s: a count of positions >= 0\n", ds);
                return 2;
            }
            const size_t rb = sek_kv_row_bytes(type, d), per = (size_t)(hkv * s_max) * rb;
            char *kc = malloc(per * nl), *vc = malloc(per * nl);
            float *qkv = malloc(sizeof(float) * t * (hq + 2 * hkv) * d), *out = malloc(sizeof(float) * t * hq * d);
            float *cs = malloc(sizeof(float) * s_max * d / 2), *sn = malloc(sizeof(float) * s_max * d / 2);
            sek_attn_args *layers = calloc(nl, sizeof *layers);
            if (!kc || !vc || !qkv || !out || !cs || !sn || !layers) {
                fprintf(stderr, "attn_bench: out of memory at depth %lld\n", (long long)depth);
                return 1;
            }
            fill(kc, type, hkv * s_max * nl, d);
            fill(vc, type, hkv * s_max * nl, d);
            for (int64_t i = 0; i < t * (hq + 2 * hkv) * d; i++) qkv[i] = frand();
            for (int64_t i = 0; i < s_max * d / 2; i++) cs[i] = 1.f, sn[i] = 0.f;
            int64_t hs, rs;
            const int64_t items = sek_attn_plan(t, hq, hkv, d, threads, &hs, &rs);
            for (int64_t l = 0; l < nl; l++)
                layers[l] = (sek_attn_args){.qkv = qkv, .k_cache = kc + per * l, .v_cache = vc + per * l, .cos = cs,
                                            .sin = sn, .out = out, .t = t, .hq = hq, .hkv = hkv, .d = d,
                                            .s_max = s_max, .past_len = depth, .scale = 0.088f, .hs = hs, .rs = rs,
                                            .kv_type = type, .rot = d};
            double best = 1e30;
            for (int rep = 0; rep < 6; rep++) {
                pthread_t th[64];
                job jobs[64];
                const double t0 = now();
                for (int64_t i = 0; i < threads; i++) {
                    jobs[i] = (job){layers, nl, items, threads, i};
                    pthread_create(&th[i], NULL, run, &jobs[i]);
                }
                for (int64_t i = 0; i < threads; i++) pthread_join(th[i], NULL);
                const double dt = now() - t0;
                if (rep && dt < best) best = dt; /* the first run warms the pages */
            }
            const double bytes = 2.0 * (double)nl * hkv * (depth + t) * rb;
            printf("%-5s %8lld %10.2f %8.1f\n", ts, (long long)depth, best * 1e3, bytes / best * 1e-9);
            free(kc), free(vc), free(qkv), free(out), free(cs), free(sn), free(layers);
        }
    }
    return 0;
}
