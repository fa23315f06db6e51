/* Paged attention for CPU decode, tree verify, short extends and the cascade draft passes. K/V are read in place
 * through the page table, each slot row once per task, in their stored dtype (fp32 or bf16, widened to fp32 in
 * an L1-sized block buffer): no context-sized copy is ever made.
 *
 * Request b owns query rows [q_start[b], q_start[b+1]) and KV positions [0, kv_len[b]); position p lives in slot
 * table[b * table_stride + p / P] * P + p % P. Positions below full_len[b] are visible to every query of b; the
 * window [full_len[b], kv_len[b]) is visible to query j at window offset i when
 *   mask_kind 0: always,  1: i <= j (causal),  2: mask[mask_start[b] + j * nq + i] (tree; nq = window length).
 * Work is split into tasks (request, tile of queries, KV chunk), each over every kv head, so that one long
 * request still fills every thread and requests of different lengths need no padding; chunk results carry
 * (max, sum, acc) and are merged by log-sum-exp.
 *
 * Outputs: out [rows, Hq, D] fp32, and when lse != NULL the natural-log LSE [rows, Hq] (-inf: nothing visible,
 * out 0). Returns nonzero when scratch memory could not be allocated. Compiled at first use by
 * layers/cpu_build.py; without a C compiler the torch path runs instead.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#define BLK 32        /* KV positions per inner block */
#define QTILE 16      /* queries per task */
#define RT 4          /* rows per register tile */
#define MIN_CHUNK 256 /* smallest KV chunk worth a task of its own */
/* KV positions x query tokens x bytes per K/V value below which a call runs on the calling thread alone: under
 * OMP_WAIT_POLICY=PASSIVE (the server's setting) waking the pool costs 50-100 us, more than one decode query over
 * ~3,000 bf16 or ~1,500 fp32 positions takes on one thread (docs/benchmarks_context.md, run 11). */
#define PARALLEL_LOAD 6144
#define PREFETCH 1     /* blocks ahead whose slot rows are prefetched (into L2) */
#define NEG (-1e30f)  /* finite "minus infinity": masked scores never reach exp */

typedef struct {
    const void *q, *k, *v;
    int q_bf16, kv_bf16;
    const int32_t *table;
    int64_t table_stride;
    int page_shift;
    const int32_t *q_start, *kv_len, *full_len;
    int mask_kind;
    const uint8_t *mask;
    const int64_t *mask_start;
    int Hq, Hkv, D;
    float scale;
} Args;

typedef struct {
    int b, j0, j1, p0, p1; /* request, its queries [j0, j1), its KV positions [p0, p1) */
} Task;

/* exp(x) for x <= 0 in a form the compiler vectorizes: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], with the
 * classic degree-6 minimax polynomial (relative error ~1e-7). Below -87 it returns ~1e-38 instead of 0. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } e;
    e.i = ((int32_t)n + 127) << 23;
    return p * e.f;
}

/* s[u][0:BLK] = q[u] . kt[:, 0:BLK] for RT rows: RT independent vector accumulators over d. */
static inline void scores_tile(float *restrict s, const float *restrict q, const float *restrict kt, int D) {
    float acc[RT][BLK] = {{0}};
    for (int d = 0; d < D; d++) {
        const float *kd = kt + (size_t)d * BLK;
        for (int u = 0; u < RT; u++) {
            const float qd = q[(size_t)u * D + d];
#pragma omp simd
            for (int i = 0; i < BLK; i++) acc[u][i] += qd * kd[i];
        }
    }
    memcpy(s, acc, sizeof(acc));
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define DOT_PATH 1
#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vfma _mm512_fmadd_ps
#define vset1 _mm512_set1_ps
#define vstore _mm512_storeu_ps
/* Lane i of the result = the sum of the 16 lanes of v[i]: pairwise transposing adds, 45 operations in all. */
static inline __m512 hsum(const __m512 *v) {
    __m512 x[8], z[4], u[2];
    for (int k = 0; k < 8; k++) /* 128-bit lane j: [a_j0+a_j2, b_j0+b_j2, a_j1+a_j3, b_j1+b_j3] */
        x[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) /* lane j: lane-j sums of 4 vectors */
        z[k] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int k = 0; k < 2; k++) /* lanes [z0+z1, z2+z3, w0+w1, w2+w3] */
        u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * k], z[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(z[2 * k], z[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#else /* AVX2 + FMA: 8 lanes */
#define LANES 8
typedef __m256 vec;
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vfma _mm256_fmadd_ps
#define vset1 _mm256_set1_ps
#define vstore _mm256_storeu_ps
/* Lane i of the result = the sum of the 8 lanes of v[i]: two rounds of horizontal adds give each vector's sums
 * of its two 128-bit halves, then the halves are added across. */
static inline __m256 hsum(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

/* LANES consecutive values of a V row as fp32: loaded (fp32) or widened in registers (bf16, exact). Inlined with a
 * constant `bf16`, so each caller compiles to one of the two loads. */
static inline __attribute__((always_inline)) vec vload_kv(const void *row, int64_t c, const int bf16) {
    if (!bf16) return vload((const float *)row + c);
#if defined(__AVX512F__)
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + c));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + c));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#endif
}

