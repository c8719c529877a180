/* kvfold native kernels: the bf16 dot product, for weights described with dot = KV_DOT_BF16 (a
 * model loaded with dot="bf16"). Included by native_weights.h.
 *
 * The definition, for one output (a row x of the activations, a row w of the weight, k values):
 *   1. x[i] and w[i] are rounded to bf16: w[i] is first quant.py's float32 dequantized value (as in
 *      the fp32 dot), then both are rounded to nearest even on their bits (bf16_of); a value that
 *      lands below bf16's smallest normal becomes a zero of its sign. k is padded with zeros to a
 *      multiple of 32.
 *   2. 16 float32 lanes start at +0. Step s (values 32s .. 32s+31) gives lane j the pair 2j, 2j+1 of
 *      its values: lane = flush(fmaf(x[odd], w[odd], lane)), then lane = flush(fmaf(x[even],
 *      w[even], lane)), where flush turns a float32 subnormal into a zero of its sign.
 *   3. The lanes are summed by halving: lane j + lane j+8, then +4, +2, +1.
 * Step 2 is what Intel documents for VDPBF16PS (odd element first, each a fused multiply-add of
 * the exact bf16 product, denormal inputs as zero and outputs flushed, MXCSR not consulted), and
 * what bench/bf16_dot_semantics.c found lane by lane on a Zen 4. So a CPU with AVX512-BF16 runs the
 * instruction, and every other build runs the same steps with fmaf and an explicit flush (the
 * inputs are never subnormal after step 1, so the instruction's denormals-as-zero has nothing to
 * do); the sequence of roundings depends on k only, never on the row count, the tile, the thread
 * or the instruction set: batch-invariant by construction, and the same bits on every ISA. One
 * corner is the CPUs' own: whether a result that rounds up to the smallest normal counts as tiny
 * (x86 decides after rounding, as the emulation's compare does).
 *
 * Why: VDPBF16PS multiplies 32 pairs an instruction, twice the fp32 fused multiply-adds' rate on
 * Zen 4, and a bf16 panel is half the bytes of an fp32 one (bench/RESULTS.md). */
#ifndef KV_NATIVE_BF16DOT_H
#define KV_NATIVE_BF16DOT_H

enum { KV_DOT_F32 = 0, KV_DOT_BF16 = 1 };

#define BF_STEP 32 /* values a step: a pair for each of 16 lanes */

static inline int64_t bf_padded(int64_t k) { return (k + BF_STEP - 1) / BF_STEP * BF_STEP; }

/* float32 -> bf16 bits, to nearest even; below the smallest normal: a zero of its sign; a NaN stays
 * a (quiet) NaN */
static inline uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7FFFu + ((u >> 16) & 1u);
    const uint16_t b = (uint16_t)(u >> 16);
    return (b & 0x7F80) ? b : (uint16_t)(b & 0x8000);
}

/* a stored bf16 value as step 1 reads it: below the smallest normal, a zero of its sign */
static inline uint16_t bf16_flushed(uint16_t b) { return (b & 0x7F80) ? b : (uint16_t)(b & 0x8000); }

static inline float bf16_float(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float flush_subnormal(float f) { return fabsf(f) < 1.17549435e-38f ? copysignf(0.0f, f) : f; }

#if defined(__AVX2__) && defined(__FMA__)
/* the 16 lanes' halving sum, after lane j + j+8: +4, +2, +1 (native_dot.h's lanes_sum adds a tail
 * last, which would turn a -0 into +0) */
static inline float bf_sum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* 8 floats -> their bf16_of, as 8 uint16 */
static inline __m128i bf16x8_of(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                           _mm256_set1_epi32(0x7F800000));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    const __m256i tiny = _mm256_cmpeq_epi32(_mm256_and_si256(r, _mm256_set1_epi32(0x7F80)), _mm256_setzero_si256());
    r = _mm256_blendv_epi8(r, _mm256_and_si256(r, _mm256_set1_epi32(0x8000)), tiny);
    r = _mm256_packus_epi32(r, r); /* every value fits 16 bits: the pack only moves them */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(r, 0x08));
}
#endif

/* dst[0 .. kp) = bf16_of(src[0 .. k)), then zeros */
static void bf16_row_of(const float *src, int64_t k, uint16_t *dst) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= k; i += 8) _mm_storeu_si128((__m128i *)(dst + i), bf16x8_of(_mm256_loadu_ps(src + i)));
#endif
    for (; i < k; i++) dst[i] = bf16_of(src[i]);
    for (; i < bf_padded(k); i++) dst[i] = 0;
}

