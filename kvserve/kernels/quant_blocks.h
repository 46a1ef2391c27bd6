/* GGML's quantized blocks as C structs, kvserve's x8 groups of them, and their decoding to float.
 *
 * The stored blocks are ggml's block_* (ggml-common.h): 32 values a block (Q8_0, Q4_0, Q4_1, Q5_0,
 * Q5_1), or a super-block of 256 values in 8 sub-blocks of 32 (Q4_K, Q5_K, Q6_K). gguf-py's
 * dequantize is the reference tests/test_quant.py checks dequant_block and the kernels against.
 *
 * The x8 groups are kvserve's repacked form of the same bytes (kvserve_pack_x8, quant_x8.h): 8 blocks
 * of a row, or one K-quant super-block with its 8 sub-blocks, their codes as 32-byte "words" of which
 * byte 4j..4j+3 belongs to block (sub-block) j. One 256-bit load then holds the same 4 values of all 8
 * blocks, and one integer dot instruction advances 8 blocks at once, each block's sum in its own lane.
 * A group has exactly the bytes of the blocks it replaces, so an x8 row keeps its size.
 *
 * The structs are read over byte buffers (torch tensors, the packing's one-row scratch): may_alias,
 * as the uint8_t pointers they stand for. Half-precision fields hold their raw bits (fp16_to_f32). */
#ifndef KVSERVE_QUANT_BLOCKS_H
#define KVSERVE_QUANT_BLOCKS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "numerics.h"

/* GGML type ids (gguf GGMLQuantizationType) */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_MXFP4 = 39 };

#define KV_BYTES __attribute__((__may_alias__))

/* ---- stored blocks (value i of a 32-value block: x_i = d q_i, with the offset or minimum shown) ---- */
typedef struct {
    uint16_t d;
    int8_t qs[32];
} KV_BYTES block_q8_0; /* x = d q */
typedef struct {
    uint16_t d;
    uint8_t qs[16]; /* value i in the low nibble of qs[i], value 16 + i in the high */
} KV_BYTES block_q4_0; /* x = d (q - 8) */
typedef struct {
    uint16_t d, m;
    uint8_t qs[16];
} KV_BYTES block_q4_1; /* x = d q + m */
typedef struct {
    uint16_t d;
    uint8_t qh[4]; /* bit i: the fifth bit of value i */
    uint8_t qs[16];
} KV_BYTES block_q5_0; /* x = d (q - 16) */
typedef struct {
    uint16_t d, m;
    uint8_t qh[4];
    uint8_t qs[16];
} KV_BYTES block_q5_1; /* x = d q + m */
/* MXFP4 (OCP Microscaling, gpt-oss's experts): an e8m0 scale byte e and 32 e2m1 codes, value i in the low nibble
 * of qs[i], 16 + i in the high. Doubled, a code's value is an integer (MX_VALUES) at half the scale, 2^(e - 128)
 * (mx_half_scale). The kernels take code c as the unsigned MX_VALUES[c] + 12 (mx_codes: one byte shuffle), the 12
 * coming off through the activation sums as Q4_0's 8 does: x = d (q - 12). */
typedef struct {
    uint8_t e;
    uint8_t qs[16];
} KV_BYTES block_mxfp4;
/* Q4_K / Q5_K: sub-block j's 6-bit scale sc_j and minimum mn_j packed in scales (k_scale_min); qs[32 c + l]
 * holds value l of sub-block 2c (low nibble) and of 2c + 1 (high); Q5_K: bit j of qh[l] is bit 4 of
 * sub-block j's value l. x = d sc_j q - dmin mn_j. */
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[128];
} KV_BYTES block_q4_K;
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[32];
    uint8_t qs[128];
} KV_BYTES block_q5_K;
/* Q6_K: value e = 128 h + 32 g + l (h half, g 0..3, l 0..31): low 4 bits nibble g / 2 of ql[64 h + 32 (g % 2) + l],
 * high 2 bits bits 2g..2g+1 of qh[32 h + l]; one int8 scale per 16 values. x = d sc (q - 32). */
typedef struct {
    uint8_t ql[128];
    uint8_t qh[64];
    int8_t scales[16];
    uint16_t d;
} KV_BYTES block_q6_K;

/* ---- x8 groups: word s (qs[s]) holds values 4s..4s+3 of block j in bytes 4j..4j+3 ---------------- */
typedef struct {
    uint16_t d[8];
    int8_t qs[8][32]; /* words 0..7: the 32 codes */
} KV_BYTES x8_q8_0;
typedef struct {
    uint16_t d[8];
    uint8_t qs[4][32]; /* a block's 16 bytes of nibbles as 4 words: values 4s.. low, 16 + 4s.. high */
} KV_BYTES x8_q4_0;
typedef struct {
    uint16_t d[8], m[8];
    uint8_t qs[4][32];
} KV_BYTES x8_q4_1;
typedef struct {
    uint16_t d[8];
    uint8_t qh[8][4]; /* block j's 32 fifth bits, as its qh */
    uint8_t qs[4][32];
} KV_BYTES x8_q5_0;
typedef struct {
    uint16_t d[8], m[8];
    uint8_t qh[8][4];
    uint8_t qs[4][32];
} KV_BYTES x8_q5_1;
typedef struct {
    uint8_t e[8];
    uint8_t qs[4][32];
} KV_BYTES x8_mxfp4;
/* A K-quant super-block: the header as stored; sub-block j's 32 codes laid out as a Q4_0 block's in lane j
 * (Q5_K: its fifth bits as a Q5_0 block's qh in lane j). */
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[4][32];
} KV_BYTES x8_q4_K;
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[8][4];
    uint8_t qs[4][32];
} KV_BYTES x8_q5_K;
/* Q6_K: ql word s holds values 4s..4s+3 (low nibble) and 16+4s.. (high) of each sub-block, as Q4_0's; byte b
 * of qh word k holds the 2 high bits of values 8k+b, 16+8k+b, 8k+4+b and 16+8k+4+b of its sub-block. */
