/* kvfold native kernels: the token-parallel halves of a DeepSeek-V4 attention layer for M rows,
 * one call each (models/deepseek_v4/native_attention.py enters them). Included at the end of
 * native.c, after the kernels it composes.
 *
 * Each half is the per-op path's native calls (Attention._project, and the output's de-rotation
 * and projections) on the same values: the matrices as kv_matmul / kv_matmul_weights compute them
 * (those that read the same finished input share one parallel region, weights_many), kv_rms_norm,
 * kv_rope, and the IEEE adds and multiplies torch makes of the bias and scale steps. So every
 * output equals the per-op path's bit for bit by construction, and each row is computed on its
 * own, as there. The fusion removes only the Python, dispatch and fork-join work between the steps.
 */
#ifndef KV_NATIVE_ATTENTION_H
#define KV_NATIVE_ATTENTION_H

static inline int64_t mm_threads(int64_t m, int64_t n, int64_t k, int64_t threads) {
    return m * n * k < KV_SERIAL_MACS ? 1 : threads;
}

/* one compressor's projections: kv = x Wkv^T, score = x Wgate^T + bias[position mod ratio] */
typedef struct {
    const kv_weights *kv, *gate; /* [cols, hid] each; kv NULL: no such compressor */
    const float *bias;           /* [ratio, cols] */
    int64_t cols, ratio;
} compressor_proj;

typedef struct {
    int64_t hid, q_rank, heads, head_dim, half; /* half: rope pairs per head */
    double eps;
    const kv_weights *q_a, *q_b, *kv;
    const float *q_norm, *kv_norm;
    compressor_proj comp, index; /* the attention's compressor, the indexer's own */
    const kv_weights *index_q_b, *index_w; /* index queries [IH * Id, q_rank], head weights [IH, hid] */
    int64_t index_heads, index_dim;
    double index_w_scale;
    int64_t threads;
} attn_project_layer;

/* threads for a parallel region of these jobs: one below KV_SERIAL_MACS in all */
static inline int64_t jobs_threads(const mm_job *jobs, int count, int64_t threads) {
    int64_t macs = 0;
    for (int j = 0; j < count; j++) macs += jobs[j].m * jobs[j].n * jobs[j].w->k;
    return mm_threads(1, macs, 1, threads);
}

/* a compressor's two projections of x, as jobs */
static int compressor_jobs(const compressor_proj *c, const float *x, int64_t m, int64_t hid, float *kv, float *score,
                           mm_job *jobs) {
    jobs[0] = (mm_job){x, hid, c->kv, 0, kv, c->cols, m, c->cols};
    jobs[1] = (mm_job){x, hid, c->gate, 0, score, c->cols, m, c->cols};
    return 2;
}

/* score += bias[position mod ratio], row by row */
static void add_position_bias(const compressor_proj *c, int64_t m, const int64_t *pos, float *score) {
    const int64_t n = c->cols;
    for (int64_t r = 0; r < m; r++) {
        const float *b = c->bias + (pos[r] % c->ratio) * n;
        float *s = score + r * n;
        for (int64_t i = 0; i < n; i++) s[i] = s[i] + b[i];
    }
}

/* A layer's projected rows: what kv_attn_project writes for m rows, or kv_attn_sequence_one reads
 * of one (an absent part's pointers are not read or written; NULL will do). */
typedef struct {
    float *q, *kv;                /* [m, heads, head_dim], [m, head_dim] */
    float *comp_kv, *comp_score;  /* the compressor's rows [m, cols] */
    float *index_kv, *index_score; /* the indexer's compressor's rows [m, cols] */
    float *index_q, *index_w;     /* index queries [m, IH, Id] and head weights [m, IH] */
} attn_rows;

