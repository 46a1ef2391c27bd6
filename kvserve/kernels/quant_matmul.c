/* Matmuls that read weights as stored: GGML quantized blocks, or bfloat16 on CPUs without it.
 *
 * Decoding one token reads every weight once, so bytes per weight set the speed. These kernels
 * never expand a weight to float in memory: y[t, r] = x[t, :] . W[r, :] walks the raw blocks of
 * row r (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; layouts as ggml's block_* structs and gguf-py's
 * dequantize, which tests/test_quant.py checks them against).
 *
 * The activations are quantized first, per 32 consecutive values, to int8 with one float scale d,
 * its product with the integer sum s = d * sum(q) (ggml's q8_1), and the sums of each half.
 * Every weight type's 32 values then meet one activation block in an integer dot product: weight
 * codes as unsigned bytes (4-, 5- or 6-bit; Q8_0's signed bytes through the sign trick) times
 * int8 activations, summed in int32 (AVX2 maddubs + madd, AVX-512 VNNI dpbusd where compiled for
 * it, plain C otherwise); offsets (Q4_0's -8, Q6_K's -32) and minimums (Q4_1, Q4_K, Q5_K) are
 * applied through the sums. One activation format for all types (not ggml's Q8_K for K-quants)
 * keeps the activation error the same for every type. At two levels (quantize_input) a row is
 * quantized again for what the first int8 left, as a second activation row, and its two products
 * added (rows_out): ~15 bits of each activation for twice the integer dots (docs/quality.md).
 *
 * The SIMD paths work in register tiles (see tile()): a weight block is decoded once for 4
 * activation rows and an activation block loaded once for 2-4 weight rows; the per-block float
 * scales are made 8 blocks at a time as vectors, so the inner loop is the integer dot, one
 * convert and one FMA per block and row pair; one horizontal sum per output at the end.
 * Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K rows are repacked at load into the x8 layout (kvserve_pack_x8, as
 * llama.cpp's and ik_llama.cpp's repacked types are, here 8 blocks of one row): one integer dot
 * instruction then advances 8 blocks at once, each block's sum in its own lane, and the float
 * work falls to one convert and one FMA per 8 blocks and row pair (tile_x8). The plain C build
 * multiplies x8 rows too (all types but Q8_0 are repacked there): a group's codes decoded once
 * for the tile's activation rows, then 32 bytes at a time that the compiler vectorizes for any
 * target, with the stored path's float work in its order (the same bits as the stored layout).
 *
 * Also: rows of quantized blocks dequantized to float32 (the embedding lookup, and the large-batch
 * path, where BLAS on a dequantized copy beats the integer kernel), and a GEMV over bfloat16
 * weights converted in registers (float32 accumulation).
 * Output rows are spread over OpenMP threads; the code path is picked at compile time from the
 * ISA flags kernels/__init__.py passes (KVSERVE_ISA=portable builds the plain C path).
 */
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KV_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KV_VNNI 1 /* the dot is dpbusd: 4 products straight into int32, no int16 step */
#ifndef KV_NO_WIDE_TILES
#define WIDE_TILES 1 /* 32 vector registers: batches as 4 weight rows x 4 activation rows */
#endif
#endif
#endif

#include "numerics.h"

/* GGML type ids (gguf GGMLQuantizationType) */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

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

/* x8: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 rows repacked 8 blocks at a time, K-quant rows a super-block at a
 * time (kvserve_pack_x8, below); their type id is the GGML id + X8. Same bytes per row, so block sizes are
 * the base type's. */
#define X8 1000
static inline int base_type(int t) { return t >= X8 ? t - X8 : t; }
static inline int x8_packs(int t) { return t == T_Q4_0 || t == T_Q4_1 || t == T_Q8_0 || t == T_Q5_0 || t == T_Q5_1 || t == T_Q4_K || t == T_Q5_K || t == T_Q6_K; }
static inline int k_type(int t) { return base_type(t) == T_Q4_K || base_type(t) == T_Q5_K || base_type(t) == T_Q6_K; }
#if defined(WIDE_TILES) && defined(__AVX512BW__) && !defined(KV_NO_PAIRS)
#define PAIR_TILES 1 /* x8 Q4_0, Q4_1 and Q8_0 batches: 4 weight rows x pairs of activation rows (tile_x8_pairs) */
#endif
/* The rows of an x8 slab (kvserve_pack_x8): 4, as many as the tiles take at one token and, for the Q4 / Q5
 * types and (with pair tiles) Q8_0, in batches. Without pair tiles Q8_0's batches take 2-row tiles, which
 * read half of each group of a 4-row slab and ran 1.1-1.5x slower from memory at 2 to 16 rows, so its
 * rows stay one after another there (a slab of 1), as they do with -DKV_Q8_PLAIN (for A/B runs). */
static inline long slab_rows(int t) {
#if defined(PAIR_TILES) && !defined(KV_Q8_PLAIN)
    (void)t;
    return 4;
#else
    return t == T_Q8_0 ? 1 : 4;
#endif
}
/* Whether row r of an x8 matrix of t with `rows` rows lies in a whole slab. */
static inline int x8_slab(int t, long r, long rows) { return slab_rows(t) > 1 && (r & ~(slab_rows(t) - 1)) + slab_rows(t) <= rows; }

/* Bytes and values per block of each type; 0 for an unknown type. */
static int block_bytes(int t) {
    if (t >= X8 && !x8_packs(t - X8)) return 0;
    switch (base_type(t)) {
    case T_Q8_0: return 34;
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    }
    return 0;
}
static int block_values(int t) { return k_type(t) ? 256 : 32; }
/* An x8 row's groups: 8 blocks each, the blocks past the last whole group stored apart (its tail);
 * a K-quant row's: one super-block each (its 8 sub-blocks the 8 lanes), no tail. nb: blocks of t a row. */
static inline long x8_groups(int t, long nb) { return k_type(t) ? nb : nb / 8; }
static inline size_t x8_group_bytes(int t) { return (k_type(t) ? 1 : 8) * (size_t)block_bytes(t); }
static inline long x8_tail_blocks(int t, long nb) { return k_type(t) ? 0 : nb % 8; }
/* Tail pairs (the SIMD builds): in a slab (below), the blocks past its rows' last whole group taken two at a
 * time, blocks 2p and 2p + 1 of its 4 rows packed as one x8 group, lane 2i + j holding row i's block 2p + j.
 * A tile then sums its rows' tails in a group's arithmetic, one group for 4 rows, where block-by-block sums
 * (acc32) made a 576-wide row (2 groups and 2 blocks) cost more than a 768-wide one. An odd tail's last
 * block stays as stored. -DKV_NO_TAIL_PAIRS keeps every tail as stored (for A/B runs). */
#if defined(KV_AVX2) && !defined(KV_NO_TAIL_PAIRS)
static inline long tail_pairs(int t, long nb) { return x8_tail_blocks(t, nb) / 2; }
#else
static inline long tail_pairs(int t, long nb) { (void)t, (void)nb; return 0; }
#endif

/* Q4_K / Q5_K: eight 6-bit scales and mins packed in 12 bytes. */
static inline void k_scale_min(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

/* ---- activations → int8 blocks ------------------------------------------------------------ */
/* Activation row t, block b (32 values) is stored as arrays, so that the scales of 8 consecutive
 * blocks load as one vector: q (32 int8), d (x ~= d * q), s = d * sum(q) (the minimum and
 * offset terms of Q4_0/Q4_1/Q4_K/Q5_K in one multiply, as ggml's q8_1 does), and h, the integer
 * sums of each half (Q6_K has one scale per 16 values). Index: t * nb + b. */
typedef struct {
    int8_t *q;
    float *d, *s;
    int16_t *h;
    long nb;
    int8_t *qt; /* q of each whole group of 8 blocks transposed as the x8 weights are */
    float *dp, *sp; /* d and s of each whole group, rows 2P and 2P + 1 side by side (see qt_at) */
    long T;
} acts;
#define ACT_BYTES 84 /* per 32 values: q 32, d 4, s 4, h 4, qt 32, dp 4, sp 4 */
/* Rows the buffer holds room for: T, or T + 1 when T is odd (the pair layout's last pair). */
static inline long act_rows(long T) { return T + (T & 1); }

/* The arrays of T rows of nb blocks laid over one buffer of act_rows(T) * nb * ACT_BYTES bytes; qt,
 * dp and sp only for a call that multiplies x8 rows (quantize_row transposes nothing otherwise). */
static acts acts_over(char *buf, long T, long nb, int x8) {
    const size_t n = (size_t)(act_rows(T) * nb);
    const acts A = {(int8_t *)buf, (float *)(buf + 32 * n), (float *)(buf + 36 * n), (int16_t *)(buf + 40 * n), nb,
                    x8 ? (int8_t *)(buf + 44 * n) : NULL, (float *)(buf + 76 * n), (float *)(buf + 80 * n), T};
    return A;
}
/* qt and dp / sp hold rows in pairs, so that one 512-bit load gives two rows' words (tile_x8_pairs):
 * a 32-byte word of row 2P, then the same word of row 2P + 1 (dp / sp: a group's 8 floats of each).
 * An odd T's last row is stored twice (its pair's second row is itself). Blocks past the last
 * whole group are not stored. */
static inline int8_t *qt_at(const acts *A, long t, long blk) { return A->qt + 64 * ((t >> 1) * A->nb + blk) + 32 * (t & 1); }
static inline long pair_at(const acts *A, long P, long blk) { return 2 * (P * A->nb + blk); } /* dp / sp: 16 floats */
/* A tail pair's activation words (blocks blk and blk + 1, blk past the last whole group) in the 128 bytes
 * qt keeps for those two blocks of a row pair: word s (values 4s..4s+3) of both blocks, 8 bytes, row 2P's
 * then row 2P + 1's, so one 64-bit broadcast gives the 4 lane pairs of a tail pair group their words. */
static inline int8_t *tail_word(const acts *A, long t, long blk, int s) {
    return A->qt + 64 * ((t >> 1) * A->nb + blk) + 16 * s + 8 * (t & 1);
}

/* One block of 32 values x as activation block o: q, d, s and h. */
static inline void quantize_block(const float *x, const acts *A, long o) {
#ifdef KV_AVX2
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + 8 * i), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    __m256i q[4]; /* round to nearest even, as lrintf below */
    for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    const __m256i lo = _mm256_add_epi32(q[0], q[1]), hi = _mm256_add_epi32(q[2], q[3]);
    /* packs interleave the 128-bit lanes; the permute puts the 32 values back in order */
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)(A->q + 32 * o), _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m256i hs = _mm256_hadd_epi32(lo, hi); /* lanes: lo lo hi hi | lo lo hi hi */
    hs = _mm256_hadd_epi32(hs, hs);
    const __m128i h2 = _mm_add_epi32(_mm256_castsi256_si128(hs), _mm256_extracti128_si256(hs, 1));
    const int s0 = _mm_cvtsi128_si32(h2), s1 = _mm_extract_epi32(h2, 1);
#else
    float amax = 0.f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int s0 = 0, s1 = 0;
    for (int i = 0; i < 32; i++) {
        const int q = (int)lrintf(x[i] * id);
        A->q[32 * o + i] = (int8_t)q;
        if (i < 16) s0 += q; else s1 += q;
    }
#endif
    A->d[o] = d;
    A->s[o] = d * (float)(s0 + s1);
    A->h[2 * o] = (int16_t)s0;
    A->h[2 * o + 1] = (int16_t)s1;
}

