/* How fast one core multiplies FP8 e4m3 weights by an fp32 row when the weights are already in L2:
 * the decoding and the multiply-adds alone, no memory stream. A decode tile of 4 or 8 rows, 4,096
 * columns, 64 rows (256 KiB, in a 1 MiB L2) read 20 times a measurement, best of 20. Each way
 * gives every lane the fp32 multiply-adds of native_dot.h's 8-lane dot (only the decoding differs):
 *
 *   pairs, f32 bits   two rows' 8 codes a 512-bit register, sign-extended, shifted to float32 bits
 *                     of value * 2^-120 and masked (native_weights.h's e4m3x8_scaled_down_pair:
 *                     what the folded FP8 decode tile runs with AVX-512);
 *   rows, f32 bits    the same decoding one row a 256-bit register (the AVX2 tile);
 *   pairs, halves     two rows' codes to halves (value * 2^-8), widened by VCVTPH2PS;
 *   rows, halves      16 codes of one row to halves, two VCVTPH2PS;
 *   vpermb            32 codes of each of two rows in one register, each code put at the top
 *                     byte of its lane by a masked VPERMB, then an arithmetic shift and a mask.
 *
 * At one thread a V4-Flash decode row is bound by this rate (issue 42: one core decodes FP8 at
 * about 17 G weights a second from DRAM); a decoding with fewer operations would lift it. G
 * weights a second. The machine's other tenants move the figures by 10-20% from run to run: run
 * it several times.
 *
 *   cc -O3 -march=native -ffp-contract=off bench/fp8_decoders.c -o /tmp/fp8_decoders && /tmp/fp8_decoders
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define K 4096
#define ROWS 64
static uint8_t codes[ROWS * K] __attribute__((aligned(64)));
static float x[K] __attribute__((aligned(64)));
static volatile float sink;

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline __m128i two_rows(const uint8_t *a, const uint8_t *b, int64_t i) {
    return _mm_castpd_si128(_mm_loadh_pd(_mm_castsi128_pd(_mm_loadl_epi64((const __m128i *)(a + i))), (const double *)(b + i)));
}
static inline __m512 pair_f32_bits(const uint8_t *a, const uint8_t *b, int64_t i) {
    const __m512i v = _mm512_slli_epi32(_mm512_cvtepi8_epi32(two_rows(a, b, i)), 20);
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0x87FFFFFF)));
}
static inline __m512 pair_halves(const uint8_t *a, const uint8_t *b, int64_t i) {
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(two_rows(a, b, i)), 7),
                                       _mm256_set1_epi16((short)0xBF80));
    return _mm512_cvtph_ps(h);
}

#define SUM_PAIRS(NR) for (int q = 0; q < (NR) / 2; q++) sink += _mm512_reduce_add_ps(p[q]);
#define SUM_ROWS(NR)  for (int c = 0; c < (NR); c++) sink += _mm256_cvtss_f32(acc[c]);

#define PAIRS(NAME, DECODE, NR)                                                                        \
    static void NAME##_##NR(const uint8_t *row) {                                                      \
        __m512 p[(NR) / 2];                                                                            \
        for (int q = 0; q < (NR) / 2; q++) p[q] = _mm512_setzero_ps();                                 \
        for (int64_t i = 0; i < K; i += 8) {                                                           \
            const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + i));                          \
            for (int q = 0; q < (NR) / 2; q++)                                                         \
                p[q] = _mm512_fmadd_ps(xv, DECODE(row + 2 * q * K, row + (2 * q + 1) * K, i), p[q]);   \
        }                                                                                              \
        SUM_PAIRS(NR)                                                                                  \
    }
#define ROWS_F32(NR)                                                                                   \
    static void rows_f32_##NR(const uint8_t *row) {                                                    \
        __m256 acc[NR];                                                                                \
        for (int c = 0; c < (NR); c++) acc[c] = _mm256_setzero_ps();                                   \
        for (int64_t i = 0; i < K; i += 8) {                                                           \
            const __m256 xv = _mm256_loadu_ps(x + i);                                                  \
            for (int c = 0; c < (NR); c++) {                                                           \
                __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + c * K + i))); \
                v = _mm256_and_si256(_mm256_slli_epi32(v, 20), _mm256_set1_epi32((int)0x87FFFFFF));    \
                acc[c] = _mm256_fmadd_ps(xv, _mm256_castsi256_ps(v), acc[c]);                          \
            }                                                                                          \
        }                                                                                              \
        SUM_ROWS(NR)                                                                                   \
    }
#define ROWS_HALVES(NR)                                                                                \
    static void rows_halves_##NR(const uint8_t *row) {                                                 \
        __m256 acc[NR];                                                                                \
        for (int c = 0; c < (NR); c++) acc[c] = _mm256_setzero_ps();                                   \
        for (int64_t i = 0; i < K; i += 16) {                                                          \
            const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);                 \
            for (int c = 0; c < (NR); c++) {                                                           \
                const __m128i b = _mm_loadu_si128((const __m128i *)(row + c * K + i));                 \
                const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),      \
                                                   _mm256_set1_epi16((short)0xBF80));                  \
                acc[c] = _mm256_fmadd_ps(x0, _mm256_cvtph_ps(_mm256_castsi256_si128(h)), acc[c]);      \
                acc[c] = _mm256_fmadd_ps(x1, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), acc[c]); \
            }                                                                                          \
        }                                                                                              \
        SUM_ROWS(NR)                                                                                   \
    }
/* step s of a 32-code run: lane l (0-7 row a, 8-15 row b) takes code 8s + l mod 8 of its row */
static __m512i vpermb_index[4];
#define VPERMB(NR)                                                                                     \
    static void vpermb_##NR(const uint8_t *row) {                                                      \
        __m512 p[(NR) / 2];                                                                            \
        for (int q = 0; q < (NR) / 2; q++) p[q] = _mm512_setzero_ps();                                 \
        for (int64_t i = 0; i < K; i += 32) {                                                          \
            __m512i src[(NR) / 2];                                                                     \
            for (int q = 0; q < (NR) / 2; q++)                                                         \
                src[q] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(row + 2 * q * K + i))), \
                                            _mm256_loadu_si256((const __m256i *)(row + (2 * q + 1) * K + i)), 1); \
            for (int s = 0; s < 4; s++) {                                                              \
                const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + i + 8 * s));              \
                for (int q = 0; q < (NR) / 2; q++) {                                                   \
                    __m512i v = _mm512_maskz_permutexvar_epi8(0x8888888888888888ull, vpermb_index[s], src[q]); \
                    v = _mm512_and_si512(_mm512_srai_epi32(v, 4), _mm512_set1_epi32((int)0x87FFFFFF)); \
                    p[q] = _mm512_fmadd_ps(xv, _mm512_castsi512_ps(v), p[q]);                          \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
        SUM_PAIRS(NR)                                                                                  \
    }
