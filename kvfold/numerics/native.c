/* kvfold native kernels: fp32 CPU row kernels. They serve two purposes: the ops whose cost on the
 * CPU is per-call overhead, not arithmetic (a decode step runs each on one row), and the
 * batch-invariant arithmetic of numerics/rows.py.
 *
 * Every kernel treats each row on its own, with a fixed order of operations, so a row's result
 * never depends on how many rows share the call, where the row sits in it, or how many threads
 * run it (batch-invariant by construction). The build uses -ffp-contract=off and no
 * reassociation flags, so each expression is evaluated exactly as written: vectorising the
 * fixed-lane loops below changes no bits, only how many lanes one instruction computes.
 * Loaded through ctypes by native.py, which compiles this file once per machine.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_dot.h"
#include "native_weights.h"

/* ---- batch-invariant matmul: out [M, N] = x [M, K] @ w [N, K]^T (fp32 w; see native_weights.h) ---- */
typedef struct {
    const float *x;
    int64_t ldx;          /* x's row stride */
    const float *w;
    float *out;
    int64_t ldo, m, n, k; /* ldo: out's row stride */
    int64_t threads;
} kv_matmul_args;

void kv_matmul(const kv_matmul_args *a) {
    kv_weights f32 = {KV_F32, 0, a->w, NULL, 1, LANES, a->k, 0, 0, 0, 0};
    weights_matmul(a->x, a->ldx, &f32, 0, a->out, a->ldo, a->m, a->n, a->threads); /* fp32: no panel, cannot fail */
}

static inline double sigmoid_d(double z) {
    if (z >= 0) return 1.0 / (1.0 + exp(-z));
    double e = exp(z);
    return e / (1.0 + e);
}

static inline float silu_f(float z) { return z / (1.0f + expf(-z)); }

/* ---- RMSNorm: out = x * rsqrt(mean(x^2) + eps) [* w] ------------------------------------------ */
void kv_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t d, double eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        float *o = out + r * d;
        float inv = (float)(1.0 / sqrt(sum_squares(xr, d) / (double)d + eps));
        if (w)
            for (int64_t i = 0; i < d; i++) o[i] = (xr[i] * inv) * w[i];
        else
            for (int64_t i = 0; i < d; i++) o[i] = xr[i] * inv;
    }
}

/* ---- interleaved partial RoPE: rotate the last 2*half dims of each [D] vector -------------------- */
static void rope_rows(const float *x, const float *cs, const float *sn, float *out, int64_t t, int64_t inner,
                      int64_t d, int64_t half, int64_t inverse) {
    int64_t nope = d - 2 * half;
    for (int64_t r = 0; r < t; r++) {
        const float *c = cs + r * half, *s = sn + r * half;
        for (int64_t h = 0; h < inner; h++) {
            const float *xv = x + (r * inner + h) * d;
            float *o = out + (r * inner + h) * d;
            if (o != xv) memcpy(o, xv, (size_t)nope * sizeof(float));
            for (int64_t p = 0; p < half; p++) {
                float a = xv[nope + 2 * p], b = xv[nope + 2 * p + 1];
                float cc = c[p], ss = inverse ? -s[p] : s[p];
                o[nope + 2 * p] = a * cc - b * ss;
                o[nope + 2 * p + 1] = a * ss + b * cc;
            }
        }
    }
}

/* x [t, inner, d] (cs, sn [t, half]) -> out, which may be x; inverse: rotate by -angle */
typedef struct {
    const float *x, *cs, *sn;
    float *out;
    int64_t t, inner, d, half, inverse;
} kv_rope_args;

void kv_rope(const kv_rope_args *a) {
    rope_rows(a->x, a->cs, a->sn, a->out, a->t, a->inner, a->d, a->half, a->inverse);
}

/* ---- mHC ------------------------------------------------------------------------------------------
 * collapse: per row, mix = flat(streams) @ fn^T (fn [(2+hc)*hc, hc*d]); r = rsqrt(mean(flat^2)+eps);
 * in float64: pre = sigmoid(mix*r*s0 + b) + eps, post = 2 sigmoid(mix*r*s1 + b),
 * comb = Sinkhorn(softmax_rows(mix*r*s2 + b) + eps); then x = sum_k pre_k * stream_k (fp32). */
#define HC_MAX 16

/* one HyperConnection's parameters: fn, base, scale [3] (the head's: fn [hc, hc*d], scale [1]),
 * the Sinkhorn iterations (the head has none) and the two epsilons */
typedef struct {
    const float *fn, *base, *scale;
    int64_t iters;
    double hc_eps, norm_eps;
} hc_params;

