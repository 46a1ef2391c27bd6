/* The prompt GEMM on AMX-INT8 tiles: x8 Q4_0 / Q4_1 / Q8_0 / Q4_K rows against many activation rows at once.
 * Included by quant_matmul.c where it is compiled for AMX (KV_AMX), after quant_matmul_avx2.h and _avx512.h,
 * whose kernels it replaces for such calls: it uses their x8_scales and sums in their order.
 *
 * One tile instruction (tdpbusd) multiplies 16 weight rows' codes (unsigned bytes, tile A: 16 x 32, one
 * block) by 16 activation rows' int8 values (tile B: 8 x 64, the same block in the dword-interleaved
 * order the instruction reads) into 16 x 16 int32 sums. Each block has its own float scales, so every
 * block's sums leave the tile and are scaled on AVX-512: per block and weight row, a vector over the
 * 16 activation rows gets tile_x8's two FMAs (m·s, then dot·(d·d_a)), into the lane (block index mod 8)
 * tile_x8 accumulates that block in, group after group; tail pairs go to the lanes tile_x8 gives them;
 * the 8 lanes are summed in hsum's pairs, two levels added as rows_out adds them. The integer sums are
 * exact and every float operation of an output is tile_x8's, in its order: the same bits as the
 * AVX-512 kernels for any batch, so a greedy request's tokens still do not depend on its batch.
 *
 * Codes are decoded once per 16 weight rows for all activation rows (AMX_BLOCK_TILES row tiles share
 * each activation tile while it sits in L1), and activation tiles once per call.
 * Linux hands out the tile registers per process on request (arch_prctl); where it refuses, or
 * kvserve_amx(0) turned it off, the AVX-512 kernels run. The tile configuration is written through a
 * compiler barrier: gcc 12 drops plain stores into a struct only `ldtilecfg` reads. */
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_BLOCK_TILES 4 /* row tiles (16 rows each) decoded together (1-8 measured the same) */
#define AMX_UNROLL _Pragma("GCC unroll 16") /* every loop over a tile's 16 rows: acc[16] stays in registers */
#define AMX_TILE_BYTES 512 /* an A tile (16 rows x 32 codes) or a B tile (8 x 64) */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) amx_config;

/* 1 when tiles run here (asked once), 0 when not or turned off; -1 not asked yet. */
static int amx_state = -1;

static int amx_permitted(void) {
    if (amx_state < 0) amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return amx_state;
}

/* Two sets, so one block's sums are scaled while the next block's are made: tmm0 / tmm1: C (16 x 16 int32),
 * tmm2 / tmm3: A (16 weight rows x 32 codes), tmm4 / tmm5: B (8 x 64: 16 activation rows' 32 values). */
static void amx_configure(void) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 2; i++) {
        c.rows[i] = 16, c.colsb[i] = 64;     /* C */
        c.rows[2 + i] = 16, c.colsb[2 + i] = 32; /* A */
        c.rows[4 + i] = 8, c.colsb[4 + i] = 64;  /* B */
    }
    __asm__ volatile("" ::: "memory");
    _tile_loadconfig(&c);
}

/* Whether this call goes to the tiles: the types whose x8 groups are 8 blocks of 32 codes in words (a Q4_K
 * super-block's 8 sub-blocks alike, with their own scales and minimums; x8_scales makes them all), rows
 * whose blocks past the last group all go in tail pairs (an even count), enough activation rows. */
static int amx_takes(int t, long rows, long nb, long R) {
    if (!(t == T_Q4_0 + X8 || t == T_Q4_1 + X8 || t == T_Q8_0 + X8 || t == T_Q4_K + X8) || slab_rows(base_type(t)) != 4)
        return 0;
    if (rows < 16 || R < AMX_FROM_ROWS || x8_tail_blocks(t, nb) != 2 * tail_pairs(t, nb)) return 0;
    return amx_permitted();
}

