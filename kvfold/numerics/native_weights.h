/* kvfold native kernels: matmuls that read weights in their checkpoint formats.
 *
 * A kv_weights describes a stack of [n, k] matrices stored as fp32, bf16, FP8 e4m3fn with block
 * scales, or packed FP4 e2m1 (low nibble = even column) with 1 x bc scales, as quant.py describes
 * them. The weights stay in that format: a decode row decodes 16 weights at a time in registers
 * inside the dot product, and so do up to KV_REGISTER_ROWS rows (tiles of 4 or 2 rows share each
 * decoded group); more rows decode a panel of columns at a time into a buffer of the thread's own.
 *
 * Exactness, by construction: every decoder yields exactly the float32 value quant.py's
 * dequantizers write, the code's value (exact in float32) times its block's scale, one IEEE
 * multiplication. The dot product over the decoded row is then native_dot.h's `dot`, whose
 * sequence of roundings depends on k only. So every output equals kv_matmul's over the
 * dequantized fp32 weights, bit for bit, whichever path (one row, a panel), thread or tile
 * computes it.
 *
 * Decoding, with AVX2 and F16C: e4m3fn and e2m1 codes are rewritten as IEEE half-precision bit
 * patterns and widened by the hardware's half-to-single conversion, which is exact and treats
 * subnormal halves as numbers whatever MXCSR's denormals-are-zero bit says.
 *   e4m3fn s.eeee.mmm -> half s.0eeee.mmm0000000 = value * 2^-8 (normal and subnormal alike,
 *                       since half's exponent bias is 8 more); the NaN code s.1111.111 gets a
 *                       half NaN. The block's multiplier is 2^8 * scale (see block_factor).
 *   e2m1 codes        -> half high bytes from a 16-entry table (0, 0.5, ..., 6 and their
 *                       negatives; code 8, "-0", is +0 as in quant.py's table), low bytes 0.
 *   bf16              -> float32 bits = bf16 bits << 16.
 * A decode row (one x) takes two shorter ways, exact for the same reason:
 *   e2m1              -> the 16 values times the block's scale, as a table a block, indexed by code
 *                       (AVX2: the 8 magnitudes, signed by the code's bit 3, where e2m1_rows_exact);
 *   e4m3fn, e8m0 scale blocks of 16+ rows -> float32 bits of value * 2^-120, against x multiplied
 *                       once a block row by 2^120 * scale wherever that product is exact, so the
 *                       fused multiply-add sees the exact product x * value * scale either way
 *                       (fold_fp8_scales says when it may; a block where a row holds a subnormal
 *                       code, a float32 subnormal operand there, decodes through halves instead).
 * With AVX-512 the tile's folded FP8 and bf16 loops hold two rows' 8 lanes in one register
 * (KV_ROW_PAIRS): each lane's operations and order are the same, so are the bits.
 */
#ifndef KV_NATIVE_WEIGHTS_H
#define KV_NATIVE_WEIGHTS_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "native_dot.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KV_DECODE_IN_REGISTERS 1 /* one row decodes in registers; without, it decodes a panel too */
#else
#define KV_DECODE_IN_REGISTERS 0
#endif

/* A block's FP4 decode-row table: its e2m1 values times the block's scale, each entry the IEEE
 * multiplication quant.py does. AVX-512VL holds all 16 (codes 0-7, 8-15) for one two-table
 * permute; AVX2 holds the 8 magnitudes (codes 0-7) and takes bit 3 of a code as its sign, which is
 * exact where e2m1_rows_exact says. */
#if defined(__AVX512VL__)
#define E2M1_TABLES 2
#else
#define E2M1_TABLES 1
#endif

/* How far ahead of a decode tile its prefetches reach, in bytes of the matrix in memory order: a
 * sixteenth of the L2 cache this CPU reports, within [32, 128] KiB (64 KiB where it reports none),
 * so what is asked for stays in L2 until the tile gets there. Set once when the library loads. On
 * a 2-core Zen 4 (1 MiB L2) 32 to 128 KiB decoded equally fast, 16 KiB slower (bench/RESULTS.md). */
static int64_t kv_prefetch_ahead = 65536;
__attribute__((constructor)) static void kv_prefetch_ahead_init(void) {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    const int64_t ahead = l2 > 0 ? (int64_t)l2 / 16 : 65536;
    kv_prefetch_ahead = ahead < 32768 ? 32768 : ahead > 131072 ? 131072 : ahead;
}

/* A decode tile of n rows (contiguous, starting at `tile`) that has read `off` bytes of each row
 * asks for the next n lines of the matrix in memory order, kv_prefetch_ahead bytes on, into L2
 * (locality 2: prefetcht1 on x86); called once per 64 bytes of a row. The tile's rows stream from
 * DRAM as n streams a row apart, each crossing a 4 KiB page every few tiles: the hardware
 * prefetcher alone kept one Zen 4 core at 17-18 GB/s on such tiles where one stream reads 27-29, and
 * asking for the tile after next row by row did no better (bench/RESULTS.md). A prefetch loads
 * nothing into a register and never faults, so no result changes. */
static inline void prefetch_tile(const void *tile, int64_t off, int n) {
    const char *at = (const char *)tile + n * off + kv_prefetch_ahead;
    for (int c = 0; c < n; c++) __builtin_prefetch(at + 64 * c, 0, 2);
}

enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8 = 2, KV_FP4 = 3 };

typedef struct {
    int64_t fmt;          /* KV_F32, KV_BF16, KV_FP8, KV_FP4 */
    int64_t scale_f32;    /* scales are float32 multipliers (else e8m0 exponent bytes) */
    const void *data;     /* matrix 0, row-major; matrix e at data + e * data_stride bytes */
    const void *scale;    /* matrix 0's [ceil(n / br), ceil(k / bc)] scales; NULL for fp32, bf16 */
    int64_t br, bc;       /* scale block: br rows x bc columns, bc a multiple of 8 */
    int64_t k;            /* columns (logical values per row) */
    int64_t data_stride;  /* bytes from one matrix to the next */
    int64_t scale_stride; /* scale entries from one matrix to the next */
    int64_t row_phase;    /* the matrix starts this many rows into its first scale block */
    int64_t nan_codes;    /* FP8: whether any code is a NaN (0x7F / 0xFF), which the fast decoder skips */
    const uint8_t *subnormal_blocks; /* FP8: matrix 0's [n, ceil(k / bc)] flags, 1 where that row's column block
                                      * holds a subnormal code (tile_subnormal); NULL when none does */
    int64_t subnormal_stride;        /* flags from one matrix to the next */
    /* A stack whose matrices lie apart (each expert's tensors where the checkpoint file has them,
     * mapped and read in place): matrix e is `pieces` row pieces of piece_rows rows each, piece p's
     * codes at piece_data[e * pieces + p], its scales at piece_scale[...] (row 0 of the piece starts
     * a scale block) and its subnormal flags at piece_subnormal[...] (NULL: none). piece_data NULL:
     * the matrices are `data_stride` apart, as above. */
    const void *const *piece_data;
    const void *const *piece_scale;
    const uint8_t *const *piece_subnormal;
    int64_t pieces, piece_rows;
    int64_t dot;          /* KV_DOT_F32: native_dot.h's dot; KV_DOT_BF16: native_bf16dot.h's (x and w rounded to bf16) */
} kv_weights;

static inline int64_t weights_row_bytes(const kv_weights *w) {
    switch (w->fmt) {
    case KV_F32: return 4 * w->k;
    case KV_BF16: return 2 * w->k;
    case KV_FP8: return w->k;
    default: return w->k / 2;
    }
}

