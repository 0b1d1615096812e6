/* What decoder.c and draft.c share: the weight and activation formats of q4gemm.c / q8gemm.c, the model's dims,
and the row-wise helpers (norm, rotary, exp) both compute the same way. Every sum runs over 8 fixed lanes in a fixed
order, so a row's result never depends on the rows beside it (decoder.c's comment). */

#ifndef BLOCKSPEC_NATIVE_H
#define BLOCKSPEC_NATIVE_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define LANES 8

void q8_quantize_blocks(const float *x, int n, int8_t *qx, float *sx, float *xs);
void q4_gemm_groups(const uint8_t *packed, const uint16_t *d, const uint16_t *m, int N, int K, const int8_t *qx,
                    const float *sx, const float *xs, int M, float *y, int g0, int g1, int path);
void q8_gemm_groups(const int8_t *packed, const uint16_t *d, int N, int K, const int8_t *qx, const float *sx, int M,
                    float *y, int g0, int g1, int path);

typedef struct {
    const void *packed;    /* codes in q4gemm.c's (bits 4) or q8gemm.c's (bits 8) chunked layout */
    const uint16_t *d, *m; /* fp16 [N / 8, K / 32, 8]; m: Q4_1's minimum, NULL for Q8_0 */
    const float *bias;     /* [N] or NULL */
    int N, K, bits;
} qweight;

typedef struct {
    const float *input_norm, *post_norm; /* [H] */
    const float *q_norm, *k_norm;        /* [D] or NULL (Qwen3's per-head norms) */
    qweight qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* this layer's [slots, Hkv, D] */
} layer_weights;

typedef struct {
    int hidden, heads, kv_heads, head_dim, intermediate, layers;
    float eps, scale;
    int threads, path;
} decoder_dims;

/* int8 activations of a [T, K] matrix: codes, per block scale sx and xs = sx * (the codes' sum) */
typedef struct {
    int8_t *q;
    float *sx, *xs;
} q8_rows;

/* 8 floats as one value: GCC lowers its arithmetic to the widest vectors the build targets (SSE pairs at least) */
typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum_lanes(const float *acc) {
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

static inline float dot(const float *a, const float *b, int n) { /* n a multiple of LANES */
    float acc[LANES] = {0};
    for (int i = 0; i < n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    return sum_lanes(acc);
}

/* out = x * rsqrt(mean(x^2) + eps) * w */
static inline void rms_norm(const float *x, const float *w, int n, float eps, float *out) {
    float r = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* rotate-half rotary of one head in place: x[i] cos[i] - x[i + D/2] sin[i], x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2] */
static inline void rotary(float *x, const float *cos, const float *sin, int D) {
    int h = D / 2;
    for (int i = 0; i < h; i++) {
        float a = x[i], b = x[i + h];
        x[i] = a * cos[i] - b * sin[i];
        x[i + h] = b * cos[i + h] + a * sin[i + h];
    }
}

/* e^x (softmax after the max is taken, SiLU): 2^(x log2 e) as 2^n * 2^f, |f| <= ~0.5, a degree-6 polynomial
(relative error ~2e-7). Written so the compiler vectorizes it: libm's expf is a call per element. */
static inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    float t = x * 1.44269504088896341f;
    /* n = round(t) by truncating a positive number (t >= -125.5 after the clamp): floorf would keep the loops
    calling this from vectorizing */
    int32_t k = (int32_t)(t + 128.5f) - 128;
    float n = (float)k, f = t - n;
    float p = 1.5403530393381606e-4f;
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    int32_t bits = (k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

static inline void share(int n, int tid, int nth, int *a, int *b) { /* contiguous split of 0..n-1 */
    *a = (int)((int64_t)n * tid / nth);
    *b = (int)((int64_t)n * (tid + 1) / nth);
}

/* this thread's output groups of y [T, N] = x @ W.T (+ bias), x given as int8 rows */
static inline void matmul(const decoder_dims *dm, const qweight *w, const q8_rows *x, int T, float *y, int tid,
                          int nth) {
    int g0, g1;
    share(w->N / 8, tid, nth, &g0, &g1);
    if (w->bits == 8)
        q8_gemm_groups(w->packed, w->d, w->N, w->K, x->q, x->sx, T, y, g0, g1, dm->path);
    else
        q4_gemm_groups(w->packed, w->d, w->m, w->N, w->K, x->q, x->sx, x->xs, T, y, g0, g1, dm->path);
    if (w->bias)
        for (int t = 0; t < T; t++)
            for (int n = g0 * 8; n < g1 * 8; n++) y[(size_t)t * w->N + n] += w->bias[n];
}

/* outputs n0..n1-1 of w (multiples of 8) as a weight of their own: the groups are stored one after another */
static inline qweight weight_rows(const qweight *w, int n0, int n1) {
    size_t g = (size_t)n0 / 8 * (w->K / QK), bytes = w->bits == 8 ? 8 * 32 : 4 * 32;
    qweight r = {(const uint8_t *)w->packed + g * bytes, w->d + g * 8, w->m ? w->m + g * 8 : NULL,
                 w->bias ? w->bias + n0 : NULL, n1 - n0, w->K, w->bits};
    return r;
}

static inline void quantize(const float *x, int rows, int K, const q8_rows *out) {
    q8_quantize_blocks(x, rows * (K / QK), out->q, out->sx, out->xs);
}

static inline void *alloc_q8(q8_rows *r, size_t rows, size_t K) {
    r->q = malloc(rows * K);
    r->sx = malloc(sizeof(float) * rows * (K / QK));
    r->xs = malloc(sizeof(float) * rows * (K / QK));
    return r->q && r->sx && r->xs ? r : NULL;
}

static inline void free_q8(q8_rows *r) { free(r->q), free(r->sx), free(r->xs); }

#endif
