"""Train kvfold's built-in `tiny` model: a small DeepSeek-V4 that has read Python's documentation.

    .venv/bin/python tools/train_tiny.py            # writes kvfold/assets/tiny/ (about 31 minutes, 2 quiet cores)
    .venv/bin/python tools/train_tiny.py --steps 20 --out /tmp/tiny-smoke   # a quick smoke run

The text is on every machine that has Python, with no download, under the PSF licence (which
allows redistribution): the entries of `pydoc_data.topics` (the language reference that `help()`
prints) and the docstrings of the standard library's own modules, read with `ast` (nothing is
imported). Documents whose name hashes to 0 mod 50 are held out: the tokenizer and the model never
see them, and `heldout.txt` carries the first of them for `kvfold eval-ppl` and the tests.

The model is trained with transformers' `DeepseekV4ForCausalLM` (a training oracle here, never a
kvfold runtime dependency) plus an MTP block assembled from the same transformers layer classes in
the layout kvfold's `MtpModule` reads (models/deepseek_v4/mtp.py): X = e_proj(enorm(embed(x[t+1])))
+ h_proj(hnorm(H[t])), one sliding-window block, its own hc_head and norm, the shared lm_head. It is
trained jointly with the main model to predict token t+2 (loss weight 0.3, as in the V3 report).
Routed experts are balanced the V3/V4 way, without an auxiliary loss: after each step every
score-routed layer's selection bias moves by `BIAS_RATE` towards the less loaded experts.

The lightning indexer gets no gradient: its top-k choice is not differentiable, and the V4 report
trains it with a separate KL loss that this script leaves out. Its random projections still pick
which compressed entries each CSA query reads, and the model learns around that choice.

Everything is seeded; the run prints and records (in `training.json`) the Python version, the
corpus' SHA-256, the command and the final losses. After training, the script loads the written
directory with kvfold and checks its logits (main and MTP) against the training forward.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch import nn
from torch.nn import functional as F

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "kvfold" / "assets" / "tiny"
SEED = 0
VOCAB = 4096
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
HELDOUT_MOD = 50
HELDOUT_CHARS = 60_000
MTP_LOSS_WEIGHT = 0.3
BIAS_RATE = 1e-2
# stdlib trees that are tests, demos or vendored code rather than documentation
SKIPPED_TREES = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "ensurepip", "pydoc_data"}


# ---- corpus -------------------------------------------------------------------------------------

def corpus_documents() -> list[tuple[str, str]]:
    """[(name, text)] in a fixed order: pydoc topics, then stdlib docstrings by file and line."""
    from pydoc_data.topics import topics
    docs = [(f"topic:{k}", topics[k].strip()) for k in sorted(topics)]
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIPPED_TREES & set(rel.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)
                if text and len(text) >= 80:
                    docs.append((f"{rel}:{getattr(node, 'lineno', 0)}", text.strip()))
    return docs


def is_heldout(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % HELDOUT_MOD == 0


def corpus_digest(docs: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for name, text in docs:
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


# ---- tokenizer ----------------------------------------------------------------------------------

def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[BOS, EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


# ---- model --------------------------------------------------------------------------------------

def model_config(vocab_size: int, bos_id: int, eos_id: int):
    """Every layer kind (sliding, CSA, HCA), hash and score-routed MoE, mHC with 4 streams."""
    from transformers import DeepseekV4Config
    return DeepseekV4Config(
        vocab_size=vocab_size, hidden_size=256, num_hidden_layers=5,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, partial_rotary_factor=0.25,
        q_lora_rank=128, o_groups=2, o_lora_rank=64, sliding_window=64,
        index_n_heads=4, index_head_dim=32, index_topk=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
        scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
        rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=65536, tie_word_embeddings=False, hidden_act="silu",
        num_nextn_predict_layers=1, bos_token_id=bos_id, eos_token_id=eos_id,
        attn_implementation="eager", experts_implementation="eager", dtype="float32", use_cache=False,
    )


class MtpHead(nn.Module):
    """The MTP block, built from transformers' layer classes under the names kvfold loads as `mtp.0.*`."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
        block_cfg = config.__class__(**{**config.to_dict(), "num_hidden_layers": 1,
                                        "layer_types": ["sliding_attention"], "mlp_layer_types": ["moe"]})
        block_cfg._attn_implementation = "eager"
        block_cfg._experts_implementation = "eager"
        h = config.hidden_size
        self.e_proj = nn.Linear(h, h, bias=False)
        self.h_proj = nn.Linear(h, h, bias=False)
        self.enorm = hf.DeepseekV4RMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = hf.DeepseekV4RMSNorm(h, eps=config.rms_norm_eps)
        self.norm = hf.DeepseekV4RMSNorm(h, eps=config.rms_norm_eps)
        self.hc_head = hf.DeepseekV4HyperHead(block_cfg)
        self.block = hf.DeepseekV4DecoderLayer(block_cfg, 0)

    def forward(self, streams, next_embeds, layer_kwargs):
        x = self.e_proj(self.enorm(next_embeds)).unsqueeze(2) + self.h_proj(self.hnorm(streams))
        return self.norm(self.hc_head(self.block(x, **layer_kwargs)))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return {"mtp.0." + k.removeprefix("block."): v for k, v in self.state_dict().items()}