/* One output by the definition, lane by lane: the reference every tile below computes. a, b: kp
 * bf16 values each (rounded, padded). */
static inline float bf_dot_scalar(const uint16_t *a, const uint16_t *b, int64_t kp) {
    float lane[16] = {0};
    for (int64_t s = 0; s < kp; s += BF_STEP)
        for (int j = 0; j < 16; j++) {
            const int64_t o = s + 2 * j + 1, e = s + 2 * j;
            lane[j] = flush_subnormal(fmaf(bf16_float(a[o]), bf16_float(b[o]), lane[j]));
            lane[j] = flush_subnormal(fmaf(bf16_float(a[e]), bf16_float(b[e]), lane[j]));
        }
    for (int half = 8; half > 0; half /= 2)
        for (int j = 0; j < half; j++) lane[j] = lane[j] + lane[j + half];
    return lane[0];
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KV_BF_NATIVE 1 /* VDPBF16PS */
/* lane j + j+8, then +4, +2, +1 */
static inline float bf_lanes_sum(__m512 v) {
    return bf_sum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}
#define BF_TILE(MR, NR)                                                                                \
    static inline void bf_tile_##MR##x##NR(const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb,  \
                                           int64_t kp, float *out, int64_t ldo) {                      \
        __m512 acc[MR][NR];                                                                            \
        for (int r = 0; r < MR; r++)                                                                   \
            for (int c = 0; c < NR; c++) acc[r][c] = _mm512_setzero_ps();                              \
        for (int64_t i = 0; i < kp; i += BF_STEP) {                                                    \
            if ((MR) == 1) prefetch_tile(b, 2 * i, NR); /* a decode row reads b in place, from DRAM */ \
            __m512bh bv[NR];                                                                           \
            for (int c = 0; c < NR; c++) bv[c] = (__m512bh)_mm512_loadu_si512(b + c * ldb + i);        \
            for (int r = 0; r < MR; r++) {                                                             \
                const __m512bh av = (__m512bh)_mm512_loadu_si512(a + r * lda + i);                     \
                for (int c = 0; c < NR; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], av, bv[c]);       \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < MR; r++)                                                                   \
            for (int c = 0; c < NR; c++) out[r * ldo + c] = bf_lanes_sum(acc[r][c]);                   \
    }
#define BF_MR 4
#define BF_NR 4
BF_TILE(4, 4)
BF_TILE(4, 1)
BF_TILE(1, 8)
#elif defined(__AVX2__) && defined(__FMA__)
#define KV_BF_NATIVE 0
/* lanes 0-7 hold values 0-15 of each step, lanes 8-15 values 16-31 (the instruction's lanes) */
static inline __m256 bf_flush8(__m256 v) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 tiny = _mm256_cmp_ps(_mm256_andnot_ps(sign, v), _mm256_set1_ps(1.17549435e-38f), _CMP_LT_OQ);
    return _mm256_blendv_ps(v, _mm256_and_ps(v, sign), tiny);
}
static inline __m256 bf_odd8(__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u))); }
static inline __m256 bf_even8(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline float bf_lanes_sum2(__m256 lo, __m256 hi) { return bf_sum8(_mm256_add_ps(lo, hi)); }
#define BF_TILE(MR, NR)                                                                                \
    static inline void bf_tile_##MR##x##NR(const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb,  \
                                           int64_t kp, float *out, int64_t ldo) {                      \
        __m256 acc[MR][NR][2];                                                                         \
        for (int r = 0; r < MR; r++)                                                                   \
            for (int c = 0; c < NR; c++) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();           \
        for (int64_t i = 0; i < kp; i += BF_STEP)                                                      \
            for (int h = 0; h < 2; h++) {                                                              \
                if ((MR) == 1 && h == 0) prefetch_tile(b, 2 * i, NR);                                  \
                __m256i bv[NR];                                                                        \
                for (int c = 0; c < NR; c++) bv[c] = _mm256_loadu_si256((const __m256i *)(b + c * ldb + i + 16 * h)); \
                for (int r = 0; r < MR; r++) {                                                         \
                    const __m256i av = _mm256_loadu_si256((const __m256i *)(a + r * lda + i + 16 * h)); \
                    for (int c = 0; c < NR; c++) {                                                     \
                        __m256 l = bf_flush8(_mm256_fmadd_ps(bf_odd8(av), bf_odd8(bv[c]), acc[r][c][h])); \
                        acc[r][c][h] = bf_flush8(_mm256_fmadd_ps(bf_even8(av), bf_even8(bv[c]), l));  \
                    }                                                                                  \
                }                                                                                      \
            }                                                                                          \
        for (int r = 0; r < MR; r++)                                                                   \
            for (int c = 0; c < NR; c++) out[r * ldo + c] = bf_lanes_sum2(acc[r][c][0], acc[r][c][1]); \
    }
