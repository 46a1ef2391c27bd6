/* Matmuls that read weights as stored: GGML quantized blocks, or bfloat16 on CPUs without it.
 *
 * Decoding one token reads every weight once, so bytes per weight set the speed. These kernels never
 * expand a weight to float in memory: y[t, r] = x[t, :] . W[r, :] walks the blocks of row r (Q8_0,
 * Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, Q4_K, Q5_K, Q6_K). The activations are quantized first, per 32 values, to int8
 * blocks, and every weight type meets them in integer dot products (quant_acts.h). Q4_0 .. Q6_K rows are
 * repacked at load into the x8 layout (kvserve_pack_x8, as llama.cpp's and ik_llama.cpp's repacked types
 * are, here 8 blocks of one row), in which one integer dot instruction advances 8 blocks at once.
 *
 *   quant_blocks.h         the block formats as structs (GGML's and the x8 groups); dequantization
 *   quant_x8.h             the x8 layout: packing, slabs of 4 rows, tail pairs; where a tile's rows lie
 *   quant_acts.h           the activations' int8 blocks
 *   quant_matmul_avx2.h    256-bit tiles: AVX2's maddubs, or AVX-512 VNNI's dpbusd, as the integer dot
 *   quant_matmul_avx512.h  512-bit pair tiles (AVX-512 BW + VNNI)
 *   quant_matmul_amx.h     AMX-INT8 tiles for calls of many activation rows
 *   quant_matmul_scalar.h  plain C
 *
 * This file picks the path at compile time from the ISA flags kernels/__init__.py passes (KVSERVE_ISA=avx2,
 * =portable build the lower ones), spreads output rows over OpenMP threads, and holds the functions
 * kvserve/kernels/quant_matmul.py binds. decode_step.c includes it whole. Also: rows of quantized blocks
 * dequantized to float32 (the embedding lookup, and the large-batch path, where BLAS on a dequantized copy
 * beats the integer kernel), and a GEMV over bfloat16 weights converted in registers. */
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The ISA paths. One -D switch: KV_NO_WIDE_TILES builds AVX-512 VNNI with AVX2's tile shapes (no 4 x 4 tiles,
 * no pair tiles), for `python -m benchmarks.kernel_ab -D KV_NO_WIDE_TILES`. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KV_AVX2 1 /* quant_matmul_avx2.h */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KV_VNNI 1 /* the dot is dpbusd: 4 products straight into int32, no int16 step */
#ifndef KV_NO_WIDE_TILES
#define WIDE_TILES 1 /* 32 vector registers: batches as 4 weight rows x 4 activation rows */
#endif
#endif
#endif
#if defined(WIDE_TILES) && defined(__AVX512BW__)
#define PAIR_TILES 1 /* x8 Q4_0, Q4_1, Q8_0, MXFP4, Q4_K and Q6_K batches: 4 weight rows x pairs of activation rows (quant_matmul_avx512.h) */
#endif
#if defined(KV_VNNI) && defined(__AVX512BW__) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KV_AMX 1 /* quant_matmul_amx.h */
#endif

#include "quant_blocks.h"
#include "quant_x8.h"
#include "quant_acts.h"

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
#define KV_INLINE static inline __attribute__((always_inline))
/* tile loops unrolled before the accumulator arrays are split into registers */
#define KV_UNROLL _Pragma("GCC unroll 4")

#ifdef KV_AVX2
#include "quant_matmul_avx2.h"
#else
#include "quant_matmul_scalar.h"
#endif
#ifdef PAIR_TILES
#include "quant_matmul_avx512.h"
#endif
#ifdef KV_AMX
/* Activation rows from which a call runs on the AMX tiles: where they overtake the AVX-512 kernels (in the
 * default model's decode step they broke even at 96, a batch of 48 at two levels, and were slower below). */
