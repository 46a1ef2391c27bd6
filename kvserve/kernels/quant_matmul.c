/* Matmuls that read weights as stored: GGML quantized blocks, or bfloat16 on CPUs without it.
 *
 * Decoding one token reads every weight once, so bytes per weight set the speed. These kernels
 * never expand a weight to float in memory: y[t, r] = x[t, :] . W[r, :] walks the raw blocks of
 * row r (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K; layouts as ggml's block_* structs and gguf-py's
 * dequantize, which tests/test_quant.py checks them against).
 *
 * The activations are quantized first, per 32 consecutive values, to int8 with one float scale
 * and the integer sums of each half (act_block). Every weight type's 32 values then meet one
 * act_block in an integer dot product: weight codes as unsigned bytes (4-, 5- or 6-bit; Q8_0's
 * signed bytes through the sign trick) times int8 activations, summed in int32 (AVX2 maddubs +
 * madd, AVX-512 VNNI dpbusd where compiled for it, plain C otherwise); offsets (Q4_0's -8,
 * Q6_K's -32) and minimums (Q4_1, Q4_K, Q5_K) are applied once per block through the sums.
 * One activation format for all types (not ggml's Q8_K for K-quants) costs one float multiply
 * per 32 weights and keeps the activation error the same for every type.
 *
 * Also: rows of quantized blocks dequantized to float32 (the embedding lookup, and the large-batch
 * path, where BLAS on a dequantized copy beats the integer kernel), and a GEMV over bfloat16
 * weights converted in registers (float32 accumulation).
 * Output rows are spread over OpenMP threads; the code path is picked at compile time from the
 * ISA flags kernels/__init__.py passes (KVSERVE_ISA=portable builds the plain C path).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KV_AVX2 1
#endif

#include "numerics.h"

/* GGML type ids (gguf GGMLQuantizationType) */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

typedef struct {
    float d;        /* x ~= d * q */
    int16_t s[2];   /* sum of q[0..15], q[16..31] */
    int8_t q[32];
} act_block;

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#ifdef KV_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: value = man * 2^-24 */
        union { uint32_t u; float f; } v;
        v.f = (float)man * 5.9604644775390625e-08f;
        return sign ? -v.f : v.f;
    }
    union { uint32_t u; float f; } v;
    v.u = bits;
    return v.f;
#endif
}

/* Bytes and values per block of each type; 0 for an unknown type. */
static int block_bytes(int t) {
    switch (t) {
    case T_Q8_0: return 34;
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    }
    return 0;
}
static int block_values(int t) { return (t == T_Q4_K || t == T_Q5_K || t == T_Q6_K) ? 256 : 32; }

/* Q4_K / Q5_K: eight 6-bit scales and mins packed in 12 bytes. */
static inline void k_scale_min(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

/* ---- activations → act_blocks ------------------------------------------------------------ */
static void quantize_row(const float *x, act_block *a, int nb) {
    for (int b = 0; b < nb; b++, x += 32) {
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int s0 = 0, s1 = 0;
        for (int i = 0; i < 32; i++) {
            const int q = (int)lrintf(x[i] * id);
            a[b].q[i] = (int8_t)q;
            if (i < 16) s0 += q; else s1 += q;
        }
        a[b].d = d;
        a[b].s[0] = (int16_t)s0;
        a[b].s[1] = (int16_t)s1;
    }
}

/* ---- one weight row · one activation row ------------------------------------------------- */
/* Each returns sum over the row; nb = number of 32-value activation blocks (cols / 32). */

#ifdef KV_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* 32 unsigned weight codes (< 128) · 32 int8 activations → 8 int32 partial sums, as float. */
static inline __m256 dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s));
#else
    const __m256i p16 = _mm256_maddubs_epi16(u, s);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
#endif
}
static inline __m256i load_act(const act_block *a) { return _mm256_loadu_si256((const __m256i *)a->q); }
static inline __m256i nibbles16(const uint8_t *qs) { /* 16 bytes → 32 codes: lows, then highs */
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}
#endif

/* dot_<type>(w, a, as, nb, nt, y): y[k] = row w · activation row a + k*as, for k < nt <= NT.
 * The AVX2 paths decode each weight block once for all nt activation rows (nt is a constant
 * where they are inlined, so the accumulators stay in registers); the plain C paths loop. */
#define NT 4
#define KV_INLINE static inline __attribute__((always_inline))

