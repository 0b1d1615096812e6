/* Q8 weights x Q8 activations on the CPU: the q4 target's lm_head (and the drafter's reads of it) and --cpu-quant q8
(built and loaded with q4gemm.c: blockspec/native/build.py, lib.py).

Weights: a GGUF Q8_0 block as it is, per output and block of 32 inputs: w = d * code (code -127..127, d fp16), so a
Q8_0 file's tensors (the bundled model's token embedding, its tied head) are computed with their own values.
Activations: q4gemm.c's per-block int8 codes and scales. One output = sum over blocks, in order, of (d * sx) *
<codes_w, codes_x>; the integer dot of a block is exact and every float step is one multiply or fused multiply-add,
so rows, threads and paths give the same bits, as in q4gemm.c. torch's int8 matmul converts the codes to fp32 and
multiplies bf16-rounded activations: compute-bound, each further row costs nearly a full pass over the head.

Layout: outputs in groups of 8; per (group, block) eight 32-byte chunks, chunk c holding 4 codes (inputs 4c..4c+3)
of each of the 8 outputs; d stored [group][block][8]. A chunk against 4 activation bytes broadcast to every lane, an
unsigned x signed multiply-add: on AVX2 |w| times x with w's sign (its pairwise 16-bit sums stay under 2 * 128 * 127,
no saturation), on VNNI w + 128 (the code's bits ^ 0x80) times x with 128 x the activations' block sum taken back
(GROUP8_VNNI, and PAIR8_ZMM for two groups at once on zmm). */

#include <omp.h>

#include "native.h"
#ifdef BLOCKSPEC_X86
#include <immintrin.h>
#endif

/* codes [N, K] int8 -> the chunked layout above; N a multiple of NG */
void q8w_pack(const int8_t *codes, int N, int K, int8_t *packed) {
    int KB = K / QK;
    for (int n = 0; n < N; n++)
        for (int b = 0; b < KB; b++)
            for (int c = 0; c < 8; c++)
                for (int j = 0; j < 4; j++)
                    packed[((((size_t)(n / NG) * KB + b) * 8 + c) * NG + n % NG) * 4 + j] =
                        codes[(size_t)n * K + b * QK + 4 * c + j];
}

static void group_scalar(const int8_t *packed, const uint16_t *d, int K, const int8_t *qx, const float *sx, int r,
                         float *y, int N, int g) {
    int KB = K / QK;
    for (int o = 0; o < NG; o++) {
        float acc = 0.0f;
        for (int b = 0; b < KB; b++) {
            const int8_t *blk = packed + ((size_t)g * KB + b) * 8 * NG * 4;
            const int8_t *q = qx + (size_t)r * K + b * QK;
            int s = 0;
            for (int c = 0; c < 8; c++)
                for (int j = 0; j < 4; j++) s += blk[(c * NG + o) * 4 + j] * q[4 * c + j];
            acc = fmaf((float)s, fp16_to_f32(d[((size_t)g * KB + b) * NG + o]) * sx[(size_t)r * KB + b], acc);
        }
        y[(size_t)r * N + g * NG + o] = acc;
    }
}

#ifdef BLOCKSPEC_X86
#define BCAST(q, off) _mm256_set1_epi32(*(const int32_t *)((q) + (off)))
#define DOT_AVX2(acc, w, x) \
    _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8((x), (w))), \
                                              _mm256_set1_epi16(1)))

#define GROUP8_SIMD(NAME, TARGET, DOT, MR)                                                                          \
    __attribute__((target(TARGET))) static void NAME(const int8_t *packed, const uint16_t *d, int K,               \
                                                     const int8_t *qx, const float *sx, int r0, float *y, int N,  \
                                                     int g) {                                                     \
        int KB = K / QK;                                                                                           \
        __m256 acc[MR];                                                                                            \
        for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();                                                 \
        for (int b = 0; b < KB; b++) {                                                                             \
            const int8_t *blk = packed + ((size_t)g * KB + b) * 8 * NG * 4;                                        \
            __m256i w[8];                                                                                          \
            for (int c = 0; c < 8; c++) w[c] = _mm256_loadu_si256((const __m256i *)(blk + c * NG * 4));           \
            __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + ((size_t)g * KB + b) * NG)));        \
            for (int r = 0; r < MR; r++) {                                                                         \
                const int8_t *q = qx + (size_t)(r0 + r) * K + b * QK;                                              \
                __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();                                  \
                for (int c = 0; c < 8; c += 2) {                                                                   \
                    s0 = DOT(s0, w[c], BCAST(q, 4 * c));                                                           \
                    s1 = DOT(s1, w[c + 1], BCAST(q, 4 * c + 4));                                                   \
                }                                                                                                  \
                __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(sx[(size_t)(r0 + r) * KB + b]));                   \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), scale, acc[r]);             \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < MR; r++) _mm256_storeu_ps(y + (size_t)(r0 + r) * N + g * NG, acc[r]);                  \
    }

