/* kvserve's decode step in one native call: every layer of a batch of decoding sequences.
 *
 * A decode step is ~10 small operations per layer (norm, four matmuls, RoPE + KV store,
 * attention, SiLU * up, residual adds); called one by one from Python each pays a dispatch, a
 * ctypes crossing and an OpenMP fork/join, which at one token cost as much as the arithmetic.
 * Here the whole forward runs inside one OpenMP parallel region: the threads stay put and meet at
 * a barrier between operations (llama.cpp's graph runner works the same way), over buffers the
 * caller allocated once. Python keeps the scheduling, the sampling and everything else, but for a greedy
 * step's argmax, made here while the logits are in the threads' caches (after a step has streamed the
 * weights through them, Python's first reads of anything run ~10x slower than warm: the sampler's argmax
 * and its torch ops took ~0.3 ms a token).
 *
 * The operations are the ones the per-op path calls (one unity build of the three kernel files):
 * quant_matmul.c's tiles (so each output row's arithmetic, and so each sequence's tokens, do not
 * depend on the batch it came in), layer_ops.c's norm and RoPE + KV store rows, and
 * paged_attention.c's work items. Activations are float32; weights are GGML quantized blocks
 * (a linear may be up to three parts of different types, as a Q4_K_M file's q/k/v are). A mixture of experts'
 * sparse layer routes each row and multiplies each chosen expert's rows together (experts_in_region).
 * With layer_ops.c's SiLU and RoPE tables, which the per-op path also runs for float32, the step
 * gives the per-op path's results bit for bit (tests/test_native_decode.py).
 */
#include <omp.h>

#include "quant_matmul.c"
#include "paged_attention.c"
/* layer_ops.c turns off fused multiply-add from here on (its rounding follows torch's). */
#include "layer_ops.c"

#define MAX_PARTS 3

/* Phases of a step. Built with -DKV_PHASES (kvserve.kernels.decode_step.library(phases=True); `python -m
 * benchmarks.step --phases`), each thread adds up, per phase, the seconds of its own work and of its wait at the
 * barrier after it: each `omp for` gets `nowait` and an explicit barrier, which keeps every result's bits. */
enum { PH_EMBED, PH_NORM, PH_QKV, PH_ROPE, PH_ATTN, PH_O_QUANT, PH_O, PH_NORM2, PH_GATE_UP, PH_SILU, PH_DOWN, PH_FINAL,
       PH_HEAD_QUANT, PH_HEAD, PH_ARGMAX, N_PHASES };
#ifdef KV_PHASES
#define PHASE_THREADS 64
static double phase_work[PHASE_THREADS][N_PHASES], phase_wait[PHASE_THREADS][N_PHASES];
static long phase_steps;
static double phase_mark[PHASE_THREADS]; /* each thread's last barrier */
#define FOR_STATIC _Pragma("omp for schedule(static) nowait")
#define FOR_DEALT _Pragma("omp for schedule(static, 1) nowait")
#define PHASE(n)                                                                              \
    do {                                                                                      \
        const int me_ = omp_get_thread_num();                                                 \
        const double t_ = omp_get_wtime();                                                    \
        phase_work[me_][n] += t_ - phase_mark[me_];                                           \
        _Pragma("omp barrier") phase_mark[me_] = omp_get_wtime();                             \
        phase_wait[me_][n] += phase_mark[me_] - t_;                                           \
    } while (0)
/* work, wait [threads, N_PHASES] seconds summed since the last call, and the steps they cover; then zeroed. */
int kvserve_phase_times(double *work, double *wait, int threads) {
    for (int t = 0; t < threads && t < PHASE_THREADS; t++)
        for (int n = 0; n < N_PHASES; n++) {
            work[t * N_PHASES + n] = phase_work[t][n], wait[t * N_PHASES + n] = phase_wait[t][n];
            phase_work[t][n] = phase_wait[t][n] = 0.0;
        }
    const long steps = phase_steps;
    phase_steps = 0;
    return (int)steps;
}
#else
#define FOR_STATIC _Pragma("omp for schedule(static)")
#define FOR_DEALT _Pragma("omp for schedule(static, 1)") /* dealt in turn: a prompt's later rows see more keys */
#define PHASE(n) ((void)0)
#endif

/* One linear layer: y[T, rows] = x[T, cols] . W^T (+ bias), W the row-wise concatenation of its parts. */
typedef struct {
    int nparts;
    int type[MAX_PARTS];  /* GGML type of each part */
    const uint8_t *w[MAX_PARTS];
    long rows[MAX_PARTS]; /* rows of each part (multiples of 16 but for the last) */
    long cols;
    long total_rows;
    const float *bias; /* [total_rows] or NULL */
} kv_linear;

