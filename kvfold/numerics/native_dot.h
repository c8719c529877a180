/* kvfold native kernels: the one fp32 dot product (lanes, tiles, matmul over column ranges).
 * Included by native.c; see its header for the arithmetic rules every kernel keeps. */
#ifndef KV_NATIVE_DOT_H
#define KV_NATIVE_DOT_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 8

/* The one dot product every kernel uses. For each output pair (row r of a, row c of b): lane j
 * accumulates a[i] * b[i] over i = j (mod LANES) in ascending i with fused multiply-adds (fmaf:
 * one rounding, exactly defined by IEEE 754 on every machine), the n % LANES tail likewise, then
 * the lanes are summed by halving (lane j + lane j + LANES/2, ...) and the tail added last. That
 * sequence of roundings depends on n only, so an MR x NR tile computes each of its outputs
 * exactly as a lone 1 x 1 call does; the tiles only share the loads. */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* the halving sum of 8 lanes, plus the tail: (l0+l4, l1+l5, l2+l6, l3+l7) -> (+2 apart) -> (+1 apart) */
static inline float lanes_sum(__m256 v, float tail) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h) + tail;
}
#define DOT_TILE(MR, NR)                                                                           \
    static inline void dot_tile_##MR##x##NR(const float *a, int64_t lda, const float *b, int64_t ldb, \
                                            int64_t n, float *out, int64_t ldo) {                  \
        __m256 acc[MR][NR];                                                                        \
        for (int r = 0; r < MR; r++)                                                               \
            for (int c = 0; c < NR; c++) acc[r][c] = _mm256_setzero_ps();                          \
        int64_t i = 0;                                                                             \
        for (; i + LANES <= n; i += LANES) {                                                       \
            __m256 bv[NR];                                                                         \
            for (int c = 0; c < NR; c++) bv[c] = _mm256_loadu_ps(b + c * ldb + i);                 \
            for (int r = 0; r < MR; r++) {                                                         \
                __m256 av = _mm256_loadu_ps(a + r * lda + i);                                      \
                for (int c = 0; c < NR; c++) acc[r][c] = _mm256_fmadd_ps(av, bv[c], acc[r][c]);    \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < MR; r++)                                                               \
            for (int c = 0; c < NR; c++) {                                                         \
                float tail = 0.0f;                                                                 \
                for (int64_t t = i; t < n; t++) tail = fmaf(a[r * lda + t], b[c * ldb + t], tail); \
                out[r * ldo + c] = lanes_sum(acc[r][c], tail);                                     \
            }                                                                                      \
    }
#else /* the same operations, lane by lane (fmaf rounds exactly as the fused instruction does) */
#define DOT_TILE(MR, NR)                                                                           \
    static inline void dot_tile_##MR##x##NR(const float *a, int64_t lda, const float *b, int64_t ldb, \
                                            int64_t n, float *out, int64_t ldo) {                  \
        float acc[MR][NR][LANES];                                                                  \
        memset(acc, 0, sizeof acc);                                                                \
        int64_t i = 0;                                                                             \
        for (; i + LANES <= n; i += LANES)                                                         \
            for (int r = 0; r < MR; r++)                                                           \
                for (int c = 0; c < NR; c++)                                                       \
                    for (int j = 0; j < LANES; j++)                                                \
                        acc[r][c][j] = fmaf(a[r * lda + i + j], b[c * ldb + i + j], acc[r][c][j]); \
        for (int r = 0; r < MR; r++)                                                               \
            for (int c = 0; c < NR; c++) {                                                         \
                float tail = 0.0f;                                                                 \
                for (int64_t t = i; t < n; t++) tail = fmaf(a[r * lda + t], b[c * ldb + t], tail); \
                float *l = acc[r][c];                                                              \
                for (int half = LANES / 2; half > 0; half /= 2)                                    \
                    for (int j = 0; j < half; j++) l[j] = l[j] + l[j + half];                      \
                out[r * ldo + c] = l[0] + tail;                                                    \
            }                                                                                      \
    }
