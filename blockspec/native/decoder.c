/* A quantized decoder stack's forward on the CPU in one call (blockspec/native/decoder.py drives it): per layer
add + RMSNorm + int8 quantize, q|k|v (Q4 x Q8, q4gemm.c), optional q/k head norms, rotary, the new k/v stored in the
paged pool, attention of every row over its sequence's keys, o, add + RMSNorm, gate|up, SiLU * up, down.

Why one call: a SmolLM2-135M decode step on 2 cores spends more time in ~60 small eager torch ops per layer (~10 us
each) than in its weights; here the whole stack is one OpenMP parallel region. Threads split the matmuls' output
groups and the attention's (row, head) pairs; the residual stream and the row-wise work between matmuls (add, norm,
quantize, SiLU) are replicated in every thread (a few us a row), so a layer needs six barriers, not ten: on a machine
whose cores are shared a barrier can cost a scheduler tick.

Exactness: every value of a row is computed by one thread with the same operations in the same order whatever the
other rows, their number, the thread count and which thread runs it (rows, (row, head) pairs and output groups are
split over threads, never a sum): a verify step's rows equal plain decoding's, so greedy speculative output equals
plain decoding of the same model. Built with -ffp-contract=off so the compiler never fuses a multiply-add in one place
and not another; the SIMD sums keep 8 fixed lanes. */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define LANES 8

void q8_quantize_blocks(const float *x, int n, int8_t *qx, float *sx, float *xs, int32_t *qs);
void q4_gemm_groups(const uint8_t *packed, const uint16_t *d, const uint16_t *m, int N, int K, const int8_t *qx,
                    const float *sx, const float *xs, const int32_t *qs, int M, float *y, int g0, int g1, int path);

typedef struct {
    const uint8_t *packed; /* codes in q4gemm.c's chunked layout */
    const uint16_t *d, *m; /* bf16 [N / 8, K / 32, 8] */
    const float *bias;     /* [N] or NULL */
    int N, K;
} q4_weight;

typedef struct {
    const float *input_norm, *post_norm; /* [H] */
    const float *q_norm, *k_norm;        /* [D] or NULL (Qwen3's per-head norms) */
    q4_weight qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* this layer's [slots, Hkv, D] */
} layer_weights;

typedef struct {
    int hidden, heads, kv_heads, head_dim, intermediate, layers;
    float eps, scale;
    int threads, path;
} decoder_dims;

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
} decoder_batch;

/* int8 activations of a [T, K] matrix: codes, per block scale sx, xs = sx * sum, integer sums */
typedef struct {
    int8_t *q;
    float *sx, *xs;
    int32_t *qs;
} q8_rows;

/* what each thread keeps to itself: its copy of the residual stream and of the row-wise work */
typedef struct {
    float *h, *x, *act, *scores, *q;
    q8_rows in;
} private_buffers;

/* matmul outputs and the attention's quantized output, written by all threads */
typedef struct {
    float *qkv, *o, *gate_up, *down;
    q8_rows att;
} shared_buffers;