/* Row t's blocks, once quantized, into the x8 layouts' transposed words (qt, dp, sp). */
static void transpose_row(const acts *A, long t) {
#ifdef KV_AVX2
    /* 8 blocks x 8 words → vector s holding word s of each block: an 8 x 8 transpose of int32 */
    const int twice = t + 1 == A->T && (t & 1) == 0; /* an odd T's last row: also its pair's second row */
    for (long g = 0; A->qt != NULL && g + 8 <= A->nb; g += 8) {
        const __m256i *src = (const __m256i *)(A->q + 32 * (t * A->nb + g));
        __m256i r[8], u[8];
        for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_si256(src + j);
        for (int j = 0; j < 8; j += 2) {
            u[j] = _mm256_unpacklo_epi32(r[j], r[j + 1]);
            u[j + 1] = _mm256_unpackhi_epi32(r[j], r[j + 1]);
        }
        for (int j = 0; j < 8; j += 4)
            for (int k = 0; k < 2; k++) {
                r[j + k] = _mm256_unpacklo_epi64(u[j + k], u[j + k + 2]);
                r[j + k + 2] = _mm256_unpackhi_epi64(u[j + k], u[j + k + 2]);
            }
        /* r[0..3]: words {0,4},{2,6},{1,5},{3,7} of blocks 0-3 (low lane) / ... ; r[4..7] the same for blocks 4-7 */
        static const int word[4] = {0, 2, 1, 3};
        for (long tt = t; tt <= t + twice; tt++) {
            for (int k = 0; k < 4; k++) {
                _mm256_storeu_si256((__m256i *)qt_at(A, tt, g + word[k]), _mm256_permute2x128_si256(r[k], r[k + 4], 0x20));
                _mm256_storeu_si256((__m256i *)qt_at(A, tt, g + word[k] + 4), _mm256_permute2x128_si256(r[k], r[k + 4], 0x31));
            }
            memcpy(A->dp + pair_at(A, tt >> 1, g) + 8 * (tt & 1), A->d + t * A->nb + g, 32);
            memcpy(A->sp + pair_at(A, tt >> 1, g) + 8 * (tt & 1), A->s + t * A->nb + g, 32);
        }
    }
    for (long b = A->nb / 8 * 8; A->qt != NULL && b + 2 <= A->nb; b += 2) /* tail pairs' words */
        for (long tt = t; tt <= t + twice; tt++)
            for (int s = 0; s < 8; s++)
                for (int j = 0; j < 2; j++) memcpy(tail_word(A, tt, b, s) + 4 * j, A->q + 32 * (t * A->nb + b + j) + 4 * s, 4);
#else /* word s (4 values) of block j → bytes 4 j.. of transposed word s (tile_x8); no pairs to fill */
    for (long g = 0; A->qt != NULL && g + 8 <= A->nb; g += 8)
        for (int s = 0; s < 8; s++)
            for (int j = 0; j < 8; j++) memcpy(qt_at(A, t, g + s) + 4 * j, A->q + 32 * (t * A->nb + g + j) + 4 * s, 4);
#endif
}

/* Input row x (A->nb blocks) as activation row t. */
static void quantize_row(const float *x, const acts *A, long t) {
    for (long b = 0; b < A->nb; b++) quantize_block(x + 32 * b, A, t * A->nb + b);
    transpose_row(A, t);
}

/* Input row x at two levels, activation rows 2t and 2t + 1: each block quantized, then what that left
 * (x - d q, at most d / 2 a value) quantized again. Their two products sum to ~15 bits of the input
 * against int8's ~7: the exact float path's answers to within ~1e-5, at twice the integer dots (the
 * weights are decoded once for both, as for any two rows). */
static void quantize_row2(const float *x, const acts *A, long t) {
    float rest[32];
    for (long b = 0, o = 2 * t * A->nb; b < A->nb; b++, o++, x += 32) {
        quantize_block(x, A, o);
        for (int i = 0; i < 32; i++) rest[i] = x[i] - A->d[o] * (float)A->q[32 * o + i];
        quantize_block(rest, A, o + A->nb);
    }
    transpose_row(A, 2 * t);
    transpose_row(A, 2 * t + 1);
}

/* Input row x as `levels` (1 or 2) activation rows: levels * t, and levels * t + 1 for the second. */
static inline void quantize_input(const float *x, const acts *A, long t, int levels) {
    if (levels == 2)
        quantize_row2(x, A, t);
    else
        quantize_row(x, A, t);
}

/* ---- tiles: RW weight rows × RT activation rows ------------------------------------------- */
/* tile(): y[k * ldy + i] = weight row i · activation row t0 + k, for i < RW, k < RT. Each weight
 * block is decoded once for the RT activation rows and each activation block loaded once for
 * the RW weight rows (RW = 4, RT = 1 when decoding one token; 2 × 4 for batches). Per 8 blocks
 * (a K-quant's 8 sub-blocks), the weight scales are turned into float vectors at once and
 * multiplied by the 8 activation scales; the minimum / offset terms (m · d_a · sum q_a) are one
 * vector FMA per 8 blocks. Per block and row pair: the integer dot, one convert, one FMA.
 * Every (i, k) sum runs the same operations in the same order whatever the tile, so a row's
 * result does not depend on the batch it came in. */
#define RWMAX 4
#define RTMAX 4
/* Where a tile's RW weight rows lie. Stored layouts: row i at w + i rs (rs: a row's bytes; gs, tail
 * and trs unused). x8 rows: row i's group g (8 blocks) at w + i rs + g gs; in a slab, its tail pairs
 * (np groups from tp, the tile's row i in lanes 2 (lane0 + i) and 2 (lane0 + i) + 1); its blocks past
 * those (GGML's layout) at tail + i trs: a slab's rows (x8_slab) or one row after another. */
typedef struct {
    const uint8_t *w;
    size_t rs, gs;
    const uint8_t *tail;
    size_t trs;
    size_t ahead; /* x8 in a slab: from a group of the rows to the same group two slabs on; else 0 */
    const uint8_t *tp;
    long np;
    int lane0;
} wrows;
#define KV_INLINE static inline __attribute__((always_inline))
/* tile loops unrolled before the accumulator arrays are split into registers */
#define KV_UNROLL _Pragma("GCC unroll 4")

#ifdef KV_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* 32 unsigned weight codes · 32 int8 activations → 8 int32 partial sums, as float (codes < 128
 * for maddubs, whose int16 pair sums would overflow above; any byte for dpbusd). */
static inline __m256 dot_u8s8(__m256i u, __m256i s) {
#ifdef KV_VNNI
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s));
#else
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
/* 16 bytes → 32 codes (low nibbles, then high): both 128-bit lanes get the bytes, the high lane
 * shifted by 4 (64-bit shifts: bits that cross into a neighbour byte are masked off). */
static inline __m256i nibbles16(const uint8_t *qs) {
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
}
/* Q5_0 / Q5_1: 32 bits (bit j: the fifth bit of value j) → 32 bytes of 0x10 or 0. */
static inline __m256i fifth_bits(const uint8_t *qh) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), /* byte j <- byte j / 8 of qh */
                                               _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL); /* bit j % 8 of byte j */
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}
static inline __m256i lanes_below(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
/* n <= 8 floats, lanes past n zero (never read past the row) */
static inline __m256 load_n(const float *p, int n, __m256i mask) { return n == 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mask); }

/* f16 scale d (and Q4_1's minimum m, the next 2 bytes) of n <= 8 consecutive blocks bs bytes apart.
 * Plain loads paired in 64-bit registers: cheaper here than a gather, which also stalled on the
 * first touch of weights that stream from memory. */
KV_INLINE void block_scales(const uint8_t *w, int bs, int n, __m256 *d, __m256 *m) {
    uint64_t v[4] = {0, 0, 0, 0};
    for (int j = 0; j < 8; j++) {
        uint32_t x = 0;
        if (j < n) memcpy(&x, w + j * bs, 4);
        v[j / 2] |= (uint64_t)x << (32 * (j & 1));
    }
    const __m256i raw = _mm256_setr_epi64x((long long)v[0], (long long)v[1], (long long)v[2], (long long)v[3]);
    /* per 128-bit lane: the four d's, then the four m's; then d0..d7 in the low half, m0..m7 high */
    const __m256i split = _mm256_shuffle_epi8(raw, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                                                    0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const __m256i both = _mm256_permute4x64_epi64(split, _MM_SHUFFLE(3, 1, 2, 0));
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(both));
    *m = _mm256_cvtph_ps(_mm256_extracti128_si256(both, 1));
}

/* The rows two tiles ahead, a group's share at a time (rows are contiguous, so this is
 * one stream): the hardware prefetcher loses track of RW interleaved rows that stream from
 * memory (the LM head at one token ran at a third of the bandwidth without this). _mm_prefetch
 * was dropped by GCC 12 here; the builtin is kept. */
static inline void prefetch_next(const uint8_t *w, size_t rb, int RW, int group_bytes, long g) {
    const uint8_t *p = w + 2 * RW * rb + (size_t)g * RW * group_bytes;
    for (int o = 0; o < RW * group_bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

/* Prefetch for group g of a tile's x8 rows. Rows one after another: prefetch_next, as acc32 does. A
 * slab's rows: their group two slabs on, in batches only. A one-token tile reads its slab front to
 * back and the hardware prefetcher keeps ahead of it unaided (prefetching made it slower: 0.84
 * against 0.61 of separate rows' time); a batch's tiles spend longer on each byte, and there it pays
 * (1.5x slower without it at 16 rows). */
KV_INLINE void prefetch_group(const wrows *R, long g, int RW, int RT, int gb) {
    if (R->ahead == 0) prefetch_next(R->w, R->rs, RW, gb, g);
    else if (RT > 1)
        for (int o = 0; o < RW * gb; o += 64) __builtin_prefetch(R->w + g * R->gs + R->ahead + o, 0, 3);
}

/* A tile's RW x RT vector accumulators: cleared, and summed into y (row i of the weight, row k of x). */
KV_INLINE void zero_sums(__m256 acc[][RTMAX], int RW, int RT) {
    KV_UNROLL
    for (int i = 0; i < RW; i++)
        KV_UNROLL
        for (int k = 0; k < RT; k++) acc[i][k] = _mm256_setzero_ps();
}

/* hsum of a0..a3 at once, [hsum(a0), hsum(a1), hsum(a2), hsum(a3)]: the same additions in the same pairs
 * (x_j = v_j + v_j+4, then (x_0 + x_2) + (x_1 + x_3)), so the same bits, in a third of the instructions. */
static inline __m128 hsum4_rows(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 s01 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31)); /* [x(a0) | x(a1)] */
    const __m256 s23 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20), _mm256_permute2f128_ps(a2, a3, 0x31));
    /* per 128-bit lane: x_0 + x_2, x_1 + x_3 of s01's vector, then of s23's */
    const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(t, t, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(t, t, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm_unpacklo_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1)); /* lanes [a0 a2 ..], [a1 a3 ..] */
}

KV_INLINE void store_sums(__m256 acc[][RTMAX], int RW, int RT, float *y, long ldy) {
    if (RW == 4) {
        KV_UNROLL
        for (int k = 0; k < RT; k++) _mm_storeu_ps(y + k * ldy, hsum4_rows(acc[0][k], acc[1][k], acc[2][k], acc[3][k]));
        return;
    }
    KV_UNROLL
    for (int i = 0; i < RW; i++)
        KV_UNROLL
        for (int k = 0; k < RT; k++) y[k * ldy + i] = hsum(acc[i][k]);
}

/* k_scale_min's bytes as two little-endian words (byte j: sub-block j), computed in registers:
 * the kernel's vector loads of bytes stored one at a time would wait on failed store forwarding
 * (the Q4_K one-token kernel ran at 11 GB/s so). */
static inline void k_scale_min_words(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t a, b, c;
    memcpy(&a, s, 4), memcpy(&b, s + 4, 4), memcpy(&c, s + 8, 4);
    const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | (((a >> 6) & 0x03030303u) << 4);
    const uint32_t mn_hi = ((c >> 4) & 0x0F0F0F0Fu) | (((b >> 6) & 0x03030303u) << 4);
    *sc = (uint64_t)(a & 0x3F3F3F3Fu) | (uint64_t)sc_hi << 32;
    *mn = (uint64_t)(b & 0x3F3F3F3Fu) | (uint64_t)mn_hi << 32;
}

/* Q8_0 (d, 32 int8), Q4_0 (d, 16 bytes of nibbles; x = d (q - 8)), Q4_1 (d, m, nibbles; x = d q + m),
 * Q5_0 (d, 4 bytes of fifth bits, nibbles; x = d (q - 16)), Q5_1 (d, m, fifth bits, nibbles; x = d q + m).
 * Q8_0's signed codes: maddubs would overflow its int16 pairs on q + 128, so AVX2 takes |q| times
 * the activation with q's sign (two sign ops per block and row pair); dpbusd has no int16 step,
 * so with VNNI the codes go in as q + 128 (one xor per weight block) and the 128 comes off
 * through the activation sums, as Q4_0's 8 does. */
