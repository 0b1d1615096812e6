/* Intel AMX tiles for the native kernels' multi-row calls (q4gemm.c, q8gemm.c pick them from AMX_MIN_ROWS rows
where the CPU has AMX-INT8 and the kernel grants the process its tile state).

Why: on an AVX512-VNNI core a verify or draft row costs another pass of integer multiply-adds (the weights are
unpacked once, but each row's dot products are its own), so 4 rows cost ~1.4x one row and 16 rows ~3x. One AMX
tile multiply does a whole 16-row x 8-output x 32-input block at once in about the time of a few VNNI instructions.

Exactness: a tile multiply's int32 sums are the same integers the VNNI and scalar paths add up (integer dot products
of one block of 32, no saturation), and the float steps after it are the other paths' own in the same order (per
row: acc += float(sum) * (d * sx) per block, then + the m term), so every path gives the same bits and a row's
result never depends on the rows beside it.

Tiles (configured per call: another library on the thread may have loaded its own configuration): 0, 1: A, the
rows' int8 activations of one block [rows, 32]; 2, 3: B, two output groups' codes [8, 64] (row c: inputs 4c..4c+3
of each of the 16 outputs); 4..7: C, the int32 sums [rows, 16] of DEPTH blocks in flight. */

#include "native.h"

#ifndef BLOCKSPEC_AMX
/* a build without AMX (another architecture, or a compiler without AMX intrinsics: build.py's later tries): the other
paths only. The pair functions keep their signatures so every build exports the same functions, and are never called
(q4gemm.c and q8gemm.c call them in AMX builds only). */
int amx_available(void) { return 0; }
void q4_pair_amx(const uint8_t *packed, const uint16_t *d, const uint16_t *m, int K, const int8_t *qx, const float *sx,
                 const float *xs, int r0, int rows, float *y, int N, int g) {}
void q8_pair_amx(const int8_t *packed, const uint16_t *d, int K, const int8_t *qx, const float *sx, int r0, int rows,
                 float *y, int N, int g) {}
#else
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX "amx-tile,amx-int8,avx512f,avx512vl,avx512bw,avx2,fma,f16c"
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

#define DEPTH 4 /* blocks in flight: their tile multiplies overlap, their sums are stored together */

/* whether the CPU has AMX-INT8 and Linux lets this process use the tile data */
int amx_available(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("amx-int8") || !__builtin_cpu_supports("avx512bw")) return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

__attribute__((target(AMX))) static void configure(int rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 2; t++) c.rows[t] = rows, c.colsb[t] = QK;              /* A, double-buffered */
    for (int t = 2; t < 4; t++) c.rows[t] = QK / 4, c.colsb[t] = 2 * 4 * NG;    /* B, double-buffered */
    for (int t = 4; t < 4 + DEPTH; t++) c.rows[t] = rows, c.colsb[t] = 2 * 4 * NG; /* C, one per block */
    _tile_loadconfig(&c);
}

/* 16 fp16 of groups g (p0) and g+1 (p1) -> 16 fp32 */
__attribute__((target(AMX))) static inline __m512 load_pair_f16(const uint16_t *p0, const uint16_t *p1) {
    __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p0)),
                                        _mm_loadu_si128((const __m128i *)p1), 1);
    return _mm512_cvtph_ps(h);
}

/* The int32 sums [n][rows][16] of blocks b..b+n-1 (n <= DEPTH) for rows r0.. and the pair's codes in
codes[j] (B tiles: row c = inputs 4c..4c+3 of group g's 8 outputs, then group g+1's); tile ids are immediates, so
the blocks are unrolled. */
#define TDP_BLOCK(DP, j, A, B, C)                                                                                 \
    if (j < n) {                                                                                                  \
        _tile_loadd(A, qx + (size_t)r0 * K + (b + j) * QK, K);                                                    \
        _tile_loadd(B, codes[j], 2 * 4 * NG);                                                                     \
        _tile_zero(C);                                                                                            \
        DP(C, A, B);                                                                                              \
    }
#define TILE_SUMS(DP)                                                                                             \
    do {                                                                                                          \
        TDP_BLOCK(DP, 0, 0, 2, 4) TDP_BLOCK(DP, 1, 1, 3, 5) TDP_BLOCK(DP, 2, 0, 2, 6) TDP_BLOCK(DP, 3, 1, 3, 7)     \
        _tile_stored(4, sums[0], 2 * 4 * NG);                                                                     \
        if (n > 1) _tile_stored(5, sums[1], 2 * 4 * NG);                                                          \
        if (n > 2) _tile_stored(6, sums[2], 2 * 4 * NG);                                                          \
        if (n > 3) _tile_stored(7, sums[3], 2 * 4 * NG);                                                          \
    } while (0)