#define BF_MR 2
#define BF_NR 2
BF_TILE(2, 2)
BF_TILE(2, 1)
BF_TILE(1, 8)
#else
#define KV_BF_NATIVE 0
#define BF_MR 1
#define BF_NR 1
#endif

/* out[r, c] = the bf16 dot of a row r and b row c, for r < m, c < n (rows kp values apart in a and
 * b as given by lda, ldb): tiles of BF_MR x BF_NR share their loads, then what is left over one
 * row or one column at a time; every output is the definition's, whichever tile computes it. */
static void bf_matmul(const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb, float *out, int64_t ldo,
                      int64_t m, int64_t n, int64_t kp) {
#if defined(__AVX2__) && defined(__FMA__)
    int64_t r = 0;
    if (m == 1) {
        int64_t c = 0;
        for (; c + 8 <= n; c += 8) bf_tile_1x8(a, lda, b + c * ldb, ldb, kp, out + c, ldo);
        for (; c < n; c++) out[c] = bf_dot_scalar(a, b + c * ldb, kp);
        return;
    }
    for (; r + BF_MR <= m; r += BF_MR) {
        int64_t c = 0;
#if KV_BF_NATIVE
        for (; c + BF_NR <= n; c += BF_NR) bf_tile_4x4(a + r * lda, lda, b + c * ldb, ldb, kp, out + r * ldo + c, ldo);
        for (; c < n; c++) bf_tile_4x1(a + r * lda, lda, b + c * ldb, ldb, kp, out + r * ldo + c, ldo);
#else
        for (; c + BF_NR <= n; c += BF_NR) bf_tile_2x2(a + r * lda, lda, b + c * ldb, ldb, kp, out + r * ldo + c, ldo);
        for (; c < n; c++) bf_tile_2x1(a + r * lda, lda, b + c * ldb, ldb, kp, out + r * ldo + c, ldo);
#endif
    }
    for (; r < m; r++) {
        int64_t c = 0;
        for (; c + 8 <= n; c += 8) bf_tile_1x8(a + r * lda, lda, b + c * ldb, ldb, kp, out + r * ldo + c, ldo);
        for (; c < n; c++) out[r * ldo + c] = bf_dot_scalar(a + r * lda, b + c * ldb, kp);
    }
#else
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < n; c++) out[r * ldo + c] = bf_dot_scalar(a + r * lda, b + c * ldb, kp);
#endif
}

/* the bf16 rows of x [m, k] (row stride ldx) for the bf16 dot: [m, kp], zero-padded */
static uint16_t *bf16_rows_of(const float *x, int64_t ldx, int64_t m, int64_t k) {
    const int64_t kp = bf_padded(k);
    uint16_t *xb = aligned_alloc(64, (size_t)((m * kp * 2 + 63) / 64 * 64));
    if (xb)
        for (int64_t r = 0; r < m; r++) bf16_row_of(x + r * ldx, k, xb + r * kp);
    return xb;
}

/* Whether the weight rows are read in place (bf16 weights whose rows are whole steps, under
 * VDPBF16PS, which reads a stored subnormal as zero as step 1 does); else they are rounded into a
 * panel first. */
static inline int bf_in_place(const kv_weights *w) { return KV_BF_NATIVE && w->fmt == KV_BF16 && w->k % BF_STEP == 0; }

#if KV_BF_NATIVE
/* Exact shortcuts to the definition's bf16 weights, for e8m0 scales 2^E: code * 2^E is then exact
 * in float32 and, for E in the ranges below (the code's smallest and largest values stay normal
 * bf16), a bf16 whose bits are the code's own with E added to the exponent. */
#define BF_FP8_E_OK(E) ((E) >= -117 && (E) <= 119) /* 2^-9 (the smallest subnormal code) .. 448 */
#define BF_FP4_E_OK(E) ((E) >= -125 && (E) <= 125) /* 0.5 .. 6 */