static void sinkhorn_row(double *a, int hc, int iters, double eps) {
    for (int j = 0; j < hc; j++) { /* columns */
        double c = 0.0;
        for (int i = 0; i < hc; i++) c += a[i * hc + j];
        c += eps;
        for (int i = 0; i < hc; i++) a[i * hc + j] /= c;
    }
    for (int it = 0; it < iters - 1; it++) {
        for (int i = 0; i < hc; i++) { /* rows */
            double c = 0.0;
            for (int j = 0; j < hc; j++) c += a[i * hc + j];
            c += eps;
            for (int j = 0; j < hc; j++) a[i * hc + j] /= c;
        }
        for (int j = 0; j < hc; j++) {
            double c = 0.0;
            for (int i = 0; i < hc; i++) c += a[i * hc + j];
            c += eps;
            for (int i = 0; i < hc; i++) a[i * hc + j] /= c;
        }
    }
}

/* out = sum_k p_k * stream_k, each element's terms added in ascending k from p_0 * stream_0: the
 * loop over elements is innermost, so it vectorises, and each element's operations stay in order */
static void weighted_streams(const float *xs, const float *p, float *out, int hc, int64_t d) {
    for (int64_t i = 0; i < d; i++) out[i] = p[0] * xs[i];
    for (int k = 1; k < hc; k++)
        for (int64_t i = 0; i < d; i++) out[i] = out[i] + p[k] * xs[k * d + i];
}

/* streams [rows, hc, d] -> out [rows, d], post [rows, hc], comb [rows, hc, hc]. Returns 0, or -1 when
 * hc is out of range (nothing written). */
int kv_hc_collapse(const hc_params *P, const float *streams, int64_t rows, int64_t hc, int64_t d, float *out,
                   float *post, float *comb) {
    if (hc < 1 || hc > HC_MAX) return -1;
    const float *fn = P->fn, *base = P->base;
    const int64_t iters = P->iters;
    const double hc_eps = P->hc_eps, norm_eps = P->norm_eps;
    int64_t n = (2 + hc) * hc, flat = hc * d;
    double s0 = P->scale[0], s1 = P->scale[1], s2 = P->scale[2];
    for (int64_t r = 0; r < rows; r++) {
        const float *xs = streams + r * flat;
        float mix[(2 + HC_MAX) * HC_MAX];
        matmul_cols(xs, flat, fn, mix, n, 1, 0, n, flat); /* each mix[j] = dot(xs, fn row j), in tiles */
        double rr = 1.0 / sqrt(sum_squares(xs, flat) / (double)flat + norm_eps);
        double r0 = rr * s0, r1 = rr * s1, r2 = rr * s2;
        float pre[HC_MAX];
        for (int64_t i = 0; i < hc; i++) {
            pre[i] = (float)(sigmoid_d(mix[i] * r0 + base[i]) + hc_eps);
            post[r * hc + i] = (float)(2.0 * sigmoid_d(mix[hc + i] * r1 + base[hc + i]));
        }
        double a[HC_MAX * HC_MAX];
        for (int64_t i = 0; i < hc; i++) {
            double l[HC_MAX], mx = -INFINITY, z = 0.0;
            for (int64_t j = 0; j < hc; j++) {
                int64_t o = 2 * hc + i * hc + j;
                l[j] = mix[o] * r2 + base[o];
                if (l[j] > mx) mx = l[j];
            }
            for (int64_t j = 0; j < hc; j++) { l[j] = exp(l[j] - mx); z += l[j]; }
            for (int64_t j = 0; j < hc; j++) a[i * hc + j] = l[j] / z + hc_eps;
        }
        sinkhorn_row(a, (int)hc, (int)iters, hc_eps);
        for (int64_t i = 0; i < hc * hc; i++) comb[r * hc * hc + i] = (float)a[i];
        weighted_streams(xs, pre, out + r * d, (int)hc, d);
    }
    return 0;
}

/* the final collapse: pre = sigmoid(mix * r * s0 + b) + eps (fn [hc, hc*d]); x = sum_k pre_k stream_k */
int kv_hc_head(const hc_params *P, const float *streams, int64_t rows, int64_t hc, int64_t d, float *out) {
    if (hc < 1 || hc > HC_MAX) return -1;
    const float *fn = P->fn, *base = P->base, *scale = P->scale;
    const double hc_eps = P->hc_eps, norm_eps = P->norm_eps;
    int64_t flat = hc * d;
    for (int64_t r = 0; r < rows; r++) {
        const float *xs = streams + r * flat;
        double rs = (1.0 / sqrt(sum_squares(xs, flat) / (double)flat + norm_eps)) * (double)scale[0];
        float pre[HC_MAX], mix[HC_MAX];
        matmul_cols(xs, flat, fn, mix, hc, 1, 0, hc, flat);
        for (int64_t i = 0; i < hc; i++) pre[i] = (float)(sigmoid_d((double)mix[i] * rs + base[i]) + hc_eps);
        weighted_streams(xs, pre, out + r * d, (int)hc, d);
    }
    return 0;
}

