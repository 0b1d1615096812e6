/* The attention of decoder.c's layers, in tiles of keys shared by every query that reads them.

Why tiles: a query head used to walk its sequence's keys alone, so a kv head's keys were read once per query head
and per row (3 heads x 4 verify rows = 12 walks over keys scattered in the pool, 48 for a draft block's 16 rows), and
a step's attention grew ~0.8 ms per 100 tokens of context at one row. Here the keys of one sequence and kv head are
cut into tiles of TILE keys at fixed positions (0, TILE, 2 TILE, ...); a unit of work is one (sequence, kv head,
tile): its keys are fetched once and every query of that sequence and kv head (its rows x the heads sharing the kv
head) reads them from the caches. The units split over threads, so a single row's attention still uses them all.

Exactness (decoder.c's rule): each unit leaves per query a partial (m: the tile's largest score, l: the sum of
e^(s - m), o: the sum of e^(s - m) v), computed from the query, the tile's keys and how many of them the query sees
(its position), nothing else; the combine then runs over the query's tiles in order with one formula. Tiles sit at
fixed key positions, so a verify row gets the same bits as plain decoding at its position, whatever the rows beside
it, the thread count or which thread ran a unit.

The partials of every (query, tile) are kept at once, up to PART_BUDGET bytes: a long prefill chunk runs in passes of
whole query rows, each pass its units, a barrier, the combine, a barrier (decode steps and draft blocks: one pass). */

#include <omp.h>

#include "native.h"
#if defined(__AVX__) && defined(BLOCKSPEC_X86)
#include <immintrin.h>
#endif

#define TILE ATTN_TILE /* keys a unit fetches: k and v of 64 keys of 64 dims (32 KB) stay in L1/L2 */
#ifndef ATTN_PART_BUDGET /* a test builds with a small one: passes must not change a bit */
#define ATTN_PART_BUDGET (16u << 20) /* bytes of partials one pass may hold */
#endif
#define PART_BUDGET ATTN_PART_BUDGET

/* keys the query row t sees: a target row its sequence's keys up to its position (at most kv_len); a draft row the
kv_len context keys and every row of its block */
static int64_t keys_seen(const decoder_batch *bt, int t) {
    int s = bt->row_seq[t];
    if (bt->query_start) return (int64_t)bt->kv_lens[s] + bt->query_start[s + 1] - bt->query_start[s];
    int64_t n = bt->positions[t] + 1;
    return n > bt->kv_lens[s] ? bt->kv_lens[s] : n;
}

/* a * b + c rounded once, lane by lane: the x86 instruction where the build has it, else fmaf (the same bits) */
static inline v8f fma8(v8f a, v8f b, v8f c) {
#if defined(__FMA__) && defined(BLOCKSPEC_X86)
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    v8f r;
    for (int l = 0; l < LANES; l++) r[l] = fmaf(a[l], b[l], c[l]);
    return r;
#endif
}

static inline v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* Up to HB query heads sharing a kv head, over n keys of a tile: each key's vector is loaded once for all of them.
Per head the arithmetic is its own and fixed (a fused multiply-add chain per lane over the dims, lanes summed as
sum_lanes does), so a head's scores do not depend on the heads beside it. */
#define HB ATTN_HEADS

/* scores[h * TILE + j] = q_h . k_j * scale, for the hb <= HB heads q_h = qs + h * D */
static inline __attribute__((always_inline)) void scores_hb(const float *qs, int hb, int64_t n, const float **ks,
                                                            int D, float scale, float *scores) {
    int64_t j = 0;
#if defined(__AVX__) && defined(BLOCKSPEC_X86)
    for (; j + 4 <= n; j += 4) { /* four keys: their lane sums in one vector by two hadds, sum_lanes' order */
        v8f acc[HB][4] = {{{0}}};
        for (int i = 0; i < D; i += LANES) {
            v8f k[4] = {load8(ks[j] + i), load8(ks[j + 1] + i), load8(ks[j + 2] + i), load8(ks[j + 3] + i)};
            for (int h = 0; h < hb; h++) {
                v8f q = load8(qs + (size_t)h * D + i);
                for (int c = 0; c < 4; c++) acc[h][c] = fma8(q, k[c], acc[h][c]);
            }
        }
        for (int h = 0; h < hb; h++) {
            __m256 g = _mm256_hadd_ps(_mm256_hadd_ps((__m256)acc[h][0], (__m256)acc[h][1]),
                                      _mm256_hadd_ps((__m256)acc[h][2], (__m256)acc[h][3]));
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(g), _mm256_extractf128_ps(g, 1));
            _mm_storeu_ps(scores + h * TILE + j, _mm_mul_ps(s, _mm_set1_ps(scale)));
        }
    }
