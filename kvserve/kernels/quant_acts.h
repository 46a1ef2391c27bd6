/* The activations a quantized matmul multiplies: each row quantized per 32 values to int8 blocks.
 * Included by quant_matmul.c; the ISA headers define quantize_block and transpose_row (declared below).
 *
 * Every weight type's 32 values meet one activation block in an integer dot product (weight codes as
 * unsigned bytes times int8 activations, summed in int32); offsets (Q4_0's -8, Q6_K's -32) and
 * minimums (Q4_1, Q4_K, Q5_K) are applied through the activation sums s and h. One activation format
 * for all types (not ggml's Q8_K for K-quants) keeps the activation error the same for every type. At
 * two levels (quantize_input) a row is quantized again for what the first int8 left, as a second
 * activation row, and its two products are added (rows_out): ~15 bits of each activation for twice the
 * integer dots (docs/quality.md). */
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

/* One block of 32 values x as activation block o (each ISA header's): its q, then store_block. */
static inline void quantize_block(const float *x, const acts *A, long o);
/* Row t's blocks, once quantized, into the x8 layouts' transposed words (qt, dp, sp): each ISA header's. */
static void transpose_row(const acts *A, long t);

/* Block o's scale d and the sums of its codes' halves s0, s1 (its q stored already). */
static inline void store_block(const acts *A, long o, float d, int s0, int s1) {
    A->d[o] = d;
    A->s[o] = d * (float)(s0 + s1);
    A->h[2 * o] = (int16_t)s0;
    A->h[2 * o + 1] = (int16_t)s1;
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
