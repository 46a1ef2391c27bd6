/* Scalar helpers shared by kvserve's kernels, written so that gcc vectorizes loops over them. */
#ifndef KVSERVE_NUMERICS_H
#define KVSERVE_NUMERICS_H

#include <stdint.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* Element formats, numbered as kvserve/kernels/__init__.py passes them (DTYPES, KV_DTYPES).
 * FMT_I8 is a KV pool format only: int8 values, one float16 scale per row of head_dim values
 * in a separate array indexed by the pool's row (kvserve/model/kv_int8.py). */
enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_F16 = 2, FMT_I8 = 3 };
static inline int fmt_bytes(int fmt) { return fmt == FMT_F32 ? 4 : fmt == FMT_I8 ? 1 : 2; } /* one element's */

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

/* IEEE half precision (the KV cache's 16-bit format where the CPU has no native bfloat16):
 * F16C's instructions where the build has them, else the same results in integer arithmetic
 * (round to nearest even; overflow to infinity; subnormals kept; a NaN stays a NaN). */
#if defined(__F16C__)
static inline float fp16_to_f32(uint16_t x) { return _cvtsh_ss(x); }
static inline uint16_t f32_to_fp16(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#else
static inline float fp16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0x1fu)
        v.u = sign | 0x7f800000u | (man << 13); /* infinity, NaN */
    else if (exp)
        v.u = sign | ((exp + 112u) << 23) | (man << 13);
    else { /* zero or subnormal: man * 2^-24, exact in float32 */
        v.f = (float)man * 5.9604644775390625e-08f;
        v.u |= sign;
    }
    return v.f;
}
static inline uint16_t f32_to_fp16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    const uint32_t sign = (v.u >> 16) & 0x8000u, a = v.u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u); /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to infinity (>= 65520) */
    if (a < 0x38800000u) { /* a half subnormal or zero: adding 0.5 leaves the count of 2^-24 steps */
        union { uint32_t u; float f; } m;
        v.u = a;
        m.f = v.f + 0.5f;
        return (uint16_t)(sign | (m.u - 0x3f000000u));
    }
    /* rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even */
    return (uint16_t)(sign | ((a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13));
}
#endif

/* n half values as float32 (the attention kernel's K/V rows). */
static inline void fp16_row_to_f32(const uint16_t *restrict src, float *restrict dst, int n) {
    int i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = fp16_to_f32(src[i]);
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