#ifndef KV_AVX2
static float dot1_q8_0(const uint8_t *w, const act_block *a, int nb) {
    float sum = 0.f;
    for (int b = 0; b < nb; b++, w += 34) {
        const int8_t *q = (const int8_t *)(w + 2);
        int isum = 0;
        for (int i = 0; i < 32; i++) isum += q[i] * a[b].q[i];
        sum += f16_to_f32(w) * a[b].d * (float)isum;
    }
    return sum;
}

static float dot1_q4(const uint8_t *w, const act_block *a, int nb, int has_min) {
    const int bs = has_min ? 20 : 18;
    float sum = 0.f;
    for (int b = 0; b < nb; b++, w += bs) {
        const uint8_t *qs = w + bs - 16;
        int isum = 0;
        for (int i = 0; i < 16; i++) isum += (qs[i] & 15) * a[b].q[i] + (qs[i] >> 4) * a[b].q[i + 16];
        const float d = f16_to_f32(w) * a[b].d, xs = (float)(a[b].s[0] + a[b].s[1]);
        sum += d * (float)isum + (has_min ? f16_to_f32(w + 2) * a[b].d * xs : -8.f * d * xs);
    }
    return sum;
}

static float dot1_q45_k(const uint8_t *w, const act_block *a, int nb, int five) {
    const int bs = five ? 176 : 144;
    float sum = 0.f;
    for (int sb = 0; sb < nb / 8; sb++, w += bs, a += 8) {
        uint8_t sc[8], mn[8];
        k_scale_min(w + 4, sc, mn);
        const float d = f16_to_f32(w), dmin = f16_to_f32(w + 2);
        const uint8_t *qh = w + 16, *qs = w + (five ? 48 : 16);
        for (int j = 0; j < 8; j++) {
            const uint8_t *q = qs + 32 * (j / 2);
            const int shift = 4 * (j & 1);
            int isum = 0;
            for (int l = 0; l < 32; l++) {
                int code = (q[l] >> shift) & 15;
                if (five) code |= ((qh[l] >> j) & 1) << 4;
                isum += code * a[j].q[l];
            }
            sum += d * sc[j] * a[j].d * (float)isum - dmin * mn[j] * a[j].d * (float)(a[j].s[0] + a[j].s[1]);
        }
    }
    return sum;
}

static float dot1_q6_k(const uint8_t *w, const act_block *a, int nb) {
    float sum = 0.f;
    for (int sb = 0; sb < nb / 8; sb++, w += 210, a += 8) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        float s = 0.f;
        for (int j = 0; j < 8; j++) {
            const int h = j / 4, g = j % 4;
            int isum[2] = {0, 0};
            for (int l = 0; l < 32; l++) {
                const int lo = (ql[64 * h + 32 * (g % 2) + l] >> (4 * (g / 2))) & 15;
                const int hi = (qh[32 * h + l] >> (2 * g)) & 3;
                isum[l / 16] += ((lo | (hi << 4)) - 32) * a[j].q[l];
            }
            s += a[j].d * (float)(sc[2 * j] * isum[0] + sc[2 * j + 1] * isum[1]);
        }
        sum += f16_to_f32(w + 208) * s;
    }
    return sum;
}
#endif

KV_INLINE void dot_q8_0(const uint8_t *w, const act_block *a, long as, int nb, int nt, float *y) {
#ifdef KV_AVX2
    /* Two accumulators per activation row (even and odd blocks): one FMA chain would make a
     * single row wait on the FMA latency at every block. */
    __m256 acc[2][NT];
    for (int k = 0; k < nt; k++) acc[0][k] = acc[1][k] = _mm256_setzero_ps();
#define Q8_0_BLOCK(P)                                                                                     \
    {                                                                                                    \
        const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 2)), qa = _mm256_sign_epi8(q, q);    \
        const float dw = f16_to_f32(w);                                                                  \
        for (int k = 0; k < nt; k++) { /* |q| · (x with q's sign): unsigned · signed, as maddubs wants */ \
            const act_block *ab = a + k * as + b;                                                        \
            const __m256i p16 = _mm256_maddubs_epi16(qa, _mm256_sign_epi8(load_act(ab), q));             \
            const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));           \
            acc[P][k] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * ab->d), acc[P][k]);                       \
        }                                                                                                \
        b++, w += 34;                                                                                    \
    }
    int b = 0;
    while (b + 2 <= nb) {
        Q8_0_BLOCK(0)
        Q8_0_BLOCK(1)
    }
    if (b < nb) Q8_0_BLOCK(0)
