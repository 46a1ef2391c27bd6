/* The quantized matmul in plain C, for CPUs without AVX2 (KVSERVE_ISA=portable builds it). Included by
 * quant_matmul.c where it is compiled without AVX2 + FMA + F16C.
 *
 * Stored rows go one weight row · one activation row at a time; x8 rows a group at a time for a tile's
 * rows: the group's codes decoded once for the tile's activation rows, then 32 bytes at a time that the
 * compiler vectorizes for any target, with the stored path's float work in its order (the same bits as
 * the stored layout). */

/* ---- activations -------------------------------------------------------------------------------- */
/* One block of 32 values x as activation block o. */
static inline void quantize_block(const float *x, const acts *A, long o) {
    float amax = 0.f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int s0 = 0, s1 = 0;
    for (int i = 0; i < 32; i++) {
        const int q = (int)lrintf(x[i] * id);
        A->q[32 * o + i] = (int8_t)q;
        if (i < 16) s0 += q; else s1 += q;
    }
    store_block(A, o, d, s0, s1);
}

/* Row t's blocks, once quantized, into the x8 layouts' transposed words: word s (4 values) of block j to
 * bytes 4 j.. of transposed word s (tile_x8); no pairs to fill (plain C has no pair tiles). */
static void transpose_row(const acts *A, long t) {
    for (long g = 0; A->qt != NULL && g + 8 <= A->nb; g += 8)
        for (int s = 0; s < 8; s++)
            for (int j = 0; j < 8; j++) memcpy(qt_at(A, t, g + s) + 4 * j, A->q + 32 * (t * A->nb + g + j) + 4 * s, 4);
}

/* ---- tiles ---------------------------------------------------------------------------------------- */
/* Each dot_* adds blocks b0..b1 of a row (w at block b0; K-quants: super-blocks) against activation
 * row o / nb to sum, one block after another: the x8 path (tile_x8 below) runs the same float
 * work in the same order, so a row gives the same bits in either layout. */
static float dot_q8_0(const uint8_t *w, const acts *A, long o, long b0, long b1, float sum) {
    const block_q8_0 *B = (const block_q8_0 *)w;
    for (long b = b0; b < b1; b++, B++) {
        const int8_t *a = A->q + 32 * (o + b);
        int isum = 0;
        for (int i = 0; i < 32; i++) isum += B->qs[i] * a[i];
        sum += fp16_to_f32(B->d) * A->d[o + b] * (float)isum;
    }
    return sum;
}

/* Q4_0 (x = d (q - 8)) and Q4_1 (x = d q + m); the offset or minimum through the activation sums. */
static float dot_q4(int t, const uint8_t *w, const acts *A, long o, long b0, long b1, float sum) {
    const int bs = block_bytes(t);
    for (long b = b0; b < b1; b++, w += bs) {
        const uint8_t *qs = block_qs(t, w);
        const int8_t *a = A->q + 32 * (o + b);
        int isum = 0;
        for (int i = 0; i < 16; i++) isum += (qs[i] & 15) * a[i] + (qs[i] >> 4) * a[i + 16];
        const float d = fp16_to_f32(block_d(w)), m = t == T_Q4_1 ? fp16_to_f32(block_m(t, w)) : -8.f * d;
        sum += d * A->d[o + b] * (float)isum + m * A->s[o + b];
    }
    return sum;
}

/* MXFP4 (x = d (q - 12), q = MX_VALUES[code] + 12: quant_blocks.h). */
static float dot_mxfp4(const uint8_t *w, const acts *A, long o, long b0, long b1, float sum) {
    for (long b = b0; b < b1; b++, w += sizeof(block_mxfp4)) {
        const block_mxfp4 *B = (const block_mxfp4 *)w;
        const int8_t *a = A->q + 32 * (o + b);
        int isum = 0;
        for (int i = 0; i < 16; i++)
            isum += (MX_VALUES[B->qs[i] & 15] + MX_OFFSET) * a[i] + (MX_VALUES[B->qs[i] >> 4] + MX_OFFSET) * a[i + 16];
        const float d = mx_half_scale(B->e), m = -(float)MX_OFFSET * d;
        sum += d * A->d[o + b] * (float)isum + m * A->s[o + b];
    }
    return sum;
}

