"""Fuzz harness for the arguments of every public op in ``workbench.ops``, on both backends.

Each example builds a *valid* call at a tiny shape (one or two 16×64 tiles, so the Numba backend stays cheap in
the CUDA simulator), then applies one mutation from one class of odd input:

    valid       nothing changed                                   must succeed
    shape       a size scalar or an array's shape made wrong       any outcome, but only ValueError/TypeError
    dtype       an array cast to another dtype                     any outcome, but only ValueError/TypeError
    byteorder   an array byte-swapped (big-endian)                 must succeed with the valid call's result
    layout      Fortran order, a strided view, read-only; a list   the same result; a list is refused
    scalar      an int as np.int64/np.int32; as float/bool/str     the same result; float/bool/str refused
    values      a broken perm, codes out of range, NaN scales,     refused (NaN/Inf: accepted, with a
                zero groups, an unstorable zero point              RuntimeWarning)
    device      the arrays as device arrays (Numba backend only),  the NumPy backend's outcome on the host
                values possibly broken as in ``values``            arrays, message for message

and checks every outcome with one oracle (``defects``): only ValueError/TypeError may escape; no input is changed;
the expectation of the class holds; and the NumPy and Numba backends agree — the same exception and message, or
bit-equal results. Derandomized and bounded in CI (the "ci" profile in tests/conftest.py); ``WORKBENCH_FUZZ=long``
searches longer. ``python3 tests/cpu/test_fuzz_ops.py N`` runs a campaign of N examples per op and class and prints
the tally (inputs tried, clean, defects) per class.
"""
from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from workbench import hardware, ops  # noqa: E402
from workbench.formats import fp8, packing  # noqa: E402
from workbench.weight import MarlinWeight  # noqa: E402

NUMBA = hardware.simulator_enabled() or hardware.gpu_available()
CLASSES = ("valid", "shape", "dtype", "byteorder", "layout", "scalar", "values", "device")
CAST_DTYPES = (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64, np.float16,
               np.float32, np.float64, ml_dtypes.bfloat16, fp8.E4M3, np.bool_)


# ---------------------------------------------------------------------------------------------------------------
# valid calls, one builder per op: (positional args, their names); arrays are NumPy, native, C-contiguous
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Call:
    op: str
    args: list
    names: list
    kwargs: dict = dataclasses.field(default_factory=dict)


def _codes(rng, shape, bits, low=0):
    return rng.integers(low, 1 << bits, size=shape, dtype=np.uint8)


def _marlin(rng, k, n, bits):
    return ops.gptq_marlin_repack(packing.pack_rows(_codes(rng, (k, n), bits), bits), None, k, n, bits,
                                  backend="numpy")


def _scales(rng, shape, dtype):
    return rng.uniform(0.01, 1.0, size=shape).astype(dtype)


