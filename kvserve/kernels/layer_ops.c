/* kvserve's fused elementwise steps of a decoder layer, for CPUs.
 *
 * Each function does in one pass over memory what takes torch several ops (and several passes
 * and dispatches): residual add + RMSNorm, rotary embedding of q and k + writing k and v into
 * their KV-pool slots. Rounding follows torch's: every value torch stores in the model dtype
 * (bfloat16 or float32) is rounded here at the same point, so results equal the torch path up
 * to the order of the RMSNorm sum. For float32 activations also SiLU * up and the RoPE tables: not
 * faster than torch's, but the same arithmetic as decode_step.c's native step, so the per-op path
 * and the native step give the same bits.
 * Rows are spread over OpenMP threads when there are enough of them to pay for it.
 */
/* No fused multiply-add: torch rounds each product before the sum, and so must we. */
#pragma GCC optimize("fp-contract=off")

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "numerics.h"

#define PARALLEL_MIN_ELEMENTS 65536

/* Each exported function has one parallel loop per dtype, the dtype a literal inside it: OpenMP
 * outlines the loop body before constants propagate, and a dtype read at run time leaves gcc
 * vectorizing both branches with masked loads, several times slower. */
#define PARALLEL_ROWS _Pragma("omp parallel for num_threads(nthreads) if (work >= PARALLEL_MIN_ELEMENTS)")

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
static inline __attribute__((always_inline)) void add_rms_norm_row(void *x, const void *delta, const void *w, void *h,
                                                                   int t, int N, float eps, const int bf16) {
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
    for (int i = 0; i < N; i++) put(h, row + i, get(w, i, bf16) * round_to(get(x, row + i, bf16) * inv, bf16), bf16);
}

/* a . b over n values in eight lanes of fixed order (the rest into the first): the same bits in every build
 * and every caller, however the compiler vectorizes (an omp simd reduction's order is the compiler's). */
static inline __attribute__((always_inline)) float dot_lanes(const float *a, const float *b, int n) {
    float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) lane[j] += a[i + j] * b[i + j];
    for (; i < n; i++) lane[0] += a[i] * b[i];
    return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

/* x[D] = w * rms_norm(x) in place, float32: one query or key head's norm (Qwen3). The per-op path (kvserve_head_norms)
 * and the native step call it from different builds, hence dot_lanes. */
static inline __attribute__((always_inline)) void rms_norm_head(float *x, const float *w, int D, float eps) {
    const float ss = dot_lanes(x, x, D);
    const float inv = 1.f / sqrtf(ss / (float)D + eps);
#pragma omp simd
    for (int i = 0; i < D; i++) x[i] = w[i] * (x[i] * inv);
}

/* Each query head and each key head of qkv [T, (H + 2 Hkv) * D] float32 normed in place (rms_norm_head). */
int kvserve_head_norms(float *qkv, const float *q_norm, const float *k_norm, int T, int H, int Hkv, int D, float eps) {
    for (int t = 0; t < T; t++) {
        float *row = qkv + (size_t)t * (H + 2 * Hkv) * D;
        for (int g = 0; g < H + Hkv; g++) rms_norm_head(row + (size_t)g * D, g < H ? q_norm : k_norm, D, eps);
    }
    return 0;
}

int kvserve_add_rms_norm(void *x, const void *delta, const void *w, void *h, int T, int N, float eps, int bf16,
                         int nthreads) {
    const long work = (long)T * N;
    if (bf16) {
        PARALLEL_ROWS
        for (int t = 0; t < T; t++) add_rms_norm_row(x, delta, w, h, t, N, eps, 1);
    } else {
        PARALLEL_ROWS
        for (int t = 0; t < T; t++) add_rms_norm_row(x, delta, w, h, t, N, eps, 0);
    }
    return 0;
}

/* Rotary embedding (rotate-half convention) of one head: out = x * cos + rotate_half(x) * sin,
 * each product and the sum rounded to the dtype as torch's three ops do. */
