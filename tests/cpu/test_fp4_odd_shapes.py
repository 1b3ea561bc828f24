"""The microscaled formats (NVFP4, MXFP4, MXFP8) on shapes that are not tile multiples, NumPy backend
(docs/formats.md, "Shapes that are not tile multiples" and "Microscaling in Marlin").

The rule is the other formats': the Marlin arrays of an (N, K) checkpoint weight are exactly those of the weight
zero-padded to N_pad = ceil(N / 64) * 64 rows of the checkpoint (columns of the Marlin arrays), zero codes and zero
scale bytes in the padding; K is a whole number of the format's groups (NVFP4 16, MX 32: the scale ops' rule; the
weight ops need whole 16-row k-tiles), so there is no K padding.
Each test builds the padded checkpoint tensors explicitly and runs the op at the aligned N (the path every other test
pins down), so "exactly that rule" is what is compared, bit for bit; the inverses take the true sizes and return the
source exactly.
"""
from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from workbench import ops  # noqa: E402
from workbench.formats import microscale as ms  # noqa: E402
from workbench.formats._checks import padded_n  # noqa: E402

NP = dict(backend="numpy")
# non-negative E4M3 scale bytes whose span stays inside fp16's range after bf16's rescale (2^-4 .. 2^4), and 0
E4M3_SCALES = np.concatenate([[0], np.arange(0x18, 0x5F)]).astype(np.uint8)


def pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    """[N, ...] -> [rows, ...] with zero bytes appended (checkpoint rows are Marlin columns)."""
    out = np.zeros((rows,) + x.shape[1:], dtype=x.dtype)
    out[:x.shape[0]] = x
    return out


@st.composite
def odd_layer(draw, fmt: str):
    """(K, N, seed): K a multiple of the format's group (1 to 5 groups), N anything up to three tiles."""
    group = ms.FORMATS[fmt].group_size
    k = group * draw(st.integers(1, 5))
    n = draw(st.integers(1, 192))
    return k, n, draw(st.integers(0, 2**31 - 1))