#ifdef KV_VNNI
#define Q8_OFFSET 1
#else
#define Q8_OFFSET 0
#endif
/* The sums of blocks g0.. (a multiple of 8) of RW weight rows (w: row 0's block g0, rows rb apart) and RT
 * activation rows, into acc. */
KV_INLINE void acc32(int t, const uint8_t *w, size_t rb, const acts *A, long t0, int RW, int RT, __m256 acc[][RTMAX],
                     long g0) {
    const int bs = block_bytes(t);
    const long nb = A->nb;
    for (long g = g0; g < nb; g += 8) {
        const int n = nb - g < 8 ? (int)(nb - g) : 8;
        const __m256i mask = lanes_below(n);
        float scl[RWMAX][RTMAX][8] __attribute__((aligned(32)));
        prefetch_next(w, rb, RW, 8 * bs, (g - g0) / 8);
        KV_UNROLL
        for (int i = 0; i < RW; i++) {
            __m256 d, m;
            block_scales(w + i * rb + (g - g0) * bs, bs, n, &d, &m);
            if (t == T_Q4_0) m = _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
            if (t == T_Q5_0) m = _mm256_mul_ps(d, _mm256_set1_ps(-16.f));
            if (t == T_Q8_0 && Q8_OFFSET) m = _mm256_mul_ps(d, _mm256_set1_ps(-128.f));
            KV_UNROLL
            for (int k = 0; k < RT; k++) {
                const long o = (t0 + k) * nb + g;
                _mm256_store_ps(scl[i][k], _mm256_mul_ps(d, load_n(A->d + o, n, mask)));
                if (t != T_Q8_0 || Q8_OFFSET) acc[i][k] = _mm256_fmadd_ps(m, load_n(A->s + o, n, mask), acc[i][k]);
            }
        }
        for (int j = 0; j < n; j++) {
            __m256i u[RWMAX], sg[RWMAX];
            KV_UNROLL
            for (int i = 0; i < RW; i++) {
                const uint8_t *b = w + i * rb + (g - g0 + j) * bs;
                if (t == T_Q8_0 && Q8_OFFSET) { /* q + 128 as unsigned bytes */
                    u[i] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8((char)0x80));
                } else if (t == T_Q8_0) { /* |q| · (x with q's sign): unsigned · signed, as maddubs wants */
                    sg[i] = _mm256_loadu_si256((const __m256i *)(b + 2));
                    u[i] = _mm256_sign_epi8(sg[i], sg[i]);
                } else if (t == T_Q5_0 || t == T_Q5_1) {
                    u[i] = _mm256_or_si256(nibbles16(b + bs - 16), fifth_bits(b + (t == T_Q5_0 ? 2 : 4)));
                } else {
                    u[i] = nibbles16(b + bs - 16);
                }
            }
            KV_UNROLL
            for (int k = 0; k < RT; k++) {
                const __m256i qa = _mm256_loadu_si256((const __m256i *)(A->q + 32 * ((t0 + k) * nb + g + j)));
                KV_UNROLL
                for (int i = 0; i < RW; i++) {
                    const __m256 p = dot_u8s8(u[i], t == T_Q8_0 && !Q8_OFFSET ? _mm256_sign_epi8(qa, sg[i]) : qa);
                    acc[i][k] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(&scl[i][k][j]), acc[i][k]);
                }
            }
        }
    }
}

KV_INLINE void tile32(int t, const uint8_t *w, size_t rb, const acts *A, long t0, int RW, int RT, float *y, long ldy) {
    __m256 acc[RWMAX][RTMAX];
    zero_sums(acc, RW, RT);
    acc32(t, w, rb, A, t0, RW, RT, acc, 0);
    store_sums(acc, RW, RT, y, ldy);
}

/* x8 rows (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K repacked by kvserve_pack_x8; Q6_K: tile_x8_q6k): per group of 8 blocks (a
 * K-quant's super-block: 8 sub-blocks) the integer dots of all 8 blocks advance together, block j's in int32
 * lane j (Q4: 4 words of low nibbles, codes 0-15 against activation words 0-3, and of high nibbles, codes
 * 16-31 against words 4-7, Q5's with their fifth bits; Q8_0: 8 words), then one convert and one FMA by the 8
 * blocks' scale products per row pair, and one FMA for the offset / minimum term (x8_scales; a K-quant's
 * sub-block scales and minimums unpacked once per super-block). In a slab, the blocks past the last whole group
 * go two at a time as tail pairs (one group for the slab's 4 rows, each row taking its two lanes); the rest are
 * stored as GGML's, and summed as tile32 sums them. Every (i, k) sum runs the same operations whatever the tile. */
#ifdef KV_VNNI
#define DP(acc, u, a) _mm256_dpbusd_epi32(acc, u, a)
#else
#define DP(acc, u, a) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)))
#endif
/* Q5_0 / Q5_1 x8 groups hold the 8 blocks' fifth bits as one more word before the nibbles (lane
 * j: block j's 32 bits); word s of the nibbles (values 4s..4s+3 low, 16+4s.. high) takes its bits
 * from byte s / 2 (low) and 2 + s / 2 (high) of that word. */
static inline __m256i x8_fifth_bits(__m256i qh, int byte, int s) {
    const __m256i idx = _mm256_add_epi8(_mm256_set1_epi8((char)byte), /* each lane's 4 bytes <- its byte `byte` */
                                        _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                                                         0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
    const uint32_t o = 4 * (s & 1), bits = (1u << o) | (2u << o) << 8 | (4u << o) << 16 | (8u << o) << 24;
    const __m256i bit = _mm256_set1_epi32((int)bits); /* byte b of a lane: bit o + b */
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, idx), bit), bit), _mm256_set1_epi8(0x10));
}
/* A group's 8 scales d and offset / minimum terms m (x = d q + m per lane, m applied through the
 * activation sums s) from the group's header at o, for tile_x8 and tile_x8_pairs alike. */
KV_INLINE void x8_scales(int t, const uint8_t *o, __m256 *d, __m256 *m) {
    if (t == T_Q4_K || t == T_Q5_K) { /* sub-block j: x = d sc_j q - dmin mn_j, as tile_q45_k makes them */
        uint64_t sc, mn;
        k_scale_min_words(o + 4, &sc, &mn);
        *d = _mm256_mul_ps(_mm256_set1_ps(f16_to_f32(o)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc))));
        *m = _mm256_mul_ps(_mm256_set1_ps(-f16_to_f32(o + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn))));
        return;
    }
    *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o));
    *m = _mm256_setzero_ps();
    if (t == T_Q4_1 || t == T_Q5_1) *m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 16)));
    if (t == T_Q4_0) *m = _mm256_mul_ps(*d, _mm256_set1_ps(-8.f));
    if (t == T_Q5_0) *m = _mm256_mul_ps(*d, _mm256_set1_ps(-16.f));
    if (t == T_Q8_0 && Q8_OFFSET) *m = _mm256_mul_ps(*d, _mm256_set1_ps(-128.f));
}
/* Activation word s of row `at` against a group at block blk: qt's word of a whole group, or (pair) a tail
 * pair's two blocks' words broadcast to its 4 lane pairs. */
KV_INLINE __m256i act_word(const acts *A, long at, long blk, int s, int pair) {
    if (pair) {
        long long v;
        memcpy(&v, tail_word(A, at, blk, s), 8);
        return _mm256_set1_epi64x(v);
    }
    return _mm256_loadu_si256((const __m256i *)qt_at(A, at, blk + s));
}
/* The integer dots of one group (its first block blk) of RW weight rows (row i's at w + i rs) against RT
 * activation rows: lane j of dot[i][k], block j's sum. */
KV_INLINE void x8_dots(int t, const uint8_t *w, size_t rs, const acts *A, long t0, long blk, int pair, int RW, int RT,
                       __m256i dot[][RTMAX]) {
    const int five = t == T_Q5_0 || t == T_Q5_1 || t == T_Q5_K, mins = t == T_Q4_1 || t == T_Q5_1, kq = t == T_Q4_K || t == T_Q5_K;
    const int codes = (kq ? 16 : mins ? 32 : 16) + (five ? 32 : 0); /* (Q4_K / Q5_K: d, dmin, 12 bytes of scales) */
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    KV_UNROLL
    for (int i = 0; i < RW; i++)
        KV_UNROLL
        for (int k = 0; k < RT; k++) dot[i][k] = _mm256_setzero_si256();
    if (t != T_Q8_0) {
        __m256i qh[RWMAX];
        KV_UNROLL
        for (int i = 0; i < RW; i++)
            if (five) qh[i] = _mm256_loadu_si256((const __m256i *)(w + i * rs + codes - 32));
        KV_UNROLL
        for (int s = 0; s < 4; s++) {
            __m256i lo[RWMAX], hi[RWMAX];
            KV_UNROLL
            for (int i = 0; i < RW; i++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + i * rs + codes + 32 * s));
                lo[i] = _mm256_and_si256(v, m4);
                hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                if (five) {
                    lo[i] = _mm256_or_si256(lo[i], x8_fifth_bits(qh[i], s / 2, s));
                    hi[i] = _mm256_or_si256(hi[i], x8_fifth_bits(qh[i], 2 + s / 2, s));
                }
            }
            KV_UNROLL
            for (int k = 0; k < RT; k++) {
                const __m256i a0 = act_word(A, t0 + k, blk, s, pair), a1 = act_word(A, t0 + k, blk, s + 4, pair);
                KV_UNROLL
                for (int i = 0; i < RW; i++) {
#ifdef KV_VNNI
                    dot[i][k] = DP(DP(dot[i][k], lo[i], a0), hi[i], a1);
#else /* codes < 32: two maddubs' int16 pairs add without overflow before one madd */
                    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[i], a0), _mm256_maddubs_epi16(hi[i], a1));
                    dot[i][k] = _mm256_add_epi32(dot[i][k], _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
                }
            }
        }
    } else {
        KV_UNROLL
        for (int s = 0; s < 8; s++) {
            __m256i u[RWMAX], sg[RWMAX];
            KV_UNROLL
            for (int i = 0; i < RW; i++) {
                sg[i] = _mm256_loadu_si256((const __m256i *)(w + i * rs + codes + 32 * s));
                u[i] = Q8_OFFSET ? _mm256_xor_si256(sg[i], _mm256_set1_epi8((char)0x80)) : _mm256_sign_epi8(sg[i], sg[i]);
            }
            KV_UNROLL
            for (int k = 0; k < RT; k++) {
                const __m256i a = act_word(A, t0 + k, blk, s, pair);
                KV_UNROLL
                for (int i = 0; i < RW; i++) dot[i][k] = DP(dot[i][k], u[i], Q8_OFFSET ? a : _mm256_sign_epi8(a, sg[i]));
            }
        }
    }
}
/* Two floats (a tail pair's blocks' activation scales) in each lane pair. */
static inline __m256 lane_pairs(const float *p) { return _mm256_castpd_ps(_mm256_broadcast_sd((const double *)p)); }
KV_INLINE void tile_x8(int t, const wrows *R, const acts *A, long t0, int RW, int RT, float *y, long ldy) {
    const long nb = A->nb, groups = nb / 8;
    __m256 acc[RWMAX][RTMAX];
    zero_sums(acc, RW, RT);
    for (long g = 0; g < groups; g++) {
        __m256i dot[RWMAX][RTMAX];
        const uint8_t *w = R->w + g * R->gs; /* row i's group g at w + i rs */
        const size_t rs = R->rs;
        prefetch_group(R, g, RW, RT, (int)x8_group_bytes(t));
        x8_dots(t, w, rs, A, t0, 8 * g, 0, RW, RT, dot);
        KV_UNROLL
        for (int i = 0; i < RW; i++) {
            __m256 d, m;
            x8_scales(t, w + i * rs, &d, &m);
            KV_UNROLL
            for (int k = 0; k < RT; k++) {
                const long off = (t0 + k) * nb + 8 * g;
                if (t != T_Q8_0 || Q8_OFFSET) acc[i][k] = _mm256_fmadd_ps(m, _mm256_loadu_ps(A->s + off), acc[i][k]);
                acc[i][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][k]), _mm256_mul_ps(d, _mm256_loadu_ps(A->d + off)),
                                            acc[i][k]);
            }
        }
    }
    /* Tail pairs: one group's dots serve the slab's 4 rows; each row takes its two lanes, in a group's
     * operations (m·s, then dot·(d·d_a)), the other lanes left as they were. */
    for (long p = 0; p < R->np; p++) {
        __m256 mine[RWMAX];
        KV_UNROLL
        for (int i = 0; i < RW; i++)
            mine[i] = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), _mm256_set1_epi32(R->lane0 + i)));
        const long blk = 8 * groups + 2 * p;
        const uint8_t *G = R->tp + p * x8_group_bytes(t);
        __m256i dot[1][RTMAX];
        x8_dots(t, G, 0, A, t0, blk, 1, 1, RT, dot);
        __m256 d, m;
        x8_scales(t, G, &d, &m);
        KV_UNROLL
        for (int k = 0; k < RT; k++) {
            const long off = (t0 + k) * nb + blk;
            const __m256 sa = lane_pairs(A->s + off), sd = _mm256_mul_ps(d, lane_pairs(A->d + off));
            const __m256 f = _mm256_cvtepi32_ps(dot[0][k]);
            KV_UNROLL
            for (int i = 0; i < RW; i++) {
                if (t != T_Q8_0 || Q8_OFFSET) acc[i][k] = _mm256_blendv_ps(acc[i][k], _mm256_fmadd_ps(m, sa, acc[i][k]), mine[i]);
                acc[i][k] = _mm256_blendv_ps(acc[i][k], _mm256_fmadd_ps(f, sd, acc[i][k]), mine[i]);
            }
        }
    }
    const long g0 = 8 * groups + 2 * R->np;
    if (g0 < nb) acc32(t, R->tail, R->trs, A, t0, RW, RT, acc, g0);
    store_sums(acc, RW, RT, y, ldy);
}
/* x8 Q6_K super-blocks (x8_move): d (f16), the 16 int8 scales, 2 words of high bits, 4 words of low
 * nibbles; sub-block j in lane j. Word s of the nibbles holds, as Q4_0's, values 4s..4s+3 (low) and
 * 16+4s.. (high) of each sub-block; byte b of high-bit word k holds the 2 high bits of values 8k+b,
 * 16+8k+b, 8k+4+b and 16+8k+4+b. The two halves of a sub-block have their own scales, so their
 * integer dots are kept apart (one pass each) and scaled by d·sc_2j·d_a and d·sc_2j+1·d_a; the -32
 * comes off through the activations' half sums, as tile_q6_k takes it. */