/* s[u][0:BLK] = q[u] . k_i for nr rows against fp32 K rows in their natural layout (D a multiple of LANES): for few
 * rows (decode, cascade) this beats transposing the block first. The LANES positions of a group accumulate in
 * independent registers over d (one chain over d would wait on the FMA latency at every step); a group past nt
 * repeats the last row and its scores are overwritten. Positions i >= nt get 0. */
static void scores_dot(float *s, const float *q, int nr, const float *const *krow, int nt, int D) {
    for (int u = 0; u < nr; u++) {
        const float *qu = q + (size_t)u * D;
        float *su = s + (size_t)u * BLK;
        for (int i0 = 0; i0 < nt; i0 += LANES) {
            const float *k[LANES];
            vec acc[LANES];
            for (int i = 0; i < LANES; i++) {
                k[i] = krow[i0 + i < nt ? i0 + i : nt - 1];
                acc[i] = vzero();
            }
            for (int d = 0; d < D; d += LANES) {
                const vec qd = vload(qu + d);
                for (int i = 0; i < LANES; i++) acc[i] = vfma(qd, vload(k[i] + d), acc[i]);
            }
            vstore(su + i0, hsum(acc));
        }
        for (int i = nt; i < BLK; i++) su[i] = 0.0f;
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define HAVE_DPBF16 1
/* The same scores for bf16 queries against bf16 K with VDPBF16PS (D a multiple of 32): 32 products per
 * instruction, each exact in fp32, and no widening. q holds the model's bf16 values unscaled; the scale is
 * applied to the sums. */
static void scores_dpbf16(float *s, const uint16_t *q, int nr, const void *const *krow, int nt, int D,
                          float scale) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (int u = 0; u < nr; u++) {
        const uint16_t *qu = q + (size_t)u * D;
        float *su = s + (size_t)u * BLK;
        for (int i0 = 0; i0 < nt; i0 += 16) {
            const uint16_t *k[16];
            __m512 acc[16];
            for (int i = 0; i < 16; i++) {
                k[i] = (const uint16_t *)krow[i0 + i < nt ? i0 + i : nt - 1];
                acc[i] = _mm512_setzero_ps();
            }
            for (int d = 0; d < D; d += 32) {
                const __m512bh qd = (__m512bh)_mm512_loadu_si512(qu + d);
                for (int i = 0; i < 16; i++)
                    acc[i] = _mm512_dpbf16_ps(acc[i], qd, (__m512bh)_mm512_loadu_si512(k[i] + d));
            }
            _mm512_storeu_ps(su + i0, _mm512_mul_ps(hsum(acc), sc));
        }
        for (int i = nt; i < BLK; i++) su[i] = 0.0f;
    }
}
#else
#define HAVE_DPBF16 0
#endif

/* Rows per P.V register tile: NR rows x 4 column vectors of accumulators plus the 4 V vectors fit the register
 * file (32 vector registers with AVX-512, 16 with AVX2). */
#if defined(__AVX512F__)
#define PV_ROWS 4
#else
#define PV_ROWS 2
#endif

/* Columns [d0, d0 + nv * LANES) of NR rows: each position's V vectors are loaded (or widened) once for all NR
 * rows, and the NR * nv accumulators stay in registers over the block's positions. Every (row, column vector)
 * accumulator sums its positions in order whatever NR and nv are, so a row's result does not depend on how rows
 * or columns are blocked. */
static inline __attribute__((always_inline)) void pv_rows(float *acc, const float *p, const void *const *vrow,
                                                          int nt, int D, int d0, const int NR, const int nv,
                                                          const int bf16) {
    vec c[PV_ROWS][4];
    for (int u = 0; u < NR; u++)
        for (int w = 0; w < nv; w++) c[u][w] = vload(acc + (size_t)u * D + d0 + w * LANES);
    for (int i = 0; i < nt; i++) {
        vec v[4];
        for (int w = 0; w < nv; w++) v[w] = vload_kv(vrow[i], d0 + w * LANES, bf16);
        for (int u = 0; u < NR; u++) {
            const vec pi = vset1(p[u * BLK + i]);
            for (int w = 0; w < nv; w++) c[u][w] = vfma(pi, v[w], c[u][w]);
        }
    }
    for (int u = 0; u < NR; u++)
        for (int w = 0; w < nv; w++) vstore(acc + (size_t)u * D + d0 + w * LANES, c[u][w]);
}

/* One tile of NR rows over every column: 4 column vectors at a time, then 1. */
static inline __attribute__((always_inline)) void pv_tile_rows(float *acc, const float *p, const void *const *vrow,
                                                               int nt, int D, const int NR, const int bf16) {
    int d0 = 0;
    for (; d0 + 4 * LANES <= D; d0 += 4 * LANES) pv_rows(acc, p, vrow, nt, D, d0, NR, 4, bf16);
    for (; d0 < D; d0 += LANES) pv_rows(acc, p, vrow, nt, D, d0, NR, 1, bf16);
}

/* acc[u][0:D] += sum_i p[u][i] * v_i[0:D] for the dot path's nr rows (unpadded), against V rows in place in the
 * cache, PV_ROWS rows at a time (the last tile takes what is left). */
static inline __attribute__((always_inline)) void pv_dot(float *acc, const float *p, int nr,
                                                         const void *const *vrow, int nt, int D, const int bf16) {
    int u = 0;
    for (; u + PV_ROWS <= nr; u += PV_ROWS)
        pv_tile_rows(acc + (size_t)u * D, p + (size_t)u * BLK, vrow, nt, D, PV_ROWS, bf16);
    switch (nr - u) {
#if PV_ROWS > 2
    case 3: pv_tile_rows(acc + (size_t)u * D, p + (size_t)u * BLK, vrow, nt, D, 3, bf16); break;
#endif
#if PV_ROWS > 1
    case 2: pv_tile_rows(acc + (size_t)u * D, p + (size_t)u * BLK, vrow, nt, D, 2, bf16); break;
#endif
    case 1: pv_tile_rows(acc + (size_t)u * D, p + (size_t)u * BLK, vrow, nt, D, 1, bf16); break;
    default: break;
    }
}

/* The dot path's P.V, compiled once per V dtype. */
static void pv_dot_f32(float *acc, const float *p, int nr, const void *const *vrow, int nt, int D) {
    pv_dot(acc, p, nr, vrow, nt, D, 0);
}
static void pv_dot_bf16(float *acc, const float *p, int nr, const void *const *vrow, int nt, int D) {
    pv_dot(acc, p, nr, vrow, nt, D, 1);
}
#else
#define DOT_PATH 0
#define HAVE_DPBF16 0
#define LANES 1 /* only named by the (always false) dot-path condition */
#endif

/* acc[u][0:D] += sum_i p[u][i] * v_i[0:D] for RT rows. With D a multiple of 16, 16 columns at a time whose RT
 * vector accumulators stay in registers across the block. */
static inline void pv_tile(float *restrict acc, const float *restrict p, const float *const *vrow, int nt, int D) {
    if (D % 16) {
        for (int i = 0; i < nt; i++)
            for (int u = 0; u < RT; u++)
                for (int d = 0; d < D; d++) acc[(size_t)u * D + d] += p[u * BLK + i] * vrow[i][d];
        return;
    }
    for (int d0 = 0; d0 < D; d0 += 16) {
        float a[RT][16];
        for (int u = 0; u < RT; u++)
#pragma omp simd
            for (int l = 0; l < 16; l++) a[u][l] = acc[(size_t)u * D + d0 + l];
        for (int i = 0; i < nt; i++) {
            const float *restrict v = vrow[i] + d0;
            for (int u = 0; u < RT; u++) {
                const float pu = p[u * BLK + i];
#pragma omp simd
                for (int l = 0; l < 16; l++) a[u][l] += pu * v[l];
            }
        }
        for (int u = 0; u < RT; u++)
#pragma omp simd
            for (int l = 0; l < 16; l++) acc[(size_t)u * D + d0 + l] = a[u][l];
    }
}

/* The slot of position pos through a request's page-table row (pages of 1 << page_shift positions). */
static inline int64_t slot_of(const int32_t *row, int page_shift, int pos) {
    return (((int64_t)row[pos >> page_shift]) << page_shift) | (pos & ((1 << page_shift) - 1));
}

/* Query rows of one kv head in a task, padded to whole register tiles. */
static inline int rows_padded(const Task *t, int G) { return ((t->j1 - t->j0) * G + RT - 1) / RT * RT; }

/* One task: queries [j0, j1) of request b (all heads) against its KV positions [p0, p1), BLK positions at a time.
 * The dot path (few rows per kv head) reads each block's K and V rows in place in the cache. The tile path reads
 * each block's slot rows (every kv head, contiguous in the cache) once: K transposed into kt[c][i]
 * (c = head * D + d), V in place (fp32) or widened into vbuf (bf16). Rows of kv head h are rr = (j - j0) * G + g,
 * padded to a multiple of RT (padding rows have q = 0 and p = 0); m/l/acc row index = h * nrp + rr. */
static int run_task(const Args *a, const Task *t, float *m_out, float *l_out, float *acc) {
    const int Hq = a->Hq, Hkv = a->Hkv, D = a->D, G = Hq / Hkv, b = t->b;
    const int nj = t->j1 - t->j0, nrh = nj * G, nrp = rows_padded(t, G);
    const int full = a->full_len[b], nwin = a->kv_len[b] - full;
    const int64_t m0 = a->mask_kind == 2 ? a->mask_start[b] : 0;
    const int64_t ss = (int64_t)Hkv * D; /* slot stride in elements */
    const int32_t *row = a->table + b * a->table_stride;
    const int dot = DOT_PATH && D % LANES == 0 && nrh < 16;
    /* bf16 queries against bf16 K on a CPU with VDPBF16PS: the scores from the bf16 values as they are. */
    const int dp = HAVE_DPBF16 && dot && a->q_bf16 && a->kv_bf16 && D % 32 == 0;
    /* Block buffers: the tile path's transposed K (kt) and widened V (vbuf); the dot path's widened K (kbuf, in kt's
     * place) for bf16 K without dp. The dot path reads V, and fp32 or dp K, in place. */
    const size_t bn = (size_t)BLK * ss, nkt = !dot || (a->kv_bf16 && !dp) ? bn : 0, nvb = dot ? 0 : bn;
    const size_t qn = (size_t)Hkv * nrp * D, qbn = dp ? (qn + 1) / 2 : 0;
    float *qf = calloc(qn + nkt + nvb + (size_t)nrp * BLK + (size_t)nj * BLK + qbn, sizeof(float));
    if (!qf) return 1;
    float *kt = qf + qn, *vbuf = kt + nkt, *s = vbuf + nvb, *vis = s + (size_t)nrp * BLK, *kbuf = kt;
    uint16_t *qb = (uint16_t *)(vis + (size_t)nj * BLK); /* dp: the bf16 queries, unscaled, laid out as qf */
    const int esz = a->kv_bf16 ? 2 : 4;
    for (int j = t->j0; j < t->j1; j++)
        for (int hq = 0; hq < Hq; hq++) {
            const int64_t src = ((int64_t)(a->q_start[b] + j) * Hq + hq) * D;
            const size_t at = ((size_t)(hq / G) * nrp + (size_t)(j - t->j0) * G + hq % G) * D;
            for (int d = 0; d < D; d++)
                qf[at + d] = (a->q_bf16 ? bf16_to_f32(((const uint16_t *)a->q)[src + d])
                                        : ((const float *)a->q)[src + d]) * a->scale;
            if (dp) memcpy(qb + at, (const uint16_t *)a->q + src, sizeof(uint16_t) * (size_t)D);
        }
    for (int r = 0; r < Hkv * nrp; r++) {
        m_out[r] = NEG;
        l_out[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)Hkv * nrp * D);
    const float *vrow[BLK];
#if DOT_PATH
    const void *kraw[BLK], *vraw[BLK]; /* the dot path's rows of one kv head: K (dp) and V in the cache */
#endif
    int64_t off[BLK];
    for (int pb = t->p0; pb < t->p1; pb += BLK) {
        const int nt = t->p1 - pb < BLK ? t->p1 - pb : BLK;
        for (int i = 0; i < nt; i++) {
            const int pos = pb + i;
            off[i] = slot_of(row, a->page_shift, pos) * ss;
        }
        /* Ask for the next block's slot rows early, scattered (page 1) or consecutive alike: the hardware
         * prefetcher alone left a batch-8 decode at 2,048 positions a third slower (docs/benchmarks_context.md). */
        const int f0 = pb + PREFETCH * BLK, f1 = f0 + BLK < t->p1 ? f0 + BLK : t->p1;
        for (int pos = f0; pos < f1; pos++) {
            const int64_t o = slot_of(row, a->page_shift, pos) * ss * esz;
            for (int64_t c = 0; c < ss * esz; c += 64) {
                __builtin_prefetch((const char *)a->k + o + c, 0, 1);
                __builtin_prefetch((const char *)a->v + o + c, 0, 1);
            }
        }
        if (dot) { /* bf16 K rows widened into kbuf (dp reads them as they are) */
            if (a->kv_bf16 && !dp)
                for (int i = 0; i < nt; i++) {
                    const uint16_t *k = (const uint16_t *)a->k + off[i];
#pragma omp simd
                    for (int64_t c = 0; c < ss; c++) kbuf[i * ss + c] = bf16_to_f32(k[c]);
                }
        } else { /* K transposed into kt[c][i] */
            for (int i = 0; i < nt; i++) {
                if (a->kv_bf16) {
                    const uint16_t *k = (const uint16_t *)a->k + off[i], *v = (const uint16_t *)a->v + off[i];
                    for (int64_t c = 0; c < ss; c++) kt[c * BLK + i] = bf16_to_f32(k[c]);
#pragma omp simd
                    for (int64_t c = 0; c < ss; c++) vbuf[i * ss + c] = bf16_to_f32(v[c]);
                } else {
                    const float *k = (const float *)a->k + off[i];
                    for (int64_t c = 0; c < ss; c++) kt[c * BLK + i] = k[c];
                }
            }
            for (int i = nt; i < BLK; i++)
                for (int64_t c = 0; c < ss; c++) kt[c * BLK + i] = 0.0f;
        }
        for (int jj = 0; jj < nj; jj++)
            for (int i = 0; i < BLK; i++) {
                const int pos = pb + i, w = pos - full, j = t->j0 + jj;
                int ok = i < nt && (w < 0 || a->mask_kind == 0 || (a->mask_kind == 1 && w <= j) ||
                                    (a->mask_kind == 2 && a->mask[m0 + (int64_t)j * nwin + w]));
                vis[jj * BLK + i] = ok ? 1.0f : 0.0f;
            }
        for (int h = 0; h < Hkv; h++) {
            const float *qh = qf + (size_t)h * nrp * D;
#if DOT_PATH
            if (dot) {
                for (int i = 0; i < nt; i++) {
                    kraw[i] = (const char *)a->k + (off[i] + (int64_t)h * D) * esz;
                    vraw[i] = (const char *)a->v + (off[i] + (int64_t)h * D) * esz;
                }
#if HAVE_DPBF16
                if (dp)
                    scores_dpbf16(s, qb + (size_t)h * nrp * D, nrh, kraw, nt, D, a->scale);
                else
#endif
                {
                    const float *krow[BLK];
                    for (int i = 0; i < nt; i++)
                        krow[i] = a->kv_bf16 ? kbuf + i * ss + (int64_t)h * D : (const float *)kraw[i];
                    scores_dot(s, qh, nrh, krow, nt, D);
                }
            } else
#endif
                for (int r0 = 0; r0 < nrp; r0 += RT)
                    scores_tile(s + (size_t)r0 * BLK, qh + (size_t)r0 * D, kt + (size_t)h * D * BLK, D);
            /* Online softmax, one vector per row over the block; the probabilities overwrite s. */
            for (int rr = 0; rr < nrh; rr++) {
                const int r = h * nrp + rr;
                float *sr = s + (size_t)rr * BLK;
                const float *vj = vis + (rr / G) * BLK;
                float bm = NEG;
#pragma omp simd reduction(max : bm)
                for (int i = 0; i < BLK; i++) {
                    const float x = vj[i] != 0.0f ? sr[i] : NEG;
                    bm = x > bm ? x : bm;
                }
                if (bm == NEG) { /* nothing visible in this block */
                    memset(sr, 0, sizeof(float) * BLK);
                    continue;
                }
                const float mn = bm > m_out[r] ? bm : m_out[r];
                const float alpha = exp_nonpos(m_out[r] - mn);
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int i = 0; i < BLK; i++) {
                    const float e = vj[i] * exp_nonpos((vj[i] != 0.0f ? sr[i] : mn) - mn);
                    sr[i] = e;
                    sum += e;
                }
                l_out[r] = l_out[r] * alpha + sum;
                m_out[r] = mn;
                if (alpha != 1.0f) {
                    float *ar = acc + (size_t)r * D;
#pragma omp simd
                    for (int d = 0; d < D; d++) ar[d] *= alpha;
                }
            }
            memset(s + (size_t)nrh * BLK, 0, sizeof(float) * (size_t)(nrp - nrh) * BLK);
#if DOT_PATH
            if (dot)
                (a->kv_bf16 ? pv_dot_bf16 : pv_dot_f32)(acc + (size_t)h * nrp * D, s, nrh, vraw, nt, D);
            else
#endif
            {
                for (int i = 0; i < nt; i++)
                    vrow[i] = (a->kv_bf16 ? vbuf + i * ss : (const float *)a->v + off[i]) + (int64_t)h * D;
                for (int r0 = 0; r0 < nrp; r0 += RT)
                    pv_tile(acc + ((size_t)h * nrp + r0) * D, s + (size_t)r0 * BLK, vrow, nt, D);
            }
        }
    }
    free(qf);
    return 0;
}