/* Activation rows 16 tau.. as B tiles (block b: 8 rows of 64 bytes, row k holding values 4k..4k+3 of each
 * activation row) and their scales d and sums s per block (16 floats); rows past R are zeros. */
static void amx_pack_acts(const acts *A, long R, long tau, uint8_t *Bt, float *da, float *sa) {
    const long nb = A->nb, live = R - 16 * tau < 16 ? R - 16 * tau : 16;
    const __mmask16 on = (__mmask16)((1u << live) - 1);
    const __m512i rowq = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)(32 * nb)));
    const __m512i rowf = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)nb));
    const int8_t *q = A->q + 32 * 16 * tau * nb;
    const float *d = A->d + 16 * tau * nb, *s = A->s + 16 * tau * nb;
    for (long b = 0; b < nb; b++) {
        for (int k = 0; k < 8; k++)
            _mm512_storeu_si512(Bt + AMX_TILE_BYTES * b + 64 * k,
                                _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), on, rowq, q + 32 * b + 4 * k, 1));
        _mm512_storeu_ps(da + 16 * b, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), on, rowf, d + b, 4));
        _mm512_storeu_ps(sa + 16 * b, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), on, rowf, s + b, 4));
    }
}

/* Lane j's 32 codes of an x8 group G (or tail-pair group) of type t in value order, as unsigned bytes
 * (Q8_0: q + 128), and its scale d and offset / minimum term m as x8_scales makes them. */
static void amx_lane_codes(int t, const uint8_t *G, int j, uint8_t *out, float *d, float *m) {
    const int codes = x8_qs_at(t);
    __m256 dv, mv;
    float ds[8], ms[8];
    x8_scales(t, G, &dv, &mv);
    _mm256_storeu_ps(ds, dv), _mm256_storeu_ps(ms, mv);
    *d = ds[j], *m = ms[j];
    for (int v = 0; v < 32; v++) {
        if (t == T_Q8_0) {
            out[v] = (uint8_t)(G[codes + 32 * (v / 4) + 4 * j + v % 4] ^ 0x80);
        } else {
            const uint8_t byte = G[codes + 32 * ((v % 16) / 4) + 4 * j + v % 4];
            out[v] = v < 16 ? byte & 15 : byte >> 4;
        }
    }
}

/* One whole group (8 blocks) of one weight row into the A tiles of blocks 8g..8g+7 (row n of each,
 * tiles AMX_TILE_BYTES apart), two 512-bit permutes putting each block's words together. */
static inline void amx_decode_group(int t, const uint8_t *G, uint8_t *A0, float *dw, float *mw) {
    const int codes = x8_qs_at(t);
    __m256 d, m;
    x8_scales(t, G, &d, &m); /* tile_x8's own */
    float dv[8], mv[8];
    _mm256_storeu_ps(dv, d), _mm256_storeu_ps(mv, m);
    for (int j = 0; j < 8; j++) dw[16 * j] = dv[j], mw[16 * j] = mv[j];
    /* dword 4 jj + s of the permute: word s, lane j0 + jj (words s < 2 in the first source, 2..3 in the second) */
    const __m512i pick0 = _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
    const __m512i pick1 = _mm512_add_epi32(pick0, _mm512_set1_epi32(4));
    const __m512i halves0 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), halves1 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    const __m512i w01 = _mm512_loadu_si512(G + codes), w23 = _mm512_loadu_si512(G + codes + 64);
    for (int h = 0; h < 2; h++) { /* blocks 4h..4h+3 */
        const __m512i P = _mm512_permutex2var_epi32(w01, h ? pick1 : pick0, w23); /* 4 blocks' first 16 bytes */
        __m512i lo, hi;
        if (t == T_Q8_0) {
            const __m512i w45 = _mm512_loadu_si512(G + codes + 128), w67 = _mm512_loadu_si512(G + codes + 192);
            const __m512i bias = _mm512_set1_epi8((char)0x80);
            lo = _mm512_xor_si512(P, bias);
            hi = _mm512_xor_si512(_mm512_permutex2var_epi32(w45, h ? pick1 : pick0, w67), bias);
        } else {
            const __m512i m4 = _mm512_set1_epi8(0x0F);
            lo = _mm512_and_si512(P, m4), hi = _mm512_and_si512(_mm512_srli_epi16(P, 4), m4);
        }
        const __m512i X = _mm512_permutex2var_epi64(lo, halves0, hi), Y = _mm512_permutex2var_epi64(lo, halves1, hi);
        _mm256_storeu_si256((__m256i *)(A0 + AMX_TILE_BYTES * (4 * h + 0)), _mm512_castsi512_si256(X));
        _mm256_storeu_si256((__m256i *)(A0 + AMX_TILE_BYTES * (4 * h + 1)), _mm512_extracti64x4_epi64(X, 1));
        _mm256_storeu_si256((__m256i *)(A0 + AMX_TILE_BYTES * (4 * h + 2)), _mm512_castsi512_si256(Y));
        _mm256_storeu_si256((__m256i *)(A0 + AMX_TILE_BYTES * (4 * h + 3)), _mm512_extracti64x4_epi64(Y, 1));
    }
}

