/* The quantized matmul's 512-bit pair tiles (AVX-512 BW + VNNI): x8 Q4_0, Q4_1, Q8_0, MXFP4, Q4_K and Q6_K rows against two
 * activation rows per vector. Included by quant_matmul.c after quant_matmul_avx2.h, whose helpers they use,
 * where it is compiled for them (PAIR_TILES). */
/* tile_x8 for RW weight rows and RP pairs of activation rows of x8 Q4_0 / Q4_1 / Q8_0 / MXFP4 / Q4_K, two activation rows
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
/* mx_codes at 512 bits: nibbles to MXFP4's doubled values + MX_OFFSET, one vpshufb per 128-bit lane. */
static inline __m512i mx_codes512(__m512i nibbles) {
    const __m512i values = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MX_VALUES));
    return _mm512_shuffle_epi8(_mm512_add_epi8(values, _mm512_set1_epi8(MX_OFFSET)), nibbles);
}
/* The second row of pair P: 2P + 1, or 2P again for an odd T's last row. */
static inline long pair_second(const acts *A, long P) { return 2 * P + 1 < A->T ? 2 * P + 1 : 2 * P; }
#define PWMAX 4 /* the accumulator arrays' room: quant_matmul.c's pair tiles are 4 weight rows x 1..3 pairs */
#define PPMAX 6
/* The pair tiles' sums into y: row 2P's RW outputs from the low halves, row 2P + 1's (where it is below T) from
 * the high ones, each summed as tile_x8 sums its row (hsum4_rows, or hsum). */
KV_INLINE void store_pairs(__m512 acc[][PPMAX], int RW, int RP, long P0, const acts *A, float *y, long ldy) {
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
/* Pairs P0 .. P0 + RP - 1 (rows 2 P0 .. 2 P0 + 2 RP - 1, those below T stored) against weight rows 0..RW-1 of w. */
KV_INLINE void tile_x8_pairs(int t, const wrows *R, const acts *A, long P0, int RW, int RP, float *y, long ldy) {
    const int bs = block_bytes(t), codes = x8_qs_at(t);
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
        if (t != T_Q8_0) prefetch_group(R, g, RW, RP, (int)x8_group_bytes(t)); /* (Q8_0's slabs stream faster unaided) */
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
                    __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                    if (t == T_MXFP4) lo = mx_codes512(lo), hi = mx_codes512(hi);
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
    long second[PPMAX];
    KV_UNROLL
    for (int p = 0; p < RP; p++) second[p] = pair_second(A, P0 + p);
    for (long q = 0; q < R->np; q++) { /* tail pairs, as tile_x8 sums them: row i's lanes in both halves */
        const long blk = 8 * groups + 2 * q;
        const uint8_t *G = R->tp + q * x8_group_bytes(t);
        __m512i dot[PPMAX];
        KV_UNROLL
        for (int p = 0; p < RP; p++) dot[p] = _mm512_setzero_si512();
        const __m512i halves = _mm512_setr_epi64(0, 0, 0, 0, 1, 1, 1, 1); /* row 2P's 8 bytes, then row 2P + 1's */
        const int words = t == T_Q8_0 ? 8 : 4;
        KV_UNROLL
        for (int s = 0; s < words; s++) {
            const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(G + codes + 32 * s)));
            __m512i lo = t == T_Q8_0 ? _mm512_xor_si512(v, bias) : _mm512_and_si512(v, m4);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            if (t == T_MXFP4) lo = mx_codes512(lo), hi = mx_codes512(hi);
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
            block_scales(t, R->tail + i * R->trs, n, &d, &m);
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
                u[i] = t == T_Q8_0    ? _mm512_xor_si512(both_halves(_mm256_loadu_si256((const __m256i *)block_qs(t, b))), bias)
                       : t == T_MXFP4 ? both_halves(mx_codes(nibbles16(block_qs(t, b))))
                                      : both_halves(nibbles16(block_qs(t, b)));
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
    store_pairs(acc, RW, RP, P0, A, y, ldy);
}
/* tile_x8_q6k on pairs of activation rows, as tile_x8_pairs runs tile_x8: every lane tile_x8_q6k's operations
 * in its order (each half's dots scaled apart, the -32 through the half sums h), so the same bits. */
KV_INLINE void tile_x8_q6k_pairs(const wrows *R, const acts *A, long P0, int RW, int RP, float *y, long ldy) {
    const long nb = A->nb, groups = nb / 8;
    long second[PPMAX];
    KV_UNROLL
    for (int p = 0; p < RP; p++) second[p] = pair_second(A, P0 + p);
    __m512 acc[PWMAX][PPMAX];
    KV_UNROLL
    for (int i = 0; i < RW; i++)
        KV_UNROLL
        for (int p = 0; p < RP; p++) acc[i][p] = _mm512_setzero_ps();
    for (long g = 0; g < groups; g++) {
        const uint8_t *w = R->w + g * R->gs;
        const size_t rs = R->rs;
        prefetch_group(R, g, RW, RP, sizeof(x8_q6_K));
        KV_UNROLL
        for (int half = 0; half < 2; half++) { /* values 0-15 of each sub-block, then 16-31 */
            __m512i dot[PWMAX][PPMAX];
            KV_UNROLL
            for (int i = 0; i < RW; i++)
                KV_UNROLL
                for (int p = 0; p < RP; p++) dot[i][p] = _mm512_setzero_si512();
            KV_UNROLL
            for (int s = 0; s < 4; s++) {
                __m512i u[PWMAX];
                KV_UNROLL
                for (int i = 0; i < RW; i++) u[i] = both_halves(q6k_codes((const x8_q6_K *)(w + i * rs), s, half));
                KV_UNROLL
                for (int p = 0; p < RP; p++) {
                    const __m512i a = _mm512_loadu_si512(qt_at(A, 2 * (P0 + p), 8 * g + s + 4 * half));
                    KV_UNROLL
                    for (int i = 0; i < RW; i++) dot[i][p] = _mm512_dpbusd_epi32(dot[i][p], u[i], a);
                }
            }
            KV_UNROLL
            for (int i = 0; i < RW; i++) {
                const x8_q6_K *G = (const x8_q6_K *)(w + i * rs);
                const __m128i sc = _mm_loadu_si128((const __m128i *)G->scales);
                const __m256 d0 = _mm256_set1_ps(fp16_to_f32(G->d));
                const __m512 d2 = _mm512_broadcast_f32x8(q6k_scales(G, half));
                KV_UNROLL
                for (int p = 0; p < RP; p++) {
                    const __m512 da = _mm512_loadu_ps(A->dp + pair_at(A, P0 + p, 8 * g));
                    acc[i][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][p]), _mm512_mul_ps(d2, da), acc[i][p]);
                    if (half) { /* -32 d d_a (sc_2j h0_j + sc_2j+1 h1_j), once per sub-block */
                        const __m512i h = _mm512_inserti64x4(
                            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(A->h + 2 * (2 * (P0 + p) * nb + 8 * g)))),
                            _mm256_loadu_si256((const __m256i *)(A->h + 2 * (second[p] * nb + 8 * g))), 1);
                        const __m512 hs = _mm512_cvtepi32_ps(_mm512_madd_epi16(h, both_halves(_mm256_cvtepi8_epi16(sc))));
                        const __m512 dd = _mm512_mul_ps(_mm512_broadcast_f32x8(d0), da);
                        acc[i][p] = _mm512_fnmadd_ps(_mm512_mul_ps(dd, _mm512_set1_ps(32.f)), hs, acc[i][p]);
                    }
                }
            }
        }
    }
    store_pairs(acc, RW, RP, P0, A, y, ldy);
}
/* One activation row (a decode step's) against RW x8 Q6_K rows: both halves of the 8 sub-blocks in one 512-bit
 * vector (values 0-15 in the low half, 16-31 in the high one, each shifted into place by its half's count), so
 * the codes are made and dotted once for both, where tile_x8_q6k makes them twice at 256 bits. The float work is
 * tile_x8_q6k's, in its order (half 0's product, half 1's, then the -32 term), so the same bits. */