/* expand: out_k = post_k * y + sum_j comb[j, k] * stream_j; per element: acc = comb[0, k] x_0, then
 * + comb[j, k] x_j for j = 1.., then post_k y + acc (element loops innermost, so they vectorise) */
void kv_hc_expand(const float *streams, const float *y, const float *post, const float *comb, int64_t rows,
                  int64_t hc, int64_t d, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xs = streams + r * hc * d, *yr = y + r * d, *cb = comb + r * hc * hc;
        for (int64_t k = 0; k < hc; k++) {
            float pk = post[r * hc + k], *o = out + (r * hc + k) * d;
            for (int64_t i = 0; i < d; i++) o[i] = cb[k] * xs[i];
            for (int64_t j = 1; j < hc; j++) {
                float c = cb[j * hc + k];
                const float *xj = xs + j * d;
                for (int64_t i = 0; i < d; i++) o[i] = o[i] + c * xj[i];
            }
            for (int64_t i = 0; i < d; i++) o[i] = pk * yr[i] + o[i];
        }
    }
}

/* ---- MoE routing, SwiGLU, and the whole layer for one row -----------------------------------------
 * scores = score(router_w @ x) (0 softmax, 1 sigmoid, 2 sqrt(softplus)); the experts are tid2eid[token]
 * (hash layers), else the top k of scores + bias (ties to the lower id), within the topk_group best
 * groups when n_group > 1 (a group's score: the sum of its two best biased scores); their weights
 * are scores[ids] / (sum + 1e-20) (float64, with `renorm`) * route_scale, rounded to fp32. Experts
 * come out in ascending id order (a stable sort keeps equal ids in routing order). */
#define MOE_MAX_K 64
#define MOE_MAX_GROUPS 64

/* a router: router_w [e, h], bias [e] (top-k routing) or tid2eid [vocab, k] (hash routing; NULL: none) */
typedef struct {
    int64_t h, e, k, n_group, topk_group;
    int scoring, renorm;
    double route_scale;
    const float *router_w, *bias;
    const int64_t *tid2eid;
} route_params;

/* whether kv_route refuses R (before any write) */
static int route_refuses(const route_params *R) {
    return R->k < 1 || R->k > MOE_MAX_K || R->k > R->e || R->n_group < 1 || R->n_group > MOE_MAX_GROUPS
           || R->e % R->n_group || R->topk_group < 1 || R->topk_group > R->n_group;
}

static void score_experts(float *s, int64_t e, int scoring) {
    if (scoring == 0) {
        float mx = -INFINITY, z = 0.0f;
        for (int64_t i = 0; i < e; i++) if (s[i] > mx) mx = s[i];
        for (int64_t i = 0; i < e; i++) { s[i] = expf(s[i] - mx); z += s[i]; }
        for (int64_t i = 0; i < e; i++) s[i] /= z;
    } else if (scoring == 1) {
        for (int64_t i = 0; i < e; i++) s[i] = 1.0f / (1.0f + expf(-s[i]));
    } else {
        for (int64_t i = 0; i < e; i++) s[i] = sqrtf(s[i] > 20.0f ? s[i] : log1pf(expf(s[i])));
    }
}

/* k passes of argmax over v[0..e) where allowed (NULL: all), ties to the lower id */
static void top_k_ids(const float *v, const unsigned char *allowed, int64_t e, int64_t k, int64_t *ids) {
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        float bv = 0.0f;
        for (int64_t i = 0; i < e; i++) {
            if (allowed && !allowed[i]) continue;
            int taken = 0;
            for (int64_t q = 0; q < j; q++) taken |= ids[q] == i;
            if (taken) continue;
            if (best < 0 || v[i] > bv) { best = i; bv = v[i]; }
        }
        ids[j] = best;
    }
}

/* one row's routing from its router logits (e floats, turned into its scores in place; hash_row:
 * its tid2eid row, or NULL); scratch holds e floats + e bytes. Returns 0, or -1 on a bad expert id. */
