"""vLLM's scalar-type ids for our weight types: the ``int b_q_type`` argument of the torch ops.

vLLM passes a weight type to its custom ops as one 64-bit integer that packs the type's fields, low bits first::

    bits  0.. 7  exponent bits        (0 for integers)
    bits  8..15  mantissa bits        (the code width for integers)
    bit     16   signed
    bits 17..48  bias                 (8 for u4b8, 128 for u8b128)
    bit     49   finite values only   (no infinities: e4m3fn)
    bits 50..57  NaN representation   (0 none, 1 IEEE 754, 2 "extended range": e4m3fn's single NaN per sign)

so ``uint4b8`` is ``1 << 50 | 8 << 17 | 4 << 8 = 1125899907892224``. The layout is vLLM's
``ScalarType.id`` (``vllm/scalar_type.py``); docs/torch.md names the snapshot it was read from. Integer types carry
NaN representation 1 there (the constructor's default), which is why 2^50 appears in every integer id.
"""
from __future__ import annotations

from typing import Any

from workbench.scalar_types import ScalarType

NAN_NONE, NAN_IEEE_754, NAN_EXTD_RANGE_MAX_MIN = 0, 1, 2

# field -> (offset, width): the packing above, one row per field
_FIELDS = {"exponent": (0, 8), "mantissa": (8, 8), "signed": (16, 1), "bias": (17, 32), "finite_only": (49, 1),
           "nan_repr": (50, 8)}

# our type -> vLLM's fields (exponent, mantissa, signed, bias, finite_only, nan_repr)
_VLLM_FIELDS = {
    ScalarType.U4: (0, 4, False, 0, False, NAN_IEEE_754),
    ScalarType.U4B8: (0, 4, False, 8, False, NAN_IEEE_754),
    ScalarType.U8: (0, 8, False, 0, False, NAN_IEEE_754),
    ScalarType.U8B128: (0, 8, False, 128, False, NAN_IEEE_754),
    ScalarType.FE4M3FN: (4, 3, True, 0, True, NAN_EXTD_RANGE_MAX_MIN),
    ScalarType.FE2M1F: (2, 1, True, 0, True, NAN_NONE),  # scalar_types.float4_e2m1f (NVFP4, MXFP4)
    ScalarType.F16: (5, 10, True, 0, False, NAN_IEEE_754),
    ScalarType.BF16: (8, 7, True, 0, False, NAN_IEEE_754),
}


def pack_id(exponent: int, mantissa: int, signed: bool, bias: int, finite_only: bool, nan_repr: int) -> int:
    """The packed id of a type given by its fields (the table in the module docstring)."""
    value = 0
    for name, field in zip(_FIELDS, (exponent, mantissa, signed, bias, finite_only, nan_repr)):
        offset, width = _FIELDS[name]
        if not 0 <= int(field) < (1 << width):
            raise ValueError(f"{name} = {field} does not fit the {width}-bit field of a scalar-type id")
        value |= int(field) << offset
    return value


def unpack_id(type_id: int) -> dict[str, int]:
    """Inverse of pack_id: field name -> value."""
    return {name: (int(type_id) >> offset) & ((1 << width) - 1) for name, (offset, width) in _FIELDS.items()}


VLLM_ID = {t: pack_id(*fields) for t, fields in _VLLM_FIELDS.items()}  # ScalarType -> vLLM id
_BY_ID = {v: t for t, v in VLLM_ID.items()}


def vllm_id(weight_type: "ScalarType | str") -> int:
    """vLLM's id of one of our scalar types (``ScalarType`` or its label, e.g. ``"u4b8"``)."""
    return VLLM_ID[ScalarType.parse(weight_type)]


def from_vllm_id(type_id: int) -> ScalarType:
    """Our ScalarType for a vLLM scalar-type id; ValueError naming the id and its fields otherwise."""
    if isinstance(type_id, bool) or not isinstance(type_id, int):
        raise TypeError(f"b_q_type must be an int (vLLM scalar-type id), got {type(type_id).__name__}")
    if type_id not in _BY_ID:
        known = ", ".join(f"{t.label} = {i}" for t, i in VLLM_ID.items())
        raise ValueError(f"b_q_type = {type_id} ({unpack_id(type_id)}) is not a type these ops know; known ids: "
                         f"{known}")
    return _BY_ID[type_id]


def as_type_id(value: Any) -> int:
    """What a Python caller may give as ``b_q_type``: our ScalarType or its label, a vLLM id, or any object with an
    integer ``.id`` (vLLM's own ScalarType) -> the vLLM id (checked to name a known type)."""
    if type(value) is int and value in _BY_ID:  # (a known id as it is: the per-call case)
        return value
    if isinstance(value, (ScalarType, str)):
        return vllm_id(value)
    type_id = getattr(value, "id", value)
    from_vllm_id(type_id)
    return int(type_id)
