/* bf16 <-> fp32 for the CPU kernels (cpu_linear_bf16.c, cpu_rope.c, attention/cpu_paged_attention.c), as scalar
 * helpers.
 * Found through cpu_build.py's include directory, whose headers are part of every kernel's cache key. */
#ifndef TREEPAGE_CPU_BF16_H
#define TREEPAGE_CPU_BF16_H

#include <stdint.h>

/* Exact: a bf16 is the upper half of an fp32. */
static inline float bf16_to_f32(uint16_t x) {
    union {
        uint32_t u;
        float f;
    } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

/* Round to nearest even, as torch rounds; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    union {
        uint32_t u;
        float f;
    } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40);
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

#endif
