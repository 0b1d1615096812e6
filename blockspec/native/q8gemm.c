/* Q8 weights x Q8 activations on the CPU: the q4 target's lm_head (and the drafter's reads of it), blockspec/native/q4.py
loads it with q4gemm.c.

Weights: int8 codes per output row with one fp32 scale per row (cpu_quant.int8_quantize). Activations: q4gemm.c's
per-block int8 codes and scales. One output = (sum over blocks, in order, of sx * <codes_w, codes_x>) * sw; the
integer dot of a block is exact (|w| <= 128, |x| <= 127) and every float step is one fused multiply-add, so rows,
threads and paths give the same bits, as in q4gemm.c. torch's int8 matmul converts the codes to fp32 and multiplies
bf16-rounded activations: compute-bound, each further row costs nearly a full pass over the 28 MB head.

Layout: outputs in groups of 8; per (group, block) eight 32-byte chunks, chunk c holding 4 codes (inputs 4c..4c+3)
of each of the 8 outputs. A chunk against 4 activation bytes broadcast to every lane: |w| times x with w's sign, an
unsigned x signed multiply-add that cannot saturate (AVX2's pairwise 16-bit sums stay under 2 * 128 * 127). */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define QK 32
#define NG 8

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

static void group_scalar(const int8_t *packed, const float *sw, int K, const int8_t *qx, const float *sx, int r,
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
            acc = fmaf((float)s, sx[(size_t)r * KB + b], acc);
        }
        y[(size_t)r * N + g * NG + o] = acc * sw[g * NG + o];
    }
}

#define BCAST(q, off) _mm256_set1_epi32(*(const int32_t *)((q) + (off)))
#define DOT_AVX2(w, x) _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8((x), (w))), \
                                         _mm256_set1_epi16(1))
#define DOT_VNNI(w, x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8((x), (w)))

#define GROUP8_SIMD(NAME, TARGET, DOT, MR)                                                                          \
    __attribute__((target(TARGET))) static void NAME(const int8_t *packed, const float *sw, int K,                 \
                                                     const int8_t *qx, const float *sx, int r0, float *y, int N,  \
                                                     int g) {                                                     \
        int KB = K / QK;                                                                                           \
        __m256 acc[MR];                                                                                            \
        for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();                                                 \
        for (int b = 0; b < KB; b++) {                                                                             \
            const int8_t *blk = packed + ((size_t)g * KB + b) * 8 * NG * 4;                                        \
            __m256i w[8];                                                                                          \
            for (int c = 0; c < 8; c++) w[c] = _mm256_loadu_si256((const __m256i *)(blk + c * NG * 4));           \
            for (int r = 0; r < MR; r++) {                                                                         \
                const int8_t *q = qx + (size_t)(r0 + r) * K + b * QK;                                              \
                __m256i s0 = DOT(w[0], BCAST(q, 0)), s1 = DOT(w[1], BCAST(q, 4));                                  \
                __m256i s2 = DOT(w[2], BCAST(q, 8)), s3 = DOT(w[3], BCAST(q, 12));                                 \
                s0 = _mm256_add_epi32(s0, DOT(w[4], BCAST(q, 16)));                                                \
                s1 = _mm256_add_epi32(s1, DOT(w[5], BCAST(q, 20)));                                                \
                s2 = _mm256_add_epi32(s2, DOT(w[6], BCAST(q, 24)));                                                \
                s3 = _mm256_add_epi32(s3, DOT(w[7], BCAST(q, 28)));                                                \
                __m256i s = _mm256_add_epi32(_mm256_add_epi32(s0, s1), _mm256_add_epi32(s2, s3));                  \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(sx[(size_t)(r0 + r) * KB + b]),     \
                                         acc[r]);                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        __m256 scale = _mm256_loadu_ps(sw + g * NG);                                                               \
        for (int r = 0; r < MR; r++) _mm256_storeu_ps(y + (size_t)(r0 + r) * N + g * NG, _mm256_mul_ps(acc[r], scale)); \
    }

#define VNNI "avx2,fma,avx512f,avx512vl,avx512vnni"
GROUP8_SIMD(g8_avx2_1, "avx2,fma", DOT_AVX2, 1)
GROUP8_SIMD(g8_avx2_2, "avx2,fma", DOT_AVX2, 2)
GROUP8_SIMD(g8_vnni_1, VNNI, DOT_VNNI, 1)
GROUP8_SIMD(g8_vnni_4, VNNI, DOT_VNNI, 4)

/* y [M, N] = the rows of qx against the N int8 weight rows; output groups split over `threads` (OpenMP) */
void q8_gemm(const int8_t *packed, const float *sw, int N, int K, const int8_t *qx, const float *sx, int M, float *y,
             int threads, int path) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int g = 0; g < N / NG; g++) {
        int r0 = 0;
        if (path == 2) {
            for (; r0 + 4 <= M; r0 += 4) g8_vnni_4(packed, sw, K, qx, sx, r0, y, N, g);
            for (; r0 < M; r0++) g8_vnni_1(packed, sw, K, qx, sx, r0, y, N, g);
        } else if (path == 1) {
            for (; r0 + 2 <= M; r0 += 2) g8_avx2_2(packed, sw, K, qx, sx, r0, y, N, g);
            for (; r0 < M; r0++) g8_avx2_1(packed, sw, K, qx, sx, r0, y, N, g);
        } else {
            for (; r0 < M; r0++) group_scalar(packed, sw, K, qx, sx, r0, y, N, g);
        }
    }
}
