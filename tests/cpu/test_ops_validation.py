"""Every op: bad input raises before any work with the offending values named; no op mutates its input; outputs are
fresh C-contiguous arrays."""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

from workbench import ops
from workbench.formats import fp8, packing


def q4(k, n, rng):
    return packing.pack_rows(rng.integers(0, 16, size=(k, n), dtype=np.uint8), 4)


BAD_CALLS = [
    # (description, callable(rng), exception, message regex)
    # odd shapes are padded (tests/cpu/test_odd_shapes.py); what the checkpoint format cannot hold is refused
    ("GPTQ K not /pf", lambda r: ops.gptq_marlin_repack(np.zeros((3, 64), np.int32), None, 20, 64, 4), ValueError,
     r"size_k = 20 is not a multiple of the pack factor 8 \(GPTQ packs 8 rows"),
    ("AWQ N not /pf", lambda r: ops.awq_marlin_repack(np.zeros((16, 12), np.int32), 16, 100, 4), ValueError,
     r"size_n = 100 is not a multiple of the pack factor 8 \(AWQ packs 8 columns"),
    ("size_n 0", lambda r: ops.gptq_marlin_repack(np.zeros((16, 0), np.int32), None, 128, 0, 4), ValueError,
     "size_n = 0 must be positive"),
    ("inverse AWQ N not /pf", lambda r: ops.marlin_to_awq_qweight(np.zeros((1, 128), np.int32), 16, 60, 4),
     ValueError, "size_n = 60 is not a multiple of the pack factor 8"),
    ("Marlin scales not padded", lambda r: ops.marlin_unpermute_scales(np.zeros((1, 100), np.float16), 128, 100, -1),
     ValueError, r"s has shape \(1, 100\), expected \(1, 128\) \(\[num_groups = 1, N_pad"),
    ("Marlin qweight not padded", lambda r: ops.marlin_to_gptq_qweight(np.zeros((2, 100), np.int32), None, 24, 50, 8),
     ValueError, r"marlin_q has shape \(2, 100\), expected \(2, 256\)"),
    ("qweight rows", lambda r: ops.gptq_marlin_repack(np.zeros((15, 64), np.int32), None, 128, 64, 4), ValueError,
     r"b_q_weight has shape \(15, 64\), expected \(16, 64\)"),
    ("qweight dtype", lambda r: ops.gptq_marlin_repack(np.zeros((16, 64), np.int64), None, 128, 64, 4), TypeError,
     "b_q_weight must have dtype int32 or uint32, got int64"),
    ("bits", lambda r: ops.gptq_marlin_repack(np.zeros((16, 64), np.int32), None, 128, 64, 2), ValueError,
     "num_bits = 2"),
    ("perm length", lambda r: ops.gptq_marlin_repack(q4(128, 64, r), np.arange(64, dtype=np.int32), 128, 64, 4),
     ValueError, "perm.size\\(-1\\) = 64, where size_k = 128"),
    ("perm not a permutation", lambda r: ops.gptq_marlin_repack(q4(128, 64, r), np.zeros(128, np.int32), 128, 64, 4),
     ValueError, r"perm is not a permutation of range\(128\): 0 appears 128 times"),
    ("awq shape", lambda r: ops.awq_marlin_repack(np.zeros((128, 16), np.int32), 128, 64, 4), ValueError,
     r"expected \(128, 8\)"),
    ("scales shape", lambda r: ops.marlin_permute_scales(np.zeros((3, 64), np.float16), 256, 64, 128), ValueError,
     r"s has shape \(3, 64\), expected \(2, 64\)"),
    ("group size", lambda r: ops.marlin_permute_scales(np.zeros((3, 64), np.float16), 256, 64, 0), ValueError,
     "group_size = 0 must be -1"),
    ("partial group count", lambda r: ops.marlin_permute_scales(np.zeros((2, 64), np.float16), 200, 64, 64),
     ValueError, r"s has shape \(2, 64\), expected \(4, 64\)"),
    ("qzeros N not /pf", lambda r: ops.repack_gptq_qzeros_to_marlin(np.zeros((1, 8), np.int32), 128, 60, 128),
     ValueError, r"size_n = 60 is not a multiple of the pack factor 8 \(GPTQ qzeros"),
    ("zp float", lambda r: ops.marlin_zero_points(np.zeros((1, 64), np.float32), 128, 64, 4), TypeError,
     "zp must hold integer codes, got dtype float32"),
    ("zp columns", lambda r: ops.marlin_zero_points(np.zeros((1, 32), np.uint8), 128, 64, 4), ValueError,
     "expected 64 columns"),
    ("qzeros shape", lambda r: ops.repack_gptq_qzeros_to_marlin(np.zeros((2, 8), np.int32), 128, 64, 128),
     ValueError, r"qzeros has shape \(2, 8\), expected \(1, 8\)"),
    ("fp8 raw shape", lambda r: ops.fp8_marlin_repack_raw_bits(np.zeros((64, 64), np.uint32), 128, 64), ValueError,
     r"raw_bits_k_major has shape \(64, 64\), expected \(32, 64\)"),
    ("block fp8 K", lambda r: ops.block_fp8_group128_repack(np.zeros((64, 66), np.uint8), 66, 64), ValueError,
     "size_k = 66 is not a multiple of the pack factor 4"),
    ("block fp8 dtype", lambda r: ops.block_fp8_group128_repack(np.zeros((64, 128), np.float16), 128, 64), TypeError,
     "row_major must have dtype uint8 or float8_e4m3fn"),
    ("block fp8 shape", lambda r: ops.block_fp8_group128_repack(np.zeros((128, 64), np.uint8), 128, 64), ValueError,
     r"row_major has shape \(128, 64\), expected \(64, 128\)"),
    ("block scales shape", lambda r: ops.block_fp8_group128_scales(np.zeros((2, 1), np.float32), 128, 64),
     ValueError, r"inverse_scales has shape \(2, 1\), expected \(1, 1\)"),
    ("block scales dtype", lambda r: ops.block_fp8_group128_scales(np.zeros((1, 1), np.float16), 128, 64),
     TypeError, "inverse_scales must have dtype bfloat16 or float32"),
    ("backend", lambda r: ops.marlin_permute_scales(np.zeros((1, 64), np.float16), 128, 64, -1, backend="tpu"),
     ValueError, "backend = 'tpu'"),
    ("size type", lambda r: ops.gptq_marlin_repack(np.zeros((16, 64), np.int32), None, 128.0, 64, 4), TypeError,
     "size_k must be an int"),
    ("experts count", lambda r: ops.stack_gptq_experts_to_marlin([q4(128, 64, r)], [], [], 4, 128, 128, 64),
     ValueError, "qweights=1 scales=0 qzeros=0"),
]