/* how far ahead of its decoding a row's codes are asked for: one row decoded at a time is a single
 * stream, which the hardware prefetcher alone left at half the fp32 path's rate (bench/RESULTS.md) */
#define BF_PREFETCH 2048

/* e4m3fn codes m = 1 .. 7 (subnormal: m * 2^-9) as bf16, m = 0 as +0 */
static const uint16_t BF_E4M3_SUBNORMAL[32] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
/* the e2m1 values (code 8, "-0", as +0, as quant.py's table has it) as bf16, twice: bf_fp4x32's
 * index for a low nibble carries the high nibble's low bit */
#define BF_E2M1_16 0, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0, 0, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0
static const uint16_t BF_E2M1[32] = {BF_E2M1_16, BF_E2M1_16};

/* BF_E2M1 times 2^(e - 127) for each e8m0 byte e whose exponent the shortcut takes (else as it
 * is): a block's table is then one load, and bf_fp4x32's permute reads it from memory, where
 * scaling the table in registers cost a fifth of a decode row's time (bench/RESULTS.md) */
static uint16_t BF_E2M1_SCALED[256][32] __attribute__((aligned(64)));
__attribute__((constructor)) static void bf_e2m1_scaled_init(void) {
    for (int e = 0; e < 256; e++)
        for (int i = 0; i < 32; i++)
            BF_E2M1_SCALED[e][i] = BF_E2M1[i] && BF_FP4_E_OK(e - 127) ? (uint16_t)(BF_E2M1[i] + ((e - 127) << 7)) : BF_E2M1[i];
}

/* 32 e4m3fn codes (none a NaN) times 2^E as bf16: s.eeee.mmm -> s.(eeee + 120 + E).mmm0000, the
 * subnormal codes (eeee = 0) from their table, the exponent likewise raised by E */
static inline __m512i bf_fp8x32(const uint8_t *codes, __m512i subnormal_table, int E) {
    const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)codes));
    __m512i v = _mm512_and_si512(_mm512_slli_epi16(c, 4), _mm512_set1_epi16(0x7F0));
    v = _mm512_add_epi16(v, _mm512_set1_epi16((short)((120 + E) << 7)));
    const __mmask32 sub = _mm512_testn_epi16_mask(c, _mm512_set1_epi16(0x78));
    v = _mm512_mask_permutexvar_epi16(v, sub, c, subnormal_table); /* the index's low 5 bits: the mantissa */
    return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(c, 8), _mm512_set1_epi16((short)0x8000), 0xF8); /* v | (sign & 0x8000) */
}

/* 32 e2m1 codes (16 bytes, low nibble first) through a block's table: byte j widened to a 32-bit
 * lane, or'ed with itself shifted by 12, holds the low nibble in its low word's 5 index bits (the
 * fifth is the high nibble's low bit: the table is there twice) and the high nibble in its high
 * word's, so one permute gives values 2j and 2j + 1 */
static inline __m512i bf_fp4x32(const uint8_t *bytes, const uint16_t *table) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    return _mm512_permutexvar_epi16(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), _mm512_load_si512(table));
}

/* a table's nonzero entries with their exponent raised by E */
static inline __m512i bf_table_scaled(const uint16_t *table, __mmask32 nonzero, int E) {
    const __m512i t = _mm512_loadu_si512(table);
    return _mm512_mask_add_epi16(t, nonzero, t, _mm512_set1_epi16((short)(E << 7)));
}

/* FP8 with float32 scales (GLM-5.3's): a block's products code * s in float32, then to bf16 to
 * nearest even. For a finite s with 2^-117 <= |s| <= 2^118 every nonzero product is a normal
 * float32 (2^-9 * 2^-117 = 2^-126 .. 448 * 2^118 < 2^127) and rounds to a normal bf16, so
 * VCVTNE2PS2BF16 (which reads and writes subnormals as zero) gives bf16_of's bits. */
#define BF_F32_SCALE_OK(S) (fabsf(S) >= 0x1p-117f && fabsf(S) <= 0x1p118f) /* false for NaN */

/* 32 e4m3fn codes (none a NaN) times s as the definition's bf16 (s within BF_F32_SCALE_OK): the
 * codes' own values (exact in bf16, so in float32), times s in float32, rounded */
