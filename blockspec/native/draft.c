/* A DFlash drafter's context append on the CPU in one call (blockspec/loading/native_stack.py drives it; the block's
forward is decoder.c's stack with a draft batch): the committed rows' target taps -> fc -> hidden_norm -> each draft
layer's k|v projection, k head norm and rotary, stored in the layer's draft cache at the rows' slots. As in decoder.c,
threads split matmul output groups and rows, never a sum, so a row's k/v do not depend on the rows beside it. */

#include <omp.h>

#include "native.h"

static void context_rows(const decoder_dims *dm, const layer_weights *lws, const qweight *fc,
                         const float *hidden_norm, const context_batch *cb, const float *taps, float *ctx, float *x,
                         float *kv, const q8_rows *in, float *k, int tid, int nth) {
    int T = cb->T, H = dm->hidden, D = dm->head_dim, a, b;
    size_t KV = (size_t)dm->kv_heads * D;
    quantize(taps, T, cb->n_taps * H, in);
    matmul(dm, fc, in, T, ctx, tid, nth);
#pragma omp barrier
    for (int t = 0; t < T; t++) rms_norm(ctx + (size_t)t * H, hidden_norm, H, dm->eps, x + (size_t)t * H);
    quantize(x, T, H, in);
    for (int l = 0; l < dm->layers; l++) { /* every layer's k|v rows of its q|k|v weight: no barrier in between */
        const layer_weights *lw = lws + l;
        qweight kv_rows = weight_rows(&lw->qkv, dm->heads * D, lw->qkv.N);
        matmul(dm, &kv_rows, in, T, kv + (size_t)l * T * 2 * KV, tid, nth);
    }
#pragma omp barrier
    share(T, tid, nth, &a, &b);
    for (int l = 0; l < dm->layers; l++) {
        const layer_weights *lw = lws + l;
        for (int t = a; t < b; t++) {
            const float *row = kv + ((size_t)l * T + t) * 2 * KV;
            int64_t slot = cb->slot_mapping[t];
            if (slot < 0) continue;
            memcpy(k, row, KV * sizeof(float));
            for (int h = 0; h < dm->kv_heads; h++) {
                if (lw->k_norm) rms_norm(k + (size_t)h * D, lw->k_norm, D, dm->eps, k + (size_t)h * D);
                rotary(k + (size_t)h * D, cb->cos + (size_t)t * D, cb->sin + (size_t)t * D, D);
            }
            memcpy(lw->k_cache + (size_t)slot * KV, k, KV * sizeof(float));
            memcpy(lw->v_cache + (size_t)slot * KV, row + KV, KV * sizeof(float));
        }
    }
}

/* taps [T, n_taps * H] of committed rows -> every draft layer's k / v in its cache. Returns 0, or -1 when scratch
memory cannot be had. */
int draft_context(const decoder_dims *dm, const layer_weights *lws, const qweight *fc, const float *hidden_norm,
                  const context_batch *cb, const float *taps) {
    size_t T = cb->T, H = dm->hidden, KV = (size_t)dm->kv_heads * dm->head_dim;
    int nth = dm->threads > 0 ? dm->threads : 1;
    float *ctx = malloc(sizeof(float) * T * H), *kv = malloc(sizeof(float) * dm->layers * T * 2 * KV);
    typedef struct {
        float *x, *k;
        q8_rows in;
    } scratch;
    scratch *pv = calloc(nth, sizeof(scratch));
    int ok = ctx && kv && pv;
    for (int i = 0; ok && i < nth; i++) {
        pv[i].x = malloc(sizeof(float) * T * H);
        pv[i].k = malloc(sizeof(float) * KV);
        ok = pv[i].x && pv[i].k && alloc_q8(&pv[i].in, T, (size_t)cb->n_taps * H);
    }
    if (ok) {
#pragma omp parallel num_threads(nth)
        {
            int tid = omp_get_thread_num();
            context_rows(dm, lws, fc, hidden_norm, cb, taps, ctx, pv[tid].x, kv, &pv[tid].in, pv[tid].k, tid,
                         omp_get_num_threads());
        }
    }
    for (int i = 0; pv && i < nth; i++) free(pv[i].x), free(pv[i].k), free_q8(&pv[i].in);
    free(pv), free(ctx), free(kv);
    return ok ? 0 : -1;
}