/* A mixture of experts' sparse layer (Mixtral, Qwen3-MoE, gpt-oss): each row's top_k of n SwiGLU experts by the
 * router (layer_ops.c's route_row), their outputs weighted by it. n 0: the layer's MLP is dense. The experts'
 * linears may carry biases (gpt-oss's), added to their outputs before the activation and the weighting. */
typedef struct {
    int n, top_k, how;               /* how: route_row's ROUTE_* */
    long ffn;                        /* each expert's width */
    const float *router;             /* [n, hidden] */
    const float *router_bias;        /* [n] or NULL */
    const kv_linear *gate_up, *down; /* [n] each: hidden -> 2 ffn (gate rows, then up), ffn -> hidden */
} kv_experts;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    kv_linear qkv, o, gate_up, down; /* gate_up, down: nparts 0 in a sparse layer */
    void *kv; /* this layer's pool [2, Hkv, num_blocks * block_size, D] */
    void *kv_scale; /* an int8 pool's row scales [2, Hkv, num_blocks * block_size] float16, else NULL */
    const float *q_norm, *k_norm; /* [D]: each query and key head's RMSNorm before RoPE (Qwen3), else NULL */
    const float *attn_out_norm, *mlp_out_norm; /* [hidden]: Gemma's norms of the attention and MLP outputs, else NULL */
    int window;       /* this layer's sliding window (keys per query), 0: none */
    int sliding_rope; /* turned by the model's sliding_inv_freq (Gemma 3's windowed layers) */
    kv_experts experts;
    const float *sinks; /* [H]: each query head's attention sink logit (gpt-oss), else NULL */
} kv_layer;

typedef struct {
    int n_layers, hidden, H, Hkv, D, ffn;
    int kv_fmt; /* the pool's format: FMT_F32, FMT_BF16, FMT_F16, FMT_I8 */
    int block_size;
    long num_blocks;
    float eps, scale;
    int window;            /* sliding window (keys per query), 0: none */
    const float *inv_freq; /* [D / 2] */
    int embed_type;        /* GGML type of the embedding table (0: float32 rows) */
    const uint8_t *embed;
    long vocab;
    const float *final_norm;
    kv_linear lm_head; /* nparts 0: the caller runs the LM head */
    const kv_layer *layers;
    int act_levels; /* int8 levels each activation row is quantized at (quant_acts.h's quantize_input): 1 or 2 */
    const float *sliding_inv_freq; /* [D / 2]: the sliding_rope layers' frequencies, else NULL */
    float embed_scale;             /* each embedding row multiplied by it (Gemma: sqrt(hidden)), 1: none */
    int gelu;                      /* the MLP's activation: 0 SiLU, 1 tanh GELU */
    float attn_softcap;            /* > 0: attention scores soft-capped to it (Gemma 2; paged_attention.c) */
    float swiglu_alpha, swiglu_limit; /* limit > 0: the experts' clamped SwiGLU (gpt-oss; layer_ops.c) */
} kv_model;

/* Buffers for a batch of up to max_batch rows, allocated once by the caller. */
typedef struct {
    int max_batch;
    long max_context; /* scores room per thread: G * max_context floats */
    int max_threads;
    float *x, *h, *qkv, *q, *k, *att, *o, *gu, *act, *delta, *cs, *sn, *scores;
    char *acts; /* quantized activations: act_rows(levels * max_batch) * (max cols / 32) * ACT_BYTES bytes, 32-byte aligned */
    float *best_val;   /* [max_threads, max_batch]: each thread's best logit of its columns (argmax) */
    int64_t *best_idx; /* [max_threads, max_batch]: its column, -1 for none */
    float *part;       /* [max_threads, 2 max_batch, 16]: each thread's two-level products (rows_out) */
    float *cs2, *sn2;  /* [max_batch, D]: the sliding_rope layers' RoPE tables */
    char *amx;         /* kvserve_amx_work_bytes(act_levels * max_batch, amx_cols, max_threads), 64-byte aligned, or NULL */
    long amx_cols;     /* the widest input it is sized for */
    /* A mixture of experts' step, for max_batch rows of top_k experts each (R = max_batch * top_k routed rows):
     * each row's experts and weights [max_batch, top_k], the routed rows ordered by expert (their row, and
     * each row's routed rows [max_batch, top_k]), per expert (n + 1 each) the first routed row, the first work
     * chunk of gate_up and of down and the byte offsets of its activations; the routed rows' gate_up [R, 2 ffn],
     * act [R, ffn] and output [R, hidden]; the router's logits [max_threads, n]. */
    int64_t *moe_chosen;
    float *moe_weight;
    int32_t *moe_row, *moe_at;
    long *moe_first, *moe_chunk_gu, *moe_chunk_down, *moe_acts_gu, *moe_acts_down;
    float *moe_gu, *moe_act, *moe_y, *moe_logits;
    int64_t *moe_trace; /* [n_layers, max_batch, top_k]: each layer's chosen experts, kept for the caller; or NULL */
} kv_work;

