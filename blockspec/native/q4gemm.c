/* Q4 weights x Q8 activations on the CPU, for decode and verify steps (blockspec/native/build.py builds it, lib.py loads it).

Weights: a GGUF Q4_1 block as it is, per output and block of 32 inputs: w = d * code + m (code 0..15, d and m fp16:
20 bytes a block), so a Q4_1 file's weights are computed with their own values. Activations: per row and block of
32, int8 codes with one fp32 scale sx and xs = sx * (the codes' sum) (llama.cpp's Q8_1). One output = sum over
blocks, in order, of (d * sx) * <codes_w, codes_x>, plus the same for m * xs; the integer dot of a block is exact
and every float step is one multiply or fused multiply-add.

Layout for the SIMD paths: outputs in groups of 8 (a vector's lanes), and per (group, block) four 32-byte chunks:
chunk c holds, for each of the 8 outputs, 4 bytes whose low nibbles are the codes of inputs 4c..4c+3 and whose high
nibbles those of inputs 4c+16..4c+19. One integer multiply-add of a chunk against 4 activation bytes broadcast to
every lane gives 8 outputs' partial sums at once; d and m are stored [group][block][8] to load as one vector.

Exactness: each output of each row is computed with the same operations in the same order whatever the other rows,
the thread count (threads split the output groups) and the path (AMX, AVX512-VNNI, AVX2 and scalar give the same bits),
so a verify step's rows equal plain decoding's. Weights stream once per call for all rows: each block's chunks are
unpacked once and used for up to MR rows. */

#include <omp.h>

#include "native.h"
#ifdef BLOCKSPEC_X86
#include <immintrin.h>
#endif

/* IEEE half -> float, exact (what F16C's vcvtph2ps computes), for the scalar path */
float fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) {
        float f = ldexpf((float)man, -24); /* zero or subnormal */
        return sign ? -f : f;
    }
    bits = sign | (exp == 31 ? 0x7f800000u : (exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#ifdef BLOCKSPEC_X86
/* the same for one block, on AVX2: |x| max, the codes rounded as lrintf does (the rounding mode's nearest-even), the
same clamp and an exact integer sum, so the same bits as the scalar loop (which called fmaxf through the PLT 32
times a block: 12 % of a 4-row stack step) */
__attribute__((target("avx2,fma"))) static void q8_block_avx2(const float *v, int8_t *q, float *sx, float *xs) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 x[4], m;
    for (int k = 0; k < 4; k++) x[k] = _mm256_loadu_ps(v + 8 * k);
    m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(x[0], abs_mask), _mm256_and_ps(x[1], abs_mask)),
                      _mm256_max_ps(_mm256_and_ps(x[2], abs_mask), _mm256_and_ps(x[3], abs_mask)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
    __m256i c[4], sum = _mm256_setzero_si256();
    for (int k = 0; k < 4; k++) {
        c[k] = _mm256_cvtps_epi32(_mm256_mul_ps(x[k], _mm256_set1_ps(id)));
        c[k] = _mm256_min_epi32(_mm256_max_epi32(c[k], lo), hi);
        sum = _mm256_add_epi32(sum, c[k]);
    }
    /* packs work within 128-bit halves: the permute puts the 8 groups of 4 codes back in order */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    *sx = d;
    *xs = d * (float)_mm_cvtsi128_si32(s4);
}
#endif

/* n blocks of 32 from x -> their int8 codes qx, scales sx and xs = sx * (the codes' sum) */
void q8_quantize_blocks(const float *x, int n, int8_t *qx, float *sx, float *xs) {
#ifdef BLOCKSPEC_X86
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        for (int b = 0; b < n; b++) q8_block_avx2(x + b * QK, qx + b * QK, sx + b, xs + b);
        return;
    }
#endif
    for (int b = 0; b < n; b++) {
        const float *v = x + b * QK;
        int8_t *q = qx + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
        float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            int c = (int)lrintf(v[i] * id);
            c = c > 127 ? 127 : (c < -127 ? -127 : c);
            q[i] = (int8_t)c;
            sum += c;
        }
        sx[b] = d;
        xs[b] = d * (float)sum;
    }
}

/* x [M, K] fp32 -> qx [M, K] int8; sx, xs [M, K / 32] */
void q8_quantize_rows(const float *x, int M, int K, int8_t *qx, float *sx, float *xs) {
    q8_quantize_blocks(x, M * (K / QK), qx, sx, xs);
}