static int route_row(const route_params *R, float *scores, const int64_t *hash_row, float *scratch, int64_t *ids,
                     float *wts) {
    const int64_t e = R->e, k = R->k, n_group = R->n_group, topk_group = R->topk_group;
    const float *bias = R->bias;
    float *biased = scratch;
    score_experts(scores, e, R->scoring);
    if (hash_row) {
        for (int64_t j = 0; j < k; j++) ids[j] = hash_row[j];
    } else {
        for (int64_t i = 0; i < e; i++) biased[i] = scores[i] + bias[i];
        unsigned char *allowed = NULL;
        if (n_group > 1) {
            int64_t per = e / n_group, best2 = per < 2 ? per : 2, gids[MOE_MAX_GROUPS];
            float gscore[MOE_MAX_GROUPS];
            for (int64_t g = 0; g < n_group; g++) {
                int64_t top[2] = {0, 0};
                top_k_ids(biased + g * per, NULL, per, best2, top);
                gscore[g] = biased[g * per + top[0]];
                if (best2 > 1) gscore[g] += biased[g * per + top[1]];
            }
            top_k_ids(gscore, NULL, n_group, topk_group, gids);
            allowed = (unsigned char *)(scratch + e);
            memset(allowed, 0, (size_t)e);
            for (int64_t g = 0; g < topk_group; g++) memset(allowed + gids[g] * per, 1, (size_t)per);
        }
        top_k_ids(biased, allowed, e, k, ids);
    }
    for (int64_t j = 0; j < k; j++)
        if (ids[j] < 0 || ids[j] >= e) return -1;
    double total = 0.0;
    for (int64_t j = 0; j < k; j++) total += scores[ids[j]];
    total += 1e-20;
    const double route_scale = R->route_scale;
    for (int64_t j = 0; j < k; j++)
        wts[j] = (float)(R->renorm ? (double)scores[ids[j]] / total * route_scale
                                   : (double)scores[ids[j]] * route_scale);
    for (int64_t j = 1; j < k; j++)
        for (int64_t q = j; q > 0 && ids[q - 1] > ids[q]; q--) {
            int64_t ti = ids[q]; ids[q] = ids[q - 1]; ids[q - 1] = ti;
            float tw = wts[q]; wts[q] = wts[q - 1]; wts[q - 1] = tw;
        }
    return 0;
}

/* routing of `rows` rows: ids [rows, k] ascending per row, weights [rows, k]. The router logits
 * of all rows are one matmul over `threads` (each still native_dot.h's `dot` of its row: a prefill
 * chunk's rows took one matrix-vector product each, one thread, reading the router from L3 a row);
 * then row by row. Returns 0, or -1 on a bad argument, expert id or allocation (what was written
 * is then meaningless). */
int kv_route(const route_params *R, const float *x, int64_t rows, const int64_t *tokens, int64_t *ids, float *wts,
             int64_t threads) {
    if (route_refuses(R)) return -1;
    const int64_t k = R->k, e = R->e;
    float *logits = malloc(sizeof(float) * (size_t)((rows + 2) * e));
    if (!logits) return -1;
    const kv_weights router = {KV_F32, 0, R->router_w, NULL, 1, LANES, R->h, 0, 0, 0, 0};
    weights_matmul(x, R->h, &router, 0, logits, e, rows, e, rows * e * R->h < KV_SERIAL_MACS ? 1 : threads);
    int rc = 0;
    for (int64_t r = 0; r < rows && rc == 0; r++)
        rc = route_row(R, logits + r * e, R->tid2eid ? R->tid2eid + tokens[r] * k : NULL, logits + rows * e,
                       ids + r * k, wts + r * k);
    free(logits);
    return rc;
}

/* act = silu(min(gate, L)) * clamp(up, -L, L), elementwise */
static void swiglu(const float *gate, const float *up, float *act, int64_t n, float limit) {
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i] < limit ? gate[i] : limit;
        float u = up[i] < -limit ? -limit : (up[i] > limit ? limit : up[i]);
        act[i] = silu_f(g) * u;
    }
}

/* out [rows, n] = swiglu of rows of gate and up (each row at stride ld) */
void kv_swiglu(const float *gate, const float *up, int64_t ld, float *out, int64_t rows, int64_t n, float limit) {
    for (int64_t r = 0; r < rows; r++) swiglu(gate + r * ld, up + r * ld, out + r * n, n, limit);
}

/* out[i] = f(x[i]) for the elementwise functions of batch-invariant rows (numerics/rows.py):
 * each element on its own with scalar libm, so a value does not depend on its place in the call
 * (a vectorised loop computes its tail with other code than its body). */
