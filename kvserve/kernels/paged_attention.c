/* kvserve's fused paged decode attention for CPUs.
 *
 * One new query token per sequence attends to its whole context straight out of the paged KV
 * pool, block by block: no gather copy and no padding to the longest sequence. A work item is
 * one (sequence, kv head) pair; its G = H / Hkv query heads share every K/V row read (GQA).
 * Scores, softmax and the weighted sum of V rows are float32 whatever the storage dtype.
 * The loops are plain C that gcc -O3 -march=native vectorizes; work items are spread over
 * OpenMP threads (the libgomp torch has already loaded, so torch and kvserve share one pool).
 *
 * One layer's pool: [2, Hkv, num_blocks, block_size, D] (K then V), float32, bfloat16,
 * float16 (the 16-bit formats passed as uint16) or int8 with a float16 scale per row in a
 * second array [2, Hkv, num_blocks, block_size] (kv_scale). An int8 row is widened to float32
 * in a row buffer and its scale folded into the score (K) or the softmax weight (V), so the
 * dequantized row is never stored. q and out: [B, H, D] contiguous, float32 or
 * bfloat16 (the model's dtype, which the pool's need not be: float32 activations over a
 * float16 pool read half the bytes per context token).
 *
 * Sliding-window attention (window > 0): the query at position L - 1 sees the `window` keys
 * L - window .. L - 1 only (transformers' mask: key > query - window). Blocks wholly before
 * the window are never read, so a block table may hold anything there (freed blocks: -1).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "numerics.h"

#define MAX_D 256
#define MAX_G 16

/* Row `index` (of D values) of an array in format fmt, as float32: a pointer into the array
 * itself for float32, else into buf; an int8 row unscaled (the caller applies its scale). */
static inline const float *row_f32(const void *base, size_t index, int D, int fmt, float *restrict buf) {
    if (fmt == FMT_F32) return (const float *)base + index * D;
    if (fmt == FMT_I8) {
        const int8_t *src = (const int8_t *)base + index * D;
#pragma omp simd
        for (int i = 0; i < D; i++) buf[i] = (float)src[i];
        return buf;
    }
    const uint16_t *src = (const uint16_t *)base + index * D;
    if (fmt == FMT_F16) {
        fp16_row_to_f32(src, buf, D);
        return buf;
    }
#pragma omp simd
    for (int i = 0; i < D; i++) buf[i] = bf16_to_f32(src[i]);
    return buf;
}

/* The first key position a query at position L - 1 sees: 0, or L - window under a window. */
static inline int window_start(int L, int window) { return window > 0 && L > window ? L - window : 0; }

/* The G query heads of KV head h for sequence b, as float32, times the softmax scale. */
static inline __attribute__((always_inline)) void scaled_queries(const void *q, int b, int h, int H, int G, int D, float scale,
                                                                 int q_fmt, float (*qf)[MAX_D]) {
    float buf[MAX_D];
    for (int g = 0; g < G; g++) {
        const float *src = row_f32(q, (size_t)b * H + h * G + g, D, q_fmt, buf);
        for (int i = 0; i < D; i++) qf[g][i] = src[i] * scale;
    }
}

/* Each head's n scores → its softmax weights, in place; cap > 0 first soft-caps each score to cap * tanh(s / cap)
 * (Gemma 2); sinks (NULL: none) are the G heads' sink logits (gpt-oss), each a score that joins its head's softmax
 * and takes no value. The sum runs in 8 partial sums, value t into sum t % 8,
 * added up in a fixed order, and the function is compiled once (noinline): neither where the row lies in memory
 * (a vectorized reduction peels to an alignment: the scores buffers are per thread, malloc'd in
 * kvserve_paged_decode) nor the code around a call can change how a head's weights round. */