def build(op: str, rng, bits: int, k_tiles: int, group: int, with_perm: bool, scale_dtype) -> Call:
    k, n = 16 * k_tiles, 64
    g = {0: -1, 1: 16, 2: k}[group]
    ng = 1 if g == -1 else k // g
    perm = rng.permutation(k).astype(np.int32) if with_perm else None
    zp_packed = ops.marlin_zero_points(_codes(rng, (ng, n), bits, 1), k, n, bits, backend="numpy")
    qzeros = packing.pack_cols(_codes(rng, (ng, n), bits) % ((1 << bits) - 1), bits)
    build_for = {
        "gptq_marlin_repack": lambda: ([packing.pack_rows(_codes(rng, (k, n), bits), bits), perm, k, n, bits],
                                       ["b_q_weight", "perm", "size_k", "size_n", "num_bits"]),
        "awq_marlin_repack": lambda: ([packing.awq_pack(_codes(rng, (k, n), bits), bits), k, n, bits],
                                      ["b_q_weight", "size_k", "size_n", "num_bits"]),
        "fp8_marlin_repack_raw_bits": lambda: ([packing.pack_rows(_codes(rng, (k, n), 8), 8), k, n],
                                               ["raw_bits_k_major", "size_k", "size_n"]),
        "block_fp8_group128_repack": lambda: ([_codes(rng, (n, 128), 8), 128, n], ["row_major", "size_k", "size_n"]),
        "marlin_permute_scales": lambda: ([_scales(rng, (ng, n), scale_dtype), k, n, g],
                                          ["s", "size_k", "size_n", "group_size"]),
        "marlin_unpermute_scales": lambda: ([_scales(rng, (ng, n), scale_dtype), k, n, g],
                                            ["s", "size_k", "size_n", "group_size"]),
        "marlin_zero_points": lambda: ([_codes(rng, (ng, n), bits), k, n, bits], ["zp", "size_k", "size_n", "num_bits"]),
        "awq_to_marlin_zero_points": lambda: ([packing.awq_pack(_codes(rng, (ng, n), bits), bits), k, n, bits],
                                              ["q_zp_packed", "size_k", "size_n", "num_bits"]),
        "repack_gptq_qzeros_to_marlin": lambda: ([qzeros, k, n, g, bits],
                                                 ["qzeros", "size_k", "size_n", "group_size", "num_bits"]),
        "gptq_qzeros_are_symmetric_code7": lambda: ([qzeros if rng.integers(2) else
                                                     packing.pack_cols(np.full((ng, n), (1 << (bits - 1)) - 1,
                                                                               np.uint8), bits), bits],
                                                    ["qzeros", "num_bits"]),
        "block_fp8_group128_scales": lambda: ([_scales(rng, (1, 1), np.float32 if bits == 4 else ml_dtypes.bfloat16),
                                               128, n, np.float16 if group else ml_dtypes.bfloat16],
                                              ["inverse_scales", "size_k", "size_n", "act_dtype"]),
        "marlin_to_codes": lambda: ([_marlin(rng, k, n, bits), k, n, bits, perm],
                                    ["marlin_q", "size_k", "size_n", "num_bits", "perm"]),
        "marlin_to_gptq_qweight": lambda: ([_marlin(rng, k, n, bits), perm, k, n, bits],
                                           ["marlin_q", "perm", "size_k", "size_n", "num_bits"]),
        "marlin_to_awq_qweight": lambda: ([_marlin(rng, k, n, bits), k, n, bits],
                                          ["marlin_q", "size_k", "size_n", "num_bits"]),
        "marlin_to_fp8_raw_bits": lambda: ([_marlin(rng, k, n, 8), k, n], ["marlin_q", "size_k", "size_n"]),
        "marlin_to_block_fp8": lambda: ([_marlin(rng, 128, n, 8), 128, n], ["marlin_q", "size_k", "size_n"]),
        "marlin_zero_points_to_codes": lambda: ([zp_packed, k, n, bits], ["zp_packed", "size_k", "size_n", "num_bits"]),
        "marlin_to_awq_zero_points": lambda: ([zp_packed, k, n, bits], ["zp_packed", "size_k", "size_n", "num_bits"]),
        "marlin_to_gptq_qzeros": lambda: ([zp_packed, k, n, g, bits],
                                          ["zp_packed", "size_k", "size_n", "group_size", "num_bits"]),
        "marlin_to_block_fp8_scales": lambda: ([_scales(rng, (1, n), np.float16), 128, n, np.float16],
                                               ["marlin_scales", "size_k", "size_n", "act_dtype"]),
        "stack_gptq_experts_to_marlin": lambda: (
            [[packing.pack_rows(_codes(rng, (k, n), bits), bits) for _ in range(2)],
             [_scales(rng, (ng, n), np.float16) for _ in range(2)], [qzeros, qzeros.copy()], bits, g, k, n],
            ["qweights", "scales", "qzeros", "num_bits", "group_size", "size_k", "size_n"]),
    }
    args, names = build_for[op]()
    return Call(op, args, names)


