"""The Marlin GEMM launch ABI: typed requests mapped to ferrum-kernels' versioned, ``repr(C)`` launch record.

ferrum-kernels (docs/formats.md, "Launch record"; Sources) calls its native Marlin through one C struct,
``FerrumMarlinLaunch`` (184 bytes, 8-byte aligned on x86-64), built from a typed request::

    MarlinMmRequest(weight_type, buffers, problem, execution)  --into_launch()-->  MarlinLaunch (ctypes)

Everything here is pure Python (no GPU, no CuPy): ``workbench.gemm`` validates a record and launches it.

Differences from ferrum-kernels, all additive: ``act_type`` may be ``bf16`` (ferrum-kernels fixes fp16; a, c and scale
types follow it), flag bit 6 asks for the deterministic reduction (``FLAG_DETERMINISTIC``, ours) and bit 7 for the batch-invariant
partition (``FLAG_BATCH_INVARIANT``, ours).
"""
from __future__ import annotations

import ctypes
import dataclasses

from workbench.scalar_types import ScalarType

ABI_VERSION = 1

# ferrum-kernels' flag bits (bit 0 is unused there too).
FLAG_HAS_ACT_ORDER = 1 << 1
FLAG_IS_K_FULL = 1 << 2
FLAG_HAS_ZERO_POINTS = 1 << 3
FLAG_USE_ATOMIC_ADD = 1 << 4
FLAG_USE_FP32_REDUCE = 1 << 5
# Ours: fixed-order cross-block sums only (atomic add refused), so the output is bitwise identical run to run.
# (Both non-atomic reductions already sum in block order; the flag makes the guarantee part of the request.)
FLAG_DETERMINISTIC = 1 << 6
# Ours: one tile and one K partition for every M and every sms (workbench.gemm.geometry.invariant_plan), so row r
# of C has the same bits whatever the other rows are; implies the deterministic reduction.
FLAG_BATCH_INVARIANT = 1 << 7
KNOWN_FLAGS = (FLAG_HAS_ACT_ORDER | FLAG_IS_K_FULL | FLAG_HAS_ZERO_POINTS | FLAG_USE_ATOMIC_ADD
               | FLAG_USE_FP32_REDUCE | FLAG_DETERMINISTIC | FLAG_BATCH_INVARIANT)

ACT_TYPES = (ScalarType.F16, ScalarType.BF16)
GEMM_WEIGHT_TYPES = (ScalarType.U4B8, ScalarType.U4, ScalarType.U8B128, ScalarType.U8, ScalarType.FE4M3FN,
                     ScalarType.FE2M1F)

_ptr = ctypes.c_void_p


