/* Scalar helpers shared by kvserve's kernels, written so that gcc vectorizes loops over them. */
#ifndef KVSERVE_NUMERICS_H
#define KVSERVE_NUMERICS_H

#include <stdint.h>

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

/* Round to nearest even, as torch does; a NaN stays a (quiet) NaN. Branch-free. */
static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    const uint32_t nan = (v.u >> 16) | 0x40u;
    const uint32_t rounded = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16;
    return (uint16_t)((v.u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/* exp(x) as 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor polynomial
 * (relative error below 2e-7); x clamped to float32's range. */
static inline float exp_approx(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float n = (x * 1.44269504f + 12582912.f) - 12582912.f; /* round to nearest: 1.5 * 2^23 */
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-06f;
    float p = 1.f / 720;
    p = p * r + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

#endif