#define AMX_FROM_ROWS 96
#include "quant_matmul_amx.h"
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
#ifdef PAIR_TILES /* x8 rows but Q5's against pairs of activation rows: PAIR_RW weight rows x 1..PAIR_RP pairs */
#define PAIR_RW 4 /* a slab's rows */
#define PAIR_RP 3 /* 4 x 3 pairs: 24 accumulators of AVX-512's 32 registers */
#define PAIRS(RP)                                                                                             \
    static void pairs_##RP(int t, const wrows *R, const acts *A, long P0, float *y, long ldy) {              \
        switch (t) {                                                                                          \
        case T_Q4_0 + X8: tile_x8_pairs(T_Q4_0, R, A, P0, PAIR_RW, RP, y, ldy); return;                      \
        case T_Q8_0 + X8: tile_x8_pairs(T_Q8_0, R, A, P0, PAIR_RW, RP, y, ldy); return;                      \
        case T_Q4_K + X8: tile_x8_pairs(T_Q4_K, R, A, P0, PAIR_RW, RP, y, ldy); return;                      \
        case T_MXFP4 + X8: tile_x8_pairs(T_MXFP4, R, A, P0, PAIR_RW, RP, y, ldy); return;                    \
        case T_Q6_K + X8: tile_x8_q6k_pairs(R, A, P0, PAIR_RW, RP, y, ldy); return;                          \
        default: tile_x8_pairs(T_Q4_1, R, A, P0, PAIR_RW, RP, y, ldy); return;                               \
        }                                                                                                     \
    }
PAIRS(1) PAIRS(2) PAIRS(3)
#undef PAIRS
#endif
typedef void (*tile_fn)(int, const wrows *, const acts *, long, float *, long);

/* Weight rows r0..r1 against activation rows ta..tb - 1 of T (ta even): one token as 4-row tiles, a batch as
 * 2 weight rows × 4 activation rows (the last rows as one narrower tile), or 4 × 4 with
 * AVX-512's 32 registers (WIDE_TILES), x8 rows but Q5's as 4 weight rows × 3 pairs of activation rows,
 * two rows per 512-bit vector (PAIR_TILES). y: output column r0 of activation row 0; row k's at y + k rows. */
static void row_range(int t, const uint8_t *w, size_t rb, const acts *A, long T, long ta, long tb, long r0, long r1, float *y,
                      long rows) {
    static const tile_fn by2[5] = {NULL, tile_2x1, tile_2x2, tile_2x3, tile_2x4};
    static const tile_fn by1[5] = {NULL, tile_1x1, tile_1x2, tile_1x3, tile_1x4};
    const long nb = A->nb * 32 / block_values(t);
    long r = r0;
#ifdef PAIR_TILES
    if (T == 1 && t == T_Q6_K + X8) /* both halves of its sub-blocks in one 512-bit vector */
        for (; r + 4 <= r1; r += 4) {
            const wrows R = rows_at(t, w, rb, nb, r, r1);
            tile_x8_q6k_one(&R, A, 0, 4, y + (r - r0));
        }
#endif
    if (T == 1)
        for (; r + 4 <= r1; r += 4) {
            const wrows R = rows_at(t, w, rb, nb, r, r1);
            tile_4x1(t, &R, A, 0, y + (r - r0), rows);
        }
#ifdef PAIR_TILES /* (Q5 rows, decoded at 256 bits, then doubled, gained nothing steady from pairs) */
    typedef void (*pair_fn)(int, const wrows *, const acts *, long, float *, long);
    static const pair_fn by_pairs[PAIR_RP + 1] = {NULL, pairs_1, pairs_2, pairs_3};
    if (T > 1 && (t == T_Q4_0 + X8 || t == T_Q4_1 + X8 || t == T_Q8_0 + X8 || t == T_Q4_K + X8 || t == T_MXFP4 + X8 || t == T_Q6_K + X8))
        for (const long np = (tb + 1) / 2; r + PAIR_RW <= r1; r += PAIR_RW) {
            const wrows R = rows_at(t, w, rb, nb, r, r1);
            for (long P0 = ta / 2; P0 < np; P0 += PAIR_RP) by_pairs[np - P0 < PAIR_RP ? np - P0 : PAIR_RP](t, &R, A, P0, y + (r - r0), rows);
        }
#endif
#ifdef WIDE_TILES /* x8 Q5 rows, and every x8 type but Q8_0 and Q6_K without pairs (Q8_0 gained nothing from 4 x 4) */
    static const tile_fn by4[5] = {NULL, tile_4x1, tile_4x2, tile_4x3, tile_4x4};
    if (t >= X8 && base_type(t) != T_Q8_0 && base_type(t) != T_Q6_K) /* (x8 Q6_K: its two dots per sum spill at 4 x 4) */
        for (; r + 4 <= r1; r += 4) {
            const wrows R = rows_at(t, w, rb, nb, r, r1);
            for (long t0 = ta; t0 < tb; t0 += 4) by4[tb - t0 < 4 ? tb - t0 : 4](t, &R, A, t0, y + t0 * rows + (r - r0), rows);
        }
#endif
    for (; r < r1; r += 2) {
        const tile_fn *f = r + 2 <= r1 ? by2 : by1;
        const wrows R = rows_at(t, w, rb, nb, r, r1);
        for (long t0 = ta; t0 < tb; t0 += 4) f[tb - t0 < 4 ? tb - t0 : 4](t, &R, A, t0, y + t0 * rows + (r - r0), rows);
    }
}