PAIRS(pairs_f32, pair_f32_bits, 4) PAIRS(pairs_f32, pair_f32_bits, 8)
PAIRS(pairs_halves, pair_halves, 4) PAIRS(pairs_halves, pair_halves, 8)
ROWS_F32(4) ROWS_F32(8) ROWS_HALVES(4) ROWS_HALVES(8) VPERMB(4) VPERMB(8)

int main(void) {
    srand(1);
    for (int i = 0; i < ROWS * K; i++) {
        const uint8_t b = (uint8_t)rand();
        codes[i] = (b & 0x7F) == 0x7F ? 0x10 : b; /* no NaN codes, as the folded tile requires */
    }
    for (int i = 0; i < K; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    for (int s = 0; s < 4; s++) {
        uint8_t t[64] = {0};
        for (int l = 0; l < 16; l++) t[4 * l + 3] = (uint8_t)((l < 8 ? 0 : 32) + 8 * s + l % 8);
        memcpy(&vpermb_index[s], t, 64);
    }
    const struct { const char *name; void (*tile)(const uint8_t *); int rows; } ways[] = {
        {"pairs, f32 bits (native)", pairs_f32_4, 4}, {"pairs, f32 bits (native)", pairs_f32_8, 8},
        {"rows, f32 bits", rows_f32_4, 4},             {"rows, f32 bits", rows_f32_8, 8},
        {"pairs, halves", pairs_halves_4, 4},           {"pairs, halves", pairs_halves_8, 8},
        {"rows, halves", rows_halves_4, 4},             {"rows, halves", rows_halves_8, 8},
        {"vpermb", vpermb_4, 4},                        {"vpermb", vpermb_8, 8}};
    printf("FP8 decode tile from L2, one core, G weights/s (best of 20)\n");
    for (unsigned w = 0; w < sizeof ways / sizeof ways[0]; w++) {
        double best = 1e30;
        for (int rep = 0; rep < 20; rep++) {
            const double t0 = seconds();
            for (int pass = 0; pass < 20; pass++)
                for (int j = 0; j + ways[w].rows <= ROWS; j += ways[w].rows) ways[w].tile(codes + (int64_t)j * K);
            const double t = seconds() - t0;
            best = t < best ? t : best;
        }
        printf("  %-26s %d rows  %5.1f\n", ways[w].name, ways[w].rows, 20.0 * ROWS * K / best / 1e9);
    }
    return 0;
}
