"""workbench tour: every format end to end on a built-in layer, one table, non-zero exit on any mismatch.

For each case: quantize (reference RTN) -> checkpoint packing (GPTQ / AWQ / FP8 as the producing tools store it) ->
Marlin repack through ``workbench.ops`` -> inverse back to the checkpoint layout (must be bit-identical) ->
dequantize from the Marlin tensors (must equal the reference dequantized weight bit for bit).
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Callable

import ml_dtypes
import numpy as np
from tqdm import tqdm

from workbench import hardware, ops
from workbench.formats import fp8 as fp8_fmt
from workbench.formats import packing
from workbench.quantize import QuantizedWeight, dequantize, quantize_weights
from workbench.text import count

DEFAULT_K, DEFAULT_N = 512, 256  # the built-in layer: 32×4 Marlin tiles, 4 groups of 128
# K and N must be multiples of 128: groups of 128 along K, and block-FP8's 128×128 scale blocks along both
SIZE_MULTIPLE = 128
DEFAULT_SEED = 20261129


@dataclasses.dataclass
class TourRow:
    fmt: str
    shape: str
    backend: str
    exact: bool
    seconds: float
    detail: str = ""


def _builtin_layer(size_k: int, size_n: int, seed: int) -> np.ndarray:
    """A weight with the heavy-tailed, per-channel-scaled look of a real linear layer (fixed seed)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_t(df=5, size=(size_k, size_n)).astype(np.float32)
    return w * rng.uniform(0.01, 0.05, size=(1, size_n)).astype(np.float32)


def _marlin_dequant_matches(q: QuantizedWeight, codes, scales_logical, zeros, g_idx) -> bool:
    back = dequantize(codes, scales_logical, zeros, q.weight_type, q.group_size, g_idx, q.act_dtype)
    return bool(np.array_equal(back, q.w_ref))


def _case_gptq(w, weight_type: str, group_size: int, act_order: bool, backend: str) -> Callable[[], tuple[bool, str]]:
    def run() -> tuple[bool, str]:
        q = quantize_weights(w, weight_type, group_size, act_order=act_order)
        k, n = q.codes.shape
        bits = q.weight_type.bits
        qweight = packing.pack_rows(q.codes, bits)  # GPTQ checkpoint tensor
        perm = None
        if q.g_idx is not None:
            perm = np.argsort(q.g_idx, kind="stable").astype(np.int32)
        marlin = np.asarray(ops.gptq_marlin_repack(qweight, perm, k, n, bits, backend=backend))
        s = np.asarray(ops.marlin_permute_scales(q.scales, k, n, group_size, backend=backend))
        round_trip = np.array_equal(ops.marlin_to_gptq_qweight(marlin, perm, k, n, bits), qweight)
        scales_back = ops.marlin_unpermute_scales(s, k, n, group_size)
        zeros = None
        if q.zeros is not None:
            qzeros_v1 = packing.pack_cols(q.zeros - np.uint8(1), bits)  # AutoGPTQ stores zero - 1
            zp = np.asarray(ops.repack_gptq_qzeros_to_marlin(qzeros_v1, k, n, group_size, bits, backend=backend))
            zeros = ops.marlin_zero_points_to_codes(zp, k, n, bits)
            round_trip &= np.array_equal(ops.marlin_to_gptq_qzeros(zp, k, n, group_size, bits), qzeros_v1)
        codes = ops.marlin_to_codes(marlin, k, n, bits, perm)
        exact = round_trip and _marlin_dequant_matches(q, codes, scales_back, zeros, q.g_idx)
        return exact, "round trip + dequant"
    return run