#define AVX2 "avx2,fma,f16c"
#define VNNI "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
GROUP8_SIMD(g8_avx2_1, AVX2, DOT_AVX2, 1)
GROUP8_SIMD(g8_avx2_2, AVX2, DOT_AVX2, 2)

/* VNNI: the weights offset to unsigned bytes (w + 128: w ^ 0x80, per block as its chunks are loaded, once for all
the tile's rows) against the signed activations, and the offset's share, 128 * (the row's block code sum, xsum: one
integer per row and block, summed once per call), taken back per block: the same exact int32 block sums as
|w| x sign(x, w), and the activations are the signed operand, so each 4-byte group is broadcast inside the
multiply-add (vpdpbusd's embedded broadcast) rather than by an instruction of its own */
#define VNNI_ZMM "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
__attribute__((target(VNNI_ZMM))) static inline __m256i dpbusd_bcast8(__m256i acc, __m256i w, const int8_t *q) {
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)q));
    return acc;
}
__attribute__((target(VNNI_ZMM))) static inline __m512i dpbusd_bcast16(__m512i acc, __m512i w, const int8_t *q) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)q));
    return acc;
}

#define GROUP8_VNNI(NAME, MR)                                                                                        \
    __attribute__((target(VNNI))) static void NAME(const int8_t *packed, const uint16_t *d, int K, const int8_t *qx, \
                                                   const int32_t *xsum, const float *sx, int r0, float *y, int N,   \
                                                   int g) {                                                         \
        int KB = K / QK;                                                                                           \
        const __m256i off = _mm256_set1_epi8((char)0x80);                                                          \
        __m256 acc[MR];                                                                                            \
        for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();                                                 \
        for (int b = 0; b < KB; b++) {                                                                             \
            const int8_t *blk = packed + ((size_t)g * KB + b) * 8 * NG * 4;                                        \
            __m256i w[8];                                                                                          \
            for (int c = 0; c < 8; c++)                                                                            \
                w[c] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + c * NG * 4)), off);             \
            __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + ((size_t)g * KB + b) * NG)));        \
            for (int r = 0; r < MR; r++) {                                                                         \
                const int8_t *q = qx + (size_t)(r0 + r) * K + b * QK;                                              \
                __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();                                  \
                for (int c = 0; c < 8; c += 2) {                                                                   \
                    s0 = dpbusd_bcast8(s0, w[c], q + 4 * c);                                                       \
                    s1 = dpbusd_bcast8(s1, w[c + 1], q + 4 * c + 4);                                               \
                }                                                                                                  \
                __m256i sum = _mm256_sub_epi32(_mm256_add_epi32(s0, s1),                                           \
                                               _mm256_set1_epi32(xsum[(size_t)(r0 + r) * KB + b]));                \
                __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(sx[(size_t)(r0 + r) * KB + b]));                   \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[r]);                                  \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < MR; r++) _mm256_storeu_ps(y + (size_t)(r0 + r) * N + g * NG, acc[r]);                  \
    }
GROUP8_VNNI(g8_vnni_1, 1)
GROUP8_VNNI(g8_vnni_4, 4)