/* e8m0 exponent byte -> 2^(e - 127) (e = 0: the float32 subnormal 2^-127; e = 255: NaN) */
static inline float e8m0_value(uint8_t e) {
    if (e == 255) return NAN;
    uint32_t bits = e ? (uint32_t)e << 23 : 1u << 22;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* where matrix-local row j's scales start (its block row), in scale entries */
static inline int64_t scale_row(const kv_weights *w, int64_t j) {
    return ((w->row_phase + j) / w->br) * ((w->k + w->bc - 1) / w->bc);
}

/* scale entry `at` as a multiplier */
static inline float scale_at(const kv_weights *w, const void *scale, int64_t at) {
    return w->scale_f32 ? ((const float *)scale)[at] : e8m0_value(((const uint8_t *)scale)[at]);
}

/* the scale of matrix-local row j, column block b */
static inline float weights_scale(const kv_weights *w, const void *scale, int64_t j, int64_t b) {
    return scale_at(w, scale, scale_row(w, j) + b);
}

static const float E2M1_VALUES[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                      0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline float e4m3_value(uint8_t b) {
    int em = b & 0x7f, e = em >> 3, m = em & 7;
    if (em == 0x7f) return NAN;
    float v = e ? ldexpf((float)(8 + m), e - 10) : ldexpf((float)m, -9);
    return b & 0x80 ? -v : v;
}

/* value i of a row (without its block scale) */
static inline float code_value(int64_t fmt, const uint8_t *row, int64_t i) {
    switch (fmt) {
    case KV_F32: { float f; memcpy(&f, row + 4 * i, 4); return f; }
    case KV_BF16: { uint16_t h; memcpy(&h, row + 2 * i, 2); uint32_t u = (uint32_t)h << 16; float f;
                    memcpy(&f, &u, 4); return f; }
    case KV_FP8: return e4m3_value(row[i]);
    default: return E2M1_VALUES[(row[i / 2] >> (4 * (i & 1))) & 0xF];
    }
}

static inline int scaled(int64_t fmt) { return fmt == KV_FP8 || fmt == KV_FP4; }

#if KV_DECODE_IN_REGISTERS
/* The vector decoders. Each yields code values times a per-format factor that the block's
 * multiplier (`block_factor`) takes back: e4m3 codes come out as their halves (value * 2^-8) and
 * are multiplied by 2^8 * scale, which equals value * scale bit for bit since 2^8 * scale is
 * exact (blocks where it would overflow take `weight_value` instead: `block_factor` returns 0). */
static inline __m256 bf16x8(const uint8_t *row, int64_t i) {
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

/* 16 e4m3 codes -> two vectors of halves: sign-extended to 16 bits, s.eeee.mmm sits at bits 15..7
 * after a shift by 7 with a copy of s at bit 14, which the mask clears. NaN codes (0x7F, 0xFF) need
 * `fp8_nan_fix` too; `nan_codes` in the descriptor says whether a matrix has any. */
static inline void e4m3x16(const uint8_t *row, int64_t i, int nan_codes, __m256 *lo, __m256 *hi) {
    __m128i b = _mm_loadu_si128((const __m128i *)(row + i));
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16((short)0xBF80));
    if (nan_codes) { /* a half NaN where the code's 7 low bits are all ones */
        __m256i em = _mm256_and_si256(_mm256_cvtepu8_epi16(b), _mm256_set1_epi16(0x7F));
        h = _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi16(em, _mm256_set1_epi16(0x7F)),
                                                _mm256_set1_epi16(0x7E00)));
    }
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

/* 16 e2m1 codes (8 bytes, low nibble first) -> two vectors of their values: half high bytes from a
 * 16-entry table */
static inline void e2m1x16(const uint8_t *row, int64_t i, __m256 *lo, __m256 *hi) {
    const __m128i table = _mm_setr_epi8(0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46, 0x00, (char)0xB8,
                                        (char)0xBC, (char)0xBE, (char)0xC0, (char)0xC2, (char)0xC4, (char)0xC6);
    __m128i b = _mm_loadl_epi64((const __m128i *)(row + i / 2)), low = _mm_set1_epi8(0x0F);
    __m128i nibbles = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
    __m128i v = _mm_shuffle_epi8(table, nibbles);
    *lo = _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), v));
    *hi = _mm256_cvtph_ps(_mm_unpackhi_epi8(_mm_setzero_si128(), v));
}

/* 16 values from value i (e4m3 as halves), before the block factor */
static inline void codes16(int64_t fmt, int nan_codes, const uint8_t *row, int64_t i, __m256 *lo, __m256 *hi) {
    if (fmt == KV_FP8) {
        e4m3x16(row, i, nan_codes, lo, hi);
    } else if (fmt == KV_FP4) {
        e2m1x16(row, i, lo, hi);
    } else {
        *lo = bf16x8(row, i);
        *hi = bf16x8(row, i + LANES);
    }
}

/* what a block's decoded codes are multiplied by: the scale (FP4), 2^8 * scale (FP8); 0 when that
 * product would overflow where the scale does not (the block then decodes value by value) */
static inline float block_factor(int64_t fmt, float scale) {
    if (fmt != KV_FP8) return scale;
    float f = scale * 256.0f;
    return isinf(f) && !isinf(scale) ? 0.0f : f;
}

/* FP8 e4m3fn codes i .. i+7 of a row -> float32 bits of value * 2^-120: the sign to bit 31, the 7
 * magnitude bits to 26..20, so a normal code's exponent reads e + 120 - 127 and a subnormal code
 * (e = 0) becomes the float32 subnormal of the same scaled value. Exact for every non-NaN code, but
 * its subnormals are numbers only while MXCSR's denormals-are-zero bit is clear (fp8_folds). */
static inline __m256 e4m3x8_scaled_down(const uint8_t *row, int64_t i) {
    __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + i)));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(v, 20), _mm256_set1_epi32((int)0x87FFFFFF)));
}

/* AVX2's one-table FP4 rows give every weight quant.py's value, bit for bit, for e8m0 scales (powers
 * of two, so table[m] = value * scale is exact or overflows, and -(v * s) is (-v) * s) on a thread
 * that rounds to nearest (MXCSR's rounding bits 13-14 clear): an overflow is then inf for either
 * sign, and code 8, +0 in quant.py's table, comes out -0 + 0 = +0. Blocks with a NaN scale go value
 * by value (the NaN's sign); other matrices and threads decode a panel. */
static inline int e2m1_rows_exact(const kv_weights *w) {
    return E2M1_TABLES == 2 || (!w->scale_f32 && !(_mm_getcsr() & 0x6000));
}

/* 8 e2m1 codes from value i (4 bytes, low nibble first) -> their entries of a block's table: each
 * lane shifts its own nibble down, and the permutes read only an index's low 3 bits (AVX-512's
 * two-table form the 4th bit too), so no mask is needed. */
static inline __m256 e2m1x8_lookup(const uint8_t *row, int64_t i, const __m256 *table) {
    int32_t four;
    memcpy(&four, row + i / 2, 4);
    __m256i codes = _mm256_srlv_epi32(_mm256_set1_epi32(four), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
#if E2M1_TABLES == 2
    return _mm256_permutex2var_ps(table[0], codes, table[1]);
#else /* the magnitude, bit 3 of the code shifted up to the sign bit, and -0 (code 8) made +0 */
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(codes, 28), _mm256_set1_epi32(INT32_MIN));
    const __m256 signed_value = _mm256_xor_ps(_mm256_permutevar8x32_ps(table[0], codes), _mm256_castsi256_ps(sign));
    return _mm256_add_ps(signed_value, _mm256_setzero_ps());
#endif
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define KV_ROW_PAIRS 1
/* Two rows' 8-lane accumulators side by side in one 512-bit register (lanes 0-7 row c's, 8-15 row
 * c+1's), against x's 8 values in both halves. Each lane still takes its own row's multiply-adds
 * in the same order, so every output's roundings stay native_dot.h's 8-lane dot on any machine;
 * an instruction only decodes and multiplies the weights of two rows at once. */
static inline __m512 pair_of(__m256 a, __m256 b) { return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1); }
static inline __m256 pair_hi(__m512 p) { return _mm512_extractf32x8_ps(p, 1); }
static inline __m512 x_pair(const float *x) { return _mm512_broadcast_f32x8(_mm256_loadu_ps(x)); }

/* e4m3x8_scaled_down of rows a and b at value i */
static inline __m512 e4m3x8_scaled_down_pair(const uint8_t *a, const uint8_t *b, int64_t i) {
    const __m128i two = _mm_castpd_si128(_mm_loadh_pd(_mm_castsi128_pd(_mm_loadl_epi64((const __m128i *)(a + i))),
                                                      (const double *)(b + i)));
    const __m512i v = _mm512_slli_epi32(_mm512_cvtepi8_epi32(two), 20);
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0x87FFFFFF)));
}

/* bf16x8 of rows a and b at value i */
static inline __m512 bf16x8_pair(const uint8_t *a, const uint8_t *b, int64_t i) {
    const __m256i two = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(a + 2 * i))),
                                                _mm_loadu_si128((const __m128i *)(b + 2 * i)), 1);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(two), 16));
}

/* a tile's accumulators as pairs and back (exact: only moves) */
#define TO_PAIRS(NR)   for (int p = 0; p < (NR) / 2; p++) pair[p] = pair_of(acc[2 * p], acc[2 * p + 1]);
#define FROM_PAIRS(NR) for (int p = 0; p < (NR) / 2; p++) { acc[2 * p] = _mm512_castps512_ps256(pair[p]); \
                                                            acc[2 * p + 1] = pair_hi(pair[p]); }
#else
#define KV_ROW_PAIRS 0
#endif

/* Whether a folded FP8 tile's rows j0 .. j0+nr-1 (rows_flags: row j0's flags, `blocks` a row) hold
 * a subnormal code in column block blk. Such a code becomes a float32 subnormal in
 * e4m3x8_scaled_down, and Intel cores take a microcode assist (about a hundred cycles) for each
 * multiply-add with a subnormal operand; the tile then decodes that block through halves (always
 * normal floats) and the block factor instead, which gives each fused multiply-add the same exact
 * product (see the header), so no result changes. */
static inline int tile_subnormal(const uint8_t *rows_flags, int64_t blocks, int nr, int64_t blk) {
    if (!rows_flags) return 0;
    for (int c = 0; c < nr; c++)
        if (rows_flags[c * blocks + blk]) return 1;
    return 0;
}

/* The row tile's two hottest loops with rows in pairs (KV_ROW_PAIRS): a folded FP8 block, and a
 * bf16 row's steps of 16. Each leaves i where the 8-lane loop after it would start (that loop then
 * has nothing left to do). Tiles of an odd row count, and machines without AVX-512, keep 8 lanes. */
