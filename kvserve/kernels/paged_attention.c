/* kvserve's fused paged decode attention for CPUs.
 *
 * One new query token per sequence attends to its whole context straight out of the paged KV
 * pool, block by block: no gather copy and no padding to the longest sequence. A work item is
 * one (sequence, kv head) pair; its G = H / Hkv query heads share every K/V row read (GQA).
 * Scores, softmax and the weighted sum of V rows are float32 whatever the storage dtype.
 * The loops are plain C that gcc -O3 -march=native vectorizes; work items are spread over
 * OpenMP threads (the libgomp torch has already loaded, so torch and kvserve share one pool).
 *
 * One layer's pool: [2, Hkv, num_blocks, block_size, D] (K then V), float32 or bfloat16
 * (bf16 passed as uint16). q and out: [B, H, D] contiguous, the pool's dtype.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_D 256
#define MAX_G 16

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40); /* NaN stays NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

/* Row `index` (of D values) of a float32 or bfloat16 array, as float32: a pointer into the
 * array itself for float32, else into buf. */
static inline const float *row_f32(const void *base, size_t index, int D, int bf16, float *restrict buf) {
    if (!bf16) return (const float *)base + index * D;
    const uint16_t *src = (const uint16_t *)base + index * D;
#pragma omp simd
    for (int i = 0; i < D; i++) buf[i] = bf16_to_f32(src[i]);
    return buf;
}

/* exp(x) for x <= 0 (softmax after subtracting the max) in a form the compiler vectorizes:
 * 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor polynomial (rel. error < 2e-7). */
static inline float exp_nonpos(float x) {
    x = x < -87.f ? -87.f : x;
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

/* Inlined per head size so that D is a constant the loops are unrolled for. */
static inline __attribute__((always_inline)) void attend_one(const void *q, const void *kv, void *out, const int32_t *table, int L, int b, int h,
                       int H, int Hkv, size_t head_rows, int bs, int D, float scale, int bf16,
                       float *restrict scores) {
    const int G = H / Hkv;
    float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], buf[MAX_D];
    for (int g = 0; g < G; g++) {
        const float *src = row_f32(q, (size_t)b * H + h * G + g, D, bf16, buf);
        for (int i = 0; i < D; i++) qf[g][i] = src[i] * scale;
    }
    const size_t k_head = (size_t)h * head_rows, v_head = (size_t)(Hkv + h) * head_rows; /* in rows */

    for (int t = 0; t < L; t++) { /* scores[g][t] = q_g . k_t */
        const float *k = row_f32(kv, k_head + (size_t)table[t / bs] * bs + t % bs, D, bf16, buf);
        for (int g = 0; g < G; g++) {
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int i = 0; i < D; i++) s += qf[g][i] * k[i];
            scores[(size_t)g * L + t] = s;
        }
    }
    for (int g = 0; g < G; g++) { /* softmax over the context */
        float *s = scores + (size_t)g * L, m = -INFINITY, sum = 0.f;
        for (int t = 0; t < L; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < L; t++) {
            s[t] = exp_nonpos(s[t] - m);
            sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int t = 0; t < L; t++) s[t] *= inv;
        memset(acc[g], 0, sizeof(float) * D);
    }
    for (int t = 0; t < L; t++) { /* out_g = sum_t p_g[t] v_t */
        const float *v = row_f32(kv, v_head + (size_t)table[t / bs] * bs + t % bs, D, bf16, buf);
        for (int g = 0; g < G; g++) {
            const float p = scores[(size_t)g * L + t];
#pragma omp simd
            for (int i = 0; i < D; i++) acc[g][i] += p * v[i];
        }
    }
    for (int g = 0; g < G; g++) {
        const size_t o = ((size_t)b * H + h * G + g) * D;
        if (bf16)
            for (int i = 0; i < D; i++) ((uint16_t *)out)[o + i] = f32_to_bf16(acc[g][i]);
        else
            memcpy((float *)out + o, acc[g], sizeof(float) * D);
    }
}

/* Returns 0, or -1 for shapes this kernel does not take, -2 when out of memory. */
int kvserve_paged_decode(const void *q, const void *kv, void *out, const int32_t *tables, int max_blocks,
                         const int32_t *seq_lens, int B, int H, int Hkv, int num_blocks, int bs, int D,
                         float scale, int bf16, int nthreads) {
    if (D > MAX_D || Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAX_G) return -1;
    int max_len = 1;
    for (int b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    const size_t head_rows = (size_t)num_blocks * bs;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(H / Hkv) * max_len);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int item = 0; item < B * Hkv; item++) {
            const int b = item / Hkv, h = item % Hkv;
            const int32_t *table = tables + (size_t)b * max_blocks;
            if (!scores) continue;
            if (D == 64)
                attend_one(q, kv, out, table, seq_lens[b], b, h, H, Hkv, head_rows, bs, 64, scale, bf16, scores);
            else if (D == 128)
                attend_one(q, kv, out, table, seq_lens[b], b, h, H, Hkv, head_rows, bs, 128, scale, bf16, scores);
            else
                attend_one(q, kv, out, table, seq_lens[b], b, h, H, Hkv, head_rows, bs, D, scale, bf16, scores);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