enum { KV_SIGMOID = 0, KV_SILU = 1, KV_SOFTPLUS = 2, KV_COS = 3, KV_SIN = 4 };
void kv_unary(const float *x, float *out, int64_t n, int64_t op) {
    for (int64_t i = 0; i < n; i++) {
        float z = x[i];
        out[i] = op == KV_SIGMOID ? 1.0f / (1.0f + expf(-z))
               : op == KV_SILU    ? silu_f(z)
               : op == KV_COS     ? cosf(z)
               : op == KV_SIN     ? sinf(z)
               : z > 20.0f        ? z : log1pf(expf(z)); /* softplus, linear past 20 as torch's */
    }
}

/* out = x / sqrt(sum(x^2) + eps) per row of d (L2 normalisation; the sum is sum_squares' fixed order) */
void kv_l2norm(const float *x, float *out, int64_t rows, int64_t d, double eps) {
    for (int64_t r = 0; r < rows; r++) {
        float den = (float)sqrt(sum_squares(x + r * d, d) + eps);
        for (int64_t i = 0; i < d; i++) out[r * d + i] = x[r * d + i] / den;
    }
}

/* One MoE layer's routing and weights, as kv_moe_rows reads them. */
typedef struct {
    route_params route;
    int64_t inter, shared_inter; /* the routed experts' and the shared expert's width */
    float limit;                 /* the SwiGLU clamp */
    const kv_weights *w13, *w2, *shared_gate, *shared_up, *shared_down;
} moe_layer;

/* weights_many over any number of jobs: MM_MAX_JOBS at a time */
static int weights_all(const mm_job *jobs, int64_t count, int64_t threads) {
    for (int64_t j = 0; j < count; j += MM_MAX_JOBS) {
        int64_t n = count - j < MM_MAX_JOBS ? count - j : MM_MAX_JOBS;
        if (weights_many(jobs + j, (int)n, threads) != 0) return -1;
    }
    return 0;
}

/* The whole MoE layer for m rows x [m, h] (tokens [m]) into out [m, h]: row r's output is
 * y = sum over its routed experts, ascending, of w_e * down_e(swiglu(gate_e x, up_e x)), starting
 * from the first term, then + shared(x): the operations, in order, of kv_route +
 * kv_matmul_weights + kv_swiglu + numerics/rows.py's combination, so a row's bits are the same
 * alone, among other rows and on the torch path. Each expert's rows are gathered and multiplied
 * together (one read of its weights for all of them), the shared expert's too; every output is
 * still native_dot.h's `dot` of its row, which no other row changes. The expert stacks
 * w13 [E, 2I, H] and w2 [E, H, I] and the shared expert's three matrices (NULL: none) are in any
 * of native_weights.h's formats. The gate-up matrices (every routed expert's and the shared one's)
 * split their columns over `threads` in one parallel region, then the down matrices in another;
 * neither split touches a reduction. Returns 0, or -1 on a bad argument or a failed allocation. */
