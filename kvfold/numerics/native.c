/* kvfold native kernels: fp32 CPU row kernels for the ops whose cost on the CPU is per-call
 * overhead, not arithmetic (a decode step runs each on one row).
 *
 * Every kernel treats each row on its own, with a fixed order of operations, so a row's result
 * never depends on how many rows share the call (batch-invariant by construction). Reductions
 * use fixed partial sums (no reassociation flags), so results are deterministic per build.
 * Loaded through ctypes by native.py, which compiles this file once per machine.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

/* sum_i a[i] * b[i] with LANES fixed partial sums (vectorizes without -ffast-math) */
static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    float tail = 0.0f;
    for (; i < n; i++) tail += a[i] * b[i];
    float s = 0.0f;
    for (int j = 0; j < LANES; j++) s += acc[j];
    return s + tail;
}

static inline double sum_squares(const float *x, int64_t n) {
    double acc[4] = {0};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) acc[j] += (double)x[i + j] * (double)x[i + j];
    double tail = 0.0;
    for (; i < n; i++) tail += (double)x[i] * (double)x[i];
    return (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail;
}

/* y[N] = W[N, K] @ x[K] */
static void gemv(const float *w, const float *x, float *y, int64_t n, int64_t k) {
    for (int64_t j = 0; j < n; j++) y[j] = dot(w + j * k, x, k);
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
void kv_rope(const float *x, const float *cs, const float *sn, float *out, int64_t t, int64_t inner,
             int64_t d, int64_t half, int inverse) {
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

/* ---- mHC ------------------------------------------------------------------------------------------
 * collapse: per row, mix = flat(streams) @ fn^T (fn [(2+hc)*hc, hc*d]); r = rsqrt(mean(flat^2)+eps);
 * in float64: pre = sigmoid(mix*r*s0 + b) + eps, post = 2 sigmoid(mix*r*s1 + b),
 * comb = Sinkhorn(softmax_rows(mix*r*s2 + b) + eps); then x = sum_k pre_k * stream_k (fp32). */
#define HC_MAX 16

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

static void weighted_streams(const float *xs, const float *p, float *out, int hc, int64_t d) {
    for (int64_t i = 0; i < d; i++) {
        float acc = p[0] * xs[i];
        for (int k = 1; k < hc; k++) acc += p[k] * xs[k * d + i];
        out[i] = acc;
    }
}

/* returns 0, or -1 when hc is out of range (nothing written) */
int kv_hc_collapse(const float *streams, const float *fn, const float *base, const float *scale,
                   int64_t rows, int64_t hc, int64_t d, int64_t iters, double hc_eps, double norm_eps,
                   float *out, float *post, float *comb) {
    if (hc < 1 || hc > HC_MAX) return -1;
    int64_t n = (2 + hc) * hc, flat = hc * d;
    double s0 = scale[0], s1 = scale[1], s2 = scale[2];
    for (int64_t r = 0; r < rows; r++) {
        const float *xs = streams + r * flat;
        float mix[(2 + HC_MAX) * HC_MAX];
        for (int64_t j = 0; j < n; j++) mix[j] = dot(fn + j * flat, xs, flat);
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
int kv_hc_head(const float *streams, const float *fn, const float *base, const float *scale, int64_t rows,
               int64_t hc, int64_t d, double hc_eps, double norm_eps, float *out) {
    if (hc < 1 || hc > HC_MAX) return -1;
    int64_t flat = hc * d;
    for (int64_t r = 0; r < rows; r++) {
        const float *xs = streams + r * flat;
        double rs = (1.0 / sqrt(sum_squares(xs, flat) / (double)flat + norm_eps)) * (double)scale[0];
        float pre[HC_MAX];
        for (int64_t i = 0; i < hc; i++)
            pre[i] = (float)(sigmoid_d((double)dot(fn + i * flat, xs, flat) * rs + base[i]) + hc_eps);
        weighted_streams(xs, pre, out + r * d, (int)hc, d);
    }
    return 0;
}

/* expand: out_k = post_k * y + sum_j comb[j, k] * stream_j */
void kv_hc_expand(const float *streams, const float *y, const float *post, const float *comb, int64_t rows,
                  int64_t hc, int64_t d, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xs = streams + r * hc * d, *yr = y + r * d, *cb = comb + r * hc * hc;
        for (int64_t k = 0; k < hc; k++) {
            float pk = post[r * hc + k];
            float *o = out + (r * hc + k) * d;
            for (int64_t i = 0; i < d; i++) {
                float acc = cb[k] * xs[i];
                for (int64_t j = 1; j < hc; j++) acc += cb[j * hc + k] * xs[j * d + i];
                o[i] = pk * yr[i] + acc;
            }
        }
    }
}

/* ---- MoE for one row --------------------------------------------------------------------------------
 * scores = score(router_w @ x); ids = tid2eid[token] (hash layers) or the top k of scores + bias (ties
 * to the lower id); weights = scores[ids] / (sum + 1e-20) * route_scale (float64, rounded to fp32);
 * y = sum over ids in ascending order of w_e * down_e(silu(min(g, L)) * clamp(u, -L, L)) + shared(x).
 * scoring: 0 softmax, 1 sigmoid, 2 sqrt(softplus). Returns 0, or -1 on a bad argument (nothing written). */
#define MOE_MAX_K 64

/* act = silu(min(gate, L)) * clamp(up, -L, L) for gu = [gate | up] of n each */
static void swiglu(const float *gu, float *act, int64_t n, float limit) {
    for (int64_t i = 0; i < n; i++) {
        float g = gu[i] < limit ? gu[i] : limit;
        float u = gu[n + i];
        u = u < -limit ? -limit : (u > limit ? limit : u);
        act[i] = silu_f(g) * u;
    }
}

int kv_moe_one(const float *x, int64_t h, const float *router_w, int64_t e, int scoring, const float *bias,
               const int64_t *tid2eid, const int64_t *token, int64_t k, double route_scale,
               const float *w13, const float *w2, int64_t inter, float limit,
               const float *shared_gate, const float *shared_up, const float *shared_down, int64_t shared_inter,
               float *out) {
    if (k < 1 || k > MOE_MAX_K || k > e) return -1;
    float *scores = malloc(sizeof(float) * (size_t)e);
    int64_t buf = 2 * (inter > shared_inter ? inter : shared_inter);
    float *gu = malloc(sizeof(float) * (size_t)buf);
    float *act = malloc(sizeof(float) * (size_t)(buf / 2 + 1));
    float *y = malloc(sizeof(float) * (size_t)h);
    if (!scores || !gu || !act || !y) { free(scores); free(gu); free(act); free(y); return -1; }

    gemv(router_w, x, scores, e, h);
    if (scoring == 0) {
        float mx = -INFINITY, z = 0.0f;
        for (int64_t i = 0; i < e; i++) if (scores[i] > mx) mx = scores[i];
        for (int64_t i = 0; i < e; i++) { scores[i] = expf(scores[i] - mx); z += scores[i]; }
        for (int64_t i = 0; i < e; i++) scores[i] /= z;
    } else if (scoring == 1) {
        for (int64_t i = 0; i < e; i++) scores[i] = 1.0f / (1.0f + expf(-scores[i]));
    } else {
        for (int64_t i = 0; i < e; i++) {
            float z = scores[i];
            scores[i] = sqrtf(z > 20.0f ? z : log1pf(expf(z)));
        }
    }

    int64_t ids[MOE_MAX_K];
    if (tid2eid) {
        for (int64_t j = 0; j < k; j++) ids[j] = tid2eid[token[0] * k + j];
    } else { /* k passes of argmax over biased scores, ties to the lower id */
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            float bv = 0.0f;
            for (int64_t i = 0; i < e; i++) {
                int taken = 0;
                for (int64_t q = 0; q < j; q++) taken |= ids[q] == i;
                if (taken) continue;
                float v = scores[i] + bias[i];
                if (best < 0 || v > bv) { best = i; bv = v; }
            }
            ids[j] = best;
        }
    }
    for (int64_t j = 0; j < k; j++)
        if (ids[j] < 0 || ids[j] >= e) { free(scores); free(gu); free(act); free(y); return -1; }
    double total = 0.0;
    for (int64_t j = 0; j < k; j++) total += scores[ids[j]];
    total += 1e-20;
    float wts[MOE_MAX_K];
    for (int64_t j = 0; j < k; j++) wts[j] = (float)((double)scores[ids[j]] / total * route_scale);
    /* experts in ascending id order (a stable insertion sort keeps equal ids in routing order) */
    for (int64_t j = 1; j < k; j++)
        for (int64_t q = j; q > 0 && ids[q - 1] > ids[q]; q--) {
            int64_t ti = ids[q]; ids[q] = ids[q - 1]; ids[q - 1] = ti;
            float tw = wts[q]; wts[q] = wts[q - 1]; wts[q - 1] = tw;
        }

    memset(out, 0, sizeof(float) * (size_t)h);
    for (int64_t j = 0; j < k; j++) {
        const float *wa = w13 + ids[j] * 2 * inter * h, *wb = w2 + ids[j] * h * inter;
        gemv(wa, x, gu, 2 * inter, h);
        swiglu(gu, act, inter, limit);
        gemv(wb, act, y, h, inter);
        for (int64_t i = 0; i < h; i++) out[i] += wts[j] * y[i];
    }
    if (shared_gate) {
        gemv(shared_gate, x, gu, shared_inter, h);
        gemv(shared_up, x, gu + shared_inter, shared_inter, h);
        swiglu(gu, act, shared_inter, limit);
        gemv(shared_down, act, y, h, shared_inter);
        for (int64_t i = 0; i < h; i++) out[i] += y[i];
    }
    free(scores); free(gu); free(act); free(y);
    return 0;
}

/* ---- one decode query's attention ---------------------------------------------------------------
 * q [h, d] (already scaled), window keys [nw, d], compressed keys: the first n_comp rows of pool
 * (sel NULL) or pool rows sel[0..n_comp) (-1 = no entry, skipped), logical row i at physical row
 * phys[i] (a paged pool) or i (phys NULL); one softmax per head over the
 * window logits, the compressed logits and the sink logit (which has no value); K = V. */
void kv_attend_one(const float *q, int64_t h, int64_t d, const float *keys_w, int64_t nw, const float *pool,
                   const int64_t *phys, const int64_t *sel, int64_t n_comp, const float *sinks, float *out,
                   float *scratch) {
    float *logit = scratch; /* nw + n_comp */
    for (int64_t hh = 0; hh < h; hh++) {
        const float *qh = q + hh * d;
        float mx = sinks[hh];
        for (int64_t j = 0; j < nw; j++) {
            logit[j] = dot(qh, keys_w + j * d, d);
            if (logit[j] > mx) mx = logit[j];
        }
        for (int64_t j = 0; j < n_comp; j++) {
            int64_t row = sel ? sel[j] : j;
            if (row < 0) { logit[nw + j] = -INFINITY; continue; }
            if (phys) row = phys[row];
            logit[nw + j] = dot(qh, pool + row * d, d);
            if (logit[nw + j] > mx) mx = logit[nw + j];
        }
        float z = expf(sinks[hh] - mx);
        for (int64_t j = 0; j < nw + n_comp; j++) { logit[j] = expf(logit[j] - mx); z += logit[j]; }
        float *o = out + hh * d;
        memset(o, 0, sizeof(float) * (size_t)d);
        for (int64_t j = 0; j < nw; j++) {
            float p = logit[j] / z;
            const float *kr = keys_w + j * d;
            for (int64_t i = 0; i < d; i++) o[i] += p * kr[i];
        }
        for (int64_t j = 0; j < n_comp; j++) {
            int64_t row = sel ? sel[j] : j;
            if (row < 0) continue;
            if (phys) row = phys[row];
            float p = logit[nw + j] / z;
            const float *kr = pool + row * d;
            for (int64_t i = 0; i < d; i++) o[i] += p * kr[i];
        }
    }
}

/* ---- one decode query's indexer top-k -------------------------------------------------------------
 * score_j = sum_h w[h] * relu(q_h . key_j) over the n entries (entry j at physical row phys[j], or
 * j when phys is NULL); the k best (higher first, ties to the
 * lower index), written to out in ascending index order. scratch holds n floats. */
void kv_index_topk_one(const float *q, const float *w, int64_t h, int64_t d, const float *keys,
                       const int64_t *phys, int64_t n, int64_t k, int64_t *out, float *scratch) {
    float *score = scratch;
    for (int64_t j = 0; j < n; j++) {
        const float *kr = keys + (phys ? phys[j] : j) * d;
        float acc = 0.0f;
        for (int64_t hh = 0; hh < h; hh++) {
            float s = dot(q + hh * d, kr, d);
            acc += w[hh] * (s > 0.0f ? s : 0.0f);
        }
        score[j] = acc;
    }
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
