/* kvfold native kernels: the layout of every struct the Python side mirrors with ctypes
 * (numerics/native_abi.py), as this compiler laid it out. Included last in native.c, after every
 * struct it lists.
 *
 * ctypes cannot read a C header: each mirror is written by hand, and a field added, moved or
 * retyped on one side only would make the kernels read the wrong bytes, silently. So the library
 * exports this table (kv_abi_layout), and the loader compares it with every mirror before any
 * kernel runs, refusing the library on the first difference. A struct listed here has every one
 * of its fields listed; a new struct passed to a kernel gets its lines here and a mirror there.
 */
#ifndef KV_NATIVE_ABI_H
#define KV_NATIVE_ABI_H

/* one line of the table: a struct's size (field "") or one field's offset and size */
typedef struct {
    const char *type, *field;
    int64_t offset, size;
} kv_abi_field;

#define ABI_STRUCT(T) {#T, "", 0, (int64_t)sizeof(T)}
#define ABI_FIELD(T, f) {#T, #f, (int64_t)offsetof(T, f), (int64_t)sizeof(((T *)0)->f)}

static const kv_abi_field abi_layout[] = {
    ABI_STRUCT(kv_abi_field), ABI_FIELD(kv_abi_field, type), ABI_FIELD(kv_abi_field, field),
    ABI_FIELD(kv_abi_field, offset), ABI_FIELD(kv_abi_field, size),

    ABI_STRUCT(kv_weights), ABI_FIELD(kv_weights, fmt), ABI_FIELD(kv_weights, scale_f32), ABI_FIELD(kv_weights, data),
    ABI_FIELD(kv_weights, scale), ABI_FIELD(kv_weights, br), ABI_FIELD(kv_weights, bc), ABI_FIELD(kv_weights, k),
    ABI_FIELD(kv_weights, data_stride), ABI_FIELD(kv_weights, scale_stride), ABI_FIELD(kv_weights, row_phase),
    ABI_FIELD(kv_weights, nan_codes), ABI_FIELD(kv_weights, subnormal_blocks),
    ABI_FIELD(kv_weights, subnormal_stride), ABI_FIELD(kv_weights, piece_data), ABI_FIELD(kv_weights, piece_scale),
    ABI_FIELD(kv_weights, piece_subnormal), ABI_FIELD(kv_weights, pieces), ABI_FIELD(kv_weights, piece_rows),
    ABI_FIELD(kv_weights, dot),

    ABI_STRUCT(mm_job), ABI_FIELD(mm_job, x), ABI_FIELD(mm_job, ldx), ABI_FIELD(mm_job, w), ABI_FIELD(mm_job, index),
    ABI_FIELD(mm_job, out), ABI_FIELD(mm_job, ldo), ABI_FIELD(mm_job, m), ABI_FIELD(mm_job, n),

    ABI_STRUCT(kv_matmul_args), ABI_FIELD(kv_matmul_args, x), ABI_FIELD(kv_matmul_args, ldx),
    ABI_FIELD(kv_matmul_args, w), ABI_FIELD(kv_matmul_args, out), ABI_FIELD(kv_matmul_args, ldo),
    ABI_FIELD(kv_matmul_args, m), ABI_FIELD(kv_matmul_args, n), ABI_FIELD(kv_matmul_args, k),
    ABI_FIELD(kv_matmul_args, threads),

    ABI_STRUCT(kv_rope_args), ABI_FIELD(kv_rope_args, x), ABI_FIELD(kv_rope_args, cs), ABI_FIELD(kv_rope_args, sn),
    ABI_FIELD(kv_rope_args, out), ABI_FIELD(kv_rope_args, t), ABI_FIELD(kv_rope_args, inner),
    ABI_FIELD(kv_rope_args, d), ABI_FIELD(kv_rope_args, half), ABI_FIELD(kv_rope_args, inverse),

    ABI_STRUCT(hc_params), ABI_FIELD(hc_params, fn), ABI_FIELD(hc_params, base), ABI_FIELD(hc_params, scale),
    ABI_FIELD(hc_params, iters), ABI_FIELD(hc_params, hc_eps), ABI_FIELD(hc_params, norm_eps),

    ABI_STRUCT(route_params), ABI_FIELD(route_params, h), ABI_FIELD(route_params, e), ABI_FIELD(route_params, k),
    ABI_FIELD(route_params, n_group), ABI_FIELD(route_params, topk_group), ABI_FIELD(route_params, scoring),
    ABI_FIELD(route_params, renorm), ABI_FIELD(route_params, route_scale), ABI_FIELD(route_params, router_w),
    ABI_FIELD(route_params, bias), ABI_FIELD(route_params, tid2eid),

    ABI_STRUCT(moe_layer), ABI_FIELD(moe_layer, route), ABI_FIELD(moe_layer, inter),
    ABI_FIELD(moe_layer, shared_inter), ABI_FIELD(moe_layer, limit), ABI_FIELD(moe_layer, w13),
    ABI_FIELD(moe_layer, w2), ABI_FIELD(moe_layer, shared_gate), ABI_FIELD(moe_layer, shared_up),
    ABI_FIELD(moe_layer, shared_down),

    ABI_STRUCT(attend_keys), ABI_FIELD(attend_keys, window), ABI_FIELD(attend_keys, window_n),
    ABI_FIELD(attend_keys, pool), ABI_FIELD(attend_keys, phys), ABI_FIELD(attend_keys, sel),
    ABI_FIELD(attend_keys, n_comp),

    ABI_STRUCT(index_query), ABI_FIELD(index_query, q), ABI_FIELD(index_query, w), ABI_FIELD(index_query, heads),
    ABI_FIELD(index_query, dim),

    ABI_STRUCT(compressor_proj), ABI_FIELD(compressor_proj, kv), ABI_FIELD(compressor_proj, gate),
    ABI_FIELD(compressor_proj, bias), ABI_FIELD(compressor_proj, cols), ABI_FIELD(compressor_proj, ratio),

    ABI_STRUCT(attn_project_layer), ABI_FIELD(attn_project_layer, hid), ABI_FIELD(attn_project_layer, q_rank),
    ABI_FIELD(attn_project_layer, heads), ABI_FIELD(attn_project_layer, head_dim),
    ABI_FIELD(attn_project_layer, half), ABI_FIELD(attn_project_layer, eps), ABI_FIELD(attn_project_layer, q_a),
    ABI_FIELD(attn_project_layer, q_b), ABI_FIELD(attn_project_layer, kv), ABI_FIELD(attn_project_layer, q_norm),
    ABI_FIELD(attn_project_layer, kv_norm), ABI_FIELD(attn_project_layer, comp),
    ABI_FIELD(attn_project_layer, index), ABI_FIELD(attn_project_layer, index_q_b),
    ABI_FIELD(attn_project_layer, index_w), ABI_FIELD(attn_project_layer, index_heads),
    ABI_FIELD(attn_project_layer, index_dim), ABI_FIELD(attn_project_layer, index_w_scale),
    ABI_FIELD(attn_project_layer, threads),

    ABI_STRUCT(attn_output_layer), ABI_FIELD(attn_output_layer, hid), ABI_FIELD(attn_output_layer, heads),
    ABI_FIELD(attn_output_layer, head_dim), ABI_FIELD(attn_output_layer, half),
    ABI_FIELD(attn_output_layer, groups), ABI_FIELD(attn_output_layer, rank), ABI_FIELD(attn_output_layer, o_a),
    ABI_FIELD(attn_output_layer, o_b), ABI_FIELD(attn_output_layer, threads),

    ABI_STRUCT(attn_rows), ABI_FIELD(attn_rows, q), ABI_FIELD(attn_rows, kv), ABI_FIELD(attn_rows, comp_kv),
    ABI_FIELD(attn_rows, comp_score), ABI_FIELD(attn_rows, index_kv), ABI_FIELD(attn_rows, index_score),
    ABI_FIELD(attn_rows, index_q), ABI_FIELD(attn_rows, index_w),

    ABI_STRUCT(fold_state), ABI_FIELD(fold_state, kv), ABI_FIELD(fold_state, score), ABI_FIELD(fold_state, rows),
    ABI_FIELD(fold_state, cols), ABI_FIELD(fold_state, ratio), ABI_FIELD(fold_state, overlap),
    ABI_FIELD(fold_state, pool), ABI_FIELD(fold_state, phys), ABI_FIELD(fold_state, width),
    ABI_FIELD(fold_state, norm), ABI_FIELD(fold_state, eps),

    ABI_STRUCT(sequence_layer), ABI_FIELD(sequence_layer, window), ABI_FIELD(sequence_layer, window_rows),
    ABI_FIELD(sequence_layer, window_len), ABI_FIELD(sequence_layer, heads), ABI_FIELD(sequence_layer, head_dim),
    ABI_FIELD(sequence_layer, half), ABI_FIELD(sequence_layer, topk), ABI_FIELD(sequence_layer, kind),
    ABI_FIELD(sequence_layer, q_scale), ABI_FIELD(sequence_layer, sinks), ABI_FIELD(sequence_layer, comp),
    ABI_FIELD(sequence_layer, index), ABI_FIELD(sequence_layer, index_heads), ABI_FIELD(sequence_layer, index_dim),
    ABI_FIELD(sequence_layer, threads),

    ABI_STRUCT(hc_entry), ABI_FIELD(hc_entry, hc), ABI_FIELD(hc_entry, norm), ABI_FIELD(hc_entry, eps),

    ABI_STRUCT(block_layer), ABI_FIELD(block_layer, hc), ABI_FIELD(block_layer, hid), ABI_FIELD(block_layer, attn),
    ABI_FIELD(block_layer, ffn), ABI_FIELD(block_layer, project), ABI_FIELD(block_layer, output),
    ABI_FIELD(block_layer, moe), ABI_FIELD(block_layer, moe_threads),

    ABI_STRUCT(decode_rows), ABI_FIELD(decode_rows, n), ABI_FIELD(decode_rows, start), ABI_FIELD(decode_rows, token),
    ABI_FIELD(decode_rows, cs), ABI_FIELD(decode_rows, sn), ABI_FIELD(decode_rows, emit_cs),
    ABI_FIELD(decode_rows, emit_sn),

    ABI_STRUCT(model_layer), ABI_FIELD(model_layer, hc), ABI_FIELD(model_layer, hid), ABI_FIELD(model_layer, vocab),
    ABI_FIELD(model_layer, layers), ABI_FIELD(model_layer, embed), ABI_FIELD(model_layer, head),
    ABI_FIELD(model_layer, norm), ABI_FIELD(model_layer, norm_eps), ABI_FIELD(model_layer, lm_head),
    ABI_FIELD(model_layer, head_threads),

    ABI_STRUCT(model_rows), ABI_FIELD(model_rows, n), ABI_FIELD(model_rows, start), ABI_FIELD(model_rows, token),
    ABI_FIELD(model_rows, rope), ABI_FIELD(model_rows, emit),
};

/* the table above; *count: its lines */
const kv_abi_field *kv_abi_layout(int64_t *count) {
    *count = (int64_t)(sizeof abi_layout / sizeof abi_layout[0]);
    return abi_layout;
}

#endif
