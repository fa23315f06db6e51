/* y = x @ W^T (+ bias) for bf16 x [M, K], W [N, K] (row-major, the nn.Linear layout) and few rows M, on CPU.
 *
 * Why: a decode step, a draft step or a small verify multiplies a handful of rows by every weight matrix, so it
 * should run at the speed weights stream from memory. torch's bf16 matmul for such shapes runs well below that
 * (docs/benchmarks_context.md: at one row no faster than fp32, which reads twice the bytes). Here each weight
 * row is read from memory once per call and dotted with every input row while it sits in L1.
 *
 * Accumulation is fp32, the result is rounded to bf16 once (round to nearest even), as torch's bf16 matmul
 * does; only the order of the fp32 sums differs. Work is split over groups of NR output columns; the dot products
 * use AVX512-BF16's VDPBF16PS (32 bf16 pairs per instruction). Compiled at first use by cpu_build.py.
 */
#include <stdint.h>
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

/* Whether this build computes (1) or is a stub (0, no AVX512-BF16: cpu_linear.py then never calls linear_bf16).
 * A fallback that widened bf16 to fp32 ran slower than torch's matmul on an AMX CPU and was removed. */
int linear_bf16_native(void) { return HAVE_DPBF16; }

#if HAVE_DPBF16

#define NR 4 /* output columns (weight rows) per register tile */
#define MR 4 /* input rows per register tile */

static inline float bf16_to_f32(uint16_t x) {
    union {
        uint32_t u;
        float f;
    } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    union {
        uint32_t u;
        float f;
    } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40);
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

/* acc[r][m] = dot(w row r, x row m) for r < nr, m < mr; forced inline so that nr, mr are constants and the
 * accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, const uint16_t *w, int64_t K, int nr, int mr, float acc[NR][MR]) {
    __m512 s[NR][MR];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < MR; m++) s[r][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512i wv[NR], xv[MR];
        for (int r = 0; r < nr; r++) wv[r] = _mm512_loadu_si512(w + r * K + k);
        for (int m = 0; m < mr; m++) xv[m] = _mm512_loadu_si512(x + m * K + k);
        for (int r = 0; r < nr; r++)
            for (int m = 0; m < mr; m++)
                s[r][m] = _mm512_dpbf16_ps(s[r][m], (__m512bh)wv[r], (__m512bh)xv[m]);
    }
    if (k < K) { /* the last K % 32 elements, the rest of the lanes zero */
        __mmask32 mask = (__mmask32)((1u << (K - k)) - 1u);
        __m512i wv[NR], xv[MR];
        for (int r = 0; r < nr; r++) wv[r] = _mm512_maskz_loadu_epi16(mask, w + r * K + k);
        for (int m = 0; m < mr; m++) xv[m] = _mm512_maskz_loadu_epi16(mask, x + m * K + k);
        for (int r = 0; r < nr; r++)
            for (int m = 0; m < mr; m++)
                s[r][m] = _mm512_dpbf16_ps(s[r][m], (__m512bh)wv[r], (__m512bh)xv[m]);
    }
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mr; m++) acc[r][m] = _mm512_reduce_add_ps(s[r][m]);
}

/* One group of nr (<= NR) weight rows starting at n0, against every input row, in tiles of MR rows. */
static void column_group(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M,
                         int64_t N, int64_t K, int64_t n0, int nr) {
    const uint16_t *wg = w + n0 * K;
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        int mr = M - m0 >= MR ? MR : (int)(M - m0);
        float acc[NR][MR];
        /* constant tile sizes for the common cases, so the register tile is fully unrolled */
        if (nr == NR && mr == MR)
            tile(x + m0 * K, wg, K, NR, MR, acc);
        else if (nr == NR && mr == 1)
            tile(x + m0 * K, wg, K, NR, 1, acc);
        else if (nr == NR && mr == 2)
            tile(x + m0 * K, wg, K, NR, 2, acc);
        else if (nr == NR && mr == 3)
            tile(x + m0 * K, wg, K, NR, 3, acc);
        else
            tile(x + m0 * K, wg, K, nr, mr, acc);
        for (int m = 0; m < mr; m++)
            for (int r = 0; r < nr; r++) {
                float v = acc[r][m] + (bias ? bf16_to_f32(bias[n0 + r]) : 0.0f);
                y[(m0 + m) * N + n0 + r] = f32_to_bf16(v);
            }
    }
}

void linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                 int64_t K, int nthreads) {
    int64_t groups = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (groups >= 64 && nthreads > 1)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n0 = g * NR;
        int nr = N - n0 >= NR ? NR : (int)(N - n0);
        column_group(x, w, bias, y, M, N, K, n0, nr);
    }
}
#endif
