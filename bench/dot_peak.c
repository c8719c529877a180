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

static double fma256(void) {
    __m256 acc[ACC], a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(1e-9f);
    for (int i = 0; i < ACC; i++) acc[i] = _mm256_set1_ps((float)i);
    double t = seconds();
    for (long n = 0; n < ITERS / ACC; n++)
#pragma GCC unroll 16 /* the accumulators stay in registers (not looped through memory) */
        for (int i = 0; i < ACC; i++) acc[i] = _mm256_fmadd_ps(a, b, acc[i]);
    t = seconds() - t;
    float s = 0;
    for (int i = 0; i < ACC; i++) s += acc[i][0];
    printf("  (checksum %g)\n", s);
    return (double)(ITERS / ACC) * ACC * 8 * 2 / t / 1e9;
}

static double fma512(void) {
    __m512 acc[ACC], a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-9f);
    for (int i = 0; i < ACC; i++) acc[i] = _mm512_set1_ps((float)i);
    double t = seconds();
    for (long n = 0; n < ITERS / ACC; n++)
#pragma GCC unroll 16 /* the accumulators stay in registers (not looped through memory) */
        for (int i = 0; i < ACC; i++) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
    t = seconds() - t;
    float s = 0;
    for (int i = 0; i < ACC; i++) s += acc[i][0];
    printf("  (checksum %g)\n", s);
    return (double)(ITERS / ACC) * ACC * 16 * 2 / t / 1e9;
}

static double dpbf16(void) {
    __m512 acc[ACC];
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3F80), b = (__m512bh)_mm512_set1_epi16(0x3000); /* 1, 2^-31 */
    for (int i = 0; i < ACC; i++) acc[i] = _mm512_set1_ps((float)i);
    double t = seconds();
    for (long n = 0; n < ITERS / ACC; n++)
#pragma GCC unroll 16 /* the accumulators stay in registers (not looped through memory) */
        for (int i = 0; i < ACC; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    t = seconds() - t;
    float s = 0;
    for (int i = 0; i < ACC; i++) s += acc[i][0];
    printf("  (checksum %g)\n", s);
    return (double)(ITERS / ACC) * ACC * 32 * 2 / t / 1e9;
}

int main(void) {
    printf("fp32 FMA, 256-bit: %.1f GFLOP/s a core\n", fma256());
    printf("fp32 FMA, 512-bit: %.1f GFLOP/s a core\n", fma512());
    printf("VDPBF16PS, 512-bit: %.1f GFLOP/s a core\n", dpbf16());
    return 0;
}
