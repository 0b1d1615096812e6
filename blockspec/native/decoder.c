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
    float *h, *x, *act, *q;
    attn_scratch attn;
    q8_rows in; /* a matmul's int8 input (the attention's output too: attn_combine runs in every thread) */
} private_buffers;

/* matmul outputs and a draft block's own k / v, written by all threads; the attention's plans (attend.c): for every
row, and for the last layer's kept rows */
typedef struct {
    float *qkv, *o, *gate_up, *down, *block_k, *block_v;
    attn_plan all, last;
} shared_buffers;

static int tap_index(const decoder_batch *bt, int layer) {
    for (int i = 0; i < bt->n_taps; i++)
        if (bt->tap_layers[i] == layer) return i;
    return -1;
}

/* rows a..b-1: the q heads normed and rotated in place (attend.c reads them there); the k heads normed and rotated; k
and v stored in the pool at the rows' slots, or a draft block's kept in block_k / block_v for this call */
static void store_kv(const decoder_dims *dm, const decoder_batch *bt, const layer_weights *lw,
                     const shared_buffers *sh, int a, int b, float *k) {
    int D = dm->head_dim, QKV = lw->qkv.N;
    size_t kv = (size_t)dm->kv_heads * D;
    for (int t = a; t < b; t++) {
        float *row = sh->qkv + (size_t)t * QKV;
        for (int h = 0; h < dm->heads; h++) {
            if (lw->q_norm) rms_norm(row + (size_t)h * D, lw->q_norm, D, dm->eps, row + (size_t)h * D);
            rotary(row + (size_t)h * D, bt->cos + (size_t)t * D, bt->sin + (size_t)t * D, D);
        }
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
    int T = bt->T, H = dm->hidden, I = dm->intermediate, QKV = lw->qkv.N, a, b;
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
    const attn_plan *plan = rows ? &sh->last : &sh->all; /* rows of a sequence see each other's keys: all stored */
    for (int k = 0; k < plan->n_pass; k++) {
        if (k > 0) {
#pragma omp barrier
        }
        attn_units(dm, bt, lw, sh->qkv, QKV, sh->block_k, sh->block_v, rows, plan, k, &pv->attn, tid, nth);
#pragma omp barrier
        attn_combine(dm, plan, k, pv->x, &pv->in);
    }
    matmul(dm, &lw->o, &pv->in, T, sh->o, tid, nth);
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
    shared_buffers sh = {malloc(sizeof(float) * T * (AT + 2 * KV)), malloc(sizeof(float) * T * H),
                         malloc(sizeof(float) * T * 2 * I), malloc(sizeof(float) * T * H),
                         malloc(sizeof(float) * T * KV), malloc(sizeof(float) * T * KV), {0}, {0}};
    int ok = sh.qkv && sh.o && sh.gate_up && sh.down && sh.block_k && sh.block_v &&
             attn_plan_build(dm, bt, NULL, bt->T, &sh.all) == 0 &&
             (!bt->last_rows || attn_plan_build(dm, bt, bt->last_rows, bt->n_last, &sh.last) == 0);
    private_buffers *pv = calloc(nth, sizeof(private_buffers));
    ok = ok && pv;
    for (int i = 0; ok && i < nth; i++) {
        size_t widest = I > H ? I : H;
        widest = AT > widest ? AT : widest; /* the attention's output is an input of the o projection */
        pv[i].h = malloc(sizeof(float) * T * H);
        pv[i].x = malloc(sizeof(float) * T * (H > D ? H : D));
        pv[i].act = malloc(sizeof(float) * T * I);
        pv[i].q = malloc(sizeof(float) * (KV > D ? KV : D));
        pv[i].attn.scores = malloc(sizeof(float) * ATTN_HEADS * ATTN_TILE);
        pv[i].attn.ks = malloc(sizeof(float *) * 2 * ATTN_TILE), pv[i].attn.vs = malloc(sizeof(float *) * 2 * ATTN_TILE);
        ok = pv[i].h && pv[i].x && pv[i].act && pv[i].q && pv[i].attn.scores && pv[i].attn.ks && pv[i].attn.vs &&
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
        free(pv[i].h), free(pv[i].x), free(pv[i].act), free(pv[i].q), free_q8(&pv[i].in);
        free(pv[i].attn.scores), free(pv[i].attn.ks), free(pv[i].attn.vs);
    }
    free(pv), free(sh.qkv), free(sh.o), free(sh.gate_up), free(sh.down), free(sh.block_k), free(sh.block_v);
    attn_plan_free(&sh.all), attn_plan_free(&sh.last);
    return ok ? 0 : -1;
}