/* The quantized activations' arrays for T input rows of `cols` values at `levels` each, laid over the work buffer. */
static acts acts_for(char *buf, long T, int levels, const kv_linear *L) {
    int x8 = 0;
    for (int p = 0; p < L->nparts; p++) x8 |= L->type[p] >= X8;
    return acts_over(buf, levels * T, L->cols / 32, x8);
}

/* The 16-row chunks of L's outputs (each part's apart). */
static long chunks_of(const kv_linear *L) {
    long chunks = 0;
    for (int p = 0; p < L->nparts; p++) chunks += (L->rows[p] + 15) / 16;
    return chunks;
}

/* Chunk c of L's outputs for the T rows of A into y [T, total_rows] (quant_matmul.c's rows_out), unless
 * its part's whole tiles were AMX's (skip[part]). */
static void chunk_out(const kv_linear *L, const acts *A, long T, int levels, long ta, long tb, long c, float *y, float *part,
                      const int *skip) {
    long first = 0, off = 0;
    int p = 0;
    for (; p < L->nparts; p++) { /* the part chunk c falls in */
        const long n = (L->rows[p] + 15) / 16;
        if (c < first + n) break;
        first += n;
        off += L->rows[p];
    }
    const int qt = L->type[p];
    const size_t rb = (size_t)(L->cols / block_values(qt)) * block_bytes(qt);
    const long r0 = 16 * (c - first), r1 = r0 + 16 < L->rows[p] ? r0 + 16 : L->rows[p];
    if (skip && skip[p] && r1 - r0 == 16) return;
    rows_out(qt, L->w[p], rb, A, T, levels, ta, tb, r0, r1, y + off + r0, L->total_rows, part);
}

/* Inside the parallel region, every thread calls it, once A holds the rows' quantized activations: the parts
 * AMX takes (quant_matmul_amx.h: their whole 16-row tiles), then the other 16-row chunks of every part spread
 * over the threads (the same chunks quant_matmul.c takes). */
static void matmul_in_region(const kv_linear *L, const acts *A, long T, int levels, float *y, const kv_work *ws, int phase) {
    (void)phase;
    float *part = ws->part + (size_t)omp_get_thread_num() * 2 * ws->max_batch * 16;
    int on_tiles[MAX_PARTS] = {0}; /* the parts whose whole tiles AMX made */
#ifdef KV_AMX
    if (ws->amx != NULL && L->cols <= ws->amx_cols) {
        int any = 0;
        for (int p = 0; p < L->nparts; p++) any |= on_tiles[p] = amx_takes(L->type[p], L->rows[p], A->nb, levels * T);
        if (any) {
            const long nb_max = ws->amx_cols / 32;
            uint8_t *tiles = (uint8_t *)ws->amx + (size_t)ws->max_threads * amx_thread_bytes(nb_max);
            uint8_t *mine = (uint8_t *)ws->amx + (size_t)omp_get_thread_num() * amx_thread_bytes(nb_max);
            amx_pack_in_region(A, levels * T, tiles);
            for (int p = 0, off = 0; p < L->nparts; off += L->rows[p], p++) {
                const size_t rb = (size_t)(L->cols / block_values(L->type[p])) * block_bytes(L->type[p]);
                if (on_tiles[p])
                    amx_rows_in_region(L->type[p], L->w[p], rb, A->nb, L->rows[p], levels * T, levels, tiles, y + off,
                                       L->total_rows, mine);
            }
        }
    }
#endif
    const long n = rows_per_pass(levels), chunks = chunks_of(L);
    long ta = 0;
    for (; !last_pass(ta, n, T); ta += n) { /* each thread's chunks, pass after pass (quant_matmul.c's rows_per_pass) */
#pragma omp for schedule(static) nowait
        for (long c = 0; c < chunks; c++) chunk_out(L, A, T, levels, ta, ta + n, c, y, part, on_tiles);
    }
    FOR_STATIC
    for (long c = 0; c < chunks; c++) chunk_out(L, A, T, levels, ta, T, c, y, part, on_tiles);
    PHASE(phase);
    if (L->bias) {
        FOR_STATIC
        for (long t = 0; t < T; t++)
            for (long r = 0; r < L->total_rows; r++) y[t * L->total_rows + r] += L->bias[r];
        PHASE(phase);
    }
}

/* Quantize x's rows, barrier, then the matmul. (Where one operation makes a row just before, its loop
 * quantizes the row itself, sparing a barrier: see kvserve_decode_step.) */
static void linear_in_region(const kv_linear *L, const float *x, long T, int levels, float *y, const kv_work *ws, int phase) {
    const acts A = acts_for(ws->acts, T, levels, L);
    FOR_STATIC
    for (long t = 0; t < T; t++) quantize_input(x + t * L->cols, &A, t, levels);
    PHASE(phase - 1); /* the quantize phase before each linear's */
    matmul_in_region(L, &A, T, levels, y, ws, phase);
}