KV_INLINE void tile_x8_q6k(const wrows *R, const acts *A, long t0, int RW, int RT, float *y, long ldy) {
    const long nb = A->nb, groups = nb / 8;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m128i evens_odds = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    __m256 acc[RWMAX][RTMAX];
    zero_sums(acc, RW, RT);
    for (long g = 0; g < groups; g++) {
        const uint8_t *w = R->w + g * R->gs;
        const size_t rs = R->rs;
        prefetch_group(R, g, RW, RT, 210);
        KV_UNROLL
        for (int half = 0; half < 2; half++) { /* values 0-15 of each sub-block, then 16-31 */
            __m256i dot[RWMAX][RTMAX];
            KV_UNROLL
            for (int i = 0; i < RW; i++)
                KV_UNROLL
                for (int k = 0; k < RT; k++) dot[i][k] = _mm256_setzero_si256();
            KV_UNROLL
            for (int s = 0; s < 4; s++) {
                __m256i u[RWMAX];
                KV_UNROLL
                for (int i = 0; i < RW; i++) {
                    const uint8_t *o = w + i * rs;
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(o + 82 + 32 * s));
                    const __m256i hb = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(o + 18 + 32 * (s / 2))), 4 * (s & 1));
                    u[i] = half ? _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30))
                                : _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
                }
                KV_UNROLL
                for (int k = 0; k < RT; k++) {
                    const __m256i a = _mm256_loadu_si256((const __m256i *)qt_at(A, t0 + k, 8 * g + s + 4 * half));
                    KV_UNROLL
                    for (int i = 0; i < RW; i++) dot[i][k] = DP(dot[i][k], u[i], a);
                }
            }
            KV_UNROLL
            for (int i = 0; i < RW; i++) {
                const uint8_t *o = w + i * rs;
                const __m128i sc = _mm_loadu_si128((const __m128i *)(o + 2)), halves = _mm_shuffle_epi8(sc, evens_odds);
                const __m256 d0 = _mm256_set1_ps(f16_to_f32(o));
                const __m256 d = _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(half ? _mm_srli_si128(halves, 8) : halves)));
                KV_UNROLL
                for (int k = 0; k < RT; k++) {
                    const long off = (t0 + k) * nb + 8 * g;
                    acc[i][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][k]), _mm256_mul_ps(d, _mm256_loadu_ps(A->d + off)), acc[i][k]);
                    if (half) { /* -32 d d_a (sc_2j h0_j + sc_2j+1 h1_j), once per sub-block */
                        const __m256 hs = _mm256_cvtepi32_ps(
                            _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(A->h + 2 * off)), _mm256_cvtepi8_epi16(sc)));
                        const __m256 dd = _mm256_mul_ps(d0, _mm256_loadu_ps(A->d + off));
                        acc[i][k] = _mm256_fnmadd_ps(_mm256_mul_ps(dd, _mm256_set1_ps(32.f)), hs, acc[i][k]);
                    }
                }
            }
        }
    }
    store_sums(acc, RW, RT, y, ldy);
}
#undef DP

#ifdef PAIR_TILES
/* tile_x8 for RW weight rows and RP pairs of activation rows of x8 Q4_0 / Q4_1 / Q8_0, two activation rows
 * to a 512-bit vector: each weight vector is decoded into both halves and meets rows 2P and 2P + 1
 * at once, their words one load from the pair layout (qt_at), taken by vpdpbusd straight from
 * memory, so a weight word decoded once serves 2 RP rows and the dots and the per-group float work
 * take half the instructions of 256-bit tiles. The accumulators (2 RW RP vectors) and one weight
 * row's decoded words fit AVX-512's 32 registers up to RW RP = 12.
 * Every lane runs tile_x8's operations in tile_x8's order (the same integer dots, then m·s and
 * dot·(d·d_a) by FMA; past the last group acc32's), and each half is summed as tile_x8 sums it:
 * the same bits, so a row's result still does not depend on its batch (nor on its pair partner). */
static inline __m512i both_halves(__m256i v) { return _mm512_inserti64x4(_mm512_castsi256_si512(v), v, 1); }
static inline __m512i pair_loadi(const int8_t *a, const int8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
#define PWMAX 4
#define PPMAX 6
/* Pairs P0 .. P0 + RP - 1 (rows 2 P0 .. 2 P0 + 2 RP - 1, those below T stored) against weight rows 0..RW-1 of w. */
KV_INLINE void tile_x8_pairs(int t, const wrows *R, const acts *A, long P0, int RW, int RP, float *y, long ldy) {
    const int mins = t == T_Q4_1, bs = block_bytes(t), codes = mins ? 32 : 16;
    const long nb = A->nb, groups = nb / 8;
    const __m512i m4 = _mm512_set1_epi8(0x0F), bias = _mm512_set1_epi8((char)0x80);
    __m512 acc[PWMAX][PPMAX];
    KV_UNROLL
    for (int i = 0; i < RW; i++)
        KV_UNROLL
        for (int p = 0; p < RP; p++) acc[i][p] = _mm512_setzero_ps();
    for (long g = 0; g < groups; g++) {
        __m512i dot[PWMAX][PPMAX];
        KV_UNROLL
        for (int i = 0; i < RW; i++)
            KV_UNROLL
            for (int p = 0; p < RP; p++) dot[i][p] = _mm512_setzero_si512();
        const uint8_t *w = R->w + g * R->gs; /* row i's group g at w + i rs */
        const size_t rs = R->rs;
        if (t != T_Q8_0) prefetch_group(R, g, RW, RP, 8 * bs); /* (Q8_0's slabs stream faster unaided: 0.75x the time at 3-8 rows) */
        if (t == T_Q8_0) { /* 8 words of codes, each q + 128 as unsigned bytes (as Q8_OFFSET has the one-token tiles take them) */
            KV_UNROLL
            for (int s = 0; s < 8; s++)
                KV_UNROLL
                for (int i = 0; i < RW; i++) {
                    const __m256i *src = (const __m256i *)(w + i * rs + codes + 32 * s);
                    const __m512i u = _mm512_xor_si512(_mm512_broadcast_i64x4(_mm256_loadu_si256(src)), bias);
                    KV_UNROLL
                    for (int p = 0; p < RP; p++)
                        dot[i][p] = _mm512_dpbusd_epi32(dot[i][p], u, _mm512_loadu_si512(qt_at(A, 2 * (P0 + p), 8 * g + s)));
                }
        } else {
            KV_UNROLL
            for (int s = 0; s < 4; s++)
                KV_UNROLL
                for (int i = 0; i < RW; i++) {
                    const __m256i *src = (const __m256i *)(w + i * rs + codes + 32 * s);
                    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(src));
                    const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                    KV_UNROLL
                    for (int p = 0; p < RP; p++) {
                        const __m512i *a = (const __m512i *)qt_at(A, 2 * (P0 + p), 8 * g + s);
                        dot[i][p] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[i][p], lo, _mm512_loadu_si512(a)), hi,
                                                        _mm512_loadu_si512(a + 4));
                    }
                }
        }
        KV_UNROLL
        for (int i = 0; i < RW; i++) {
            __m256 d, m;
            x8_scales(t, w + i * rs, &d, &m); /* (Q8_0: Q8_OFFSET is set wherever pairs are) */
            const __m512 d2 = _mm512_broadcast_f32x8(d), m2 = _mm512_broadcast_f32x8(m);
            KV_UNROLL
            for (int p = 0; p < RP; p++) {
                const long off = pair_at(A, P0 + p, 8 * g);
                acc[i][p] = _mm512_fmadd_ps(m2, _mm512_loadu_ps(A->sp + off), acc[i][p]);
                acc[i][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][p]), _mm512_mul_ps(d2, _mm512_loadu_ps(A->dp + off)),
                                            acc[i][p]);
            }
        }
    }
    long second[PPMAX]; /* row 2P + 1, or 2P again for an odd T's last row */
    KV_UNROLL
    for (int p = 0; p < RP; p++) second[p] = 2 * (P0 + p) + 1 < A->T ? 2 * (P0 + p) + 1 : 2 * (P0 + p);
    for (long q = 0; q < R->np; q++) { /* tail pairs, as tile_x8 sums them: row i's lanes in both halves */
        const long blk = 8 * groups + 2 * q;
        const uint8_t *G = R->tp + q * 8 * bs;
        __m512i dot[PPMAX];
        KV_UNROLL
        for (int p = 0; p < RP; p++) dot[p] = _mm512_setzero_si512();
        const __m512i halves = _mm512_setr_epi64(0, 0, 0, 0, 1, 1, 1, 1); /* row 2P's 8 bytes, then row 2P + 1's */
        const int words = t == T_Q8_0 ? 8 : 4;
        KV_UNROLL
        for (int s = 0; s < words; s++) {
            const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(G + codes + 32 * s)));
            const __m512i lo = t == T_Q8_0 ? _mm512_xor_si512(v, bias) : _mm512_and_si512(v, m4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            KV_UNROLL
            for (int p = 0; p < RP; p++) {
                const int8_t *a = tail_word(A, 2 * (P0 + p), blk, s);
                dot[p] = _mm512_dpbusd_epi32(dot[p], lo, _mm512_permutexvar_epi64(halves, _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)a))));
                if (t != T_Q8_0)
                    dot[p] = _mm512_dpbusd_epi32(dot[p], hi, _mm512_permutexvar_epi64(halves, _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(a + 64)))));
            }
        }
        __m256 d, m;
        x8_scales(t, G, &d, &m);
        const __m512 d2 = _mm512_broadcast_f32x8(d), m2 = _mm512_broadcast_f32x8(m);
        KV_UNROLL
        for (int p = 0; p < RP; p++) {
            const long o = 2 * (P0 + p) * nb + blk, o2 = second[p] * nb + blk;
            const __m512 sa = _mm512_insertf32x8(_mm512_castps256_ps512(lane_pairs(A->s + o)), lane_pairs(A->s + o2), 1);
            const __m512 da = _mm512_insertf32x8(_mm512_castps256_ps512(lane_pairs(A->d + o)), lane_pairs(A->d + o2), 1);
            const __m512 f = _mm512_cvtepi32_ps(dot[p]), sd = _mm512_mul_ps(d2, da);
            KV_UNROLL
            for (int i = 0; i < RW; i++) {
                const __mmask16 mine = (__mmask16)(0x0303u << (2 * (R->lane0 + i)));
                acc[i][p] = _mm512_mask3_fmadd_ps(m2, sa, acc[i][p], mine);
                acc[i][p] = _mm512_mask3_fmadd_ps(f, sd, acc[i][p], mine);
            }
        }
    }
    if (8 * groups + 2 * R->np < nb) { /* the blocks past those, stored as GGML's: acc32's operations, two rows a vector */
        const long g0 = 8 * groups + 2 * R->np;
        const int n = (int)(nb - g0);
        const __m256i mask = lanes_below(n);
        __m512 scl[PWMAX][PPMAX];
        KV_UNROLL
        for (int i = 0; i < RW; i++) {
            __m256 d, m;
            block_scales(R->tail + i * R->trs, bs, n, &d, &m);
            if (t == T_Q4_0) m = _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
            if (t == T_Q8_0) m = _mm256_mul_ps(d, _mm256_set1_ps(-128.f));
            const __m512 d2 = _mm512_broadcast_f32x8(d), m2 = _mm512_broadcast_f32x8(m);
            KV_UNROLL
            for (int p = 0; p < RP; p++) {
                const long o = 2 * (P0 + p) * nb + g0, o2 = second[p] * nb + g0;
                const __m512 da = _mm512_insertf32x8(_mm512_castps256_ps512(load_n(A->d + o, n, mask)),
                                                     load_n(A->d + o2, n, mask), 1);
                const __m512 sa = _mm512_insertf32x8(_mm512_castps256_ps512(load_n(A->s + o, n, mask)),
                                                     load_n(A->s + o2, n, mask), 1);
                scl[i][p] = _mm512_mul_ps(d2, da);
                acc[i][p] = _mm512_fmadd_ps(m2, sa, acc[i][p]);
            }
        }
        for (int j = 0; j < n; j++) {
            const __m512i lane = _mm512_setr_epi32(j, j, j, j, j, j, j, j, 8 + j, 8 + j, 8 + j, 8 + j, 8 + j, 8 + j, 8 + j, 8 + j);
            __m512i u[PWMAX];
            KV_UNROLL
            for (int i = 0; i < RW; i++) {
                const uint8_t *b = R->tail + i * R->trs + j * bs;
                u[i] = t == T_Q8_0 ? _mm512_xor_si512(both_halves(_mm256_loadu_si256((const __m256i *)(b + 2))), bias)
                                   : both_halves(nibbles16(b + bs - 16));
            }
            KV_UNROLL
            for (int p = 0; p < RP; p++) {
                const __m512i q2 = pair_loadi(A->q + 32 * (2 * (P0 + p) * nb + g0 + j), A->q + 32 * (second[p] * nb + g0 + j));
                KV_UNROLL
                for (int i = 0; i < RW; i++) {
                    const __m512 prod = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u[i], q2));
                    acc[i][p] = _mm512_fmadd_ps(prod, _mm512_permutexvar_ps(lane, scl[i][p]), acc[i][p]);
                }
            }
        }
    }
    if (RW == 4) { /* hsum4_rows on both halves at once: row 2P's four sums, then row 2P + 1's */
        const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 4, 12, 5, 13, 0, 0, 0, 0, 0, 0, 0, 0);
        KV_UNROLL
        for (int p = 0; p < RP; p++) {
            const long r = 2 * (P0 + p);
            /* 128-bit lanes of acc[i][p]: v0..3, v4..7 of row 2P, then of row 2P + 1 */
            const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[0][p], acc[1][p], _MM_SHUFFLE(2, 0, 2, 0)),
                                             _mm512_shuffle_f32x4(acc[0][p], acc[1][p], _MM_SHUFFLE(3, 1, 3, 1)));
            const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2][p], acc[3][p], _MM_SHUFFLE(2, 0, 2, 0)),
                                             _mm512_shuffle_f32x4(acc[2][p], acc[3][p], _MM_SHUFFLE(3, 1, 3, 1)));
            const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
            const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(t, t, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(t, t, _MM_SHUFFLE(3, 1, 3, 1)));
            const __m256 both = _mm512_castps512_ps256(_mm512_permutexvar_ps(order, z));
            _mm_storeu_ps(y + r * ldy, _mm256_castps256_ps128(both));
            if (r + 1 < A->T) _mm_storeu_ps(y + (r + 1) * ldy, _mm256_extractf128_ps(both, 1));
        }
        return;
    }
    KV_UNROLL
    for (int i = 0; i < RW; i++)
        KV_UNROLL
        for (int p = 0; p < RP; p++) {
            const long r = 2 * (P0 + p);
            y[r * ldy + i] = hsum(_mm512_castps512_ps256(acc[i][p]));
            if (r + 1 < A->T) y[(r + 1) * ldy + i] = hsum(_mm512_extractf32x8_ps(acc[i][p], 1));
        }
}
#endif


