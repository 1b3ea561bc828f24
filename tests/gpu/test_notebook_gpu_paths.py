"""The GPU-only code paths of the notebooks, run where a GPU is (CI has none, and the GPU machine has no Jupyter).

Notebook 06's last cell multiplies MiniLM-shaped layers with the native GEMM and checks vLLM's acceptance bound;
here the same function runs on fresh random weights of those shapes (heavier-tailed than randn, like real weights)
and, where the MiniLM package is installed, on the real weights.
"""
import numpy as np
import pytest

from workbench import hardware

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not hardware.cupy_available(), reason="no CUDA GPU visible to CuPy")]


def test_notebook06_gemm_vs_reference_on_minilm_shapes(rng):
    from workbench.render.accuracy import gemm_vs_reference

    # MiniLM-L6's Linear shapes (K, N): attention 384x384, FFN up 384x1536, FFN down 1536x384.
    weights = {f"t{k}x{n}": (rng.standard_t(5, size=(k, n)) * 0.05).astype(np.float32)
               for k, n in ((384, 384), (384, 1536), (1536, 384))}
    rows = gemm_vs_reference(weights, seed=int(rng.integers(1 << 30)))
    assert len(rows) == 3 * len(weights)
    for r in rows:
        # vLLM's acceptance criterion for its Marlin tests: mean|C - C_ref| / mean|C_ref| < 0.04 (fp32 accumulation
        # in another order plus one rounding of C to fp16; in practice ~1e-3).
        assert r["mean_rel_diff"] < 0.04, r


def test_notebook06_gemm_vs_reference_on_real_minilm_weights():
    from workbench.render import load_minilm_weights
    from workbench.render.accuracy import gemm_vs_reference

    try:
        weights = load_minilm_weights()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"MiniLM weights not installed: {exc}")
    rows = gemm_vs_reference(dict(list(weights.items())[:2]))
    assert all(r["mean_rel_diff"] < 0.04 for r in rows), rows  # the notebook's own assertion
