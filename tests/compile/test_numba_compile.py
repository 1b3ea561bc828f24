"""Offline compile check of every Numba kernel, and the compiled integer semantics of their bit twiddling.

1. Every kernel variant in ``kernels_numba`` compiles for sm_80 and sm_90 with the real Numba CUDA compiler
   (``cuda.compile_ptx``) and the PTX assembles with ``ptxas``: typing errors the simulator accepts (a shared-array
   shape that is not a constant, a missing intrinsic) fail here. Needs no GPU.
2. The device helpers that twiddle bits run under ``numba.njit`` — compiled integer semantics, where ``uintN op
   literal`` widens to 64 bits instead of wrapping as in the simulator — and must still equal the NumPy
   reference maps exhaustively over a tile, and over every float32 bit pattern class for the float rounding.

This file must run in a process *without* NUMBA_ENABLE_CUDASIM (CI's second pytest process).
"""
import os
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1":
    pytest.skip("NUMBA_ENABLE_CUDASIM=1: the offline compile check needs the real Numba CUDA compiler; it runs in "
                "the tests/compile process", allow_module_level=True)

import numba  # noqa: E402
from numba import cuda  # noqa: E402

from kernels_numba import float_bits, marlin_repack, scales  # noqa: E402
from workbench.formats import marlin_tile, packing  # noqa: E402

ARCHS = ((8, 0), (9, 0))
TARGETS = list(marlin_repack.compile_targets()) + list(scales.compile_targets())


def test_every_kernel_variant_is_listed():
    names = [t[0] for t in TARGETS]
    assert len(names) == len(set(names))
    # direct: 3×2 (ktpt 1 and the default) + 3; 2 row gathers, perm inversion
    assert sum(n.startswith(("repack[", "unpack[", "gather_rows[", "invert_perm", "direct_")) for n in names) == 12
    assert any(n.startswith("block_fp8_scales") for n in names) and any(n.startswith("zero_points") for n in names)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) is not on PATH")
@pytest.mark.parametrize("cc", ARCHS, ids=lambda cc: f"sm_{cc[0]}{cc[1]}")
@pytest.mark.parametrize("name,pyfunc,argtypes", TARGETS, ids=[t[0] for t in TARGETS])
def test_kernel_compiles_and_assembles(name, pyfunc, argtypes, cc, tmp_path):
    ptx, _ = cuda.compile_ptx(pyfunc, argtypes, cc=cc)
    ptx_file = tmp_path / "kernel.ptx"
    ptx_file.write_text(ptx)
    result = subprocess.run(["ptxas", f"-arch=sm_{cc[0]}{cc[1]}", "-v", str(ptx_file), "-o",
                             str(tmp_path / "kernel.cubin")], capture_output=True, text=True)
    assert result.returncode == 0, f"{name} for sm_{cc[0]}{cc[1]}: ptxas failed\n{result.stderr}"
    assert "spill" not in result.stderr or "0 bytes spill stores" in result.stderr, result.stderr


# ---------------------------------------------------------------------------------------------------------------
# compiled integer semantics of the bit-twiddling helpers (njit = the compiled widening rules, on the CPU)
# ---------------------------------------------------------------------------------------------------------------
def _njit(device_function):
    return numba.njit(device_function.py_func)


