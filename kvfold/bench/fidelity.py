"""Fidelity at real shapes without a dequantized model's memory (issue 42 item 5).

A quantized real-shape model (bench/fidelity_real_shapes.py) is compared with the same model in
fp32, and with transformers, on a short prompt. The fp32 models cannot be held whole (DeepSeek-V4-
Flash's 4 layers are 130 GB of fp32, GLM-5.3-Flash's 38 GB), but a short prompt reads only the
routed experts it selects (top-6 of 256 per token and MoE layer in V4, top-8 of 288 in GLM). So the
fp32 models hold each stacked expert tensor in `sparse_zeros`: a private mapping of a sparse,
unlinked file, whose pages cost nothing until written and read as zeros; only the experts the
quantized run routed to are written, decoded as the loader decodes them (`dequantize_`). A model
that routes to an expert nobody wrote reads zeros and its logits move, so the comparison detects
it; `RoutedExperts` / `HfRouted` also name such experts, and `expert_pages` tells, from the kernel's
page accounting, whether any page nobody wrote was read.

The pieces: `RoutedExperts` (the ids each kvfold MoE layer routes each row to), `dequantize_`
(every held weight to an fp32 parameter, stacked experts sparse), `run_prompt` (one prefill and a
few decode steps), `hf_model` / `hf_weights` / `hf_logits` / `HfRouted` (transformers' model of
the same config on the meta device, given kvfold's fp32 tensors under its names, sharing their
memory). tests/test_fidelity_sparse_experts.py checks them on small configs.

transformers' MoE (5.23, deepseek_v4 and glm5_next alike) runs one of three experts forwards,
`config._experts_implementation`: "eager" (the class's own: a loop over the experts some row hit,
`F.linear` on the view `gate_up_proj[e]`, so only those experts' pages are read), "batched_mm"
(gathers `gate_up_proj[ids]`, a copy of each (row, slot)'s expert: again only routed experts, at
one copy per slot) and "grouped_mm" (the whole stacked tensor, transposed, into one grouped matmul
whose offsets skip the experts without rows). None copies or casts the whole stack (fp32 in, fp32
held: `.to` is a no-op). Measured with `expert_pages` on torch 2.13's CPU kernels, all three read
only the routed experts' pages. A model built directly from a config gets "grouped_mm"
(`get_correct_experts_implementation(None)`); `hf_model` pins "eager", the oracle of
tests/hf_oracle.py, whose reads are plain from its code, and every run checks them again.
"""
from __future__ import annotations

import math
import os
import re
import tempfile
from typing import Iterable

import torch
from torch import nn

from ..layers.basic import QuantizedWeight
from ..layers.moe import Experts

_SMAPS_HEAD = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")


# ---- sparse fp32 tensors ---------------------------------------------------------------------------
def sparse_zeros(shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
                 directory: str | None = None) -> torch.Tensor:
    """A zero tensor whose pages take no memory until written: a private mapping of a sparse file,
    unlinked at once (the mapping keeps it). A page read unwritten is the file's hole, zeros; a page
    written becomes a private copy, never written back. The kernel's default overcommit heuristic
    refuses one private mapping larger than RAM + swap (V4-Flash's largest stack is 17 GB,
    GLM-5.3-Flash's 19 GB: they pass on a 24 GB machine)."""
    n = math.prod(shape)
    fd, path = tempfile.mkstemp(prefix="kvfold-sparse-", dir=directory)
    try:
        os.ftruncate(fd, n * torch.empty(0, dtype=dtype).element_size())  # a hole: no disk blocks
        t = torch.from_file(path, shared=False, size=n, dtype=dtype)
    finally:
        os.close(fd)
        os.unlink(path)
    return t.view(shape)