/* acc[r] += float(sums[j][r]) * (d * sx[r]) for blocks b..b+n-1, in order */
__attribute__((target(AMX))) static inline void scale_sums(__m512 *acc, int32_t (*sums)[16 * 2 * NG],
                                                           const uint16_t *d, const float *sx, int g, int KB, int b,
                                                           int n, int r0, int rows) {
    for (int j = 0; j < n; j++) {
        __m512 dv = load_pair_f16(d + ((size_t)g * KB + b + j) * NG, d + ((size_t)(g + 1) * KB + b + j) * NG);
        for (int r = 0; r < rows; r++) {
            __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(sums[j] + r * 2 * NG)));
            acc[r] = _mm512_fmadd_ps(s, _mm512_mul_ps(dv, _mm512_set1_ps(sx[(size_t)(r0 + r) * KB + b + j])), acc[r]);
        }
    }
}

/* Q4_1 (q4gemm.c's layout): groups g, g+1, rows r0..r0+rows-1 (rows <= 16) of y [M, N] */
__attribute__((target(AMX))) void q4_pair_amx(const uint8_t *packed, const uint16_t *d, const uint16_t *m, int K,
                                              const int8_t *qx, const float *sx, const float *xs, int r0, int rows,
                                              float *y, int N, int g) {
    int KB = K / QK;
    _Alignas(64) uint8_t codes[DEPTH][QK / 4 * 2 * 4 * NG];
    _Alignas(64) int32_t sums[DEPTH][16 * 2 * NG];
    __m512 acc[16];
    const __m256i low = _mm256_set1_epi8(15);
    configure(rows);
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < KB; b += DEPTH) {
        int n = KB - b < DEPTH ? KB - b : DEPTH;
        for (int j = 0; j < n; j++)
            for (int h = 0; h < 2; h++) { /* chunk c: low nibbles are inputs 4c.., high ones 4c+16..: B rows c, c+4 */
                const uint8_t *blk = packed + ((size_t)(g + h) * KB + b + j) * 4 * NG * 4;
                for (int c = 0; c < 4; c++) {
                    __m256i p = _mm256_loadu_si256((const __m256i *)(blk + c * NG * 4));
                    _mm256_store_si256((__m256i *)(codes[j] + c * 2 * 4 * NG + h * 4 * NG), _mm256_and_si256(p, low));
                    _mm256_store_si256((__m256i *)(codes[j] + (c + 4) * 2 * 4 * NG + h * 4 * NG),
                                       _mm256_and_si256(_mm256_srli_epi16(p, 4), low));
                }
            }
        TILE_SUMS(_tile_dpbsud);
        scale_sums(acc, sums, d, sx, g, KB, b, n, r0, rows);
    }
    for (int r = 0; r < rows; r++) {
        __m512 mt = _mm512_setzero_ps();
        for (int b = 0; b < KB; b++)
            mt = _mm512_fmadd_ps(load_pair_f16(m + ((size_t)g * KB + b) * NG, m + ((size_t)(g + 1) * KB + b) * NG),
                                 _mm512_set1_ps(xs[(size_t)(r0 + r) * KB + b]), mt);
        _mm512_storeu_ps(y + (size_t)(r0 + r) * N + g * NG, _mm512_add_ps(acc[r], mt));
    }
}

/* Q8_0 (q8gemm.c's layout: a (group, block)'s 8 chunks are B's rows for that group): groups g, g+1 */
__attribute__((target(AMX))) void q8_pair_amx(const int8_t *packed, const uint16_t *d, int K, const int8_t *qx,
                                              const float *sx, int r0, int rows, float *y, int N, int g) {
    int KB = K / QK;
    _Alignas(64) int8_t codes[DEPTH][QK / 4 * 2 * 4 * NG];
    _Alignas(64) int32_t sums[DEPTH][16 * 2 * NG];
    __m512 acc[16];
    configure(rows);
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < KB; b += DEPTH) {
        int n = KB - b < DEPTH ? KB - b : DEPTH;
        for (int j = 0; j < n; j++)
            for (int h = 0; h < 2; h++) {
                const int8_t *blk = packed + ((size_t)(g + h) * KB + b + j) * 8 * NG * 4;
                for (int c = 0; c < 8; c++)
                    _mm256_store_si256((__m256i *)(codes[j] + c * 2 * 4 * NG + h * 4 * NG),
                                       _mm256_loadu_si256((const __m256i *)(blk + c * NG * 4)));
            }
        TILE_SUMS(_tile_dpbssd);
        scale_sums(acc, sums, d, sx, g, KB, b, n, r0, rows);
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + (size_t)(r0 + r) * N + g * NG, acc[r]);
}
#endif
