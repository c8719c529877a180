/* What this CPU's VDPBF16PS computes, lane by lane, against exact scalar models of it.
 *
 * A bf16-activation fixed order for prefill (issue 42) would run VDPBF16PS where the CPU has
 * AVX512-BF16 and an emulation elsewhere (AVX2), so the two must give the same bits by
 * construction. Intel documents the instruction as two steps a lane, odd element first, each
 * adding one exact bf16 x bf16 product with one rounding, inputs and results flushed to zero.
 * This program draws random lanes (normal exponents, then every exponent) and counts where the
 * hardware differs from three models: that one (two fused multiply-adds, odd first), the even
 * element first, and the three terms summed with one rounding.
 *
 *   cc -O2 -mavx512f -mavx512bw -mavx512bf16 -mfma bench/bf16_dot_semantics.c -lm -o /tmp/bf16dot
 *   /tmp/bf16dot          # exponents near 0
 *   /tmp/bf16dot wide     # every exponent: underflow, overflow, infinities
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static uint64_t state = 88172645463325252ull;
static uint64_t next(void) { state ^= state << 13; state ^= state >> 7; state ^= state << 17; return state; }

static float bf16_value(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static float flush(float f) { return fpclassify(f) == FP_SUBNORMAL ? copysignf(0.0f, f) : f; }
static uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static uint16_t random_bf16(int wide) {
    uint16_t exp = wide ? (uint16_t)(next() % 255) : (uint16_t)(120 + next() % 16);
    return (uint16_t)(((next() & 1) << 15) | (exp << 7) | (next() & 0x7F));
}

static float random_acc(int wide) {
    uint32_t u = (uint32_t)next();
    uint32_t exp = wide ? (u >> 23) & 0xFF : 110 + next() % 30;
    if (exp == 255) exp = 254;
    u = (u & 0x807FFFFF) | (exp << 23);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

int main(int argc, char **argv) {
    const int wide = argc > 1;
    const long lanes = 20000000;
    long odd_first = 0, even_first = 0, one_rounding = 0, compared = 0;
    for (long done = 0; done < lanes; done += 16) {
        uint16_t a[32], b[32];
        float acc[16], hw[16];
        for (int i = 0; i < 32; i++) { a[i] = random_bf16(wide); b[i] = random_bf16(wide); }
        for (int j = 0; j < 16; j++) acc[j] = random_acc(wide);
        __m512 r = _mm512_dpbf16_ps(_mm512_loadu_ps(acc), (__m512bh)_mm512_loadu_si512(a), (__m512bh)_mm512_loadu_si512(b));
        _mm512_storeu_ps(hw, r);
        for (int j = 0; j < 16; j++) {
            const float a0 = flush(bf16_value(a[2 * j])), a1 = flush(bf16_value(a[2 * j + 1]));
            const float b0 = flush(bf16_value(b[2 * j])), b1 = flush(bf16_value(b[2 * j + 1]));
            const float c = flush(acc[j]);
            const float m_odd = flush(fmaf(a0, b0, flush(fmaf(a1, b1, c))));
            const float m_even = flush(fmaf(a1, b1, flush(fmaf(a0, b0, c))));
            const float m_one = flush((float)((double)c + (double)a1 * b1 + (double)a0 * b0));
            if (isnan(hw[j]) && isnan(m_odd)) continue;
            compared++;
            odd_first += bits(hw[j]) != bits(m_odd);
            even_first += bits(hw[j]) != bits(m_even);
            one_rounding += bits(hw[j]) != bits(m_one);
        }
    }
    printf("%s exponents, %ld lanes compared: differs from two fused steps odd first %ld, even first %ld, "
           "one rounding %ld\n", wide ? "all" : "normal", compared, odd_first, even_first, one_rounding);
    return odd_first != 0;
}
