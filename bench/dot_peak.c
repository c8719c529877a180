/* This core's peak multiply-add rate: the fp32 FMA (256- and 512-bit) and VDPBF16PS, each as
 * 12 independent accumulators in a loop (enough to cover the latency), one thread.
 *
 * Issue 42 asks for the prefill's FLOP/s against the CPU's peak. A FLOP count: an fp32 FMA is 2
 * a lane; VDPBF16PS adds two bf16 x bf16 products a lane, 4. The all-core peak is this times the
 * cores where the clock holds under load (run one copy a core to see).
 *
 *   cc -O2 -mavx512f -mavx512bf16 -mfma bench/dot_peak.c -o /tmp/dot_peak && /tmp/dot_peak
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define ACC 12
#define ITERS 200000000L

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* GFLOP/s of ITERS instructions `ACC_T acc = OP(acc)` over ACC accumulators, FLOPS each */
#define PEAK(NAME, ACC_T, SET1, OP, FLOPS)                                                       \
    static double NAME(void) {                                                                   \
        ACC_T acc[ACC];                                                                          \
        for (int i = 0; i < ACC; i++) acc[i] = SET1((float)i);                                   \
        double t = seconds();                                                                    \
        for (long n = 0; n < ITERS / ACC; n++)                                                   \
            _Pragma("GCC unroll 16") /* the accumulators stay in registers, not looped through memory */ \
            for (int i = 0; i < ACC; i++) acc[i] = OP(acc[i]);                                   \
        t = seconds() - t;                                                                       \
        float s = 0;                                                                             \
        for (int i = 0; i < ACC; i++) s += acc[i][0];                                            \
        printf("  (checksum %g)\n", s); /* the results are used: the loop is not dropped */      \
        return (double)(ITERS / ACC) * ACC * (FLOPS) / t / 1e9;                                  \
    }

#define FMA256(a) _mm256_fmadd_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(1e-9f), a)
#define FMA512(a) _mm512_fmadd_ps(_mm512_set1_ps(1.0f), _mm512_set1_ps(1e-9f), a)
#define DPBF16(a) _mm512_dpbf16_ps(a, (__m512bh)_mm512_set1_epi16(0x3F80), (__m512bh)_mm512_set1_epi16(0x3000)) /* 1 x 2^-31 */

PEAK(fma256, __m256, _mm256_set1_ps, FMA256, 8 * 2)
PEAK(fma512, __m512, _mm512_set1_ps, FMA512, 16 * 2)
PEAK(dpbf16, __m512, _mm512_set1_ps, DPBF16, 16 * 2 * 2)

int main(void) {
    printf("fp32 FMA, 256-bit: %.1f GFLOP/s a core\n", fma256());
    printf("fp32 FMA, 512-bit: %.1f GFLOP/s a core\n", fma512());
    printf("VDPBF16PS, 512-bit: %.1f GFLOP/s a core\n", dpbf16());
    return 0;
}