/* AVX512 (zmm): output groups g, g+1 at once as q4gemm.c's PAIR_ZMM (g's 8 outputs in the low half, g+1's in the
high one, each half loaded from its own group's chunks), per lane the operations of GROUP8_VNNI in the same order, in
tiles of up to 8 rows (the drafter's 16-row block: 2 tiles) */
#ifndef PF8_CODES
#define PF8_CODES 8192 /* bytes ahead in a pair's codes and PF8_CODES / 16 in its d, as q4gemm.c's PREFETCH_PAIR */
#endif
#define PAIR8_ZMM(NAME, MR)                                                                                           \
    __attribute__((target(VNNI_ZMM))) static void NAME(const int8_t *packed, const uint16_t *d, int K,              \
                                                       const int8_t *qx, const int32_t *xsum, const float *sx,      \
                                                       int r0, float *y, int N, int g) {                             \
        int KB = K / QK;                                                                                              \
        size_t wst = (size_t)KB * 8 * NG * 4, fst = (size_t)KB * NG; /* group g -> g+1: codes and d */               \
        const int8_t *pw = packed + (size_t)g * wst;                                                                  \
        const uint16_t *pd = d + (size_t)g * fst;                                                                     \
        const __m512i off = _mm512_set1_epi8((char)0x80);                                                             \
        __m512 acc[MR];                                                                                               \
        for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();                                                    \
        for (int b = 0; b < KB; b++) {                                                                                \
            const int8_t *blk = pw + (size_t)b * 8 * NG * 4;                                                          \
            const char *pc = (const char *)pw + PF8_CODES + (size_t)b * 2 * 8 * NG * 4;                                \
            for (int l = 0; PF8_CODES && l < 8; l++) _mm_prefetch(pc + 64 * l, _MM_HINT_T0);                           \
            if (PF8_CODES) _mm_prefetch((const char *)pd + PF8_CODES / 16 + (size_t)b * 2 * NG * 2, _MM_HINT_T0);       \
            __m512i w[8];                                                                                             \
            for (int c = 0; c < 8; c++)                                                                               \
                w[c] = _mm512_xor_si512(                                                                              \
                    _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk + c * NG * 4))), \
                                       _mm256_loadu_si256((const __m256i *)(blk + wst + c * NG * 4)), 1),             \
                    off);                                                                                             \
            __m512 dv = _mm512_cvtph_ps(                                                                              \
                _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(pd + b * NG))),      \
                                        _mm_loadu_si128((const __m128i *)(pd + fst + b * NG)), 1));                   \
            for (int r = 0; r < MR; r++) {                                                                            \
                const int8_t *q = qx + (size_t)(r0 + r) * K + b * QK;                                                 \
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();                                     \
                for (int c = 0; c < 8; c += 2) {                                                                      \
                    s0 = dpbusd_bcast16(s0, w[c], q + 4 * c);                                                         \
                    s1 = dpbusd_bcast16(s1, w[c + 1], q + 4 * c + 4);                                                 \
                }                                                                                                     \
                __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(s0, s1),                                              \
                                               _mm512_set1_epi32(xsum[(size_t)(r0 + r) * KB + b]));                   \
                __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(sx[(size_t)(r0 + r) * KB + b]));                      \
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[r]);                                     \
            }                                                                                                         \
        }                                                                                                             \
        for (int r = 0; r < MR; r++) _mm512_storeu_ps(y + (size_t)(r0 + r) * N + g * NG, acc[r]);                     \
    }
PAIR8_ZMM(p8_zmm_1, 1)
PAIR8_ZMM(p8_zmm_2, 2)
PAIR8_ZMM(p8_zmm_3, 3)
PAIR8_ZMM(p8_zmm_4, 4)
PAIR8_ZMM(p8_zmm_5, 5)
PAIR8_ZMM(p8_zmm_6, 6)
PAIR8_ZMM(p8_zmm_7, 7)
PAIR8_ZMM(p8_zmm_8, 8)

typedef void (*pair8_fn)(const int8_t *, const uint16_t *, int, const int8_t *, const int32_t *, const float *, int,
                         float *, int, int);
static const pair8_fn p8_zmm_rows[] = {p8_zmm_1, p8_zmm_1, p8_zmm_2, p8_zmm_3, p8_zmm_4,
                                       p8_zmm_5, p8_zmm_6, p8_zmm_7, p8_zmm_8};
#define PAIR_MR 8 /* rows per tile at most */