#if KV_ROW_PAIRS
#define PAIRED_FP8_FOLDED(NR)                                                                         \
    if ((NR) % 2 == 0) {                                                                              \
        __m512 pair[(NR) / 2 + 1];                                                                    \
        TO_PAIRS(NR)                                                                                  \
        for (; i < b1; i += LANES) {                                                                  \
            if ((i & 63) == 0) prefetch_tile(data + j0 * rb, i, NR);                                  \
            const __m512 xv = x_pair(xs + i);                                                         \
            for (int p = 0; p < (NR) / 2; p++)                                                        \
                pair[p] = _mm512_fmadd_ps(xv, e4m3x8_scaled_down_pair(data + (j0 + 2 * p) * rb,       \
                                                                      data + (j0 + 2 * p + 1) * rb, i), pair[p]); \
        }                                                                                             \
        FROM_PAIRS(NR)                                                                                \
    }
#define PAIRED_BF16(NR)                                                                               \
    if ((NR) % 2 == 0) {                                                                              \
        __m512 pair[(NR) / 2 + 1];                                                                    \
        TO_PAIRS(NR)                                                                                  \
        for (; i + 2 * LANES <= b1; i += 2 * LANES) {                                                 \
            const __m512 x0 = x_pair(x + i), x1 = x_pair(x + i + LANES);                              \
            if (i % values_per_line == 0) prefetch_tile(data + j0 * rb, i * rb / k, NR);              \
            for (int p = 0; p < (NR) / 2; p++) {                                                      \
                const uint8_t *a = data + (j0 + 2 * p) * rb, *b = a + rb;                             \
                pair[p] = _mm512_fmadd_ps(x0, bf16x8_pair(a, b, i), pair[p]);                         \
                pair[p] = _mm512_fmadd_ps(x1, bf16x8_pair(a, b, i + LANES), pair[p]);                 \
            }                                                                                         \
        }                                                                                             \
        FROM_PAIRS(NR)                                                                                \
    }
#else
#define PAIRED_FP8_FOLDED(NR)
#define PAIRED_BF16(NR)
#endif

/* the FP4 tables of columns srow[0 .. nc) at column block blk (e2m1x8_lookup), from the block's
 * scale s: each entry E2M1_VALUES[m] * s, one IEEE multiplication as quant.py's */
static inline __attribute__((always_inline)) void fp4_table(float s, __m256 *table) {
    for (int t = 0; t < E2M1_TABLES; t++)
        table[t] = _mm256_mul_ps(_mm256_loadu_ps(E2M1_VALUES + t * LANES), _mm256_set1_ps(s));
}

/* as fp4_table for columns srow[0 .. nc) at block blk, each scale read on its own; 0 where a scale
 * is NaN (the block then goes value by value) */
static inline __attribute__((always_inline)) int fp4_tables(const kv_weights *w, const void *scale, const int64_t *srow, int nc, int64_t blk,
                             __m256 table[][E2M1_TABLES]) {
    int numbers = 1;
    for (int c = 0; c < nc; c++) {
        const float s = scale_at(w, scale, srow[c] + blk);
        numbers &= !isnan(s);
        fp4_table(s, table[c]);
    }
    return numbers;
}

/* The e8m0 scales of columns srow[0 .. nc) at blocks blk .. blk+15 as float32, into s[c][0 .. 16):
 * e8m0_value's values, widened 16 at a time instead of a byte-to-float conversion a block (on a
 * 2-core Zen 4 that conversion was a third of an FP4 decode row's instructions: bench/RESULTS.md).
 * Returns 0, and the blocks read their scales one by one (fp4_tables), where the scales are floats,
 * a NaN byte (255) is among them, or the machine lacks AVX-512BW's masked byte loads; the masked
 * load reads no byte past the row's last block. */
#define FP4_SCALE_RUN 16
static inline __attribute__((always_inline)) int fp4_scales_run(const kv_weights *w, const void *scale, const int64_t *srow, int nc, int64_t blk,
                                 float s[][FP4_SCALE_RUN]) {
#if E2M1_TABLES == 2 && defined(__AVX512BW__)
    if (w->scale_f32) return 0;
    const int64_t left = (w->k + w->bc - 1) / w->bc - blk;
    const __mmask16 live = (__mmask16)(left >= FP4_SCALE_RUN ? 0xFFFF : (1u << left) - 1);
    for (int c = 0; c < nc; c++) {
        const __m128i e = _mm_maskz_loadu_epi8(live, (const uint8_t *)scale + srow[c] + blk);
        if (_mm_mask_cmpeq_epi8_mask(live, e, _mm_set1_epi8(-1))) return 0;
        const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu8_epi32(e), 23); /* 2^(e - 127) for e in 1 .. 254 */
        const __mmask16 zero = _mm512_cmpeq_epi32_mask(bits, _mm512_setzero_si512()); /* e = 0: 2^-127 */
        _mm512_storeu_si512(s[c], _mm512_mask_mov_epi32(bits, zero, _mm512_set1_epi32(1 << 22)));
    }
    return 1;
#else
    (void)w, (void)scale, (void)srow, (void)nc, (void)blk, (void)s;
    return 0;
#endif
}

/* the tables of nc columns at block blk: from the run of scales read at the run's first block
 * (fp4_scales_run, *run says whether it could), else one scale at a time; 0 where a scale is NaN */
static inline __attribute__((always_inline)) int fp4_block_tables(const kv_weights *w, const void *scale, const int64_t *srow, int nc, int64_t blk,
                                   float s[][FP4_SCALE_RUN], int *run, __m256 table[][E2M1_TABLES]) {
    if (blk % FP4_SCALE_RUN == 0) *run = fp4_scales_run(w, scale, srow, nc, blk, s);
    if (!*run) return fp4_tables(w, scale, srow, nc, blk, table);
    for (int c = 0; c < nc; c++) fp4_table(s[c][blk % FP4_SCALE_RUN], table[c]);
    return 1;
}

/* the block factors of columns srow[0 .. nc) at column block blk (1 unscaled); 0 where one would
 * overflow (block_factor: the block then goes value by value) */
static inline int block_factors(int64_t fmt, const kv_weights *w, const void *scale, const int64_t *srow, int nc,
                                int64_t blk, __m256 *f) {
    int exact = 1;
    for (int c = 0; c < nc; c++) {
        const float fc = scaled(fmt) ? block_factor(fmt, scale_at(w, scale, srow[c] + blk)) : 1.0f;
        exact &= fc != 0.0f || !scaled(fmt);
        f[c] = _mm256_set1_ps(fc);
    }
    return exact;
}

/* outputs j0 .. j0+NR-1 of one row x, for a matrix of format FMT: native_dot.h's dot_tile_1xNR
 * with the weights decoded in registers (lane j: ascending i = j mod 8 with fused multiply-adds,
 * 16 values a step as two consecutive steps of 8, then the halving sum and the scalar tail).
 * FP8 only: where folded[blk] is set, the block's values are xs = x * 2^120 * scale (every product
 * exact, fold_fp8_scales) and its weights e4m3x8_scaled_down's, so each fused multiply-add sees the
 * exact product x * (value * scale) that it sees on the dequantized weight, with no multiply per
 * weight. FP4: each block's values times its scale are a table the codes index (e2m1x8_lookup),
 * so every weight is its value (AVX2: where e2m1_rows_exact). */