/* Outputs r0..r1 (at most 16) of input rows ta..tb - 1 of T, whose activations are `levels` rows each in A
 * (quantize_input), into y (column r0 of row 0, rows ldy apart): with two levels each row's two products, made
 * into `part` (2 T x 16 floats), then added in one fixed order, so a row's result still does not depend on its
 * batch. */
static void rows_out(int t, const uint8_t *w, size_t rb, const acts *A, long T, int levels, long ta, long tb, long r0,
                     long r1, float *y, long ldy, float *part) {
    if (levels != 2) {
        row_range(t, w, rb, A, T, ta, tb, r0, r1, y, ldy);
        return;
    }
    row_range(t, w, rb, A, 2 * T, 2 * ta, 2 * tb, r0, r1, part, 16);
    for (long k = ta; k < tb; k++)
        for (long i = 0; i < r1 - r0; i++) y[k * ldy + i] = part[32 * k + i] + part[32 * k + 16 + i];
}

/* Input rows a thread takes through all its 16-row chunks before the next ones: 48 activation rows (8 pair
 * tiles' 3 pairs; 24 input rows at two levels). A prompt chunk's activations, 40 bytes per 32 values and row as
 * the tiles read them, are 1.3 MB for 512 rows of 2048, more than an L2 holds: taken whole, every 4-row slab read
 * them again from L3. 48 rows at a time stay in L2 through the thread's chunks (16 weight rows are a few KiB);
 * 18 rows of 8192 values were 1.06x slower and 96 rows 1.07x (Zen 5, 2026-12-08). The order of a sum's
 * operations does not change: the same bits. */
static inline long rows_per_pass(int levels) { return 48 / levels; }
/* Whether the pass from input row ta takes the rest: the last, at most 1.5 passes' rows (no short pass after). */
static inline int last_pass(long ta, long n, long T) { return T - ta <= n + n / 2; }

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
        const long n = rows_per_pass(levels);
        long ta = 0;
        for (;; ta += n) { /* the same chunks each thread's, pass after pass (one static schedule) */
            const long tb = last_pass(ta, n, T) ? T : ta + n;
#pragma omp for schedule(static) nowait
            for (long c = c0; c < chunks; c++)
                rows_out(qtype, w, rb, &A, T, levels, ta, tb, 16 * c, 16 * c + 16 < rows ? 16 * c + 16 : rows, y + 16 * c, rows,
                         mine);
            if (tb == T) break;
        }
    }
    free(buf);
    return 0;
}

/* Whether this build multiplies rows of GGML type t faster in the x8 layout than as stored: the SIMD builds for
 * every x8 type; plain C for all but Q8_0, whose stored 32 bytes already make one contiguous dot there (its x8
 * rows were slower). */
int kvserve_x8(int t) {
#ifdef KV_AVX2
    return x8_packs(t);
#else
    return x8_packs(t) && t != T_Q8_0;
#endif
}

/* dst = rows of src (GGML type qtype, one of x8_packs') in the x8 layout (quant_x8.h), or back (unpack != 0,
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

/* ---- bfloat16 weights, float32 activations: y[T, rows] = x[T, cols] · W^T (dot_bf16: the ISA header's) ---- */
int kvserve_bf16_matmul(const uint16_t *w, long rows, long cols, const float *x, long T, float *y, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long r0 = 0; r0 < rows; r0 += 16) {
        const long r1 = r0 + 16 < rows ? r0 + 16 : rows;
        for (long t = 0; t < T; t++)
            for (long r = r0; r < r1; r++) y[t * rows + r] = dot_bf16(w + r * cols, x + t * cols, cols);
    }
    return 0;
}
