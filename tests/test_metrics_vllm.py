"""/metrics with vLLM's semantics under vLLM's names after the prefix (server/metrics.py): running
and waiting requests, KV-cache usage, prefix-cache queries and hits in tokens, time-to-first-token
and inter-token histograms, speculative acceptance per draft position."""
import kvfold
from kvfold import Engine, SamplingParams
from kvfold.engine.latency import ITL_BUCKETS, TTFT_BUCKETS, RequestLatency
from kvfold.engine.sequence import RequestOutput
from kvfold.server.metrics import parse, render


def out(rid, n_tokens, finished=False):
    return RequestOutput(rid, [1] * n_tokens, "", finished, "stop" if finished else None, 3, n_tokens, 0)


def test_latency_histograms_put_each_interval_in_its_bucket():
    now = [0.0]
    lat = RequestLatency(clock=lambda: now[0])
    lat.arrived("a")
    lat.arrived("b")
    now[0] = 0.03
    lat.observe([out("a", 1)])  # a: first token after 30 ms
    now[0] = 0.2
    lat.observe([out("a", 2), out("b", 1)])  # a: two tokens 170 ms later (85 ms each); b: first after 200 ms
    now[0] = 0.25
    lat.observe([out("b", 1, finished=True)])  # b: 50 ms; finished requests are forgotten
    lat.observe([out("b", 1)])  # a stray output of a forgotten request counts nowhere
    text = render(lat.metrics())
    m = parse(text)
    assert m["kvfold_time_to_first_token_seconds_count"] == 2
    assert abs(m["kvfold_time_to_first_token_seconds_sum"] - 0.23) < 1e-12
    assert m['kvfold_time_to_first_token_seconds_bucket{le="0.02"}'] == 0
    assert m['kvfold_time_to_first_token_seconds_bucket{le="0.04"}'] == 1
    assert m['kvfold_time_to_first_token_seconds_bucket{le="0.25"}'] == 2
    assert m["kvfold_inter_token_latency_seconds_count"] == 3
    assert m['kvfold_inter_token_latency_seconds_bucket{le="0.05"}'] == 1  # b's 50 ms (upper bounds inclusive)
    assert m['kvfold_inter_token_latency_seconds_bucket{le="0.1"}'] == 3  # and a's two of 85 ms
    assert m['kvfold_inter_token_latency_seconds_bucket{le="+Inf"}'] == 3
    assert len([k for k in m if k.startswith("kvfold_time_to_first_token_seconds_bucket")]) == len(TTFT_BUCKETS) + 1
    assert len([k for k in m if k.startswith("kvfold_inter_token_latency_seconds_bucket")]) == len(ITL_BUCKETS) + 1


def test_an_engines_metrics_read_as_vllms():
    tiny = kvfold.load_model("tiny")  # trained, with its MTP layer: its drafts are often accepted
    text = "The with statement is used to wrap the execution of a block with methods defined by a context manager. "
    prompts = [tiny.tokenizer.encode(text * 15)[:200], tiny.tokenizer.encode("A list comprehension " * 60)[:150]]
    engine = Engine(tiny, max_seq_len=512, speculative="mtp", num_draft=3)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    done = engine.generate(prompts, sp) + engine.generate(prompts[:1], sp)  # the repeat hits the prefix cache
    m = parse(render(engine.metrics()))
    assert m["kvfold_num_requests_running"] == m["kvfold_num_requests_waiting"] == 0
    assert 0 <= m["kvfold_kv_cache_usage_perc"] <= 1
    raw = engine.metrics()
    assert m["kvfold_prefix_cache_queries_total"] == raw["prefix_cache_lookup_tokens"] > 0
    assert m["kvfold_prefix_cache_hits_total"] == raw["prefix_cache_hit_tokens"] >= 128  # the repeated prompt
    assert m["kvfold_prefix_cache_request_hits_total"] == raw["prefix_cache_hits"] >= 1
    assert m["kvfold_time_to_first_token_seconds_count"] == 3
    generated = sum(len(c.token_ids) for c in done)
    assert m["kvfold_inter_token_latency_seconds_count"] == generated - 3
    per_pos = [m[f'kvfold_spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(3)]
    assert per_pos == sorted(per_pos, reverse=True) and per_pos[0] > 0  # a later draft needs every earlier one
    assert sum(per_pos) == m["kvfold_spec_decode_num_accepted_tokens_total"]
    assert m["kvfold_spec_decode_num_draft_tokens_total"] >= m["kvfold_spec_decode_num_accepted_tokens_total"]
    assert 0 < m["kvfold_spec_decode_num_drafts_total"] <= m["kvfold_spec_decode_num_draft_tokens_total"]
    assert m["kvfold_spec_decode_mean_accepted_length"] == \
        1 + m["kvfold_spec_decode_num_accepted_tokens_total"] / m["kvfold_spec_decode_num_drafts_total"]