#define WEIGHTS_ROW_TILE(NAME, FMT, NR)                                                               \
    static void weights_row_##NAME##_##NR(const float *x, const kv_weights *w, const uint8_t *data,  \
                                          const void *scale, int64_t j0, float *out, const float *xs, \
                                          const uint8_t *folded, const uint8_t *subnormal) {          \
        const int64_t k = w->k, k8 = k - k % LANES, bc = scaled(FMT) ? w->bc : (k8 ? k8 : 1);        \
        const int64_t rb = weights_row_bytes(w);                                                      \
        const int nan_codes = (int)w->nan_codes;                                                      \
        const int64_t blocks = subnormal ? (k + bc - 1) / bc : 0; /* no division where none is read */ \
        const uint8_t *rows_flags = subnormal ? subnormal + j0 * blocks : NULL;                       \
        /* values of a row in one 64-byte cache line: a constant of the format, so `%` is a mask */  \
        const int64_t values_per_line = (FMT) == KV_FP4 ? 128 : (FMT) == KV_FP8 ? 64 : 32;            \
        __m256 acc[NR];                                                                               \
        int64_t srow[NR];                                                                             \
        float run_scales[NR][FP4_SCALE_RUN]; /* FP4: fp4_block_tables */                              \
        int run = 0;                                                                                  \
        for (int c = 0; c < NR; c++) {                                                                \
            acc[c] = _mm256_setzero_ps();                                                             \
            srow[c] = scaled(FMT) ? scale_row(w, j0 + c) : 0;                                         \
        }                                                                                             \
        for (int64_t b0 = 0, blk = 0; b0 < k8; b0 += bc, blk++) {                                     \
            int64_t b1 = b0 + bc < k8 ? b0 + bc : k8, i = b0;                                         \
            if ((FMT) == KV_FP8 && folded && folded[blk] && !tile_subnormal(rows_flags, blocks, NR, blk)) { \
                PAIRED_FP8_FOLDED(NR)                                                                 \
                for (; i < b1; i += LANES) {                                                          \
                    if ((i & 63) == 0) prefetch_tile(data + j0 * rb, i, NR);                          \
                    const __m256 xv = _mm256_loadu_ps(xs + i);                                        \
                    for (int c = 0; c < NR; c++)                                                      \
                        acc[c] = _mm256_fmadd_ps(xv, e4m3x8_scaled_down(data + (j0 + c) * rb, i), acc[c]); \
                }                                                                                     \
                continue;                                                                             \
            }                                                                                         \
            if ((FMT) == KV_FP4) {                                                                    \
                __m256 table[NR][E2M1_TABLES];                                                        \
                const int numbers = fp4_block_tables(w, scale, srow, NR, blk, run_scales, &run, table); \
                for (; !numbers && i < b1; i += LANES) /* a NaN scale: value by value */              \
                    for (int c = 0; c < NR; c++) acc[c] = value_step(x, w, data, scale, j0 + c, i, acc[c]); \
                for (; i < b1; i += LANES) {                                                          \
                    if ((i & 127) == 0) prefetch_tile(data + j0 * rb, i / 2, NR);                     \
                    const __m256 xv = _mm256_loadu_ps(x + i);                                         \
                    for (int c = 0; c < NR; c++)                                                      \
                        acc[c] = _mm256_fmadd_ps(xv, e2m1x8_lookup(data + (j0 + c) * rb, i, table[c]), acc[c]); \
                }                                                                                     \
                continue;                                                                             \
            }                                                                                         \
            __m256 f[NR];                                                                             \
            const int exact = block_factors(FMT, w, scale, srow, NR, blk, f);                         \
            if (!exact) { /* 2^8 * scale overflows: value by value, the same operations */            \
                for (; i < b1; i += LANES)                                                            \
                    for (int c = 0; c < NR; c++) acc[c] = value_step(x, w, data, scale, j0 + c, i, acc[c]); \
                continue;                                                                             \
            }                                                                                         \
            if ((FMT) == KV_BF16) { PAIRED_BF16(NR) }                                                 \
            for (; i + 2 * LANES <= b1; i += 2 * LANES) {                                             \
                __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + LANES);              \
                if (i % values_per_line == 0) /* the matrix's lines ahead: prefetch_tile */           \
                    prefetch_tile(data + j0 * rb, i * rb / k, NR);                                    \
                for (int c = 0; c < NR; c++) {                                                        \
                    __m256 lo, hi;                                                                    \
                    codes16(FMT, nan_codes, data + (j0 + c) * rb, i, &lo, &hi);                       \
                    if (scaled(FMT)) { lo = _mm256_mul_ps(lo, f[c]); hi = _mm256_mul_ps(hi, f[c]); }  \
                    acc[c] = _mm256_fmadd_ps(x0, lo, acc[c]);                                         \
                    acc[c] = _mm256_fmadd_ps(x1, hi, acc[c]);                                         \
                }                                                                                     \
            }                                                                                         \
            for (; i < b1; i += LANES) /* a last step of 8 */                                        \
                for (int c = 0; c < NR; c++) acc[c] = value_step(x, w, data, scale, j0 + c, i, acc[c]); \
        }                                                                                             \
        for (int c = 0; c < NR; c++) {                                                                \
            float tail = 0.0f;                                                                        \
            for (int64_t t = k8; t < k; t++)                                                          \
                tail = fmaf(x[t], weight_value(w, data, scale, j0 + c, t), tail);                     \
            out[c] = lanes_sum(acc[c], tail);                                                         \
        }                                                                                             \
    }
#endif

/* the float32 weight at matrix-local row j, column i: quant.py's dequantized value */
static inline float weight_value(const kv_weights *w, const uint8_t *data, const void *scale, int64_t j, int64_t i) {
    float v = code_value(w->fmt, data + j * weights_row_bytes(w), i);
    return scaled(w->fmt) ? v * weights_scale(w, scale, j, i / w->bc) : v;
}

/* row j of the matrix, decoded into dst[k] */
static void decode_row(const kv_weights *w, const uint8_t *data, const void *scale, int64_t j, float *dst) {
    int64_t i = 0;
#if KV_DECODE_IN_REGISTERS
    const uint8_t *row = data + j * weights_row_bytes(w);
#if E2M1_TABLES == 2
    if (w->fmt == KV_FP4) { /* each block's table (its 16 values times its scale, fp4_table): 8 values a lookup */
        const int64_t srow = scale_row(w, j), k8 = w->k - w->k % LANES;
        for (int64_t b0 = 0; b0 < k8; b0 += w->bc) {
            __m256 table[E2M1_TABLES];
            fp4_table(scale_at(w, scale, srow + b0 / w->bc), table);
            const int64_t b1 = b0 + w->bc < k8 ? b0 + w->bc : k8;
            for (i = b0; i < b1; i += LANES) _mm256_storeu_ps(dst + i, e2m1x8_lookup(row, i, table));
        }
        for (; i < w->k; i++) dst[i] = weight_value(w, data, scale, j, i);
        return;
    }
#endif
    const int64_t bc = scaled(w->fmt) ? w->bc : 2 * LANES, srow = scaled(w->fmt) ? scale_row(w, j) : 0;
    if (bc % (2 * LANES) == 0)
        for (; i + 2 * LANES <= w->k; i += 2 * LANES) {
            float f = scaled(w->fmt) ? block_factor(w->fmt, scale_at(w, scale, srow + i / bc)) : 1.0f;
            if (f == 0.0f) {
                for (int l = 0; l < 2 * LANES; l++) dst[i + l] = weight_value(w, data, scale, j, i + l);
                continue;
            }
            __m256 lo, hi;
            codes16(w->fmt, (int)w->nan_codes, row, i, &lo, &hi);
            if (scaled(w->fmt)) { lo = _mm256_mul_ps(lo, _mm256_set1_ps(f)); hi = _mm256_mul_ps(hi, _mm256_set1_ps(f)); }
            _mm256_storeu_ps(dst + i, lo);
            _mm256_storeu_ps(dst + i + LANES, hi);
        }
#endif
    for (; i < w->k; i++) dst[i] = weight_value(w, data, scale, j, i);
}

#if KV_DECODE_IN_REGISTERS
/* one step of 8 of row j from value i, the weights decoded one by one: acc + x[i..i+8) * w */
static inline __m256 value_step(const float *x, const kv_weights *w, const uint8_t *data, const void *scale,
                                int64_t j, int64_t i, __m256 acc) {
    float v[LANES];
    for (int l = 0; l < LANES; l++) v[l] = weight_value(w, data, scale, j, i + l);
    return _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(v), acc);
}

WEIGHTS_ROW_TILE(bf16, KV_BF16, 1)
WEIGHTS_ROW_TILE(bf16, KV_BF16, 4)
WEIGHTS_ROW_TILE(fp8, KV_FP8, 1)
WEIGHTS_ROW_TILE(fp8, KV_FP8, 4)
WEIGHTS_ROW_TILE(fp4, KV_FP4, 1)
WEIGHTS_ROW_TILE(fp4, KV_FP4, 4)

#if E2M1_TABLES == 2 && defined(__AVX512BW__)
/* weights_row_fp4_4 (R = 1) and weights_rows_fp4_Rx4 (R = 2, 4 rows of x, row r at x + r ldx, into
 * out + r ldo) for the releases' FP4 layout (e8m0 scales on 1 x 32 blocks, k a multiple of 32),
 * with the same operations in the same order, so the same bits: lane j of each output takes
 * ascending i = j mod 8 with fused multiply-adds of its row of x against the block's table
 * entries (fp4_table: E2M1_VALUES[m] * scale), then the halving sum plus the +0 tail of k8 == k.
 * What differs is only the control: the scales are widened 16 blocks at a time (fp4_scales_run)
 * and each block's four steps of 8 run as straight-line code, which the generic tiles' per-block
 * branches (NaN scales, folded FP8, block factors) kept from their registers: 1.7-1.8x the decode
 * rate on a Zen 4 (bench/RESULTS.md). Returns 0, having written nothing (the sums are its own
 * until the end), where a run of scales holds a NaN (255, fp4_scales_run); the generic tile then
 * takes the tile, value by value in those blocks. */