def build(config, seed: int):
    from transformers import DeepseekV4ForCausalLM
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config)
    mtp = MtpHead(config)
    mtp.apply(model._init_weights)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith("indexer.q_b_proj.weight"):
                w.copy_(paired_heads(w.shape, config.index_n_heads, g))
            elif name.endswith("indexer.scorer.weights_proj.weight"):
                w.copy_(torch.randn(w.shape, generator=g) / math.sqrt(w.shape[-1]))
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):  # hash routing: a fixed random expert set per token id
            buf.copy_(torch.stack([torch.randperm(config.n_routed_experts, generator=g)[: buf.shape[1]]
                                   for _ in range(buf.shape[0])]))
    return model, mtp


def paired_heads(shape, n_heads: int, g: torch.Generator) -> torch.Tensor:
    """The indexer's query projection with head h + n/2 the negation of head h. An indexer score is
    sum_h w_h * ReLU(q_h . k): with independent heads, every head is negative for about 1 / 2^n of the
    (query, entry) pairs, which then score exactly 0 and tie. With negated pairs one head of each pair
    is positive, so no score is 0 and kvfold's tie rule is never what decides a selection. The
    projection gets no gradient (see the module docstring), so the pairing holds after training."""
    w = (torch.randn(shape, generator=g) / math.sqrt(shape[-1])).view(n_heads, -1, shape[-1])
    w[n_heads // 2: 2 * (n_heads // 2)] = -w[: n_heads // 2]
    return w.reshape(shape)


def forward(model, mtp, ids: torch.Tensor):
    """ids [B, T + 2] -> (main logits [B, T, V] for ids[:, 1:T+1], MTP logits [B, T, V] for ids[:, 2:])."""
    from transformers.masking_utils import create_sliding_window_causal_mask
    body = model.model
    inputs, next_ids = ids[:, :-2], ids[:, 1:-1]
    embeds = body.embed_tokens(inputs)
    positions = torch.arange(inputs.shape[1]).unsqueeze(0)
    mask = create_sliding_window_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None,
                                             past_key_values=None, position_ids=positions)
    kwargs = dict(position_embeddings={"main": body.rotary_emb(embeds, position_ids=positions, layer_type="main"),
                                       "compress": body.rotary_emb(embeds, position_ids=positions,
                                                                   layer_type="compress")},
                  position_ids=positions, attention_mask=mask)
    streams = embeds.unsqueeze(2).expand(-1, -1, model.config.hc_mult, -1).contiguous()
    for layer in body.layers:
        streams = layer(streams, input_ids=inputs, **kwargs)
    logits = model.lm_head(body.norm(body.hc_head(streams)))
    mtp_logits = model.lm_head(mtp(streams, body.embed_tokens(next_ids), kwargs))
    return logits, mtp_logits