NUMPY_ONLY = {"marlin_to_codes", "marlin_to_block_fp8_scales"}  # no backend= keyword
OPS = [name for name in (
    "gptq_marlin_repack", "awq_marlin_repack", "fp8_marlin_repack_raw_bits", "block_fp8_group128_repack",
    "marlin_permute_scales", "marlin_unpermute_scales", "marlin_zero_points", "awq_to_marlin_zero_points",
    "repack_gptq_qzeros_to_marlin", "gptq_qzeros_are_symmetric_code7", "block_fp8_group128_scales",
    "marlin_to_codes", "marlin_to_gptq_qweight", "marlin_to_awq_qweight", "marlin_to_fp8_raw_bits",
    "marlin_to_block_fp8", "marlin_zero_points_to_codes", "marlin_to_awq_zero_points", "marlin_to_gptq_qzeros",
    "marlin_to_block_fp8_scales", "stack_gptq_experts_to_marlin")]
SCALE_ARGS = {"s", "inverse_scales", "scales", "marlin_scales"}
# 128-wide FP8 tiles and two experts: 0.1-0.3 s a call in the simulator (one Python thread per CUDA thread)
SLOW_IN_SIMULATOR = {"block_fp8_group128_repack", "marlin_to_block_fp8", "stack_gptq_experts_to_marlin"}


def test_the_harness_covers_every_public_op():
    public = {name for name, f in vars(ops).items() if callable(f) and not name.startswith("_")
              and getattr(f, "__module__", None) == "workbench.ops"}
    assert public == set(OPS), public ^ set(OPS)


# ---------------------------------------------------------------------------------------------------------------
# mutations: (call, expectation, whether a RuntimeWarning is due); expectation "same" (the valid call's result),
# "accept" (some result), "refuse" (ValueError/TypeError) or "any"
# ---------------------------------------------------------------------------------------------------------------
def _array_slots(call: Call):
    """(index, element index or None, name) of every array argument, list elements included."""
    slots = []
    for i, (a, name) in enumerate(zip(call.args, call.names)):
        if isinstance(a, np.ndarray):
            slots.append((i, None, name))
        elif isinstance(a, list):
            slots += [(i, j, f"{name}[{j}]") for j, x in enumerate(a) if isinstance(x, np.ndarray)]
    return slots


def _get(call, slot):
    i, j, _ = slot
    return call.args[i] if j is None else call.args[i][j]


def _set(call, slot, value) -> Call:
    i, j, _ = slot
    args = list(call.args)
    if j is None:
        args[i] = value
    else:
        args[i] = list(args[i])
        args[i][j] = value
    return dataclasses.replace(call, args=args)


def _scalar_slots(call: Call):
    return [i for i, a in enumerate(call.args) if type(a) is int]