/* Attention._project for m rows x [m, hid] at positions pos [m] (cos, sin [m, half]), into out:
 *   q_lora = rms_norm(x Wqa^T) * q_norm                                  [m, q_rank]
 *   q      = rope(rms_norm per head(q_lora Wqb^T))                       [m, heads, head_dim]
 *   kv     = rope(rms_norm(x Wkv^T) * kv_norm)                           [m, head_dim]
 *   the compressor's and the indexer's (kv, score) rows                  [m, cols]
 *   index queries rope(q_lora Wiq^T) [m, IH, Id] and head weights (x Wiw^T) * scale [m, IH].
 * Outputs of an absent part are not written. Returns 0, or -1 when a buffer cannot be allocated. */
int kv_attn_project(const attn_project_layer *L, const float *x, int64_t m, const int64_t *pos, const float *cs,
                    const float *sn, const attn_rows *out) {
    float *q = out->q, *kv = out->kv, *comp_kv = out->comp_kv, *comp_score = out->comp_score;
    float *index_kv = out->index_kv, *index_score = out->index_score, *index_q = out->index_q;
    float *index_w = out->index_w;
    int64_t hid = L->hid, qr = L->q_rank, hd = L->heads * L->head_dim, th = L->threads;
    int64_t ih = L->index_heads, iq = ih * L->index_dim;
    float *q_lora = malloc(sizeof(float) * (size_t)(m * qr + 1));
    if (!q_lora) return -1;
    /* every matrix that reads x in one parallel region, then both that read q_lora */
    mm_job from_x[7], from_q[2];
    int nx = 0, nq = 0;
    from_x[nx++] = (mm_job){x, hid, L->q_a, 0, q_lora, qr, m, qr};
    from_x[nx++] = (mm_job){x, hid, L->kv, 0, kv, L->head_dim, m, L->head_dim};
    if (L->comp.kv) nx += compressor_jobs(&L->comp, x, m, hid, comp_kv, comp_score, from_x + nx);
    if (L->index.kv) {
        nx += compressor_jobs(&L->index, x, m, hid, index_kv, index_score, from_x + nx);
        from_x[nx++] = (mm_job){x, hid, L->index_w, 0, index_w, ih, m, ih};
    }
    int rc = weights_many(from_x, nx, jobs_threads(from_x, nx, th));
    kv_rms_norm(q_lora, L->q_norm, q_lora, m, qr, L->eps);
    from_q[nq++] = (mm_job){q_lora, qr, L->q_b, 0, q, hd, m, hd};
    if (L->index.kv) from_q[nq++] = (mm_job){q_lora, qr, L->index_q_b, 0, index_q, iq, m, iq};
    rc |= weights_many(from_q, nq, jobs_threads(from_q, nq, th));
    kv_rms_norm(q, NULL, q, m * L->heads, L->head_dim, L->eps);
    rope_rows(q, cs, sn, q, m, L->heads, L->head_dim, L->half, 0);
    kv_rms_norm(kv, L->kv_norm, kv, m, L->head_dim, L->eps);
    rope_rows(kv, cs, sn, kv, m, 1, L->head_dim, L->half, 0);
    if (L->comp.kv) add_position_bias(&L->comp, m, pos, comp_score);
    if (L->index.kv) {
        add_position_bias(&L->index, m, pos, index_score);
        rope_rows(index_q, cs, sn, index_q, m, ih, L->index_dim, L->half, 0);
        float scale = (float)L->index_w_scale; /* torch multiplies an fp32 tensor by a scalar in fp32 */
        for (int64_t i = 0; i < m * ih; i++) index_w[i] = index_w[i] * scale;
    }
    free(q_lora);
    return rc ? -1 : 0;
}

typedef struct {
    int64_t hid, heads, head_dim, half, groups, rank; /* rank: outputs per group of wo_a */
    const kv_weights *o_a;                            /* `groups` descriptors, group g's rows of wo_a */
    const kv_weights *o_b;                            /* [hid, groups * rank] */
    int64_t threads;
} attn_output_layer;

