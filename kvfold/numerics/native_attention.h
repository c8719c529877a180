/* kvfold native kernels: the token-parallel halves of a DeepSeek-V4 attention layer for M rows,
 * one call each (models/deepseek_v4/native_attention.py enters them). Included at the end of
 * native.c, after the kernels it composes.
 *
 * Each half is the per-op path's sequence of native calls (Attention._project, and the output's
 * de-rotation and projections), in the same order on the same values: weights_matmul as
 * kv_matmul / kv_matmul_weights run it, kv_rms_norm, kv_rope, and the IEEE adds and multiplies
 * torch makes of the bias and scale steps. So every output equals the per-op path's bit for bit
 * by construction, and each row is computed on its own, as there. The fusion removes only the
 * Python and dispatch work between the steps.
 */
#ifndef KV_NATIVE_ATTENTION_H
#define KV_NATIVE_ATTENTION_H

#define KV_SERIAL_MACS (1 << 17) /* numerics/rows.py's _SERIAL_MACS: a smaller matmul runs on one thread */

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

static int project_compressor(const compressor_proj *c, const float *x, int64_t m, int64_t hid,
                              const int64_t *pos, int64_t threads, float *kv, float *score) {
    int64_t n = c->cols, t = mm_threads(m, n, hid, threads);
    int rc = weights_matmul(x, hid, c->kv, 0, kv, n, m, n, t);
    rc |= weights_matmul(x, hid, c->gate, 0, score, n, m, n, t);
    for (int64_t r = 0; r < m; r++) {
        const float *b = c->bias + (pos[r] % c->ratio) * n;
        float *s = score + r * n;
        for (int64_t i = 0; i < n; i++) s[i] = s[i] + b[i];
    }
    return rc;
}

/* Attention._project for m rows x [m, hid] at positions pos [m] (cos, sin [m, half]):
 *   q_lora = rms_norm(x Wqa^T) * q_norm                                  [m, q_rank]
 *   q      = rope(rms_norm per head(q_lora Wqb^T))                       [m, heads, head_dim]
 *   kv     = rope(rms_norm(x Wkv^T) * kv_norm)                           [m, head_dim]
 *   the compressor's and the indexer's (kv, score) rows                  [m, cols]
 *   index queries rope(q_lora Wiq^T) [m, IH, Id] and head weights (x Wiw^T) * scale [m, IH].
 * Outputs of an absent part are not written. Returns 0, or -1 when a buffer cannot be allocated. */
int kv_attn_project(const attn_project_layer *L, const float *x, int64_t m, const int64_t *pos, const float *cs,
                    const float *sn, float *q, float *kv, float *comp_kv, float *comp_score, float *index_kv,
                    float *index_score, float *index_q, float *index_w) {
    int64_t hid = L->hid, qr = L->q_rank, hd = L->heads * L->head_dim, th = L->threads;
    float *q_lora = malloc(sizeof(float) * (size_t)(m * qr + 1));
    if (!q_lora) return -1;
    int rc = weights_matmul(x, hid, L->q_a, 0, q_lora, qr, m, qr, mm_threads(m, qr, hid, th));
    kv_rms_norm(q_lora, L->q_norm, q_lora, m, qr, L->eps);
    rc |= weights_matmul(q_lora, qr, L->q_b, 0, q, hd, m, hd, mm_threads(m, hd, qr, th));
    kv_rms_norm(q, NULL, q, m * L->heads, L->head_dim, L->eps);
    kv_rope(q, cs, sn, q, m, L->heads, L->head_dim, L->half, 0);
    rc |= weights_matmul(x, hid, L->kv, 0, kv, L->head_dim, m, L->head_dim, mm_threads(m, L->head_dim, hid, th));
    kv_rms_norm(kv, L->kv_norm, kv, m, L->head_dim, L->eps);
    kv_rope(kv, cs, sn, kv, m, 1, L->head_dim, L->half, 0);
    if (L->comp.kv) rc |= project_compressor(&L->comp, x, m, hid, pos, th, comp_kv, comp_score);
    if (L->index.kv) {
        rc |= project_compressor(&L->index, x, m, hid, pos, th, index_kv, index_score);
        int64_t ih = L->index_heads, iq = ih * L->index_dim;
        rc |= weights_matmul(q_lora, qr, L->index_q_b, 0, index_q, iq, m, iq, mm_threads(m, iq, qr, th));
        kv_rope(index_q, cs, sn, index_q, m, ih, L->index_dim, L->half, 0);
        rc |= weights_matmul(x, hid, L->index_w, 0, index_w, ih, m, ih, mm_threads(m, ih, hid, th));
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
        kv_rope(o, cs, sn, rot, m, L->heads, L->head_dim, L->half, 1);
        for (int64_t i = 0; i < g; i++)
            rc |= weights_matmul(rot + i * per_in, hd, &L->o_a[i], 0, grouped + i * L->rank, gr, m, L->rank,
                                 mm_threads(m, L->rank, per_in, th));
        rc |= weights_matmul(grouped, gr, L->o_b, 0, out, L->hid, m, L->hid, mm_threads(m, L->hid, gr, th));
    }
    free(rot);
    free(grouped);
    return rc ? -1 : 0;
}

#endif
