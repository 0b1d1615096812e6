/* What the native C files share: the weight and activation formats of q4gemm.c / q8gemm.c, the structs Python passes
in (blockspec/native/structs.py mirrors them; layout.c reports their layout so the mirrors are checked at load), the
model's dims, and the row-wise helpers (norm, rotary, exp) decoder.c and draft.c compute the same way. Every sum runs
over 8 fixed lanes in a fixed order, so a row's result never depends on the rows beside it (decoder.c's comment). */

#ifndef BLOCKSPEC_NATIVE_H
#define BLOCKSPEC_NATIVE_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The x86 SIMD paths (AVX2, AVX512-VNNI, AMX) are compiled on x86 only: elsewhere the same files build the scalar
paths, which give the same bits. BLOCKSPEC_PORTABLE asks an x86 build for what another architecture compiles (the
build test checks that it builds and computes the same). */
#if (defined(__x86_64__) || defined(__i386__)) && !defined(BLOCKSPEC_PORTABLE)
#define BLOCKSPEC_X86 1
#endif
/* AMX tiles: 64-bit x86 and a compiler with their intrinsics (build.py's later tries pass BLOCKSPEC_NO_AMX) */
#if defined(BLOCKSPEC_X86) && defined(__x86_64__) && !defined(BLOCKSPEC_NO_AMX)
#define BLOCKSPEC_AMX 1
#endif

#define QK 32    /* inputs per block (GGUF's Q4_1 / Q8_0 blocks, the activations' int8 blocks) */
#define NG 8     /* outputs per group: the lanes of one 256-bit vector */
#define LANES 8  /* the fixed lanes of every float sum */
/* AMX from this many rows (verify steps of a few rows measure faster on VNNI:
   docs/results/2026-12-06-cpu-native-drafter-amx.md) */
#define AMX_MIN_ROWS 8

float fp16_to_f32(uint16_t h);
void q8_quantize_blocks(const float *x, int n, int8_t *qx, float *sx, float *xs);
void q4_gemm_groups(const uint8_t *packed, const uint16_t *d, const uint16_t *m, int N, int K, const int8_t *qx,
                    const float *sx, const float *xs, int M, float *y, int g0, int g1, int path);
void q8_gemm_groups(const int8_t *packed, const uint16_t *d, int N, int K, const int8_t *qx, const float *sx, int M,
                    float *y, int g0, int g1, int path);

/* amx.c: whether the CPU has AMX-INT8 and the kernel grants its tile state (0 in a build without AMX), and one pair of
output groups for rows r0..r0+rows-1 (rows <= 16) in q4gemm.c's / q8gemm.c's layout (never called without AMX) */
int amx_available(void);
void q4_pair_amx(const uint8_t *packed, const uint16_t *d, const uint16_t *m, int K, const int8_t *qx, const float *sx,
                 const float *xs, int r0, int rows, float *y, int N, int g);
void q8_pair_amx(const int8_t *packed, const uint16_t *d, int K, const int8_t *qx, const float *sx, int r0, int rows,
                 float *y, int N, int g);

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

/* one forward's rows for decoder_forward (decoder.c) */
typedef struct {
    int T;                       /* rows */
    const float *cos, *sin;      /* [T, D] */
    const int64_t *positions;    /* [T] */
    const int64_t *slot_mapping; /* [T], -1: not stored */
    const int32_t *row_seq;      /* [T] the sequence of each row */
    const int32_t *kv_lens;      /* [B] keys at positions < kv_len are visible */
    const int64_t *block_tables; /* [B, max_blocks] */
    int max_blocks, block_size;
    const int32_t *tap_layers; /* [n_taps]: the stream after these layers (the last: the final-normed output) */
    int n_taps;
    const int32_t *query_start; /* [B + 1]: a draft block's rows (NULL: target rows, causal over the pool) */
    const int32_t *last_rows;   /* [n_last] ascending: the rows whose output is read (NULL: all); decoder.c: layer() */
    int n_last;
} decoder_batch;

/* the committed rows of a drafter's context append (draft.c) */
typedef struct {
    int T, n_taps;
    const float *cos, *sin;      /* [T, D] */
    const int64_t *slot_mapping; /* [T], -1: not stored */
} context_batch;

/* int8 activations of a [T, K] matrix: codes, per block scale sx and xs = sx * (the codes' sum) */
typedef struct {
    int8_t *q;
    float *sx, *xs;
} q8_rows;

/* attend.c: a layer's attention in tiles of keys (its comment); the plan is built once per forward */
typedef struct {
    int seq, q0, nq, tiles, unit0; /* its queries are qidx[q0 .. q0 + nq - 1]; its units unit0 .. + kv_heads * tiles */
    int64_t keys;                  /* keys its query seeing the most sees */
    size_t part0;                  /* its first partial in the pass */
} attn_segment;
typedef struct {
    int seg0, n_seg, unit0, n_units;
} attn_pass;
typedef struct {
    int n_pass, n_seg, n_units, group; /* group: query heads per kv head */
    int hunit;                         /* query heads a unit takes: the group, or 1 where units would be too few */
    int *qidx;                         /* [Tq] query rows ordered by sequence */
    int64_t *nkeys;                    /* [Tq] keys each query row sees */
    attn_segment *segs;
    attn_pass *passes;
    int *unit_seg; /* [n_units] */
    float *o, *m, *l; /* one pass's partials [parts, D], [parts], [parts] */
} attn_plan;
typedef struct {
    const float **ks, **vs; /* [2, TILE] two tiles' key and value addresses (the one in use, the next) */
    float *scores;          /* [ATTN_HEADS, TILE] */
} attn_scratch;
#define ATTN_TILE 64
#define ATTN_HEADS 3 /* query heads attend.c takes together */

/* used between the C files only: not exported from the library (lib.py types every export) */
#define INTERNAL __attribute__((visibility("hidden")))
INTERNAL int attn_plan_build(const decoder_dims *dm, const decoder_batch *bt, const int32_t *rows, int Tq, attn_plan *p);
INTERNAL void attn_plan_free(attn_plan *p);
INTERNAL void attn_units(const decoder_dims *dm, const decoder_batch *bt, const layer_weights *lw, const float *qkv, int QKV,
                const float *block_k, const float *block_v, const int32_t *rows, const attn_plan *p, int k,
                const attn_scratch *sc, int tid, int nth);
INTERNAL void attn_combine(const decoder_dims *dm, const attn_plan *p, int k, float *out, const q8_rows *att);

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

/* rotate-half rotary of one head in place: x[i] cos[i] - x[i + D/2] sin[i], x[i + D/2] cos[i + D/2] + x[i] sin[i +
   D/2] */
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