def mapping_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident bytes, private-copy bytes) of the mapping holding `t` (/proc/self/smaps). For a
    `sparse_zeros` tensor the private copies are the pages written; resident pages beyond them
    were read without ever being written."""
    addr = t.untyped_storage().data_ptr()
    inside, rss = False, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = _SMAPS_HEAD.match(line)
            if head is not None:
                inside = int(head.group(1), 16) <= addr < int(head.group(2), 16)
            elif inside and line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif inside and line.startswith("Anonymous:"):
                return rss, int(line.split()[1]) * 1024
    raise ValueError("the tensor's memory is not one of this process's mappings")


def expert_pages(model: nn.Module) -> dict[str, int]:
    """Over every stacked expert tensor of `model` (kvfold or transformers) that is a mapping:
    bytes written ("written") and bytes read but never written ("read_unwritten", 0 when nothing
    outside the written experts was touched, at page granularity)."""
    written = unwritten = 0
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rss, anon = mapping_pages(p)
            written, unwritten = written + anon, unwritten + rss - anon
    return {"written": written, "read_unwritten": unwritten}


# ---- which experts a kvfold run routes to --------------------------------------------------------------
def moe_layers(model: nn.Module) -> dict[str, nn.Module]:
    """kvfold's MoE layers by name: the modules with a router `gate` and stacked `experts`."""
    return {n: m for n, m in model.named_modules()
            if isinstance(getattr(m, "experts", None), Experts) and hasattr(m, "gate")}


class RoutedExperts:
    """The expert ids every MoE layer of a kvfold model routes each row to, call by call, read by
    running the layer's own router on the layer's input (a forward pre-hook). The router is called
    with the layer's arguments (V4: x, token ids, ops; GLM: x, ops). V4's decode rows run the MoE,
    or the whole block, in one native call that routes inside C, so while this listens the model's
    fused decode is off (`set_fused_decode(False)`: the same bits, per op). Batch-invariant routing
    gives each row the ids it gets alone, the native call's included (moe.py); were these not the
    ids the layer used, the fp32 model built from them would miss an expert and say so."""

    def __init__(self, model: nn.Module):
        layers = moe_layers(model)
        self.model, self.calls = model, {name: [] for name in layers}
        self.fused = getattr(model, "fused_decode", None)
        if self.fused is not None:
            model.set_fused_decode(False)
        self.handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in layers.items()]

    def _hook(self, name: str):
        def hook(moe, args):
            with torch.no_grad():
                _, ids = moe.gate(*args)
            self.calls[name].append(ids.detach().clone().long())
        return hook

    def rows(self) -> dict[str, torch.Tensor]:
        """Per layer, [rows, k]: every call's rows in order, each row's ids ascending."""
        return {name: torch.cat(c).sort(dim=-1).values for name, c in self.calls.items() if c}

    def experts(self) -> dict[str, list[int]]:
        """Per layer, the experts any row was routed to, ascending."""
        return {name: sorted(set(r.flatten().tolist())) for name, r in self.rows().items()}

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        if self.fused is not None:
            self.model.set_fused_decode(self.fused)
        self.model = None  # what was routed stays readable; the model is not kept alive for it


def expert_rows(experts: dict[str, list[int]]) -> dict[str, list[int]]:
    """`dequantize_`'s `sparse` for routed experts: each MoE layer's two stacked tensors, with the
    experts (their index in the stack) to write."""
    return {f"{layer}.experts.{part}": ids for layer, ids in experts.items() for part in ("gate_up_proj", "down_proj")}


