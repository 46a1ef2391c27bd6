/* The quantized matmul's 256-bit SIMD kernels: AVX2 + FMA + F16C, and with AVX-512 VNNI (KV_VNNI) its
 * 256-bit dpbusd as the integer dot. Included by quant_matmul.c where it is compiled for AVX2 (KV_AVX2).
 *
 * The tiles (tile()) work in registers: a weight block is decoded once for up to 4 activation rows and an
 * activation block loaded once for 2-4 weight rows; the per-block float scales are made 8 blocks at a
 * time as vectors, so the inner loop is the integer dot, one convert and one FMA per block and row pair;
 * one horizontal sum per output at the end. x8 rows (tile_x8) advance 8 blocks per integer dot
 * instruction, each block's sum in its own lane, and the float work falls to one convert and one FMA
 * per 8 blocks and row pair. */

/* ---- activations -------------------------------------------------------------------------------- */
/* One block of 32 values x as activation block o. */
static inline void quantize_block(const float *x, const acts *A, long o) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + 8 * i), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    __m256i q[4]; /* round to nearest even, as the plain C path's lrintf */
    for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    const __m256i lo = _mm256_add_epi32(q[0], q[1]), hi = _mm256_add_epi32(q[2], q[3]);
    /* packs interleave the 128-bit lanes; the permute puts the 32 values back in order */
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)(A->q + 32 * o), _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m256i hs = _mm256_hadd_epi32(lo, hi); /* lanes: lo lo hi hi | lo lo hi hi */
    hs = _mm256_hadd_epi32(hs, hs);
    const __m128i h2 = _mm_add_epi32(_mm256_castsi256_si128(hs), _mm256_extracti128_si256(hs, 1));
    const int s0 = _mm_cvtsi128_si32(h2), s1 = _mm_extract_epi32(h2, 1);
    store_block(A, o, d, s0, s1);
}

/* Row t's blocks, once quantized, into the x8 layouts' transposed words (qt, dp, sp). */
static void transpose_row(const acts *A, long t) {
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
}

/* ---- the integer dot: AVX2's maddubs + madd, or AVX-512 VNNI's dpbusd --------------------------- */
/* 32 unsigned weight codes · 32 int8 activations → 8 int32 partial sums, as float (codes < 128
 * for maddubs, whose int16 pair sums would overflow above; any byte for dpbusd). */
static inline __m256 dot_u8s8(__m256i u, __m256i s) {
#ifdef KV_VNNI
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s));
#else
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
/* acc + the 8 int32 sums of u · a (as dot_u8s8, kept in int32: the x8 tiles' lanes). */
#ifdef KV_VNNI
#define DP(acc, u, a) _mm256_dpbusd_epi32(acc, u, a)
#else
#define DP(acc, u, a) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)))
#endif
/* Q8_0's signed codes: maddubs would overflow its int16 pairs on q + 128, so AVX2 takes |q| times
 * the activation with q's sign (two sign ops per block and row pair); dpbusd has no int16 step,
 * so with VNNI the codes go in as q + 128 (one xor per weight block) and the 128 comes off
 * through the activation sums, as Q4_0's 8 does. */
#ifdef KV_VNNI
#define Q8_OFFSET 1
#else
#define Q8_OFFSET 0
#endif

/* ---- tiles ---------------------------------------------------------------------------------------- */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
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
/* MXFP4: 32 codes (0..15, as nibbles16 or an x8 word's nibbles give them) → the unsigned values the kernels
 * multiply, MX_VALUES + MX_OFFSET (0..24: two maddubs' int16 pairs still add without overflow). */
static inline __m256i mx_codes(__m256i nibbles) {
    const __m256i values = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MX_VALUES));
    return _mm256_shuffle_epi8(_mm256_add_epi8(values, _mm256_set1_epi8(MX_OFFSET)), nibbles); /* (the table: made once, out of the loops) */
}
/* 8 e8m0 bytes (as int32 lanes) → their half scales 2^(e - 128), as mx_half_scale makes each. */
static inline __m256 mx_scales(__m256i e) {
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}
static inline __m256i lanes_below(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
/* n <= 8 floats, lanes past n zero (never read past the row) */
static inline __m256 load_n(const float *p, int n, __m256i mask) { return n == 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mask); }

/* f16 scale d (and Q4_1's minimum m, the next 2 bytes; MXFP4: its d and -12 d) of n <= 8 consecutive blocks of t.
 * Plain loads paired in 64-bit registers: cheaper here than a gather, which also stalled on the
 * first touch of weights that stream from memory. */