/* codes [N, K] (one byte each, 0..15) -> the chunked layout above; N a multiple of NG */
void q4_pack(const uint8_t *codes, int N, int K, uint8_t *packed) {
    int KB = K / QK;
    for (int n = 0; n < N; n++)
        for (int b = 0; b < KB; b++)
            for (int c = 0; c < 4; c++)
                for (int j = 0; j < 4; j++) {
                    const uint8_t *w = codes + (size_t)n * K + b * QK;
                    size_t at = ((((size_t)(n / NG) * KB + b) * 4 + c) * NG + n % NG) * 4 + j;
                    packed[at] = (uint8_t)(w[4 * c + j] | (w[4 * c + 16 + j] << 4));
                }
}

static void group_scalar(const uint8_t *packed, const uint16_t *d, const uint16_t *m, int K, const int8_t *qx,
                         const float *sx, const float *xs, int r, float *y, int N, int g) {
    int KB = K / QK;
    for (int o = 0; o < NG; o++) {
        float acc = 0.0f, mt = 0.0f;
        for (int b = 0; b < KB; b++) {
            const uint8_t *blk = packed + ((size_t)g * KB + b) * 4 * NG * 4;
            const int8_t *q = qx + (size_t)r * K + b * QK;
            int s = 0;
            for (int c = 0; c < 4; c++)
                for (int j = 0; j < 4; j++) {
                    uint8_t byte = blk[(c * NG + o) * 4 + j];
                    s += (byte & 15) * q[4 * c + j] + (byte >> 4) * q[4 * c + 16 + j];
                }
            size_t at = ((size_t)g * KB + b) * NG + o;
            acc = fmaf((float)s, fp16_to_f32(d[at]) * sx[(size_t)r * KB + b], acc);
        }
        for (int b = 0; b < KB; b++)
            mt = fmaf(fp16_to_f32(m[((size_t)g * KB + b) * NG + o]), xs[(size_t)r * KB + b], mt);
        y[(size_t)r * N + g * NG + o] = acc + mt;
    }
}

#ifdef BLOCKSPEC_X86
/* one output group for rows r0..r0+MR-1; DOT4(w[4], q, off): the block's integer sums of the 4 chunks w against
activation bytes q[off..off+15] */
#define GROUP_SIMD(NAME, TARGET, DOT4, MR)                                                                           \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *packed, const uint16_t *d, const uint16_t *m,     \
                                                     int K, const int8_t *qx, const float *sx, const float *xs,      \
                                                     int r0, float *y, int N, int g) {                               \
        int KB = K / QK;                                                                                              \
        const __m256i low = _mm256_set1_epi8(15);                                                                     \
        __m256 acc[MR];                                                                                               \
        for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();                                                    \
        for (int b = 0; b < KB; b++) {                                                                                \
            const uint8_t *blk = packed + ((size_t)g * KB + b) * 4 * NG * 4;                                          \
            __m256i wl[4], wh[4];                                                                                     \
            for (int c = 0; c < 4; c++) {                                                                             \
                __m256i p = _mm256_loadu_si256((const __m256i *)(blk + c * NG * 4));                                  \
                wl[c] = _mm256_and_si256(p, low);                                                                     \
                wh[c] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);                                               \
            }                                                                                                         \
            __m256 dv = LOAD_F16(d + ((size_t)g * KB + b) * NG);                                                      \
            for (int r = 0; r < MR; r++) {                                                                            \
                const int8_t *q = qx + (size_t)(r0 + r) * K + b * QK;                                                 \
                __m256i s = _mm256_add_epi32(DOT4(wl, q, 0), DOT4(wh, q, 16));                                        \
                __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(sx[(size_t)(r0 + r) * KB + b]));                      \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);                                       \
            }                                                                                                         \
        }                                                                                                             \
        for (int r = 0; r < MR; r++) {                                                                                \
            __m256 mt = _mm256_setzero_ps();                                                                          \
            for (int b = 0; b < KB; b++)                                                                              \
                mt = _mm256_fmadd_ps(LOAD_F16(m + ((size_t)g * KB + b) * NG),                                         \
                                     _mm256_set1_ps(xs[(size_t)(r0 + r) * KB + b]), mt);                              \
            _mm256_storeu_ps(y + (size_t)(r0 + r) * N + g * NG, _mm256_add_ps(acc[r], mt));                           \
        }                                                                                                             \
    }

