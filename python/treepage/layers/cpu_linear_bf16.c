/* y = x @ W^T (+ bias) for bf16 x [M, K], W [N, K] (row-major, the nn.Linear layout) and few rows M, on CPU.
 *
 * Why: a decode step, a draft step or a small verify multiplies a handful of rows by every weight matrix, so it
 * should run at the speed weights stream from memory. torch's bf16 matmul for such shapes runs well below that
 * (docs/benchmarks_context.md: at one row no faster than fp32, which reads twice the bytes; on a CPU without
 * native bf16 it falls further behind from 4 rows on). Here each weight row is read from memory once per call
 * and used for every input row while it is in registers or L1.
 *
 * Three paths, all accumulating in fp32 and rounding to bf16 once (round to nearest even), as torch's bf16
 * matmul does; only the order of the fp32 sums differs:
 *  - AMX (AMX-BF16 CPUs; N % 16 == 0, K % 32 == 0, M <= 32): TDPBF16PS on tiles of 16 weight rows x 32 K,
 *    loaded in place, against the input packed in K pairs (linear_amx);
 *  - otherwise AVX512-BF16's VDPBF16PS, 32 bf16 pairs per instruction, on register tiles of NR weight rows x MR
 *    input rows (column_group);
 *  - on a CPU without AVX512-BF16 (AVX2 + FMA), register tiles of fp32 FMAs: the input rows are widened to
 *    fp32 once per call, each weight vector as it is loaded (a bf16 is the upper half of an fp32).
 * Work is split over output columns. Compiled at first use by cpu_build.py; cpu_linear.py picks the row counts
 * each path serves.
 */
#define _GNU_SOURCE /* syscall(), for the AMX permission */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#define HAVE_WIDEN 0
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_DPBF16 0
#define HAVE_WIDEN 1
#else
#define HAVE_DPBF16 0
#define HAVE_WIDEN 0
#endif

/* The path this build computes with: 2 VDPBF16PS (bf16 in hardware), 1 fp32 FMAs on widened bf16, 0 none
 * (torch's matmul keeps every shape). */
int linear_bf16_path(void) { return HAVE_DPBF16 ? 2 : HAVE_WIDEN; }

#if HAVE_DPBF16 || HAVE_WIDEN

#define NR (HAVE_DPBF16 ? 4 : 8) /* output columns (weight rows) per register tile */
#define MR (HAVE_DPBF16 ? 4 : 1) /* input rows per register tile */
/* Weights (N * K) below which a call runs on one thread: waking the pool's other thread (OMP_WAIT_POLICY=PASSIVE,
 * as the server runs) costs more than it saves on a small matrix (benchmarks_context.md). */
#define PARALLEL_MIN_WEIGHTS (1 << 20)

#if HAVE_DPBF16
typedef uint16_t xelem; /* the input rows as the tiles read them: bf16 */

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

#else
typedef float xelem; /* the input rows as the tiles read them: widened to fp32 once per call */

