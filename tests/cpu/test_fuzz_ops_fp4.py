"""The microscaled ops under odd arguments: one oracle for all of them — a clean ValueError/TypeError or the valid
call's exact result (a host array that is byte-swapped, Fortran-ordered or strided is the same data), never another
exception, never a mutated input."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from workbench import ops

BF16 = np.dtype(ml_dtypes.bfloat16)
K, N = 64, 64


def _calls(rng):
    """op -> (valid positional args, names); each array argument is one the fuzzer may change."""
    e4m3 = rng.integers(0x20, 0x60, size=(N, K // 16), dtype=np.uint8)
    e8m0 = rng.integers(100, 150, size=(N, K // 32), dtype=np.uint8)
    return {
        "fp4_marlin_repack": [rng.integers(0, 256, (N, K // 2), dtype=np.uint8), K, N],
        "marlin_to_fp4": [rng.integers(-2**31, 2**31 - 1, (K // 16, 2 * N), dtype=np.int32), K, N],
        "mxfp8_marlin_repack": [rng.integers(0, 256, (N, K), dtype=np.uint8), K, N],
        "marlin_to_mxfp8": [rng.integers(-2**31, 2**31 - 1, (K // 16, 4 * N), dtype=np.int32), K, N],
        "nvfp4_marlin_scales": [e4m3, K, N, np.float16],
        "marlin_to_nvfp4_scales": [rng.integers(0x80, 0xF0, (K // 16, N), dtype=np.uint8), K, N],
        "mx_marlin_scales": [e8m0, K, N],
        "marlin_to_mx_scales": [rng.integers(0, 255, (K // 32, N), dtype=np.uint8), K, N],
        "nvfp4_marlin_process_scales": [e4m3.T.copy().view(ml_dtypes.float8_e4m3fn).astype(np.float16)],
        "mxfp4_marlin_process_scales": [e8m0.T.copy()],
    }


MUTATIONS = ("valid", "byteswapped", "fortran", "strided", "list", "wrong_dtype", "extra_row", "float_size",
             "bool_size", "negative_size")


def _mutate(args, kind, rng):
    """-> (args, expectation): "same" (the valid result), "accept" (some result), "refuse" (ValueError/TypeError)."""
    args = list(args)
    arr = args[0]
    if kind == "valid":
        return args, "same"
    if kind == "byteswapped":
        args[0] = arr.astype(arr.dtype.newbyteorder(">")) if arr.dtype.itemsize > 1 else arr
        return args, "same"
    if kind == "fortran":
        args[0] = np.asfortranarray(arr)
        return args, "same"
    if kind == "strided":
        wide = np.zeros((arr.shape[0], 2 * arr.shape[1]), arr.dtype)
        wide[:, ::2] = arr
        args[0] = wide[:, ::2]
        return args, "same"
    if kind == "list":
        args[0] = arr.tolist()
        return args, "refuse"
    if kind == "wrong_dtype":
        args[0] = arr.astype(np.float64)
        return args, "refuse"
    if kind == "extra_row":  # one more group: a shape error where the sizes fix the groups, else a valid call
        args[0] = np.concatenate([arr, arr[:1]])
        return args, "refuse" if len(args) >= 3 else "accept"
    if len(args) < 3:  # the process steps take no sizes: mutate the array instead
        args[0] = arr[:, :32]
        return args, "refuse"
    args[1] = {"float_size": float(args[1]), "bool_size": True, "negative_size": -args[1]}[kind]
    return args, "refuse"


def _result(op, args):
    out = getattr(ops, op)(*args, backend="numpy")
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("op", sorted(_calls(np.random.default_rng(0))))
@given(kind=st.sampled_from(MUTATIONS), seed=st.integers(0, 2**16))
def test_every_odd_argument_is_handled_cleanly(op, kind, seed):
    rng = np.random.default_rng(seed)
    valid = _calls(rng)[op]
    want = _result(op, valid)
    args, expect = _mutate(valid, kind, rng)
    before = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    if expect == "refuse":
        with pytest.raises((ValueError, TypeError)):
            _result(op, args)
    elif expect == "accept":
        _result(op, args)
    else:
        got = _result(op, args)
        assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))
    for a, b in zip(args, before):
        if isinstance(a, np.ndarray):
            assert np.array_equal(a, b) and a.dtype == b.dtype  # inputs never mutated