#define FP4_TILE_E8M0(R)                                                                              \
    static int fp4_tile_e8m0_##R(const float *x, int64_t ldx, const kv_weights *w, const uint8_t *data, \
                                 const void *scale, int64_t j0, float *out, int64_t ldo) {            \
        const int64_t k = w->k, rb = k / 2, blocks = k / 32;                                          \
        const uint8_t *row[4];                                                                        \
        int64_t srow[4];                                                                              \
        for (int c = 0; c < 4; c++) {                                                                 \
            row[c] = data + (j0 + c) * rb;                                                            \
            srow[c] = scale_row(w, j0 + c);                                                           \
        }                                                                                             \
        __m256 acc[R][4];                                                                             \
        for (int r = 0; r < (R); r++)                                                                 \
            for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();                              \
        float s[4][FP4_SCALE_RUN];                                                                    \
        for (int64_t b = 0; b < blocks; b++) {                                                        \
            if (b % FP4_SCALE_RUN == 0 && !fp4_scales_run(w, scale, srow, 4, b, s)) return 0;          \
            __m256 table[4][2];                                                                       \
            for (int c = 0; c < 4; c++) fp4_table(s[c][b % FP4_SCALE_RUN], table[c]);                \
            const int64_t i0 = 32 * b;                                                                \
            if ((i0 & 127) == 0) prefetch_tile(data + j0 * rb, i0 / 2, 4);                            \
            for (int64_t i = i0; i < i0 + 32; i += LANES) {                                           \
                __m256 xv[R];                                                                         \
                for (int r = 0; r < (R); r++) xv[r] = _mm256_loadu_ps(x + r * ldx + i);               \
                for (int c = 0; c < 4; c++) {                                                         \
                    const __m256 wv = e2m1x8_lookup(row[c], i, table[c]);                             \
                    for (int r = 0; r < (R); r++) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);  \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        for (int r = 0; r < (R); r++)                                                                 \
            for (int c = 0; c < 4; c++) out[r * ldo + c] = lanes_sum(acc[r][c], 0.0f);                \
        return 1;                                                                                     \
    }
FP4_TILE_E8M0(1)
FP4_TILE_E8M0(2)
FP4_TILE_E8M0(4)
#define FP4_ROW_TILE_E8M0(w) (!(w)->scale_f32 && (w)->bc == 32 && (w)->k % 32 == 0)
#else
#define FP4_ROW_TILE_E8M0(w) 0
#endif

/* outputs j0 .. j0+NC-1 of R rows of x (row r at x + r ldx, into out + r ldo), for a matrix of
 * format FMT, the weights decoded in registers once for all R rows: each output is
 * weights_row_*'s and native_dot.h's dot (lane j: ascending i = j mod 8 with fused multiply-adds,
 * 16 values a step as two consecutive steps of 8, then the halving sum and the scalar tail). FP8:
 * a block where every row's x is folded (xs, R rows of k; folded, R rows of a flag a column block:
 * fold_fp8_scales) and no row of the tile holds a subnormal code reads e4m3x8_scaled_down's
 * weights against xs, as a decode row does; other blocks decode through halves and the block
 * factor. Either way each fused multiply-add sees the same exact product (see the header). FP4
 * indexes each block's table as a decode row does (where e2m1_rows_exact). */
#define WEIGHTS_ROWS_TILE(NAME, FMT, R, NC)                                                           \
    static void weights_rows_##NAME##_##R##x##NC(const float *x, int64_t ldx, const kv_weights *w,   \
                                                 const uint8_t *data, const void *scale, int64_t j0,   \
                                                 float *out, int64_t ldo, const float *xs,             \
                                                 const uint8_t *folded, const uint8_t *subnormal) {    \
        const int64_t k = w->k, k8 = k - k % LANES, bc = scaled(FMT) ? w->bc : (k8 ? k8 : 1);        \
        const int64_t rb = weights_row_bytes(w);                                                      \
        const int nan_codes = (int)w->nan_codes;                                                      \
        const int64_t blocks = (k + bc - 1) / bc; /* flags a row: folded (R rows), subnormal */       \
        const uint8_t *rows_flags = subnormal ? subnormal + j0 * blocks : NULL;                       \
        const int64_t values_per_line = (FMT) == KV_FP4 ? 128 : (FMT) == KV_FP8 ? 64 : 32;            \
        __m256 acc[R][NC];                                                                            \
        int64_t srow[NC];                                                                             \
        float run_scales[NC][FP4_SCALE_RUN]; /* FP4: fp4_block_tables */                              \
        int run = 0;                                                                                  \
        for (int c = 0; c < NC; c++) {                                                                \
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_setzero_ps();                              \
            srow[c] = scaled(FMT) ? scale_row(w, j0 + c) : 0;                                         \
        }                                                                                             \
        for (int64_t b0 = 0, blk = 0; b0 < k8; b0 += bc, blk++) {                                     \
            int64_t b1 = b0 + bc < k8 ? b0 + bc : k8, i = b0;                                         \
            int all_folded = (FMT) == KV_FP8 && folded != NULL;                                       \
            for (int r = 0; all_folded && r < R; r++) all_folded = folded[r * blocks + blk];          \
            if (all_folded && !tile_subnormal(rows_flags, blocks, NC, blk)) {                         \
                for (; i < b1; i += LANES) {                                                          \
                    __m256 xv[R];                                                                     \
                    if ((i & 63) == 0) prefetch_tile(data + j0 * rb, i, NC);                          \
                    for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(xs + r * k + i);              \
                    for (int c = 0; c < NC; c++) {                                                    \
                        const __m256 wv = e4m3x8_scaled_down(data + (j0 + c) * rb, i);                \
                        for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]); \
                    }                                                                                 \
                }                                                                                     \
                continue;                                                                             \
            }                                                                                         \
            if ((FMT) == KV_FP4) {                                                                    \
                __m256 table[NC][E2M1_TABLES];                                                        \
                const int numbers = fp4_block_tables(w, scale, srow, NC, blk, run_scales, &run, table); \
                for (; !numbers && i < b1; i += LANES) /* a NaN scale: value by value */              \
                    for (int c = 0; c < NC; c++)                                                      \
                        for (int r = 0; r < R; r++)                                                   \
                            acc[r][c] = value_step(x + r * ldx, w, data, scale, j0 + c, i, acc[r][c]); \
                for (; i < b1; i += LANES) {                                                          \
                    __m256 xv[R];                                                                     \
                    if ((i & 127) == 0) prefetch_tile(data + j0 * rb, i / 2, NC);                     \
                    for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(x + r * ldx + i);             \
                    for (int c = 0; c < NC; c++) {                                                    \
                        const __m256 wv = e2m1x8_lookup(data + (j0 + c) * rb, i, table[c]);           \
                        for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]); \
                    }                                                                                 \
                }                                                                                     \
                continue;                                                                             \
            }                                                                                         \
            __m256 f[NC];                                                                             \
            const int exact = block_factors(FMT, w, scale, srow, NC, blk, f);                         \
            if (exact)                                                                                \
                for (; i + 2 * LANES <= b1; i += 2 * LANES) {                                         \
                    __m256 x0[R], x1[R];                                                              \
                    if (i % values_per_line == 0) /* the matrix's lines ahead: prefetch_tile */       \
                        prefetch_tile(data + j0 * rb, i * rb / k, NC);                                \
                    for (int r = 0; r < R; r++) {                                                     \
                        x0[r] = _mm256_loadu_ps(x + r * ldx + i);                                     \
                        x1[r] = _mm256_loadu_ps(x + r * ldx + i + LANES);                             \
                    }                                                                                 \
                    for (int c = 0; c < NC; c++) {                                                    \
                        __m256 lo, hi;                                                                \
                        codes16(FMT, nan_codes, data + (j0 + c) * rb, i, &lo, &hi);                   \
                        if (scaled(FMT)) { lo = _mm256_mul_ps(lo, f[c]); hi = _mm256_mul_ps(hi, f[c]); } \
                        for (int r = 0; r < R; r++) {                                                 \
                            acc[r][c] = _mm256_fmadd_ps(x0[r], lo, acc[r][c]);                        \
                            acc[r][c] = _mm256_fmadd_ps(x1[r], hi, acc[r][c]);                        \
                        }                                                                             \
                    }                                                                                 \
                }                                                                                     \
            for (; i < b1; i += LANES) /* a last step of 8, or 2^8 * scale overflows: value by value */ \
                for (int c = 0; c < NC; c++)                                                          \
                    for (int r = 0; r < R; r++)                                                       \
                        acc[r][c] = value_step(x + r * ldx, w, data, scale, j0 + c, i, acc[r][c]);    \
        }                                                                                             \
        for (int r = 0; r < R; r++)                                                                   \
            for (int c = 0; c < NC; c++) {                                                            \
                float tail = 0.0f;                                                                    \
                for (int64_t t = k8; t < k; t++)                                                      \
                    tail = fmaf(x[r * ldx + t], weight_value(w, data, scale, j0 + c, t), tail);       \
                out[r * ldo + c] = lanes_sum(acc[r][c], tail);                                        \
            }                                                                                         \
    }

#define WEIGHTS_ROWS_TILES(R)                                                                         \
    WEIGHTS_ROWS_TILE(bf16, KV_BF16, R, 4) WEIGHTS_ROWS_TILE(bf16, KV_BF16, R, 1)                     \
    WEIGHTS_ROWS_TILE(fp8, KV_FP8, R, 4) WEIGHTS_ROWS_TILE(fp8, KV_FP8, R, 1)                         \
    WEIGHTS_ROWS_TILE(fp4, KV_FP4, R, 4) WEIGHTS_ROWS_TILE(fp4, KV_FP4, R, 1)
WEIGHTS_ROWS_TILES(2)
WEIGHTS_ROWS_TILES(4)

#endif

#if KV_DECODE_IN_REGISTERS
/* Whether FP8 decode rows of `w` fold their block scales into x (WEIGHTS_ROW_TILE): e8m0 scales
 * (powers of two, so x * 2^120 * scale can be exact), no NaN codes (e4m3x8_scaled_down has none),
 * blocks of at least 16 rows (the fold is paid once a block row), and float32 subnormals read as
 * numbers: MXCSR's denormals-are-zero bit (0x40) clear on this thread. */
static inline int fp8_folds(const kv_weights *w) {
    return w->fmt == KV_FP8 && !w->scale_f32 && !w->nan_codes && w->br >= 16 && w->k >= LANES
        && !(_mm_getcsr() & 0x40);
}

