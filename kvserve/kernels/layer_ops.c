/* kvserve's fused elementwise steps of a decoder layer, for CPUs.
 *
 * Each function does in one pass over memory what takes torch several ops (and several passes
 * and dispatches): residual add + RMSNorm, rotary embedding of q and k + writing k and v into
 * their KV-pool slots, and SiLU(gate) * up. Rounding follows torch's: every value torch stores
 * in the model dtype (bfloat16 or float32) is rounded here at the same point, so results equal
 * the torch path up to the order of the RMSNorm sum and the last bit of exp in SiLU.
 * Rows are spread over OpenMP threads when there are enough of them to pay for it.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_MIN_ELEMENTS 65536

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    union { uint32_t u; float f; } v;
    v.f = f;
    const uint32_t nan = (v.u >> 16) | 0x40u; /* NaN stays a (quiet) NaN */
    const uint32_t rounded = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16;
    return (uint16_t)((v.u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/* Element i of a float32 or bfloat16 array, as float32; and the value rounded to that dtype. */
static inline float get(const void *p, size_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void put(void *p, size_t i, float x, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(x);
    else
        ((float *)p)[i] = x;
}
static inline float round_to(float x, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(x)) : x; }

/* x += delta (when delta is given; rounded to the dtype), then h = w * rms_norm(x):
 * float32 statistics, h rounded to the dtype before the weight multiplies it (as the reference). */
static inline __attribute__((always_inline)) void add_rms_norm(void *x, const void *delta, const void *w, void *h,
                                                               int T, int N, float eps, const int bf16, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if ((long)T * N >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int t = 0; t < T; t++) {
        const size_t row = (size_t)t * N;
        float ss = 0.f;
        if (delta) {
#pragma omp simd reduction(+ : ss)
            for (int i = 0; i < N; i++) {
                const float v = round_to(get(x, row + i, bf16) + get(delta, row + i, bf16), bf16);
                put(x, row + i, v, bf16);
                ss += v * v;
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int i = 0; i < N; i++) {
                const float v = get(x, row + i, bf16);
                ss += v * v;
            }
        }
        const float inv = 1.f / sqrtf(ss / (float)N + eps);
#pragma omp simd
        for (int i = 0; i < N; i++)
            put(h, row + i, get(w, i, bf16) * round_to(get(x, row + i, bf16) * inv, bf16), bf16);
    }
}

/* The dtype becomes a constant in each copy, so the loops vectorize. */
int kvserve_add_rms_norm(void *x, const void *delta, const void *w, void *h, int T, int N, float eps, int bf16,
                         int nthreads) {
    if (bf16)
        add_rms_norm(x, delta, w, h, T, N, eps, 1, nthreads);
    else
        add_rms_norm(x, delta, w, h, T, N, eps, 0, nthreads);
    return 0;
}

/* Rotary embedding (rotate-half convention) of one head: out = x * cos + rotate_half(x) * sin,
 * each product and the sum rounded to the dtype as torch's three ops do. */
__attribute__((optimize("fp-contract=off"), always_inline)) static inline void rope_head(const void *x, size_t xo,
                                                                         const void *cs, const void *sn, size_t co,
                                                                         void *out, size_t oo, int D, int bf16) {
    const int half = D / 2;
#pragma omp simd
    for (int i = 0; i < D; i++) {
        const float xi = get(x, xo + i, bf16);
        const float rot = i < half ? -get(x, xo + i + half, bf16) : get(x, xo + i - half, bf16);
        const float a = round_to(xi * get(cs, co + i, bf16), bf16);
        const float b = round_to(rot * get(sn, co + i, bf16), bf16);
        put(out, oo + i, a + b, bf16);
    }
}

/* qkv [T, (H + 2 Hkv) * D] from the fused projection; cos, sin [T, D] in the model dtype.
 * Writes q_out [T, H, D] and k_out [T, Hkv, D] rotated, and each token's rotated k and its v into
 * slot slots[t] of the pool [2, Hkv, num_slots, D]. */
__attribute__((optimize("fp-contract=off"), always_inline)) static inline void rope_store(
    const void *qkv, const void *cs, const void *sn, void *q_out, void *k_out, void *kv, const int64_t *slots, int T,
    int H, int Hkv, int D, long num_slots, const int bf16, int nthreads) {
    const size_t width = (size_t)(H + 2 * Hkv) * D, esize = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) if ((long)T * width >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int t = 0; t < T; t++) {
        const size_t row = (size_t)t * width, co = (size_t)t * D;
        for (int h = 0; h < H; h++) rope_head(qkv, row + (size_t)h * D, cs, sn, co, q_out, ((size_t)t * H + h) * D, D, bf16);
        for (int h = 0; h < Hkv; h++) {
            const size_t ko = ((size_t)t * Hkv + h) * D;
            rope_head(qkv, row + (size_t)(H + h) * D, cs, sn, co, k_out, ko, D, bf16);
            char *kslot = (char *)kv + (((size_t)h * num_slots + slots[t]) * D) * esize;
            char *vslot = (char *)kv + (((size_t)(Hkv + h) * num_slots + slots[t]) * D) * esize;
            memcpy(kslot, (const char *)k_out + ko * esize, D * esize);
            memcpy(vslot, (const char *)qkv + (row + (size_t)(H + Hkv + h) * D) * esize, D * esize);
        }
    }
}

int kvserve_rope_store(const void *qkv, const void *cs, const void *sn, void *q_out, void *k_out, void *kv,
                       const int64_t *slots, int T, int H, int Hkv, int D, long num_slots, int bf16, int nthreads) {
    if (bf16)
        rope_store(qkv, cs, sn, q_out, k_out, kv, slots, T, H, Hkv, D, num_slots, 1, nthreads);
    else
        rope_store(qkv, cs, sn, q_out, k_out, kv, slots, T, H, Hkv, D, num_slots, 0, nthreads);
    return 0;
}

/* exp(x) in a form the compiler vectorizes: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p a
 * degree-6 Taylor polynomial (relative error below 2e-7); x clamped to float32's range. */
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

/* gate_up [T, 2F] (gate columns, then up columns) -> out [T, F] = silu(gate) * up, silu rounded
 * to the dtype before the product as torch's two ops do. */
__attribute__((optimize("fp-contract=off"), always_inline)) static inline void silu_mul(const void *gate_up, void *out,
                                                                                      int T, int F, const int bf16,
                                                                                      int nthreads) {
#pragma omp parallel for num_threads(nthreads) if ((long)T * F >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int t = 0; t < T; t++) {
        const size_t g = (size_t)t * 2 * F, u = g + F, o = (size_t)t * F;
#pragma omp simd
        for (int i = 0; i < F; i++) {
            const float x = get(gate_up, g + i, bf16);
            const float s = round_to(x / (1.f + exp_approx(-x)), bf16);
            put(out, o + i, s * get(gate_up, u + i, bf16), bf16);
        }
    }
}

int kvserve_silu_mul(const void *gate_up, void *out, int T, int F, int bf16, int nthreads) {
    if (bf16)
        silu_mul(gate_up, out, T, F, 1, nthreads);
    else
        silu_mul(gate_up, out, T, F, 0, nthreads);
    return 0;
}