@pytest.mark.parametrize("desc,call,exc,message", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_a_clear_error(desc, call, exc, message, rng):
    with pytest.raises(exc, match=message):
        call(rng)


def _good_calls(rng):
    k, n = 256, 128
    codes4 = rng.integers(0, 16, size=(k, n), dtype=np.uint8)
    zp = rng.integers(1, 15, size=(2, n), dtype=np.uint8)
    row_major = rng.integers(0, 256, size=(n, k), dtype=np.uint8)
    return [
        (ops.gptq_marlin_repack, (packing.pack_rows(codes4, 4), rng.permutation(k).astype(np.int32), k, n, 4)),
        (ops.awq_marlin_repack, (packing.awq_pack(codes4, 4), k, n, 4)),
        (ops.marlin_permute_scales, (rng.standard_normal((2, n)).astype(np.float16), k, n, 128)),
        (ops.marlin_zero_points, (zp, k, n, 4)),
        (ops.awq_to_marlin_zero_points, (packing.awq_pack(zp, 4), k, n, 4)),
        (ops.repack_gptq_qzeros_to_marlin, (packing.pack_cols(zp - 1, 4), k, n, 128)),
        (ops.fp8_marlin_repack_raw_bits, (fp8.pack_fp8_to_int32(row_major), k, n)),
        (ops.block_fp8_group128_repack, (row_major, k, n)),
        (ops.block_fp8_group128_scales, (rng.uniform(0, 1, (1, 2)).astype(ml_dtypes.bfloat16), k, n)),
    ]


def test_no_op_mutates_its_inputs_and_outputs_are_contiguous(rng):
    for op, args in _good_calls(rng):
        before = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
        out = op(*args)
        for a, b in zip(args, before):
            if isinstance(a, np.ndarray):
                assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), op.__name__
        assert out.flags["C_CONTIGUOUS"], op.__name__
        assert not any(np.shares_memory(out, a) for a in args if isinstance(a, np.ndarray)), op.__name__