#undef Q8_0_BLOCK
    for (int k = 0; k < nt; k++) y[k] = hsum(_mm256_add_ps(acc[0][k], acc[1][k]));
#else
    for (int k = 0; k < nt; k++) y[k] = dot1_q8_0(w, a + k * as, nb);
#endif
}

/* Q4_0 (offset 8) and Q4_1 (minimum m): codes 0..15, low nibbles are values 0..15. */
KV_INLINE void dot_q4(const uint8_t *w, const act_block *a, long as, int nb, int has_min, int nt, float *y) {
#ifdef KV_AVX2
    const int bs = has_min ? 20 : 18;
    __m256 acc[2][NT];  /* even and odd blocks, as in dot_q8_0 */
    float corr[NT];
    for (int k = 0; k < nt; k++) acc[0][k] = acc[1][k] = _mm256_setzero_ps(), corr[k] = 0.f;
#define Q4_BLOCK(P)                                                                                    \
    {                                                                                                 \
        const __m256i q = nibbles16(w + bs - 16);                                                     \
        const float dw = f16_to_f32(w), mw = has_min ? f16_to_f32(w + 2) : -8.f * dw;                 \
        for (int k = 0; k < nt; k++) {                                                                \
            const act_block *ab = a + k * as + b;                                                     \
            acc[P][k] = _mm256_fmadd_ps(dot_u8s8(q, load_act(ab)), _mm256_set1_ps(dw * ab->d), acc[P][k]); \
            corr[k] += mw * ab->d * (float)(ab->s[0] + ab->s[1]);                                     \
        }                                                                                             \
        b++, w += bs;                                                                                 \
    }
    int b = 0;
    while (b + 2 <= nb) {
        Q4_BLOCK(0)
        Q4_BLOCK(1)
    }
    if (b < nb) Q4_BLOCK(0)
#undef Q4_BLOCK
    for (int k = 0; k < nt; k++) y[k] = hsum(_mm256_add_ps(acc[0][k], acc[1][k])) + corr[k];
#else
    for (int k = 0; k < nt; k++) y[k] = dot1_q4(w, a + k * as, nb, has_min);
#endif
}

/* Q4_K (144 bytes) and Q5_K (176 bytes, with qh: bit j of qh[l] is bit 4 of sub-block j's l-th code):
 * d, dmin (f16), 12 bytes of scales/mins, [qh,] qs: 4 chunks of 32 bytes, chunk c holding
 * sub-block 2c in its low nibbles and 2c+1 in its high nibbles. x = d*sc*q - dmin*m. */
KV_INLINE void dot_q45_k(const uint8_t *w, const act_block *a, long as, int nb, int five, int nt, float *y) {
#ifdef KV_AVX2
    const int bs = five ? 176 : 144;
    __m256 acc[NT];
    float corr[NT];
    for (int k = 0; k < nt; k++) acc[k] = _mm256_setzero_ps(), corr[k] = 0.f;
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    for (int sb = 0; sb < nb / 8; sb++, w += bs) {
        uint8_t sc[8], mn[8];
        k_scale_min(w + 4, sc, mn);
        const float d = f16_to_f32(w), dmin = f16_to_f32(w + 2);
        const uint8_t *qs = w + (five ? 48 : 16);
        const __m256i hb = five ? _mm256_loadu_si256((const __m256i *)(w + 16)) : _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 2)));
            __m256i q = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(raw, 4) : raw, m4);
            if (five) q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, j), one), 4));
            const float dj = d * sc[j], mj = dmin * mn[j];
            for (int k = 0; k < nt; k++) {
                const act_block *ab = a + k * as + 8 * sb + j;
                acc[k] = _mm256_fmadd_ps(dot_u8s8(q, load_act(ab)), _mm256_set1_ps(dj * ab->d), acc[k]);
                corr[k] += mj * ab->d * (float)(ab->s[0] + ab->s[1]);
            }
        }
    }
    for (int k = 0; k < nt; k++) y[k] = hsum(acc[k]) - corr[k];
#else
    for (int k = 0; k < nt; k++) y[k] = dot1_q45_k(w, a + k * as, nb, five);
#endif
}

