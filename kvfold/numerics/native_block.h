/* kvfold native kernels: a whole DeepSeek-V4 block, and the whole model, for a batch of decode rows
 * (a decode step's one row per sequence, and verify steps' rows, each a decode row in row order),
 * one call each (models/deepseek_v4/native_block.py enters them).
 * Included at the end of native.c, after the kernels it composes.
 *
 * It is Block.forward's sequence of native calls for those rows, in the same order on the same
 * values: the attention's mHC collapse (kv_hc_collapse) and input norm (kv_rms_norm), the
 * attention's projections (kv_attn_project), each sequence's decode row (kv_attn_sequence_one:
 * folds, selection, attention, window write) and the output (kv_attn_output), the expand
 * (kv_hc_expand), the MoE's collapse and norm, the MoE rows (kv_moe_rows) and the last expand.
 * So the streams and the states get the per-op path's bits by construction (and, as there, each
 * row the bits it gets alone); the fusion removes only the Python between the calls.
 */
#ifndef KV_NATIVE_BLOCK_H
#define KV_NATIVE_BLOCK_H

/* one sub-block's entry: its HyperConnection's parameters and its input RMSNorm */
typedef struct {
    hc_params hc;
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

/* x [n, hid] = norm(sum_k pre_k * stream_k) per row, with the expand's post and comb */
static int collapse_norm(const hc_entry *H, const float *streams, int64_t n, int64_t hc, int64_t hid, float *x,
                         float *post, float *comb) {
    if (kv_hc_collapse(&H->hc, streams, n, hc, hid, x, post, comb) != 0) return -1;
    kv_rms_norm(x, H->norm, x, n, hid, H->eps); /* in place: each row's scale is read before its writes */
    return 0;
}

/* whether kv_block_decode_rows would refuse B before writing anything (the routing arguments
 * kv_moe_rows checks, the mHC width) */
static int block_refuses(const block_layer *B) {
    return B->hc < 1 || B->hc > HC_MAX || route_refuses(&B->moe->route);
}

/* The floats one row of a layer's attn_rows takes */
static int64_t attn_row_floats(const attn_project_layer *P) {
    const int64_t cc = P->comp.kv ? P->comp.cols : 0, ic = P->index.kv ? P->index.cols : 0;
    const int64_t ih = P->index.kv ? P->index_heads : 0;
    return P->heads * P->head_dim + P->head_dim + 2 * cc + 2 * ic + ih * P->index_dim + ih;
}

/* Row r of n rows' attn_rows laid out in buf (n * attn_row_floats(P) floats: each part's n rows
 * after the previous part's); row 0 is where each part's rows start. */
static attn_rows attn_row(const attn_project_layer *P, float *buf, int64_t n, int64_t r) {
    const int64_t hd = P->heads * P->head_dim, d = P->head_dim;
    const int64_t cc = P->comp.kv ? P->comp.cols : 0, ic = P->index.kv ? P->index.cols : 0;
    const int64_t ih = P->index.kv ? P->index_heads : 0, iq = ih * P->index_dim;
    attn_rows A;
    A.q = buf + r * hd;           buf += n * hd;
    A.kv = buf + r * d;           buf += n * d;
    A.comp_kv = buf + r * cc;     buf += n * cc;
    A.comp_score = buf + r * cc;  buf += n * cc;
    A.index_kv = buf + r * ic;    buf += n * ic;
    A.index_score = buf + r * ic; buf += n * ic;
    A.index_q = buf + r * iq;     buf += n * iq;
    A.index_w = buf + r * ih;
    return A;
}

/* n decode rows (a sequence's verify rows consecutive, in row order): row r at position start[r]
 * with token id token[r]; (cs, sn) [n, half]: the layer's rope at the rows' positions;
 * (emit_cs[r], emit_sn[r]): the rope of the entry row r's closing window emits (NULL when none
 * closes) */
typedef struct {
    int64_t n;
    const int64_t *start, *token;
    const float *cs, *sn;
    const float *const *emit_cs, *const *emit_sn;
} decode_rows;

/* The block for R's rows, row r on sequence state S[r]: streams [n, hc, hid] -> out [n, hc, hid].
 * Block.forward's calls on n rows: the token-parallel steps take all the rows at once, the decode
 * row of each sequence's attention runs on its own state, in row order. Returns -2 (refused
 * before any write) for routing arguments kv_moe_rows would refuse; -1: a buffer could not be
 * allocated (the states may then be part-written, as with kv_attn_sequence_one). */
int kv_block_decode_rows(const block_layer *B, const sequence_layer *const *S, const decode_rows *R,
                         const float *streams, float *out) {
    const attn_project_layer *P = B->project;
    const int64_t n = R->n, hc = B->hc, hid = B->hid, hd = P->heads * P->head_dim;
    if (block_refuses(B) || n < 1) return -2;
    int64_t row = hid + hc + hc * hc + attn_row_floats(P) + hd + hid + hc * hid;
    float *x = malloc(sizeof(float) * (size_t)(n * row + 1));
    if (!x) return -1;
    float *post = x + n * hid, *comb = post + n * hc, *rows = comb + n * hc * hc;
    float *o = rows + n * attn_row_floats(P), *y = o + n * hd, *mid = y + n * hid;
    const attn_rows all = attn_row(P, rows, n, 0);
    int rc = collapse_norm(&B->attn, streams, n, hc, hid, x, post, comb);
    if (!rc) rc = kv_attn_project(P, x, n, R->start, R->cs, R->sn, &all);
    for (int64_t r = 0; r < n && !rc; r++) {
        const attn_rows one = attn_row(P, rows, n, r);
        rc = kv_attn_sequence_one(S[r], R->start[r], &one, R->emit_cs[r], R->emit_sn[r], o + r * hd);
    }
    if (!rc) rc = kv_attn_output(B->output, o, n, R->cs, R->sn, y);
    if (!rc) {
        kv_hc_expand(streams, y, post, comb, n, hc, hid, mid);
        rc = collapse_norm(&B->ffn, mid, n, hc, hid, x, post, comb);
    }
    if (!rc) rc = kv_moe_rows(B->moe, x, n, R->token, B->moe_threads, y);
    if (!rc) kv_hc_expand(mid, y, post, comb, n, hc, hid, out);
    free(x);
    return rc ? -1 : 0;
}

/* The model around its blocks: the embedding, the mHC head, the final norm and the lm_head. */
typedef struct {
    int64_t hc, hid, vocab, layers;
    const kv_weights *embed;                 /* [vocab, hid]: fp32, or as stored (bf16, ...) */
    hc_params head;                          /* the mHC head's (kv_hc_head) */
    const float *norm;
    double norm_eps;
    const kv_weights *lm_head;               /* [vocab, hid] */
    int64_t head_threads;
} model_layer;

/* n decode rows of the whole model (as decode_rows): row r at position start[r] with token id
 * token[r]; block i's rope rope[2i], rope[2i + 1] = cos, sin [n, half] and the rope of the entry
 * row r's closing window emits there emit[2 (i n + r)] = cos, emit[2 (i n + r) + 1] = sin (NULL
 * when none closes) */
typedef struct {
    int64_t n;
    const int64_t *start, *token;
    const float *const *rope, *const *emit;
} model_rows;

/* CausalLM.forward's rows for R's decode rows (Dsv4Model._run_rows): each token's embedding row
 * (an fp32 row as it is, another format through decode_row: the value a load-time decode writes)
 * copied into its hc streams, each block as kv_block_decode_rows runs it (block i with the states
 * S[i n .. i n + n)), then the head's collapse (kv_hc_head), the norm and the lm_head
 * (weights_matmul), in that order. Writes the final streams [n, hc, hid] and the logits [n, vocab].
 * Every token and block is checked for refusal before any block runs, so -2 writes nothing; -1: a
 * buffer could not be allocated (the states may then be part-written). */
int kv_model_decode_rows(const model_layer *M, const block_layer *const *B, const sequence_layer *const *S,
                         const model_rows *R, float *streams, float *logits) {
    const int64_t n = R->n, *token = R->token;
    int64_t hc = M->hc, hid = M->hid;
    if (n < 1 || hc < 1 || hc > HC_MAX) return -2;
    for (int64_t r = 0; r < n; r++)
        if (token[r] < 0 || token[r] >= M->vocab) return -2;
    for (int64_t i = 0; i < M->layers; i++)
        if (B[i]->hc != hc || B[i]->hid != hid || block_refuses(B[i])) return -2;
    const float **emit_rows = malloc(sizeof(float *) * (size_t)(2 * n));
    float *cur = malloc(sizeof(float) * (size_t)(n * (2 * hc * hid + hid)));
    if (!cur || !emit_rows) { free(cur); free(emit_rows); return -1; }
    float *next = cur + n * hc * hid, *x = next + n * hc * hid;
    for (int64_t r = 0; r < n; r++) {
        if (M->embed->fmt == KV_F32) /* decode_row reads the other formats */
            memcpy(x + r * hid, (const float *)M->embed->data + token[r] * hid, sizeof(float) * (size_t)hid);
        else
            decode_row(M->embed, (const uint8_t *)M->embed->data, M->embed->scale, token[r], x + r * hid);
        for (int64_t k = 0; k < hc; k++) memcpy(cur + (r * hc + k) * hid, x + r * hid, sizeof(float) * (size_t)hid);
    }
    int rc = 0;
    for (int64_t i = 0; i < M->layers && !rc; i++) {
        for (int64_t r = 0; r < n; r++) {
            emit_rows[r] = R->emit[2 * (i * n + r)];
            emit_rows[n + r] = R->emit[2 * (i * n + r) + 1];
        }
        const decode_rows rows = {n, R->start, token, R->rope[2 * i], R->rope[2 * i + 1], emit_rows,
                                  emit_rows + n};
        rc = kv_block_decode_rows(B[i], S + i * n, &rows, cur, next);
        float *t = cur; cur = next; next = t;
    }
    if (!rc) {
        memcpy(streams, cur, sizeof(float) * (size_t)(n * hc * hid));
        rc = kv_hc_head(&M->head, cur, n, hc, hid, x);
    }
    if (!rc) {
        kv_rms_norm(x, M->norm, x, n, hid, M->norm_eps);
        rc = weights_matmul(x, hid, M->lm_head, 0, logits, M->vocab, n, M->vocab, M->head_threads);
    }
    free(cur < next ? cur : next);
    free(emit_rows);
    return rc ? -1 : 0;
}

#endif