KV_INLINE void block_scales(int t, const uint8_t *w, int n, __m256 *d, __m256 *m) {
    const int bs = block_bytes(t);
    if (t == T_MXFP4) { /* one byte e a block */
        uint64_t e = 0;
        for (int j = 0; j < n; j++) e |= (uint64_t)w[j * bs] << (8 * j);
        *d = mx_scales(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)e)));
        *m = _mm256_mul_ps(*d, _mm256_set1_ps(-(float)MX_OFFSET));
        return;
    }
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
 * memory (the LM head at one token ran at a third of the bandwidth). GCC 12 dropped _mm_prefetch
 * here; the builtin stays. */
static inline void prefetch_next(const uint8_t *w, size_t rb, int RW, int group_bytes, long g) {
    const uint8_t *p = w + 2 * RW * rb + (size_t)g * RW * group_bytes;
    for (int o = 0; o < RW * group_bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

/* Prefetch for group g of a tile's x8 rows. Rows one after another: prefetch_next, as acc32 does. A
 * slab's rows: their group two slabs on, in batches only. A one-token tile reads its slab front to
 * back and the hardware prefetcher keeps ahead of it unaided (prefetching made it slower); a batch's
 * tiles spend longer on each byte, and there it pays. */
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
 * the kernel's vector loads of bytes stored one at a time would wait on failed store forwarding. */
static inline void k_scale_min_words(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t a, b, c;
    memcpy(&a, s, 4), memcpy(&b, s + 4, 4), memcpy(&c, s + 8, 4);
    const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | (((a >> 6) & 0x03030303u) << 4);
    const uint32_t mn_hi = ((c >> 4) & 0x0F0F0F0Fu) | (((b >> 6) & 0x03030303u) << 4);
    *sc = (uint64_t)(a & 0x3F3F3F3Fu) | (uint64_t)sc_hi << 32;
    *mn = (uint64_t)(b & 0x3F3F3F3Fu) | (uint64_t)mn_hi << 32;
}

/* Stored Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4 rows (quant_blocks.h): the sums of blocks g0.. (a multiple of 8) of RW weight rows (w: row 0's block g0, rows rb apart) and RT
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
            block_scales(t, w + i * rb + (g - g0) * bs, n, &d, &m);
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
                    u[i] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)block_qs(t, b)), _mm256_set1_epi8((char)0x80));
                } else if (t == T_Q8_0) { /* |q| · (x with q's sign): unsigned · signed, as maddubs wants */
                    sg[i] = _mm256_loadu_si256((const __m256i *)block_qs(t, b));
                    u[i] = _mm256_sign_epi8(sg[i], sg[i]);
                } else if (t == T_Q5_0 || t == T_Q5_1) {
                    u[i] = _mm256_or_si256(nibbles16(block_qs(t, b)), fifth_bits(block_qh(t, b)));
                } else {
                    u[i] = t == T_MXFP4 ? mx_codes(nibbles16(block_qs(t, b))) : nibbles16(block_qs(t, b));
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

/* x8 rows (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, Q4_K, Q5_K repacked by kvserve_pack_x8; Q6_K: tile_x8_q6k): per group of 8 blocks (a
 * K-quant's super-block: 8 sub-blocks) the integer dots of all 8 blocks advance together, block j's in int32
 * lane j (Q4: 4 words of low nibbles, codes 0-15 against activation words 0-3, and of high nibbles, codes
 * 16-31 against words 4-7, Q5's with their fifth bits; Q8_0: 8 words), then one convert and one FMA by the 8
 * blocks' scale products per row pair, and one FMA for the offset / minimum term (x8_scales; a K-quant's
 * sub-block scales and minimums unpacked once per super-block). In a slab, the blocks past the last whole group
 * go two at a time as tail pairs (one group for the slab's 4 rows, each row taking its two lanes); the rest are
 * stored as GGML's, and summed as tile32 sums them. Every (i, k) sum runs the same operations whatever the tile. */
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
 * activation sums s) from the x8 group G, for tile_x8 and tile_x8_pairs alike. */
KV_INLINE void x8_scales(int t, const uint8_t *G, __m256 *d, __m256 *m) {
    if (t == T_Q4_K || t == T_Q5_K) { /* sub-block j: x = d sc_j q - dmin mn_j, as tile_q45_k makes them */
        const x8_q4_K *K = (const x8_q4_K *)G; /* (Q5_K's header is the same) */
        uint64_t sc, mn;
        k_scale_min_words(K->scales, &sc, &mn);
        *d = _mm256_mul_ps(_mm256_set1_ps(fp16_to_f32(K->d)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc))));
        *m = _mm256_mul_ps(_mm256_set1_ps(-fp16_to_f32(K->dmin)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn))));
        return;
    }
    if (t == T_MXFP4) {
        long long e;
        memcpy(&e, ((const x8_mxfp4 *)G)->e, 8);
        *d = mx_scales(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(e)));
        *m = _mm256_mul_ps(*d, _mm256_set1_ps(-(float)MX_OFFSET));
        return;
    }
    *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const x8_q4_0 *)G)->d)); /* d[8] leads every other type */
    *m = _mm256_setzero_ps();
    if (t == T_Q4_1 || t == T_Q5_1) *m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const x8_q4_1 *)G)->m)); /* m[8] next */
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
    const int five = t == T_Q5_0 || t == T_Q5_1 || t == T_Q5_K, codes = x8_qs_at(t);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    KV_UNROLL
    for (int i = 0; i < RW; i++)
        KV_UNROLL
        for (int k = 0; k < RT; k++) dot[i][k] = _mm256_setzero_si256();
    if (t != T_Q8_0) {
        __m256i qh[RWMAX];
        KV_UNROLL
        for (int i = 0; i < RW; i++)
            if (five) qh[i] = _mm256_loadu_si256((const __m256i *)(w + i * rs + x8_qh_at(t)));
        KV_UNROLL
        for (int s = 0; s < 4; s++) {
            __m256i lo[RWMAX], hi[RWMAX];
            KV_UNROLL
            for (int i = 0; i < RW; i++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + i * rs + codes + 32 * s));
                lo[i] = _mm256_and_si256(v, m4);
                hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                if (t == T_MXFP4) lo[i] = mx_codes(lo[i]), hi[i] = mx_codes(hi[i]);
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
/* x8 Q6_K: word s of one half's 6-bit codes as unsigned bytes (half 0: values 0-15 of each sub-block, 1: 16-31). */
static inline __m256i q6k_codes(const x8_q6_K *G, int s, int half) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i v = _mm256_loadu_si256((const __m256i *)G->ql[s]);
    const __m256i hb = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)G->qh[s / 2]), 4 * (s & 1));
    return half ? _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30))
                : _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
}
/* x8 Q6_K: one half's 8 scales d·sc (lane j: sub-block j's scale of that half). */
static inline __m256 q6k_scales(const x8_q6_K *G, int half) {
    const __m128i halves = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)G->scales),
                                            _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    return _mm256_mul_ps(_mm256_set1_ps(fp16_to_f32(G->d)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(half ? _mm_srli_si128(halves, 8) : halves)));
}
/* x8 Q6_K super-blocks (x8_q6_K): sub-block j in lane j. The two halves of a sub-block have their own scales, so their
 * integer dots are kept apart (one pass each) and scaled by d·sc_2j·d_a and d·sc_2j+1·d_a; the -32
 * comes off through the activations' half sums, as tile_q6_k takes it. */