@pytest.mark.parametrize("bits", [4, 8])
def test_direct_helpers_under_compiled_integer_semantics(bits, rng):
    """The direct kernels' word builders (and their inverses), njit-compiled, over one full 16×64 tile."""
    pf = 32 // bits
    codes = rng.integers(0, 1 << bits, (16, 64), dtype=np.uint8)
    gptq = packing.pack_rows(codes, bits).view(np.uint32)  # (16/pf, 64)
    expected = marlin_tile.marlin_repack_codes(codes, bits).view(np.uint32).ravel()
    if bits == 4:
        forward = _njit(marlin_repack.marlin_words_4bit)
        inverse = _njit(marlin_repack.gptq_byte_from_marlin_4bit)

        @numba.njit
        def build(g):
            out = np.empty(128, np.uint32)
            back = np.zeros_like(g)
            for col in range(8):
                for warp in range(4):
                    n = 16 * warp + col
                    for row2 in range(4):
                        w = forward(g[0, n], g[1, n], g[0, n + 8], g[1, n + 8], row2)
                        out[16 * col + 4 * row2 + warp] = w
                        back[0, n] |= np.uint32(inverse(w, 0) << np.uint32(8 * row2))
                        back[1, n] |= np.uint32(inverse(w, 1) << np.uint32(8 * row2))
                        back[0, n + 8] |= np.uint32(inverse(w, 2) << np.uint32(8 * row2))
                        back[1, n + 8] |= np.uint32(inverse(w, 3) << np.uint32(8 * row2))
            return out, back
    else:
        forward = _njit(marlin_repack.marlin_words_8bit)
        inverse = _njit(marlin_repack.gptq_half_from_marlin_8bit)

        @numba.njit
        def build(g):
            out = np.empty(256, np.uint32)
            back = np.zeros_like(g)
            for col in range(8):
                for slot in range(8):
                    n = 16 * (slot // 2) + col + 8 * (slot % 2)
                    for row2 in range(4):
                        w = forward(g[row2 // 2, n], g[2 + row2 // 2, n], row2)
                        out[32 * col + 8 * row2 + slot] = w
                        shift = np.uint32(16 * (row2 % 2))
                        back[row2 // 2, n] |= np.uint32(inverse(w, 0) << shift)
                        back[2 + row2 // 2, n] |= np.uint32(inverse(w, 1) << shift)
            return out, back
    out, back = build(np.ascontiguousarray(gptq))
    assert np.array_equal(out, expected)
    assert np.array_equal(back, gptq), f"{pf} codes per word"


def test_float_rounding_under_compiled_integer_semantics(rng):
    """f32 bits × 2^s -> f16 / bf16 bits equals NumPy / ml_dtypes for random patterns and every exponent × edge
    mantissa (ties, carries into the exponent, subnormal results, overflow, inf and NaN)."""
    convert = _njit(float_bits.f32_bits_scaled_to_half_bits)

    @numba.njit
    def run(xs, scale_log2, mant_bits, bias):
        out = np.empty(xs.size, np.uint16)
        for i in range(xs.size):
            out[i] = convert(xs[i], scale_log2, mant_bits, bias)
        return out

    exponents = np.arange(256, dtype=np.uint32) << np.uint32(23)
    mantissas = np.array([0, 1, 2, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3000, 0x7F, 0x80, 0x81, 0xFFFF, 0x8000,
                          0x10000, 0x18000, 0x400000, 0x7FFFFF], np.uint32)
    edges = (exponents[:, None] | mantissas[None, :]).ravel()
    xs = np.concatenate([rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32), edges,
                         edges | np.uint32(0x80000000)])
    values = xs.view(np.float32)
    for scale_log2, target, fmt in ((8, np.float16, float_bits.F16_FORMAT), (0, np.float16, float_bits.F16_FORMAT),
                                    (120, ml_dtypes.bfloat16, float_bits.BF16_FORMAT),
                                    (0, ml_dtypes.bfloat16, float_bits.BF16_FORMAT)):
        with np.errstate(all="ignore"):
            expected = (values * np.float32(2.0**scale_log2)).astype(target).view(np.uint16)
        got = run(xs, scale_log2, *fmt)
        mismatch = np.flatnonzero(got != expected)
        assert mismatch.size == 0, (f"2^{scale_log2} -> {np.dtype(target)}: {mismatch.size} mismatches, first "
                                    f"{hex(int(xs[mismatch[0]]))}: got {hex(int(got[mismatch[0]]))}, "
                                    f"expected {hex(int(expected[mismatch[0]]))}")