static inline __m512i bf_fp8x32_f32(const uint8_t *codes, __m512i subnormal_table, __m512 s) {
    const __m512i v = bf_fp8x32(codes, subnormal_table, 0);
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s), _mm512_mul_ps(lo, s));
}

/* whether the matrix's rows decode through the shortcuts block by block: FP8 (e8m0 or float
 * scales) or FP4 (e8m0), no NaN codes, blocks and k whole steps */
static inline int bf_shortcuts(const kv_weights *w) {
    return (w->fmt == KV_FP8 || (w->fmt == KV_FP4 && !w->scale_f32)) && w->k % BF_STEP == 0 && w->bc % BF_STEP == 0
           && !(w->fmt == KV_FP8 && w->nan_codes);
}

/* whether the block scale at `at` (scale entries) is in its shortcut's range */
static inline int bf_scale_ok(const kv_weights *w, const void *scale, int64_t at) {
    if (w->scale_f32) return BF_F32_SCALE_OK(((const float *)scale)[at]);
    const int E = (int)((const uint8_t *)scale)[at] - 127;
    return w->fmt == KV_FP8 ? BF_FP8_E_OK(E) : BF_FP4_E_OK(E);
}

/* row j as bf16 into dst through the shortcuts, block by block (a block whose scale is out of
 * range one value at a time); 0 where the matrix does not take them (bf_shortcuts) */
static int bf_decode_row_fast(const kv_weights *w, const uint8_t *data, const void *scale, int64_t j, uint16_t *dst) {
    if (!bf_shortcuts(w)) return 0;
    const uint8_t *row = data + j * weights_row_bytes(w);
    const int64_t srow = scale_row(w, j);
    const uint8_t *scales = (const uint8_t *)scale + srow;
    for (int64_t b = 0, blk = 0; b < w->k; b += w->bc, blk++) { /* blk counted, not divided: a division a block cost more than its decoding */
        const int E = w->scale_f32 ? 0 : (int)scales[blk] - 127, ok = bf_scale_ok(w, scale, srow + blk);
        const int64_t b1 = b + w->bc < w->k ? b + w->bc : w->k;
        if (w->fmt == KV_FP8 && w->scale_f32 && ok) {
            const __m512i table = _mm512_loadu_si512(BF_E4M3_SUBNORMAL);
            const __m512 sv = _mm512_set1_ps(((const float *)scale)[srow + blk]);
            for (int64_t i = b; i < b1; i += BF_STEP) {
                _mm_prefetch((const char *)(row + i) + BF_PREFETCH, _MM_HINT_T0);
                _mm512_storeu_si512(dst + i, bf_fp8x32_f32(row + i, table, sv));
            }
        } else if (w->fmt == KV_FP8 && ok) {
            const __m512i table = bf_table_scaled(BF_E4M3_SUBNORMAL, 0xFE, E);
            for (int64_t i = b; i < b1; i += BF_STEP) {
                _mm_prefetch((const char *)(row + i) + BF_PREFETCH, _MM_HINT_T0);
                _mm512_storeu_si512(dst + i, bf_fp8x32(row + i, table, E));
            }
        } else if (w->fmt == KV_FP4 && ok) {
            for (int64_t i = b; i < b1; i += BF_STEP) {
                _mm_prefetch((const char *)(row + i / 2) + BF_PREFETCH, _MM_HINT_T0);
                _mm512_storeu_si512(dst + i, bf_fp4x32(row + i / 2, BF_E2M1_SCALED[scales[blk]]));
            }
        } else {
            for (int64_t i = b; i < b1; i++) dst[i] = bf16_of(weight_value(w, data, scale, j, i));
        }
    }
    return 1;
}

/* Up to this many rows (decode, verify, small batches) take their FP8 and FP4 weights decoded in
 * registers straight into VDPBF16PS, BF_REG_COLS columns at a time: a decoded panel costs a store
 * and a load from L2 a value, which left a decode row at two thirds of the fp32 dot's rate
 * (bench/RESULTS.md). Each output is still one accumulator over the steps in order, then
 * bf_lanes_sum: the tiles' bits. */
#define BF_REG_ROWS 4
#define BF_REG_COLS 4

/* whether a matrix's weights decode in registers: those the shortcuts take */
static inline int bf_in_registers(const kv_weights *w, int64_t m) { return m <= BF_REG_ROWS && bf_shortcuts(w); }

/* whether every block scale of the tile's rows (scale_row srow[c]) is in the shortcuts' range:
 * checked once a tile, out of the loop that decodes */