#endif
    for (; j < n; j++)
        for (int h = 0; h < hb; h++) {
            v8f acc = {0};
            for (int i = 0; i < D; i += LANES) acc = fma8(load8(qs + (size_t)h * D + i), load8(ks[j] + i), acc);
            float lanes[LANES];
            memcpy(lanes, &acc, sizeof lanes);
            scores[h * TILE + j] = sum_lanes(lanes) * scale;
        }
}

/* out[h * D + i] = sum over keys j, in order, of p[h * TILE + j] * vs[j][i]: 32 dims at a time, so the hb x 4
accumulators stay in registers and each value vector is loaded once for the hb heads */
static inline __attribute__((always_inline)) void values_hb(const float *p, int hb, int64_t n, const float **vs,
                                                            int D, float *out) {
    for (int i0 = 0; i0 < D; i0 += QK) {
        v8f a[HB][4] = {{{0}}};
        for (int64_t j = 0; j < n; j++) {
            v8f v[4] = {load8(vs[j] + i0), load8(vs[j] + i0 + 8), load8(vs[j] + i0 + 16), load8(vs[j] + i0 + 24)};
            for (int h = 0; h < hb; h++) {
                v8f w = splat8(p[h * TILE + j]);
                for (int c = 0; c < 4; c++) a[h][c] = fma8(w, v[c], a[h][c]);
            }
        }
        for (int h = 0; h < hb; h++) memcpy(out + (size_t)h * D + i0, a[h], QK * sizeof(float));
    }
}

/* hb heads (q rotated, consecutive in qs) over the tile's first n keys -> each head's partial: m [hb], l [hb],
o [hb, D] */
static void attend_heads(const float *qs, int hb, int64_t n, const float **ks, const float **vs, int D, float scale,
                         float *scores, float *m, float *l, float *o) {
    if (hb == 3) scores_hb(qs, 3, n, ks, D, scale, scores);
    else if (hb == 2) scores_hb(qs, 2, n, ks, D, scale, scores);
    else scores_hb(qs, 1, n, ks, D, scale, scores);
    for (int h = 0; h < hb; h++) {
        float *s = scores + h * TILE, mx = -INFINITY, acc[LANES] = {0};
        for (int64_t j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) s[j] = fast_exp(s[j] - mx);
        for (int64_t j = 0; j < n; j++) acc[j % LANES] += s[j];
        m[h] = mx, l[h] = sum_lanes(acc);
    }
    if (hb == 3) values_hb(scores, 3, n, vs, D, o);
    else if (hb == 2) values_hb(scores, 2, n, vs, D, o);
    else values_hb(scores, 1, n, vs, D, o);
}

static int tiles_of(int64_t keys) { return (int)((keys + TILE - 1) / TILE); }

void attn_plan_free(attn_plan *p) {
    free(p->qidx), free(p->nkeys), free(p->segs), free(p->passes), free(p->unit_seg);
    free(p->o), free(p->m), free(p->l);
    memset(p, 0, sizeof *p);
}