class ExpertBalancer:
    """Auxiliary-loss-free balancing: count each score-routed layer's selections during a step, then
    move its `e_score_correction_bias` by `BIAS_RATE` towards the experts that got fewer tokens."""

    def __init__(self, modules):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter
        self.routers = [m for root in modules for m in root.modules() if isinstance(m, DeepseekV4TopKRouter)]
        self.counts = {id(r): torch.zeros(r.num_experts) for r in self.routers}
        for r in self.routers:
            r.register_forward_hook(self._count)

    def _count(self, router, inputs, output):
        self.counts[id(router)] += torch.bincount(output[2].flatten(), minlength=router.num_experts).float()

    @torch.no_grad()
    def step(self) -> float:
        worst = 0.0
        for r in self.routers:
            c = self.counts[id(r)]
            r.e_score_correction_bias += BIAS_RATE * torch.sign(c.mean() - c)
            worst = max(worst, float(c.max() / c.mean().clamp_min(1)))
            c.zero_()
        return worst


def batches(stream: torch.Tensor, bos_id: int, batch: int, length: int, g: torch.Generator):
    """Windows of `length + 1` tokens at random offsets, each behind a BOS (as prompts are at inference)."""
    while True:
        starts = torch.randint(0, stream.numel() - length - 1, (batch,), generator=g)
        rows = torch.stack([stream[s: s + length + 1] for s in starts.tolist()])
        yield torch.cat([torch.full((batch, 1), bos_id), rows], dim=1)


def learning_rate(step: int, steps: int, peak: float, warmup: int = 50) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


@torch.no_grad()
def heldout_loss(model, mtp, ids: torch.Tensor) -> tuple[float, float]:
    model.eval(), mtp.eval()
    logits, mtp_logits = forward(model, mtp, ids)
    model.train(), mtp.train()
    return (F.cross_entropy(logits.flatten(0, 1), ids[:, 1:-1].flatten()).item(),
            F.cross_entropy(mtp_logits.flatten(0, 1), ids[:, 2:].flatten()).item())