/* xs[i] = x[i] * F for each column block of the scale row starting at entry `srow`, F = 2^120 *
 * scale, and folded[blk] whether every product is exact: F must lie in [2^-126, 2^126] (so 1/F is
 * exact too; NaN fails), and each y = x * F must give x back as y * (1/F), which fails for a
 * product that rounded (a subnormal), overflowed or was flushed to zero, and for a NaN x. */
static void fold_fp8_scales(const float *x, const kv_weights *w, const void *scale, int64_t srow, float *xs,
                            uint8_t *folded) {
    const int64_t k8 = w->k - w->k % LANES, bc = w->bc;
    for (int64_t b0 = 0, blk = 0; b0 < k8; b0 += bc, blk++) {
        const int64_t b1 = b0 + bc < k8 ? b0 + bc : k8;
        const float f = scale_at(w, scale, srow + blk) * 0x1p120f;
        int exact = f >= 0x1p-126f && f <= 0x1p126f;
        if (exact) {
            const __m256 fv = _mm256_set1_ps(f), inv = _mm256_set1_ps(1.0f / f);
            __m256 same = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
            for (int64_t i = b0; i < b1; i += LANES) {
                const __m256 xv = _mm256_loadu_ps(x + i), y = _mm256_mul_ps(xv, fv);
                _mm256_storeu_ps(xs + i, y);
                same = _mm256_and_ps(same, _mm256_cmp_ps(_mm256_mul_ps(y, inv), xv, _CMP_EQ_OQ));
            }
            exact = _mm256_movemask_ps(same) == 0xFF;
        }
        folded[blk] = (uint8_t)exact;
    }
}

/* weights_row_fp8_4 for a matrix whose decode rows do not fold (float32 scales, as GLM-5.3's
 * release stores them; blocks of fewer than 16 rows), with no NaN code, k and the block width
 * multiples of 16: the same operations in the same order, so the same bits (each block's codes
 * as halves times the block factor 2^8 * scale, then per 16 values two fused multiply-adds into
 * lane j's running sum; the halving sum plus the +0 tail of k8 == k), as one straight loop a
 * block. Returns 0, having written nothing, where a block factor of the tile would overflow
 * (block_factor's 0); weights_row_fp8_4 then takes the tile, value by value in that block. */
static int fp8_row_tile_scaled(const float *x, const kv_weights *w, const uint8_t *data, const void *scale,
                               int64_t j0, float *out) {
    const int64_t k = w->k, rb = k, bc = w->bc;
    const uint8_t *row = data + j0 * rb;
    int64_t srow[4];
    for (int c = 0; c < 4; c++) srow[c] = scale_row(w, j0 + c);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b0 = 0, blk = 0; b0 < k; b0 += bc, blk++) {
        __m256 f[4];
        if (!block_factors(KV_FP8, w, scale, srow, 4, blk, f)) return 0;
        const int64_t b1 = b0 + bc < k ? b0 + bc : k; /* the last block may be partial */
        for (int64_t i = b0; i < b1; i += 2 * LANES) {
            if (i % 64 == 0) prefetch_tile(row, i, 4);
            const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + LANES);
            for (int c = 0; c < 4; c++) {
                __m256 lo, hi;
                e4m3x16(row + c * rb, i, 0, &lo, &hi);
                acc[c] = _mm256_fmadd_ps(x0, _mm256_mul_ps(lo, f[c]), acc[c]);
                acc[c] = _mm256_fmadd_ps(x1, _mm256_mul_ps(hi, f[c]), acc[c]);
            }
        }
    }
    for (int c = 0; c < 4; c++) out[c] = lanes_sum(acc[c], 0.0f);
    return 1;
}
#define FP8_ROW_TILE_SCALED(w) (!(w)->nan_codes && (w)->k % 16 == 0 && (w)->bc % 16 == 0)

/* weights_row_fp8_4 where every column block of x folded (all_folded) and no row of the tile holds
 * a subnormal code, k a multiple of 8: the same operations in the same order, so the same bits
 * (lane j of each output: ascending i = j mod 8, fused multiply-adds of xs against
 * e4m3x8_scaled_down's weights; the halving sum plus the +0 tail of k8 == k). Only the control
 * differs: one straight loop over the row, two rows a register with AVX-512 (KV_ROW_PAIRS),
 * instead of the generic tile's per-block branches, which kept its accumulators out of registers
 * (bench/RESULTS.md). Returns 0, having written nothing, where a row of the tile holds a
 * subnormal code; weights_row_fp8_4 then takes the tile. */
static int fp8_row_tile_folded(const kv_weights *w, const uint8_t *data, int64_t j0, float *out, const float *xs,
                               const uint8_t *subnormal) {
    const int64_t k = w->k, rb = k, blocks = (k + w->bc - 1) / w->bc;
    if (subnormal && memchr(subnormal + j0 * blocks, 1, 4 * blocks)) return 0;
    const uint8_t *row = data + j0 * rb;
    __m256 acc[4];
#if KV_ROW_PAIRS
    __m512 pair[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t i = 0; i < k; i += LANES) {
        if ((i & 63) == 0) prefetch_tile(row, i, 4);
        const __m512 xv = x_pair(xs + i);
        pair[0] = _mm512_fmadd_ps(xv, e4m3x8_scaled_down_pair(row, row + rb, i), pair[0]);
        pair[1] = _mm512_fmadd_ps(xv, e4m3x8_scaled_down_pair(row + 2 * rb, row + 3 * rb, i), pair[1]);
    }
    FROM_PAIRS(4)
#else
    for (int c = 0; c < 4; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += LANES) {
        if ((i & 63) == 0) prefetch_tile(row, i, 4);
        const __m256 xv = _mm256_loadu_ps(xs + i);
        for (int c = 0; c < 4; c++) acc[c] = _mm256_fmadd_ps(xv, e4m3x8_scaled_down(row + c * rb, i), acc[c]);
    }
#endif
    for (int c = 0; c < 4; c++) out[c] = lanes_sum(acc[c], 0.0f);
    return 1;
}

/* outputs n0 .. n1-1 of one row x for an FP8 matrix, a block row of scales at a time: x folded
 * into `buf` (k floats, then a flag a column block) once, then tiles that stay inside it */
static void fp8_folded_rows(const float *x, const kv_weights *w, const uint8_t *data, const void *scale, float *out,
                            int64_t n0, int64_t n1, float *buf, const uint8_t *subnormal) {
    uint8_t *folded = (uint8_t *)(buf + w->k);
    for (int64_t r0 = n0; r0 < n1;) {
        int64_t r1 = ((w->row_phase + r0) / w->br + 1) * w->br - w->row_phase, c = r0;
        r1 = r1 < n1 ? r1 : n1;
        fold_fp8_scales(x, w, scale, scale_row(w, r0), buf, folded);
        const int all_folded = w->k % LANES == 0 && !memchr(folded, 0, (w->k + w->bc - 1) / w->bc);
        for (; c + 4 <= r1; c += 4)
            if (!(all_folded && fp8_row_tile_folded(w, data, c, out + c, buf, subnormal)))
                weights_row_fp8_4(x, w, data, scale, c, out + c, buf, folded, subnormal);
        for (; c < r1; c++) weights_row_fp8_1(x, w, data, scale, c, out + c, buf, folded, subnormal);
        r0 = r1;
    }
}

/* rows r .. r+R-1 of x against columns [c0, c1), in tiles of R x 4 then R x 1 */
#define ROWS_COLS(R, NAME, c0, c1, XS, FOLDED)                                                        \
    {                                                                                                 \
        int64_t c = c0;                                                                               \
        for (; c + 4 <= c1; c += 4)                                                                   \
            weights_rows_##NAME##_##R##x4(x + r * ldx, ldx, w, data, scale, c, out + r * ldo + c, ldo, \
                                          XS, FOLDED, subnormal);                                     \
        for (; c < c1; c++)                                                                           \
            weights_rows_##NAME##_##R##x1(x + r * ldx, ldx, w, data, scale, c, out + r * ldo + c, ldo, \
                                          XS, FOLDED, subnormal);                                     \
    }

/* FP8 rows r .. r+R-1 with their x folded into `buf` (R rows of k floats, then R rows of a flag a
 * column block) once a block row of scales, then tiles that stay inside that block row */
#define FP8_FOLDED_ROWS(R)                                                                            \
    for (int64_t r0 = n0; r0 < n1;) {                                                                 \
        int64_t r1 = ((w->row_phase + r0) / w->br + 1) * w->br - w->row_phase;                        \
        r1 = r1 < n1 ? r1 : n1;                                                                       \
        for (int q = 0; q < (R); q++)                                                                 \
            fold_fp8_scales(x + (r + q) * ldx, w, scale, scale_row(w, r0), buf + q * w->k, folded + q * blocks); \
        ROWS_COLS(R, fp8, r0, r1, buf, folded)                                                        \
        r0 = r1;                                                                                      \
    }

/* FP4 rows r .. r+R-1 against columns [n0, n1): the releases' layout in fp4_tile_e8m0's tiles of 4
 * columns where it can, the generic tiles elsewhere */