/* The plan of one layer's attention over its query rows r = 0..Tq-1 (row t = rows[r], or r when rows is NULL):
queries ordered by sequence, cut into passes, each pass into segments (one sequence's queries in the pass) and units.
Returns 0, or -1 when memory cannot be had. */
int attn_plan_build(const decoder_dims *dm, const decoder_batch *bt, const int32_t *rows, int Tq, attn_plan *p) {
    memset(p, 0, sizeof *p);
    int kvh = dm->kv_heads, group = dm->heads / dm->kv_heads, B = 0, D = dm->head_dim;
    for (int r = 0; r < Tq; r++) {
        int s = bt->row_seq[rows ? rows[r] : r];
        B = s + 1 > B ? s + 1 : B;
    }
    int *count = calloc((size_t)B + 1, sizeof(int));
    p->qidx = malloc(sizeof(int) * (Tq ? Tq : 1));
    p->nkeys = malloc(sizeof(int64_t) * (Tq ? Tq : 1));
    p->segs = malloc(sizeof(attn_segment) * (Tq ? Tq : 1)); /* at most one segment per query row */
    p->passes = malloc(sizeof(attn_pass) * (Tq ? Tq : 1));
    if (!count || !p->qidx || !p->nkeys || !p->segs || !p->passes) return free(count), attn_plan_free(p), -1;
    /* queries ordered by sequence (stable): a counting sort */
    for (int r = 0; r < Tq; r++) {
        int t = rows ? rows[r] : r;
        count[bt->row_seq[t] + 1]++;
        p->nkeys[r] = keys_seen(bt, t);
    }
    for (int s = 0; s < B; s++) count[s + 1] += count[s];
    for (int r = 0; r < Tq; r++) p->qidx[count[bt->row_seq[rows ? rows[r] : r]]++] = r;
    free(count);
    /* passes of whole query rows under the budget; in a pass, one segment per sequence, whose partials are every
    (kv head, tile, query, head of the kv head) of it, the tiles being those of its query seeing the most keys */
    size_t per_part = sizeof(float) * ((size_t)D + 2), closed = 0, max_parts = 0;
    int units = 0;
    attn_pass *pass = NULL;
    attn_segment *seg = NULL;
    for (int i = 0; i < Tq; i++) {
        int r = p->qidx[i], s = bt->row_seq[rows ? rows[r] : r], tiles = tiles_of(p->nkeys[r]);
        int same = seg && seg->seq == s;
        size_t open = same ? (size_t)dm->heads * (tiles > seg->tiles ? tiles : seg->tiles) * (seg->nq + 1)
                           : (seg ? (size_t)dm->heads * seg->tiles * seg->nq : 0) + (size_t)dm->heads * tiles;
        if (!pass || (seg && (closed + open) * per_part > PART_BUDGET)) {
            if (seg) closed += (size_t)dm->heads * seg->tiles * seg->nq;
            max_parts = closed > max_parts ? closed : max_parts;
            pass = p->passes + p->n_pass++;
            pass->seg0 = p->n_seg, pass->n_seg = 0, closed = 0, seg = NULL, same = 0;
        }
        if (!same) {
            if (seg) closed += (size_t)dm->heads * seg->tiles * seg->nq;
            seg = p->segs + p->n_seg++, pass->n_seg++;
            seg->seq = s, seg->q0 = i, seg->nq = 0, seg->tiles = 0, seg->keys = 0, seg->part0 = closed;
        }
        seg->nq++;
        seg->tiles = tiles > seg->tiles ? tiles : seg->tiles;
        seg->keys = p->nkeys[r] > seg->keys ? p->nkeys[r] : seg->keys;
    }
    if (seg) closed += (size_t)dm->heads * seg->tiles * seg->nq;
    max_parts = closed > max_parts ? closed : max_parts;
    /* a short context leaves fewer (kv head, tile) units than threads can share evenly (3 kv heads, 1 tile, 2
    threads: 2 + 1): then each head of a group is a unit of its own (a head's arithmetic is the same either way) */
    int whole = 0;
    for (int g = 0; g < p->n_seg; g++) whole += kvh * p->segs[g].tiles;
    p->group = group, p->hunit = whole < 2 * (dm->threads > 0 ? dm->threads : 1) ? 1 : group;
    int hparts = (group + p->hunit - 1) / p->hunit;
    for (int k = 0; k < p->n_pass; k++) {
        attn_pass *ps = p->passes + k;
        ps->unit0 = units;
        for (int g = ps->seg0; g < ps->seg0 + ps->n_seg; g++)
            p->segs[g].unit0 = units, units += kvh * p->segs[g].tiles * hparts;
        ps->n_units = units - ps->unit0;
    }
    p->n_units = units;
    p->unit_seg = malloc(sizeof(int) * (units ? units : 1));
    p->o = malloc(sizeof(float) * (max_parts ? max_parts : 1) * D);
    p->m = malloc(sizeof(float) * (max_parts ? max_parts : 1));
    p->l = malloc(sizeof(float) * (max_parts ? max_parts : 1));
    if (!p->unit_seg || !p->o || !p->m || !p->l) return attn_plan_free(p), -1;
    for (int g = 0; g < p->n_seg; g++)
        for (int u = 0; u < kvh * p->segs[g].tiles * hparts; u++) p->unit_seg[p->segs[g].unit0 + u] = g;
    return 0;
}