def mutate(call: Call, cls: str, draw) -> tuple[Call, str, bool]:
    arrays, scalars = _array_slots(call), _scalar_slots(call)
    if cls == "valid":
        return call, "same", False
    if cls == "shape":
        if scalars and draw(st.booleans()):
            i = draw(st.sampled_from(scalars))
            value = draw(st.sampled_from([0, -16, -1, 1, 8, 24, 48, 96, 128, 2 ** 31, 2 ** 40]))
            args = list(call.args)
            args[i] = value
            return dataclasses.replace(call, args=args), "any", False
        slot = draw(st.sampled_from(arrays))
        a = _get(call, slot)
        how = draw(st.sampled_from(["drop_row", "add_row", "flatten", "add_axis", "drop_col", "empty"]))
        changed = {"drop_row": lambda: a[:-1] if a.ndim else a, "add_row": lambda: np.concatenate([a, a[:1]]),
                   "flatten": lambda: a.reshape(-1), "add_axis": lambda: a[None],
                   "drop_col": lambda: a[..., :-1], "empty": lambda: a[:0]}[how]()
        return _set(call, slot, np.ascontiguousarray(changed)), "any", False
    if cls == "dtype":
        slot = draw(st.sampled_from(arrays))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # casts that overflow are the point
            return _set(call, slot, _get(call, slot).astype(draw(st.sampled_from(CAST_DTYPES)))), "any", False
    if cls == "byteorder":
        swappable = [s for s in arrays if _get(call, s).dtype.itemsize > 1 and _get(call, s).dtype.kind in "iuf"]
        if not swappable:
            return call, "same", False
        slot = draw(st.sampled_from(swappable))
        a = _get(call, slot)
        return _set(call, slot, a.astype(a.dtype.newbyteorder(">"))), "same", False
    if cls == "layout":
        slot = draw(st.sampled_from(arrays))
        a = _get(call, slot)
        how = draw(st.sampled_from(["fortran", "strided", "readonly", "list"]))
        if how == "list":
            return _set(call, slot, a.tolist()), "refuse", False
        if how == "fortran":
            return _set(call, slot, np.asfortranarray(a)), "same", False
        if how == "readonly":
            b = a.copy()
            b.setflags(write=False)
            return _set(call, slot, b), "same", False
        wide = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype) if a.ndim else a
        wide[..., ::2] = a
        return _set(call, slot, wide[..., ::2]), "same", False
    if cls == "scalar":
        if not scalars:
            return call, "same", False
        i = draw(st.sampled_from(scalars))
        v = call.args[i]
        kind = draw(st.sampled_from(["np.int64", "np.int32", "float", "bool", "str", "none"]))
        new = {"np.int64": np.int64(v), "np.int32": np.int32(v), "float": float(v), "bool": bool(v), "str": str(v),
               "none": None}[kind]
        args = list(call.args)
        args[i] = new
        return dataclasses.replace(call, args=args), "same" if kind.startswith("np.") else "refuse", False
    if cls in ("values", "device"):
        return break_values(call, draw, on_device=cls == "device")
    raise AssertionError(cls)