#if E2M1_TABLES == 2 && defined(__AVX512BW__)
#define FP4_ROWS_COLS(R)                                                                              \
    if (FP4_ROW_TILE_E8M0(w)) {                                                                       \
        int64_t c = n0;                                                                               \
        for (; c + 4 <= n1; c += 4)                                                                   \
            if (!fp4_tile_e8m0_##R(x + r * ldx, ldx, w, data, scale, c, out + r * ldo + c, ldo))      \
                weights_rows_fp4_##R##x4(x + r * ldx, ldx, w, data, scale, c, out + r * ldo + c, ldo, \
                                         NULL, NULL, subnormal);                                      \
        for (; c < n1; c++)                                                                           \
            weights_rows_fp4_##R##x1(x + r * ldx, ldx, w, data, scale, c, out + r * ldo + c, ldo,     \
                                     NULL, NULL, subnormal);                                          \
    } else ROWS_COLS(R, fp4, n0, n1, NULL, NULL)
#else
#define FP4_ROWS_COLS(R) ROWS_COLS(R, fp4, n0, n1, NULL, NULL)
#endif

/* out[r, n0 .. n1) for m rows of x, in groups of 4 rows, then 2 (a last single row is the
 * caller's decode row); `buf` (an FP8 matrix whose rows fold, else NULL): room for
 * fold_rows_floats(w, 4). Returns the rows done. */
static int64_t weights_rows_cols(const float *x, int64_t ldx, const kv_weights *w, const uint8_t *data,
                                 const void *scale, float *out, int64_t ldo, int64_t m, int64_t n0, int64_t n1,
                                 float *buf, const uint8_t *subnormal) {
    const int64_t blocks = w->bc > 0 ? (w->k + w->bc - 1) / w->bc : 0;
    uint8_t *folded = buf ? (uint8_t *)(buf + 4 * w->k) : NULL;
    int64_t r = 0;
#define BY_FORMAT(R)                                                                                  \
    if (w->fmt == KV_FP8 && buf) { FP8_FOLDED_ROWS(R) }                                               \
    else if (w->fmt == KV_FP8) ROWS_COLS(R, fp8, n0, n1, NULL, NULL)                                  \
    else if (w->fmt == KV_FP4) FP4_ROWS_COLS(R)                                                       \
    else ROWS_COLS(R, bf16, n0, n1, NULL, NULL)
    for (; r + 4 <= m; r += 4) BY_FORMAT(4)
    for (; r + 2 <= m; r += 2) BY_FORMAT(2)
#undef BY_FORMAT
    return r;
}
#endif

/* Up to this many rows (decode, verify and small batches) decode the weights in registers, each
 * tile's once for all its rows; more decode a panel of columns once and run native_dot.h's tiles
 * over it. */
#define KV_REGISTER_ROWS 8

#include "native_bf16dot.h"

/* out[m, j] = dot(x row m, weight row j) over columns [n0, n1) of the matrix at data, scale and
 * subnormal (its flags, NULL: none); with dot = KV_DOT_BF16 the bf16 dot of xb (x's rows as
 * bf16_rows_of gives them) and the weights. A fp32 matrix is
 * read as it is; up to KV_REGISTER_ROWS rows of another format decode in registers (AVX2), other
 * cases decode the columns a panel at a time into `panel` (room for `panel_rows` rows of k
 * floats). */
static void weights_cols_at(const float *x, int64_t ldx, const kv_weights *w, const uint8_t *data, const void *scale,
                            const uint8_t *subnormal, float *out, int64_t ldo, int64_t m, int64_t n0, int64_t n1,
                            float *panel, int64_t panel_rows, const uint16_t *xb) {
    const int64_t k = w->k;
    if (w->dot == KV_DOT_BF16) {
        weights_cols_bf16(xb, m, w, data, scale, out, ldo, n0, n1, panel);
        return;
    }
    if (w->fmt == KV_F32) {
        matmul_cols(x, ldx, (const float *)data, out, ldo, m, n0, n1, k);
        return;
    }
#if KV_DECODE_IN_REGISTERS
    if (m <= KV_REGISTER_ROWS && (w->fmt != KV_FP4 || e2m1_rows_exact(w))) {
        float *fold = panel && fp8_folds(w) ? panel : NULL; /* room to fold x into FP8 block scales */
        const int64_t done = weights_rows_cols(x, ldx, w, data, scale, out, ldo, m, n0, n1, fold, subnormal);
        if (done == m) return;
        x += done * ldx; /* the one row left decodes as a decode row */
        out += done * ldo;
        if (fold) {
            fp8_folded_rows(x, w, data, scale, out, n0, n1, fold, subnormal);
            return;
        }
        int64_t c = n0;
#define ROWS(NAME)                                                                                \
        for (; c + 4 <= n1; c += 4) weights_row_##NAME##_4(x, w, data, scale, c, out + c, NULL, NULL, NULL); \
        for (; c < n1; c++) weights_row_##NAME##_1(x, w, data, scale, c, out + c, NULL, NULL, NULL);
#if E2M1_TABLES == 2 && defined(__AVX512BW__)
        if (w->fmt == KV_FP4 && FP4_ROW_TILE_E8M0(w))
            for (; c + 4 <= n1; c += 4)
                if (!fp4_tile_e8m0_1(x, 0, w, data, scale, c, out + c, 0))
                    weights_row_fp4_4(x, w, data, scale, c, out + c, NULL, NULL, NULL);
#endif
        if (w->fmt == KV_FP8 && FP8_ROW_TILE_SCALED(w))
            for (; c + 4 <= n1; c += 4)
                if (!fp8_row_tile_scaled(x, w, data, scale, c, out + c))
                    weights_row_fp8_4(x, w, data, scale, c, out + c, NULL, NULL, NULL);
        if (w->fmt == KV_FP8) { ROWS(fp8) } else if (w->fmt == KV_FP4) { ROWS(fp4) } else { ROWS(bf16) }
#undef ROWS
        return;
    }
#endif
    for (int64_t c0 = n0; c0 < n1; c0 += panel_rows) {
        int64_t c1 = c0 + panel_rows < n1 ? c0 + panel_rows : n1;
        for (int64_t c = c0; c < c1; c++) decode_row(w, data, scale, c, panel + (c - c0) * k);
        matmul_cols_tiled(x, ldx, panel, out + c0, ldo, m, 0, c1 - c0, k, 1);
    }
}

/* weights_cols_at over matrix `index`: its rows where the stride puts them, or piece by piece
 * (each piece's columns as a matrix of its own, written at its place in out) */
static void weights_cols(const float *x, int64_t ldx, const kv_weights *w, int64_t index, float *out, int64_t ldo,
                         int64_t m, int64_t n0, int64_t n1, float *panel, int64_t panel_rows, const uint16_t *xb) {
    if (!w->piece_data) {
        const uint8_t *data = (const uint8_t *)w->data + index * w->data_stride;
        const void *scale = w->scale ? (const void *)((const uint8_t *)w->scale
                                                      + index * w->scale_stride * (w->scale_f32 ? 4 : 1)) : NULL;
        const uint8_t *subnormal = w->subnormal_blocks ? w->subnormal_blocks + index * w->subnormal_stride : NULL;
        weights_cols_at(x, ldx, w, data, scale, subnormal, out, ldo, m, n0, n1, panel, panel_rows, xb);
        return;
    }
    const int64_t pr = w->piece_rows;
    for (int64_t p = n0 / pr; p < w->pieces && p * pr < n1; p++) {
        const int64_t at = index * w->pieces + p, lo = p * pr;
        const int64_t a = n0 > lo ? n0 : lo, b = n1 < lo + pr ? n1 : lo + pr;
        weights_cols_at(x, ldx, w, (const uint8_t *)w->piece_data[at], w->piece_scale ? w->piece_scale[at] : NULL,
                        w->piece_subnormal ? w->piece_subnormal[at] : NULL, out + lo, ldo, m, a - lo, b - lo,
                        panel, panel_rows, xb);
    }
}

/* room for `floats` floats on a cache line boundary: a row read from it (a folded x) then never
 * splits a vector load across two lines */
static inline float *panel_alloc(int64_t floats) {
    size_t bytes = ((sizeof(float) * (size_t)floats + 63) / 64) * 64;
    return aligned_alloc(64, bytes);
}

/* One matmul of those `weights_many` runs together: out [m, n] = x [m, k] @ (matrix `index` of w)^T. */
typedef struct {
    const float *x;
    int64_t ldx;
    const kv_weights *w;
    int64_t index;
    float *out;
    int64_t ldo, m, n;
} mm_job;

/* The floats of decoded weights a panel holds: half the L2 cache this CPU reports (the rows of x a
 * tile reads take the rest), read once; 64 KiB where it reports none. Every row of x passes over a
 * panel, so a larger one streams x from L3 fewer times: on a 2-core Zen 4 (1 MiB L2), a [512, 4096]
 * x against 4,096 columns ran 1.3x faster with 512 KiB panels than with 64 KiB (bench/RESULTS.md).
 * Which columns a panel holds changes no output (each is its own dot). */
static int64_t panel_floats_target(void) {
    static int64_t cached; /* 0 until read; the same value whichever thread stores it */
    int64_t floats = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (!floats) {
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        floats = l2 > 0 ? (int64_t)l2 / 8 : 16384;
        floats = floats < 16384 ? 16384 : floats > (1 << 20) ? (1 << 20) : floats;
        __atomic_store_n(&cached, floats, __ATOMIC_RELAXED);
    }
    return floats;
}