/* unit u -> its kv head, tile and first query head in the group (p->hunit heads from there). A tile's kv heads (and
head parts) come one after another: they share the slots' lines (the pool is [slot, kv head, dim]). */
static void unit_at(const decoder_dims *dm, const attn_plan *p, int u, int *kvh, int *tile, int *h0) {
    const attn_segment *sg = p->segs + p->unit_seg[u];
    int hparts = (p->group + p->hunit - 1) / p->hunit, rem = u - sg->unit0;
    *h0 = (rem % hparts) * p->hunit, rem /= hparts;
    *kvh = rem % dm->kv_heads, *tile = rem / dm->kv_heads;
}

/* the addresses of keys j0..j0+n-1 of sequence s for kv head kvh (decoder.c's key order: the pool through the block
table, then a draft block's own rows) */
static void tile_keys(const decoder_dims *dm, const decoder_batch *bt, const layer_weights *lw,
                      const float *block_k, const float *block_v, int s, int kvh, int64_t j0, int n,
                      const float **ks, const float **vs) {
    size_t stride = (size_t)dm->kv_heads * dm->head_dim, off = (size_t)kvh * dm->head_dim;
    int64_t ctx = bt->query_start ? bt->kv_lens[s] : INT64_MAX, bs = bt->block_size;
    const int64_t *table = bt->block_tables + (size_t)s * bt->max_blocks;
    for (int i = 0; i < n; i++) {
        int64_t j = j0 + i;
        if (j < ctx) {
            int64_t slot = table[j / bs] * bs + j % bs;
            ks[i] = lw->k_cache + slot * stride + off, vs[i] = lw->v_cache + slot * stride + off;
        } else {
            int64_t row = bt->query_start[s] + (j - ctx);
            ks[i] = block_k + row * stride + off, vs[i] = block_v + row * stride + off;
        }
    }
}

static void fetch_tile(const float **ks, const float **vs, int n, int D) {
    for (int i = 0; i < n; i++)
        for (int d = 0; d < D; d += 16) __builtin_prefetch(ks[i] + d), __builtin_prefetch(vs[i] + d);
}

/* unit u's keys (ks, vs [TILE]) -> their number */
static int unit_keys(const decoder_dims *dm, const decoder_batch *bt, const layer_weights *lw, const float *block_k,
                     const float *block_v, const attn_plan *p, int u, const float **ks, const float **vs) {
    const attn_segment *sg = p->segs + p->unit_seg[u];
    int kvh, tile, h0;
    unit_at(dm, p, u, &kvh, &tile, &h0);
    int64_t j0 = (int64_t)tile * TILE;
    int n = (int)(sg->keys - j0 < TILE ? sg->keys - j0 : TILE);
    tile_keys(dm, bt, lw, block_k, block_v, sg->seq, kvh, j0, n, ks, vs);
    return n;
}