@given(odd_layer("nvfp4"))
def test_fp4_weights_are_the_padded_weights_tiles_and_invert(case):
    k, n, seed = case
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    q = ops.fp4_marlin_repack(packed, k, n, **NP)
    assert q.shape == (k // 16, 2 * padded_n(n))
    assert np.array_equal(q, ops.fp4_marlin_repack(pad_rows(packed, padded_n(n)), k, padded_n(n), **NP))
    assert np.array_equal(ops.marlin_to_fp4(q, k, n, **NP), packed)


@given(odd_layer("mxfp8"))
def test_mxfp8_weights_are_the_padded_weights_tiles_and_invert(case):
    k, n, seed = case
    rng = np.random.default_rng(seed)
    weight = rng.integers(0, 256, size=(n, k), dtype=np.uint8)
    q = ops.mxfp8_marlin_repack(weight, k, n, **NP)
    assert q.shape == (k // 16, 4 * padded_n(n))
    assert np.array_equal(q, ops.mxfp8_marlin_repack(pad_rows(weight, padded_n(n)), k, padded_n(n), **NP))
    assert np.array_equal(ops.marlin_to_mxfp8(q, k, n, **NP), weight)


@given(odd_layer("nvfp4"), st.sampled_from((np.float16, ms.BF16)))
def test_nvfp4_scales_are_the_padded_scales_bytes_and_invert(case, act):
    """Padded scales are byte 0 (E4M3 +0): the same bytes, and the same bf16 scale factor (vLLM's minimum is over
    positive scales, which the padding does not add)."""
    k, n, seed = case
    rng = np.random.default_rng(seed)
    scales = rng.choice(E4M3_SCALES, size=(n, k // 16)).astype(np.uint8)
    got, sf = ops.nvfp4_marlin_scales(scales, k, n, act, **NP)
    want, sf_want = ops.nvfp4_marlin_scales(pad_rows(scales, padded_n(n)), k, padded_n(n), act, **NP)
    assert got.shape == (k // 16, padded_n(n)) and sf == sf_want
    assert np.array_equal(got, want)
    assert np.array_equal(ops.marlin_to_nvfp4_scales(got, k, n, sf, **NP), scales)


@given(odd_layer("mxfp4"), st.sampled_from(("mxfp4", "mxfp8")))
def test_mx_scales_are_the_padded_codes_and_invert(case, fmt):
    """Padded E8M0 codes are 0, i.e. 2^-127: not zero, but finite, so a padded column is 0 (code) x 2^-127 = 0."""
    k, n, seed = case
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 255, size=(n, k // 32), dtype=np.uint8)  # every code but the NaN 0xFF
    got = ops.mx_marlin_scales(codes, k, n, fmt, **NP)
    assert got.shape == (k // 32, padded_n(n))
    assert np.array_equal(got, ops.mx_marlin_scales(pad_rows(codes, padded_n(n)), k, padded_n(n), fmt, **NP))
    assert np.array_equal(ops.marlin_to_mx_scales(got, k, n, fmt, **NP), codes)


def test_padding_dequantizes_to_zero_and_the_true_columns_to_the_source(rng):
    """N = 100 (1.56 tiles): through the Marlin arrays and back, the padded 28 columns are zero codes and zero scale
    bytes, and the true columns dequantize exactly as the checkpoint's (the exact float64 dequantizers)."""
    k, n = 64, 100
    w = rng.standard_normal((n, k)).astype(np.float32)
    packed, scales, g = ms.quantize_nvfp4(w)
    q = ops.fp4_marlin_repack(packed, k, n, **NP)
    s, sf = ops.nvfp4_marlin_scales(scales, k, n, np.float16, **NP)
    full_codes = ops.marlin_to_fp4(q, k, padded_n(n), **NP)  # every column, the padding included
    full_scales = ops.marlin_to_nvfp4_scales(s, k, padded_n(n), sf, **NP)
    assert not full_codes[n:].any() and not full_scales[n:].any()
    assert np.array_equal(ms.dequantize_nvfp4(full_codes[:n], full_scales[:n], g),
                          ms.dequantize_nvfp4(packed, scales, g))
    elements, codes = ms.quantize_mx(w[:, :64], "mxfp4")
    mx = ops.mx_marlin_scales(codes, 64, n, **NP)
    assert not ops.marlin_to_mx_scales(mx, 64, padded_n(n), **NP)[n:].any()


@pytest.mark.parametrize("call,match", [
    (lambda: ops.fp4_marlin_repack(np.zeros((7, 4), np.uint8), 8, 7, **NP), r"size_k = 8 is not a multiple of 16"),
    (lambda: ops.nvfp4_marlin_scales(np.zeros((7, 1), np.uint8), 24, 7, **NP), r"size_k = 24 is not a multiple of 16"),
    (lambda: ops.mx_marlin_scales(np.zeros((7, 1), np.uint8), 48, 7, **NP), r"size_k = 48 is not a multiple of 32"),
    (lambda: ops.mxfp8_marlin_repack(np.zeros((7, 8), np.uint8), 8, 7, **NP), r"size_k = 8 is not a multiple of 16"),
    (lambda: ops.marlin_to_mx_scales(np.zeros((1, 64), np.uint8), 16, 7, "mxfp8", **NP),
     r"size_k = 16 is not a multiple of 32 \(mxfp8 has one scale per 32"),
    (lambda: ops.marlin_to_mx_scales(np.zeros((1, 7), np.uint8), 32, 7, **NP), r"expected \(1, 64\)"),
    (lambda: ops.marlin_to_nvfp4_scales(np.zeros((1, 7), np.uint8), 16, 7, **NP), r"expected \(1, 64\)"),
])
def test_what_the_formats_cannot_hold_is_refused_by_value_and_rule(call, match):
    with pytest.raises(ValueError, match=match):
        call()