/* Bytes of one expert's activations in the work buffer: n routed rows of `cols` values at `levels`, 64-byte
 * aligned so that the next expert's start where the arrays need them. */
static long group_bytes(long n, int levels, long cols) {
    return n ? (act_rows(levels * n) * (cols / 32) * ACT_BYTES + 63) / 64 * 64 : 0;
}

/* The e (0..E-1) whose span [at[e], at[e + 1]) of a non-decreasing at[0..E] holds x, at[0] <= x < at[E]. */
static int span_of(const long *at, int E, long x) {
    int lo = 0, hi = E;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (at[mid] <= x)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* One linear of every chosen expert (Ls[e]) over its routed rows, whose activations lie at acts_at[e] bytes into
 * the work buffer, into y from its first routed row on (ldy apart): the chunks of all of them in one work-shared
 * loop (chunk_at[e]: expert e's first), so each chosen expert's weights are read once, by whichever thread. */
static void experts_matmul(const kv_linear *Ls, const long *chunk_at, const long *acts_at, const long *first, int E,
                           int lv, float *y, long ldy, const kv_work *ws, float *part) {
    FOR_STATIC
    for (long c = 0; c < chunk_at[E]; c++) {
        const int e = span_of(chunk_at, E, c);
        const long n = first[e + 1] - first[e];
        const acts A = acts_for(ws->acts + acts_at[e], n, lv, &Ls[e]);
        chunk_out(&Ls[e], &A, n, lv, 0, n, c - chunk_at[e], y + (size_t)first[e] * ldy, part, NULL);
    }
}

/* y[n] += bias[n] where there is one: a biased expert's outputs, as the per-op path's linear adds them. */
static inline void add_bias(float *y, const float *bias, long n) {
    if (bias)
        for (long i = 0; i < n; i++) y[i] += bias[i];
}

/* A sparse layer's MLP for the B rows of ws->h into ws->delta, every thread calling it: each row routed
 * (route_row), the routed rows grouped by expert, then one work-shared loop over every chosen expert's
 * 16-row chunks of gate_up, SiLU * up, and one over down, so each chosen expert's weights are read once per
 * step however many rows chose it (the grouped matmul); each row's outputs weighted and added in ascending
 * expert order, as the per-op path's Experts adds them (model/llama.py). */
static void experts_in_region(const kv_model *m, const kv_experts *X, const kv_work *ws, int B, int lv, int layer) {
    const int N = m->hidden, E = X->n, k = X->top_k;
    const long F = X->ffn, R = (long)B * k;
    const long *first = ws->moe_first, *cgu = ws->moe_chunk_gu, *cdown = ws->moe_chunk_down;
    float *part = ws->part + (size_t)omp_get_thread_num() * 2 * ws->max_batch * 16;
    FOR_STATIC
    for (int t = 0; t < B; t++)
        route_row(ws->h + (size_t)t * N, X->router, X->router_bias, N, E, k, X->how, ws->moe_chosen + (size_t)t * k,
                  ws->moe_weight + (size_t)t * k, ws->moe_logits + (size_t)omp_get_thread_num() * E);
    PHASE(PH_NORM2);
#pragma omp single
    {
        long *at = ws->moe_first, fill[E];
        if (ws->moe_trace)
            memcpy(ws->moe_trace + (size_t)layer * ws->max_batch * k, ws->moe_chosen, sizeof(int64_t) * (size_t)R);
        for (int e = 0; e <= E; e++) at[e] = 0;
        for (long i = 0; i < R; i++) at[ws->moe_chosen[i] + 1]++;
        for (int e = 0; e < E; e++) at[e + 1] += at[e], fill[e] = at[e];
        for (long i = 0; i < R; i++) {
            const long g = fill[ws->moe_chosen[i]]++;
            ws->moe_row[g] = (int32_t)(i / k), ws->moe_at[i] = (int32_t)g;
        }
        ws->moe_chunk_gu[0] = ws->moe_chunk_down[0] = ws->moe_acts_gu[0] = ws->moe_acts_down[0] = 0;
        for (int e = 0; e < E; e++) {
            const long n = at[e + 1] - at[e];
            ws->moe_chunk_gu[e + 1] = ws->moe_chunk_gu[e] + (n ? chunks_of(&X->gate_up[e]) : 0);
            ws->moe_chunk_down[e + 1] = ws->moe_chunk_down[e] + (n ? chunks_of(&X->down[e]) : 0);
            ws->moe_acts_gu[e + 1] = ws->moe_acts_gu[e] + group_bytes(n, lv, N);
            ws->moe_acts_down[e + 1] = ws->moe_acts_down[e] + group_bytes(n, lv, F);
        }
    }
    FOR_STATIC
    for (long g = 0; g < R; g++) {
        const int e = span_of(first, E, g);
        const acts A = acts_for(ws->acts + ws->moe_acts_gu[e], first[e + 1] - first[e], lv, &X->gate_up[e]);
        quantize_input(ws->h + (size_t)ws->moe_row[g] * N, &A, g - first[e], lv);
    }
    PHASE(PH_NORM2);
    experts_matmul(X->gate_up, cgu, ws->moe_acts_gu, first, E, lv, ws->moe_gu, 2 * F, ws, part);
    PHASE(PH_GATE_UP);
    /* (the gate_up activations are spent: down's are laid over the same buffer) */
    FOR_STATIC
    for (long g = 0; g < R; g++) {
        const int e = span_of(first, E, g);
        float *gu = ws->moe_gu + (size_t)g * 2 * F;
        add_bias(gu, X->gate_up[e].bias, 2 * F);
        if (m->swiglu_limit > 0.f)
            clamped_swiglu_row(gu, ws->moe_act + (size_t)g * F, (int)F, m->swiglu_alpha, m->swiglu_limit);
        else
            silu_mul_row(gu, ws->moe_act + (size_t)g * F, (int)F);
        const acts A = acts_for(ws->acts + ws->moe_acts_down[e], first[e + 1] - first[e], lv, &X->down[e]);
        quantize_input(ws->moe_act + (size_t)g * F, &A, g - first[e], lv);
    }
    PHASE(PH_SILU);
    experts_matmul(X->down, cdown, ws->moe_acts_down, first, E, lv, ws->moe_y, N, ws, part);
    PHASE(PH_DOWN);
    FOR_STATIC
    for (int t = 0; t < B; t++) {
        const int64_t *chosen = ws->moe_chosen + (size_t)t * k;
        int order[k]; /* the row's slots by expert, ascending */
        for (int s = 0; s < k; s++) {
            int j = s;
            for (; j > 0 && chosen[order[j - 1]] > chosen[s]; j--) order[j] = order[j - 1];
            order[j] = s;
        }
        float *d = ws->delta + (size_t)t * N;
        for (int i = 0; i < N; i++) d[i] = 0.f;
        for (int s = 0; s < k; s++) {
            const float w = ws->moe_weight[(size_t)t * k + order[s]];
            float *y = ws->moe_y + (size_t)ws->moe_at[(size_t)t * k + order[s]] * N;
            add_bias(y, X->down[chosen[order[s]]].bias, N);
            for (int i = 0; i < N; i++) d[i] += y[i] * w;
        }
    }
    PHASE(PH_DOWN);
}

/* Row t's query heads of KV head h rotated, and its key and value stored (rope_store_group), the pool's
 * format a literal in each copy; the heads normed first where the model norms them. */
static void rope_store(const kv_model *m, const kv_layer *L, const kv_work *ws, const int64_t *slots, int t, int h,
                       long num_slots) {
    const float *cs = L->sliding_rope ? ws->cs2 : ws->cs, *sn = L->sliding_rope ? ws->sn2 : ws->sn;
    if (L->q_norm) {
        const int G = m->H / m->Hkv;
        float *row = ws->qkv + (size_t)t * (m->H + 2 * m->Hkv) * m->D;
        for (int g = h * G; g < (h + 1) * G; g++) rms_norm_head(row + (size_t)g * m->D, L->q_norm, m->D, m->eps);
        rms_norm_head(row + (size_t)(m->H + h) * m->D, L->k_norm, m->D, m->eps);
    }
#define GROUP(F) rope_store_group(ws->qkv, cs, sn, ws->q, ws->k, L->kv, L->kv_scale, slots, t, h, m->H, m->Hkv, \
                                  m->D, num_slots, 0, F)
    if (m->kv_fmt == FMT_F16)
        GROUP(FMT_F16);
    else if (m->kv_fmt == FMT_I8)
        GROUP(FMT_I8);
    else if (m->kv_fmt == FMT_F32)
        GROUP(FMT_F32);
    else
        GROUP(FMT_BF16);
#undef GROUP
}

static int linear_ok(const kv_linear *L, long cols, long rows) {
    if (L->nparts < 1 || L->nparts > MAX_PARTS || L->cols != cols || L->total_rows != rows) return 0;
    long sum = 0;
    for (int p = 0; p < L->nparts; p++) {
        if (block_bytes(L->type[p]) == 0 || cols % block_values(L->type[p]) || L->rows[p] <= 0 || !L->w[p]) return 0;
        sum += L->rows[p];
    }
    return sum == rows;
}

/* Whether logit v at column i comes before bv at bi in numpy's argmax: a NaN before any number (the
 * first NaN wins), else the larger value, and between equals the lower column; bi < 0 is none. */
static inline int ahead(float v, int64_t i, float bv, int64_t bi) {
    if (i < 0 || bi < 0) return bi < 0 && i >= 0;
    const int vn = v != v, bn = bv != bv;
    if (vn || bn) return vn && (!bn || i < bi);
    return v > bv || (v == bv && i < bi);
}

/* row[c0..c1)'s argmax as numpy's: its column (-1 when empty) and value. */
static void argmax_span(const float *row, long c0, long c1, float *val, int64_t *idx) {
    if (c0 >= c1) {
        *idx = -1, *val = 0.f;
        return;
    }
    float m = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (long c = c0; c < c1; c++) {
        m = row[c] > m ? row[c] : m;
        nan |= row[c] != row[c];
    }
    long c = c0;
    if (nan)
        while (row[c] == row[c]) c++;
    else
        while (row[c] != m) c++; /* m is one of the values (all -inf: the first) */
    *idx = c, *val = row[c];
}

/* Inside a parallel region, after the logits [B, ld] are written: each row's argmax over its first `cols`
 * logits into argmax / argmax_val. Each thread scans the columns a static schedule dealt it as the LM head's
 * 16-row chunks (still in its cache), keeping its best in best_val / best_idx [threads, stride]; then the
 * threads' bests merge, which gives the same column however the columns were dealt. */
static void argmax_in_region(const float *logits, long ld, long cols, int B, float *best_val, int64_t *best_idx,
                             long stride, int64_t *argmax, float *argmax_val) {
    const int nt = omp_get_num_threads(), me = omp_get_thread_num();
    const long chunks = (cols + 15) / 16, q = chunks / nt, r = chunks % nt;
    const long c0 = 16 * (me * q + (me < r ? me : r)), c1 = c0 + 16 * (q + (me < r));
    for (int t = 0; t < B; t++)
        argmax_span(logits + (size_t)t * ld, c0 < cols ? c0 : cols, c1 < cols ? c1 : cols,
                    best_val + (size_t)me * stride + t, best_idx + (size_t)me * stride + t);
#pragma omp barrier
    FOR_STATIC
    for (int t = 0; t < B; t++) {
        float v = 0.f;
        int64_t i = -1;
        for (int k = 0; k < nt; k++) {
            const size_t at = (size_t)k * stride + t;
            if (ahead(best_val[at], best_idx[at], v, i)) v = best_val[at], i = best_idx[at];
        }
        argmax[t] = i, argmax_val[t] = v;
    }
}

/* The same on its own, for logits [B, ld] of the caller's: 0; -1 when cols is not in 1..ld; -2 out of memory. */
int kvserve_argmax(const float *logits, int B, long ld, long cols, int64_t *argmax, float *argmax_val, int nthreads) {
    if (B <= 0 || cols < 1 || cols > ld) return B <= 0 ? 0 : -1;
    float *val = malloc(sizeof(float) * (size_t)nthreads * B);
    int64_t *idx = malloc(sizeof(int64_t) * (size_t)nthreads * B);
    if (!val || !idx) {
        free(val), free(idx);
        return -2;
    }
#pragma omp parallel num_threads(nthreads)
    argmax_in_region(logits, ld, cols, B, val, idx, B, argmax, argmax_val);
    free(val), free(idx);
    return 0;
}

/* A sparse layer the step takes: SwiGLU experts (clamped or not) of quantized weights. */
static int experts_ok(const kv_model *m, const kv_experts *X) {
    if (X->n < 1 || X->top_k < 1 || X->top_k > X->n || !X->router || X->ffn < 32 || X->ffn % 32 || m->gelu ||
        !X->gate_up || !X->down || X->how < ROUTE_SOFTMAX || X->how > ROUTE_TOP_LOGITS)
        return 0;
    for (int e = 0; e < X->n; e++)
        if (!linear_ok(&X->gate_up[e], m->hidden, 2 * X->ffn) || !linear_ok(&X->down[e], X->ffn, m->hidden))
            return 0;
    return 1;
}

/* Shapes the step takes: 0, or -1 (the caller keeps the per-op path). */
int kvserve_decode_check(const kv_model *m) {
    if (m->n_layers < 1 || m->window < 0 || m->attn_softcap < 0 || (m->gelu != 0 && m->gelu != 1) || m->hidden % 32 || m->ffn % 32 || m->D % 2 || (m->act_levels != 1 && m->act_levels != 2) ||
        attention_shapes_check(m->H, m->Hkv, m->D, FMT_F32, m->kv_fmt))
        return -1;
    if (m->embed_type != 0 && (block_bytes(m->embed_type) == 0 || m->hidden % block_values(m->embed_type))) return -1;
    const long qkv_rows = (long)(m->H + 2 * m->Hkv) * m->D;
    for (int l = 0; l < m->n_layers; l++) {
        const kv_layer *L = &m->layers[l];
        if (L->experts.n ? !experts_ok(m, &L->experts)
                         : !linear_ok(&L->gate_up, m->hidden, 2L * m->ffn) || !linear_ok(&L->down, m->ffn, m->hidden))
            return -1;
        if (!linear_ok(&L->qkv, m->hidden, qkv_rows) || !linear_ok(&L->o, (long)m->H * m->D, m->hidden) || !L->kv ||
            (m->kv_fmt == FMT_I8 && (!L->kv_scale || m->D > MAX_I8_D)) || L->window < 0 ||
            (L->sliding_rope && !m->sliding_inv_freq))
            return -1;
    }
    if (m->lm_head.nparts && !linear_ok(&m->lm_head, m->hidden, m->vocab)) return -1;
    return 0;
}

/* Row t of x: the embedding of token id (dequantized, or copied from float32 rows). */
static void embed_row(const kv_model *m, long id, float *x) {
    if (m->embed_type == 0) {
        memcpy(x, (const float *)m->embed + id * m->hidden, sizeof(float) * m->hidden);
        return;
    }
    const int bb = block_bytes(m->embed_type), bv = block_values(m->embed_type), t = base_type(m->embed_type);
    const long nb = m->hidden / bv;
    const uint8_t *row = m->embed + (size_t)id * nb * bb;
    uint8_t x8[m->embed_type >= X8 ? nb * bb : 1], plain[m->embed_type >= X8 ? nb * bb : 1]; /* an x8 row (a tied LM head's) back in the stored layout */
    if (m->embed_type >= X8) {
        slab_row(t, (uint8_t *)m->embed, m->vocab, nb, id, x8, 0);
        x8_move(t, x8, plain, nb, 0);
        row = plain;
    }
    for (long b = 0; b < nb; b++) dequant_block(t, row + b * bb, x + b * bv);
}

/* ids, positions, slots: [B] int64; tables [B, max_blocks] int32; seq_lens [B] int32.
 * Writes the final-normed hidden states into hidden [B, hidden] and, when the model has an LM
 * head here and logits is given, the logits into logits [B, vocab]; with argmax given too, each row's
 * argmax over its first argmax_cols logits (numpy's: the first NaN, else the first maximum) into
 * argmax [B] and the logit there into argmax_val [B] (a greedy sampler's whole work). Returns 0; -1 shapes the step does not take; -3
 * (nothing written) when an id, a slot, a context or a block id lies outside its range; -4 when
 * the work buffers are too small for this batch. */
int kvserve_decode_step(const kv_model *m, const kv_work *ws, int B, const int64_t *ids, const int64_t *positions,
                        const int64_t *slots, const int32_t *tables, int max_blocks, const int32_t *seq_lens,
                        float *hidden, float *logits, int64_t *argmax, float *argmax_val, long argmax_cols,
                        int nthreads) {
    if (B <= 0) return 0;
    if (B > ws->max_batch || nthreads > ws->max_threads) return -4;
    for (int l = 0; l < m->n_layers; l++)
        if (m->layers[l].experts.n && !ws->moe_y) return -4; /* no buffers for the experts */
    const long num_slots = m->num_blocks * m->block_size;
    for (int t = 0; t < B; t++)
        if (ids[t] < 0 || ids[t] >= m->vocab || slots[t] < 0 || slots[t] >= num_slots || positions[t] < 0) return -3;
    const int max_len = attention_tables_ok(tables, max_blocks, seq_lens, B, (int)m->num_blocks, m->block_size,
                                            m->window);
    if (max_len < 0) return max_len;
    if (max_len > ws->max_context) return -4;
    if (argmax && (argmax_cols < 1 || argmax_cols > m->vocab)) return -1;
    const int N = m->hidden, H = m->H, Hkv = m->Hkv, D = m->D, F = m->ffn, G = H / Hkv;
    const float eps = m->eps;
#pragma omp parallel num_threads(nthreads)
    {
        float *scores = ws->scores + (size_t)omp_get_thread_num() * G * ws->max_context;
        const int lv = m->act_levels;
#ifdef KV_PHASES
        phase_mark[omp_get_thread_num()] = omp_get_wtime();
#pragma omp single nowait
        phase_steps++;
#endif
        FOR_STATIC
        for (int t = 0; t < B; t++) {
            float *x = ws->x + (size_t)t * N;
            embed_row(m, ids[t], x);
            if (m->embed_scale != 1.f)
                for (int i = 0; i < N; i++) x[i] *= m->embed_scale;
            rope_table_row(positions[t], m->inv_freq, D, ws->cs, ws->sn, (size_t)t * D, 0);
            if (m->sliding_inv_freq) rope_table_row(positions[t], m->sliding_inv_freq, D, ws->cs2, ws->sn2, (size_t)t * D, 0);
        }
        PHASE(PH_EMBED);
        for (int l = 0; l < m->n_layers; l++) {
            const kv_layer *L = &m->layers[l];
            const float *delta_norm = l ? m->layers[l - 1].mlp_out_norm : NULL;
            /* h = norm(x + the previous layer's MLP output (normed first where the model norms it)), each row
             * quantized for qkv by its own thread */
            const acts Aqkv = acts_for(ws->acts, B, lv, &L->qkv);
            FOR_STATIC
            for (int t = 0; t < B; t++) {
                if (delta_norm) add_rms_norm_row(ws->delta, NULL, delta_norm, ws->delta, t, N, eps, 0);
                add_rms_norm_row(ws->x, l ? ws->delta : NULL, L->input_norm, ws->h, t, N, eps, 0);
                quantize_input(ws->h + (size_t)t * N, &Aqkv, t, lv);
            }
            PHASE(PH_NORM);
            matmul_in_region(&L->qkv, &Aqkv, B, lv, ws->qkv, ws, PH_QKV);
            /* q, k rotated; k and v into their slots; then attention. One row (one sequence's decode step) reads
             * no other row's new keys, so each KV head's rotations go with its attention: one barrier fewer, and
             * the rotations spread over the threads. Rows of one prompt chunk read each other's: a barrier. */
            if (B == 1) {
                FOR_STATIC
                for (int h = 0; h < Hkv; h++) {
                    rope_store(m, L, ws, slots, 0, h, num_slots);
                    attend_item(ws->q, L->kv, L->kv_scale, ws->att, tables, seq_lens[0], L->window, 0, h, H, Hkv,
                                (size_t)num_slots, m->block_size, D, m->scale, m->attn_softcap, L->sinks, FMT_F32,
                                m->kv_fmt, scores);
                }
            } else {
                FOR_STATIC
                for (int t = 0; t < B; t++)
                    for (int h = 0; h < Hkv; h++) rope_store(m, L, ws, slots, t, h, num_slots);
                PHASE(PH_ROPE);
                FOR_DEALT
                for (int item = 0; item < B * Hkv; item++) {
                    const int b = item / Hkv, h = item % Hkv;
                    attend_item(ws->q, L->kv, L->kv_scale, ws->att, tables + (size_t)b * max_blocks, seq_lens[b], L->window, b, h,
                                H, Hkv, (size_t)num_slots, m->block_size, D, m->scale, m->attn_softcap, L->sinks, FMT_F32,
                                m->kv_fmt, scores);
                }
            }
            PHASE(PH_ATTN);
            linear_in_region(&L->o, ws->att, B, lv, ws->o, ws, PH_O);
            const acts Agu = acts_for(ws->acts, B, lv, &L->gate_up);
            FOR_STATIC
            for (int t = 0; t < B; t++) {
                if (L->attn_out_norm) add_rms_norm_row(ws->o, NULL, L->attn_out_norm, ws->o, t, N, eps, 0);
                add_rms_norm_row(ws->x, ws->o, L->post_norm, ws->h, t, N, eps, 0);
                if (!L->experts.n) quantize_input(ws->h + (size_t)t * N, &Agu, t, lv);
            }
            PHASE(PH_NORM2);
            if (L->experts.n) {
                experts_in_region(m, &L->experts, ws, B, lv, l);
                continue;
            }
            matmul_in_region(&L->gate_up, &Agu, B, lv, ws->gu, ws, PH_GATE_UP);
            /* act = silu(gate) * up, or gelu(gate) * up */
            const acts Adown = acts_for(ws->acts, B, lv, &L->down);
            FOR_STATIC
            for (int t = 0; t < B; t++) {
                if (m->gelu)
                    gelu_mul_row(ws->gu + (size_t)t * 2 * F, ws->act + (size_t)t * F, F);
                else
                    silu_mul_row(ws->gu + (size_t)t * 2 * F, ws->act + (size_t)t * F, F);
                quantize_input(ws->act + (size_t)t * F, &Adown, t, lv);
            }
            PHASE(PH_SILU);
            matmul_in_region(&L->down, &Adown, B, lv, ws->delta, ws, PH_DOWN);
        }
        const float *last_norm = m->layers[m->n_layers - 1].mlp_out_norm;
        FOR_STATIC
        for (int t = 0; t < B; t++) {
            if (last_norm) add_rms_norm_row(ws->delta, NULL, last_norm, ws->delta, t, N, eps, 0);
            add_rms_norm_row(ws->x, ws->delta, m->final_norm, hidden, t, N, eps, 0);
        }
        PHASE(PH_FINAL);
        if (m->lm_head.nparts && logits) {
            linear_in_region(&m->lm_head, hidden, B, lv, logits, ws, PH_HEAD);
            if (argmax) {
                argmax_in_region(logits, m->vocab, argmax_cols, B, ws->best_val, ws->best_idx, ws->max_batch, argmax, argmax_val);
                PHASE(PH_ARGMAX);
            }
        }
    }
    return 0;
}