/* Q4_K (144 bytes) and Q5_K (176 bytes, with qh: bit j of qh[l] is bit 4 of sub-block j's l-th code):
 * d, dmin (f16), 12 bytes of scales/mins, [qh,] qs: 4 chunks of 32 bytes, chunk c holding
 * sub-block 2c in its low nibbles and 2c+1 in its high nibbles. x = d*sc*q - dmin*m. */
KV_INLINE void tile_q45_k(int t, const uint8_t *w, size_t rb, const acts *A, long t0, int RW, int RT, float *y, long ldy) {
    const int five = t == T_Q5_K, bs = five ? 176 : 144;
    const long nb = A->nb;
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    __m256 acc[RWMAX][RTMAX];
    zero_sums(acc, RW, RT);
    for (long sb = 0; sb < nb / 8; sb++) {
        float scl[RWMAX][RTMAX][8] __attribute__((aligned(32)));
        prefetch_next(w, rb, RW, bs, sb);
        KV_UNROLL
        for (int i = 0; i < RW; i++) {
            const uint8_t *b = w + i * rb + sb * bs;
            uint64_t sc, mn;
            k_scale_min_words(b + 4, &sc, &mn);
            const __m256 d = _mm256_mul_ps(_mm256_set1_ps(f16_to_f32(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc))));
            const __m256 m = _mm256_mul_ps(_mm256_set1_ps(f16_to_f32(b + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn))));
            KV_UNROLL
            for (int k = 0; k < RT; k++) {
                const long o = (t0 + k) * nb + 8 * sb;
                _mm256_store_ps(scl[i][k], _mm256_mul_ps(d, _mm256_loadu_ps(A->d + o)));
                acc[i][k] = _mm256_fnmadd_ps(m, _mm256_loadu_ps(A->s + o), acc[i][k]);
            }
        }
        for (int j = 0; j < 8; j++) {
            __m256i u[RWMAX];
            KV_UNROLL
            for (int i = 0; i < RW; i++) {
                const uint8_t *b = w + i * rb + sb * bs;
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + (five ? 48 : 16) + 32 * (j / 2)));
                u[i] = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(raw, 4) : raw, m4);
                if (five) {
                    const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 16));
                    u[i] = _mm256_or_si256(u[i], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, j), one), 4));
                }
            }
            KV_UNROLL
            for (int k = 0; k < RT; k++) {
                const __m256i qa = _mm256_loadu_si256((const __m256i *)(A->q + 32 * ((t0 + k) * nb + 8 * sb + j)));
                KV_UNROLL
                for (int i = 0; i < RW; i++)
                    acc[i][k] = _mm256_fmadd_ps(dot_u8s8(u[i], qa), _mm256_broadcast_ss(&scl[i][k][j]), acc[i][k]);
            }
        }
    }
    store_sums(acc, RW, RT, y, ldy);
}

/* Q6_K (210 bytes): ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16] (one per 16
 * values), d (f16, last). Value e = 128h + 32g + l (h half, g group 0..3, l 0..31): low bits are
 * nibble g/2 of ql[64h + 32(g%2) + l], high bits are bits 2g..2g+1 of qh[32h + l]; x = d*sc*(q-32).
 * Codes go to maddubs unsigned (0..63); the -32 is taken off through the activation half sums. */
KV_INLINE void tile_q6_k(const uint8_t *w, size_t rb, const acts *A, long t0, int RW, int RT, float *y, long ldy) {
    const long nb = A->nb;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    __m256 acc[RWMAX][RTMAX];
    zero_sums(acc, RW, RT);
    for (long sb = 0; sb < nb / 8; sb++) {
        float scl[RWMAX][RTMAX][8] __attribute__((aligned(32)));
        prefetch_next(w, rb, RW, 210, sb);
        KV_UNROLL
        for (int i = 0; i < RW; i++) {
            const uint8_t *b = w + i * rb + sb * 210;
            const __m256 d = _mm256_set1_ps(f16_to_f32(b + 208));
            const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
            KV_UNROLL
            for (int k = 0; k < RT; k++) {
                const long o = (t0 + k) * nb + 8 * sb;
                const __m256 dd = _mm256_mul_ps(d, _mm256_loadu_ps(A->d + o));
                _mm256_store_ps(scl[i][k], dd);
                /* per sub-block: sc[2j] * h0 + sc[2j+1] * h1, times 32 d d_a */
                const __m256 hs = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(A->h + 2 * o)), sc));
                acc[i][k] = _mm256_fnmadd_ps(_mm256_mul_ps(dd, _mm256_set1_ps(32.f)), hs, acc[i][k]);
            }
        }
        for (int j = 0; j < 8; j++) {
            const int h = j / 4, g = j % 4;
            __m256i u[RWMAX], scales[RWMAX];
            KV_UNROLL
            for (int i = 0; i < RW; i++) {
                const uint8_t *b = w + i * rb + sb * 210;
                const __m256i l4 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (g % 2)));
                const __m256i h2 = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                const __m256i lo = _mm256_and_si256(g < 2 ? l4 : _mm256_srli_epi16(l4, 4), m4);
                u[i] = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h2, 2 * g), m2), 4));
                const int8_t *sc = (const int8_t *)(b + 192);
                scales[i] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
            }
            KV_UNROLL
            for (int k = 0; k < RT; k++) {
                const __m256i qa = _mm256_loadu_si256((const __m256i *)(A->q + 32 * ((t0 + k) * nb + 8 * sb + j)));
                KV_UNROLL
                for (int i = 0; i < RW; i++) {
                    const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u[i], qa), scales[i]));
                    acc[i][k] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(&scl[i][k][j]), acc[i][k]);
                }
            }
        }
    }
    store_sums(acc, RW, RT, y, ldy);
}

KV_INLINE void tile(int t, const wrows *R, const acts *A, long t0, int RW, int RT, float *y, long ldy) {
    const uint8_t *w = R->w;
    const size_t rb = R->rs;
    switch (t) {
    case T_Q8_0 + X8: tile_x8(T_Q8_0, R, A, t0, RW, RT, y, ldy); return;
    case T_Q4_0 + X8: tile_x8(T_Q4_0, R, A, t0, RW, RT, y, ldy); return;
    case T_Q4_1 + X8: tile_x8(T_Q4_1, R, A, t0, RW, RT, y, ldy); return;
    case T_Q5_0 + X8: tile_x8(T_Q5_0, R, A, t0, RW, RT, y, ldy); return;
    case T_Q5_1 + X8: tile_x8(T_Q5_1, R, A, t0, RW, RT, y, ldy); return;
    case T_Q4_K + X8: tile_x8(T_Q4_K, R, A, t0, RW, RT, y, ldy); return;
    case T_Q5_K + X8: tile_x8(T_Q5_K, R, A, t0, RW, RT, y, ldy); return;
    case T_Q6_K + X8: tile_x8_q6k(R, A, t0, RW, RT, y, ldy); return;
    case T_Q8_0: tile32(T_Q8_0, w, rb, A, t0, RW, RT, y, ldy); return;
    case T_Q4_0: tile32(T_Q4_0, w, rb, A, t0, RW, RT, y, ldy); return;
    case T_Q4_1: tile32(T_Q4_1, w, rb, A, t0, RW, RT, y, ldy); return;
    case T_Q5_0: tile32(T_Q5_0, w, rb, A, t0, RW, RT, y, ldy); return;
    case T_Q5_1: tile32(T_Q5_1, w, rb, A, t0, RW, RT, y, ldy); return;
    case T_Q4_K: tile_q45_k(T_Q4_K, w, rb, A, t0, RW, RT, y, ldy); return;
    case T_Q5_K: tile_q45_k(T_Q5_K, w, rb, A, t0, RW, RT, y, ldy); return;
    default: tile_q6_k(w, rb, A, t0, RW, RT, y, ldy); return;
    }
}

