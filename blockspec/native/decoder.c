/* A quantized decoder stack's forward on the CPU in one call (blockspec/loading/native_stack.py drives it): per layer
add + RMSNorm + int8 quantize, q|k|v (Q4 or Q8 x Q8, q4gemm.c / q8gemm.c), optional q/k head norms, rotary, the new
k/v stored in the paged pool, attention of every row over its sequence's keys, o, add + RMSNorm, gate|up, SiLU * up,
down. The same stack runs a DFlash drafter's block: each row over its sequence's cached draft context and every row
of its own block, whose k/v are kept for this call only.

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

#include <omp.h>

#include "native.h"
#if defined(__AVX__) && defined(BLOCKSPEC_X86)
#include <immintrin.h>
#endif

/* what each thread keeps to itself: its copy of the residual stream and of the row-wise work */
typedef struct {
    float *h, *x, *act, *scores, *q;
    const float **ks, **vs; /* the current row's key and value addresses */
    q8_rows in;
} private_buffers;

/* matmul outputs, the attention's quantized output and a draft block's own k / v, written by all threads */
typedef struct {
    float *qkv, *o, *gate_up, *down, *block_k, *block_v;
    q8_rows att;
} shared_buffers;

/* the addresses of row t's keys for kv head kvh: ks[j], vs[j] (a target row: its sequence's keys at positions
0..min(pos, kv_len - 1) through the block table; a draft row: its sequence's kv_len context keys, then every row of
its block); returns their number */
static int64_t key_rows(const decoder_dims *dm, const decoder_batch *bt, const layer_weights *lw,
                        const shared_buffers *sh, int t, int kvh, const float **ks, const float **vs) {
    int s = bt->row_seq[t];
    int64_t n = bt->positions[t] + 1, bs = bt->block_size, j = 0;
    if (n > bt->kv_lens[s] || bt->query_start) n = bt->kv_lens[s];
    size_t stride = (size_t)dm->kv_heads * dm->head_dim, off = (size_t)kvh * dm->head_dim;
    const int64_t *table = bt->block_tables + (size_t)s * bt->max_blocks;
    for (int64_t blk = 0; j < n; blk++) /* one table lookup per block of keys, not a division per key */
        for (int64_t slot = table[blk] * bs, end = slot + bs; slot < end && j < n; slot++, j++) {
            ks[j] = lw->k_cache + slot * stride + off;
            vs[j] = lw->v_cache + slot * stride + off;
        }
    if (bt->query_start)
        for (int r = bt->query_start[s]; r < bt->query_start[s + 1]; r++, j++) {
            ks[j] = sh->block_k + r * stride + off;
            vs[j] = sh->block_v + r * stride + off;
        }
    return j;
}

/* The pool's keys and values are scattered over its blocks and, between two steps, pushed out of the caches by the
weights streaming through: without a prefetch every key waits for memory (at 200 keys attention grew a 4-row step
by ~40 %). key_scores requests the lines of each key's k and v AHEAD keys before it reaches them. */
#define AHEAD 16
static inline void fetch(const float *row, int n) {
    for (int i = 0; i < n; i += 16) __builtin_prefetch(row + i);
}

/* out[0..D-1] = sum over keys j, in order, of p[j] * vs[j][i]: eight vectors (64 dims) stay in registers over all
keys, so p[j] and vs[j] are read once per 64 dims (out[i] += p v[i] over memory made each key a load and a store) */
static void weigh_values(const float *p, int64_t n, const float **vs, int D, float *out) {
    for (int i0 = 0; i0 < D; i0 += 2 * QK) {
        int wide = D - i0 >= 2 * QK; /* a head of 32 dims (or an odd last 32) takes the first four only */
        v8f a[8] = {{0}};
        for (int64_t j = 0; j < n; j++) {
            const float *v = vs[j] + i0;
            for (int c = 0; c < 4; c++) a[c] += p[j] * load8(v + 8 * c);
            if (wide)
                for (int c = 4; c < 8; c++) a[c] += p[j] * load8(v + 8 * c);
        }
        memcpy(out + i0, a, (wide ? 64 : 32) * sizeof(float));
    }
}

/* scores[j] = dot(q, ks[j], D) * scale for every key. Eight keys at a time on AVX: each key's 8 lane sums accumulate
as dot() does (an independent chain per key, where dot() made each key wait for the last), then hadd sums the lanes
of the eight keys in sum_lanes' order ((0+1)+(2+3))+((4+5)+(6+7)): the same bits as dot(). */
static void key_scores(const float *q, int64_t n, const float **ks, const float **vs, int D, float scale,
                       float *scores) {
    int64_t j = 0;
    for (int64_t k = 0; k < AHEAD && k < n; k++) fetch(ks[k], D), fetch(vs[k], D);
#if defined(__AVX__) && defined(BLOCKSPEC_X86)
    for (; j + 8 <= n; j += 8) {
        for (int64_t k = j + AHEAD; k < j + AHEAD + 8 && k < n; k++) fetch(ks[k], D), fetch(vs[k], D);
        __m256 acc[8];
        for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_ps();
        for (int i = 0; i < D; i += LANES) {
            __m256 qi = _mm256_loadu_ps(q + i);
            for (int k = 0; k < 8; k++)
                acc[k] = _mm256_add_ps(acc[k], _mm256_mul_ps(qi, _mm256_loadu_ps(ks[j + k] + i)));
        }
        __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
        __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
        __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
        _mm256_storeu_ps(scores + j, _mm256_mul_ps(s, _mm256_set1_ps(scale)));
    }
#endif
    for (; j < n; j++) scores[j] = dot(q, ks[j], D) * scale;
}