/* the columns a thread takes at a time: decode rows 64 KiB of weights, panels panel_floats_target's
 * (the block stays in cache while every row passes over it) */
static inline int64_t job_block(const mm_job *j) {
    const int64_t floats = j->m > KV_REGISTER_ROWS ? panel_floats_target() : 16384;
    if (j->w->dot == KV_DOT_BF16) { /* bf16 panels: twice the columns in the same bytes */
        const int64_t block = (2 * floats / bf_padded(j->w->k > 0 ? j->w->k : 1)) & ~(int64_t)3;
        return block < 8 ? 8 : block;
    }
    int64_t block = (floats / (j->w->k > 0 ? j->w->k : 1)) & ~(int64_t)3;
    block = block < 4 ? 4 : block;
    /* FP8 decode rows fold x into a block row's scales once a call (fp8_folded_rows): a call of 4
     * columns of a 4,096-wide matrix spent a fifth of its time folding (bench/RESULTS.md), so they
     * take up to a block row (128 columns in the releases) a call */
    if (j->w->fmt == KV_FP8 && j->m <= KV_REGISTER_ROWS && KV_DECODE_IN_REGISTERS && j->w->br > block)
        block = j->w->br < 128 ? j->w->br : 128;
    return block;
}

/* a panel for decoded columns (more than KV_REGISTER_ROWS rows, or no vector decoders), or (FP8
 * rows) for x folded with the scales (job_panel_floats); AVX2 FP4 rows may need it too
 * (e2m1_rows_exact) */
static inline int job_panel(const mm_job *j) {
    const int64_t fmt = j->w->fmt;
    if (j->w->dot == KV_DOT_BF16) return !bf_in_place(j->w);
    return fmt != KV_F32 && (j->m > KV_REGISTER_ROWS || !KV_DECODE_IN_REGISTERS || fmt == KV_FP8
                             || (fmt == KV_FP4 && E2M1_TABLES == 1));
}

/* the panel's floats: `block` decoded columns; for FP8 at least 4 folded rows of x and their flags
 * (weights_rows_cols) */
static inline int64_t job_panel_floats(const mm_job *j, int64_t block) {
    const kv_weights *w = j->w;
    if (w->dot == KV_DOT_BF16) return bf_panel_floats(w, block);
    const int64_t floats = block * w->k;
    if (w->fmt != KV_FP8) return floats;
    const int64_t folds = 4 * w->k + (w->k + w->bc - 1) / w->bc; /* a float for each row's 4 flags */
    return floats > folds ? floats : folds;
}

/* the job's column block b, of `block` columns */
static void job_cols(const mm_job *j, int64_t block, int64_t b, float *panel, const uint16_t *xb) {
    const int64_t n0 = b * block, n1 = n0 + block < j->n ? n0 + block : j->n;
    weights_cols(j->x, j->ldx, j->w, j->index, j->out, j->ldo, j->m, n0, n1, panel, block, xb);
}

#define MM_MAX_JOBS 80
#define KV_SERIAL_MACS (1 << 17) /* numerics/rows.py's _SERIAL_MACS: a smaller matmul runs on one thread */

/* Every job's out, each output native_dot.h's `dot`. The threads split the jobs' column blocks,
 * all jobs' in one sequence (one parallel region, so one fork and one join for several matrices
 * that read the same finished inputs) into runs of about equal work, never the K reduction: which
 * thread computes an output, and beside which other job, changes nothing. Returns 0, or -1 when a
 * panel buffer cannot be allocated. */
static int weights_many(const mm_job *jobs, int count, int64_t threads) {
    int64_t first[MM_MAX_JOBS + 1], block[MM_MAX_JOBS], panel_floats = 0;
    if (count > MM_MAX_JOBS) return -1;
    first[0] = 0;
    for (int j = 0; j < count; j++) {
        block[j] = job_block(&jobs[j]);
        first[j + 1] = first[j] + (jobs[j].n + block[j] - 1) / block[j];
        if (job_panel(&jobs[j]) && job_panel_floats(&jobs[j], block[j]) > panel_floats)
            panel_floats = job_panel_floats(&jobs[j], block[j]);
    }
    const int64_t total = first[count];
    int failed = 0;
    uint16_t *xb[MM_MAX_JOBS] = {0}; /* bf16-dot jobs: their x rounded once, read by every thread */
    for (int j = 0; j < count && !failed; j++)
        if (jobs[j].w->dot == KV_DOT_BF16 && jobs[j].m && jobs[j].n)
            failed = !(xb[j] = bf16_rows_of(jobs[j].x, jobs[j].ldx, jobs[j].m, jobs[j].w->k));
    if (failed || threads <= 1 || total <= 1) { /* no OpenMP region: even a serialised one costs about a microsecond */
        float *panel = panel_floats && !failed ? panel_alloc(panel_floats) : NULL;
        failed |= panel_floats && !panel;
        for (int j = 0; j < count && !failed; j++)
            for (int64_t b = 0; b < first[j + 1] - first[j]; b++) job_cols(&jobs[j], block[j], b, panel, xb[j]);
        free(panel);
        for (int j = 0; j < count; j++) free(xb[j]);
        return failed ? -1 : 0;
    }
    /* a block's work, roughly: its weights times (its rows + what decoding them costs) */
    int64_t cost[MM_MAX_JOBS], sum = 0;
    for (int j = 0; j < count; j++) {
        cost[j] = block[j] * jobs[j].w->k * (jobs[j].m + (jobs[j].w->fmt == KV_F32 ? 0 : 2));
        sum += cost[j] * (first[j + 1] - first[j]);
    }
    #pragma omp parallel num_threads(threads) reduction(|:failed)
    {
        float *panel = panel_floats ? panel_alloc(panel_floats) : NULL;
        if (panel_floats && !panel) failed = 1;
        /* thread t takes the ascending run of blocks whose work starts in its t-th share of the sum
         * (the jobs' rows differ, so equal block counts would not be equal work) */
        #pragma omp for schedule(static, 1)
        for (int64_t t = 0; t < threads; t++) {
            int64_t before = 0;
            for (int j = 0; j < count; j++)
                for (int64_t b = 0; b < first[j + 1] - first[j]; b++, before += cost[j])
                    if (before * threads / (sum > 0 ? sum : 1) == t && (!panel_floats || panel))
                        job_cols(&jobs[j], block[j], b, panel, xb[j]);
        }
        free(panel);
    }
    for (int j = 0; j < count; j++) free(xb[j]);
    return failed ? -1 : 0;
}

/* out [M, N] = x [M, K] @ (matrix `index` of w) [N, K]^T: `weights_many` of one job. */
static int weights_matmul(const float *x, int64_t ldx, const kv_weights *w, int64_t index, float *out,
                          int64_t ldo, int64_t m, int64_t n, int64_t threads) {
    const mm_job job = {x, ldx, w, index, out, ldo, m, n};
    return weights_many(&job, 1, threads);
}

/* One pass over FP8 e4m3 codes [rows, k] (row stride k), the threads taking rows: whether any code
 * is a NaN (magnitude 0x7F), which the fast decoders do not decode, and where flags is not NULL,
 * flags[r * ceil(k / bc) + b] = 1 where row r's block b of bc columns holds a subnormal code
 * (magnitude 1..7; tile_subnormal), else 0. Returns nan | (any subnormal << 1). Plain byte loops
 * the compiler vectorises: a load-time scan of a model's FP8 weights runs at memory speed. */
int64_t kv_scan_fp8(const uint8_t *codes, int64_t rows, int64_t k, int64_t bc, uint8_t *flags, int64_t threads) {
    const int64_t blocks = (k + bc - 1) / bc;
    int nan = 0, sub = 0;
    #pragma omp parallel for num_threads(threads) reduction(|:nan, sub) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = codes + r * k;
        if (!flags) {
            uint8_t any = 0;
            for (int64_t j = 0; j < k; j++) any |= (uint8_t)((row[j] & 0x7F) == 0x7F);
            nan |= any;
            continue;
        }
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t j1 = (b + 1) * bc < k ? (b + 1) * bc : k;
            uint8_t n = 0, s = 0;
            for (int64_t j = b * bc; j < j1; j++) {
                const uint8_t m = row[j] & 0x7F;
                n |= (uint8_t)(m == 0x7F);
                s |= (uint8_t)((uint8_t)(m - 1) < 7);
            }
            flags[r * blocks + b] = s;
            nan |= n;
            sub |= s;
        }
    }
    return nan | (sub << 1);
}

/* The job's matmul (weights_matmul's), after checking its descriptor. Returns 0; -2: a descriptor
 * the kernels cannot read (nothing written); -1: a panel buffer cannot be allocated. */
int kv_matmul_weights(const mm_job *job, int64_t threads) {
    const kv_weights *w = job->w;
    if (w->fmt < KV_F32 || w->fmt > KV_FP4 || (scaled(w->fmt) && (w->bc % LANES || w->br < 1))
        || (w->fmt == KV_FP4 && w->k % 2) || (w->piece_data && (w->pieces < 1 || w->piece_rows < 1))
        || (w->dot != KV_DOT_F32 && w->dot != KV_DOT_BF16))
        return -2;
    return weights_many(job, 1, threads);
}

#endif