/* groups g, g+1 for every row, the rows in as few tiles of up to PAIR_MR as there can be, of near equal size */
static void pair8_zmm(const int8_t *packed, const uint16_t *d, int K, const int8_t *qx, const int32_t *xsum,
                      const float *sx, int M, float *y, int N, int g) {
    int tiles = (M + PAIR_MR - 1) / PAIR_MR;
    for (int i = 0, r0 = 0; i < tiles; i++) {
        int rows = (M - r0) / (tiles - i) + ((M - r0) % (tiles - i) != 0);
        p8_zmm_rows[rows](packed, d, K, qx, xsum, sx, r0, y, N, g);
        r0 += rows;
    }
}
#endif

/* one output group for every row, rows in tiles of 4 (VNNI) / 2 (AVX2) / 1 (the results do not depend on it) */
static void group(const int8_t *packed, const uint16_t *d, int K, const int8_t *qx, const int32_t *xsum,
                  const float *sx, int M, float *y, int N, int g, int path) {
    int r0 = 0;
#ifdef BLOCKSPEC_X86
    if (path >= 2) {
        for (; r0 + 4 <= M; r0 += 4) g8_vnni_4(packed, d, K, qx, xsum, sx, r0, y, N, g);
        for (; r0 < M; r0++) g8_vnni_1(packed, d, K, qx, xsum, sx, r0, y, N, g);
        return;
    }
    if (path == 1) {
        for (; r0 + 2 <= M; r0 += 2) g8_avx2_2(packed, d, K, qx, sx, r0, y, N, g);
        for (; r0 < M; r0++) g8_avx2_1(packed, d, K, qx, sx, r0, y, N, g);
        return;
    }
#else
    (void)xsum; /* the scalar loops only */
#endif
    for (; r0 < M; r0++) group_scalar(packed, d, K, qx, sx, r0, y, N, g);
}

/* output groups g0..g1-1 of y [M, N] for every row: a thread's share (decoder.c, draft.c) */
void q8_gemm_groups(const int8_t *packed, const uint16_t *d, int N, int K, const int8_t *qx, const float *sx, int M,
                    float *y, int g0, int g1, int path) {
    int g = g0;
#ifdef BLOCKSPEC_AMX
    if (path == 3 && M >= AMX_MIN_ROWS) /* pairs of groups in tiles of up to 16 rows (amx.c); an odd last group on VNNI */
        for (; g + 2 <= g1; g += 2)
            for (int r0 = 0; r0 < M; r0 += 16) q8_pair_amx(packed, d, K, qx, sx, r0, M - r0 < 16 ? M - r0 : 16, y, N, g);
#endif
    if (g >= g1) return;
    int32_t stack[1024], *xsum = NULL; /* the VNNI loops' 128 * (code sum) per row and block */
#ifndef BLOCKSPEC_X86
    path = 0; /* no other path is built */
#endif
    if (path >= 2) {
        size_t n = (size_t)M * (K / QK);
        xsum = n <= sizeof stack / sizeof *stack ? stack : malloc(n * sizeof *xsum);
        if (xsum == NULL) path = 1; /* no memory for the sums: the AVX2 loops give the same bits */
        for (size_t i = 0; xsum && i < n; i++) {
            int s = 0;
            for (int j = 0; j < QK; j++) s += qx[i * QK + j];
            xsum[i] = 128 * s;
        }
    }
#ifdef BLOCKSPEC_X86
    if (path >= 2) /* pairs of groups on zmm; an odd last group on ymm */
        for (; g + 2 <= g1; g += 2) pair8_zmm(packed, d, K, qx, xsum, sx, M, y, N, g);
#endif
    for (; g < g1; g++) group(packed, d, K, qx, xsum, sx, M, y, N, g, path);
    if (xsum != stack) free(xsum);
}

/* y [M, N] = the rows of qx against the N int8 weight rows; output groups split over `threads` (OpenMP) */
void q8_gemm(const int8_t *packed, const uint16_t *d, int N, int K, const int8_t *qx, const float *sx, int M, float *y,
             int threads, int path) {
#pragma omp parallel num_threads(threads)
    {
        int n = omp_get_num_threads(), t = omp_get_thread_num(), g0 = N / NG * t / n, g1 = N / NG * (t + 1) / n;
        q8_gemm_groups(packed, d, N, K, qx, sx, M, y, g0, g1, path);
    }
}