__attribute__((always_inline)) static inline void rope_head(const void *x, size_t xo,
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

/* The widest head an int8 pool row is quantized for (the attention kernel's limit too). */
#define MAX_I8_D 256

/* A row of D float32 values as int8 with one float16 scale s = absmax / 127: q = round(x / s),
 * clamped to +-127, with s as stored (so q * s is what attention reads back); round half to
 * even, as torch.round. A row of zeros stores scale 0 and zeros. kvserve/model/kv_int8.py is
 * the torch reference, and gives the same bytes. */
static inline void quantize_row_i8(const float *restrict x, int D, int8_t *restrict q, uint16_t *restrict scale) {
    float amax = 0.f;
    for (int i = 0; i < D; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const uint16_t h = f32_to_fp16(amax / 127.f);
    const float s = fp16_to_f32(h);
    *scale = h;
    if (s == 0.f) {
        memset(q, 0, (size_t)D);
        return;
    }
#pragma omp simd
    for (int i = 0; i < D; i++) {
        float v = x[i] / s;
        v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
        q[i] = (int8_t)(int)((v + 12582912.f) - 12582912.f); /* 1.5 * 2^23: round to nearest even */
    }
}

/* A row of D values in the model's dtype, stored into a pool slot in the pool's format: a copy
 * when they are the same, else converted through float32 (float32 activations, a 16-bit pool;
 * an int8 pool quantizes the row and writes its scale into *scale). */
static inline void store_row(char *dst, uint16_t *scale, const char *src, int D, const int bf16, const int kv_fmt) {
    if (kv_fmt == bf16) { /* FMT_F32 = 0 and FMT_BF16 = 1: the bf16 flag is the model dtype's format */
        memcpy(dst, src, (size_t)D * (bf16 ? 2 : 4));
        return;
    }
    if (kv_fmt == FMT_I8) {
        float row[MAX_I8_D];
        for (int i = 0; i < D; i++) row[i] = get(src, i, bf16);
        quantize_row_i8(row, D, (int8_t *)dst, scale);
        return;
    }
    for (int i = 0; i < D; i++) {
        const float x = get(src, i, bf16);
        if (kv_fmt == FMT_F16)
            ((uint16_t *)dst)[i] = f32_to_fp16(x);
        else
            put(dst, i, x, kv_fmt);
    }
}

/* Row t's query heads of KV head h rotated into q_out, its key head h rotated into k_out, and that key and
 * its value into slot slots[t] of the pool (each group's outputs apart, so groups may go to different threads). */
__attribute__((always_inline)) static inline void rope_store_group(const void *qkv, const void *cs, const void *sn,
                                                                  void *q_out, void *k_out, void *kv, uint16_t *kv_scale,
                                                                  const int64_t *slots, int t, int h, int H, int Hkv,
                                                                  int D, long num_slots, const int bf16, const int kv_fmt) {
    const size_t width = (size_t)(H + 2 * Hkv) * D, esize = bf16 ? 2 : 4;
    const size_t kv_esize = fmt_bytes(kv_fmt);
    const size_t row = (size_t)t * width, co = (size_t)t * D;
    const int G = H / Hkv;
    for (int g = h * G; g < (h + 1) * G; g++) rope_head(qkv, row + (size_t)g * D, cs, sn, co, q_out, ((size_t)t * H + g) * D, D, bf16);
    const size_t ko = ((size_t)t * Hkv + h) * D;
    rope_head(qkv, row + (size_t)(H + h) * D, cs, sn, co, k_out, ko, D, bf16);
    const size_t krow = (size_t)h * num_slots + slots[t], vrow = (size_t)(Hkv + h) * num_slots + slots[t];
    char *kslot = (char *)kv + krow * D * kv_esize, *vslot = (char *)kv + vrow * D * kv_esize;
    /* an int8 pool's scales: one per pool row, at the row's own index */
    store_row(kslot, kv_scale ? kv_scale + krow : NULL, (const char *)k_out + ko * esize, D, bf16, kv_fmt);
    store_row(vslot, kv_scale ? kv_scale + vrow : NULL, (const char *)qkv + (row + (size_t)(H + Hkv + h) * D) * esize, D,
              bf16, kv_fmt);
}

__attribute__((always_inline)) static inline void rope_store_row(const void *qkv, const void *cs, const void *sn,
                                                                void *q_out, void *k_out, void *kv, uint16_t *kv_scale,
                                                                const int64_t *slots, int t, int H, int Hkv, int D,
                                                                long num_slots, const int bf16, const int kv_fmt) {
    for (int h = 0; h < Hkv; h++)
        rope_store_group(qkv, cs, sn, q_out, k_out, kv, kv_scale, slots, t, h, H, Hkv, D, num_slots, bf16, kv_fmt);
}

/* qkv [T, (H + 2 Hkv) * D] from the fused projection; cos, sin [T, D] in the model dtype.
 * Writes q_out [T, H, D] and k_out [T, Hkv, D] rotated, and each token's rotated k and its v into
 * slot slots[t] of the pool [2, Hkv, num_slots, D], whose format kv_fmt (0 float32, 1 bfloat16,
 * 2 float16, 3 int8) need not be the model's; an int8 pool's row scales go into kv_scale
 * [2, Hkv, num_slots] (float16; NULL for the float formats). Returns 0; -1 for a format or head
 * size it does not take; -3 (and writes nothing) when a slot lies outside the pool. */
int kvserve_rope_store(const void *qkv, const void *cs, const void *sn, void *q_out, void *k_out, void *kv,
                       void *kv_scale, const int64_t *slots, int T, int H, int Hkv, int D, long num_slots, int bf16,
                       int kv_fmt, int nthreads) {
    if (kv_fmt < FMT_F32 || kv_fmt > FMT_I8 || (kv_fmt == FMT_I8 && (!kv_scale || D > MAX_I8_D))) return -1;
    for (int t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -3; /* would write outside the pool: write nothing */
    const long work = (long)T * (H + 2 * Hkv) * D;
#define ROWS(BF16, KVF) \
    PARALLEL_ROWS for (int t = 0; t < T; t++) \
        rope_store_row(qkv, cs, sn, q_out, k_out, kv, kv_scale, slots, t, H, Hkv, D, num_slots, BF16, KVF)
    /* The pairs the models run with get their own copies; any other pair works, slower. */
    if (!bf16 && kv_fmt == FMT_F32) {
        ROWS(0, FMT_F32);
    } else if (!bf16 && kv_fmt == FMT_F16) {
        ROWS(0, FMT_F16);
    } else if (!bf16 && kv_fmt == FMT_I8) {
        ROWS(0, FMT_I8);
    } else if (bf16 && kv_fmt == FMT_BF16) {
        ROWS(1, FMT_BF16);
    } else {
        ROWS(bf16, kv_fmt);
    }
#undef ROWS
    return 0;
}

/* act[F] = silu(gate) * up for one row of gu = [gate F | up F], float32 (numerics.h's exp). */
static inline __attribute__((always_inline)) void silu_mul_row(const float *gu, float *act, int F) {
    const float *up = gu + F;
#pragma omp simd
    for (int i = 0; i < F; i++) act[i] = gu[i] / (1.f + exp_approx(-gu[i])) * up[i];
}

/* gu [T, 2F] float32 -> act, row t at act + t * ld (act may be gu itself with ld 2F: each row's
 * gate half is overwritten by its own result, value i after it is read). */
int kvserve_silu_mul(const float *gu, float *act, int T, int F, long ld, int nthreads) {
    const long work = (long)T * F;
    PARALLEL_ROWS
    for (int t = 0; t < T; t++) silu_mul_row(gu + (size_t)t * 2 * F, act + (size_t)t * ld, F);
    return 0;
}

/* act[F] = gelu_tanh(gate) * up, float32: 0.5 g (1 + tanh(u)) is g * sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3),
 * through silu_mul_row's exp. */
static inline __attribute__((always_inline)) void gelu_mul_row(const float *gu, float *act, int F) {
    const float *up = gu + F;
    const float c = 1.5957691216057308f; /* 2 sqrt(2 / pi) */
#pragma omp simd
    for (int i = 0; i < F; i++) {
        const float g = gu[i];
        act[i] = g / (1.f + exp_approx(-c * (g + 0.044715f * g * g * g))) * up[i];
    }
}

int kvserve_gelu_mul(const float *gu, float *act, int T, int F, long ld, int nthreads) {
    const long work = (long)T * F;
    PARALLEL_ROWS
    for (int t = 0; t < T; t++) gelu_mul_row(gu + (size_t)t * 2 * F, act + (size_t)t * ld, F);
    return 0;
}

/* act[F] = (clamp(up, -limit, limit) + 1) * g sigmoid(alpha g), g = min(gate, limit), float32: gpt-oss's clamped
 * SwiGLU (a NaN stays NaN, as torch's clamp keeps it), g sigmoid(alpha g) through silu_mul_row's exp. */
static inline __attribute__((always_inline)) void clamped_swiglu_row(const float *gu, float *act, int F, float alpha,
                                                                     float limit) {
    const float *up = gu + F;
#pragma omp simd
    for (int i = 0; i < F; i++) {
        const float g = gu[i] > limit ? limit : gu[i], u = up[i] > limit ? limit : up[i] < -limit ? -limit : up[i];
        act[i] = (u + 1.f) * (g / (1.f + exp_approx(-alpha * g)));
    }
}

int kvserve_clamped_swiglu(const float *gu, float *act, int T, int F, long ld, float alpha, float limit, int nthreads) {
    const long work = (long)T * F;
    PARALLEL_ROWS
    for (int t = 0; t < T; t++) clamped_swiglu_row(gu + (size_t)t * 2 * F, act + (size_t)t * ld, F, alpha, limit);
    return 0;
}

/* cos and sin [D] of position p: angle p * inv_freq[i] in float32, the D/2 frequencies twice
 * over, rounded to the model's dtype (the rotate-half convention's tables). */
static inline void rope_table_row(int64_t p, const float *inv_freq, int D, void *cs, void *sn, size_t o, int bf16) {
    const int half = D / 2;
    for (int i = 0; i < half; i++) {
        const float a = (float)p * inv_freq[i], c = cosf(a), s = sinf(a);
        put(cs, o + i, c, bf16);
        put(cs, o + i + half, c, bf16);
        put(sn, o + i, s, bf16);
        put(sn, o + i + half, s, bf16);
    }
}

int kvserve_rope_table(const int64_t *positions, const float *inv_freq, int T, int D, void *cs, void *sn, int bf16) {
    for (int t = 0; t < T; t++) rope_table_row(positions[t], inv_freq, D, cs, sn, (size_t)t * D, bf16);
    return 0;
}

/* How a router turns its logits into the chosen experts' weights. */
enum {
    ROUTE_SOFTMAX = 0,  /* softmax over all E experts, the top k of it */
    ROUTE_RENORM = 1,   /* the same, renormalized over the chosen (Mixtral's, Qwen3-MoE's norm_topk_prob) */
    ROUTE_TOP_LOGITS = 2 /* the top k logits, softmax over them (gpt-oss) */
};

/* A mixture of experts' router for one row h [N]: the logits h . router_e (dot_lanes), plus bias[e] where given,
 * then the top k (ties to the lower expert) into chosen [k] and their weights into w [k] as `how` says (float32,
 * expf). The per-op path and the native step both route through it, so a row's experts and weights do not
 * depend on the path or on the batch. logits: E floats of scratch. */
static void route_row(const float *h, const float *router, const float *bias, int N, int E, int k, int how,
                      int64_t *chosen, float *w, float *logits) {
    float top = -INFINITY;
    for (int e = 0; e < E; e++) {
        logits[e] = dot_lanes(h, router + (size_t)e * N, N);
        if (bias) logits[e] += bias[e];
        top = logits[e] > top ? logits[e] : top;
    }
    if (how != ROUTE_TOP_LOGITS) {
        float sum = 0.f;
        for (int e = 0; e < E; e++) sum += logits[e] = expf(logits[e] - top);
        for (int e = 0; e < E; e++) logits[e] /= sum;
    }
    unsigned char taken[E];
    memset(taken, 0, (size_t)E);
    float kept = 0.f;
    for (int s = 0; s < k; s++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || logits[e] > logits[best])) best = e; /* a NaN row: the lowest left */
        chosen[s] = best, w[s] = logits[best], taken[best] = 1;
        kept += w[s];
    }
    if (how == ROUTE_RENORM)
        for (int s = 0; s < k; s++) w[s] /= kept;
    if (how == ROUTE_TOP_LOGITS) {
        const float m = w[0]; /* the largest */
        float sum = 0.f;
        for (int s = 0; s < k; s++) sum += w[s] = expf(w[s] - m);
        for (int s = 0; s < k; s++) w[s] /= sum;
    }
}

/* h [T, N] float32 -> each row's k experts chosen [T, k] and weights w [T, k] (route_row); -1 when the
 * shapes do not fit. */
int kvserve_route(const float *h, const float *router, const float *bias, int T, int N, int E, int k, int how,
                  int64_t *chosen, float *w) {
    if (k < 1 || k > E || how < ROUTE_SOFTMAX || how > ROUTE_TOP_LOGITS) return -1;
    float logits[E];
    for (int t = 0; t < T; t++)
        route_row(h + (size_t)t * N, router, bias, N, E, k, how, chosen + (size_t)t * k, w + (size_t)t * k, logits);
    return 0;
}