/* this thread's units of pass k: each query's partial over the unit's tile. The next unit's keys are requested
while this one's are used: between layers the weights streaming through push the pool out of the caches. */
void attn_units(const decoder_dims *dm, const decoder_batch *bt, const layer_weights *lw, const float *qkv, int QKV,
                const float *block_k, const float *block_v, const int32_t *rows, const attn_plan *p, int k,
                const attn_scratch *sc, int tid, int nth) {
    const attn_pass *ps = p->passes + k;
    int a, b, D = dm->head_dim, group = p->group, cur = 0;
    share(ps->n_units, tid, nth, &a, &b);
    a += ps->unit0, b += ps->unit0;
    int n_tile = a < b ? unit_keys(dm, bt, lw, block_k, block_v, p, a, sc->ks, sc->vs) : 0;
    if (a < b) fetch_tile(sc->ks, sc->vs, n_tile, D);
    for (int u = a; u < b; u++, cur ^= 1) {
        const float **ks = sc->ks + cur * TILE, **vs = sc->vs + cur * TILE;
        int n_next = 0;
        if (u + 1 < b) {
            n_next = unit_keys(dm, bt, lw, block_k, block_v, p, u + 1, ks + (cur ? -TILE : TILE),
                               vs + (cur ? -TILE : TILE));
            fetch_tile(ks + (cur ? -TILE : TILE), vs + (cur ? -TILE : TILE), n_next, D);
        }
        const attn_segment *sg = p->segs + p->unit_seg[u];
        int kvh, tile, h_first;
        unit_at(dm, p, u, &kvh, &tile, &h_first);
        int h_end = h_first + p->hunit < group ? h_first + p->hunit : group;
        int64_t j0 = (int64_t)tile * TILE;
        for (int qi = 0; qi < sg->nq; qi++) {
            int r = p->qidx[sg->q0 + qi], t = rows ? rows[r] : r;
            int64_t seen = p->nkeys[r] - j0;
            if (seen <= 0) continue; /* a tile past the row's position: the combine stops before it */
            int n = (int)(seen < n_tile ? seen : n_tile);
            for (int h0 = h_first; h0 < h_end; h0 += HB) { /* the unit's heads, HB at a time */
                int hb = h_end - h0 < HB ? h_end - h0 : HB;
                size_t part = (size_t)sg->part0 + (((size_t)kvh * sg->tiles + tile) * sg->nq + qi) * group + h0;
                const float *q = qkv + (size_t)t * QKV + (size_t)(kvh * group + h0) * D;
                attend_heads(q, hb, n, ks, vs, D, dm->scale, sc->scores, p->m + part, p->l + part, p->o + part * D);
            }
        }
        n_tile = n_next;
    }
}

/* every query of pass k: its tiles' partials combined in tile order, int8-quantized into att (row r's heads in
order: what the o projection reads). Every thread runs it for all queries, into its own att. */
void attn_combine(const decoder_dims *dm, const attn_plan *p, int k, float *out, const q8_rows *att) {
    const attn_pass *ps = p->passes + k;
    int D = dm->head_dim, group = p->group;
    for (int g = ps->seg0; g < ps->seg0 + ps->n_seg; g++) {
        const attn_segment *sg = p->segs + g;
        for (int qi = 0; qi < sg->nq; qi++) {
            int r = p->qidx[sg->q0 + qi], nt = tiles_of(p->nkeys[r]);
            for (int hq = 0; hq < dm->heads; hq++) {
                int kvh = hq / group, hh = hq % group;
                size_t part0 = (size_t)sg->part0 + ((size_t)kvh * sg->tiles * sg->nq + qi) * group + hh;
                size_t step = (size_t)sg->nq * group; /* from one tile's partial to the next */
                float mx = -INFINITY, l = 0.0f;
                for (int tile = 0; tile < nt; tile++) mx = p->m[part0 + tile * step] > mx ? p->m[part0 + tile * step] : mx;
                memset(out, 0, sizeof(float) * D);
                for (int tile = 0; tile < nt; tile++) {
                    size_t part = part0 + tile * step;
                    float w = fast_exp(p->m[part] - mx);
                    const float *o = p->o + part * D;
                    l += w * p->l[part];
                    for (int i = 0; i < D; i++) out[i] += w * o[i];
                }
                float inv = l > 0.0f ? 1.0f / l : 0.0f;
                for (int i = 0; i < D; i++) out[i] *= inv;
                size_t blk = ((size_t)r * dm->heads + hq) * (D / QK);
                q8_quantize_blocks(out, D / QK, att->q + blk * QK, att->sx + blk, att->xs + blk);
            }
        }
    }
}