/* Q6_K (210 bytes): ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16] (one per 16
 * values), d (f16, last). Value e = 128h + 32g + l (h half, g group 0..3, l 0..31): low bits are
 * nibble g/2 of ql[64h + 32(g%2) + l], high bits are bits 2g..2g+1 of qh[32h + l]; x = d*sc*(q-32).
 * Codes go to maddubs unsigned (0..63); the -32 is taken off through the activation sums. */
KV_INLINE void dot_q6_k(const uint8_t *w, const act_block *a, long as, int nb, int nt, float *y) {
#ifdef KV_AVX2
    __m256 acc[NT];
    float corr[NT];
    for (int k = 0; k < nt; k++) acc[k] = _mm256_setzero_ps(), corr[k] = 0.f;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    for (int sb = 0; sb < nb / 8; sb++, w += 210) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        const float d = f16_to_f32(w + 208);
        for (int j = 0; j < 8; j++) {
            const int h = j / 4, g = j % 4;
            const __m256i l4 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32 * (g % 2)));
            const __m256i h2 = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            const __m256i lo = _mm256_and_si256(g < 2 ? l4 : _mm256_srli_epi16(l4, 4), m4);
            const __m256i q = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h2, 2 * g), m2), 4));
            const __m256i scales = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
            for (int k = 0; k < nt; k++) {
                const act_block *ab = a + k * as + 8 * sb + j;
                const __m256i p16 = _mm256_maddubs_epi16(q, load_act(ab));
                const float da = d * ab->d;
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p16, scales)), _mm256_set1_ps(da), acc[k]);
                corr[k] += 32.f * da * (float)(sc[2 * j] * ab->s[0] + sc[2 * j + 1] * ab->s[1]);
            }
        }
    }
    for (int k = 0; k < nt; k++) y[k] = hsum(acc[k]) - corr[k];
#else
    for (int k = 0; k < nt; k++) y[k] = dot1_q6_k(w, a + k * as, nb);
#endif
}

KV_INLINE void dot_rows_nt(int t, const uint8_t *w, const act_block *a, long as, int nb, int nt, float *y) {
    switch (t) {
    case T_Q8_0: dot_q8_0(w, a, as, nb, nt, y); return;
    case T_Q4_0: dot_q4(w, a, as, nb, 0, nt, y); return;
    case T_Q4_1: dot_q4(w, a, as, nb, 1, nt, y); return;
    case T_Q4_K: dot_q45_k(w, a, as, nb, 0, nt, y); return;
    case T_Q5_K: dot_q45_k(w, a, as, nb, 1, nt, y); return;
    default: dot_q6_k(w, a, as, nb, nt, y); return;
    }
}
/* Two instances: NT activation rows at a time, and one (the rest, and decoding one token). */
static void dot_rows_4(int t, const uint8_t *w, const act_block *a, long as, int nb, float *y) {
    dot_rows_nt(t, w, a, as, nb, NT, y);
}
static void dot_rows_1(int t, const uint8_t *w, const act_block *a, int nb, float *y) {
    dot_rows_nt(t, w, a, 0, nb, 1, y);
}

/* y[T, rows] = x[T, cols] · W^T, W given as rows × (cols / block_values) blocks of type `qtype`.
 * Returns 0, or -1 for an unknown type or a cols that is not a whole number of blocks. */
int kvserve_quant_matmul(int qtype, const uint8_t *w, long rows, long cols, const float *x, long T, float *y,
                         int nthreads) {
    const int bb = block_bytes(qtype);
    if (bb == 0 || cols % block_values(qtype) != 0) return -1;
    const int nb = (int)(cols / 32);
    const size_t row_bytes = (size_t)(cols / block_values(qtype)) * bb;
    act_block *act = malloc(sizeof(act_block) * nb * T);
    if (act == NULL) return -2;
#pragma omp parallel for num_threads(nthreads) if (T * cols >= 16384)
    for (long t = 0; t < T; t++) quantize_row(x + t * cols, act + t * nb, nb);
    /* Rows in chunks of 16 per thread step; each weight row is decoded once per NT activation rows. */
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long r0 = 0; r0 < rows; r0 += 16) {
        const long r1 = r0 + 16 < rows ? r0 + 16 : rows;
        float out[NT];
        for (long r = r0; r < r1; r++) {
            long t = 0;
            for (; t + NT <= T; t += NT) {
                dot_rows_4(qtype, w + r * row_bytes, act + t * nb, nb, nb, out);
                for (int k = 0; k < NT; k++) y[(t + k) * rows + r] = out[k];
            }
            for (; t < T; t++) dot_rows_1(qtype, w + r * row_bytes, act + t * nb, nb, y + t * rows + r);
        }
    }
    free(act);
    return 0;
}