KV_INLINE void tile_x8_q6k(const wrows *R, const acts *A, long t0, int RW, int RT, float *y, long ldy) {
    const long nb = A->nb, groups = nb / 8;
    __m256 acc[RWMAX][RTMAX];
    zero_sums(acc, RW, RT);
    for (long g = 0; g < groups; g++) {
        const uint8_t *w = R->w + g * R->gs;
        const size_t rs = R->rs;
        prefetch_group(R, g, RW, RT, sizeof(x8_q6_K));
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
                for (int i = 0; i < RW; i++) u[i] = q6k_codes((const x8_q6_K *)(w + i * rs), s, half);
                KV_UNROLL
                for (int k = 0; k < RT; k++) {
                    const __m256i a = _mm256_loadu_si256((const __m256i *)qt_at(A, t0 + k, 8 * g + s + 4 * half));
                    KV_UNROLL
                    for (int i = 0; i < RW; i++) dot[i][k] = DP(dot[i][k], u[i], a);
                }
            }
            KV_UNROLL
            for (int i = 0; i < RW; i++) {
                const x8_q6_K *G = (const x8_q6_K *)(w + i * rs);
                const __m128i sc = _mm_loadu_si128((const __m128i *)G->scales);
                const __m256 d0 = _mm256_set1_ps(fp16_to_f32(G->d)), d = q6k_scales(G, half);
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

/* Stored Q4_K and Q5_K rows (block_q4_K, block_q5_K): sub-block j's dots against activation block j of the
 * super-block, x = d sc_j q - dmin mn_j. */
KV_INLINE void tile_q45_k(int t, const uint8_t *w, size_t rb, const acts *A, long t0, int RW, int RT, float *y, long ldy) {
    const int five = t == T_Q5_K, bs = five ? sizeof(block_q5_K) : sizeof(block_q4_K);
    const long nb = A->nb;
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    __m256 acc[RWMAX][RTMAX];
    zero_sums(acc, RW, RT);
    for (long sb = 0; sb < nb / 8; sb++) {
        float scl[RWMAX][RTMAX][8] __attribute__((aligned(32)));
        prefetch_next(w, rb, RW, bs, sb);
        KV_UNROLL
        for (int i = 0; i < RW; i++) {
            const block_q4_K *K = (const block_q4_K *)(w + i * rb + sb * bs); /* (Q5_K's header is the same) */
            uint64_t sc, mn;
            k_scale_min_words(K->scales, &sc, &mn);
            const __m256 d = _mm256_mul_ps(_mm256_set1_ps(fp16_to_f32(K->d)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc))));
            const __m256 m = _mm256_mul_ps(_mm256_set1_ps(fp16_to_f32(K->dmin)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn))));
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
                const uint8_t *qs = five ? ((const block_q5_K *)b)->qs : ((const block_q4_K *)b)->qs;
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 2)));
                u[i] = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(raw, 4) : raw, m4);
                if (five) {
                    const __m256i hb = _mm256_loadu_si256((const __m256i *)((const block_q5_K *)b)->qh);
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

/* Stored Q6_K rows (block_q6_K): codes go to maddubs unsigned (0..63); the -32 is taken off through the
 * activation half sums. */
KV_INLINE void tile_q6_k(const uint8_t *w, size_t rb, const acts *A, long t0, int RW, int RT, float *y, long ldy) {
    const long nb = A->nb;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    __m256 acc[RWMAX][RTMAX];
    zero_sums(acc, RW, RT);
    for (long sb = 0; sb < nb / 8; sb++) {
        float scl[RWMAX][RTMAX][8] __attribute__((aligned(32)));
        prefetch_next(w, rb, RW, sizeof(block_q6_K), sb);
        KV_UNROLL
        for (int i = 0; i < RW; i++) {
            const block_q6_K *B = (const block_q6_K *)(w + i * rb) + sb;
            const __m256 d = _mm256_set1_ps(fp16_to_f32(B->d));
            const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)B->scales));
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
                const block_q6_K *B = (const block_q6_K *)(w + i * rb) + sb;
                const __m256i l4 = _mm256_loadu_si256((const __m256i *)(B->ql + 64 * h + 32 * (g % 2)));
                const __m256i h2 = _mm256_loadu_si256((const __m256i *)(B->qh + 32 * h));
                const __m256i lo = _mm256_and_si256(g < 2 ? l4 : _mm256_srli_epi16(l4, 4), m4);
                u[i] = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h2, 2 * g), m2), 4));
                const int8_t *sc = B->scales;
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
    case T_MXFP4 + X8: tile_x8(T_MXFP4, R, A, t0, RW, RT, y, ldy); return;
    case T_Q4_K + X8: tile_x8(T_Q4_K, R, A, t0, RW, RT, y, ldy); return;
    case T_Q5_K + X8: tile_x8(T_Q5_K, R, A, t0, RW, RT, y, ldy); return;
    case T_Q6_K + X8: tile_x8_q6k(R, A, t0, RW, RT, y, ldy); return;
    case T_Q8_0: tile32(T_Q8_0, w, rb, A, t0, RW, RT, y, ldy); return;
    case T_Q4_0: tile32(T_Q4_0, w, rb, A, t0, RW, RT, y, ldy); return;
    case T_Q4_1: tile32(T_Q4_1, w, rb, A, t0, RW, RT, y, ldy); return;
    case T_Q5_0: tile32(T_Q5_0, w, rb, A, t0, RW, RT, y, ldy); return;
    case T_Q5_1: tile32(T_Q5_1, w, rb, A, t0, RW, RT, y, ldy); return;
    case T_MXFP4: tile32(T_MXFP4, w, rb, A, t0, RW, RT, y, ldy); return;
    case T_Q4_K: tile_q45_k(T_Q4_K, w, rb, A, t0, RW, RT, y, ldy); return;
    case T_Q5_K: tile_q45_k(T_Q5_K, w, rb, A, t0, RW, RT, y, ldy); return;
    default: tile_q6_k(w, rb, A, t0, RW, RT, y, ldy); return;
    }
}

/* ---- bfloat16 weights: a row's dot with float32 activations, widened in registers ------------------- */
static float dot_bf16(const uint16_t *w, const float *x, long n) {
    long k = 0;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; k + 16 <= n; k += 16) {
        const __m256i w0 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + k)));
        const __m256i w1 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + k + 8)));
        a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w1, 16)), _mm256_loadu_ps(x + k + 8), a1);
    }
    float sum = hsum(_mm256_add_ps(a0, a1));
    for (; k < n; k++) sum += bf16_to_f32(w[k]) * x[k];
    return sum;
}
