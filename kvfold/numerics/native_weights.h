/* kvfold native kernels: matmuls that read weights in their checkpoint formats.
 *
 * A kv_weights describes a stack of [n, k] matrices stored as fp32, bf16, FP8 e4m3fn with block
 * scales, or packed FP4 e2m1 (low nibble = even column) with 1 x bc scales, as quant.py describes
 * them. The weights stay in that format: a decode row decodes each group of 8 weights in
 * registers inside the dot product, several rows decode a panel of columns at a time into a
 * buffer of the thread's own.
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
 *                       half NaN. Multiplying by 2^8 is exact.
 *   e2m1 codes        -> half high bytes from a 16-entry table (0, 0.5, ..., 6 and their
 *                       negatives; code 8, "-0", is +0 as in quant.py's table), low bytes 0.
 *   bf16              -> float32 bits = bf16 bits << 16.
 */
#ifndef KV_NATIVE_WEIGHTS_H
#define KV_NATIVE_WEIGHTS_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_dot.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KV_DECODE_IN_REGISTERS 1 /* one row decodes in registers; without, it decodes a panel too */
#else
#define KV_DECODE_IN_REGISTERS 0
#endif

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

/* the scale of matrix-local row j, column block b */
static inline float weights_scale(const kv_weights *w, const void *scale, int64_t j, int64_t b) {
    int64_t at = ((w->row_phase + j) / w->br) * ((w->k + w->bc - 1) / w->bc) + b;
    return w->scale_f32 ? ((const float *)scale)[at] : e8m0_value(((const uint8_t *)scale)[at]);
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
/* 8 codes from value i of a row -> their values (without the block scale) */
static inline __m256 codes8(int64_t fmt, const uint8_t *row, int64_t i) {
    if (fmt == KV_F32) return _mm256_loadu_ps((const float *)row + i);
    if (fmt == KV_BF16) {
        __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * i)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
    }
    if (fmt == KV_FP8) {
        __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(row + i)));
        __m128i em = _mm_and_si128(b, _mm_set1_epi16(0x7f));
        __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8), _mm_slli_epi16(em, 7));
        __m128i nan = _mm_and_si128(_mm_cmpeq_epi16(em, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7e00));
        return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(h, nan)), _mm256_set1_ps(256.0f));
    }
    const __m128i table = _mm_setr_epi8(0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46, 0x00, (char)0xB8,
                                        (char)0xBC, (char)0xBE, (char)0xC0, (char)0xC2, (char)0xC4, (char)0xC6);
    int32_t four;
    memcpy(&four, row + i / 2, 4);
    __m128i b = _mm_cvtsi32_si128(four), low = _mm_set1_epi8(0x0F);
    __m128i nibbles = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
    return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), _mm_shuffle_epi8(table, nibbles)));
}

/* outputs j0 .. j0+NR-1 of one row x: native_dot.h's dot_tile_1xNR, the weights decoded in
 * registers (lane j: ascending i = j mod 8 with fused multiply-adds, then the halving sum and
 * the scalar tail) */