#endif
DOT_TILE(1, 1)
DOT_TILE(1, 4)
DOT_TILE(2, 1)
DOT_TILE(2, 4)
DOT_TILE(3, 1)
DOT_TILE(3, 4)
DOT_TILE(4, 1)
DOT_TILE(4, 2)
DOT_TILE(4, 3)
#if defined(__AVX512VL__)
/* 32 vector registers: a 4 x 5 tile holds its 20 accumulators and the 9 vectors it loads for 20
 * multiply-adds (4 x 3 loads 7 for 12); 4 x 6 would need 34 registers, and the compiler then
 * reloads every weight vector from memory (measured slower: bench/RESULTS.md) */
#define KV_WIDE_TILE 1
DOT_TILE(4, 5)
#else
#define KV_WIDE_TILE 0
#endif

/* sum_i a[i] * b[i] */
static inline float dot(const float *a, const float *b, int64_t n) {
    float out;
    dot_tile_1x1(a, 0, b, 0, n, &out, 0);
    return out;
}

static inline double sum_squares(const float *x, int64_t n) {
    double acc[4] = {0};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) acc[j] += (double)x[i + j] * (double)x[i + j];
    double tail = 0.0;
    for (; i < n; i++) tail += (double)x[i] * (double)x[i];
    return (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail;
}

/* out[m, j] = dot(x row m, w row j) for x [M, K] (row stride ldx), w [N, K], out (row stride ldo),
 * over columns [n0, n1). Tiles of 4 rows x 3 or 2 columns, then the last 3, 2 or 1 rows together
 * (3 x 4, 2 x 4, 1 x 4: so a verify step's 2 or 3 rows read each weight once, not once a row),
 * share their loads; every output is still the one `dot` above. `wide`: 4 x 5 tiles first where the
 * machine has the registers (KV_WIDE_TILE), for w in cache (a decoded panel); w streamed from
 * memory reads better 3 rows at a time (bench/RESULTS.md). */
static void matmul_cols_tiled(const float *x, int64_t ldx, const float *w, float *out, int64_t ldo, int64_t m,
                              int64_t n0, int64_t n1, int64_t k, int wide) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) {
        int64_t c = n0;
#if KV_WIDE_TILE
        for (; wide && c + 5 <= n1; c += 5) dot_tile_4x5(x + r * ldx, ldx, w + c * k, k, k, out + r * ldo + c, ldo);
#endif
        for (; c + 3 <= n1; c += 3) dot_tile_4x3(x + r * ldx, ldx, w + c * k, k, k, out + r * ldo + c, ldo);
        for (; c + 2 <= n1; c += 2) dot_tile_4x2(x + r * ldx, ldx, w + c * k, k, k, out + r * ldo + c, ldo);
        for (; c < n1; c++) dot_tile_4x1(x + r * ldx, ldx, w + c * k, k, k, out + r * ldo + c, ldo);
    }
    const float *xr = x + r * ldx;
    float *o = out + r * ldo;
    int64_t c = n0;
    if (m - r == 3) {
        for (; c + 4 <= n1; c += 4) dot_tile_3x4(xr, ldx, w + c * k, k, k, o + c, ldo);
        for (; c < n1; c++) dot_tile_3x1(xr, ldx, w + c * k, k, k, o + c, ldo);
    } else if (m - r == 2) {
        for (; c + 4 <= n1; c += 4) dot_tile_2x4(xr, ldx, w + c * k, k, k, o + c, ldo);
        for (; c < n1; c++) dot_tile_2x1(xr, ldx, w + c * k, k, k, o + c, ldo);
    } else if (m - r == 1) {
        for (; c + 4 <= n1; c += 4) dot_tile_1x4(xr, ldx, w + c * k, k, k, o + c, 1);
        for (; c < n1; c++) dot_tile_1x1(xr, ldx, w + c * k, k, k, o + c, 1);
    }
}

static void matmul_cols(const float *x, int64_t ldx, const float *w, float *out, int64_t ldo, int64_t m,
                        int64_t n0, int64_t n1, int64_t k) {
    matmul_cols_tiled(x, ldx, w, out, ldo, m, n0, n1, k, 0);
}

#endif
