/* The x8 weight layout: rows repacked at load into x8 groups (quant_blocks.h), rows in slabs of four.
 * Included by quant_matmul.c after the ISA selection (PAIR_TILES, KV_AVX2 decide two layout details).
 *
 * An x8 row: its whole groups of 8 blocks (a K-quant: one group per super-block), then the blocks past
 * the last whole group (its tail) as stored. A row keeps its size, so rows can still be sliced and fused.
 *
 * Slabs: the x8 rows of a matrix in fours, each four's bytes (4 rows' worth) holding group 0 of its rows
 * 0..3, then group 1 of rows 0..3, ..., then the four rows' tail pairs (one group each, below), then the
 * rest of their tails one row after another. A tile of 4 rows then reads one stream of memory front to
 * back, which the hardware prefetcher follows at full speed (four streams of separate rows it does not).
 * The last rows % 4 rows stay one after another.
 *
 * Tail pairs (SIMD builds, in a slab): the tail blocks taken two at a time, blocks 2p and 2p + 1 of the 4
 * rows packed as one x8 group, lane 2i + j holding row i's block 2p + j. A tile sums its rows' tails in a
 * group's arithmetic, one group for 4 rows, where summed block by block (acc32) the 2-block tail of a
 * 576-wide row made it cost more than a 768-wide one. An odd tail's last block stays as stored. */

/* Rows in a slab: 4, as many as the tiles take at one token and, for every type but Q8_0, in batches.
 * Q8_0's batches run as pair tiles where the build has them (PAIR_TILES), which take 4-row slabs too;
 * without them they run as 2-row tiles, which would read half of each group of a 4-row slab, so Q8_0's
 * rows stay one after another there (a slab of 1). */
static inline long slab_rows(int t) {
#ifdef PAIR_TILES
    (void)t;
    return 4;
#else
    return t == T_Q8_0 ? 1 : 4;
#endif
}
/* Whether row r of an x8 matrix of t with `rows` rows lies in a whole slab. */
static inline int x8_slab(int t, long r, long rows) { return slab_rows(t) > 1 && (r & ~(slab_rows(t) - 1)) + slab_rows(t) <= rows; }

/* An x8 row's groups, a group's bytes, and its tail blocks (none for a K-quant). nb: blocks of t a row. */
static inline long x8_groups(int t, long nb) { return k_type(t) ? nb : nb / 8; }
static inline size_t x8_group_bytes(int t) { return (k_type(t) ? 1 : 8) * (size_t)block_bytes(t); }
static inline long x8_tail_blocks(int t, long nb) { return k_type(t) ? 0 : nb % 8; }
/* Tail pairs of a row in a slab: the SIMD builds'; plain C keeps every tail as stored. */
#ifdef KV_AVX2
static inline long tail_pairs(int t, long nb) { return x8_tail_blocks(t, nb) / 2; }
#else
static inline long tail_pairs(int t, long nb) { (void)t, (void)nb; return 0; }
#endif

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

/* ---- packing: stored blocks <-> x8 groups ---------------------------------------------------------- */
/* n bytes from a stored block's field into an x8 group's (pack), or back. */
static inline void x8_copy(int pack, void *in_group, const void *in_block, size_t n) {
    memcpy(pack ? in_group : (void *)in_block, pack ? in_block : in_group, n);
}
/* Lane j of the x8 group G (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 or MXFP4) from the stored block b (pack), or back into b:
 * its d (MXFP4: e) to d[j] (e[j]), its m to m[j], its fifth bits to qh[j], its 4-byte words w to bytes 4j.. of word w. */