int kv_moe_rows(const moe_layer *L, const float *x, int64_t m, const int64_t *token, int64_t threads, float *out) {
    const int64_t h = L->route.h, inter = L->inter, si = L->shared_inter, k = L->route.k, e = L->route.e;
    const int64_t pairs = m * k;
    const int shared = L->shared_gate != NULL;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(2 * pairs + e + 1)); /* ids, each pair's slot, first */
    float *wts = malloc(sizeof(float) * (size_t)(pairs + 1));
    float *xg = malloc(sizeof(float) * (size_t)(pairs * (2 * h + 3 * inter) + m * (3 * si + h) + 1));
    mm_job *jobs = malloc(sizeof(mm_job) * (size_t)(e + 2));
    int rc = !ids || !wts || !xg || !jobs ? -1 : 0;
    if (rc == 0) rc = kv_route(&L->route, x, m, token, ids, wts, threads);
    if (rc != 0) { free(ids); free(wts); free(xg); free(jobs); return -1; }
    /* pair p (row p / k's j-th expert, j = p mod k) sits at slot[p] of the gathered rows: by
     * expert, then by p; expert i's slots end at first[i] once placed */
    int64_t *slot = ids + pairs, *first = slot + pairs;
    float *gu = xg + pairs * h, *act = gu + pairs * 2 * inter, *yg = act + pairs * inter;
    float *gs = yg + pairs * h, *us = gs + m * si, *as = us + m * si, *ys = as + m * si;
    memset(first, 0, sizeof(int64_t) * (size_t)(e + 1));
    for (int64_t p = 0; p < pairs; p++) first[ids[p]]++;
    for (int64_t i = 0, at = 0; i < e; i++) { int64_t c = first[i]; first[i] = at; at += c; }
    for (int64_t p = 0; p < pairs; p++) slot[p] = first[ids[p]]++;
    for (int64_t p = 0; p < pairs; p++) memcpy(xg + slot[p] * h, x + (p / k) * h, sizeof(float) * (size_t)h);
    int64_t n = 0;
    for (int64_t i = 0, at = 0; i < e; at = first[i++])
        if (first[i] > at)
            jobs[n++] = (mm_job){xg + at * h, h, L->w13, i, gu + at * 2 * inter, 2 * inter, first[i] - at, 2 * inter};
    if (shared) {
        jobs[n++] = (mm_job){x, h, L->shared_gate, 0, gs, si, m, si};
        jobs[n++] = (mm_job){x, h, L->shared_up, 0, us, si, m, si};
    }
    rc = weights_all(jobs, n, threads); /* every matrix that reads x */
    if (rc == 0) {
        for (int64_t q = 0; q < pairs; q++)
            swiglu(gu + q * 2 * inter, gu + q * 2 * inter + inter, act + q * inter, inter, L->limit);
        for (int64_t r = 0; shared && r < m; r++) swiglu(gs + r * si, us + r * si, as + r * si, si, L->limit);
        n = 0;
        for (int64_t i = 0, at = 0; i < e; at = first[i++])
            if (first[i] > at) jobs[n++] = (mm_job){act + at * inter, inter, L->w2, i, yg + at * h, h, first[i] - at, h};
        if (shared) jobs[n++] = (mm_job){as, si, L->shared_down, 0, ys, h, m, h};
        rc = weights_all(jobs, n, threads); /* then every down projection */
    }
    for (int64_t r = 0; rc == 0 && r < m; r++) { /* routed outputs weighted in routing order, then the shared one */
        float *o = out + r * h;
        const float *y0 = yg + slot[r * k] * h;
        for (int64_t i = 0; i < h; i++) o[i] = y0[i] * wts[r * k];
        for (int64_t j = 1; j < k; j++) {
            const float *yj = yg + slot[r * k + j] * h;
            for (int64_t i = 0; i < h; i++) o[i] = o[i] + yj[i] * wts[r * k + j];
        }
        if (shared)
            for (int64_t i = 0; i < h; i++) o[i] = o[i] + ys[r * h + i];
    }
    free(ids); free(wts); free(xg); free(jobs);
    return rc ? -1 : 0;
}

/* ---- one decode query's attention ---------------------------------------------------------------
 * q [h, d] (already scaled); the keys K: window keys, the rows of up to three runs, run r
 * `window_n[r]` contiguous [d] rows at `window[r]` (the ring's rows, oldest first, then the new
 * row: no copy into one buffer); compressed keys: the first n_comp rows of pool (sel NULL) or pool
 * rows sel[0..n_comp) (-1 = no entry, skipped), logical row i at physical row phys[i] (a paged
 * pool) or i (phys NULL); one softmax per head over the window logits, the compressed logits and
 * the sink logit (which has no value); K = V. Each logit is the one `dot`, each head's sums run
 * over the keys in that order whatever the loops around them. */
#define WINDOW_RUNS 3
typedef struct {
    const float *window[WINDOW_RUNS]; /* run r: window_n[r] rows (NULL when empty) */
    int64_t window_n[WINDOW_RUNS];
    const float *pool;                /* NULL when n_comp is 0 */
    const int64_t *phys, *sel;
    int64_t n_comp;
} attend_keys;

/* key j of K (the window runs' rows, then the compressed ones), NULL for a pick of -1 */
static inline const float *attend_key(const attend_keys *K, int64_t j, int64_t d) {
    for (int r = 0; r < WINDOW_RUNS; r++) {
        if (j < K->window_n[r]) return K->window[r] + j * d;
        j -= K->window_n[r];
    }
    int64_t row = K->sel ? K->sel[j] : j;
    if (row < 0) return NULL;
    return K->pool + (K->phys ? K->phys[row] : row) * d;
}

/* heads h0 .. h1 of kv_attend_one, logit [h1 - h0, n]: each key is read once for all these heads
 * (4 heads a tile), from L1, where a head at a time read every key again from L3 */