static float sum_lanes(const float *acc) {
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

static float dot(const float *a, const float *b, int n) { /* n a multiple of LANES */
    float acc[LANES] = {0};
    for (int i = 0; i < n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    return sum_lanes(acc);
}

/* out = x * rsqrt(mean(x^2) + eps) * w */
static void rms_norm(const float *x, const float *w, int n, float eps, float *out) {
    float r = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* rotate-half rotary of one head in place: x[i] cos[i] - x[i + D/2] sin[i], x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2] */
static void rotary(float *x, const float *cos, const float *sin, int D) {
    int h = D / 2;
    for (int i = 0; i < h; i++) {
        float a = x[i], b = x[i + h];
        x[i] = a * cos[i] - b * sin[i];
        x[i + h] = b * cos[i + h] + a * sin[i + h];
    }
}

/* e^x (softmax after the max is taken, SiLU): 2^(x log2 e) as 2^n * 2^f, f in [-0.5, 0.5], a degree-6 polynomial
(relative error ~2e-7). Written so the compiler vectorizes it: libm's expf is a call per element. */
static inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float t = x * 1.44269504088896341f;
    float n = floorf(t + 0.5f), f = t - n;
    float p = 1.5403530393381606e-4f;
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* one row and one query head (q rotated) over its sequence's keys at positions 0..min(pos, kv_len - 1) */
static void attend(const decoder_dims *dm, const decoder_batch *bt, const layer_weights *lw, const float *q, int t,
                   int head, float *out, float *scores) {
    int D = dm->head_dim, kvh = head / (dm->heads / dm->kv_heads), s = bt->row_seq[t], bs = bt->block_size;
    int64_t n = bt->positions[t] + 1;
    if (n > bt->kv_lens[s]) n = bt->kv_lens[s];
    const int64_t *table = bt->block_tables + (size_t)s * bt->max_blocks;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        int64_t slot = table[j / bs] * bs + j % bs;
        scores[j] = dot(q, lw->k_cache + ((size_t)slot * dm->kv_heads + kvh) * D, D) * dm->scale;
        mx = scores[j] > mx ? scores[j] : mx;
    }
    float acc[LANES] = {0};
    for (int64_t j = 0; j < n; j++) scores[j] = fast_exp(scores[j] - mx);
    for (int64_t j = 0; j < n; j++) acc[j % LANES] += scores[j];
    float inv = 1.0f / sum_lanes(acc);
    for (int i = 0; i < D; i++) out[i] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        int64_t slot = table[j / bs] * bs + j % bs;
        const float *v = lw->v_cache + ((size_t)slot * dm->kv_heads + kvh) * D;
        float p = scores[j] * inv;
        for (int i = 0; i < D; i++) out[i] += p * v[i];
    }
}

static void share(int n, int tid, int nth, int *a, int *b) { /* contiguous split of 0..n-1 */
    *a = (int)((int64_t)n * tid / nth);
    *b = (int)((int64_t)n * (tid + 1) / nth);
}

/* this thread's output groups of y [T, N] = x @ W.T (+ bias), x given as int8 rows */
static void matmul(const decoder_dims *dm, const q4_weight *w, const q8_rows *x, int T, float *y, int tid, int nth) {
    int g0, g1;
    share(w->N / 8, tid, nth, &g0, &g1);
    q4_gemm_groups(w->packed, w->d, w->m, w->N, w->K, x->q, x->sx, x->xs, x->qs, T, y, g0, g1, dm->path);
    if (w->bias)
        for (int t = 0; t < T; t++)
            for (int n = g0 * 8; n < g1 * 8; n++) y[(size_t)t * w->N + n] += w->bias[n];
}

static void quantize(const float *x, int rows, int K, const q8_rows *out) {
    q8_quantize_blocks(x, rows * (K / QK), out->q, out->sx, out->xs, out->qs);
}

static int tap_index(const decoder_batch *bt, int layer) {
    for (int i = 0; i < bt->n_taps; i++)
        if (bt->tap_layers[i] == layer) return i;
    return -1;
}

/* rows a..b-1: the k heads normed and rotated, k and v stored in the pool */
static void store_kv(const decoder_dims *dm, const decoder_batch *bt, const layer_weights *lw, const float *qkv,
                     int a, int b, float *k) {
    int D = dm->head_dim, QKV = lw->qkv.N;
    size_t kv = (size_t)dm->kv_heads * D;
    for (int t = a; t < b; t++) {
        const float *row = qkv + (size_t)t * QKV;
        int64_t slot = bt->slot_mapping[t];
        if (slot < 0) continue;
        memcpy(k, row + (size_t)dm->heads * D, kv * sizeof(float));
        for (int h = 0; h < dm->kv_heads; h++) {
            if (lw->k_norm) rms_norm(k + (size_t)h * D, lw->k_norm, D, dm->eps, k + (size_t)h * D);
            rotary(k + (size_t)h * D, bt->cos + (size_t)t * D, bt->sin + (size_t)t * D, D);
        }
        memcpy(lw->k_cache + (size_t)slot * kv, k, kv * sizeof(float));
        memcpy(lw->v_cache + (size_t)slot * kv, row + (size_t)dm->heads * D + kv, kv * sizeof(float));
    }
}