/* 8 fp16 -> 8 fp32 (exact) */
#define LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define BCAST(q, off) _mm256_set1_epi32(*(const int32_t *)((q) + (off)))
/* AVX2: unsigned codes x signed bytes in 16-bit pairs (|pair| <= 2 * 15 * 127), four chunks summed in 16 bits
(<= 15240, no saturation), then widened to 32 */
#define MADDUBS(w, q, off) _mm256_maddubs_epi16((w), BCAST(q, off))
#define DOT4_AVX2(w, q, off)                                                                                 \
    _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(MADDUBS(w[0], q, off), MADDUBS(w[1], q, off + 4)),   \
                                       _mm256_add_epi16(MADDUBS(w[2], q, off + 8), MADDUBS(w[3], q, off + 12))), \
                      _mm256_set1_epi16(1))
/* VNNI: one chain of four accumulating 32-bit multiply-adds */
#define DOT4_VNNI(w, q, off)                                                                                      \
    _mm256_dpbusd_epi32(                                                                                          \
        _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w[0], BCAST(q, off)), \
                                                w[1], BCAST(q, off + 4)),                                         \
                            w[2], BCAST(q, off + 8)),                                                             \
        w[3], BCAST(q, off + 12))
#define AVX2 "avx2,fma,f16c"
#define VNNI "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
GROUP_SIMD(group_avx2_1, AVX2, DOT4_AVX2, 1)
GROUP_SIMD(group_avx2_2, AVX2, DOT4_AVX2, 2)
GROUP_SIMD(group_vnni_1, VNNI, DOT4_VNNI, 1)
GROUP_SIMD(group_vnni_2, VNNI, DOT4_VNNI, 2)
GROUP_SIMD(group_vnni_4, VNNI, DOT4_VNNI, 4)

typedef void (*group_fn)(const uint8_t *, const uint16_t *, const uint16_t *, int, const int8_t *, const float *,
                         const float *, int, float *, int, int);

/* AVX512 (zmm), paths 2 and 3: two consecutive output groups g, g+1 at once, group g's 8 outputs in the low 256-bit
half and g+1's in the high one, the layout as it is (each half loaded from its own group's chunks). Per lane the same
operations in the same order as GROUP_SIMD: the block's exact int32 dot, converted, times (d * sx) as one multiply,
one fma per block in order; the m term its own fma chain in block order (kept beside the first, so m is converted
once per block for all the tile's rows), then acc + mt. One multiply-add instruction, its 4 activation bytes
broadcast inside it, does both groups' work, and 32 registers hold up to 8 rows' accumulators: on Zen 4 (which splits
a zmm op in two) a 4-row call of the target's gate|up shape ran ~1.45x and a 16-row one ~1.6x faster than two
groups on ymm, 1 row in cache ~1.35x. */
#define ZMM "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
/* 32 bytes of group g at p and 32 of group g+1 at p + stride */
#define LOAD_PAIR(p, stride)                                                                     \
    _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p))),       \
                       _mm256_loadu_si256((const __m256i *)((p) + (stride))), 1)
#define LOAD_PAIR_F16(p, stride)                                                                         \
    _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p))), \
                                            _mm_loadu_si128((const __m128i *)((p) + (stride))), 1))
/* acc + <w, the 4 signed activation bytes at q broadcast to every lane>: vpdpbusd with an embedded broadcast (GCC
12 emits a vpbroadcastd of its own for _mm512_set1_epi32; folded, a 1-row call ran ~15 % faster) */
__attribute__((target(ZMM))) static inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t *q) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)q));
    return acc;
}

/* Software prefetch: the hardware's stream prefetch follows one group's codes well but loses the pair's two streams
(they lie K / 32 * 128 bytes apart); a streamed 1-row pass of the target's layers was ~1.4x slower without this. One
sweep over the pair's codes (and one over its d, one over its m) runs PF_CODES bytes ahead of the pair's linear position
at the rate the pair consumes them, and runs on into the next pairs', so each group's codes are requested well before
they are read. */
#ifndef PF_CODES
#define PF_CODES 8192
#endif
#define PF_SCALES (PF_CODES / 8) /* the same number of blocks ahead in d and m (16 bytes a group and block) */
#define PREFETCH_PAIR(pw, pd, pm, b)                                                                  \
    if (PF_CODES) {                                                                                   \
        const char *pc = (const char *)(pw) + PF_CODES + (size_t)(b) * 2 * 4 * NG * 4;                \
        for (int l = 0; l < 4; l++) _mm_prefetch(pc + 64 * l, _MM_HINT_T0);                          \
        _mm_prefetch((const char *)(pd) + PF_SCALES + (size_t)(b) * 2 * NG * 2, _MM_HINT_T0);         \
        _mm_prefetch((const char *)(pm) + PF_SCALES + (size_t)(b) * 2 * NG * 2, _MM_HINT_T0);         \
    }