/* one row and one query head (q rotated) over its keys (key_rows) */
static void attend(const decoder_dims *dm, const float *q, int64_t n, const float **ks, const float **vs, float *out,
                   float *scores) {
    key_scores(q, n, ks, vs, dm->head_dim, dm->scale, scores);
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) mx = scores[j] > mx ? scores[j] : mx;
    float acc[LANES] = {0};
#pragma omp simd
    for (int64_t j = 0; j < n; j++) scores[j] = fast_exp(scores[j] - mx);
    for (int64_t j = 0; j < n; j++) acc[j % LANES] += scores[j];
    float inv = 1.0f / sum_lanes(acc);
    for (int64_t j = 0; j < n; j++) scores[j] *= inv;
    weigh_values(scores, n, vs, dm->head_dim, out);
}

static int tap_index(const decoder_batch *bt, int layer) {
    for (int i = 0; i < bt->n_taps; i++)
        if (bt->tap_layers[i] == layer) return i;
    return -1;
}

/* rows a..b-1: the k heads normed and rotated; k and v stored in the pool at the rows' slots, or a draft block's
kept in block_k / block_v for this call */
static void store_kv(const decoder_dims *dm, const decoder_batch *bt, const layer_weights *lw,
                     const shared_buffers *sh, int a, int b, float *k) {
    int D = dm->head_dim, QKV = lw->qkv.N;
    size_t kv = (size_t)dm->kv_heads * D;
    for (int t = a; t < b; t++) {
        const float *row = sh->qkv + (size_t)t * QKV;
        int64_t slot = bt->slot_mapping[t];
        if (slot < 0 && !bt->query_start) continue;
        memcpy(k, row + (size_t)dm->heads * D, kv * sizeof(float));
        for (int h = 0; h < dm->kv_heads; h++) {
            if (lw->k_norm) rms_norm(k + (size_t)h * D, lw->k_norm, D, dm->eps, k + (size_t)h * D);
            rotary(k + (size_t)h * D, bt->cos + (size_t)t * D, bt->sin + (size_t)t * D, D);
        }
        float *kd = bt->query_start ? sh->block_k + t * kv : lw->k_cache + (size_t)slot * kv;
        float *vd = bt->query_start ? sh->block_v + t * kv : lw->v_cache + (size_t)slot * kv;
        memcpy(kd, k, kv * sizeof(float));
        memcpy(vd, row + (size_t)dm->heads * D + kv, kv * sizeof(float));
    }
}

/* rows: NULL, or the rows whose output is read (n_rows of them, ascending: the last layer of a draft block, of whose
16 rows DFlash reads K). Every row's k / v are still stored (the kept rows attend to them); then the kept rows move to
the front of the residual stream and attention, o and the MLP run for them alone, each exactly as in a full pass. */
static void layer(const decoder_dims *dm, const decoder_batch *bt, const layer_weights *lw, const shared_buffers *sh,
                  const private_buffers *pv, int tid, int nth, const int32_t *rows, int n_rows) {
    int T = bt->T, H = dm->hidden, D = dm->head_dim, I = dm->intermediate, QKV = lw->qkv.N, a, b;
    for (int t = 0; t < T; t++) rms_norm(pv->h + (size_t)t * H, lw->input_norm, H, dm->eps, pv->x + (size_t)t * H);
    quantize(pv->x, T, H, &pv->in);
    matmul(dm, &lw->qkv, &pv->in, T, sh->qkv, tid, nth);
#pragma omp barrier
    share(T, tid, nth, &a, &b);
    store_kv(dm, bt, lw, sh, a, b, pv->q);
    if (rows) { /* each thread its own copy of the stream; rows ascend, so row r never overwrites a later one */
        for (int r = 0; r < n_rows; r++)
            memmove(pv->h + (size_t)r * H, pv->h + (size_t)rows[r] * H, sizeof(float) * H);
        T = n_rows;
    }
#pragma omp barrier
    share(T * dm->heads, tid, nth, &a, &b);
    int key_row = -1, key_head = -1;
    int64_t n_keys = 0;
    for (int p = a; p < b; p++) { /* rows of a sequence see each other's keys: all were stored above */
        int r = p / dm->heads, hq = p % dm->heads, t = rows ? rows[r] : r;
        memcpy(pv->q, sh->qkv + (size_t)t * QKV + (size_t)hq * D, D * sizeof(float));
        if (lw->q_norm) rms_norm(pv->q, lw->q_norm, D, dm->eps, pv->q);
        rotary(pv->q, bt->cos + (size_t)t * D, bt->sin + (size_t)t * D, D);
        int kvh = hq / (dm->heads / dm->kv_heads);
        if (t != key_row || kvh != key_head) /* a row's heads sharing a kv head share its key list */
            n_keys = key_rows(dm, bt, lw, sh, t, kvh, pv->ks, pv->vs), key_row = t, key_head = kvh;
        attend(dm, pv->q, n_keys, pv->ks, pv->vs, pv->x, pv->scores);
        size_t blk = (size_t)p * (D / QK); /* row r's heads: a head is whole blocks of 32 (NativeDecoder.runs) */
        q8_quantize_blocks(pv->x, D / QK, sh->att.q + blk * QK, sh->att.sx + blk, sh->att.xs + blk);
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
#pragma omp simd
        for (int i = 0; i < I; i++) act[i] = gu[i] / (1.0f + fast_exp(-gu[i])) * gu[I + i];
    }
    quantize(pv->act, T, I, &pv->in);
    matmul(dm, &lw->down, &pv->in, T, sh->down, tid, nth);
#pragma omp barrier
    for (size_t i = 0; i < (size_t)T * H; i++) pv->h[i] += sh->down[i];
}

