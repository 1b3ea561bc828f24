"""Small real-model shapes for the torch surface's tests and benchmarks: a Llama-shaped decoder (random weights from
a fixed seed, in plain torch and as transformers' LlamaForCausalLM) and the helper that swaps every ``nn.Linear`` of
a model for a ``MarlinLinear`` beside an fp16 copy holding the same dequantized weights.

``tests/gpu/test_torch_models.py``, ``tests/cpu/test_torch_modules.py`` and ``bench/bench_torch.py`` all build their
models here. transformers is imported only by the functions that need it (``llama_for_causal_lm``), never at import
time: the GPU machine runs the plain-torch ``Decoder`` without it.

The comparison every caller makes: the swapped model against the fp16 model whose Linears hold *the same
dequantized weights* (``swap_linears``' second model) isolates the kernels' error (fp32 accumulation, late scales,
roundings); against the original fp16 model it shows the format's.
"""
from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from workbench.quantize import quantize_weights
from workbench.torch.modules import replace_linears
from workbench.weight import make_marlin_weight

# Llama's architecture at a small size (LlamaConfig's fields; random weights from DECODER_SEED): GQA (8 query heads
# over 2 KV heads), SwiGLU, an untied lm_head, so each kind of Linear a real Llama has is there
DECODER_CONFIG = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                      hidden_act="silu")
DECODER_SEED = 1234

# all-MiniLM-L6-v2's BertConfig (its config.json), for models of its shape with random weights
MINILM_CONFIG = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                     intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
                     hidden_act="gelu")
# the fixed sentences MiniLM embeds (tests and bench alike)
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


# ---------------------------------------------------------------------------------------------------------------
# swapping Linears
# ---------------------------------------------------------------------------------------------------------------
def swap_linears(model: nn.Module, weight_type, group_size: int) -> tuple[nn.Module, nn.Module, int]:
    """``(ours, same, count)``: two copies of ``model``, ``ours`` with every nn.Linear swapped by
    ``replace_linears`` for the reference quantizer's weight (given by name, as ``workbench.load`` returns them),
    ``same`` with every nn.Linear holding that weight dequantized (in the Linear's dtype); ``count`` Linears each.
    Raises if any Linear was not swapped (the comparison would then not be of the kernels alone)."""
    same, weights = copy.deepcopy(model), {}
    for name, linear in model.named_modules():
        if isinstance(linear, nn.Linear):
            q = quantize_weights(linear.weight.detach().float().cpu().numpy().T, weight_type, group_size,
                                 act_dtype=np.float16)  # (K, N) = (in, out)
            weights[name] = make_marlin_weight(q)
            target = same.get_submodule(name).weight
            with torch.no_grad():
                target.copy_(torch.from_numpy(np.ascontiguousarray(q.w_ref.T)).to(target.dtype))
    ours = copy.deepcopy(model)
    report = replace_linears(ours, "*", weight_type, group_size, weights=weights)
    if report.skipped or sorted(report.replaced) != sorted(weights):
        raise RuntimeError(f"not every Linear was swapped: {report}")
    return ours, same, len(weights)


def mean_pooled(model: nn.Module, inputs: dict) -> torch.Tensor:
    """sentence-transformers' head for all-MiniLM-L6-v2 over a transformers encoder: the mean of the last hidden
    state over real tokens, L2-normalised, in float32."""
    h = model(**inputs).last_hidden_state.float()
    m = inputs["attention_mask"][..., None].float()
    return F.normalize((h * m).sum(1) / m.sum(1), dim=-1)


# ---------------------------------------------------------------------------------------------------------------
# the decoder: Llama's layer in plain torch, with a static KV cache
# ---------------------------------------------------------------------------------------------------------------
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
    static KV cache, so that one decode step is a fixed graph (CUDA-graph capture, torch.compile without
    recompiles). ``bench/bench_torch.py validate`` checks it against LlamaForCausalLM."""

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


def decoder_state(c: dict | None = None, seed: int = DECODER_SEED) -> dict[str, np.ndarray]:
    """The decoder's random weights (float32, transformers' parameter names), from NumPy's PCG64 so every machine
    draws the same: N(0, 0.02) like LlamaConfig's initializer_range, norms near 1."""
    c = DECODER_CONFIG if c is None else c
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


def decoder(c: dict | None = None, seed: int = DECODER_SEED) -> Decoder:
    """The plain-torch ``Decoder`` of config ``c`` (default DECODER_CONFIG) holding ``decoder_state(c, seed)``
    (float32, on the CPU)."""
    c = DECODER_CONFIG if c is None else c
    m = Decoder(c)
    own = {}
    for name, value in decoder_state(c, seed).items():  # (the norms are Parameters here, not modules)
        key = name.removesuffix(".weight") if name.endswith("layernorm.weight") or name == "model.norm.weight" \
            else name
        own[key] = torch.from_numpy(value)
    missing, unexpected = m.load_state_dict(own, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"decoder weights do not fit: missing {missing}, unexpected {unexpected}")
    return m


def llama_for_causal_lm(c: dict | None = None, seed: int = DECODER_SEED):
    """transformers' LlamaForCausalLM of config ``c`` (default DECODER_CONFIG) holding the same
    ``decoder_state(c, seed)`` as ``decoder(c, seed)`` (float32, on the CPU). Needs transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = DECODER_CONFIG if c is None else c
    model = LlamaForCausalLM(LlamaConfig(**c))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in decoder_state(c, seed).items()})
    return model