static inline __m256 widen8(const uint16_t *w) {
    __m128i h = _mm_loadu_si128((const __m128i *)w);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* As the VDPBF16PS tile, 8 fp32 lanes per FMA, on tiles of NR = 8 weight rows x MR = 1 input row: eight
 * independent FMA chains, whose accumulators and widened weight vectors fill AVX2's 16 registers; further
 * input rows read the group's weights again from L1. The next group's rows are prefetched: rows of a few KB
 * are too short for the hardware prefetcher to ramp up on (one row: 26 -> 20 ms per forward,
 * benchmark/bench_linear.py). */
static inline __attribute__((always_inline)) void tile(const float *x, const uint16_t *w, int64_t K, int nr,
                                                       int mr, float acc[NR][MR]) {
    __m256 s[NR][MR];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < MR; m++) s[r][m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[NR];
        if ((k & 31) == 0) /* a cache line per row: the same place in the next group's rows */
            for (int r = 0; r < nr; r++) _mm_prefetch((const char *)(w + (r + NR) * K + k), _MM_HINT_T0);
        for (int r = 0; r < nr; r++) wv[r] = widen8(w + r * K + k);
        for (int m = 0; m < mr; m++) {
            __m256 xv = _mm256_loadu_ps(x + m * K + k);
            for (int r = 0; r < nr; r++) s[r][m] = _mm256_fmadd_ps(wv[r], xv, s[r][m]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mr; m++) {
            float a = hsum8(s[r][m]);
            for (int64_t j = k; j < K; j++) a += bf16_to_f32(w[r * K + j]) * x[m * K + j]; /* K % 8 */
            acc[r][m] = a;
        }
}
#endif

/* One group of nr (<= NR) weight rows starting at n0, against every input row, in tiles of MR rows. */
static void column_group(const xelem *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M,
                         int64_t N, int64_t K, int64_t n0, int nr) {
    const uint16_t *wg = w + n0 * K;
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        int mr = M - m0 >= MR ? MR : (int)(M - m0);
        float acc[NR][MR];
        /* constant tile sizes for the common cases, so the register tile is fully unrolled */
        if (nr == NR && mr == MR)
            tile(x + m0 * K, wg, K, NR, MR, acc);
#if HAVE_DPBF16 /* MR = 4; the widening path's MR is 1 */
        else if (nr == NR && mr == 1)
            tile(x + m0 * K, wg, K, NR, 1, acc);
        else if (nr == NR && mr == 2)
            tile(x + m0 * K, wg, K, NR, 2, acc);
        else if (nr == NR && mr == 3)
            tile(x + m0 * K, wg, K, NR, 3, acc);
#endif
        else
            tile(x + m0 * K, wg, K, nr, mr, acc);
        for (int m = 0; m < mr; m++)
            for (int r = 0; r < nr; r++) {
                float v = acc[r][m] + (bias ? bf16_to_f32(bias[n0 + r]) : 0.0f);
                y[(m0 + m) * N + n0 + r] = f32_to_bf16(v);
            }
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_MAX_ROWS 32 /* input rows: two B tiles of 16 */

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Linux hands out the AMX register state only on request, once per process. */
static int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}

/* x rows [m0, m0 + mh) packed in K pairs, tile B's layout: xp[kp][m - m0][2] (row stride mh * 4 bytes). */
static void pack_pairs(const uint16_t *x, int64_t K, int64_t m0, int64_t mh, uint16_t *xp) {
    for (int64_t kp = 0; kp < K / 2; kp++)
        for (int64_t m = 0; m < mh; m++) {
            xp[(kp * mh + m) * 2] = x[(m0 + m) * K + 2 * kp];
            xp[(kp * mh + m) * 2 + 1] = x[(m0 + m) * K + 2 * kp + 1];
        }
}

/* With AMX the weights are tile A as they lie (16 weight rows x 32 K, row stride K), the input rows are tile B
 * (packed in K pairs, at most 16 rows per tile: two halves), and C[n][m] accumulates in fp32, y^T of 16 output
 * columns. A pass over K serves two blocks of 16 columns x both halves: tiles 0-3 C, 4-5 A, 6-7 B. Needs
 * N % 16 == 0, K % 32 == 0 and M <= 2 * 16. */
static void linear_amx(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M,
                       int64_t N, int64_t K, int nthreads, uint16_t *xp) {
    const int64_t M0 = M < 16 ? M : 16, M1 = M - M0;
    uint16_t *xp0 = xp, *xp1 = xp + M0 * K;
    pack_pairs(x, K, 0, M0, xp0);
    pack_pairs(x, K, M0, M1, xp1);
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16;
    cfg.colsb[0] = cfg.colsb[2] = cfg.colsb[6] = (uint16_t)(M0 * 4); /* C: fp32 per row; B: a bf16 pair per row */
    cfg.colsb[1] = cfg.colsb[3] = cfg.colsb[7] = (uint16_t)(M1 * 4);
    cfg.colsb[4] = cfg.colsb[5] = 64; /* A: 32 bf16 of K */
    if (!M1) cfg.rows[1] = cfg.rows[3] = cfg.rows[7] = 0;
    int64_t blocks = N / 16, pairs = (blocks + 1) / 2;
#pragma omp parallel num_threads(nthreads) if (N * K >= PARALLEL_MIN_WEIGHTS && nthreads > 1)
    {
        _tile_loadconfig(&cfg);
        float c[2][2][16][16]; /* [column block][half][column][row] */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            int64_t n0 = p * 32;
            int two = n0 + 16 < N;
            const uint16_t *w0 = w + n0 * K, *w1 = w0 + 16 * K;
            _tile_zero(0);
            _tile_zero(2);
            if (M1) {
                _tile_zero(1);
                _tile_zero(3);
            }
            for (int64_t k = 0; k < K; k += 32) {
                _tile_loadd(6, xp0 + k * M0, M0 * 4);
                _tile_loadd(4, w0 + k, K * 2);
                _tile_dpbf16ps(0, 4, 6);
                if (M1) {
                    _tile_loadd(7, xp1 + k * M1, M1 * 4);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (two) {
                    _tile_loadd(5, w1 + k, K * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    if (M1) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c[0][0], 64);
            if (M1) _tile_stored(1, c[0][1], 64);
            if (two) {
                _tile_stored(2, c[1][0], 64);
                if (M1) _tile_stored(3, c[1][1], 64);
            }
            for (int b = 0; b <= two; b++)
                for (int i = 0; i < 16; i++) {
                    int64_t n = n0 + b * 16 + i;
                    float add = bias ? bf16_to_f32(bias[n]) : 0.0f;
                    for (int64_t m = 0; m < M; m++)
                        y[m * N + n] = f32_to_bf16(c[b][m >= 16][i][m & 15] + add);
                }
        }
        _tile_release();
    }
}
#else
#define HAVE_AMX 0
#endif

/* Whether linear_bf16 runs on AMX tiles for shapes linear_amx accepts (cpu_linear.py sets its row limits by it). */
int linear_bf16_amx(void) {
#if HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* 0, or -1 when a scratch buffer could not be allocated (nothing written). */
int linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                int64_t K, int nthreads) {
#if HAVE_AMX
    if (M > 0 && M <= AMX_MAX_ROWS && N % 16 == 0 && K % 32 == 0 && amx_permitted()) {
        uint16_t *xp = malloc((size_t)(M * K) * sizeof *xp);
        if (!xp) return -1;
        linear_amx(x, w, bias, y, M, N, K, nthreads, xp);
        free(xp);
        return 0;
    }
#endif
#if HAVE_WIDEN
    float *xs = malloc((size_t)(M * K) * sizeof *xs);
    if (!xs && M * K > 0) return -1; /* malloc(0) may say NULL */
    for (int64_t i = 0; i < M * K; i++) xs[i] = bf16_to_f32(x[i]);
#else
    const uint16_t *xs = x;
#endif
    int64_t groups = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (N * K >= PARALLEL_MIN_WEIGHTS && nthreads > 1)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n0 = g * NR;
        int nr = N - n0 >= NR ? NR : (int)(N - n0);
        column_group(xs, w, bias, y, M, N, K, n0, nr);
    }
#if HAVE_WIDEN
    free(xs);
#endif
    return 0;
}
#endif