static void layer(const decoder_dims *dm, const decoder_batch *bt, const layer_weights *lw, const shared_buffers *sh,
                  const private_buffers *pv, int tid, int nth) {
    int T = bt->T, H = dm->hidden, D = dm->head_dim, I = dm->intermediate, QKV = lw->qkv.N, a, b;
    for (int t = 0; t < T; t++) rms_norm(pv->h + (size_t)t * H, lw->input_norm, H, dm->eps, pv->x + (size_t)t * H);
    quantize(pv->x, T, H, &pv->in);
    matmul(dm, &lw->qkv, &pv->in, T, sh->qkv, tid, nth);
#pragma omp barrier
    share(T, tid, nth, &a, &b);
    store_kv(dm, bt, lw, sh->qkv, a, b, pv->q);
#pragma omp barrier
    share(T * dm->heads, tid, nth, &a, &b);
    for (int p = a; p < b; p++) { /* rows of a sequence see each other's keys: all were stored above */
        int t = p / dm->heads, hq = p % dm->heads;
        memcpy(pv->q, sh->qkv + (size_t)t * QKV + (size_t)hq * D, D * sizeof(float));
        if (lw->q_norm) rms_norm(pv->q, lw->q_norm, D, dm->eps, pv->q);
        rotary(pv->q, bt->cos + (size_t)t * D, bt->sin + (size_t)t * D, D);
        attend(dm, bt, lw, pv->q, t, hq, pv->x, pv->scores);
        size_t blk = (size_t)p * (D / QK); /* a head is whole blocks of 32 (NativeDecoder.runs checks D) */
        q8_quantize_blocks(pv->x, D / QK, sh->att.q + blk * QK, sh->att.sx + blk, sh->att.xs + blk, sh->att.qs + blk);
    }
#pragma omp barrier
    matmul(dm, &lw->o, &sh->att, T, sh->o, tid, nth);
#pragma omp barrier
    for (size_t i = 0; i < (size_t)T * H; i++) pv->h[i] += sh->o[i];
    for (int t = 0; t < T; t++) rms_norm(pv->h + (size_t)t * H, lw->post_norm, H, dm->eps, pv->x + (size_t)t * H);
    quantize(pv->x, T, H, &pv->in);
    matmul(dm, &lw->gate_up, &pv->in, T, sh->gate_up, tid, nth);
#pragma omp barrier
    for (int t = 0; t < T; t++) {
        const float *gu = sh->gate_up + (size_t)t * 2 * I;
        float *act = pv->act + (size_t)t * I;
        for (int i = 0; i < I; i++) act[i] = gu[i] / (1.0f + fast_exp(-gu[i])) * gu[I + i];
    }
    quantize(pv->act, T, I, &pv->in);
    matmul(dm, &lw->down, &pv->in, T, sh->down, tid, nth);
#pragma omp barrier
    for (size_t i = 0; i < (size_t)T * H; i++) pv->h[i] += sh->down[i];
}

static void *alloc_q8(q8_rows *r, size_t rows, size_t K) {
    r->q = malloc(rows * K);
    r->sx = malloc(sizeof(float) * rows * (K / QK));
    r->xs = malloc(sizeof(float) * rows * (K / QK));
    r->qs = malloc(sizeof(int32_t) * rows * (K / QK));
    return r->q && r->sx && r->xs && r->qs ? r : NULL;
}

static void free_q8(q8_rows *r) { free(r->q), free(r->sx), free(r->xs), free(r->qs); }