int paged_attention(const void *q, int q_bf16, const void *k_cache, const void *v_cache, int kv_bf16,
                    const int32_t *table, int64_t table_stride, int P, const int32_t *q_start,
                    const int32_t *kv_len, const int32_t *full_len, int mask_kind, const uint8_t *mask,
                    const int64_t *mask_start, int B, int Hq, int Hkv, int D, float scale, float *out, float *lse,
                    int nthreads) {
    Args a = {q, k_cache, v_cache, q_bf16, kv_bf16, table, table_stride, 0, q_start, kv_len, full_len,
              mask_kind, mask, mask_start, Hq, Hkv, D, scale};
    while ((1 << a.page_shift) < P) a.page_shift++; /* P is a power of two (the allocator checks) */
    /* KV chunk length: at least MIN_CHUNK, short enough for ~4 tasks per thread over the whole batch. */
    int64_t work = 0, load = 0;
    for (int b = 0; b < B; b++) {
        work += (int64_t)kv_len[b] * ((q_start[b + 1] - q_start[b] + QTILE - 1) / QTILE);
        load += (int64_t)kv_len[b] * (q_start[b + 1] - q_start[b]);
    }
    /* Small calls stay on this thread: waking the pool costs more than they do (and much more on a busy host). */
    const int parallel = nthreads > 1 && load * (kv_bf16 ? 2 : 4) >= PARALLEL_LOAD;
    int64_t chunk = (work + 4 * (int64_t)nthreads - 1) / (4 * (int64_t)nthreads);
    chunk = chunk < MIN_CHUNK ? MIN_CHUNK : (chunk + BLK - 1) / BLK * BLK;
    int64_t ntasks = 0, ngroups = 0;
    for (int b = 0; b < B; b++) {
        const int64_t nt = (q_start[b + 1] - q_start[b] + QTILE - 1) / QTILE;
        ntasks += nt * (kv_len[b] > 0 ? (kv_len[b] + chunk - 1) / chunk : 1);
        ngroups += nt;
    }
    Task *tasks = malloc(sizeof(Task) * (size_t)(ntasks + 1));
    int64_t *group_first = malloc(sizeof(int64_t) * (size_t)(ngroups + 1));
    const int G = Hq / Hkv;
    const int64_t per_task = (int64_t)Hkv * ((QTILE * G + RT - 1) / RT * RT) * (D + 2);
    float *scratch = malloc(sizeof(float) * (size_t)(ntasks * per_task + 1));
    if (!tasks || !group_first || !scratch) {
        free(tasks);
        free(group_first);
        free(scratch);
        return 1;
    }
    int64_t n = 0, gi = 0;
    for (int b = 0; b < B; b++) {
        const int nq = q_start[b + 1] - q_start[b];
        for (int j0 = 0; j0 < nq; j0 += QTILE) {
            group_first[gi++] = n;
            const int j1 = j0 + QTILE < nq ? j0 + QTILE : nq;
            int p0 = 0;
            do {
                const int p1 = p0 + chunk < kv_len[b] ? p0 + (int)chunk : kv_len[b];
                tasks[n++] = (Task){b, j0, j1, p0, p1};
                p0 = p1;
            } while (p0 < kv_len[b]);
        }
    }
    group_first[gi] = n;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (parallel)
    for (int64_t i = 0; i < ntasks; i++) {
        const int nr = Hkv * rows_padded(&tasks[i], G);
        float *m = scratch + i * per_task, *l = m + nr, *acc = l + nr;
        if (run_task(&a, &tasks[i], m, l, acc)) {
#pragma omp atomic write
            failed = 1;
        }
    }
    if (failed) {
        free(tasks);
        free(group_first);
        free(scratch);
        return 1;
    }
    /* Merge the KV chunks of each query tile by log-sum-exp. */
#pragma omp parallel for schedule(static) num_threads(nthreads) if (parallel)
    for (int64_t g = 0; g < ngroups; g++) {
        const Task *t0 = &tasks[group_first[g]];
        const int nrp = rows_padded(t0, G), nr = Hkv * nrp;
        for (int r = 0; r < nr; r++) {
            const int h = r / nrp, rr = r % nrp;
            if (rr >= (t0->j1 - t0->j0) * G) continue; /* padding row */
            float mx = NEG;
            for (int64_t i = group_first[g]; i < group_first[g + 1]; i++) {
                const float mi = scratch[i * per_task + r];
                mx = mi > mx ? mi : mx;
            }
            float l = 0.0f;
            const int64_t row = q_start[t0->b] + t0->j0 + rr / G, head = h * G + rr % G;
            float *o = out + (row * Hq + head) * D;
            memset(o, 0, sizeof(float) * (size_t)D);
            for (int64_t i = group_first[g]; i < group_first[g + 1]; i++) {
                const float *base = scratch + i * per_task;
                const float li = base[nr + r];
                if (li == 0.0f) continue;
                const float w = exp_nonpos(base[r] - mx);
                const float *ai = base + 2 * nr + (int64_t)r * D;
                l += li * w;
#pragma omp simd
                for (int d = 0; d < D; d++) o[d] += w * ai[d];
            }
            if (l > 0.0f) {
                const float inv = 1.0f / l;
#pragma omp simd
                for (int d = 0; d < D; d++) o[d] *= inv;
            }
            if (lse) lse[row * Hq + head] = l > 0.0f ? mx + logf(l) : -INFINITY;
        }
    }
    free(tasks);
    free(group_first);
    free(scratch);
    return 0;
}