def train(args) -> None:
    torch.set_num_threads(args.threads)
    started = time.time()
    docs = corpus_documents()
    train_docs = [t for n, t in docs if not is_heldout(n)]
    held_docs = [t for n, t in docs if is_heldout(n)]
    print(f"corpus: {len(docs)} documents, {sum(map(len, train_docs))} training characters, "
          f"{len(held_docs)} held out", flush=True)
    tok = train_tokenizer(train_docs)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    stream = torch.tensor([i for t in train_docs for i in tok.encode(t).ids + [eos_id]], dtype=torch.long)
    held_text = "\n\n".join(held_docs)[:HELDOUT_CHARS]
    held_ids = torch.tensor(tok.encode(held_text).ids, dtype=torch.long)
    n_eval = min(4, (held_ids.numel() - 2) // (args.length + 1))
    held_batch = torch.stack([torch.cat([torch.tensor([bos_id]), held_ids[i * (args.length + 1):][:args.length + 1]])
                              for i in range(n_eval)])
    print(f"tokenizer: {tok.get_vocab_size()} tokens; {stream.numel()} training tokens", flush=True)

    config = model_config(tok.get_vocab_size(), bos_id, eos_id)
    model, mtp = build(config, args.seed)
    model.train(), mtp.train()
    params = [p for p in list(model.parameters()) + list(mtp.parameters()) if p.requires_grad]
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M main + "
          f"{sum(p.numel() for p in mtp.parameters()) / 1e6:.2f}M MTP", flush=True)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    balancer = ExpertBalancer([model, mtp])
    data = batches(stream, bos_id, args.batch, args.length, torch.Generator().manual_seed(args.seed))
    log = []
    for step in range(args.steps):
        ids = next(data)
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr)
        logits, mtp_logits = forward(model, mtp, ids)
        main_loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:-1].flatten())
        mtp_loss = F.cross_entropy(mtp_logits.flatten(0, 1), ids[:, 2:].flatten())
        (main_loss + MTP_LOSS_WEIGHT * mtp_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        imbalance = balancer.step()
        if step % 25 == 0 or step == args.steps - 1:
            entry = {"step": step, "loss": round(main_loss.item(), 4), "mtp_loss": round(mtp_loss.item(), 4),
                     "expert_max_over_mean": round(imbalance, 2), "seconds": round(time.time() - started)}
            if step % 100 == 0 or step == args.steps - 1:
                entry["heldout_loss"], entry["heldout_mtp_loss"] = (round(x, 4) for x in
                                                                     heldout_loss(model, mtp, held_batch))
            log.append(entry)
            print(json.dumps(entry), flush=True)
    save(args, docs, tok, config, model, mtp, held_text, log, time.time() - started)


def save(args, docs, tok, config, model, mtp, held_text, log, seconds: float) -> None:
    """bf16 weights (the release's float format) in one safetensors file, MTP under `mtp.0.*`."""
    from safetensors.torch import save_file
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        for p in list(model.parameters()) + list(mtp.parameters()):
            p.copy_(p.bfloat16().float())  # what ships is what the self-check below compares against
    model.save_pretrained(out, save_original_format=False, safe_serialization=True)
    tensors = {k: v for k, v in model.state_dict().items() if not k.endswith("inv_freq")}
    tensors.update(mtp.checkpoint_tensors())
    params = {k for k, _ in model.named_parameters()} | {"mtp.0." + k.removeprefix("block.") for k, _ in
                                                         mtp.named_parameters()}
    # parameters in bf16; buffers (the routers' selection biases, the hash table) exactly as trained
    tensors = {k: (v.bfloat16() if k in params else v).contiguous() for k, v in tensors.items()}
    for f in out.glob("model*.safetensors*"):
        f.unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "generation_config.json").unlink(missing_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "heldout.txt").write_text(held_text, encoding="utf-8")
    record = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "seed": args.seed,
              "python": platform.python_version(), "torch": torch.__version__,
              "corpus": {"sources": ["pydoc_data.topics", "standard-library docstrings (ast)"],
                         "documents": len(docs), "sha256": corpus_digest(docs),
                         "heldout": f"sha256(name) % {HELDOUT_MOD} == 0"},
              "steps": args.steps, "batch": args.batch, "length": args.length, "peak_lr": args.lr,
              "threads": args.threads, "seconds": round(seconds), "final": log[-1], "log": log}
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    check_with_kvfold(out, model, mtp)


@torch.no_grad()
def check_with_kvfold(out: Path, model, mtp) -> None:
    """The written directory, loaded by kvfold, gives the training forward's logits (main and MTP)."""
    sys.path.insert(0, str(REPO))
    import kvfold
    text = (out / "heldout.txt").read_text(encoding="utf-8")[:2000]
    kv = kvfold.load_model(str(out))
    ids = [kv.tokenizer.bos_id] + kv.tokenizer.encode(text)[:200]
    model.eval(), mtp.eval()
    want, want_mtp = forward(model, mtp, torch.tensor([ids]))
    state = kv.new_state(capacity=len(ids))
    got, hidden = kv.forward(ids[:-2], state, return_hidden=True)
    mtp_state = kv.new_mtp_state(capacity=len(ids), max_rewind=0)
    got_mtp, _ = kv.mtp_step(hidden, ids[1:-1], mtp_state)
    main_err = (got - want[0]).abs().max().item()
    mtp_err = (got_mtp - want_mtp[0]).abs().max().item()
    print(f"kvfold vs training forward: main max |diff| {main_err:.2e}, MTP {mtp_err:.2e}", flush=True)
    if max(main_err, mtp_err) > 1e-4:  # fp32 rounding at logit scale ~10 is ~1e-6; a wrong tensor is O(0.1)
        raise SystemExit("kvfold does not reproduce the trained model; the checkpoint is not usable")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=SEED)
    train(p.parse_args())


if __name__ == "__main__":
    main()