/* The 16 weight rows r0.. (whole slabs) as A tiles for every block (Acodes: block b's at AMX_TILE_BYTES b,
 * row n's 32 codes at 32 n) and their scales dw / mw (block b, row n at 16 b + n). */
static void amx_decode_rows(int t, const uint8_t *w, size_t rb, long nb, long rows, long r0, uint8_t *Acodes, float *dw,
                            float *mw) {
    const int bt = base_type(t);
    const long groups = nb / 8, np = tail_pairs(t, nb), stored = nb * 32 / block_values(t); /* (K-quants: super-blocks) */
    for (int n = 0; n < 16; n++) {
        const wrows R = rows_at(t, w, rb, stored, r0 + n, rows);
        for (long g = 0; g < groups; g++)
            amx_decode_group(bt, R.w + g * R.gs, Acodes + AMX_TILE_BYTES * 8 * g + 32 * n, dw + 16 * 8 * g + n, mw + 16 * 8 * g + n);
        for (long p = 0; p < np; p++)
            for (int e = 0; e < 2; e++) {
                const long b = 8 * groups + 2 * p + e;
                amx_lane_codes(bt, R.tp + p * x8_group_bytes(t), 2 * R.lane0 + e, Acodes + AMX_TILE_BYTES * b + 32 * n,
                               dw + 16 * b + n, mw + 16 * b + n);
            }
    }
}

/* Block b's int32 sums, C[n][k] = weight row n · activation row k, in tile set s (0 or 1). */
#define AMX_BLOCK(tc, ta, tb, Ab, Bb, C)                                                                      \
    do {                                                                                                      \
        _tile_zero(tc);                                                                                       \
        _tile_loadd(ta, Ab, 32);                                                                              \
        _tile_loadd(tb, Bb, 64);                                                                              \
        _tile_dpbusd(tc, ta, tb);                                                                             \
        _tile_stored(tc, C, 64);                                                                              \
    } while (0)

/* tile_x8's two FMAs for block sums C (row n's over 16 activation rows at C + 16 n) into acc[n], rows n
 * with n % 4 == only (a tail pair's lanes), or all when only < 0. */
KV_INLINE void amx_scale(const int32_t *C, const float *dw, const float *mw, __m512 a_d, __m512 a_s, int only, __m512 acc[16]) {
    AMX_UNROLL
    for (int n = 0; n < 16; n++) {
        if (only >= 0 && n % 4 != only) continue;
        acc[n] = _mm512_fmadd_ps(_mm512_set1_ps(mw[n]), a_s, acc[n]);
        acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(C + 16 * n)), _mm512_mul_ps(_mm512_set1_ps(dw[n]), a_d), acc[n]);
    }
}

