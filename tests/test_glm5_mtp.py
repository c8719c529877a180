"""GLM-5.3's MTP layer (kvfold/models/glm5/mtp.py). transformers 5.23 has no implementation of it (its
glm5_next ignores `layers.45.*`), so the reference is the formula the release's NextN layer follows
(DeepSeek-V3 NextN, as SGLang and vLLM run it), written here from transformers' own Glm5Next
attention (DSA with its indexer), MoE and RMSNorm modules loaded with the very tensors the
checkpoint stores, over transformers' main-model hidden states."""
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import kvfold
from kvfold.errors import CapacityError, CheckpointError
from helpers import fp32_paths_bound, random_ids
from test_glm5_next import TEXT, VISION, _randomize

N_LAYERS = TEXT["num_hidden_layers"]
PREFIX = f"model.language_model.layers.{N_LAYERS}."


def hf_mtp_layer(text_config):
    """The NextN layer from transformers' modules: attention as a full-indexer DSA layer (layer 1's
    kind), score-routed MoE, five RMSNorms and eh_proj, no mHC."""
    from transformers.models.glm5_next.modeling_glm5_next import (Glm5NextTextAttention, Glm5NextTextMoE,
                                                                  Glm5NextTextRMSNorm)
    h, eps = text_config.hidden_size, text_config.rms_norm_eps
    assert text_config.layer_types[1] == "indexed_attention" and text_config.indexer_types[1] == "full"
    m = nn.Module()
    m.enorm, m.hnorm = Glm5NextTextRMSNorm(h, eps), Glm5NextTextRMSNorm(h, eps)
    m.eh_proj = nn.Linear(2 * h, h, bias=False)
    m.input_layernorm, m.post_attention_layernorm = Glm5NextTextRMSNorm(h, eps), Glm5NextTextRMSNorm(h, eps)
    m.self_attn = Glm5NextTextAttention(text_config, 1)
    m.mlp = Glm5NextTextMoE(text_config)
    m.shared_head = nn.Module()
    m.shared_head.norm = Glm5NextTextRMSNorm(h, eps)
    return m.eval()


@pytest.fixture(scope="module")
def mtp_pair(tmp_path_factory):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration
    torch.manual_seed(0)
    hf = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=dict(TEXT), vision_config=VISION))
    hf.set_attn_implementation("eager")
    _randomize(hf)
    hf.eval()
    d = tmp_path_factory.mktemp("glm5_mtp")
    hf.save_pretrained(d)
    layer = hf_mtp_layer(hf.config.text_config)
    layer.self_attn.config._attn_implementation = "eager"
    _randomize(layer, seed=1)
    tensors = {PREFIX + k: v.detach().clone().contiguous() for k, v in layer.state_dict().items()}
    # copies of the embedding and the head, as some releases store them: the main model's serve
    tensors[PREFIX + "embed_tokens.weight"] = torch.zeros(TEXT["vocab_size"], TEXT["hidden_size"])
    tensors[PREFIX + "shared_head.head.weight"] = torch.zeros(TEXT["vocab_size"], TEXT["hidden_size"])
    save_file(tensors, d / "mtp.safetensors")
    return hf, layer, kvfold.load_model(d), d


def reference_logits(hf, layer, ids):
    """NextN at positions 0..T-2: eh_proj([enorm(embed(x_{t+1})), hnorm(h_t)]), one pre-norm DSA +
    MoE layer with plain residuals, shared_head.norm, the main lm_head; h_t is transformers' final
    hidden state (final norm of the mHC stream mean)."""
    with torch.no_grad():
        text = hf.model.language_model
        h = text(input_ids=ids[None], use_cache=False).last_hidden_state
        x = layer.eh_proj(torch.cat([layer.enorm(text.embed_tokens(ids[None, 1:])), layer.hnorm(h[:, :-1])], -1))
        mask = torch.ones(1, ids.numel() - 1, dtype=torch.bool)
        a = x + layer.self_attn(hidden_states=layer.input_layernorm(x), attention_mask=mask)[0]
        out = a + layer.mlp(layer.post_attention_layernorm(a))
        return hf.lm_head(layer.shared_head.norm(out))[0].float()


def mtp_logits(model, ids, pieces):
    st = model.new_state(capacity=ids.numel())
    _, streams = model.forward(ids, st, return_hidden=True)
    ms = model.new_mtp_state(capacity=ids.numel(), max_rewind=4)
    out, p = [], 0
    for n in pieces:
        out.append(model.mtp_step(streams[p:p + n], ids[p + 1:p + 1 + n], ms)[0])
        p += n
    assert ms.pos == p
    return torch.cat(out)


def test_checkpoint_mtp_layer_loads_and_the_plain_one_has_none(mtp_pair, tmp_path):
    _, _, model, d = mtp_pair
    assert model.supports_mtp and type(model.mtp).__name__ == "Glm5Mtp"
    assert not any(n.startswith("mtp.") and "embed" in n for n, _ in model.named_parameters())
    import shutil
    bare = tmp_path / "bare"
    shutil.copytree(d, bare)
    (bare / "mtp.safetensors").unlink()
    assert not kvfold.load_model(bare).supports_mtp


@pytest.mark.parametrize("n", [2, 5, 9, 40])
def test_mtp_logits_match_the_nextn_formula(mtp_pair, n):
    hf, layer, model, _ = mtp_pair
    ids = random_ids(n, TEXT["vocab_size"], seed=n)
    want = reference_logits(hf, layer, ids)
    got = mtp_logits(model, ids, [n - 1])
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= fp32_paths_bound(want, N_LAYERS + 1)