/* Q5_0 (x = d (q - 16)) and Q5_1 (x = d q + m). */
static float dot_q5(int t, const uint8_t *w, const acts *A, long o, long b0, long b1, float sum) {
    const int bs = block_bytes(t);
    for (long b = b0; b < b1; b++, w += bs) {
        const uint8_t *qs = block_qs(t, w);
        uint32_t qh;
        memcpy(&qh, block_qh(t, w), 4);
        const int8_t *a = A->q + 32 * (o + b);
        int isum = 0;
        for (int i = 0; i < 16; i++)
            isum += ((qs[i] & 15) | (((qh >> i) & 1) << 4)) * a[i] + ((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) * a[i + 16];
        const float d = fp16_to_f32(block_d(w)), m = t == T_Q5_1 ? fp16_to_f32(block_m(t, w)) : -16.f * d;
        sum += d * A->d[o + b] * (float)isum + m * A->s[o + b];
    }
    return sum;
}

static float dot_q45_k(const uint8_t *w, const acts *A, long o, long b0, long b1, float sum, int five) {
    const int bs = five ? sizeof(block_q5_K) : sizeof(block_q4_K);
    for (long sb = b0; sb < b1; sb++, w += bs) {
        const block_q4_K *K = (const block_q4_K *)w; /* d, dmin, scales (Q5_K's are the same) */
        uint8_t sc[8], mn[8];
        k_scale_min(K->scales, sc, mn);
        const float d = fp16_to_f32(K->d), dmin = fp16_to_f32(K->dmin);
        const uint8_t *qh = ((const block_q5_K *)w)->qh, *qs = five ? ((const block_q5_K *)w)->qs : K->qs;
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
    const block_q6_K *B = (const block_q6_K *)w;
    for (long sb = b0; sb < b1; sb++, B++) {
        const uint8_t *ql = B->ql, *qh = B->qh;
        const int8_t *sc = B->scales;
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
        sum += fp16_to_f32(B->d) * s;
    }
    return sum;
}

/* Blocks b0..b1 of a stored row of type t (K-quants: super-blocks), added to sum. */
static float dot_blocks(int t, const uint8_t *w, const acts *A, long o, long b0, long b1, float sum) {
    switch (t) {
    case T_Q8_0: return dot_q8_0(w, A, o, b0, b1, sum);
    case T_Q4_0: return dot_q4(T_Q4_0, w, A, o, b0, b1, sum);
    case T_Q4_1: return dot_q4(T_Q4_1, w, A, o, b0, b1, sum);
    case T_Q5_0: return dot_q5(T_Q5_0, w, A, o, b0, b1, sum);
    case T_Q5_1: return dot_q5(T_Q5_1, w, A, o, b0, b1, sum);
    case T_MXFP4: return dot_mxfp4(w, A, o, b0, b1, sum);
    case T_Q4_K: return dot_q45_k(w, A, o, b0, b1, sum, 0);
    case T_Q5_K: return dot_q45_k(w, A, o, b0, b1, sum, 1);
    default: return dot_q6_k(w, A, o, b0, b1, sum);
    }
}

/* An x8 group's (8 blocks, or a K-quant super-block's 8 sub-blocks) codes in qt's order: c[32 S + 4 j + b]
 * is value 4 S + b of block j, as dot_blocks multiplies it (Q6_K less 32; the others as unsigned codes
 * whose offset or minimum goes through the activation sums). Q8_0's words are its codes already
 * (x8_sums reads them in place). Layouts: quant_blocks.h. */
static void x8_codes(int t, const uint8_t *G, int8_t c[256]) {
    if (t == T_Q6_K) {
        const x8_q6_K *X = (const x8_q6_K *)G;
        for (int S = 0; S < 8; S++) {
            const int s = S & 3, upper = S >> 2;
            for (int k = 0; k < 32; k++) {
                const int lo = (X->ql[s][k] >> (4 * upper)) & 15;
                const int hi = (X->qh[s / 2][k] >> (4 * (s % 2) + 2 * upper)) & 3;
                c[32 * S + k] = (int8_t)((lo | (hi << 4)) - 32);
            }
        }
        return;
    }
    const int five = t == T_Q5_0 || t == T_Q5_1 || t == T_Q5_K;
    /* the 4 words of nibbles, and (Q5_*) the lanes' fifth bits: bit v of lane j's word */
    const uint8_t *qs = G + x8_qs_at(t), *qh = five ? G + x8_qh_at(t) : NULL;
    for (int k = 0; k < 128; k++) {
        c[k] = (int8_t)(qs[k] & 15);
        c[k + 128] = (int8_t)(qs[k] >> 4);
    }
    for (int k = 0; t == T_MXFP4 && k < 256; k++) c[k] = (int8_t)(MX_VALUES[c[k]] + MX_OFFSET);
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
            const int8_t *c = t == T_Q8_0 ? ((const x8_q8_0 *)G)->qs[0] : codes;
            if (t != T_Q8_0) x8_codes(t, G, codes);
            const long blk = 8 * g; /* the group's first activation block */
            for (int k = 0; k < RT; k++) {
                const long at = t0 + k, o = at * A->nb;
                int isum[8][2];
                x8_sums(c, A, at, blk, isum);
                if (t == T_Q6_K) {
                    const int8_t *sc = ((const x8_q6_K *)G)->scales;
                    float s = 0.f;
                    for (int j = 0; j < 8; j++)
                        s += A->d[o + blk + j] * (float)(sc[2 * j] * isum[j][0] + sc[2 * j + 1] * isum[j][1]);
                    sum[k] += fp16_to_f32(((const x8_q6_K *)G)->d) * s;
                } else if (k_quant) {
                    const x8_q4_K *K = (const x8_q4_K *)G; /* (Q5_K's header is the same) */
                    uint8_t sc[8], mn[8];
                    k_scale_min(K->scales, sc, mn);
                    const float d = fp16_to_f32(K->d), dmin = fp16_to_f32(K->dmin);
                    for (int j = 0; j < 8; j++)
                        sum[k] += d * sc[j] * A->d[o + blk + j] * (float)(isum[j][0] + isum[j][1]) - dmin * mn[j] * A->s[o + blk + j];
                } else {
                    const int has_min = t == T_Q4_1 || t == T_Q5_1;
                    for (int j = 0; j < 8; j++) {
                        const int is = isum[j][0] + isum[j][1];
                        if (t == T_MXFP4) {
                            const float d = mx_half_scale(((const x8_mxfp4 *)G)->e[j]), m = -(float)MX_OFFSET * d;
                            sum[k] += d * A->d[o + blk + j] * (float)is + m * A->s[o + blk + j];
                            continue;
                        }
                        const float d = fp16_to_f32(((const x8_q4_0 *)G)->d[j]); /* d[8] leads every other type, m[8] next */
                        if (t == T_Q8_0) {
                            sum[k] += d * A->d[o + blk + j] * (float)is;
                        } else {
                            const float m = has_min ? fp16_to_f32(((const x8_q4_1 *)G)->m[j]) : (t == T_Q4_0 ? -8.f : -16.f) * d;
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

/* ---- bfloat16 weights: a row's dot with float32 activations ---------------------------------------- */
static float dot_bf16(const uint16_t *w, const float *x, long n) {
    float sum = 0.f;
    for (long k = 0; k < n; k++) sum += bf16_to_f32(w[k]) * x[k];
    return sum;
}