/* One row tile (16 weight rows, decoded) against one activation tile, lane by lane: tile_x8's sums of
 * lane j's blocks (8 g + j, then its tail-pair blocks) into out[n][j][k] (16 x 8 x 16 floats). The
 * blocks' int32 sums are made AMX_AHEAD blocks before they are scaled, into a ring of AMX_RING tiles
 * that stays in L1 (a tile stored to L2 takes 4x as long), so the tile unit and the FMAs overlap. */
#define AMX_RING 8
#define AMX_AHEAD 4 /* (1-6 measured the same) */
/* Step (j, r) of the lane-major order: lane j's r-th block. */
static inline long amx_block_of(int j, long r, long groups) { return r < groups ? 8 * r + j : 8 * groups + 2 * (r - groups) + (j & 1); }
static void amx_lanes(long nb, long np, const uint8_t *Acodes, const float *dw, const float *mw, const uint8_t *Bt,
                      const float *da, const float *sa, int32_t *C, float *out) {
    const long groups = nb / 8, per_lane = groups + np, steps = 8 * per_lane;
    long ahead = 0; /* the next step to issue, as (lane aj, index ar) */
    int aj = 0;
    long ar = 0;
#define AMX_ISSUE()                                                                                           \
    do {                                                                                                      \
        const long b_ = amx_block_of(aj, ar, groups);                                                         \
        int32_t *c_ = C + 256 * (ahead % AMX_RING);                                                           \
        if (ahead & 1) AMX_BLOCK(1, 3, 5, Acodes + AMX_TILE_BYTES * b_, Bt + AMX_TILE_BYTES * b_, c_);        \
        else AMX_BLOCK(0, 2, 4, Acodes + AMX_TILE_BYTES * b_, Bt + AMX_TILE_BYTES * b_, c_);                  \
        ahead++;                                                                                              \
        if (++ar == per_lane) ar = 0, aj++;                                                                   \
    } while (0)
    while (ahead < AMX_AHEAD && ahead < steps) AMX_ISSUE();
    long s = 0;
    for (int j = 0; j < 8; j++) {
        __m512 acc[16];
        AMX_UNROLL
        for (int n = 0; n < 16; n++) acc[n] = _mm512_setzero_ps();
        for (long r = 0; r < per_lane; r++, s++) {
            const long b = amx_block_of(j, r, groups);
            if (ahead < steps) AMX_ISSUE();
            /* a tail pair's block lands in lane j for the rows at slab position j / 2 */
            amx_scale(C + 256 * (s % AMX_RING), dw + 16 * b, mw + 16 * b, _mm512_loadu_ps(da + 16 * b), _mm512_loadu_ps(sa + 16 * b),
                      r < groups ? -1 : j / 2, acc);
        }
        AMX_UNROLL
        for (int n = 0; n < 16; n++) _mm512_storeu_ps(out + 16 * (8 * n + j), acc[n]);
    }
#undef AMX_ISSUE
}

/* out's 8 lanes summed as hsum sums them, ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)), into
 * y: activation row 16 tau + k of weight row r0 + n; two levels as rows_out adds them. */
static void amx_store(const float *out, long R, long tau, int levels, float *y, long ldy, long r0) {
    float s[16][16]; /* [n][k] */
    for (int n = 0; n < 16; n++) {
        const float *a = out + 128 * n;
        const __m512 x0 = _mm512_add_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(a + 64));
        const __m512 x1 = _mm512_add_ps(_mm512_loadu_ps(a + 16), _mm512_loadu_ps(a + 80));
        const __m512 x2 = _mm512_add_ps(_mm512_loadu_ps(a + 32), _mm512_loadu_ps(a + 96));
        const __m512 x3 = _mm512_add_ps(_mm512_loadu_ps(a + 48), _mm512_loadu_ps(a + 112));
        _mm512_storeu_ps(s[n], _mm512_add_ps(_mm512_add_ps(x0, x2), _mm512_add_ps(x1, x3)));
    }
    for (long k = 0; k < 16 && 16 * tau + k < R; k += levels) {
        float *row = y + (16 * tau + k) / levels * ldy + r0;
        for (int n = 0; n < 16; n++) row[n] = levels == 2 ? s[n][k] + s[n][k + 1] : s[n][k];
    }
}