#else /* plain C: stored rows one weight row · one activation row at a time; x8 rows a group for a tile's rows */

/* Each dot_* adds blocks b0..b1 of a row (w at block b0; K-quants: super-blocks) against activation
 * row o / nb to sum, one block after another: the x8 path (tile_x8 below) runs the same float
 * work in the same order, so a row gives the same bits in either layout. */
static float dot_q8_0(const uint8_t *w, const acts *A, long o, long b0, long b1, float sum) {
    for (long b = b0; b < b1; b++, w += 34) {
        const int8_t *q = (const int8_t *)(w + 2), *a = A->q + 32 * (o + b);
        int isum = 0;
        for (int i = 0; i < 32; i++) isum += q[i] * a[i];
        sum += f16_to_f32(w) * A->d[o + b] * (float)isum;
    }
    return sum;
}

static float dot_q4(const uint8_t *w, const acts *A, long o, long b0, long b1, float sum, int has_min) {
    const int bs = has_min ? 20 : 18;
    for (long b = b0; b < b1; b++, w += bs) {
        const uint8_t *qs = w + bs - 16;
        const int8_t *a = A->q + 32 * (o + b);
        int isum = 0;
        for (int i = 0; i < 16; i++) isum += (qs[i] & 15) * a[i] + (qs[i] >> 4) * a[i + 16];
        const float d = f16_to_f32(w), m = has_min ? f16_to_f32(w + 2) : -8.f * d;
        sum += d * A->d[o + b] * (float)isum + m * A->s[o + b];
    }
    return sum;
}

static float dot_q5(const uint8_t *w, const acts *A, long o, long b0, long b1, float sum, int has_min) {
    const int bs = has_min ? 24 : 22;
    for (long b = b0; b < b1; b++, w += bs) {
        const uint8_t *qs = w + bs - 16;
        uint32_t qh;
        memcpy(&qh, w + (has_min ? 4 : 2), 4);
        const int8_t *a = A->q + 32 * (o + b);
        int isum = 0;
        for (int i = 0; i < 16; i++)
            isum += ((qs[i] & 15) | (((qh >> i) & 1) << 4)) * a[i] + ((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) * a[i + 16];
        const float d = f16_to_f32(w), m = has_min ? f16_to_f32(w + 2) : -16.f * d;
        sum += d * A->d[o + b] * (float)isum + m * A->s[o + b];
    }
    return sum;
}

static float dot_q45_k(const uint8_t *w, const acts *A, long o, long b0, long b1, float sum, int five) {
    const int bs = five ? 176 : 144;
    for (long sb = b0; sb < b1; sb++, w += bs) {
        uint8_t sc[8], mn[8];
        k_scale_min(w + 4, sc, mn);
        const float d = f16_to_f32(w), dmin = f16_to_f32(w + 2);
        const uint8_t *qh = w + 16, *qs = w + (five ? 48 : 16);
        for (int j = 0; j < 8; j++) {
            const long ob = o + 8 * sb + j;
            const uint8_t *q = qs + 32 * (j / 2);
            const int8_t *a = A->q + 32 * ob;
            const int shift = 4 * (j & 1);
            int isum = 0;
            for (int l = 0; l < 32; l++) {
                int code = (q[l] >> shift) & 15;
                if (five) code |= ((qh[l] >> j) & 1) << 4;
                isum += code * a[l];
            }
            sum += d * sc[j] * A->d[ob] * (float)isum - dmin * mn[j] * A->s[ob];
        }
    }
    return sum;
}

static float dot_q6_k(const uint8_t *w, const acts *A, long o, long b0, long b1, float sum) {
    for (long sb = b0; sb < b1; sb++, w += 210) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        float s = 0.f;
        for (int j = 0; j < 8; j++) {
            const long ob = o + 8 * sb + j;
            const int8_t *a = A->q + 32 * ob;
            const int h = j / 4, g = j % 4;
            int isum[2] = {0, 0};
            for (int l = 0; l < 32; l++) {
                const int lo = (ql[64 * h + 32 * (g % 2) + l] >> (4 * (g / 2))) & 15;
                const int hi = (qh[32 * h + l] >> (2 * g)) & 3;
                isum[l / 16] += ((lo | (hi << 4)) - 32) * a[l];
            }
            s += A->d[ob] * (float)(sc[2 * j] * isum[0] + sc[2 * j + 1] * isum[1]);
        }
        sum += f16_to_f32(w + 208) * s;
    }
    return sum;
}

/* Blocks b0..b1 of a stored row of type t (K-quants: super-blocks), added to sum. */
static float dot_blocks(int t, const uint8_t *w, const acts *A, long o, long b0, long b1, float sum) {
    switch (t) {
    case T_Q8_0: return dot_q8_0(w, A, o, b0, b1, sum);
    case T_Q4_0: return dot_q4(w, A, o, b0, b1, sum, 0);
    case T_Q4_1: return dot_q4(w, A, o, b0, b1, sum, 1);
    case T_Q5_0: return dot_q5(w, A, o, b0, b1, sum, 0);
    case T_Q5_1: return dot_q5(w, A, o, b0, b1, sum, 1);
    case T_Q4_K: return dot_q45_k(w, A, o, b0, b1, sum, 0);
    case T_Q5_K: return dot_q45_k(w, A, o, b0, b1, sum, 1);
    default: return dot_q6_k(w, A, o, b0, b1, sum);
    }
}

/* An x8 group's (8 blocks, or a K-quant super-block's 8 sub-blocks) codes in qt's order: c[32 S + 4 j + b]
 * is value 4 S + b of block j, as dot_blocks multiplies it (Q6_K less 32; the others as unsigned codes
 * whose offset or minimum goes through the activation sums). Q8_0's words are its codes already
 * (x8_sums reads them in place). Layouts: x8_move. */
static void x8_codes(int t, const uint8_t *G, int8_t c[256]) {
    if (t == T_Q6_K) { /* d, 16 scales, 2 words of high bits, 4 of low nibbles */
        for (int S = 0; S < 8; S++) {
            const int s = S & 3, upper = S >> 2;
            for (int k = 0; k < 32; k++) {
                const int lo = (G[82 + 32 * s + k] >> (4 * upper)) & 15;
                const int hi = (G[18 + 32 * (s / 2) + k] >> (4 * (s % 2) + 2 * upper)) & 3;
                c[32 * S + k] = (int8_t)((lo | (hi << 4)) - 32);
            }
        }
        return;
    }
    const int k_quant = t == T_Q4_K || t == T_Q5_K, five = t == T_Q5_0 || t == T_Q5_1 || t == T_Q5_K;
    /* where the 4 words of nibbles start, and (Q5_*) the lanes' fifth bits: bit v of lane j's word */
    const int head = k_quant ? 16 : t == T_Q4_1 || t == T_Q5_1 ? 32 : 16;
    const uint8_t *qs = G + (t == T_Q5_K ? 48 : head + 32 * (five && !k_quant)), *qh = G + (t == T_Q5_K ? 16 : head);
    for (int k = 0; k < 128; k++) {
        c[k] = (int8_t)(qs[k] & 15);
        c[k + 128] = (int8_t)(qs[k] >> 4);
    }
    /* 4 fifth bits (values 4 s.., one word's bytes) → 16 in each byte whose bit is set (little-endian words) */
    static const uint32_t spread[16] = {0x0, 0x10, 0x1000, 0x1010, 0x100000, 0x100010, 0x101000, 0x101010, 0x10000000,
                                        0x10000010, 0x10001000, 0x10001010, 0x10100000, 0x10100010, 0x10101000, 0x10101010};
    for (int j = 0; five && j < 8; j++) {
        uint32_t bits, word;
        memcpy(&bits, qh + 4 * j, 4);
        for (int s = 0; s < 8; s++) { /* values 4 s..4 s + 3 of lane j (s >= 4: the upper half's) */
            memcpy(&word, c + 32 * s + 4 * j, 4);
            word |= spread[(bits >> (s < 4 ? 4 * s : 16 + 4 * (s - 4))) & 15];
            memcpy(c + 32 * s + 4 * j, &word, 4);
        }
    }
}

/* A group's codes c (x8_codes, or Q8_0's words) against activation row `at` (its transposed words qt):
 * lane j's integer sums over values 0..15 and 16..31 (Q6_K scales each half apart; the others add them). */
static void x8_sums(const int8_t *c, const acts *A, long at, long g, int isum[8][2]) {
    int acc[2][32] = {{0}};
    for (int S = 0; S < 8; S++) {
        const int8_t *a = qt_at(A, at, g + S), *w = c + 32 * S;
        int *sum = acc[S >> 2];
        for (int k = 0; k < 32; k++) sum[k] += w[k] * a[k];
    }
    for (int j = 0; j < 8; j++)
        for (int h = 0; h < 2; h++) isum[j][h] = acc[h][4 * j] + acc[h][4 * j + 1] + acc[h][4 * j + 2] + acc[h][4 * j + 3];
}

/* x8 rows (wrows): each group's codes decoded once for the tile's RT activation rows, then dot_blocks'
 * float work, block by block, and the blocks past the last whole group as stored. */
static void tile_x8(int t, const wrows *R, const acts *A, long t0, int RW, int RT, float *y, long ldy) {
    const int k_quant = k_type(t);
    const long nb = A->nb * 32 / block_values(t), groups = x8_groups(t, nb);
    for (int i = 0; i < RW; i++) {
        float sum[RTMAX] = {0.f};
        for (long g = 0; g < groups; g++) {
            const uint8_t *G = R->w + i * R->rs + g * R->gs;
            int8_t codes[256];
            const int8_t *c = t == T_Q8_0 ? (const int8_t *)(G + 16) : codes;
            if (t != T_Q8_0) x8_codes(t, G, codes);
            const long blk = 8 * g; /* the group's first activation block */
            for (int k = 0; k < RT; k++) {
                const long at = t0 + k, o = at * A->nb;
                int isum[8][2];
                x8_sums(c, A, at, blk, isum);
                if (t == T_Q6_K) {
                    const int8_t *sc = (const int8_t *)(G + 2);
                    float s = 0.f;
                    for (int j = 0; j < 8; j++)
                        s += A->d[o + blk + j] * (float)(sc[2 * j] * isum[j][0] + sc[2 * j + 1] * isum[j][1]);
                    sum[k] += f16_to_f32(G) * s;
                } else if (k_quant) {
                    uint8_t sc[8], mn[8];
                    k_scale_min(G + 4, sc, mn);
                    const float d = f16_to_f32(G), dmin = f16_to_f32(G + 2);
                    for (int j = 0; j < 8; j++)
                        sum[k] += d * sc[j] * A->d[o + blk + j] * (float)(isum[j][0] + isum[j][1]) - dmin * mn[j] * A->s[o + blk + j];
                } else {
                    const int has_min = t == T_Q4_1 || t == T_Q5_1;
                    for (int j = 0; j < 8; j++) {
                        const float d = f16_to_f32(G + 2 * j);
                        const int is = isum[j][0] + isum[j][1];
                        if (t == T_Q8_0) {
                            sum[k] += d * A->d[o + blk + j] * (float)is;
                        } else {
                            const float m = has_min ? f16_to_f32(G + 16 + 2 * j) : (t == T_Q4_0 ? -8.f : -16.f) * d;
                            sum[k] += d * A->d[o + blk + j] * (float)is + m * A->s[o + blk + j];
                        }
                    }
                }
            }
        }
        for (int k = 0; k < RT; k++) {
            const long o = (t0 + k) * A->nb;
            if (!k_quant) sum[k] = dot_blocks(t, R->tail + i * R->trs, A, o, 8 * groups, nb, sum[k]);
            y[k * ldy + i] = sum[k];
        }
    }
}

