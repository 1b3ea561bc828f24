"""Float32 → float16 / bfloat16 rounding in integer arithmetic, for kernels that rescale scales.

What they compute: docs/formats.md, "Exponent bias in the scales" and "Block FP8".

Why integers: the value has to come out *bit-identical* to NumPy's ``(f32 * 2^s).astype(f16 | bf16)`` in both
worlds, the CUDA simulator (NumPy scalars) and compiled code (hardware ``cvt``), including subnormals, overflow to
infinity and ties. Doing the rounding on the bit pattern makes both worlds run the same instructions, and a test
can compare it against NumPy / ml_dtypes over every interesting bit pattern with ``numba.njit`` (compiled integer
semantics) as well as in the simulator.

    f32 bits  s|eeeeeeee|mmmmmmmmmmmmmmmmmmmmmmm      value = M · 2^P,  M = 1.m (or 0.m), P = e - 150 (or -149)
    target    s|  E bits |T mantissa bits           f16: E = 5, T = 10, bias 15;  bf16: E = 8, T = 7, bias 127

The product with 2^s is exact in float32 unless it overflows, and then both routes give infinity, so rounding
``M · 2^(P+s)`` once (round to nearest, ties to even) is the same as NumPy's multiply-then-cast.
"""
from __future__ import annotations

from numba import cuda, int32, uint32

F16_FORMAT = (10, 15)  # (mantissa bits, exponent bias)
BF16_FORMAT = (7, 127)


@cuda.jit(device=True, inline=True)
def f32_bits_scaled_to_half_bits(x, scale_log2, mant_bits, bias):
    """Bits of ``target(f32_from_bits(x) * 2^scale_log2)``, target = 16-bit float with mant_bits/bias.

    NaN follows NumPy (f16: sign | 0x7C00 | top mantissa bits, quieted) and ml_dtypes (bf16: sign | 0x7FC0).
    """

    def round_shift_right(v, r):
        """v >> r rounded to nearest, ties to even (v < 2^25, 0 < r < 32). Inner function: one body for njit too."""
        q = v >> uint32(r)
        rem = v & uint32((uint32(1) << uint32(r)) - uint32(1))
        halfway = uint32(1) << uint32(r - 1)
        if rem > halfway or (rem == halfway and (q & uint32(1)) == uint32(1)):
            q = q + uint32(1)
        return uint32(q)

    x = uint32(x)
    sign = uint32((x >> uint32(16)) & uint32(0x8000))
    e = int32((x >> uint32(23)) & uint32(0xFF))
    m = uint32(x & uint32(0x7FFFFF))
    exp_field_max = (bias << 1) + 1  # all-ones exponent field: inf / NaN
    inf_bits = uint32(exp_field_max << mant_bits)
    if e == 255:
        if m == uint32(0):
            return uint32(sign | inf_bits)
        if mant_bits == 10:  # NumPy: keep the top mantissa bits, quiet bit set (x86 quiets NaN in the multiply)
            return uint32(sign | inf_bits | ((m | uint32(0x400000)) >> uint32(13)))
        return uint32(sign | inf_bits | (uint32(1) << uint32(mant_bits - 1)))  # ml_dtypes: canonical quiet NaN
    if e == 0:
        if m == uint32(0):
            return sign
        big_m = m
        p = int32(-149 + scale_log2)
        top = 0  # bit length - 1 of a subnormal significand
        probe = m
        while probe > uint32(1):
            probe = probe >> uint32(1)
            top += 1
    else:
        big_m = uint32(m | uint32(0x800000))
        p = int32(e - 150 + scale_log2)
        top = 23
    unbiased = top + p  # exponent of the leading bit
    if unbiased > bias:
        return uint32(sign | inf_bits)
    if unbiased >= 1 - bias:  # normal result: keep mant_bits + 1 significant bits
        r = top - mant_bits
        if r > 0:
            q = round_shift_right(big_m, r)
        else:
            q = uint32(big_m << uint32(-r))
        # q carries the implicit bit; adding it to (exponent - 1) lets a rounding carry bump the exponent (even to inf)
        return uint32(sign | uint32(uint32((unbiased + bias - 1) << mant_bits) + q))
    r = (1 - bias - mant_bits) - p  # subnormal result: count units of 2^(1 - bias - mant_bits)
    if r >= 26:
        return sign
    if r > 0:
        return uint32(sign | round_shift_right(big_m, r))
    return uint32(sign | uint32(big_m << uint32(-r)))