def _case_awq(w, group_size: int, backend: str) -> Callable[[], tuple[bool, str]]:
    def run() -> tuple[bool, str]:
        q = quantize_weights(w, "u4", group_size)
        k, n = q.codes.shape
        qweight = packing.awq_pack(q.codes, 4)
        qzeros = packing.awq_pack(q.zeros, 4)
        marlin = np.asarray(ops.awq_marlin_repack(qweight, k, n, 4, backend=backend))
        zp = np.asarray(ops.awq_to_marlin_zero_points(qzeros, k, n, 4, backend=backend))
        exact = np.array_equal(ops.marlin_to_awq_qweight(marlin, k, n, 4), qweight)
        exact &= np.array_equal(ops.marlin_to_awq_zero_points(zp, k, n, 4), qzeros)
        codes = ops.marlin_to_codes(marlin, k, n, 4)
        zeros = ops.marlin_zero_points_to_codes(zp, k, n, 4)
        exact &= _marlin_dequant_matches(q, codes, q.scales, zeros, None)
        return bool(exact), "round trip + dequant"
    return run


def _case_block_fp8(w, act_dtype, backend: str) -> Callable[[], tuple[bool, str]]:
    def run() -> tuple[bool, str]:
        k, n = w.shape
        # DeepSeek-style: one float32 inverse scale per 128×128 block of the [N, K] weight
        blocks = np.abs(w.T.reshape(-(-n // 128), 128, k // 128, 128)).max(axis=(1, 3))
        inv = np.ascontiguousarray(np.maximum(blocks, 1e-12) / fp8_fmt.E4M3_MAX, dtype=np.float32)
        row_major = fp8_fmt.float_to_e4m3(w.T / np.repeat(np.repeat(inv, 128, 0), 128, 1)[:n])
        marlin = np.asarray(ops.block_fp8_group128_repack(row_major, k, n, backend=backend))
        s = np.asarray(ops.block_fp8_group128_scales(inv, k, n, act_dtype, backend=backend))
        exact = np.array_equal(ops.marlin_to_block_fp8(marlin, k, n), row_major)
        scales = fp8_fmt.expand_block_scales(inv, k, n)
        ref = dequantize(row_major.T, scales, None, "fe4m3fn", 128, None, act_dtype)
        folded = ops.marlin_unpermute_scales(s, k, n, 128).astype(np.float32)
        bias = np.float32(fp8_fmt.exponent_bias(act_dtype))
        codes = ops.marlin_to_codes(marlin, k, n, 8)
        kernel_view = (fp8_fmt.e4m3_to_float32(codes) / bias * np.repeat(folded, 128, 0)).astype(act_dtype)
        exact &= np.array_equal(kernel_view.astype(np.float32), ref)
        return bool(exact), "round trip + dequant"
    return run


def tour_cases(size_k: int, size_n: int, seed: int, backend: str) -> list[tuple[str, Callable]]:
    w = _builtin_layer(size_k, size_n, seed)
    cases = []
    for wt in ("u4b8", "u4", "u8b128", "u8"):
        for g in (-1, 128):
            cases.append((f"GPTQ {wt} g{g}", _case_gptq(w, wt, g, False, backend)))
    cases.append(("GPTQ u4b8 g128 act-order", _case_gptq(w, "u4b8", 128, True, backend)))
    cases.append(("GPTQ u8b128 g64 act-order", _case_gptq(w, "u8b128", 64, True, backend)))
    cases.append(("AWQ u4 g128", _case_awq(w, 128, backend)))
    cases.append(("FP8 e4m3 channelwise", _case_gptq_fp8(w, -1, backend)))
    cases.append(("block-FP8 128x128 (fp16)", _case_block_fp8(w, np.float16, backend)))
    cases.append(("block-FP8 128x128 (bf16)", _case_block_fp8(w, ml_dtypes.bfloat16, backend)))
    return cases


def _case_gptq_fp8(w, group_size: int, backend: str) -> Callable[[], tuple[bool, str]]:
    def run() -> tuple[bool, str]:
        q = quantize_weights(w, "fe4m3fn", group_size)
        k, n = q.codes.shape
        raw = packing.pack_rows(q.codes, 8)  # K-major raw E4M3 words, as vLLM's pack_fp8_to_int32 makes them
        marlin = np.asarray(ops.fp8_marlin_repack_raw_bits(raw, k, n, backend=backend))
        exact = np.array_equal(ops.marlin_to_fp8_raw_bits(marlin, k, n), raw)
        exact &= _marlin_dequant_matches(q, ops.marlin_to_codes(marlin, k, n, 8), q.scales, None, None)
        return bool(exact), "round trip + dequant"
    return run


def run_tour(size_k: int = DEFAULT_K, size_n: int = DEFAULT_N, seed: int = DEFAULT_SEED, backend: str = "auto",
             progress: bool = True) -> list[TourRow]:
    check_size("K", size_k)
    check_size("N", size_n)
    if backend == "numba":
        from workbench.backends import ensure_numba_target

        ensure_numba_target()  # one clear error here rather than the same one in every row
    rows = []
    cases = tour_cases(size_k, size_n, seed, backend)
    for name, case in tqdm(cases, desc="tour", disable=not progress, leave=False):
        t0 = time.perf_counter()
        try:
            exact, detail = case()
        except Exception as exc:  # a crash is a failed row, reported with its message
            exact, detail = False, f"{type(exc).__name__}: {exc}"
        rows.append(TourRow(name, f"{size_k}x{size_n}", backend, exact, time.perf_counter() - t0, detail))
    return rows


def check_size(name: str, value: int) -> int:
    """``value`` if it is a positive multiple of SIZE_MULTIPLE, else a ValueError naming it and the rule."""
    if value <= 0 or value % SIZE_MULTIPLE:
        raise ValueError(f"{name} = {value} is not a positive multiple of {SIZE_MULTIPLE} (the tour quantizes in"
                         f" groups of {SIZE_MULTIPLE} along K and block-FP8 uses {SIZE_MULTIPLE}x{SIZE_MULTIPLE}"
                         " scale blocks)")
    return value


def _size_arg(name: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            return check_size(name, int(text))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc) if text.strip().lstrip("-").isdigit()
                                             else f"{name} = {text!r} is not an integer") from None
    return parse


def _seed_arg(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"seed = {text!r} is not a non-negative integer")
    return int(text)


def format_table(rows: list[TourRow]) -> str:
    head = ("format", "K x N", "backend", "bit-exact", "time")
    body = [(r.fmt, r.shape, r.backend, "yes" if r.exact else f"NO ({r.detail})", f"{r.seconds * 1e3:7.1f} ms")
            for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in body]
    return "\n".join(lines)


def default_backend() -> str:
    """The Numba-CUDA kernels when a real GPU is here, else the NumPy reference."""
    return "numba" if hardware.gpu_available() else "numpy"


def _command(args) -> int:
    backend = default_backend() if args.backend == "auto" else args.backend
    print(f"device: {hardware.describe()}; backend: {backend}"
          + (" (GPU kernels)" if backend == "numba" and hardware.gpu_available() else ""))
    if backend == "numba" and hardware.simulator_enabled() and args.k * args.n > SIZE_MULTIPLE ** 2:
        print(f"the simulator runs one Python thread per CUDA thread, so this takes minutes at {args.k} x {args.n};"
              f" --k {SIZE_MULTIPLE} --n {SIZE_MULTIPLE} is the quickest")
    rows = run_tour(args.k, args.n, args.seed, backend, progress=not args.no_progress)
    print(format_table(rows))
    bad = [r.fmt for r in rows if not r.exact]
    if bad:
        print(f"MISMATCH in {count(len(bad), 'case')}: {', '.join(bad)}")
        return 1
    print(f"all {count(len(rows), 'case')} bit-exact")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("tour", help="run every format end to end on a built-in layer",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=_size_arg("K"), default=DEFAULT_K,
                   help=f"rows K of the built-in layer (a multiple of {SIZE_MULTIPLE}; default {DEFAULT_K})")
    p.add_argument("--n", type=_size_arg("N"), default=DEFAULT_N,
                   help=f"columns N of the built-in layer (a multiple of {SIZE_MULTIPLE}; default {DEFAULT_N})")
    p.add_argument("--seed", type=_seed_arg, default=DEFAULT_SEED, help="seed of the built-in layer's random weights")
    p.add_argument("--backend", choices=("auto", "numpy", "numba"), default="auto",
                   help="ops backend (auto: the Numba GPU kernels when a GPU is present, else NumPy; "
                        "numba without a GPU runs the kernels in the CUDA simulator)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=_command)
