/* The rotary embedding for CPU: out = x * cos + swap_halves(x) * sin for every head row of q or k, fp32 or bf16.
 *
 * Why: the torch path (rope.py, _rotate) takes seven ops per tensor, each a pass over [T, H, D] (in bf16 a
 * widened fp32 copy, the swapped halves, two products, a sum and the narrowing back); per layer of a decode step
 * their dispatch costs more than the arithmetic, and in a long prefill their copies move several times the bytes
 * of q and k. Here each value is read once and written once.
 *
 * Exactly the torch path's values: the math is in fp32 in the same order, each product and the sum rounded on its
 * own, and bf16 is rounded once at the end to nearest even (cpu_bf16.h), as torch rounds. Each product is a
 * statement of its own, so no compiler fuses it into a multiply-add with the sum (GCC does not contract at all
 * under cpu_build.py's -std=c11; clang contracts only within one expression).
 *
 * Tables are rope.py's: full head width, [cos, cos] and [-sin, sin] per position, fp32. Rows of x may be strided
 * (the fused q/k/v projection's views); out is contiguous [T, H, D]. Compiled at first use by cpu_build.py.
 */
#include <stdint.h>

#include "cpu_bf16.h"

/* Values below which a call runs on one thread: waking the pool's other thread costs more than a decode step's
 * rotation takes. */
#define PARALLEL_MIN_VALUES (1 << 16)

static void rotate_f32(const float *x, float *out, int64_t half, const float *c, const float *s) {
    for (int64_t j = 0; j < half; j++) {
        float a = x[j], b = x[j + half];
        float lo = a * c[j], lo_swap = b * s[j];
        float hi = b * c[j + half], hi_swap = a * s[j + half];
        out[j] = lo + lo_swap;
        out[j + half] = hi + hi_swap;
    }
}

static void rotate_bf16(const uint16_t *x, uint16_t *out, int64_t half, const float *c, const float *s) {
    for (int64_t j = 0; j < half; j++) {
        float a = bf16_to_f32(x[j]), b = bf16_to_f32(x[j + half]);
        float lo = a * c[j], lo_swap = b * s[j];
        float hi = b * c[j + half], hi_swap = a * s[j + half];
        out[j] = f32_to_bf16(lo + lo_swap);
        out[j + half] = f32_to_bf16(hi + hi_swap);
    }
}

static void rotate_row(const void *x, void *out, int bf16, int64_t r, int64_t H, int64_t D, int64_t stride_t,
                       int64_t stride_h, const float *cos, const float *sin, const int64_t *pos) {
    int64_t t = r / H, h = r % H, src = t * stride_t + h * stride_h;
    const float *c = cos + pos[t] * D, *s = sin + pos[t] * D;
    if (bf16)
        rotate_bf16((const uint16_t *)x + src, (uint16_t *)out + r * D, D / 2, c, s);
    else
        rotate_f32((const float *)x + src, (float *)out + r * D, D / 2, c, s);
}

/* x [T, H, D] with element strides (stride_t, stride_h, 1); pos [T] rows of the tables cos/sin [*, D]. A small
 * call does not enter an OpenMP region at all, not even one of one thread. */
void rope_rotate(const void *x, void *out, int bf16, int64_t T, int64_t H, int64_t D, int64_t stride_t,
                 int64_t stride_h, const float *cos, const float *sin, const int64_t *pos, int nthreads) {
    int64_t rows = T * H;
    if (rows * D < PARALLEL_MIN_VALUES || nthreads < 2) {
        for (int64_t r = 0; r < rows; r++) rotate_row(x, out, bf16, r, H, D, stride_t, stride_h, cos, sin, pos);
        return;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) rotate_row(x, out, bf16, r, H, D, stride_t, stride_h, cos, sin, pos);
}