#define PAIR_ZMM(NAME, MR)                                                                                            \
    __attribute__((target(ZMM))) static void NAME(const uint8_t *packed, const uint16_t *d, const uint16_t *m, int K, \
                                                  const int8_t *qx, const float *sx, const float *xs, int r0,       \
                                                  float *y, int N, int g) {                                         \
        int KB = K / QK;                                                                                              \
        size_t wst = (size_t)KB * 4 * NG * 4, fst = (size_t)KB * NG; /* group g -> g+1: codes, d and m */            \
        const uint8_t *pw = packed + (size_t)g * wst;                                                                 \
        const uint16_t *pd = d + (size_t)g * fst, *pm = m + (size_t)g * fst;                                          \
        const __m512i low = _mm512_set1_epi8(15);                                                                     \
        __m512 acc[MR], mt[MR];                                                                                       \
        for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps(), mt[r] = _mm512_setzero_ps();                      \
        for (int b = 0; b < KB; b++) {                                                                                \
            const uint8_t *blk = pw + (size_t)b * 4 * NG * 4;                                                         \
            PREFETCH_PAIR(pw, pd, pm, b);                                                                             \
            __m512i wl[4], wh[4];                                                                                     \
            for (int c = 0; c < 4; c++) {                                                                             \
                __m512i p = LOAD_PAIR(blk + c * NG * 4, wst);                                                         \
                wl[c] = _mm512_and_si512(p, low);                                                                     \
                wh[c] = _mm512_and_si512(_mm512_srli_epi32(p, 4), low);                                               \
            }                                                                                                         \
            __m512 dv = LOAD_PAIR_F16(pd + (size_t)b * NG, fst), mv = LOAD_PAIR_F16(pm + (size_t)b * NG, fst);        \
            for (int r = 0; r < MR; r++) {                                                                            \
                const int8_t *q = qx + (size_t)(r0 + r) * K + b * QK;                                                 \
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();                                     \
                for (int c = 0; c < 4; c++) {                                                                         \
                    s0 = dpbusd_bcast(s0, wl[c], q + 4 * c);                                                          \
                    s1 = dpbusd_bcast(s1, wh[c], q + 16 + 4 * c);                                                     \
                }                                                                                                     \
                __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(sx[(size_t)(r0 + r) * KB + b]));                      \
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), scale, acc[r]);                \
                mt[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[(size_t)(r0 + r) * KB + b]), mt[r]);                    \
            }                                                                                                         \
        }                                                                                                             \
        for (int r = 0; r < MR; r++)                                                                                  \
            _mm512_storeu_ps(y + (size_t)(r0 + r) * N + g * NG, _mm512_add_ps(acc[r], mt[r]));                        \
    }
PAIR_ZMM(pair_zmm_1, 1)
PAIR_ZMM(pair_zmm_2, 2)
PAIR_ZMM(pair_zmm_3, 3)
PAIR_ZMM(pair_zmm_4, 4)
PAIR_ZMM(pair_zmm_5, 5)
PAIR_ZMM(pair_zmm_6, 6)
PAIR_ZMM(pair_zmm_7, 7)
PAIR_ZMM(pair_zmm_8, 8)

static const group_fn pair_zmm_rows[] = {pair_zmm_1, pair_zmm_1, pair_zmm_2, pair_zmm_3, pair_zmm_4,
                                         pair_zmm_5, pair_zmm_6, pair_zmm_7, pair_zmm_8};
#define PAIR_MR 8 /* rows per tile at most: 2 x MR accumulators, 8 codes and a few more of the 32 registers */