# ---------------------------------------------------------------------------------------------------------------
# regressions of issue 26, host side (each failed before the shared checks)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call,name", [
    (lambda: ops.gptq_marlin_repack(np.zeros((16, 64), np.int32).tolist(), None, 128, 64, 4), "b_q_weight"),
    (lambda: ops.gptq_marlin_repack(np.zeros((16, 64), np.int32), list(range(128)), 128, 64, 4), "perm"),
    (lambda: ops.marlin_permute_scales([[1.0] * 64], 128, 64, -1), "s"),
    (lambda: ops.marlin_zero_points([[1] * 64], 128, 64, 4), "zp"),
    (lambda: ops.stack_gptq_experts_to_marlin([np.zeros((16, 64), np.int32)], [[[1.0] * 64]],
                                              [np.zeros((1, 8), np.int32)], 4, -1, 128, 64), r"scales\[0\]"),
])
def test_python_lists_are_refused_with_the_argument_named(call, name):
    """Low: lists raised AttributeError ('list' object has no attribute 'dtype'); the rule for every op is one
    TypeError naming the argument (a list has no dtype, and the dtype is part of each format)."""
    with pytest.raises(TypeError, match=rf"^{name} must be a NumPy or CUDA array, got list"):
        call()


@pytest.mark.parametrize("bits,kind", [(4.0, TypeError), (True, TypeError), ("4", TypeError),
                                       (np.float32(8), TypeError), (2, ValueError)])
def test_num_bits_must_be_an_integer_4_or_8(bits, kind, rng):
    """Defect 6: the NumPy backend failed deep inside with "unsupported operand type(s) for <<" for 4.0."""
    q = q4(128, 64, rng)
    with pytest.raises(kind, match="num_bits"):
        ops.gptq_marlin_repack(q, None, 128, 64, bits)
    assert np.array_equal(ops.gptq_marlin_repack(q, None, np.int64(128), np.int32(64), np.int64(4)),
                          ops.gptq_marlin_repack(q, None, 128, 64, 4))


@pytest.mark.parametrize("op", ["marlin_permute_scales", "marlin_unpermute_scales", "block_fp8_group128_scales"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_scales_are_kept_with_a_warning(op, bad, rng):
    """Low: NaN/Inf scales passed without a warning (they turn a whole group's outputs into NaN/Inf)."""
    if op == "block_fp8_group128_scales":
        s, args = np.ones((1, 1), np.float32), (128, 64)
        s[0, 0] = bad
    else:
        s, args = np.ones((2, 64), np.float16), (32, 64, 16)
        s[1, 3] = bad
    with pytest.warns(RuntimeWarning, match=r"holds 1 NaN/Inf value\(s\), the first .*\[(1, 3|0, 0)\]"):
        out = getattr(ops, op)(s, *args)
    assert not np.isfinite(np.asarray(out, np.float32)).all()


@pytest.mark.parametrize("op", ["awq_to_marlin_zero_points", "marlin_zero_points", "marlin_zero_points_to_codes",
                                "marlin_to_awq_zero_points"])
def test_zero_points_with_zero_groups_are_refused_clearly(op):
    """Low: AWQ zero points with zero groups failed with NumPy's "cannot reshape array of size 0"."""
    zp = np.zeros((0, 64), np.uint8) if op == "marlin_zero_points" else np.zeros((0, 8), np.int32)
    with pytest.raises(ValueError, match=r"has shape \(0, (64|8)\): 0 groups; a layer has at least one"):
        getattr(ops, op)(zp, 128, 64, 4)


def test_a_marlin_weight_with_a_bad_perm_is_refused_when_built(rng):
    """The act-order perm is checked once, where a layer is built (kernels read rows through it)."""
    from workbench.weight import random_marlin_weight

    w, _ = random_marlin_weight(64, 64, "u4b8", 32, act_order=True)
    bad = w.perm.copy()
    bad[3] = bad[4]
    with pytest.raises(ValueError, match=rf"perm is not a permutation of range\(64\): {bad[4]} appears 2 times"):
        dataclasses.replace(w, perm=bad)
    with pytest.raises(ValueError, match=r"perm has shape \(63,\), expected \(64,\)"):
        dataclasses.replace(w, perm=w.perm[:-1])