KV_INLINE void tile(int t, const wrows *R, const acts *A, long t0, int RW, int RT, float *y, long ldy) {
    if (t >= X8) {
        tile_x8(base_type(t), R, A, t0, RW, RT, y, ldy);
        return;
    }
    KV_UNROLL
    for (int i = 0; i < RW; i++)
        KV_UNROLL
        for (int k = 0; k < RT; k++) {
            const long o = (t0 + k) * A->nb;
            y[k * ldy + i] = dot_blocks(t, R->w + i * R->rs, A, o, 0, A->nb * 32 / block_values(t), 0.f);
        }
}
#endif

/* The tile shapes used, each compiled with its RW and RT as constants (accumulators in registers). */
#define TILE(RW, RT)                                                                                          \
    static void tile_##RW##x##RT(int t, const wrows *R, const acts *A, long t0, float *y, long ldy) {          \
        tile(t, R, A, t0, RW, RT, y, ldy);                                                                    \
    }
TILE(4, 1) TILE(2, 1) TILE(1, 1) TILE(2, 2) TILE(1, 2) TILE(2, 3) TILE(1, 3) TILE(2, 4) TILE(1, 4)
#ifdef WIDE_TILES
TILE(4, 2) TILE(4, 3) TILE(4, 4)
#endif
#undef TILE
#ifdef PAIR_TILES /* x8 Q4_0, Q4_1 and Q8_0 rows against pairs of activation rows: PAIR_RW weight rows x 1..PAIR_RP pairs */
#ifndef PAIR_RW
#define PAIR_RW 4
#endif
#ifndef PAIR_RP
#define PAIR_RP 3
#endif
#if 4 % PAIR_RW
#error "PAIR_RW must divide a slab's 4 rows"
#endif
#define PAIRS(RP)                                                                                             \
    static void pairs_##RP(int t, const wrows *R, const acts *A, long P0, float *y, long ldy) {              \
        switch (t) {                                                                                          \
        case T_Q4_0 + X8: tile_x8_pairs(T_Q4_0, R, A, P0, PAIR_RW, RP, y, ldy); return;                      \
        case T_Q8_0 + X8: tile_x8_pairs(T_Q8_0, R, A, P0, PAIR_RW, RP, y, ldy); return;                      \
        default: tile_x8_pairs(T_Q4_1, R, A, P0, PAIR_RW, RP, y, ldy); return;                               \
        }                                                                                                     \
    }
PAIRS(1) PAIRS(2) PAIRS(3) PAIRS(4) PAIRS(5) PAIRS(6)
#undef PAIRS
#endif
typedef void (*tile_fn)(int, const wrows *, const acts *, long, float *, long);

/* Where rows r.. of a matrix (w, rows rb bytes apart in the stored layouts) lie for a tile of rows below
 * r1 (r1: the end of the caller's chunk, a multiple of 4 or the matrix's last row + 1). */
static wrows rows_at(int t, const uint8_t *w, size_t rb, long nb, long r, long r1) {
    if (t >= X8 && x8_slab(base_type(t), r, r1)) {
        const long SLAB = slab_rows(base_type(t));
        const size_t gb = x8_group_bytes(t), tb = (size_t)x8_tail_blocks(t, nb) * block_bytes(t);
        const uint8_t *S = w + (r & ~(long)(SLAB - 1)) * rb;
        const long i0 = r & (SLAB - 1), groups = x8_groups(t, nb);
        const long np = tail_pairs(t, nb);
        const size_t rest = tb - (size_t)(2 * np * block_bytes(t)); /* each row's tail past its pairs */
        const uint8_t *tails = S + SLAB * groups * gb;
        const wrows R = {S + i0 * gb, gb, SLAB * gb, tails + np * gb + i0 * rest, rest, 2 * SLAB * rb, tails, np, (int)i0};
        return R;
    }
    const wrows R = {w + r * rb, rb, x8_group_bytes(t), w + r * rb + x8_groups(t, nb) * x8_group_bytes(t), rb, 0, NULL, 0, 0};
    return R;
}

/* Weight rows r0..r1 against all T activation rows: one token as 4-row tiles, a batch as
 * 2 weight rows × 4 activation rows (the last T % 4 rows as one narrower tile), or 4 × 4 with
 * AVX-512's 32 registers (WIDE_TILES), Q4_0 / Q4_1 / Q8_0 as 4 weight rows × 3 pairs of activation rows,
 * two rows per 512-bit vector (PAIR_TILES; 4 x 2 pairs and 2 x 4 were no faster, 2 x 6 spills; Q8_0's
 * pairs against its old 2 x 4 tiles over rows one after another: 0.9-1.15x the time at 2-32 rows, for
 * half the time at one token, where its slabs stream as one). */
/* (y: output column r0 of activation row 0; row k's at y + k rows.) */
static void row_range(int t, const uint8_t *w, size_t rb, const acts *A, long T, long r0, long r1, float *y, long rows) {
    static const tile_fn by2[5] = {NULL, tile_2x1, tile_2x2, tile_2x3, tile_2x4};
    static const tile_fn by1[5] = {NULL, tile_1x1, tile_1x2, tile_1x3, tile_1x4};
    const long nb = A->nb * 32 / block_values(t);
    long r = r0;
    if (T == 1)
        for (; r + 4 <= r1; r += 4) {
            const wrows R = rows_at(t, w, rb, nb, r, r1);
            tile_4x1(t, &R, A, 0, y + (r - r0), rows);
        }
#ifdef PAIR_TILES /* (Q5 rows, decoded at 256 bits, then doubled, gained nothing steady from pairs: 0.86-1.25x) */
    typedef void (*pair_fn)(int, const wrows *, const acts *, long, float *, long);
    static const pair_fn by_pairs[7] = {NULL, pairs_1, pairs_2, pairs_3, pairs_4, pairs_5, pairs_6};
#ifdef KV_Q8_PLAIN
    if (T > 1 && (t == T_Q4_0 + X8 || t == T_Q4_1 + X8))
#else
    if (T > 1 && (t == T_Q4_0 + X8 || t == T_Q4_1 + X8 || t == T_Q8_0 + X8))
#endif
        for (const long np = (T + 1) / 2; r + PAIR_RW <= r1; r += PAIR_RW) {
            const wrows R = rows_at(t, w, rb, nb, r, r1);
            for (long P0 = 0; P0 < np; P0 += PAIR_RP) by_pairs[np - P0 < PAIR_RP ? np - P0 : PAIR_RP](t, &R, A, P0, y + (r - r0), rows);
        }
#endif
#ifdef WIDE_TILES /* x8 Q4 / Q5 / K rows (measured; Q8_0 gained nothing; x8 Q4_K in pairs took 1.09-1.39x the time at 3-4 rows) */
    static const tile_fn by4[5] = {NULL, tile_4x1, tile_4x2, tile_4x3, tile_4x4};
    if (t >= X8 && base_type(t) != T_Q8_0 && base_type(t) != T_Q6_K) /* (x8 Q6_K: its two dots per sum spill at 4 x 4) */
        for (; r + 4 <= r1; r += 4) {
            const wrows R = rows_at(t, w, rb, nb, r, r1);
            for (long t0 = 0; t0 < T; t0 += 4) by4[T - t0 < 4 ? T - t0 : 4](t, &R, A, t0, y + t0 * rows + (r - r0), rows);
        }
#endif
    for (; r < r1; r += 2) {
        const tile_fn *f = r + 2 <= r1 ? by2 : by1;
        const wrows R = rows_at(t, w, rb, nb, r, r1);
        for (long t0 = 0; t0 < T; t0 += 4) f[T - t0 < 4 ? T - t0 : 4](t, &R, A, t0, y + t0 * rows + (r - r0), rows);
    }
}


/* Outputs r0..r1 (at most 16) of T input rows whose activations are `levels` rows each in A (quantize_input),
 * into y (column r0 of row 0, rows ldy apart): with two levels each row's two products, made into `part`
 * (2 T x 16 floats), then added in one fixed order, so a row's result still does not depend on its batch. */
static void rows_out(int t, const uint8_t *w, size_t rb, const acts *A, long T, int levels, long r0, long r1, float *y,
                     long ldy, float *part) {
    if (levels != 2) {
        row_range(t, w, rb, A, T, r0, r1, y, ldy);
        return;
    }
    row_range(t, w, rb, A, 2 * T, r0, r1, part, 16);
    for (long k = 0; k < T; k++)
        for (long i = 0; i < r1 - r0; i++) y[k * ldy + i] = part[32 * k + i] + part[32 * k + 16 + i];
}

#if defined(KV_VNNI) && defined(__AVX512BW__) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KV_AMX 1
/* Activation rows from which a call runs on the tiles: where they overtake the AVX-512 kernels (Xeon, 2 threads:
 * alone, the default model's layers at 64-96 rows, the 1B shape's at 48-64; in the default model's decode step,
 * batch 32 of two-level rows (64) 1.11x the time on the tiles, batch 48 even, batch 64 0.90-0.93x). */
#define AMX_FROM_ROWS 96
#include "quant_matmul_amx.h"
#endif

/* Whether calls large enough run on AMX tiles: on < 0 asks, 0 turns them off, 1 on (where they run here).
 * Returns 1 when they do. Both give the same bits (quant_matmul_amx.h). */
int kvserve_amx(int on) {
#ifdef KV_AMX
    if (on == 0) amx_state = 0;
    if (on > 0) amx_state = -1;
    return amx_permitted();
#else
    (void)on;
    return 0;
#endif
}

/* Bytes of work buffer the native step needs for AMX calls of up to R activation rows of up to cols values
 * on `threads` threads (each thread's scratch, then the activation tiles); 0 where this build has no AMX. */
long kvserve_amx_work_bytes(long R, long cols, int threads) {
#ifdef KV_AMX
    return (long)((size_t)threads * amx_thread_bytes(cols / 32) + amx_act_bytes(R, cols / 32));
#else
    (void)R, (void)cols, (void)threads;
    return 0;
#endif
}

/* Which integer dot this build runs: 0 plain C, 1 AVX2 maddubs + madd, 2 AVX-512 VNNI dpbusd.
 * Where sgemm overtakes it depends on it (kvserve/model/quant.py's blas_from_rows). */
