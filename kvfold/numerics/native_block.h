/* kvfold native kernels: a whole DeepSeek-V4 block for one sequence's decode row, one call
 * (models/deepseek_v4/native_block.py enters it). Included at the end of native.c, after the
 * kernels it composes.
 *
 * It is Block.forward's sequence of native calls for that row, in the same order on the same
 * values: the attention's mHC collapse (kv_hc_collapse) and input norm (kv_rms_norm), the
 * attention's projections (kv_attn_project), its decode row (kv_attn_sequence_one: folds,
 * selection, attention, window write) and output (kv_attn_output), the expand (kv_hc_expand), the
 * MoE's collapse and norm, the MoE row (moe_row, as kv_moe_rows runs it) and the last expand. So
 * the streams and the state get the per-op path's bits by construction; the fusion removes only
 * the Python between the calls.
 */
#ifndef KV_NATIVE_BLOCK_H
#define KV_NATIVE_BLOCK_H

/* one sub-block's entry: its HyperConnection's parameters and its input RMSNorm */
typedef struct {
    const float *fn, *base, *scale;
    int64_t iters;
    double hc_eps, norm_eps;
    const float *norm;
    double eps;
} hc_entry;

typedef struct {
    int64_t hc, hid;
    hc_entry attn, ffn;
    const attn_project_layer *project;
    const attn_output_layer *output;
    const moe_layer *moe;
    int64_t moe_threads;
} block_layer;

/* x = norm(sum_k pre_k * stream_k), with the expand's post and comb */
static int collapse_norm(const hc_entry *H, const float *streams, int64_t hc, int64_t hid, float *x, float *post,
                         float *comb) {
    if (kv_hc_collapse(streams, H->fn, H->base, H->scale, 1, hc, hid, H->iters, H->hc_eps, H->norm_eps, x, post,
                       comb) != 0)
        return -1;
    kv_rms_norm(x, H->norm, x, 1, hid, H->eps); /* in place: the row's scale is read before any write */
    return 0;
}

/* The block for the row at position `start` (token id *token): streams [hc, hid] -> out [hc, hid].
 * (cs, sn): the layer's rope at `start`; (emit_cs, emit_sn): the rope of the entry a closing
 * window emits (NULL when none closes). The routing arguments moe_row would refuse are checked
 * first, so a refusal (-2) writes nothing; -1: a buffer could not be allocated (the state may
 * then be part-written, as with kv_attn_sequence_one). */
/* whether kv_block_decode_one would refuse B before writing anything (the routing arguments
 * moe_row checks, the mHC width) */
static int block_refuses(const block_layer *B) {
    const moe_layer *M = B->moe;
    return B->hc < 1 || B->hc > HC_MAX || M->k < 1 || M->k > MOE_MAX_K || M->k > M->e || M->n_group < 1
           || M->n_group > MOE_MAX_GROUPS || M->e % M->n_group || M->topk_group < 1 || M->topk_group > M->n_group;
}

int kv_block_decode_one(const block_layer *B, const sequence_layer *S, int64_t start, const int64_t *token,
                        const float *cs, const float *sn, const float *emit_cs, const float *emit_sn,
                        const float *streams, float *out) {
    const attn_project_layer *P = B->project;
    const moe_layer *M = B->moe;
    int64_t hc = B->hc, hid = B->hid, hd = P->heads * P->head_dim;
    if (block_refuses(B)) return -2;
    int64_t cc = P->comp.kv ? P->comp.cols : 0, ic = P->index.kv ? P->index.cols : 0;
    int64_t ih = P->index.kv ? P->index_heads : 0, iq = ih * P->index_dim;
    int64_t n = hid + hc + hc * hc + hd + P->head_dim + 2 * cc + 2 * ic + iq + ih + hd + hid + hc * hid;
    float *x = malloc(sizeof(float) * (size_t)(n + 1));
    if (!x) return -1;
    float *post = x + hid, *comb = post + hc, *q = comb + hc * hc, *kv = q + hd, *comp_kv = kv + P->head_dim;
    float *comp_score = comp_kv + cc, *index_kv = comp_score + cc, *index_score = index_kv + ic;
    float *index_q = index_score + ic, *index_w = index_q + iq, *o = index_w + ih, *y = o + hd, *mid = y + hid;
    int rc = collapse_norm(&B->attn, streams, hc, hid, x, post, comb);
    if (!rc) rc = kv_attn_project(P, x, 1, &start, cs, sn, q, kv, comp_kv, comp_score, index_kv, index_score,
                                  index_q, index_w);
    if (!rc) rc = kv_attn_sequence_one(S, start, q, kv, comp_kv, comp_score, index_kv, index_score, index_q,
                                       index_w, emit_cs, emit_sn, o);
    if (!rc) rc = kv_attn_output(B->output, o, 1, cs, sn, y);
    if (!rc) {
        kv_hc_expand(streams, y, post, comb, 1, hc, hid, mid);
        rc = collapse_norm(&B->ffn, mid, hc, hid, x, post, comb);
    }
    if (!rc) rc = moe_row(M, x, token, B->moe_threads, y);
    if (!rc) kv_hc_expand(mid, y, post, comb, 1, hc, hid, out);
    free(x);
    return rc ? -1 : 0;
}