#define WEIGHTS_ROW_TILE(NR)                                                                          \
    static inline void weights_row_##NR(const float *x, const kv_weights *w, const uint8_t *data,    \
                                        const void *scale, int64_t j0, float *out) {                 \
        const int64_t k = w->k, k8 = k - k % LANES, bc = scaled(w->fmt) ? w->bc : (k8 ? k8 : 1);     \
        const int64_t rb = weights_row_bytes(w);                                                      \
        __m256 acc[NR];                                                                               \
        for (int c = 0; c < NR; c++) acc[c] = _mm256_setzero_ps();                                    \
        for (int64_t b0 = 0; b0 < k8; b0 += bc) {                                                     \
            int64_t b1 = b0 + bc < k8 ? b0 + bc : k8;                                                 \
            __m256 s[NR];                                                                             \
            for (int c = 0; c < NR; c++)                                                              \
                s[c] = _mm256_set1_ps(scaled(w->fmt) ? weights_scale(w, scale, j0 + c, b0 / bc) : 1.0f); \
            for (int64_t i = b0; i < b1; i += LANES) {                                                \
                __m256 xv = _mm256_loadu_ps(x + i);                                                   \
                for (int c = 0; c < NR; c++) {                                                        \
                    __m256 wv = codes8(w->fmt, data + (j0 + c) * rb, i);                              \
                    if (scaled(w->fmt)) wv = _mm256_mul_ps(wv, s[c]);                                 \
                    acc[c] = _mm256_fmadd_ps(xv, wv, acc[c]);                                         \
                }                                                                                     \
            }                                                                                         \
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
    for (; i + LANES <= w->k; i += LANES) {
        __m256 v = codes8(w->fmt, row, i);
        if (scaled(w->fmt)) v = _mm256_mul_ps(v, _mm256_set1_ps(weights_scale(w, scale, j, i / w->bc)));
        _mm256_storeu_ps(dst + i, v);
    }
#endif
    for (; i < w->k; i++) dst[i] = weight_value(w, data, scale, j, i);
}

#if KV_DECODE_IN_REGISTERS
WEIGHTS_ROW_TILE(1)
WEIGHTS_ROW_TILE(4)
#endif

/* out[m, j] = dot(x row m, weight row j) over columns [n0, n1) of matrix `index`. A fp32 matrix is
 * read as it is; one row of another format decodes in registers (AVX2), other cases decode the
 * columns a panel at a time into `panel` (room for `panel_rows` rows of k floats). */
static void weights_cols(const float *x, int64_t ldx, const kv_weights *w, int64_t index, float *out, int64_t ldo,
                         int64_t m, int64_t n0, int64_t n1, float *panel, int64_t panel_rows) {
    const uint8_t *data = (const uint8_t *)w->data + index * w->data_stride;
    const void *scale = w->scale ? (const void *)((const uint8_t *)w->scale
                                                  + index * w->scale_stride * (w->scale_f32 ? 4 : 1)) : NULL;
    const int64_t k = w->k;
    if (w->fmt == KV_F32) {
        matmul_cols(x, ldx, (const float *)data, out, ldo, m, n0, n1, k);
        return;
    }
#if KV_DECODE_IN_REGISTERS
    if (m == 1) {
        int64_t c = n0;
        for (; c + 4 <= n1; c += 4) weights_row_4(x, w, data, scale, c, out + c);
        for (; c < n1; c++) weights_row_1(x, w, data, scale, c, out + c);
        return;
    }
#endif
    for (int64_t c0 = n0; c0 < n1; c0 += panel_rows) {
        int64_t c1 = c0 + panel_rows < n1 ? c0 + panel_rows : n1;
        for (int64_t c = c0; c < c1; c++) decode_row(w, data, scale, c, panel + (c - c0) * k);
        matmul_cols(x, ldx, panel, out + c0, ldo, m, 0, c1 - c0, k);
    }
}

/* out [M, N] = x [M, K] @ (matrix `index` of w) [N, K]^T, every output native_dot.h's `dot`.
 * Threads split the columns into blocks of about 64 KiB of decoded weights (each block stays in
 * cache while every row passes over it), never the K reduction: which thread computes an output
 * changes nothing. Returns 0, or -1 when a panel buffer cannot be allocated. */
static int weights_matmul(const float *x, int64_t ldx, const kv_weights *w, int64_t index, float *out,
                          int64_t ldo, int64_t m, int64_t n, int64_t threads) {
    const int64_t k = w->k;
    int64_t block = (16384 / (k > 0 ? k : 1)) & ~(int64_t)3;
    if (block < 4) block = 4;
    int64_t n_blocks = (n + block - 1) / block;
    int need_panel = w->fmt != KV_F32 && (m > 1 || !KV_DECODE_IN_REGISTERS), failed = 0;
    #pragma omp parallel num_threads(threads) if(threads > 1 && n_blocks > 1) reduction(|:failed)
    {
        float *panel = need_panel ? malloc(sizeof(float) * (size_t)(block * k)) : NULL;
        if (need_panel && !panel) failed = 1;
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < n_blocks; b++) {
            int64_t n0 = b * block, n1 = n0 + block < n ? n0 + block : n;
            if (!need_panel || panel) weights_cols(x, ldx, w, index, out, ldo, m, n0, n1, panel, block);
        }
        free(panel);
    }
    return failed ? -1 : 0;
}

int kv_matmul_weights(const float *x, int64_t ldx, const kv_weights *w, int64_t index, float *out, int64_t ldo,
                      int64_t m, int64_t n, int64_t threads) {
    if (w->fmt < KV_F32 || w->fmt > KV_FP4 || (scaled(w->fmt) && (w->bc % LANES || w->br < 1))
        || (w->fmt == KV_FP4 && w->k % 2))
        return -2;
    return weights_matmul(x, ldx, w, index, out, ldo, m, n, threads);
}

#endif
