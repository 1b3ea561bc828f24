"""Weight scalar types of the Marlin family, with their launch-record codes (docs/formats.md, "Weight scalar types").

A weight type says how many bits a code has, how many codes share an int32 word
(the *pack factor*), and how a code becomes a number:

* ``u4b8`` / ``u8b128``: symmetric, ``value = code - bias`` (bias 8 / 128, folded into dequantization);
* ``u4`` / ``u8``: asymmetric, ``value = code - zero_point`` with a zero point per (group, column);
* ``fe4m3fn``: the byte is an FP8 E4M3 number (no zero point);
* ``fe2m1f``: the nibble is an FP4 E2M1 number (NVFP4, MXFP4; no zero point).

Scales are in the activation type, except the microscaled formats' scale bytes: ``fe4m3fn`` (NVFP4's, stored as
S0E5M3 bytes) and ``fe8m0fnu`` (the MX formats'), both given to the GEMM as ``scale_type``.
"""
from __future__ import annotations

import enum


class ScalarType(enum.Enum):
    # value = (name, bits, bias, has_zero_points, abi_code)
    # abi codes 1, 4, 5, 8 are the launch record's FERRUM_MARLIN_SCALAR_* values; 2, 6, 7 are ours (the record has
    # no bf16, u8 or u8b128 code; docs/formats.md, "Launch record").
    F16 = ("f16", 16, None, False, 1)
    BF16 = ("bf16", 16, None, False, 2)
    U4 = ("u4", 4, None, True, 4)
    U4B8 = ("u4b8", 4, 8, False, 5)
    U8 = ("u8", 8, None, True, 6)
    U8B128 = ("u8b128", 8, 128, False, 7)
    FE4M3FN = ("fe4m3fn", 8, None, False, 8)
    FE2M1F = ("fe2m1f", 4, None, False, 9)  # E2M1 (NVFP4 / MXFP4 elements); 9 is ours
    # E8M0 (the MX formats' scale bytes, 2^(code - 127)): a scale type only, never a weight; 10 is ours
    FE8M0FNU = ("fe8m0fnu", 8, None, False, 10)

    def __init__(self, label: str, bits: int, bias: int | None, has_zero_points: bool, abi_code: int):
        self.label = label
        self.bits = bits
        self.bias = bias
        self.has_zero_points = has_zero_points
        self.abi_code = abi_code

    @property
    def pack_factor(self) -> int:
        """Codes per 32-bit word."""
        return 32 // self.bits

    @property
    def is_integer_weight(self) -> bool:
        return self in (ScalarType.U4, ScalarType.U4B8, ScalarType.U8, ScalarType.U8B128)

    @classmethod
    def parse(cls, value: "ScalarType | str") -> "ScalarType":
        if isinstance(value, ScalarType):
            return value
        for member in cls:
            if member.label == str(value).lower() or member.name == str(value).upper():
                return member
        names = ", ".join(m.label for m in WEIGHT_TYPES)
        raise ValueError(f"unknown weight type {value!r}; expected one of {names}")

    def __str__(self) -> str:
        return self.label


WEIGHT_TYPES = (ScalarType.U4B8, ScalarType.U4, ScalarType.U8B128, ScalarType.U8, ScalarType.FE4M3FN)

# Group sizes Marlin kernels are built for (-1 = one group over all of K, "channelwise").
SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
