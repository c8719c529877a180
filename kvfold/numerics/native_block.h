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
int kv_block_decode_one(const block_layer *B, const sequence_layer *S, int64_t start, const int64_t *token,
                        const float *cs, const float *sn, const float *emit_cs, const float *emit_sn,
                        const float *streams, float *out) {
    const attn_project_layer *P = B->project;
    const moe_layer *M = B->moe;
    int64_t hc = B->hc, hid = B->hid, hd = P->heads * P->head_dim;
    if (hc < 1 || hc > HC_MAX || M->k < 1 || M->k > MOE_MAX_K || M->k > M->e || M->n_group < 1
        || M->n_group > MOE_MAX_GROUPS || M->e % M->n_group || M->topk_group < 1 || M->topk_group > M->n_group)
        return -2;
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

#endif