/* ---- dequantization: whole rows of blocks → float32 ---------------------------------------- */
static void dequant_block(int t, const uint8_t *w, float *out) {
    switch (t) {
    case T_Q8_0: {
        const float d = f16_to_f32(w);
        for (int i = 0; i < 32; i++) out[i] = d * (float)((const int8_t *)(w + 2))[i];
        return;
    }
    case T_Q4_0:
    case T_Q4_1: {
        const int m = t == T_Q4_1;
        const float d = f16_to_f32(w), mn = m ? f16_to_f32(w + 2) : -8.f * d;
        const uint8_t *qs = w + (m ? 4 : 2);
        for (int i = 0; i < 16; i++) {
            out[i] = d * (float)(qs[i] & 15) + mn;
            out[i + 16] = d * (float)(qs[i] >> 4) + mn;
        }
        return;
    }
    case T_Q4_K:
    case T_Q5_K: {
        const int five = t == T_Q5_K;
        uint8_t sc[8], mn[8];
        k_scale_min(w + 4, sc, mn);
        const float d = f16_to_f32(w), dmin = f16_to_f32(w + 2);
        const uint8_t *qh = w + 16, *qs = w + (five ? 48 : 16);
        for (int j = 0; j < 8; j++) {
            const float dj = d * sc[j], mj = dmin * mn[j];
            for (int l = 0; l < 32; l++) {
                int code = (qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 15;
                if (five) code |= ((qh[l] >> j) & 1) << 4;
                out[32 * j + l] = dj * (float)code - mj;
            }
        }
        return;
    }
    case T_Q6_K: {
        const int8_t *sc = (const int8_t *)(w + 192);
        const float d = f16_to_f32(w + 208);
        for (int e = 0; e < 256; e++) {
            const int h = e / 128, g = (e / 32) % 4, l = e % 32;
            const int lo = (w[64 * h + 32 * (g % 2) + l] >> (4 * (g / 2))) & 15;
            const int hi = (w[128 + 32 * h + l] >> (2 * g)) & 3;
            out[e] = d * (float)sc[e / 16] * (float)((lo | (hi << 4)) - 32);
        }
        return;
    }
    }
}

/* out[i, :] = dequantized row ids[i] (row i where ids is NULL), i < n. */
int kvserve_dequant_rows(int qtype, const uint8_t *w, long cols, const int64_t *ids, long n, float *out,
                         int nthreads) {
    const int bb = block_bytes(qtype), bv = block_values(qtype);
    if (bb == 0 || cols % bv != 0) return -1;
    const size_t row_bytes = (size_t)(cols / bv) * bb;
#pragma omp parallel for num_threads(nthreads) if (n * cols >= 65536)
    for (long i = 0; i < n; i++) {
        const uint8_t *row = w + (ids ? ids[i] : i) * row_bytes;
        for (long b = 0; b < cols / bv; b++) dequant_block(qtype, row + b * bb, out + i * cols + b * bv);
    }
    return 0;
}

/* ---- bfloat16 weights, float32 activations: y[T, rows] = x[T, cols] · W^T ------------------ */
static float dot_bf16(const uint16_t *w, const float *x, long n) {
    long k = 0;
    float sum = 0.f;
#ifdef KV_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; k + 16 <= n; k += 16) {
        const __m256i w0 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + k)));
        const __m256i w1 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + k + 8)));
        a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w1, 16)), _mm256_loadu_ps(x + k + 8), a1);
    }
    sum = hsum(_mm256_add_ps(a0, a1));
#endif
    for (; k < n; k++) sum += bf16_to_f32(w[k]) * x[k];
    return sum;
}

int kvserve_bf16_matmul(const uint16_t *w, long rows, long cols, const float *x, long T, float *y, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long r0 = 0; r0 < rows; r0 += 16) {
        const long r1 = r0 + 16 < rows ? r0 + 16 : rows;
        for (long t = 0; t < T; t++)
            for (long r = r0; r < r1; r++) y[t * rows + r] = dot_bf16(w + r * cols, x + t * cols, cols);
    }
    return 0;
}