static void x8_lane(int t, uint8_t *G, int j, uint8_t *b, int pack) {
    if (t == T_MXFP4) x8_copy(pack, &((x8_mxfp4 *)G)->e[j], &((block_mxfp4 *)b)->e, 1);
    else x8_copy(pack, &((x8_q4_0 *)G)->d[j], &((block_q4_0 *)b)->d, 2); /* d leads every other type */
    if (t == T_Q4_1 || t == T_Q5_1) x8_copy(pack, &((x8_q4_1 *)G)->m[j], &((block_q4_1 *)b)->m, 2); /* m follows it in both */
    if (t == T_Q5_0 || t == T_Q5_1) x8_copy(pack, G + x8_qh_at(t) + 4 * j, block_qh(t, b), 4);
    for (int w = 0; w < (t == T_Q8_0 ? 8 : 4); w++) x8_copy(pack, G + x8_qs_at(t) + 32 * w + 4 * j, block_qs(t, b) + 4 * w, 4);
}
/* nb blocks of t (K-quants: super-blocks) from the stored layout at src into x8 groups at dst (pack), or back. */
static void x8_move(int t, const uint8_t *src, uint8_t *dst, long nb, int pack) {
    uint8_t *stored = pack ? (uint8_t *)src : dst, *x8 = pack ? dst : (uint8_t *)src; /* (src is only read) */
    if (t == T_Q6_K) {
        for (long sb = 0; sb < nb; sb++) {
            block_q6_K *s = (block_q6_K *)stored + sb;
            x8_q6_K *x = (x8_q6_K *)x8 + sb;
            if (pack) {
                x->d = s->d, memcpy(x->scales, s->scales, 16);
                memset(x->qh, 0, sizeof x->qh), memset(x->ql, 0, sizeof x->ql); /* (bits are ORed in) */
            } else {
                s->d = x->d, memcpy(s->scales, x->scales, 16);
                memset(s->ql, 0, sizeof s->ql), memset(s->qh, 0, sizeof s->qh);
            }
            for (int j = 0; j < 8; j++) {
                const int h = j / 4, g = j % 4, lsh = 4 * (g / 2), hsh = 2 * g; /* sub-block j: 32 h + 8 g.. (quant_blocks.h) */
                for (int v = 0; v < 32; v++) {
                    uint8_t *ql = &s->ql[64 * h + 32 * (g % 2) + v], *qh = &s->qh[32 * h + v];
                    const int b = v % 4, w = (v % 16) / 4, upper = v >= 16; /* nibble word w, byte b, high nibble if upper */
                    uint8_t *xl = &x->ql[w][4 * j + b], *xh = &x->qh[w / 2][4 * j + b];
                    const int xsh = 4 * upper, xhsh = 4 * (w % 2) + 2 * upper;
                    if (pack) {
                        *xl |= (uint8_t)(((*ql >> lsh) & 15) << xsh);
                        *xh |= (uint8_t)(((*qh >> hsh) & 3) << xhsh);
                    } else {
                        *ql |= (uint8_t)(((*xl >> xsh) & 15) << lsh);
                        *qh |= (uint8_t)(((*xh >> xhsh) & 3) << hsh);
                    }
                }
            }
        }
        return;
    }
    if (t == T_Q4_K || t == T_Q5_K) { /* the header as stored; sub-block j's codes and fifth bits to lane j */
        const int five = t == T_Q5_K;
        const size_t bs = block_bytes(t), head = offsetof(block_q4_K, qs); /* d, dmin, scales (Q5_K's too) */
        for (long sb = 0; sb < nb; sb++) {
            uint8_t *s = stored + sb * bs, *x = x8 + sb * bs;
            uint8_t *sqs = five ? ((block_q5_K *)s)->qs : ((block_q4_K *)s)->qs, *sqh = ((block_q5_K *)s)->qh;
            uint8_t(*xqs)[32] = five ? ((x8_q5_K *)x)->qs : ((x8_q4_K *)x)->qs, (*xqh)[4] = ((x8_q5_K *)x)->qh;
            memcpy(pack ? x : s, pack ? s : x, head);
            memset((pack ? x : s) + head, 0, bs - head); /* (bits and nibbles are ORed in) */
            for (int j = 0; j < 8; j++) {
                for (int v = 0; five && v < 32; v++) { /* value v's fifth bit: bit j of qh[v] stored, bit v % 8 of qh[j][v / 8] in x8 */
                    if (pack) xqh[j][v / 8] |= (uint8_t)(((sqh[v] >> j) & 1) << (v % 8));
                    else sqh[v] |= (uint8_t)(((xqh[j][v / 8] >> (v % 8)) & 1) << j);
                }
                for (int b = 0; b < 16; b++) { /* x8 byte b of lane j: values b (low) and 16 + b; stored: nibble j & 1 */
                    uint8_t *xb = &xqs[b / 4][4 * j + b % 4], *q = &sqs[32 * (j / 2) + b];
                    const int sh = 4 * (j & 1);
                    if (pack) *xb = (uint8_t)(((q[0] >> sh) & 15) | ((q[16] >> sh) & 15) << 4);
                    else {
                        q[0] |= (uint8_t)((*xb & 15) << sh);
                        q[16] |= (uint8_t)((*xb >> 4) << sh);
                    }
                }
            }
        }
        return;
    }
    const int bs = block_bytes(t);
    for (long g = 0; g + 8 <= nb; g += 8)
        for (int j = 0; j < 8; j++) x8_lane(t, x8 + g * bs, j, stored + (g + j) * bs, pack);
    const long tail = nb / 8 * 8;
    memcpy(dst + tail * bs, src + tail * bs, (size_t)(nb - tail) * bs);
}

/* Copies row r of an x8 matrix m (nb blocks of t a row, in slabs) into a one-row buffer in the x8 layout,
 * or from it (put != 0). */
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