static void attend_heads(const float *q, int64_t h0, int64_t h1, int64_t d, const attend_keys *K, int64_t n,
                         const float *sinks, float *out, float *logit) {
    const int64_t nh = h1 - h0;
    for (int64_t j = 0; j < n;) {
        const float *kr = attend_key(K, j, d);
        const int three = kr && j + 3 <= n && attend_key(K, j + 1, d) == kr + d && attend_key(K, j + 2, d) == kr + 2 * d;
        const int64_t nk = three ? 3 : 1; /* three keys side by side in memory: 12 chains a tile, not 4 */
        int64_t hh = 0;
        for (; three && hh + 4 <= nh; hh += 4) dot_tile_4x3(q + (h0 + hh) * d, d, kr, d, d, logit + hh * n + j, n);
        for (; kr && hh + 4 <= nh; hh += 4) dot_tile_4x1(q + (h0 + hh) * d, d, kr, 0, d, logit + hh * n + j, n);
        for (; hh < nh; hh++)
            for (int64_t c = 0; c < nk; c++) logit[hh * n + j + c] = kr ? dot(q + (h0 + hh) * d, kr + c * d, d) : -INFINITY;
        j += nk;
    }
    for (int64_t hh = 0; hh < nh; hh++) { /* the head's softmax: max, then the exponentials in key order */
        float *l = logit + hh * n, mx = sinks[h0 + hh];
        for (int64_t j = 0; j < n; j++)
            if (l[j] > mx) mx = l[j];
        float z = expf(sinks[h0 + hh] - mx);
        for (int64_t j = 0; j < n; j++) { l[j] = expf(l[j] - mx); z += l[j]; }
        for (int64_t j = 0; j < n; j++) l[j] = l[j] / z;
        memset(out + (h0 + hh) * d, 0, sizeof(float) * (size_t)d);
    }
    for (int64_t j = 0; j < n; j++) { /* each head's output: + p * key, in key order */
        const float *kr = attend_key(K, j, d);
        if (!kr) continue;
        for (int64_t hh = 0; hh < nh; hh++) {
            const float p = logit[hh * n + j];
            float *o = out + (h0 + hh) * d;
            for (int64_t i = 0; i < d; i++) o[i] += p * kr[i];
        }
    }
}

/* scratch: h * (window rows + n_comp) floats. The heads split into `threads` runs (which thread
 * computes a head changes none of its operations). */
void kv_attend_one(const float *q, int64_t h, int64_t d, const attend_keys *K, const float *sinks, float *out,
                   float *scratch, int64_t threads) {
    const int64_t n = K->window_n[0] + K->window_n[1] + K->window_n[2] + K->n_comp;
    const int64_t th = threads < 1 || h * n * d < KV_SERIAL_MACS ? 1 : threads < h ? threads : h;
    #pragma omp parallel for num_threads(th) schedule(static, 1) if (th > 1)
    for (int64_t t = 0; t < th; t++) {
        const int64_t h0 = h * t / th, h1 = h * (t + 1) / th;
        attend_heads(q, h0, h1, d, K, n, sinks, out, scratch + h0 * n);
    }
}

/* ---- one decode query's indexer top-k -------------------------------------------------------------
 * score_j = sum_h w[h] * relu(q_h . key_j) over the n entries (entry j at physical row phys[j], or
 * j when phys is NULL); the k best (higher first, ties to the lower index), written to out in
 * ascending index order. scratch holds n floats. The scores split into `threads` runs of entries;
 * the selection runs on one. */
typedef struct {
    const float *q, *w; /* the query's heads [heads, dim] and their weights [heads] */
    int64_t heads, dim;
} index_query;

/* score_j for entries j0 .. j1: the heads' dots 4 at a time (each still the one `dot`), then the
 * weighted sum in head order */
static void index_scores_run(const index_query *Q, const float *keys, const int64_t *phys, int64_t j0, int64_t j1,
                             float *score) {
    const float *q = Q->q, *w = Q->w;
    const int64_t h = Q->heads, d = Q->dim;
    float s[3 * h]; /* [h, 3]: head hh's dots with up to three entries */
    for (int64_t j = j0; j < j1;) {
        const int64_t row = phys ? phys[j] : j;
        const int three = j + 3 <= j1 && (!phys || (phys[j + 1] == row + 1 && phys[j + 2] == row + 2));
        const int64_t nk = three ? 3 : 1; /* three entries side by side in memory: 12 chains a tile, not 4 */
        const float *kr = keys + row * d;
        int64_t hh = 0;
        for (; three && hh + 4 <= h; hh += 4) dot_tile_4x3(q + hh * d, d, kr, d, d, s + hh * 3, 3);
        for (; !three && hh + 4 <= h; hh += 4) dot_tile_4x1(q + hh * d, d, kr, 0, d, s + hh * 3, 3);
        for (; hh < h; hh++)
            for (int64_t c = 0; c < nk; c++) s[hh * 3 + c] = dot(q + hh * d, kr + c * d, d);
        for (int64_t c = 0; c < nk; c++) {
            float acc = 0.0f;
            for (hh = 0; hh < h; hh++) acc += w[hh] * (s[hh * 3 + c] > 0.0f ? s[hh * 3 + c] : 0.0f);
            score[j + c] = acc;
        }
        j += nk;
    }
}