static __attribute__((noinline)) void softmax_rows(float *restrict scores, int G, int n, float cap,
                                                   const float *sinks) {
    for (int g = 0; g < G; g++) {
        float *s = scores + (size_t)g * n, m = sinks ? sinks[g] : -INFINITY, part[8] = {0.f}, most[8];
        if (cap > 0.f)
            for (int t = 0; t < n; t++) s[t] = tanhf(s[t] / cap) * cap;
        for (int j = 0; j < 8; j++) most[j] = m; /* the maximum in 8 lanes, as one chain of compares waits on each */
        int t = 0;
        for (; t + 8 <= n; t += 8)
            for (int j = 0; j < 8; j++) most[j] = s[t + j] > most[j] ? s[t + j] : most[j];
        for (; t < n; t++) m = s[t] > m ? s[t] : m;
        for (int j = 0; j < 8; j++) m = most[j] > m ? most[j] : m; /* (a maximum is exact in any order) */
        t = 0;
        for (; t + 8 <= n; t += 8)
            for (int j = 0; j < 8; j++) {
                s[t + j] = exp_approx(s[t + j] - m);
                part[j] += s[t + j];
            }
        for (; t < n; t++) {
            s[t] = exp_approx(s[t] - m);
            part[t % 8] += s[t];
        }
        const float sum = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7])) +
                          (sinks ? exp_approx(sinks[g] - m) : 0.f);
        const float inv = 1.f / sum;
        for (t = 0; t < n; t++) s[t] *= inv;
    }
}

/* The G heads' outputs into out [B, H, D], in the activations' format. */
static inline __attribute__((always_inline)) void store_heads(void *out, float (*acc)[MAX_D], int b, int h, int H, int G, int D,
                                                              int q_fmt) {
    for (int g = 0; g < G; g++) {
        const size_t o = ((size_t)b * H + h * G + g) * D;
        if (q_fmt == FMT_BF16)
            for (int i = 0; i < D; i++) ((uint16_t *)out)[o + i] = f32_to_bf16(acc[g][i]);
        else
            memcpy((float *)out + o, acc[g], sizeof(float) * D);
    }
}

/* Inlined per head size so that D is a constant the loops are unrolled for. Keys t0 .. L - 1. */
static inline __attribute__((always_inline)) void attend_one(const void *q, const void *kv,
                                                             const uint16_t *kv_scale, void *out,
                                                             const int32_t *table, int t0, int L, int b, int h, int H, int Hkv,
                                                             size_t head_rows, int bs, int D, float scale, float cap, const float *sinks,
                                                             int q_fmt, int kv_fmt, float *restrict scores) {
    const int G = H / Hkv;
    float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], buf[MAX_D];
    scaled_queries(q, b, h, H, G, D, scale, q_fmt, qf);
    const size_t k_head = (size_t)h * head_rows, v_head = (size_t)(Hkv + h) * head_rows; /* in rows */
    const int n = L - t0; /* keys seen; scores[g][t - t0] */

    for (int t = t0; t < L; t++) { /* scores[g][t] = q_g . k_t */
        const size_t r = k_head + (size_t)table[t / bs] * bs + t % bs;
        const float *k = row_f32(kv, r, D, kv_fmt, buf);
        const float ks = kv_fmt == FMT_I8 ? fp16_to_f32(kv_scale[r]) : 1.f;
        for (int g = 0; g < G; g++) {
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int i = 0; i < D; i++) s += qf[g][i] * k[i];
            scores[(size_t)g * n + t - t0] = kv_fmt == FMT_I8 ? s * ks : s;
        }
    }
    softmax_rows(scores, G, n, cap, sinks ? sinks + (size_t)h * G : NULL);
    for (int g = 0; g < G; g++) memset(acc[g], 0, sizeof(float) * D);
    for (int t = t0; t < L; t++) { /* out_g = sum_t p_g[t] v_t */
        const size_t r = v_head + (size_t)table[t / bs] * bs + t % bs;
        const float *v = row_f32(kv, r, D, kv_fmt, buf);
        const float vs = kv_fmt == FMT_I8 ? fp16_to_f32(kv_scale[r]) : 1.f;
        for (int g = 0; g < G; g++) {
            const float p = kv_fmt == FMT_I8 ? scores[(size_t)g * n + t - t0] * vs : scores[(size_t)g * n + t - t0];
#pragma omp simd
            for (int i = 0; i < D; i++) acc[g][i] += p * v[i];
        }
    }
    store_heads(out, acc, b, h, H, G, D, q_fmt);
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* The vector path: the same attention, shaped for the registers. Scores come 4 keys at a time,
 * each key's row read and widened once for up to 4 query heads, with 4 x 4 independent sums (no
 * horizontal add per key: one per 4 keys, done by hadds); the weighted sum of V rows keeps 32
 * output values of up to 4 heads in registers over the whole context. The scalar loops above
 * leave each key's sum in one dependent chain plus a reduction, and the output in memory. */