/* one thread's whole forward over the replicated stream (`h`: the embeddings in); thread 0 writes the results */
static void run(const decoder_dims *dm, const layer_weights *lws, const float *final_norm, const decoder_batch *bt,
                const shared_buffers *sh, const private_buffers *pv, int tid, int nth, float *out, float *taps) {
    int T = bt->T, H = dm->hidden, last = dm->layers - 1;
    for (int l = 0; l < dm->layers; l++) {
        layer(dm, bt, lws + l, sh, pv, tid, nth, l == last ? bt->last_rows : NULL, bt->n_last);
        int k = l < dm->layers - 1 ? tap_index(bt, l) : -1;
        if (k >= 0 && tid == 0)
            for (int t = 0; t < T; t++)
                memcpy(taps + ((size_t)t * bt->n_taps + k) * H, pv->h + (size_t)t * H, sizeof(float) * H);
    }
    if (tid != 0) return;
    int k = tap_index(bt, last), R = bt->last_rows ? bt->n_last : T;
    if (bt->last_rows) memset(out, 0, sizeof(float) * T * H); /* rows nobody reads: zeros, not stale inputs */
    for (int r = 0; r < R; r++) {
        int t = bt->last_rows ? bt->last_rows[r] : r;
        rms_norm(pv->h + (size_t)r * H, final_norm, H, dm->eps, out + (size_t)t * H);
        if (k >= 0) memcpy(taps + ((size_t)t * bt->n_taps + k) * H, out + (size_t)t * H, sizeof(float) * H);
    }
}

/* h [T, H]: the embeddings in, the final-normed hidden states out; taps [T, n_taps * H]. Returns 0, or -1 when
scratch memory cannot be had. */
int decoder_forward(const decoder_dims *dm, const layer_weights *lws, const float *final_norm, const decoder_batch *bt,
                    float *h, float *taps) {
    size_t T = bt->T, H = dm->hidden, I = dm->intermediate, D = dm->head_dim, AT = dm->heads * D;
    size_t KV = (size_t)dm->kv_heads * D;
    int nth = dm->threads > 0 ? dm->threads : 1;
    int64_t longest = 1; /* keys of the longest row: a draft row's are its context and its block */
    for (size_t t = 0; t < T; t++) longest = bt->positions[t] + 1 > longest ? bt->positions[t] + 1 : longest;
    shared_buffers sh = {malloc(sizeof(float) * T * (AT + 2 * KV)), malloc(sizeof(float) * T * H),
                         malloc(sizeof(float) * T * 2 * I), malloc(sizeof(float) * T * H),
                         malloc(sizeof(float) * T * KV), malloc(sizeof(float) * T * KV), {0}};
    int ok = sh.qkv && sh.o && sh.gate_up && sh.down && sh.block_k && sh.block_v && alloc_q8(&sh.att, T, AT);
    private_buffers *pv = calloc(nth, sizeof(private_buffers));
    ok = ok && pv;
    for (int i = 0; ok && i < nth; i++) {
        size_t widest = I > H ? I : H;
        pv[i].h = malloc(sizeof(float) * T * H);
        pv[i].x = malloc(sizeof(float) * T * (H > D ? H : D));
        pv[i].act = malloc(sizeof(float) * T * I);
        pv[i].scores = malloc(sizeof(float) * longest);
        pv[i].ks = malloc(sizeof(float *) * longest), pv[i].vs = malloc(sizeof(float *) * longest);
        pv[i].q = malloc(sizeof(float) * (KV > D ? KV : D));
        ok = pv[i].h && pv[i].x && pv[i].act && pv[i].scores && pv[i].ks && pv[i].vs && pv[i].q &&
             alloc_q8(&pv[i].in, T, widest);
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
        free(pv[i].ks), free(pv[i].vs);
    }
    free(pv), free(sh.qkv), free(sh.o), free(sh.gate_up), free(sh.down), free(sh.block_k), free(sh.block_v);
    free_q8(&sh.att);
    return ok ? 0 : -1;
}