void kv_index_topk_one(const index_query *Q, const float *keys, const int64_t *phys, int64_t n, int64_t k,
                       int64_t *out, float *scratch, int64_t threads) {
    float *score = scratch;
    const int64_t th = threads < 1 || n * Q->heads * Q->dim < KV_SERIAL_MACS ? 1 : threads;
    #pragma omp parallel for num_threads(th) schedule(static, 1) if (th > 1)
    for (int64_t t = 0; t < th; t++) index_scores_run(Q, keys, phys, n * t / th, n * (t + 1) / th, score);
    /* best[0..cnt) sorted by (score desc, index asc); an entry enters only if strictly better than
     * the current k-th (a later index never wins a tie) */
    int64_t cnt = 0;
    for (int64_t j = 0; j < n; j++) {
        float s = score[j];
        if (cnt == k && !(s > score[out[k - 1]])) continue;
        int64_t pos = cnt < k ? cnt++ : k - 1;
        while (pos > 0 && s > score[out[pos - 1]]) { out[pos] = out[pos - 1]; pos--; }
        out[pos] = j;
    }
    for (int64_t i = 1; i < cnt; i++) /* ascending index order */
        for (int64_t p = i; p > 0 && out[p - 1] > out[p]; p--) { int64_t t = out[p]; out[p] = out[p - 1]; out[p - 1] = t; }
}

/* ---- compressor pooling (fold.py's pool_windows) ---------------------------------------------------
 * kv, score [L, m*c] rows of consecutive positions; per window and channel, a softmax over its slots
 * (overlap: the previous window's rows' first halves, then its own rows' second halves; else its
 * own rows) weights the kv slots; an all -inf column pools to 0. out [n_w, c]. */
int kv_pool_windows(const float *kv, const float *score, int64_t n_w, int64_t ratio, int64_t c_total,
                    int overlap, float *out) {
    int64_t c = overlap ? c_total / 2 : c_total, slots = overlap ? 2 * ratio : ratio;
    float *mx = malloc(sizeof(float) * (size_t)c), *z = malloc(sizeof(float) * (size_t)c);
    float *e = malloc(sizeof(float) * (size_t)(slots * c));
    if (!mx || !z || !e) { free(mx); free(z); free(e); return -1; }
    for (int64_t w = 0; w < n_w; w++) {
        for (int64_t j = 0; j < c; j++) { mx[j] = -INFINITY; z[j] = 0.0f; }
        for (int64_t s = 0; s < slots; s++) {
            const float *sc = overlap ? (s < ratio ? score + (w * ratio + s) * c_total
                                                   : score + ((w + 1) * ratio + s - ratio) * c_total + c)
                                      : score + (w * ratio + s) * c_total;
            for (int64_t j = 0; j < c; j++) if (sc[j] > mx[j]) mx[j] = sc[j];
        }
        for (int64_t s = 0; s < slots; s++) {
            const float *sc = overlap ? (s < ratio ? score + (w * ratio + s) * c_total
                                                   : score + ((w + 1) * ratio + s - ratio) * c_total + c)
                                      : score + (w * ratio + s) * c_total;
            float *es = e + s * c;
            for (int64_t j = 0; j < c; j++) {
                es[j] = mx[j] == -INFINITY ? 0.0f : expf(sc[j] - mx[j]);
                z[j] += es[j];
            }
        }
        float *o = out + w * c;
        for (int64_t j = 0; j < c; j++) o[j] = 0.0f;
        for (int64_t s = 0; s < slots; s++) {
            const float *kr = overlap ? (s < ratio ? kv + (w * ratio + s) * c_total
                                                   : kv + ((w + 1) * ratio + s - ratio) * c_total + c)
                                      : kv + (w * ratio + s) * c_total;
            const float *es = e + s * c;
            for (int64_t j = 0; j < c; j++)
                if (z[j] > 0.0f) o[j] += kr[j] * (es[j] / z[j]);
        }
    }
    free(mx); free(z); free(e);
    return 0;
}

#include "native_attention.h" /* the attention layer's fused halves, composed of the kernels above */
#include "native_block.h"     /* a V4 block's decode row, composed of the attention's halves and the MoE row */
#include "native_abi.h"       /* every struct's layout, for native_abi.py's check at load */