static inline int bf_scales_ok(const kv_weights *w, const void *scale, const int64_t *srow) {
    const int64_t blocks = w->k / w->bc;
    int ok = 1;
    for (int c = 0; c < BF_REG_COLS; c++)
        for (int64_t b = 0; b < blocks; b++) ok &= bf_scale_ok(w, scale, srow[c] + b);
    return ok;
}

/* out[r, c] for MR rows of xb (kp values apart) and the BF_REG_COLS columns from c0; 0 (out
 * unspecified) where a block's scale is outside the shortcuts' range */
#define BF_REG_TILE(MR)                                                                                  \
    static int bf_reg_tile_##MR(const uint16_t *xb, int64_t kp, const kv_weights *w, const uint8_t *data, \
                                const void *scale, int64_t c0, float *out, int64_t ldo) {                \
        const int fp8 = w->fmt == KV_FP8, f32 = w->scale_f32;                                           \
        const int64_t rb = weights_row_bytes(w);                                                         \
        const uint8_t *row[BF_REG_COLS];                                                                 \
        int64_t srow[BF_REG_COLS];                                                                       \
        __m512 acc[MR][BF_REG_COLS];                                                                     \
        for (int c = 0; c < BF_REG_COLS; c++) {                                                          \
            row[c] = data + (c0 + c) * rb;                                                               \
            srow[c] = scale_row(w, c0 + c);                                                              \
            for (int r = 0; r < MR; r++) acc[r][c] = _mm512_setzero_ps();                                \
        }                                                                                                \
        if (!bf_scales_ok(w, scale, srow)) return 0;                                                     \
        const uint8_t *e8 = (const uint8_t *)scale;                                                      \
        for (int64_t b = 0, blk = 0; b < w->k; b += w->bc, blk++) {                                      \
            __m512i table[BF_REG_COLS];                                                                  \
            __m512 sv[BF_REG_COLS];                                                                      \
            int E[BF_REG_COLS];                                                                          \
            for (int c = 0; c < BF_REG_COLS && fp8; c++) {                                               \
                E[c] = f32 ? 0 : (int)e8[srow[c] + blk] - 127;                                           \
                table[c] = bf_table_scaled(BF_E4M3_SUBNORMAL, 0xFE, E[c]);                               \
                if (f32) sv[c] = _mm512_set1_ps(((const float *)scale)[srow[c] + blk]);                 \
            }                                                                                            \
            const int64_t b1 = b + w->bc < w->k ? b + w->bc : w->k;                                      \
            for (int64_t i = b; i < b1; i += BF_STEP) {                                                  \
                if (!((fp8 ? i : i / 2) & 63)) prefetch_tile(row[0], fp8 ? i : i / 2, BF_REG_COLS);      \
                __m512bh bv[BF_REG_COLS];                                                                \
                for (int c = 0; c < BF_REG_COLS; c++) {                                                  \
                    const uint8_t *codes = fp8 ? row[c] + i : row[c] + i / 2;                            \
                    bv[c] = (__m512bh)(!fp8 ? bf_fp4x32(codes, BF_E2M1_SCALED[e8[srow[c] + blk]])         \
                                       : f32 ? bf_fp8x32_f32(codes, table[c], sv[c])                     \
                                             : bf_fp8x32(codes, table[c], E[c]));                        \
                }                                                                                        \
                for (int r = 0; r < MR; r++) {                                                           \
                    const __m512bh av = (__m512bh)_mm512_loadu_si512(xb + r * kp + i);                  \
                    for (int c = 0; c < BF_REG_COLS; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], av, bv[c]); \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < MR; r++)                                                                     \
            for (int c = 0; c < BF_REG_COLS; c++) out[r * ldo + c] = bf_lanes_sum(acc[r][c]);            \
        return 1;                                                                                        \
    }
BF_REG_TILE(1)
BF_REG_TILE(2)
BF_REG_TILE(4)

/* the BF_REG_COLS columns from c0 for all m rows, 4, 2 or 1 at a time; 0 as bf_reg_tile_* */
static int bf_reg_cols(const uint16_t *xb, int64_t m, int64_t kp, const kv_weights *w, const uint8_t *data,
                       const void *scale, int64_t c0, float *out, int64_t ldo) {
    const void *sc = scale;
    for (int64_t r = 0; r < m;) {
        const int64_t take = m - r >= 4 ? 4 : m - r >= 2 ? 2 : 1;
        const uint16_t *a = xb + r * kp;
        float *o = out + r * ldo + c0;
        if (!(take == 4 ? bf_reg_tile_4(a, kp, w, data, sc, c0, o, ldo)
              : take == 2 ? bf_reg_tile_2(a, kp, w, data, sc, c0, o, ldo)
                          : bf_reg_tile_1(a, kp, w, data, sc, c0, o, ldo)))
            return 0;
        r += take;
    }
    return 1;
}
#else
static int bf_decode_row_fast(const kv_weights *w, const uint8_t *data, const void *scale, int64_t j, uint16_t *dst) {
    (void)w, (void)data, (void)scale, (void)j, (void)dst;
    return 0;
}
#define BF_REG_COLS 4
static inline int bf_in_registers(const kv_weights *w, int64_t m) { (void)w, (void)m; return 0; }
static int bf_reg_cols(const uint16_t *xb, int64_t m, int64_t kp, const kv_weights *w, const uint8_t *data,
                       const void *scale, int64_t c0, float *out, int64_t ldo) {
    (void)xb, (void)m, (void)kp, (void)w, (void)data, (void)scale, (void)c0, (void)out, (void)ldo;
    return 0;
}
#endif

/* row j of the matrix as the definition's bf16 weights, dst[0 .. kp) (tmp: k floats) */
static void bf_decode_row(const kv_weights *w, const uint8_t *data, const void *scale, int64_t j, float *tmp,
                          uint16_t *dst) {
    const int64_t k = w->k;
    if (w->fmt == KV_BF16) {
        const uint16_t *src = (const uint16_t *)data + j * k;
        int64_t i = 0;
        for (; i < k; i++) dst[i] = bf16_flushed(src[i]);
        for (; i < bf_padded(k); i++) dst[i] = 0;
        return;
    }
    if ((w->fmt == KV_FP8 || w->fmt == KV_FP4) && bf_decode_row_fast(w, data, scale, j, dst)) return;
    decode_row(w, data, scale, j, tmp);
    bf16_row_of(tmp, k, dst);
}

/* the floats of panel a bf16-dot call of `block` columns needs: the rounded rows, and one float32
 * row to decode into */
static inline int64_t bf_panel_floats(const kv_weights *w, int64_t block) {
    return bf_in_place(w) ? 0 : (block * bf_padded(w->k) + 1) / 2 + w->k + 16;
}

/* out[r, j] for the columns [n0, n1), decoded a panel at a time (the rows read in place where
 * they can be) */
static void bf_panel_cols(const uint16_t *xb, int64_t m, const kv_weights *w, const uint8_t *data, const void *scale,
                          float *out, int64_t ldo, int64_t n0, int64_t n1, float *panel) {
    const int64_t k = w->k, kp = bf_padded(k);
    if (bf_in_place(w)) {
        bf_matmul(xb, kp, (const uint16_t *)data + n0 * k, k, out + n0, ldo, m, n1 - n0, kp);
        return;
    }
    float *row = panel;                        /* k floats */
    uint16_t *pb = (uint16_t *)(panel + k + 16); /* (n1 - n0) rows of kp */
    for (int64_t c = n0; c < n1; c++) bf_decode_row(w, data, scale, c, row, pb + (c - n0) * kp);
    bf_matmul(xb, kp, pb, kp, out + n0, ldo, m, n1 - n0, kp);
}

/* out[r, j] for the columns [n0, n1) of the matrix at data and scale, xb: the rows' bf16 values;
 * a few rows decode in registers, a tile a block of whose scales the shortcuts do not take, the
 * last columns short of a tile, and more rows through a panel */
static void weights_cols_bf16(const uint16_t *xb, int64_t m, const kv_weights *w, const uint8_t *data,
                              const void *scale, float *out, int64_t ldo, int64_t n0, int64_t n1, float *panel) {
    if (bf_in_registers(w, m)) {
        const int64_t kp = bf_padded(w->k);
        for (; n0 + BF_REG_COLS <= n1; n0 += BF_REG_COLS)
            if (!bf_reg_cols(xb, m, kp, w, data, scale, n0, out, ldo))
                bf_panel_cols(xb, m, w, data, scale, out, ldo, n0, n0 + BF_REG_COLS, panel);
        if (n0 == n1) return;
    }
    bf_panel_cols(xb, m, w, data, scale, out, ldo, n0, n1, panel);
}

#endif