def test_mtp_in_pieces_equals_one_call(mtp_pair):
    """The MTP layer's own latent and indexer rows carry across calls: a prefill piece, then steps
    of one and three positions give the logits of one call (up to fp32 paths)."""
    hf, layer, model, _ = mtp_pair
    ids = random_ids(30, TEXT["vocab_size"], seed=3)
    want = reference_logits(hf, layer, ids)
    got = mtp_logits(model, ids, [17, 1, 3, 1, 7])
    assert (got - want).abs().max().item() <= fp32_paths_bound(want, N_LAYERS + 1)


def test_mtp_state_rewinds_exactly_and_refuses_past_capacity(mtp_pair):
    _, _, model, _ = mtp_pair
    ids = random_ids(20, TEXT["vocab_size"], seed=4)
    st = model.new_state(capacity=20)
    _, streams = model.forward(ids, st, return_hidden=True)
    a, b = model.new_mtp_state(capacity=18, max_rewind=3), model.new_mtp_state(capacity=18, max_rewind=3)
    model.mtp_step(streams[:10], ids[1:11], a)
    model.mtp_step(streams[:10], ids[1:11], b)
    _, y = model.mtp_step(streams[10:11], ids[11:12], a)
    model.mtp_step(y, [5], a)  # a draft step from its own output, then rejected
    model.mtp_step(y, [7], a)
    a.rewind_to(11)
    model.mtp_step(streams[10:11], ids[11:12], b)
    assert torch.equal(model.mtp_step(streams[11:15], ids[12:16], a)[0], model.mtp_step(streams[11:15], ids[12:16], b)[0])
    with pytest.raises(CapacityError):
        model.mtp_step(streams[15:19], ids[16:20], a)
    assert a.pos == 15


def test_mtp_greedy_generation_equals_plain(mtp_pair):
    _, _, model, _ = mtp_pair
    prompt = random_ids(12, TEXT["vocab_size"], seed=9).tolist()
    plain = kvfold.generate(model, prompt, 24, stop_ids=[]).tokens
    for k in (1, 2, 4):
        res = kvfold.generate(model, prompt, 24, stop_ids=[], speculative="mtp", num_draft=k)
        assert res.tokens == plain, k
        assert res.drafted > 0 and res.verify_steps + res.accepted == 23


def test_incomplete_mtp_layer_is_refused(mtp_pair, tmp_path):
    import shutil
    from safetensors.torch import load_file
    _, _, _, d = mtp_pair
    broken = tmp_path / "broken"
    shutil.copytree(d, broken)
    t = load_file(broken / "mtp.safetensors")
    del t[PREFIX + "eh_proj.weight"]
    save_file(t, broken / "mtp.safetensors")
    with pytest.raises(CheckpointError, match="mtp.eh_proj.weight"):
        kvfold.load_model(broken)


def test_engine_speculates_with_the_glm_mtp_layer(mtp_pair):
    """speculative="mtp" in the engine (which the server runs): the MTP layer drafts for
    every GLM-5.3 sequence of a batch; outputs equal the plain engine's."""
    from kvfold import Engine, SamplingParams
    _, _, model, _ = mtp_pair
    prompts = [random_ids(n, TEXT["vocab_size"], seed=n).tolist() for n in (3, 12, 140)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain_engine = Engine(model, max_seq_len=200)
    engine = Engine(model, max_seq_len=200, speculative="mtp", num_draft=3)
    for batch in (prompts, [prompts[2][:130] + [1, 2]]):  # the second hits the prefix cache at 128
        plain = plain_engine.generate(batch, params)
        spec = engine.generate(batch, params)
        assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert engine.metrics()["prefix_cache_hits"] == 1
    outs = []
    for e in (plain_engine, engine):  # n = 2: the second choice's drafter joins at its first decode
        rids = e.add_choices(prompts[1], [params] * 2)
        got = {r: [] for r in rids}
        while e.has_unfinished():
            for o in e.step():
                got[o.request_id] += o.new_token_ids
        outs.append(list(got.values()))
    assert outs[0] == outs[1]
    m = engine.metrics()
    assert m["spec_draft_tokens"] > 0 and m["live_states"] == 0 and engine.spec.dropped == 0


def test_server_with_mtp_speculation_answers_as_generate(mtp_pair):
    """`kvfold serve --speculative mtp` on a GLM-5.3 checkpoint with its MTP layer: a token-id
    completion over HTTP (the real openai client) equals plain kvfold.generate."""
    import openai
    from kvfold import Engine
    from kvfold.server.app import create_app
    from helpers import serving
    _, _, model, _ = mtp_pair
    prompt = random_ids(30, TEXT["vocab_size"], seed=30).tolist()
    want = kvfold.generate(model, prompt, 10, stop_ids=[]).tokens
    engine = Engine(model, max_seq_len=128, max_running=4, speculative="mtp", num_draft=2)
    with serving(create_app(engine, model_name="glm5", api_key="k")) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=60)
        r = c.completions.create(model="glm5", prompt=prompt, max_tokens=10, temperature=0,
                                 extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.choices[0].token_ids == want
    assert engine.metrics()["spec_draft_tokens"] > 0 and engine.metrics()["live_states"] == 0