# ---- the fp32 model --------------------------------------------------------------------------------------
@torch.no_grad()
def dequantize_(model: nn.Module, sparse: dict[str, Iterable[int]] | None = None,
                directory: str | None = None) -> dict[str, int]:
    """Make every weight `model` holds as stored (a `QuantizedWeight`: FP8, FP4, or bf16 in an fp32
    model) an fp32 parameter holding what a dequantizing load writes (`QuantizedWeight.dequant`: the
    code's value times its block's scale, one IEEE product, as the loader's `dequant_into`). The
    weights named in `sparse` become `sparse_zeros` with only the listed indices of their first dim
    decoded (routed experts: `expert_rows`); the others are decoded whole. Those in `sparse` go first:
    the stacked experts are most of the stored bytes, freed as each is replaced, before the dense
    weights grow fourfold. Call it before the model runs: a model that has run keeps native
    descriptors of its stored weights (layers/native_cache.py), which would hold them until its
    next forward. Returns the bytes decoded, dense and sparse."""
    sparse = {} if sparse is None else {k: sorted(set(v)) for k, v in sparse.items()}
    held = model.quantized_weights() if hasattr(model, "quantized_weights") else \
        {n: m for n, m in model.named_modules() if isinstance(m, QuantizedWeight)}
    done = {"dense": 0, "sparse": 0}
    for name in sorted(held, key=lambda n: n not in sparse):
        holder = held.pop(name)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if name in sparse:
            value = sparse_zeros(tuple(holder.shape), holder.dtype, directory)
            for i in sparse[name]:
                value[i].copy_(holder.dequant(index=i))
            done["sparse"] += len(sparse[name]) * value[0].nbytes
        else:
            value = holder.dequant()
            done["dense"] += value.nbytes
        delattr(parent, attr)
        parent.register_parameter(attr, nn.Parameter(value, requires_grad=False))
        del holder
    return done


def run_prompt(model, prompt: list[int], decode_steps: int, feed: list[int] | None = None
               ) -> tuple[torch.Tensor, list[int]]:
    """One prefill of `prompt`, then `decode_steps` one-token steps: the fp32 logits of every row
    ([len(prompt) + decode_steps, vocab]) and the tokens fed. A step feeds the argmax of the row
    before it (greedy), or `feed`'s token at that position (another run's tokens, so that two models
    see the same input whatever they predict)."""
    state = model.new_state(capacity=len(prompt) + decode_steps)
    try:
        rows, tokens = [model.forward(list(prompt), state)], list(prompt)
        for _ in range(decode_steps):
            tok = int(rows[-1][-1].argmax()) if feed is None else int(feed[len(tokens)])
            tokens.append(tok)
            rows.append(model.forward([tok], state))
    finally:
        state.free()
    return torch.cat(rows).float(), tokens


# ---- transformers ----------------------------------------------------------------------------------------------
def is_glm(model) -> bool:
    from ..models.glm5.model import Glm5Model
    return isinstance(model, Glm5Model)


def hf_model(model) -> nn.Module:
    """transformers' model of the kvfold `model`'s config (from the checkpoint, `to_hf_dict`), built
    on the meta device: no memory until `hf_weights` gives it kvfold's tensors. DeepSeek-V4:
    `DeepseekV4ForCausalLM`; GLM-5.3: `Glm5NextTextModel` (the text path of
    `Glm5NextForConditionalGeneration`, whose vision tower a text prompt never runs; `hf_logits`
    applies the lm_head). Eager attention and eager experts (see the module docstring)."""
    if is_glm(model):
        from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel
        text = model.config.to_hf_dict()
        cfg, cls = Glm5NextConfig(text_config=text).text_config, Glm5NextTextModel
    else:
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
        cfg, cls = DeepseekV4Config(**model.config.to_hf_dict()), DeepseekV4ForCausalLM
    with torch.device("meta"):
        hf = cls(cfg)
    hf.set_attn_implementation("eager")
    hf.set_experts_implementation("eager")
    _rebuild_meta_buffers(hf)
    return hf.eval()


def _rebuild_meta_buffers(hf: nn.Module) -> None:
    """The buffers a transformers module computes at construction and never saves (the rotary
    tables), left on meta by the meta-device build: computed again on the CPU by a fresh module
    of the same class from the same config."""
    for name, m in hf.named_modules():
        stale = [b for b in m._non_persistent_buffers_set if m._buffers.get(b) is not None and m._buffers[b].is_meta]
        if not stale:
            continue
        if not hasattr(m, "config"):
            raise ValueError(f"{name} ({type(m).__name__}) has buffers computed at construction and no config "
                             f"to compute them again from: {stale}")
        fresh = type(m)(m.config)
        for b in stale:
            m._buffers[b] = fresh._buffers[b]