/* The attention's output for m rows: de-rotate each head's rope dims (o [m, heads, head_dim]),
 * group g's heads through its rows of wo_a, then wo_b: out [m, hid]. Returns 0, or -1 when a
 * buffer cannot be allocated. */
int kv_attn_output(const attn_output_layer *L, const float *o, int64_t m, const float *cs, const float *sn,
                   float *out) {
    int64_t hd = L->heads * L->head_dim, g = L->groups, per_in = hd / g, gr = g * L->rank, th = L->threads;
    float *rot = malloc(sizeof(float) * (size_t)(m * hd + 1));
    float *grouped = malloc(sizeof(float) * (size_t)(m * gr + 1));
    int rc = !rot || !grouped;
    if (!rc) {
        rope_rows(o, cs, sn, rot, m, L->heads, L->head_dim, L->half, 1);
        mm_job groups[MM_MAX_JOBS]; /* the groups of wo_a, up to MM_MAX_JOBS a parallel region */
        for (int64_t g0 = 0; g0 < g; g0 += MM_MAX_JOBS) {
            const int count = (int)(g - g0 < MM_MAX_JOBS ? g - g0 : MM_MAX_JOBS);
            for (int j = 0; j < count; j++) {
                const int64_t i = g0 + j;
                groups[j] = (mm_job){rot + i * per_in, hd, &L->o_a[i], 0, grouped + i * L->rank, gr, m, L->rank};
            }
            rc |= weights_many(groups, count, jobs_threads(groups, count, th)) != 0;
        }
        rc |= weights_matmul(grouped, gr, L->o_b, 0, out, L->hid, m, L->hid, mm_threads(m, L->hid, gr, th));
    }
    free(rot);
    free(grouped);
    return rc ? -1 : 0;
}

/* ---- one sequence's decode row: folds, selection, attention, window write -------------------------
 * Attention._one_sequence for a single row at position `start`, on fp32 state held as plain rows:
 * the same kernels in the same order (kv_pool_windows, kv_rms_norm, kv_rope, kv_index_topk_one,
 * kv_attend_one) and the same row copies, so the state and the output get the per-op path's bits. */
typedef struct {
    float *kv, *score;    /* position rings [rows, cols]: position p at row p mod rows */
    int64_t rows, cols, ratio, overlap;
    float *pool;          /* entries [*, width]: entry w at row phys[w] (phys NULL: row w) */
    const int64_t *phys;
    int64_t width;
    const float *norm;    /* the entry norm's weight */
    double eps;
} fold_state;

typedef struct {
    float *window;        /* the window ring [window_rows, head_dim] */
    int64_t window_rows, window_len, heads, head_dim, half, topk;
    int64_t kind;         /* 0 sliding, 1 CSA, 2 HCA */
    double q_scale;
    const float *sinks;
    fold_state comp, index;
    int64_t index_heads, index_dim;
    int64_t threads;      /* the selection's scores and the attention's heads split over these */
} sequence_layer;

/* The compressor's step for the row (kv, score) at position p: when p closes window w, pool its
 * slots (the rows of positions from w*r, or w*r - r with overlap, to p; positions before 0 are
 * kv 0, score -inf), norm, rotate by (cs, sn) and write entry w; then write the row to the rings. */