/* both groups g, g+1 for every row, the rows in as few tiles of up to PAIR_MR as there can be, of near equal sizes
(5 rows: one tile of 5, not 4 + 1; the results do not depend on the tiling) */
static void pair_zmm(const uint8_t *packed, const uint16_t *d, const uint16_t *m, int K, const int8_t *qx,
                     const float *sx, const float *xs, int M, float *y, int N, int g) {
    int tiles = (M + PAIR_MR - 1) / PAIR_MR;
    for (int i = 0, r0 = 0; i < tiles; i++) {
        int rows = (M - r0) / (tiles - i) + ((M - r0) % (tiles - i) != 0);
        pair_zmm_rows[rows](packed, d, m, K, qx, sx, xs, r0, y, N, g);
        r0 += rows;
    }
}
#endif

/* 3: AMX-INT8 tiles for calls of AMX_MIN_ROWS+ rows (amx.c) and AVX512-VNNI for the others, 2: AVX512-VNNI,
1: AVX2, 0: scalar */
int q4_best_path(void) {
#ifndef BLOCKSPEC_X86
    return 0; /* the scalar loops only */
#else
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
        return 0;
    if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512vl")) return 1;
    return amx_available() ? 3 : 2;
#endif
}

/* one output group for every row, rows in tiles of 4 / 2 / 1 (the results do not depend on the tiling; AMX's
pairs of groups are q4_gemm_groups') */
static void group(const uint8_t *packed, const uint16_t *d, const uint16_t *m, int K, const int8_t *qx,
                  const float *sx, const float *xs, int M, float *y, int N, int g, int path) {
    int r0 = 0;
#ifndef BLOCKSPEC_X86
    path = 0; /* no other path is built */
#endif
    if (path == 0) {
        for (; r0 < M; r0++) group_scalar(packed, d, m, K, qx, sx, xs, r0, y, N, g);
        return;
    }
#ifdef BLOCKSPEC_X86
    /* AVX2 has 16 vector registers: 2 rows at a time at most without spilling */
    group_fn f1 = path >= 2 ? group_vnni_1 : group_avx2_1, f2 = path >= 2 ? group_vnni_2 : group_avx2_2;
    if (path >= 2)
        for (; r0 + 4 <= M; r0 += 4) group_vnni_4(packed, d, m, K, qx, sx, xs, r0, y, N, g);
    for (; r0 + 2 <= M; r0 += 2) f2(packed, d, m, K, qx, sx, xs, r0, y, N, g);
    for (; r0 < M; r0++) f1(packed, d, m, K, qx, sx, xs, r0, y, N, g);
#endif
}

/* output groups g0..g1-1 of y [M, N] for every row: a thread's share of one matmul (decoder.c calls it inside its
own parallel region) */
void q4_gemm_groups(const uint8_t *packed, const uint16_t *d, const uint16_t *m, int N, int K, const int8_t *qx,
                    const float *sx, const float *xs, int M, float *y, int g0, int g1, int path) {
    int g = g0;
#ifdef BLOCKSPEC_AMX
    if (path == 3 && M >= AMX_MIN_ROWS) /* pairs of groups in tiles of up to 16 rows; an odd last group on VNNI */
        for (; g + 2 <= g1; g += 2)
            for (int r0 = 0; r0 < M; r0 += 16)
                q4_pair_amx(packed, d, m, K, qx, sx, xs, r0, M - r0 < 16 ? M - r0 : 16, y, N, g);
#endif
#ifdef BLOCKSPEC_X86
    if (path >= 2) /* pairs of groups on zmm (where AMX did not take them); an odd last group on ymm */
        for (; g + 2 <= g1; g += 2) pair_zmm(packed, d, m, K, qx, sx, xs, M, y, N, g);
#endif
    for (; g < g1; g++) group(packed, d, m, K, qx, sx, xs, M, y, N, g, path);
}

/* y [M, N] = the rows of qx against the N weight rows; output groups split over `threads` (OpenMP) */
void q4_gemm(const uint8_t *packed, const uint16_t *d, const uint16_t *m, int N, int K, const int8_t *qx,
             const float *sx, const float *xs, int M, float *y, int threads, int path) {
#pragma omp parallel num_threads(threads)
    {
        int n = omp_get_num_threads(), t = omp_get_thread_num(), g0 = N / NG * t / n, g1 = N / NG * (t + 1) / n;
        q4_gemm_groups(packed, d, m, N, K, qx, sx, xs, M, y, g0, g1, path);
    }
}