typedef struct {
    uint16_t d;
    int8_t scales[16];
    uint8_t qh[2][32];
    uint8_t ql[4][32];
} KV_BYTES x8_q6_K;

_Static_assert(sizeof(block_q8_0) == 34 && sizeof(block_q4_0) == 18 && sizeof(block_q4_1) == 20, "GGML block sizes");
_Static_assert(sizeof(block_q5_0) == 22 && sizeof(block_q5_1) == 24 && sizeof(block_mxfp4) == 17, "GGML block sizes");
_Static_assert(sizeof(block_q4_K) == 144 && sizeof(block_q5_K) == 176 && sizeof(block_q6_K) == 210, "GGML block sizes");
_Static_assert(sizeof(x8_q8_0) == 8 * sizeof(block_q8_0) && sizeof(x8_q4_0) == 8 * sizeof(block_q4_0) &&
                   sizeof(x8_q4_1) == 8 * sizeof(block_q4_1) && sizeof(x8_q5_0) == 8 * sizeof(block_q5_0) &&
                   sizeof(x8_q5_1) == 8 * sizeof(block_q5_1) && sizeof(x8_mxfp4) == 8 * sizeof(block_mxfp4),
               "an x8 group holds the bytes of its 8 blocks");
_Static_assert(sizeof(x8_q4_K) == sizeof(block_q4_K) && sizeof(x8_q5_K) == sizeof(block_q5_K) &&
                   sizeof(x8_q6_K) == sizeof(block_q6_K),
               "an x8 K-quant group holds the bytes of its super-block");

/* x8: a row repacked into x8 groups (the blocks past the last whole group as stored; quant_x8.h). Its type id is
 * the GGML id + X8; its block sizes are the base type's. */
#define X8 1000
static inline int base_type(int t) { return t >= X8 ? t - X8 : t; }
static inline int x8_packs(int t) {
    return t == T_Q4_0 || t == T_Q4_1 || t == T_Q8_0 || t == T_Q5_0 || t == T_Q5_1 || t == T_MXFP4 || t == T_Q4_K || t == T_Q5_K || t == T_Q6_K;
}
static inline int k_type(int t) { return base_type(t) == T_Q4_K || base_type(t) == T_Q5_K || base_type(t) == T_Q6_K; }

/* Bytes and values per block of each type (stored or x8); 0 for an unknown type. */
static int block_bytes(int t) {
    if (t >= X8 && !x8_packs(t - X8)) return 0;
    switch (base_type(t)) {
    case T_Q8_0: return sizeof(block_q8_0);
    case T_Q4_0: return sizeof(block_q4_0);
    case T_Q4_1: return sizeof(block_q4_1);
    case T_Q5_0: return sizeof(block_q5_0);
    case T_Q5_1: return sizeof(block_q5_1);
    case T_MXFP4: return sizeof(block_mxfp4);
    case T_Q4_K: return sizeof(block_q4_K);
    case T_Q5_K: return sizeof(block_q5_K);
    case T_Q6_K: return sizeof(block_q6_K);
    }
    return 0;
}
static int block_values(int t) { return k_type(t) ? 256 : 32; }

/* MXFP4: a code's value doubled; the unsigned codes the kernels multiply (value + 12); the scale of the doubled
 * values, 2^(e - 128) exactly for every byte (ggml's e8m0_to_fp32_half: e < 2 are subnormal floats). */
static const int8_t MX_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
#define MX_OFFSET 12
static inline float mx_half_scale(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float d;
    memcpy(&d, &bits, 4);
    return d;
}

/* A stored 32-value block b of type t (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4): its scale, minimum (Q4_1 / Q5_1),
 * fifth bits (Q5_0 / Q5_1) and codes (Q8_0) or nibbles. t is a constant where the kernels call these. */