/* The model around its blocks: the embedding, the mHC head, the final norm and the lm_head. */
typedef struct {
    int64_t hc, hid, vocab, layers;
    const kv_weights *embed;                 /* [vocab, hid]: fp32, or as stored (bf16, ...) */
    const float *head_fn, *head_base, *head_scale;
    double head_hc_eps, head_norm_eps;
    const float *norm;
    double norm_eps;
    const kv_weights *lm_head;               /* [vocab, hid] */
    int64_t head_threads;
} model_layer;

/* CausalLM.forward's rows for one sequence's decode row (Dsv4Model._run_rows): the token's
 * embedding row (an fp32 row as it is, another format through decode_row: the value a load-time
 * decode writes) copied into the hc streams,
 * each block as kv_block_decode_one runs it (block i with its state S[i] and its rope
 * rope[4i .. 4i+3] = cs, sn, emit_cs, emit_sn), then the head's collapse (kv_hc_head), the norm
 * and the lm_head (weights_matmul), in that order. Writes the final streams [hc, hid] and the
 * logits [vocab]. Every block is checked for refusal before any is run, so -2 writes nothing;
 * -1: a buffer could not be allocated (the state may then be part-written). */
int kv_model_decode_one(const model_layer *M, const block_layer *const *B, const sequence_layer *const *S,
                        const float *const *rope, int64_t start, const int64_t *token, float *streams,
                        float *logits) {
    int64_t hc = M->hc, hid = M->hid;
    if (*token < 0 || *token >= M->vocab || hc < 1 || hc > HC_MAX) return -2;
    for (int64_t i = 0; i < M->layers; i++)
        if (B[i]->hc != hc || B[i]->hid != hid || block_refuses(B[i])) return -2;
    float *cur = malloc(sizeof(float) * (size_t)(2 * hc * hid + hid));
    if (!cur) return -1;
    float *next = cur + hc * hid, *x = next + hc * hid;
    if (M->embed->fmt == KV_F32) /* decode_row reads the other formats */
        memcpy(x, (const float *)M->embed->data + *token * hid, sizeof(float) * (size_t)hid);
    else
        decode_row(M->embed, (const uint8_t *)M->embed->data, M->embed->scale, *token, x);
    for (int64_t k = 0; k < hc; k++) memcpy(cur + k * hid, x, sizeof(float) * (size_t)hid);
    int rc = 0;
    for (int64_t i = 0; i < M->layers && !rc; i++) {
        const float *const *r = rope + 4 * i;
        rc = kv_block_decode_one(B[i], S[i], start, token, r[0], r[1], r[2], r[3], cur, next);
        float *t = cur; cur = next; next = t;
    }
    if (!rc) {
        memcpy(streams, cur, sizeof(float) * (size_t)(hc * hid));
        rc = kv_hc_head(cur, M->head_fn, M->head_base, M->head_scale, 1, hc, hid, M->head_hc_eps,
                        M->head_norm_eps, x);
    }
    if (!rc) {
        kv_rms_norm(x, M->norm, x, 1, hid, M->norm_eps);
        rc = weights_matmul(x, hid, M->lm_head, 0, logits, M->vocab, 1, M->vocab, M->head_threads);
    }
    free(cur < next ? cur : next);
    return rc ? -1 : 0;
}

#endif