static int fold_one(const fold_state *F, int64_t p, const float *kv, const float *score, const float *cs,
                    const float *sn, int64_t half) {
    int64_t r = F->ratio, cols = F->cols;
    if ((p + 1) % r == 0) {
        int64_t w = p / r, base = w * r - (F->overlap ? r : 0), n = p + 1 - base;
        float *rows_kv = malloc(sizeof(float) * (size_t)(2 * n * cols + F->width));
        if (!rows_kv) return -1;
        float *rows_sc = rows_kv + n * cols, *entry = rows_sc + n * cols;
        for (int64_t i = 0; i < n; i++) {
            int64_t q = base + i;
            float *dk = rows_kv + i * cols, *ds = rows_sc + i * cols;
            if (q < 0) {
                for (int64_t j = 0; j < cols; j++) { dk[j] = 0.0f; ds[j] = -INFINITY; }
            } else {
                const float *sk = q == p ? kv : F->kv + (q % F->rows) * cols;
                const float *ss = q == p ? score : F->score + (q % F->rows) * cols;
                memcpy(dk, sk, sizeof(float) * (size_t)cols);
                memcpy(ds, ss, sizeof(float) * (size_t)cols);
            }
        }
        int rc = kv_pool_windows(rows_kv, rows_sc, 1, r, cols, (int)F->overlap, entry);
        if (rc == 0) {
            kv_rms_norm(entry, F->norm, entry, 1, F->width, F->eps);
            float *dst = F->pool + (F->phys ? F->phys[w] : w) * F->width;
            rope_rows(entry, cs, sn, dst, 1, 1, F->width, half, 0);
        }
        free(rows_kv);
        if (rc != 0) return -1;
    }
    memcpy(F->kv + (p % F->rows) * cols, kv, sizeof(float) * (size_t)cols);
    memcpy(F->score + (p % F->rows) * cols, score, sizeof(float) * (size_t)cols);
    return 0;
}

/* The row at position `start`: in, one row of kv_attn_project's (q unscaled); (cs, sn) the rope of
 * the entry a closing window emits (NULL when none closes). Writes out [heads, head_dim].
 * Returns 0, or -1 when a buffer cannot be allocated (then the state may be part-written: the
 * caller's refusals all come before this call). */
int kv_attn_sequence_one(const sequence_layer *S, int64_t start, const attn_rows *in, const float *cs,
                         const float *sn, float *out) {
    const float *q = in->q, *kv = in->kv;
    int64_t d = S->head_dim, hd = S->heads * d, n_comp = 0;
    const fold_state *C = S->kind ? &S->comp : NULL;
    if (C && fold_one(C, start, in->comp_kv, in->comp_score, cs, sn, S->half) != 0) return -1;
    if (S->kind == 1 && fold_one(&S->index, start, in->index_kv, in->index_score, cs, sn, S->half) != 0) return -1;
    int64_t n_entries = C ? (start + 1) / C->ratio : 0;
    int64_t k = S->kind == 1 ? (S->topk < n_entries ? S->topk : n_entries) : n_entries;
    int64_t prev = start - S->window_len + 1 > 0 ? start - S->window_len + 1 : 0, n_ring = start - prev;
    const int64_t keys = n_ring + 1 + k, logits = S->heads * keys; /* kv_attend_one's scratch */
    float *qs = malloc(sizeof(float) * (size_t)(hd + (logits > n_entries ? logits : n_entries) + 1));
    int64_t *sel = malloc(sizeof(int64_t) * (size_t)(k + 1));
    if (!qs || !sel) { free(qs); free(sel); return -1; }
    float *scratch = qs + hd;
    if (S->kind == 1 && k > 0) {
        const index_query Q = {in->index_q, in->index_w, S->index_heads, S->index_dim};
        kv_index_topk_one(&Q, S->index.pool, S->index.phys, n_entries, k, sel, scratch, S->threads);
    }
    if (S->kind) n_comp = k;
    float scale = (float)S->q_scale; /* torch scales an fp32 tensor by a Python float in fp32 */
    for (int64_t i = 0; i < hd; i++) qs[i] = q[i] * scale;
    int64_t a = prev % S->window_rows, first = n_ring < S->window_rows - a ? n_ring : S->window_rows - a;
    const attend_keys K = {{S->window + a * d, S->window, kv}, {first, n_ring - first, 1}, C ? C->pool : NULL,
                           C ? C->phys : NULL, S->kind == 1 ? sel : NULL, n_comp};
    kv_attend_one(qs, S->heads, d, &K, S->sinks, out, scratch, S->threads);
    memcpy(S->window + (start % S->window_rows) * d, kv, sizeof(float) * (size_t)d);
    free(qs);
    free(sel);
    return 0;
}

#endif