/* Bytes of scratch a thread needs for rows of nb blocks, and the activation tiles of R rows. */
static size_t amx_thread_bytes(long nb) {
    return (size_t)AMX_BLOCK_TILES * nb * (AMX_TILE_BYTES + 128) + AMX_RING * 1024 + 8192;
}
static size_t amx_act_bytes(long R, long nb) { return (size_t)((R + 15) / 16) * nb * (AMX_TILE_BYTES + 128); }

/* Inside a parallel region, every thread: A's R activation rows as B tiles into `tiles` (amx_act_bytes), then
 * a barrier. */
static void amx_pack_in_region(const acts *A, long R, uint8_t *tiles) {
    const long nb = A->nb, taus = (R + 15) / 16;
    float *da = (float *)(tiles + (size_t)taus * nb * AMX_TILE_BYTES), *sa = da + (size_t)taus * nb * 16;
#pragma omp for schedule(static)
    for (long tau = 0; tau < taus; tau++)
        amx_pack_acts(A, R, tau, tiles + (size_t)tau * nb * AMX_TILE_BYTES, da + (size_t)tau * nb * 16, sa + (size_t)tau * nb * 16);
}

/* Inside a parallel region, every thread, once amx_pack_in_region has packed the R = levels T activation rows:
 * this thread's share of the rows / 16 whole row tiles of a weight of type t, outputs into y (row k's at
 * y + k ldy). No barrier after; the rows past the last whole tile are the caller's (rows_out). scratch: this
 * thread's amx_thread_bytes(nb). */
static void amx_rows_in_region(int t, const uint8_t *w, size_t rb, long nb, long rows, long R, int levels,
                               const uint8_t *tiles, float *y, long ldy, uint8_t *scratch) {
    const long taus = (R + 15) / 16, n_row_tiles = rows / 16, np = tail_pairs(t, nb);
    const uint8_t *Bt = tiles;
    const float *da = (const float *)(tiles + (size_t)taus * nb * AMX_TILE_BYTES), *sa = da + (size_t)taus * nb * 16;
    uint8_t *Acodes = scratch;
    float *dw = (float *)(scratch + (size_t)AMX_BLOCK_TILES * nb * AMX_TILE_BYTES), *mw = dw + (size_t)AMX_BLOCK_TILES * nb * 16;
    int32_t *C = (int32_t *)(mw + (size_t)AMX_BLOCK_TILES * nb * 16);
    float *out = (float *)(C + 256 * AMX_RING);
    amx_configure();
#pragma omp for schedule(static) nowait
    for (long c = 0; c < (n_row_tiles + AMX_BLOCK_TILES - 1) / AMX_BLOCK_TILES; c++) {
        const long first = c * AMX_BLOCK_TILES, n = n_row_tiles - first < AMX_BLOCK_TILES ? n_row_tiles - first : AMX_BLOCK_TILES;
        for (long i = 0; i < n; i++)
            amx_decode_rows(t, w, rb, nb, rows, 16 * (first + i), Acodes + (size_t)i * nb * AMX_TILE_BYTES,
                            dw + (size_t)i * nb * 16, mw + (size_t)i * nb * 16);
        for (long tau = 0; tau < taus; tau++)
            for (long i = 0; i < n; i++) {
                amx_lanes(nb, np, Acodes + (size_t)i * nb * AMX_TILE_BYTES, dw + (size_t)i * nb * 16, mw + (size_t)i * nb * 16,
                          Bt + (size_t)tau * nb * AMX_TILE_BYTES, da + (size_t)tau * nb * 16, sa + (size_t)tau * nb * 16, C, out);
                amx_store(out, R, tau, levels, y, ldy, 16 * (first + i));
            }
    }
    _tile_release();
}