KV_INLINE void tile_x8_q6k_one(const wrows *R, const acts *A, long t0, int RW, float *y) {
    const long nb = A->nb, groups = nb / 8;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i code_shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1); /* >> 0, >> 4 */
    const __m512i high_shift = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);  /* << 4, << 2 */
    __m256 acc[RWMAX][RTMAX];
    zero_sums(acc, RW, 1);
    for (long g = 0; g < groups; g++) {
        const uint8_t *w = R->w + g * R->gs;
        const size_t rs = R->rs;
        prefetch_group(R, g, RW, 1, sizeof(x8_q6_K));
        __m512i dot[PWMAX];
        KV_UNROLL
        for (int i = 0; i < RW; i++) dot[i] = _mm512_setzero_si512();
        KV_UNROLL
        for (int s = 0; s < 4; s++) {
            const __m512i a = pair_loadi(qt_at(A, t0, 8 * g + s), qt_at(A, t0, 8 * g + s + 4)); /* half 0's word, half 1's */
            KV_UNROLL
            for (int i = 0; i < RW; i++) {
                const x8_q6_K *G = (const x8_q6_K *)(w + i * rs);
                const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)G->ql[s]));
                const __m512i hb = _mm512_srli_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)G->qh[s / 2])), 4 * (s & 1));
                const __m512i u = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi16(v, code_shift), m4),
                                                  _mm512_and_si512(_mm512_sllv_epi16(hb, high_shift), m30));
                dot[i] = _mm512_dpbusd_epi32(dot[i], u, a);
            }
        }
        const long off = t0 * nb + 8 * g;
        const __m256 da = _mm256_loadu_ps(A->d + off);
        KV_UNROLL
        for (int i = 0; i < RW; i++) {
            const x8_q6_K *G = (const x8_q6_K *)(w + i * rs);
            const __m128i sc = _mm_loadu_si128((const __m128i *)G->scales);
            const __m256 d0 = _mm256_set1_ps(fp16_to_f32(G->d)), d_lo = q6k_scales(G, 0), d_hi = q6k_scales(G, 1);
            acc[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm512_castsi512_si256(dot[i])), _mm256_mul_ps(d_lo, da), acc[i][0]);
            acc[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm512_extracti64x4_epi64(dot[i], 1)), _mm256_mul_ps(d_hi, da), acc[i][0]);
            const __m256 hs = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(A->h + 2 * off)), _mm256_cvtepi8_epi16(sc)));
            acc[i][0] = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_mul_ps(d0, da), _mm256_set1_ps(32.f)), hs, acc[i][0]);
        }
    }
    store_sums(acc, RW, 1, y, 0);
}