/* one thread's whole forward over the replicated stream (`h`: the embeddings in); thread 0 writes the results */
static void run(const decoder_dims *dm, const layer_weights *lws, const float *final_norm, const decoder_batch *bt,
                const shared_buffers *sh, const private_buffers *pv, int tid, int nth, float *out, float *taps) {
    int T = bt->T, H = dm->hidden;
    for (int l = 0; l < dm->layers; l++) {
        layer(dm, bt, lws + l, sh, pv, tid, nth);
        int k = l < dm->layers - 1 ? tap_index(bt, l) : -1;
        if (k >= 0 && tid == 0)
            for (int t = 0; t < T; t++)
                memcpy(taps + ((size_t)t * bt->n_taps + k) * H, pv->h + (size_t)t * H, sizeof(float) * H);
    }
    if (tid != 0) return;
    int k = tap_index(bt, dm->layers - 1);
    for (int t = 0; t < T; t++) {
        rms_norm(pv->h + (size_t)t * H, final_norm, H, dm->eps, out + (size_t)t * H);
        if (k >= 0) memcpy(taps + ((size_t)t * bt->n_taps + k) * H, out + (size_t)t * H, sizeof(float) * H);
    }
}

/* h [T, H]: the embeddings in, the final-normed hidden states out; taps [T, n_taps * H]. Returns 0, or -1 when
scratch memory cannot be had. */
int decoder_forward(const decoder_dims *dm, const layer_weights *lws, const float *final_norm, const decoder_batch *bt,
                    float *h, float *taps) {
    size_t T = bt->T, H = dm->hidden, I = dm->intermediate, D = dm->head_dim, AT = dm->heads * D;
    int nth = dm->threads > 0 ? dm->threads : 1;
    int64_t longest = 1;
    for (size_t t = 0; t < T; t++) longest = bt->positions[t] + 1 > longest ? bt->positions[t] + 1 : longest;
    shared_buffers sh = {malloc(sizeof(float) * T * (AT + 2 * dm->kv_heads * D)), malloc(sizeof(float) * T * H),
                         malloc(sizeof(float) * T * 2 * I), malloc(sizeof(float) * T * H), {0}};
    int ok = sh.qkv && sh.o && sh.gate_up && sh.down && alloc_q8(&sh.att, T, AT);
    private_buffers *pv = calloc(nth, sizeof(private_buffers));
    ok = ok && pv;
    for (int i = 0; ok && i < nth; i++) {
        size_t widest = I > H ? I : H;
        pv[i].h = malloc(sizeof(float) * T * H);
        pv[i].x = malloc(sizeof(float) * T * (H > D ? H : D));
        pv[i].act = malloc(sizeof(float) * T * I);
        pv[i].scores = malloc(sizeof(float) * longest);
        pv[i].q = malloc(sizeof(float) * (dm->kv_heads > 1 ? dm->kv_heads : 1) * D + sizeof(float) * D);
        ok = pv[i].h && pv[i].x && pv[i].act && pv[i].scores && pv[i].q && alloc_q8(&pv[i].in, T, widest);
        if (ok) memcpy(pv[i].h, h, sizeof(float) * T * H);
    }
    if (ok) {
#pragma omp parallel num_threads(nth)
        {
            /* the shares follow the threads the runtime grants, which may be fewer than asked */
            int tid = omp_get_thread_num();
            run(dm, lws, final_norm, bt, &sh, pv + tid, tid, omp_get_num_threads(), h, taps);
        }
    }
    for (int i = 0; pv && i < nth; i++) {
        free(pv[i].h), free(pv[i].x), free(pv[i].act), free(pv[i].scores), free(pv[i].q), free_q8(&pv[i].in);
    }
    free(pv), free(sh.qkv), free(sh.o), free(sh.gate_up), free(sh.down), free_q8(&sh.att);
    return ok ? 0 : -1;
}