static inline uint16_t block_d(const uint8_t *b) { return ((const block_q4_0 *)b)->d; } /* first in every type but MXFP4 */
static inline uint16_t block_m(int t, const uint8_t *b) {
    return t == T_Q4_1 ? ((const block_q4_1 *)b)->m : ((const block_q5_1 *)b)->m;
}
static inline const uint8_t *block_qh(int t, const uint8_t *b) {
    return t == T_Q5_0 ? ((const block_q5_0 *)b)->qh : ((const block_q5_1 *)b)->qh;
}
static inline const uint8_t *block_qs(int t, const uint8_t *b) {
    switch (t) {
    case T_Q8_0: return (const uint8_t *)((const block_q8_0 *)b)->qs;
    case T_Q4_0: return ((const block_q4_0 *)b)->qs;
    case T_Q4_1: return ((const block_q4_1 *)b)->qs;
    case T_Q5_0: return ((const block_q5_0 *)b)->qs;
    case T_MXFP4: return ((const block_mxfp4 *)b)->qs;
    default: return ((const block_q5_1 *)b)->qs;
    }
}
/* The same for an x8 group of t (any x8 type but Q6_K): where its first word of codes or nibbles, and its
 * fifth bits (Q5_0, Q5_1, Q5_K), start. */
static inline int x8_qs_at(int t) {
    switch (t) {
    case T_Q8_0: return offsetof(x8_q8_0, qs);
    case T_Q4_0: return offsetof(x8_q4_0, qs);
    case T_Q4_1: return offsetof(x8_q4_1, qs);
    case T_Q5_0: return offsetof(x8_q5_0, qs);
    case T_Q5_1: return offsetof(x8_q5_1, qs);
    case T_MXFP4: return offsetof(x8_mxfp4, qs);
    case T_Q4_K: return offsetof(x8_q4_K, qs);
    default: return offsetof(x8_q5_K, qs);
    }
}
static inline int x8_qh_at(int t) {
    return t == T_Q5_0 ? offsetof(x8_q5_0, qh) : t == T_Q5_1 ? offsetof(x8_q5_1, qh) : offsetof(x8_q5_K, qh);
}

/* Q4_K / Q5_K: eight 6-bit scales and mins packed in 12 bytes. */
static inline void k_scale_min(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

/* One stored block (a K-quant: a super-block) of type t as float32 values. */
static void dequant_block(int t, const uint8_t *w, float *out) {
    switch (t) {
    case T_Q8_0: {
        const block_q8_0 *b = (const block_q8_0 *)w;
        const float d = fp16_to_f32(b->d);
        for (int i = 0; i < 32; i++) out[i] = d * (float)b->qs[i];
        return;
    }
    case T_Q4_0:
    case T_Q4_1: {
        const float d = fp16_to_f32(block_d(w)), mn = t == T_Q4_1 ? fp16_to_f32(block_m(t, w)) : -8.f * d;
        const uint8_t *qs = block_qs(t, w);
        for (int i = 0; i < 16; i++) {
            out[i] = d * (float)(qs[i] & 15) + mn;
            out[i + 16] = d * (float)(qs[i] >> 4) + mn;
        }
        return;
    }
    case T_Q5_0:
    case T_Q5_1: {
        const float d = fp16_to_f32(block_d(w)), mn = t == T_Q5_1 ? fp16_to_f32(block_m(t, w)) : -16.f * d;
        uint32_t qh;
        memcpy(&qh, block_qh(t, w), 4);
        const uint8_t *qs = block_qs(t, w);
        for (int i = 0; i < 16; i++) {
            out[i] = d * (float)((qs[i] & 15) | (((qh >> i) & 1) << 4)) + mn;
            out[i + 16] = d * (float)((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) + mn;
        }
        return;
    }
    case T_MXFP4: {
        const block_mxfp4 *b = (const block_mxfp4 *)w;
        const float d = mx_half_scale(b->e);
        for (int i = 0; i < 16; i++) {
            out[i] = d * (float)MX_VALUES[b->qs[i] & 15];
            out[i + 16] = d * (float)MX_VALUES[b->qs[i] >> 4];
        }
        return;
    }
    case T_Q4_K:
    case T_Q5_K: {
        const int five = t == T_Q5_K;
        const block_q4_K *b4 = (const block_q4_K *)w; /* d, dmin and scales: the same in both */
        const block_q5_K *b5 = (const block_q5_K *)w;
        uint8_t sc[8], mn[8];
        k_scale_min(b4->scales, sc, mn);
        const float d = fp16_to_f32(b4->d), dmin = fp16_to_f32(b4->dmin);
        const uint8_t *qs = five ? b5->qs : b4->qs;
        for (int j = 0; j < 8; j++) {
            const float dj = d * sc[j], mj = dmin * mn[j];
            for (int l = 0; l < 32; l++) {
                int code = (qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 15;
                if (five) code |= ((b5->qh[l] >> j) & 1) << 4;
                out[32 * j + l] = dj * (float)code - mj;
            }
        }
        return;
    }
    case T_Q6_K: {
        const block_q6_K *b = (const block_q6_K *)w;
        const float d = fp16_to_f32(b->d);
        for (int e = 0; e < 256; e++) {
            const int h = e / 128, g = (e / 32) % 4, l = e % 32;
            const int lo = (b->ql[64 * h + 32 * (g % 2) + l] >> (4 * (g / 2))) & 15;
            const int hi = (b->qh[32 * h + l] >> (2 * g)) & 3;
            out[e] = d * (float)b->scales[e / 16] * (float)((lo | (hi << 4)) - 32);
        }
        return;
    }
    }
}

#endif