int kvserve_quant_dot(void) {
#ifdef KV_VNNI
    return 2;
#elif defined(KV_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* y[T, rows] = x[T, cols] · W^T, W given as rows × (cols / block_values) blocks of type `qtype`, each
 * activation row quantized at `levels` (1 or 2, quantize_input) int8 levels.
 * One OpenMP region per call (a decode step makes ~120 calls): the activations are quantized
 * (spread over the threads when there are several rows), then each thread takes a contiguous
 * range of 16-row chunks. Calls too small to repay waking a second thread run on one.
 * Returns 0, -1 for an unknown type, a cols that is not a whole number of blocks or a levels
 * other than 1 or 2, -2 when out of memory. */
int kvserve_quant_matmul(int qtype, const uint8_t *w, long rows, long cols, const float *x, long T, float *y,
                         int nthreads, int levels) {
    const int bb = block_bytes(qtype);
    if (bb == 0 || cols % block_values(qtype) != 0 || (levels != 1 && levels != 2)) return -1;
    if (T <= 0 || rows <= 0) return 0;
    const long nb = cols / 32, R = levels * T; /* activation rows */
    const size_t rb = (size_t)(cols / block_values(qtype)) * bb;
    /* one allocation: q (64-byte aligned), d, s, h, qt; the AMX activation tiles; then each thread's scratch
     * (AMX tiles' and the two-level products of rows_out) */
    const size_t n = (size_t)(act_rows(R) * nb), bytes = (n * ACT_BYTES + 63) / 64 * 64;
    const size_t part = levels == 2 ? (size_t)R * 16 : 0;
#ifdef KV_AMX
    const int amx = amx_takes(qtype, rows, nb, R);
    const size_t tiles = amx ? (amx_act_bytes(R, nb) + 63) / 64 * 64 : 0, per_thread = amx ? amx_thread_bytes(nb) : 0;
#else
    const size_t tiles = 0, per_thread = 0;
#endif
    const size_t own = (part * sizeof(float) + per_thread + 63) / 64 * 64; /* each thread's scratch */
    char *buf = aligned_alloc(64, bytes + tiles + (size_t)nthreads * own);
    if (buf == NULL) return -2;
    const acts A = acts_over(buf, R, nb, qtype >= X8);
    const long chunks = (rows + 15) / 16;
#pragma omp parallel num_threads(nthreads) if (rows * nb * R >= 8192)
    {
        char *scratch = buf + bytes + tiles + (size_t)omp_get_thread_num() * own;
        float *mine = (float *)(scratch + per_thread);
#pragma omp for schedule(static)
        for (long t = 0; t < T; t++) quantize_input(x + t * cols, &A, t, levels);
        long c0 = 0; /* the first chunk left to the kernels above (AMX takes the whole 16-row ones) */
#ifdef KV_AMX
        if (amx) {
            uint8_t *tiles_buf = (uint8_t *)buf + bytes;
            amx_pack_in_region(&A, R, tiles_buf);
            amx_rows_in_region(qtype, w, rb, nb, rows, R, levels, tiles_buf, y, rows, (uint8_t *)scratch);
            c0 = rows / 16;
        }
#endif
#pragma omp for schedule(static)
        for (long c = c0; c < chunks; c++)
            rows_out(qtype, w, rb, &A, T, levels, 16 * c, 16 * c + 16 < rows ? 16 * c + 16 : rows, y + 16 * c, rows, mine);
    }
    free(buf);
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
    case T_Q5_0:
    case T_Q5_1: {
        const int m = t == T_Q5_1;
        const float d = f16_to_f32(w), mn = m ? f16_to_f32(w + 2) : -16.f * d;
        uint32_t qh;
        memcpy(&qh, w + (m ? 4 : 2), 4);
        const uint8_t *qs = w + (m ? 8 : 6);
        for (int i = 0; i < 16; i++) {
            out[i] = d * (float)((qs[i] & 15) | (((qh >> i) & 1) << 4)) + mn;
            out[i + 16] = d * (float)((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) + mn;
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

/* ---- the x8 layout: rows of Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 repacked 8 blocks at a time ----------
 * Each whole group of 8 blocks becomes: the 8 scales d (f16), for Q4_1 / Q5_1 the 8 minimums m,
 * then the blocks' words (4 bytes) transposed: 32 bytes per word index, block j's word in bytes
 * 4j..4j+3 (a Q4 block's 16 bytes of codes are 4 words, a Q8_0 block's 32 are 8, a Q5 block's
 * fifth bits and codes 5). Blocks past the last whole
 * group are copied as they are. A row keeps its size, so rows can still be sliced and fused. */
/* Lane j of the x8 group G (Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0) from the stored block b (pack), or back into b. */
static void x8_lane(int t, uint8_t *G, int j, uint8_t *b, int pack) {
    const int head = t == T_Q4_1 || t == T_Q5_1 ? 4 : 2;
    const int words = t == T_Q8_0 ? 8 : t == T_Q5_0 || t == T_Q5_1 ? 5 : 4; /* a Q5 block's first word: its fifth bits */
    for (int h = 0; h < head; h += 2) /* d, then Q4_1's m: 8 f16 each */
        memcpy(pack ? G + 8 * h + 2 * j : b + h, pack ? b + h : G + 8 * h + 2 * j, 2);
    for (int wd = 0; wd < words; wd++) {
        uint8_t *x = G + 8 * head + 32 * wd + 4 * j, *p = b + head + 4 * wd;
        memcpy(pack ? x : p, pack ? p : x, 4);
    }
}
static void x8_move(int t, const uint8_t *src, uint8_t *dst, long nb, int pack) {
    if (t == T_Q6_K) { /* stored: ql[128], qh[64], scales[16], d; x8 (tile_x8_q6k): d, scales, 64 bytes of
                        * high bits, 128 of low nibbles. Value v of sub-block j (h = j / 4, g = j % 4): low
                        * bits nibble g / 2 of ql[64 h + 32 (g % 2) + v], high bits 2g.. of qh[32 h + v]. */
        for (long sb = 0; sb < nb; sb++) {
            const uint8_t *in = src + sb * 210;
            uint8_t *out = dst + sb * 210;
            if (pack) {
                memcpy(out, in + 208, 2), memcpy(out + 2, in + 192, 16);
                memset(out + 18, 0, 192);
            } else {
                memcpy(out + 208, in, 2), memcpy(out + 192, in + 2, 16);
                memset(out, 0, 192);
            }
            for (int j = 0; j < 8; j++) {
                const int h = j / 4, g = j % 4;
                for (int v = 0; v < 32; v++) {
                    const int ql = 64 * h + 32 * (g % 2) + v, qh = 128 + 32 * h + v, lsh = 4 * (g / 2), hsh = 2 * g;
                    const int b = v % 4, s = (v % 16) / 4, upper = v >= 16; /* nibble word s, byte b, high nibble if upper */
                    const int xl = 82 + 32 * s + 4 * j + b, xsh = 4 * upper;
                    const int xh = 18 + 32 * (s / 2) + 4 * j + b, xhsh = 4 * (s % 2) + 2 * upper;
                    if (pack) {
                        out[xl] |= (uint8_t)(((in[ql] >> lsh) & 15) << xsh);
                        out[xh] |= (uint8_t)(((in[qh] >> hsh) & 3) << xhsh);
                    } else {
                        out[ql] |= (uint8_t)(((in[xl] >> xsh) & 15) << lsh);
                        out[qh] |= (uint8_t)(((in[xh] >> xhsh) & 3) << hsh);
                    }
                }
            }
        }
        return;
    }
    if (t == T_Q4_K || t == T_Q5_K) { /* per super-block: its 16 bytes of scales as stored; [Q5_K: sub-block
        * j's fifth bits, bit v of lane j as Q5_0's qh (stored: bit j of qh[v]);] sub-block j's 32 codes as a
        * Q4_0 block's (byte b: value b low, 16 + b high), its 4 words in lane j */
        const int five = t == T_Q5_K, bs = block_bytes(t), qs = five ? 48 : 16;
        for (long sb = 0; sb < nb; sb++) {
            const uint8_t *in = src + sb * bs;
            uint8_t *out = dst + sb * bs;
            memcpy(out, in, 16);
            memset(out + 16, 0, (size_t)bs - 16); /* (bits and nibbles are ORed in) */
            for (int j = 0; j < 8; j++) {
                for (int v = 0; five && v < 32; v++) { /* x8 bit: byte 16 + 4 j + v / 8, bit v % 8 */
                    const int x = 16 + 4 * j + v / 8;
                    if (pack) out[x] |= (uint8_t)(((in[16 + v] >> j) & 1) << (v % 8));
                    else out[16 + v] |= (uint8_t)(((in[x] >> (v % 8)) & 1) << j);
                }
                for (int b = 0; b < 16; b++) { /* x8 byte x; stored: nibble j & 1 of qs[32 (j / 2) + v] */
                    const int x = qs + 32 * (b / 4) + 4 * j + b % 4, sh = 4 * (j & 1), q = qs + 32 * (j / 2) + b;
                    if (pack) out[x] = (uint8_t)(((in[q] >> sh) & 15) | ((in[q + 16] >> sh) & 15) << 4);
                    else {
                        out[q] |= (uint8_t)((in[x] & 15) << sh);
                        out[q + 16] |= (uint8_t)((in[x] >> 4) << sh);
                    }
                }
            }
        }
        return;
    }
    const int bs = block_bytes(t);
    for (long g = 0; g + 8 <= nb; g += 8)
        for (int j = 0; j < 8; j++)
            if (pack) x8_lane(t, dst + g * bs, j, (uint8_t *)src + (g + j) * bs, 1);
            else x8_lane(t, (uint8_t *)src + g * bs, j, dst + (g + j) * bs, 0);
    const long tail = nb / 8 * 8;
    memcpy(dst + tail * bs, src + tail * bs, (size_t)(nb - tail) * bs);
}

/* Whether this build multiplies rows of GGML type t faster in the x8 layout than as stored: the SIMD builds for
 * every x8 type; plain C for all but Q8_0, whose stored 32 bytes already make one contiguous dot there
 * (its x8 rows, multiplied too, took 1.4-1.5x the time on x86-64 without SIMD flags). */
int kvserve_x8(int t) {
#ifdef KV_AVX2
    return x8_packs(t);
#else
    return x8_packs(t) && t != T_Q8_0;
#endif
}

/* Slabs: the x8 rows of a matrix in fours, each four's bytes (4 rows' worth) holding group 0 of its
 * rows 0..3, then group 1 of rows 0..3, ..., then the four rows' tail pairs (tail_pairs: one group each),
 * then their blocks past those one row after another. A tile of 4 rows then reads one stream of memory
 * front to back, which the hardware prefetcher follows at full speed (four streams of separate rows it
 * did not: 1.4-1.6x slower from memory at one token). The last rows % 4 rows stay one after another.
 * Copies row r of an x8 matrix m (nb blocks of t a row) into a one-row buffer in the x8 layout, or
 * from it (put != 0). */
static void slab_row(int t, uint8_t *m, long rows, long nb, long r, uint8_t *row, int put) {
    const size_t bs = block_bytes(t), rb = nb * bs, gb = x8_group_bytes(t), tb = (size_t)x8_tail_blocks(t, nb) * bs;
    const long SLAB = slab_rows(t);
    if (!x8_slab(t, r, rows)) {
        memcpy(put ? m + r * rb : row, put ? row : m + r * rb, rb);
        return;
    }
    uint8_t *S = m + (r & ~(long)(SLAB - 1)) * rb;
    const long i = r & (SLAB - 1), groups = x8_groups(t, nb), np = tail_pairs(t, nb);
    for (long g = 0; g < groups; g++) {
        uint8_t *at = S + (SLAB * g + i) * gb;
        memcpy(put ? at : row + g * gb, put ? row + g * gb : at, gb);
    }
    uint8_t *tails = S + SLAB * groups * gb, *own = row + groups * gb; /* (a slab of 4: a tail pair's 8 lanes) */
    for (long p = 0; p < np; p++)
        for (int j = 0; j < 2; j++) x8_lane(t, tails + p * gb, (int)(2 * i + j), own + (2 * p + j) * bs, put);
    const size_t rest = tb - 2 * np * bs;
    memcpy(put ? tails + np * gb + i * rest : own + 2 * np * bs, put ? own + 2 * np * bs : tails + np * gb + i * rest, rest);
}

/* dst = rows of src (GGML type qtype: Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0) in the x8 layout, or back (unpack != 0,
 * qtype the x8 id). Returns 0, -1 for another type or a cols that is not whole blocks, -2 out of memory. */
int kvserve_pack_x8(int qtype, const uint8_t *src, uint8_t *dst, long rows, long cols, int unpack) {
    const int t = unpack ? qtype - X8 : qtype;
    if ((unpack && qtype < X8) || !x8_packs(t) || cols % block_values(t)) return -1;
    const long nb = cols / block_values(t);
    const size_t rb = (size_t)nb * block_bytes(t);
    uint8_t *row = malloc(rb);
    if (row == NULL) return -2;
    for (long r = 0; r < rows; r++) {
        if (unpack) {
            slab_row(t, (uint8_t *)src, rows, nb, r, row, 0);
            x8_move(t, row, dst + r * rb, nb, 0);
        } else {
            x8_move(t, src + r * rb, row, nb, 1);
            slab_row(t, dst, rows, nb, r, row, 1);
        }
    }
    free(row);
    return 0;
}

/* out[i, :] = dequantized row ids[i] (row i where ids is NULL), i < n, of a matrix of `rows` rows. */
int kvserve_dequant_rows(int qtype, const uint8_t *w, long rows, long cols, const int64_t *ids, long n, float *out,
                         int nthreads) {
    const int bb = block_bytes(qtype), bv = block_values(qtype), t = base_type(qtype);
    if (bb == 0 || cols % bv != 0) return -1;
    const size_t row_bytes = (size_t)(cols / bv) * bb;
#pragma omp parallel for num_threads(nthreads) if (n * cols >= 65536)
    for (long i = 0; i < n; i++) {
        const uint8_t *row = w + (ids ? ids[i] : i) * row_bytes;
        uint8_t x8[qtype >= X8 ? row_bytes : 1], plain[qtype >= X8 ? row_bytes : 1]; /* an x8 row back in the stored layout first */
        if (qtype >= X8) {
            slab_row(t, (uint8_t *)w, rows, cols / bv, ids ? ids[i] : i, x8, 0);
            x8_move(t, x8, plain, cols / bv, 0);
            row = plain;
        }
        for (long b = 0; b < cols / bv; b++) dequant_block(t, row + b * bb, out + i * cols + b * bv);
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
