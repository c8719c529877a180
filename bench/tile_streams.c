/* How fast one core reads a matrix from DRAM the way a decode row's tiles do: 4 or 8 rows at a
 * time, each row a stream of its own a row apart, one fp32 fused multiply-add per weight (bf16
 * weights, 4,096 columns, a 1 GiB matrix: 32x a 32 MiB L3). Three ways to ask for lines early:
 *
 *   none       the hardware prefetcher alone;
 *   next tile  one line of each row of the tile after next, at the same column (native_weights.h
 *              before session 26);
 *   ahead D    the next lines of the matrix in memory order, D bytes on, into L2 (prefetch_tile).
 *
 * Issue 42's decode runs at the memory's rate only if each core keeps enough lines in flight; a
 * single linear read (the bench's `amax`) is the reference. GB/s of weights read, best of 3.
 *
 *   cc -O3 -march=native bench/tile_streams.c -o /tmp/tile_streams && /tmp/tile_streams  (as native.c builds)
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define COLS 4096
#define ROWS 131072 /* x 8 KiB = 1 GiB */
#define ROW_BYTES (COLS * 2)

enum { NONE, NEXT_TILE, AHEAD };

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* one pass over the matrix in tiles of `nr` rows; returns a sum so that nothing is dropped */
static float pass(const float *x, const uint16_t *w, int nr, int how, long ahead) {
    float total = 0.0f;
    for (long j = 0; j < ROWS; j += nr) {
        const char *tile = (const char *)(w + j * COLS);
        __m256 acc[8];
        for (int c = 0; c < nr; c++) acc[c] = _mm256_setzero_ps();
        for (long i = 0; i < COLS; i += 8) {
            const long off = 2 * i; /* bytes into each row */
            if (off % 64 == 0 && how == NEXT_TILE && j + 3 * nr <= ROWS)
                for (int c = 0; c < nr; c++) _mm_prefetch(tile + (2L * nr + c) * ROW_BYTES + off, _MM_HINT_T0);
            if (off % 64 == 0 && how == AHEAD)
                for (int c = 0; c < nr; c++) __builtin_prefetch(tile + nr * off + ahead + 64 * c, 0, 2);
            const __m256 xv = _mm256_loadu_ps(x + i);
            for (int c = 0; c < nr; c++) {
                const __m128i h = _mm_loadu_si128((const __m128i *)(tile + c * ROW_BYTES + off));
                const __m256 wv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
                acc[c] = _mm256_fmadd_ps(xv, wv, acc[c]);
            }
        }
        for (int c = 0; c < nr; c++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, acc[c]);
            for (int l = 0; l < 8; l++) total += lanes[l];
        }
    }
    return total;
}

static double gbs(const float *x, const uint16_t *w, int nr, int how, long ahead, float *sink) {
    double best = 1e9;
    for (int r = 0; r < 3; r++) {
        const double t = seconds();
        *sink += pass(x, w, nr, how, ahead);
        const double dt = seconds() - t;
        best = dt < best ? dt : best;
    }
    return (double)ROWS * ROW_BYTES / best / 1e9;
}

int main(void) {
    float *x = aligned_alloc(64, COLS * sizeof(float));
    uint16_t *w = aligned_alloc(64, (size_t)ROWS * ROW_BYTES);
    if (!x || !w) return 1;
    for (long i = 0; i < COLS; i++) x[i] = (float)(i % 7) - 3.0f;
    for (long i = 0; i < (long)ROWS * COLS; i++) w[i] = (uint16_t)(0x3C00 + (i * 2654435761u >> 20) % 512);
    float sink = 0.0f;
    double linear = 1e9; /* one stream: the matrix summed in order */
    for (int r = 0; r < 3; r++) {
        const double t = seconds();
        __m256i s = _mm256_setzero_si256();
        for (long i = 0; i < (long)ROWS * COLS; i += 16)
            s = _mm256_add_epi16(s, _mm256_load_si256((const __m256i *)(w + i)));
        sink += (float)_mm256_extract_epi16(s, 0);
        const double dt = seconds() - t;
        linear = dt < linear ? dt : linear;
    }
    printf("one linear stream: %.1f GB/s\n", (double)ROWS * ROW_BYTES / linear / 1e9);
    const long aheads[] = {16384, 32768, 65536, 131072, 262144};
    for (int nr = 4; nr <= 8; nr += 4) {
        printf("tiles of %d rows: none %.1f, next tile %.1f", nr, gbs(x, w, nr, NONE, 0, &sink),
               gbs(x, w, nr, NEXT_TILE, 0, &sink));
        for (int a = 0; a < 5; a++) printf(", ahead %ld KiB %.1f", aheads[a] / 1024, gbs(x, w, nr, AHEAD, aheads[a], &sink));
        printf(" GB/s\n");
    }
    return sink == 12345.0f; /* keeps the sums */
}