class MarlinLaunch(ctypes.Structure):
    """``FerrumMarlinLaunch``, field for field (``#[repr(C)]``): 14 pointers, 14 i32, 4 u32 around them."""

    _fields_ = [
        ("abi_version", ctypes.c_uint32),
        ("struct_size", ctypes.c_uint32),
        ("a", _ptr),
        ("b", _ptr),
        ("c", _ptr),
        ("c_tmp", _ptr),
        ("b_bias", _ptr),
        ("a_scales", _ptr),
        ("b_scales", _ptr),
        ("global_scale", _ptr),
        ("zero_points", _ptr),
        ("group_index", _ptr),
        ("permutation", _ptr),
        ("a_tmp", _ptr),
        ("workspace", _ptr),
        ("stream", _ptr),
        ("prob_m", ctypes.c_int32),
        ("prob_n", ctypes.c_int32),
        ("prob_k", ctypes.c_int32),
        ("lda", ctypes.c_int32),
        ("a_type", ctypes.c_int32),
        ("b_type", ctypes.c_int32),
        ("c_type", ctypes.c_int32),
        ("scale_type", ctypes.c_int32),
        ("num_groups", ctypes.c_int32),
        ("group_size", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("thread_k_init", ctypes.c_int32),
        ("thread_n_init", ctypes.c_int32),
        ("sms", ctypes.c_int32),
        ("flags", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]

    def pointer(self, name: str) -> int:
        """A pointer field as an int (0 for null)."""
        return getattr(self, name) or 0


@dataclasses.dataclass(frozen=True)
class MarlinMmBuffers:
    """Device addresses (ints, 0 = absent) of every buffer a launch touches."""

    a: int
    b: int
    c: int
    c_tmp: int = 0
    a_scales: int = 0
    b_scales: int = 0
    zero_points: int = 0
    group_index: int = 0
    permutation: int = 0
    a_tmp: int = 0
    workspace: int = 0
    global_scale: int = 0  # NVFP4: one fp32 (vLLM's `const float*`)


@dataclasses.dataclass(frozen=True)
class MarlinMmProblem:
    m: int
    n: int
    k: int
    lda: int
    num_groups: int
    group_size: int


@dataclasses.dataclass(frozen=True)
class MarlinMmExecution:
    device: int = 0
    stream: int = 0  # a CUstream handle; 0 = the legacy default stream
    sms: int = -1  # -1: every SM of the device
    has_act_order: bool = False
    is_k_full: bool = True
    use_atomic_add: bool = False
    use_fp32_reduce: bool = True
    deterministic: bool = False
    batch_invariant: bool = False


@dataclasses.dataclass(frozen=True)
class MarlinMmRequest:
    weight_type: ScalarType
    buffers: MarlinMmBuffers
    problem: MarlinMmProblem
    execution: MarlinMmExecution
    act_type: ScalarType = ScalarType.F16
    scale_type: ScalarType | None = None  # None: the activation type; fe4m3fn (NVFP4) or fe8m0fnu (MX) scale bytes

    def flags(self) -> int:
        """ferrum-kernels' mapping: zero points are flagged by a non-null pointer, the rest by the execution
        booleans."""
        ex = self.execution
        flags = 0
        if ex.has_act_order:
            flags |= FLAG_HAS_ACT_ORDER
        if ex.is_k_full:
            flags |= FLAG_IS_K_FULL
        if self.buffers.zero_points:
            flags |= FLAG_HAS_ZERO_POINTS
        if ex.use_atomic_add:
            flags |= FLAG_USE_ATOMIC_ADD
        if ex.use_fp32_reduce:
            flags |= FLAG_USE_FP32_REDUCE
        if ex.deterministic:
            flags |= FLAG_DETERMINISTIC
        if ex.batch_invariant:
            flags |= FLAG_BATCH_INVARIANT
        return flags

    def into_launch(self) -> MarlinLaunch:
        weight_type = ScalarType.parse(self.weight_type)
        act_type = ScalarType.parse(self.act_type)
        if weight_type not in GEMM_WEIGHT_TYPES:
            raise ValueError(f"weight_type = {weight_type} is not a Marlin weight type "
                             f"({', '.join(map(str, GEMM_WEIGHT_TYPES))})")
        if act_type not in ACT_TYPES:
            raise ValueError(f"act_type = {act_type} is not f16 or bf16")
        b, p, ex = self.buffers, self.problem, self.execution
        return MarlinLaunch(
            abi_version=ABI_VERSION,
            struct_size=ctypes.sizeof(MarlinLaunch),
            a=b.a or None, b=b.b or None, c=b.c or None, c_tmp=b.c_tmp or None, b_bias=None,
            a_scales=b.a_scales or None, b_scales=b.b_scales or None, global_scale=b.global_scale or None,
            zero_points=b.zero_points or None, group_index=b.group_index or None,
            permutation=b.permutation or None, a_tmp=b.a_tmp or None, workspace=b.workspace or None,
            stream=ex.stream or None,
            prob_m=p.m, prob_n=p.n, prob_k=p.k, lda=p.lda,
            a_type=act_type.abi_code, b_type=weight_type.abi_code, c_type=act_type.abi_code,
            scale_type=(ScalarType.parse(self.scale_type) if self.scale_type else act_type).abi_code,
            num_groups=p.num_groups, group_size=p.group_size,
            device=ex.device, thread_k_init=-1, thread_n_init=-1, sms=ex.sms,
            flags=self.flags(), reserved=0,
        )