#define QPASS 4 /* query heads per pass over the keys */
static inline __attribute__((always_inline)) __m256 load8(const void *base, size_t i, int fmt) {
    if (fmt == FMT_F32) return _mm256_loadu_ps((const float *)base + i);
    if (fmt == FMT_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
    if (fmt == FMT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i))), 16));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + i))));
}
/* The pool rows of keys t0, t0 + 1, ... in turn: one division per pass, not two per key. */
typedef struct {
    const int32_t *table;
    int bs, block, off;
} key_rows;
static inline key_rows rows_from(const int32_t *table, int bs, int t0) {
    const key_rows it = {table, bs, t0 / bs, t0 % bs};
    return it;
}
static inline size_t next_row(key_rows *it) {
    const size_t r = (size_t)it->table[it->block] * it->bs + it->off;
    if (++it->off == it->bs) it->off = 0, it->block++;
    return r;
}
/* The 4 horizontal sums of a[0..3], in order. */
static inline __m128 hsum4(const __m256 a[4]) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
static inline __attribute__((always_inline)) float hsum1(__m256 a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
/* A pool row's bytes into the caches ahead of its use (the blocks of a context lie apart, so the
 * hardware prefetcher restarts at each). */
static inline __attribute__((always_inline)) void prefetch_row(const void *kv, size_t r, int D, int kv_fmt) {
    const size_t bytes = (size_t)D * fmt_bytes(kv_fmt);
    const char *p = (const char *)kv + r * bytes;
    for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}
#define KEYS_AHEAD 16 /* keys whose K rows are asked for ahead of the one being read */
/* Keys r[0..3]'s scores for NG heads (an int8 pool's row scales not yet applied): a key's 8 partial sums, added
 * up by hsum4. */
static inline __attribute__((always_inline)) void four_keys(float (*qf)[MAX_D], int NG, const void *kv, const size_t r[4], int D,
                                                            int kv_fmt, __m128 out[QPASS]) {
    __m256 acc[QPASS][4];
    for (int g = 0; g < NG; g++)
        for (int j = 0; j < 4; j++) acc[g][j] = _mm256_setzero_ps();
    for (int i = 0; i < D; i += 8) {
        __m256 k[4];
        for (int j = 0; j < 4; j++) k[j] = load8(kv, r[j] * D + i, kv_fmt);
        for (int g = 0; g < NG; g++) {
            const __m256 q = _mm256_loadu_ps(qf[g] + i);
            for (int j = 0; j < 4; j++) acc[g][j] = _mm256_fmadd_ps(k[j], q, acc[g][j]);
        }
    }
    for (int g = 0; g < NG; g++) out[g] = hsum4(acc[g]);
}
/* out[g] = sum_t p[g][t] v_t for NG heads, 32 values of D at a time. */
static inline __attribute__((always_inline)) void pv_pass(float (*acc_out)[MAX_D], int NG, const void *kv, const uint16_t *kv_scale,
                                                          size_t v_head, const int32_t *table, int t0, int L, int bs, int D,
                                                          int kv_fmt, const float *restrict scores, int n) {
    for (int c = 0; c < D; c += 32) {
        __m256 acc[QPASS][4];
        for (int g = 0; g < NG; g++)
            for (int j = 0; j < 4; j++) acc[g][j] = _mm256_setzero_ps();
        key_rows it = rows_from(table, bs, t0);
        for (int t = t0; t < L; t++) {
            const size_t r = v_head + next_row(&it);
            const float vs = kv_fmt == FMT_I8 ? fp16_to_f32(kv_scale[r]) : 1.f;
            __m256 v[4];
            for (int j = 0; j < 4; j++) v[j] = load8(kv, r * D + c + 8 * j, kv_fmt);
            for (int g = 0; g < NG; g++) {
                const __m256 p = _mm256_set1_ps(kv_fmt == FMT_I8 ? scores[(size_t)g * n + t - t0] * vs : scores[(size_t)g * n + t - t0]);
                for (int j = 0; j < 4; j++) acc[g][j] = _mm256_fmadd_ps(p, v[j], acc[g][j]);
            }
        }
        for (int g = 0; g < NG; g++)
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(acc_out[g] + c + 8 * j, acc[g][j]);
    }
}
#if defined(__AVX512F__)
/* The same passes on 512-bit vectors, the same bits: each lane runs four_keys' and pv_pass's operations in
 * their order. A score's 8 partial sums sit in one half of a vector, two keys to a vector (as the
 * matmul's pair tiles hold two activation rows), and are added up as hsum4 adds them; pv_pass's sums are
 * per output value already, so 16 of them to a vector change nothing. Where the FMA units are 512 bits
 * wide (Zen 5, Xeon) that is twice the work per instruction of the 256-bit passes: a long prompt's
 * attention is bound by these multiply-adds. */
/* Keys r0 and r1's values i .. i + 7, as float32 in the low and high halves. */
static inline __attribute__((always_inline)) __m512 load2x8(const void *base, size_t r0, size_t r1, int D, int i, int fmt) {
    if (fmt == FMT_F32)
        return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps((const float *)base + r0 * D + i)),
                                  _mm256_loadu_ps((const float *)base + r1 * D + i), 1);
    if (fmt == FMT_I8) {
        const __m128i b = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + r0 * D + i)),
                                             _mm_loadl_epi64((const __m128i *)((const int8_t *)base + r1 * D + i)));
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    }
    const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + r0 * D + i))),
                                              _mm_loadu_si128((const __m128i *)((const uint16_t *)base + r1 * D + i)), 1);
    if (fmt == FMT_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
/* 16 values from element i of an array in format fmt, as float32. */
static inline __attribute__((always_inline)) __m512 load16(const void *base, size_t i, int fmt) {
    if (fmt == FMT_F32) return _mm512_loadu_ps((const float *)base + i);
    if (fmt == FMT_I8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)base + i))));
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    if (fmt == FMT_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
/* hsum4 of keys j .. j + 3's sums, held as a = [j | j + 1], b = [j + 2 | j + 3]: the same pairs added in the same order. */
static inline __attribute__((always_inline)) __m128 hsum4_512(__m512 a, __m512 b) {
    /* per 128-bit lane: hadd(hadd(k, k + 1), hadd(k + 2, k + 3))'s two steps (lanes: j lo, j hi, j + 1 lo, j + 1 hi) */
    const __m512 p = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 q = _mm512_add_ps(_mm512_shuffle_ps(p, p, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(p, p, _MM_SHUFFLE(3, 1, 3, 1)));
    /* q's lanes: [j, j + 2, .. ] of the low halves' sums, then of the high halves', then j + 1's and j + 3's */
    const __m512 s = _mm512_add_ps(q, _mm512_shuffle_f32x4(q, q, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 8, 1, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), s));
}
static inline __attribute__((always_inline)) void four_keys512(float (*qf)[MAX_D], int NG, const void *kv, const size_t r[4], int D,
                                                               int kv_fmt, __m128 out[QPASS]) {
    __m512 acc[QPASS][2];
    for (int g = 0; g < NG; g++) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
    for (int i = 0; i < D; i += 8) {
        const __m512 k01 = load2x8(kv, r[0], r[1], D, i, kv_fmt), k23 = load2x8(kv, r[2], r[3], D, i, kv_fmt);
        for (int g = 0; g < NG; g++) {
            const __m512 q = _mm512_broadcast_f32x8(_mm256_loadu_ps(qf[g] + i));
            acc[g][0] = _mm512_fmadd_ps(k01, q, acc[g][0]);
            acc[g][1] = _mm512_fmadd_ps(k23, q, acc[g][1]);
        }
    }
    for (int g = 0; g < NG; g++) out[g] = hsum4_512(acc[g][0], acc[g][1]);
}
/* pv_pass over NV x 16 values of D from c (NV <= 4): a head's sums stay in registers over the whole context. */
static inline __attribute__((always_inline)) void pv_pass512(float (*acc_out)[MAX_D], int NG, int NV, int c, const void *kv,
                                                             const uint16_t *kv_scale, size_t v_head, const int32_t *table, int t0,
                                                             int L, int bs, int D, int kv_fmt, const float *restrict scores, int n) {
    __m512 acc[QPASS][4];
    for (int g = 0; g < NG; g++)
        for (int j = 0; j < NV; j++) acc[g][j] = _mm512_setzero_ps();
    key_rows it = rows_from(table, bs, t0);
    for (int t = t0; t < L; t++) {
        const size_t r = v_head + next_row(&it);
        const float vs = kv_fmt == FMT_I8 ? fp16_to_f32(kv_scale[r]) : 1.f;
        __m512 v[4];
        for (int j = 0; j < NV; j++) v[j] = load16(kv, r * D + c + 16 * j, kv_fmt);
        for (int g = 0; g < NG; g++) {
            const __m512 p = _mm512_set1_ps(kv_fmt == FMT_I8 ? scores[(size_t)g * n + t - t0] * vs : scores[(size_t)g * n + t - t0]);
            for (int j = 0; j < NV; j++) acc[g][j] = _mm512_fmadd_ps(p, v[j], acc[g][j]);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(acc_out[g] + c + 16 * j, acc[g][j]);
}
static inline __attribute__((always_inline)) void pv_all512(float (*acc_out)[MAX_D], int NG, const void *kv, const uint16_t *kv_scale,
                                                            size_t v_head, const int32_t *table, int t0, int L, int bs, int D,
                                                            int kv_fmt, const float *restrict scores, int n) {
    int c = 0;
    for (; c + 64 <= D; c += 64) pv_pass512(acc_out, NG, 4, c, kv, kv_scale, v_head, table, t0, L, bs, D, kv_fmt, scores, n);
    if (D - c == 32) pv_pass512(acc_out, NG, 2, c, kv, kv_scale, v_head, table, t0, L, bs, D, kv_fmt, scores, n);
}
#define FOUR_KEYS four_keys512
#define PV_PASS(NG) pv_all512(acc + g0, NG, kv, kv_scale, v_head, table, t0, L, bs, D, kv_fmt, scores + (size_t)g0 * n, n)
#else
#define FOUR_KEYS four_keys
#define PV_PASS(NG) pv_pass(acc + g0, NG, kv, kv_scale, v_head, table, t0, L, bs, D, kv_fmt, scores + (size_t)g0 * n, n)
#endif
/* scores[g][t - t0] = qf[g] . k_t for NG heads (g < NG), keys t0 .. L - 1: 4 keys at a time (FOUR_KEYS), the last
 * ones one at a time. */
static inline __attribute__((always_inline)) void qk_pass(float (*qf)[MAX_D], int NG, const void *kv, const uint16_t *kv_scale,
                                                          size_t k_head, size_t v_head, const int32_t *table, int t0, int L, int bs, int D,
                                                          int kv_fmt, float *restrict scores, int n) {
    int t = t0;
    key_rows it = rows_from(table, bs, t0);
    int ta = t0 + KEYS_AHEAD < L ? t0 + KEYS_AHEAD : L; /* the next key whose K row is asked for ahead */
    key_rows ahead = rows_from(table, bs, ta);
    for (; t + 4 <= L; t += 4) {
        size_t r[4];
        for (int j = 0; j < 4; j++) {
            const size_t slot = next_row(&it);
            r[j] = k_head + slot;
            prefetch_row(kv, v_head + slot, D, kv_fmt); /* its V row, read by pv_pass after the softmax */
            if (ta < L) prefetch_row(kv, k_head + next_row(&ahead), D, kv_fmt), ta++;
        }
        __m128 sums[QPASS];
        FOUR_KEYS(qf, NG, kv, r, D, kv_fmt, sums);
        __m128 ks = _mm_set1_ps(1.f);
        if (kv_fmt == FMT_I8)
            ks = _mm_setr_ps(fp16_to_f32(kv_scale[r[0]]), fp16_to_f32(kv_scale[r[1]]), fp16_to_f32(kv_scale[r[2]]),
                             fp16_to_f32(kv_scale[r[3]]));
        for (int g = 0; g < NG; g++) _mm_storeu_ps(scores + (size_t)g * n + t - t0, _mm_mul_ps(sums[g], ks));
    }
    for (; t < L; t++) {
        const size_t r = k_head + next_row(&it);
        __m256 acc[QPASS];
        for (int g = 0; g < NG; g++) acc[g] = _mm256_setzero_ps();
        for (int i = 0; i < D; i += 8) {
            const __m256 k = load8(kv, r * D + i, kv_fmt);
            for (int g = 0; g < NG; g++) acc[g] = _mm256_fmadd_ps(k, _mm256_loadu_ps(qf[g] + i), acc[g]);
        }
        const float ks = kv_fmt == FMT_I8 ? fp16_to_f32(kv_scale[r]) : 1.f;
        for (int g = 0; g < NG; g++) scores[(size_t)g * n + t - t0] = hsum1(acc[g]) * ks;
    }
}
#define QK_PASS(NG) qk_pass(qf + g0, NG, kv, kv_scale, k_head, v_head, table, t0, L, bs, D, kv_fmt, scores + (size_t)g0 * n, n)
static inline __attribute__((always_inline)) void attend_simd(const void *q, const void *kv, const uint16_t *kv_scale, void *out,
                                                              const int32_t *table, int t0, int L, int b, int h, int H, int Hkv,
                                                              size_t head_rows, int bs, int D, float scale, float cap, const float *sinks,
                                                              int q_fmt, int kv_fmt, float *restrict scores) {
    const int G = H / Hkv, n = L - t0;
    float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D];
    scaled_queries(q, b, h, H, G, D, scale, q_fmt, qf);
    const size_t k_head = (size_t)h * head_rows, v_head = (size_t)(Hkv + h) * head_rows; /* in rows */
    for (int g0 = 0; g0 < G; g0 += QPASS) {
        switch (G - g0 < QPASS ? G - g0 : QPASS) {
        case 1: QK_PASS(1); break;
        case 2: QK_PASS(2); break;
        case 3: QK_PASS(3); break;
        default: QK_PASS(4); break;
        }
    }
    softmax_rows(scores, G, n, cap, sinks ? sinks + (size_t)h * G : NULL);
    for (int g0 = 0; g0 < G; g0 += QPASS) {
        switch (G - g0 < QPASS ? G - g0 : QPASS) {
        case 1: PV_PASS(1); break;
        case 2: PV_PASS(2); break;
        case 3: PV_PASS(3); break;
        default: PV_PASS(4); break;
        }
    }
    store_heads(out, acc, b, h, H, G, D, q_fmt);
}
#undef QK_PASS
#undef PV_PASS
#undef FOUR_KEYS
#endif

/* One work item: sequence b's query heads of KV head h. Literal formats and head sizes: each
 * inlined copy has them as constants (a format read at run time leaves gcc vectorizing every
 * branch with slow masked loads). The pairs the models run with get their own copies; any other
 * pair works, slower. Also called by decode_step.c, inside its own parallel region. */
static void attend_item(const void *q, const void *kv, const uint16_t *kv_scale, void *out, const int32_t *table,
                        int L, int window, int b,
                        int h, int H, int Hkv, size_t head_rows, int bs, int D, float scale, float cap, const float *sinks, int q_fmt,
                        int kv_fmt, float *restrict scores) {
    const int t0 = window_start(L, window);
#define ATTEND(DIM, QF, KVF) attend_one(q, kv, kv_scale, out, table, t0, L, b, h, H, Hkv, head_rows, bs, DIM, scale, cap, sinks, QF, KVF, scores)
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ATTEND_V(DIM, QF, KVF) attend_simd(q, kv, kv_scale, out, table, t0, L, b, h, H, Hkv, head_rows, bs, DIM, scale, cap, sinks, QF, KVF, scores)
#define ATTEND_D(QF, KVF) if (D == 64) ATTEND_V(64, QF, KVF); else if (D == 128) ATTEND_V(128, QF, KVF); \
                          else if (D % 32 == 0) ATTEND_V(D, QF, KVF); else ATTEND(D, QF, KVF)
#else
#define ATTEND_D(QF, KVF) if (D == 64) ATTEND(64, QF, KVF); else if (D == 128) ATTEND(128, QF, KVF); else ATTEND(D, QF, KVF)
#endif
    if (q_fmt == FMT_F32 && kv_fmt == FMT_F32) {
        ATTEND_D(FMT_F32, FMT_F32);
    } else if (q_fmt == FMT_F32 && kv_fmt == FMT_F16) {
        ATTEND_D(FMT_F32, FMT_F16);
    } else if (q_fmt == FMT_F32 && kv_fmt == FMT_BF16) {
        ATTEND_D(FMT_F32, FMT_BF16);
    } else if (q_fmt == FMT_F32 && kv_fmt == FMT_I8) {
        ATTEND_D(FMT_F32, FMT_I8);
    } else if (q_fmt == FMT_BF16 && kv_fmt == FMT_BF16) {
        ATTEND_D(FMT_BF16, FMT_BF16);
    } else if (q_fmt == FMT_BF16 && kv_fmt == FMT_I8) {
        ATTEND_D(FMT_BF16, FMT_I8);
    } else {
        ATTEND(D, q_fmt, kv_fmt);
    }
#undef ATTEND_D
#undef ATTEND_V
#undef ATTEND
}

/* 0 for shapes and formats the kernel takes, else -1. */
static int attention_shapes_check(int H, int Hkv, int D, int q_fmt, int kv_fmt) {
    return D > MAX_D || Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAX_G || (q_fmt != FMT_F32 && q_fmt != FMT_BF16) ||
                   kv_fmt < FMT_F32 || kv_fmt > FMT_I8
               ? -1
               : 0;
}

/* The most keys one query of the batch sees (>= 1), or -3 when a context length or a block id
 * the window reads would fall outside the tables or the pool. */
static int attention_tables_ok(const int32_t *tables, int max_blocks, const int32_t *seq_lens, int B, int num_blocks,
                               int bs, int window) {
    int max_len = 1;
    for (int b = 0; b < B; b++) {
        const int L = seq_lens[b], t0 = window_start(L, window);
        if (L < 1 || L > (long)max_blocks * bs) return -3;
        for (int j = t0 / bs; j < (L + bs - 1) / bs; j++)
            if (tables[(size_t)b * max_blocks + j] < 0 || tables[(size_t)b * max_blocks + j] >= num_blocks) return -3;
        max_len = L - t0 > max_len ? L - t0 : max_len;
    }
    return max_len;
}

/* window: 0, or the sliding window (keys seen per query); kv_scale: an int8 pool's row scales
 * (NULL for the float formats); sinks: each query head's sink logit [H] float32 (gpt-oss), or NULL. Returns 0; -1 for shapes this kernel does not take; -3 when a
 * context length or block id would read outside the tables or the pool (nothing is read then);
 * -2 when out of memory. */
int kvserve_paged_decode(const void *q, const void *kv, const void *kv_scale, void *out, const int32_t *tables,
                         int max_blocks, const int32_t *seq_lens, int B, int H, int Hkv, int num_blocks, int bs, int D,
                         float scale, float cap, const float *sinks, int q_fmt, int kv_fmt, int window, int nthreads) {
    if (attention_shapes_check(H, Hkv, D, q_fmt, kv_fmt) || window < 0 || (kv_fmt == FMT_I8 && !kv_scale)) return -1;
    const int max_len = attention_tables_ok(tables, max_blocks, seq_lens, B, num_blocks, bs, window);
    if (max_len < 0) return max_len;
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
            if (scores)
                attend_item(q, kv, kv_scale, out, tables + (size_t)b * max_blocks, seq_lens[b], window, b, h, H, Hkv, head_rows,
                            bs, D, scale, cap, sinks, q_fmt, kv_fmt, scores);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