_GLM_FORGET_GATE = re.compile(r"^(layers\.\d+\.self_attn\.)(A_log|dt_bias|f_a_proj\.weight|f_b_proj\.weight)$")
_GLM_CONV = re.compile(r"^(layers\.\d+\.self_attn\.)([qkv])_conv1d$")


def hf_weights(model) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """kvfold's tensors under transformers' names, sharing their memory (the q, k, v conv taps of
    GLM excepted, joined in one tensor), and GLM's lm_head weight (None for V4, whose head is
    in the dict). V4: the same names and layouts (kvfold's names are transformers' module names).
    GLM-5.3's text model: no `model.` prefix, the KDA forget gate's A_log, dt_bias, f_a_proj and
    f_b_proj under `forget_gate.`, and the q | k | v conv taps as one `conv1d.weight` (the
    in-memory layout kvfold's loader splits the same way)."""
    sd = model.state_dict()
    if not is_glm(model):
        return dict(sd), None
    out, convs = {}, {}
    for name, t in sd.items():
        if name == "lm_head.weight":
            continue
        key = name.removeprefix("model.")
        if (m := _GLM_CONV.match(key)) is not None:
            convs.setdefault(m.group(1), {})[m.group(2)] = t
            continue
        if (m := _GLM_FORGET_GATE.match(key)) is not None:
            key = f"{m.group(1)}forget_gate.{m.group(2)}"
        out[key] = t
    for pre, taps in convs.items():
        out[pre + "conv1d.weight"] = torch.cat([taps["q"], taps["k"], taps["v"]])
    return out, sd["lm_head.weight"]


def load_hf_weights(hf: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Give `hf` (from `hf_model`) `weights` as its tensors (`assign`: no copy), every one of them:
    a name missing on either side or a shape that differs raises."""
    hf.load_state_dict(weights, strict=True, assign=True)
    left = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"transformers tensors left without a value: {left[:10]}")


@torch.no_grad()
def hf_logits(hf: nn.Module, tokens: list[int], lm_head: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' fp32 logits of `tokens`, one full forward without a cache: [T, vocab]. GLM's text
    model is fed the embeddings, as `Glm5NextModel` feeds it, and `lm_head` applied as
    `Glm5NextForConditionalGeneration` applies it."""
    ids = torch.tensor([list(tokens)], dtype=torch.long)
    if lm_head is None:
        return hf(input_ids=ids, use_cache=False).logits[0].float()
    hidden = hf(inputs_embeds=hf.embed_tokens(ids), use_cache=False).last_hidden_state
    return nn.functional.linear(hidden, lm_head)[0].float()


class HfRouted:
    """The expert ids transformers' MoE layers route each row to (a pre-hook on each experts module,
    whose arguments are the rows, their top-k ids and weights), by kvfold's layer name."""

    def __init__(self, hf: nn.Module):
        self.ids: dict[str, torch.Tensor] = {}
        self.handles = []
        for name, m in hf.named_modules():
            if name.endswith(".experts") and isinstance(getattr(m, "gate_up_proj", None), torch.Tensor):
                layer = "model." + name.removeprefix("model.").removesuffix(".experts")
                self.handles.append(m.register_forward_pre_hook(self._hook(layer)))

    def _hook(self, layer: str):
        def hook(_, args):
            self.ids[layer] = args[1].detach().reshape(-1, args[1].shape[-1]).long().sort(dim=-1).values
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def routing_report(kv_rows: dict[str, torch.Tensor], other: dict[str, torch.Tensor],
                   written: dict[str, list[int]]) -> dict[str, dict]:
    """Per MoE layer: whether another run routed every row to kvfold's experts ("same"), and the
    experts it routed to that were not written ("unwritten": it read zeros there)."""
    out = {}
    for layer, rows in kv_rows.items():
        got = other.get(layer)
        ids = set() if got is None else set(got.flatten().tolist())
        out[layer] = {"same": got is not None and torch.equal(got, rows),
                      "unwritten": sorted(ids - set(written.get(layer, ())))}
    return out