def break_values(call: Call, draw, on_device: bool = False) -> tuple[Call, str, bool]:
    """One broken value the op's rules refuse (or NaN/Inf scales: kept, with a warning); unchanged if none fits.
    ``on_device``: only breaks a device array can carry (device perms are int32, device codes uint8)."""
    names = dict(zip(call.names, range(len(call.args))))
    choices = []
    if "perm" in names and call.args[names["perm"]] is not None:
        choices += ["perm_negative", "perm_repeat", "perm_outside"] + ([] if on_device else ["perm_wrap"])
    if call.op == "marlin_zero_points" and (call.args[3] == 4 or not on_device):  # 2^8 needs more than uint8
        choices += ["code_too_big"] + ([] if on_device else ["code_negative"])
    if names.keys() & SCALE_ARGS and call.op not in ("marlin_to_block_fp8_scales",):
        choices += ["nan", "inf"]
    if call.op in ("marlin_zero_points", "awq_to_marlin_zero_points", "marlin_zero_points_to_codes",
                   "marlin_to_awq_zero_points", "marlin_to_gptq_qzeros"):
        choices.append("zero_groups")
    if call.op == "repack_gptq_qzeros_to_marlin":
        choices.append("all_ones_field")
    if call.op == "marlin_to_gptq_qzeros":
        choices.append("zero_point_0")
    if not choices:
        return call, "same", False
    what = draw(st.sampled_from(choices))
    args = list(call.args)
    if what.startswith("perm"):
        p = args[names["perm"]].astype(np.int64)
        i = draw(st.integers(0, p.size - 1))
        p[i] = {"perm_wrap": p[i] + 2 ** 32, "perm_negative": -1 - p[i], "perm_repeat": p[(i + 1) % p.size],
                "perm_outside": p.size + p[i]}[what]
        args[names["perm"]] = p if what == "perm_wrap" else p.astype(np.int32)
        return dataclasses.replace(call, args=args), "refuse", False
    if what.startswith("code"):
        zp = args[0].astype(np.int16)
        zp.flat[draw(st.integers(0, zp.size - 1))] = -1 if what == "code_negative" else 1 << args[3]
        args[0] = zp if what == "code_negative" or args[3] == 8 else zp.astype(np.uint8)
        return dataclasses.replace(call, args=args), "refuse", False
    if what in ("nan", "inf"):
        slot = next(s for s in _array_slots(call) if s[2].split("[")[0] in SCALE_ARGS)
        s = _get(call, slot).copy()
        s.flat[draw(st.integers(0, s.size - 1))] = np.nan if what == "nan" else -np.inf
        return _set(call, slot, s), "accept", True
    if what == "zero_groups":
        args[0] = np.ascontiguousarray(args[0][:0])
        return dataclasses.replace(call, args=args), "refuse", False
    bits = args[names["num_bits"]]
    words = args[0].copy().view(np.uint32)
    field = draw(st.integers(0, 32 // bits - 1))
    mask = np.uint32(((1 << bits) - 1) << (field * bits))
    words.flat[draw(st.integers(0, words.size - 1))] &= ~mask  # a zero point of 0 (Marlin codes)
    if what == "all_ones_field":
        words = args[0].copy().view(np.uint32)
        words.flat[draw(st.integers(0, words.size - 1))] |= mask  # stored zero - 1 = all ones: zero 2^bits
    args[0] = words.view(np.int32)
    return dataclasses.replace(call, args=args), "refuse", False


# ---------------------------------------------------------------------------------------------------------------
# the oracle
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
    result: Any = None
    error: tuple[str, str] | None = None  # (exception type, message)
    warned: bool = False


def _snapshot(call: Call):
    return [(_get(call, s).shape, _get(call, s).dtype.str, _get(call, s).tobytes()) for s in _array_slots(call)]


def _to_device(call: Call) -> Call:
    from numba import cuda

    for slot in _array_slots(call):
        a = _get(call, slot)
        if a.dtype.isnative and a.flags.c_contiguous:
            call = _set(call, slot, cuda.to_device(a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a))
    return call


def run(call: Call, backend: str | None) -> Outcome:
    kwargs = dict(call.kwargs, **({} if backend is None else {"backend": backend}))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            result = getattr(ops, call.op)(*call.args, **kwargs)
        except Exception as exc:  # every exception is recorded; the oracle decides which are defects
            return Outcome(error=(type(exc).__name__, str(exc)), warned=_warned(seen))
    return Outcome(result=result, warned=_warned(seen))


def _warned(seen) -> bool:
    return any(issubclass(w.category, RuntimeWarning) and "NaN/Inf" in str(w.message) for w in seen)


def _host_bytes(x):
    if isinstance(x, MarlinWeight):
        return tuple(_host_bytes(getattr(x, f)) for f in ("qweight", "scales", "zeros", "g_idx", "perm")) + (
            x.weight_type.label, x.num_experts)
    if x is None or isinstance(x, (bool, np.bool_)):
        return x
    host = x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)
    return host.shape, host.tobytes()


def same_outcome(a: Outcome, b: Outcome) -> bool:
    if a.error or b.error:
        return a.error == b.error
    return _host_bytes(a.result) == _host_bytes(b.result)


ALLOWED = ("ValueError", "TypeError")


def defects(call: Call, expect: str, warn: bool, reference: Outcome, numba: bool, on_device: bool) -> list[str]:
    """Everything wrong with the outcome of ``call`` (empty: handled cleanly). ``reference``: the valid call's
    outcome on the NumPy backend, the result a value-preserving mutation must reproduce."""
    found = []
    before = _snapshot(call)
    numpy_backend = None if call.op in NUMPY_ONLY else "numpy"
    host = run(call, numpy_backend)
    if _snapshot(call) != before:
        found.append("input mutated (numpy)")
    outcomes = [("numpy", host)]
    if numba and call.op not in NUMPY_ONLY:
        device_call = _to_device(call) if on_device else call
        outcomes.append(("numba", run(device_call, "numba")))
        if _snapshot(call) != before:
            found.append("input mutated (numba)")
        if not same_outcome(host, outcomes[1][1]):
            found.append(f"backends disagree: numpy {host.error or 'ok'} / numba {outcomes[1][1].error or 'ok'}")
    for backend, out in outcomes:
        if out.error and out.error[0] not in ALLOWED:
            found.append(f"{backend}: {out.error[0]}: {out.error[1][:120]}")
        if expect == "same" and out.error:
            found.append(f"{backend}: a value-preserving change was refused: {out.error[1][:120]}")
        if expect == "same" and not out.error and not same_outcome(out, reference):
            found.append(f"{backend}: result differs from the valid call's")
        if expect == "accept" and out.error:
            found.append(f"{backend}: refused: {out.error[1][:120]}")
        if expect == "refuse" and not out.error:
            found.append(f"{backend}: invalid input accepted")
        if warn and not out.warned and not (on_device and backend == "numba"):  # device scales are not read back
            found.append(f"{backend}: NaN/Inf scales without a warning")
    return found


# ---------------------------------------------------------------------------------------------------------------
# the hypothesis driver
# ---------------------------------------------------------------------------------------------------------------
def example(data_draw, op: str, cls: str):
    """Draw one example of class ``cls`` for ``op`` -> (call, expect, warn, reference, on_device)."""
    seed = data_draw(st.integers(0, 2 ** 16))
    bits = data_draw(st.sampled_from([4, 8]))
    base = build(op, np.random.default_rng(seed), bits, data_draw(st.integers(1, 2)), data_draw(st.integers(0, 2)),
                 data_draw(st.booleans()), data_draw(st.sampled_from([np.float16, ml_dtypes.bfloat16, np.float32])))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = run(base, None if op in NUMPY_ONLY else "numpy")
    call, expect, warn = mutate(base, cls, data_draw)
    if cls == "device" and not data_draw(st.booleans()):
        call, expect, warn = base, "same", False  # device arrays with valid values half the time
    return call, expect, warn, reference, cls == "device"


@pytest.mark.parametrize("op", OPS)
@given(data=st.data())
def test_every_odd_argument_is_handled_cleanly(op, data):
    cls = data.draw(st.sampled_from(CLASSES if NUMBA else CLASSES[:-1]))
    call, expect, warn, reference, on_device = example(data.draw, op, cls)
    assert reference.error is None, reference.error  # the builders make valid calls
    # the Numba backend on about half the examples; a quarter for ops whose simulated kernels are slow
    numba = NUMBA and (on_device or data.draw(st.integers(0, 3)) < (1 if op in SLOW_IN_SIMULATOR else 2))
    found = defects(call, expect, warn, reference, numba, on_device)
    assert not found, (cls, op, found)


def campaign(per_op_and_class: int) -> dict:
    """A fresh random campaign (not derandomized): per class, (inputs tried, clean, inputs with a defect) and the
    distinct defects seen."""
    from hypothesis import HealthCheck, settings

    tally = {cls: [0, 0, 0, set()] for cls in CLASSES}

    def searcher(op: str, cls: str):
        @settings(max_examples=per_op_and_class, derandomize=False, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def one(data):
            call, expect, warn, reference, on_device = example(data.draw, op, cls)
            found = defects(call, expect, warn, reference, NUMBA, on_device)
            t = tally[cls]
            t[0] += 1
            t[1 if not found else 2] += 1
            t[3].update(f"{op}: {f}" for f in found)

        return one

    for op in OPS:
        for cls in CLASSES if NUMBA else CLASSES[:-1]:
            searcher(op, cls)()
    return tally


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    result = campaign(n)
    print(f"{'class':10} {'tried':>6} {'clean':>6} {'defect':>6}  distinct defects")
    for cls, (tried, clean, bad, kinds) in result.items():
        print(f"{cls:10} {tried:6d} {clean:6d} {bad:6d}  {len(kinds)}")
        for kind in sorted(kinds)[:40]:
            print(f"    {kind}")
    print("numba backend:", NUMBA, "| simulator:", hardware.simulator_enabled())
