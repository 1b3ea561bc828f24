"""Scale permutations, zero points and block-FP8 scales, as Numba-CUDA kernels.

Specified in docs/formats.md, "Scale permutation", "Zero points" and "Block FP8".

All of these are small (a scale row is N values per group), so each is one element-wise grid-stride launch over
every expert at once: with a leading expert axis the rows of all experts are just more rows.

Scale permutations act on each row in independent chunks, ``out[d] = in[chunk + P[d % W]]``::

    P64 (W = 64): the transpose of an 8×8 block        P64(i) = i//8 + 8*(i%8)
    P32 (W = 32): the transpose of a 4×4 block of pairs P32(i) = 2*(i//8) + (i%2) + 8*((i//2)%4)

Both are involutions (a transpose applied twice is the identity), so the inverse kernel is the forward kernel.

Shapes that are not tile multiples (docs/formats.md, "Shapes that are not tile multiples"): the Marlin tensors have
N_pad = ceil(N/64)*64 columns and ceil(K/G) groups. The forward kernels write every padded element as 0 and read
nothing past N (a gather whose source column is >= the source's width gives 0); the inverses read the padded
tensor and write the N true columns.

Marlin zero points (always P64, then the weights' field interleave, then column packing)::

    word (row, c), field f  ←  zero of column  n = chunk + P64(d % 64),  d = c*pf + INTERLEAVE[f]
    INTERLEAVE = [0,2,4,6,1,3,5,7] (4-bit) / [0,2,1,3] (8-bit), the same order AWQ uses inside its words

Sources: plain codes (uint8), AWQ words (undo the interleave), GPTQ v1 words (stored zero − 1: add 1; a stored
all-ones field is an error the host reports by group / packed column / lane, never a silent value).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, int32, uint32

from kernels_numba._launch import Arrays, copy_to_host_checked, is_device_array, jit
from workbench.formats._checks import (check_bits, check_size, code_range_message, padded_n,
                                       require_codes_in_range, require_integer_dtype, require_native_byte_order,
                                       require_pack_multiple,
                                       v1_all_ones_message, v1_zero_message)
from workbench.formats.fp8 import block_scale_shape, check_block_fp8_shapes, exponent_bias
from kernels_numba.float_bits import BF16_FORMAT, F16_FORMAT, f32_bits_scaled_to_half_bits

THREADS = 256  # element-wise kernels: one word per thread-step
MAX_BLOCKS = 132 * 16  # grid-stride cap: 16 blocks per SM of an H100/H200 keeps every SM busy without tail waste
BLOCK_FP8 = 128  # block-FP8 block edge (weight_block_size = [128, 128])
NO_ERROR = np.iinfo(np.int64).max  # "no bad field seen" for the atomic-min error slot


def _blocks(total: int) -> int:
    return max(1, min(MAX_BLOCKS, -(-total // THREADS)))


@cuda.jit(device=True, inline=True)
def p64(i):
    return (i >> 3) + ((i & 7) << 3)


@cuda.jit(device=True, inline=True)
def p32(i):
    return ((i >> 3) << 1) + (i & 1) + (((i >> 1) & 3) << 3)


# ---------------------------------------------------------------------------------------------------------------
# scale permutation (16- or 32-bit elements, raw bits), optionally rounding float32 into a 16-bit float
# ---------------------------------------------------------------------------------------------------------------
def permute_kernel_source(width: int, convert: str):
    """convert: "none" (move raw bits), "f16" or "bf16" (float32 bits in, rounded 16-bit float bits out)."""
    grouped = width == 64
    to_half = convert != "none"
    mant_bits, bias = BF16_FORMAT if convert == "bf16" else F16_FORMAT

    def permute(src, out):
        """src [rows, Cs], out [rows, Co] raw elements: out[r, d] = src[r, d - d%W + P(d%W)], or 0 where that
        column is past Cs (forward: Cs = N, Co = N_pad; inverse: Cs = N_pad, Co = N)."""
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        cols = out.shape[1]
        src_cols = src.shape[1]
        for t in range(start, out.size, stride):
            row = t // cols
            d = t - row * cols
            if grouped:
                s = d - (d & 63) + p64(d & 63)
            else:
                s = d - (d & 31) + p32(d & 31)
            if s >= src_cols:
                out[row, d] = 0  # a padded column: scale 0
            elif to_half:
                out[row, d] = f32_bits_scaled_to_half_bits(src[row, s], 0, mant_bits, bias)
            else:
                out[row, d] = src[row, s]

    return permute


@functools.lru_cache(maxsize=None)
def _permute_kernel(width: int, convert: str):
    return jit(permute_kernel_source(width, convert))


def _uses_p64(size_k: int, group_size: int) -> bool:
    return group_size != -1 and group_size < size_k


def _num_groups(size_k: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-size_k // group_size)


def _check_rows(d, name: str, rows: int, cols: int):
    shape = tuple(d.shape)
    if shape[-2:] != (rows, cols) or len(shape) not in (2, 3):
        raise ValueError(f"{name} has shape {shape}, expected ({rows}, {cols}) or (experts, {rows}, {cols})")


def _raw_view(d):
    """A device array of 16- or 32-bit floats -> the same bits as unsigned integers."""
    size = np.dtype(d.dtype).itemsize
    if size == 2:
        return d.view(np.uint16)
    if size == 4:
        return d.view(np.uint32)
    raise TypeError(f"scales must be 16- or 32-bit floats, got {d.dtype}")


def _permute(s, size_k: int, size_n: int, group_size: int, stream, out_dtype=None, inverse: bool = False):
    size_n = check_size(size_n, "size_n")
    cols_in, cols_out = (padded_n(size_n), size_n) if inverse else (size_n, padded_n(size_n))
    arrays = Arrays(stream)
    src_dtype = np.dtype(s.dtype) if not is_device_array(s) else None
    d = arrays.take(s, "s")
    in_dtype = src_dtype or np.dtype(d.dtype)
    _check_rows(d, "s", _num_groups(size_k, group_size), cols_in)
    raw = _raw_view(d)
    convert = "none"
    result_dtype = in_dtype
    if out_dtype is not None and np.dtype(out_dtype) != in_dtype:
        import ml_dtypes

        if in_dtype != np.dtype(np.float32) or np.dtype(out_dtype) not in (np.dtype(np.float16),
                                                                           np.dtype(ml_dtypes.bfloat16)):
            raise TypeError(f"scales convert only from float32 to float16/bfloat16 here, not {in_dtype} -> {out_dtype}")
        convert = "f16" if np.dtype(out_dtype) == np.dtype(np.float16) else "bf16"
        result_dtype = np.dtype(out_dtype)
    rows = int(np.prod(raw.shape[:-1]))
    out = arrays.empty(tuple(raw.shape[:-1]) + (cols_out,), np.uint16 if convert != "none" else raw.dtype)
    width = 64 if _uses_p64(size_k, group_size) else 32
    _permute_kernel(width, convert)[_blocks(rows * cols_out), THREADS, arrays.stream](
        raw.reshape((rows, cols_in)), out.reshape((rows, cols_out)))
    if arrays.any_device:  # raw bits for CuPy / Numba (no bfloat16 dtype); torch tensors in the result's dtype
        return arrays.give(out, result_dtype if getattr(arrays, "framework", None) == "torch" else None)
    return arrays.give(out).view(result_dtype)


def marlin_permute_scales(s, size_k: int, size_n: int, group_size: int, *, stream=None, out_dtype=None):
    """Scales [ng, N] (or [E, ng, N]) -> Marlin order [ng, N_pad] (padded columns 0): P64 when grouped with more
    than one group, else P32.

    With ``out_dtype`` float16/bfloat16 and float32 input, the values are also rounded (as NumPy's astype).
    Device results come back as raw 16/32-bit words (CuPy has no bfloat16); NumPy results keep the dtype.
    """
    return _permute(s, size_k, size_n, group_size, stream, out_dtype)


def marlin_unpermute_scales(s, size_k: int, size_n: int, group_size: int, *, stream=None):
    """Inverse of marlin_permute_scales, [ng, N_pad] -> [ng, N] (P64 and P32 are involutions: the same gather)."""
    return _permute(s, size_k, size_n, group_size, stream, inverse=True)


# ---------------------------------------------------------------------------------------------------------------
# zero points
# ---------------------------------------------------------------------------------------------------------------
def _zero_point_fields(bits: int) -> tuple[int, int, int, int]:
    """(fields per word, log2 of it, half of it, field mask) of ``bits``-wide zero points in a uint32 word."""
    pf = 32 // bits
    return pf, pf.bit_length() - 1, pf // 2, (1 << bits) - 1


def zero_points_kernel_source(bits: int, source: str):
    """source: "codes" (uint8 [rows, N]), "awq" or "gptq_v1" (uint32 [rows, N/pf]) -> Marlin uint32 [rows, N/pf]."""
    pf, log_pf, half_pf, mask = _zero_point_fields(bits)
    from_codes = source == "codes"
    from_awq = source == "awq"

    def zero_points(src, out, size_n, error):
        """out [rows, N_pad/pf]; a column n >= size_n is padding (code 0, nothing read). error: int64[2] = (lowest
        flat index row*N + n of a bad code, count): for codes a code that does not fit ``bits`` bits (each code is
        read once), for gptq_v1 a stored all-ones field; unused for awq."""
        words_per_row = out.shape[1]
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        for w in range(start, out.size, stride):
            row = w // words_per_row
            c = w - row * words_per_row
            word = uint32(0)
            for f in range(pf):
                d = (c << log_pf) + ((f & (half_pf - 1)) << 1) + (f >> (log_pf - 1))  # c*pf + INTERLEAVE[f]
                n = d - (d & 63) + p64(d & 63)
                if n >= size_n:
                    code = uint32(0)
                elif from_codes:
                    code = uint32(src[row, n])
                    if code > uint32(mask):  # reported, never silently truncated
                        cuda.atomic.min(error, 0, row * size_n + n)
                        cuda.atomic.add(error, 1, 1)
                    code = code & uint32(mask)
                else:
                    i = n & (pf - 1)
                    field = ((i >> 1) + half_pf * (i & 1)) if from_awq else i
                    code = uint32(src[row, n >> log_pf] >> uint32(field * bits)) & uint32(mask)
                    if not from_awq:  # GPTQ v1 stores zero - 1
                        if code == uint32(mask):
                            cuda.atomic.min(error, 0, row * size_n + n)
                            cuda.atomic.add(error, 1, 1)
                        code = uint32(code + uint32(1)) & uint32(mask)
                word = word | uint32(code << uint32(f * bits))
            out[row, c] = word

    return zero_points


def zero_points_inverse_kernel_source(bits: int, target: str):
    """Marlin uint32 [rows, N/pf] -> target: "codes" (uint8 [rows, N]), "awq" or "gptq_v1" (uint32 [rows, N/pf])."""
    pf, log_pf, half_pf, mask = _zero_point_fields(bits)
    to_codes = target == "codes"
    to_awq = target == "awq"

    @cuda.jit(device=True, inline=True)
    def marlin_code(zp, row, n):
        """Code of column n in row ``row`` of Marlin-packed zero points."""
        d = n - (n & 63) + p64(n & 63)  # P64 is its own inverse
        i = d & (pf - 1)
        field = (i >> 1) + half_pf * (i & 1)  # the interleave's inverse
        return uint32(zp[row, d >> log_pf] >> uint32(field * bits)) & uint32(mask)

    def zero_points_inverse(zp, out, size_n, error):
        """error: int64[2] = (lowest flat index of a zero of 0, count) for gptq_v1 (v1 cannot store it)."""
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        if to_codes:
            for t in range(start, out.size, stride):
                row = t // size_n
                n = t - row * size_n
                out[row, n] = marlin_code(zp, row, n)
        else:
            words_per_row = size_n >> log_pf
            for w in range(start, out.size, stride):
                row = w // words_per_row
                c = w - row * words_per_row
                word = uint32(0)
                for f in range(pf):
                    if to_awq:
                        n = (c << log_pf) + ((f & (half_pf - 1)) << 1) + (f >> (log_pf - 1))
                        code = marlin_code(zp, row, n)
                    else:
                        n = (c << log_pf) + f
                        code = marlin_code(zp, row, n)
                        if code == uint32(0):
                            cuda.atomic.min(error, 0, row * size_n + n)
                            cuda.atomic.add(error, 1, 1)
                        code = uint32(code + uint32(mask)) & uint32(mask)  # code - 1 mod 2^b, no wrap warning
                    word = word | uint32(code << uint32(f * bits))
                out[row, c] = word

    return zero_points_inverse


def symmetric_kernel_source():
    def not_symmetric(words, flags, symmetric_word):
        """words uint32 [E, W]; flags int32 [E] (zeroed): flags[e] = 1 when expert e has a word != symmetric_word."""
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        per_expert = words.shape[1]
        for t in range(start, words.size, stride):
            e = t // per_expert
            if words[e, t - e * per_expert] != uint32(symmetric_word):
                flags[e] = 1

    return not_symmetric


@functools.lru_cache(maxsize=None)
def _zp_kernel(bits: int, source: str):
    return jit(zero_points_kernel_source(bits, source))


@functools.lru_cache(maxsize=None)
def _zp_inverse_kernel(bits: int, target: str):
    return jit(zero_points_inverse_kernel_source(bits, target))


@functools.lru_cache(maxsize=None)
def _symmetric_kernel():
    return jit(symmetric_kernel_source())


def _check_bits_n(bits: int, size_n: int) -> tuple[int, int, int]:
    """The ops' scalar checks (one rule, one message) -> (bits, size_n, pack factor) as Python ints."""
    bits, size_n = check_bits(bits), check_size(size_n, "size_n")
    return bits, size_n, 32 // bits


def _rows_view(d, name: str, cols: int):
    """[rows, cols] or [E, rows, cols] -> ([total_rows, cols] view, leading shape)."""
    shape = tuple(d.shape)
    if len(shape) not in (2, 3) or shape[-1] != cols:
        raise ValueError(f"{name} has shape {shape}, expected [..., {cols}] with 2 or 3 dimensions")
    lead = shape[:-1]
    return d.reshape((int(np.prod(lead)), cols)), lead


def _new_error_slot(arrays: Arrays):
    return arrays.take(np.array([NO_ERROR, 0], dtype=np.int64), "error")


def _raise_v1_error(arrays: Arrays, error, size_n: int, bits: int, ng: int | None, what: str, codes=None,
                    lead: tuple[int, ...] = ()):
    """Raise what a zero-point kernel marked in ``error``: ``what`` = "all_ones" (a v1 stored all-ones field),
    "zero" (a zero of 0 going into v1) or "code_range" (a code in ``codes`` that does not fit ``bits``)."""
    host = arrays.to_host(error)
    if host[0] == NO_ERROR:
        return
    row, n = divmod(int(host[0]), size_n)
    if what == "code_range":  # codes [rows, N]: name the element as the caller indexes it ([ng, N] or [E, ng, N])
        value = int(copy_to_host_checked(codes[row, n:n + 1], arrays.stream)[0])
        index = (row // lead[1], row % lead[1], n) if len(lead) == 2 else (row, n)
        raise ValueError(code_range_message("zp", index, value, int(host[1]), bits))
    where = f"group={row}" if not ng else f"expert={row // ng} group={row % ng}"
    if what == "all_ones":
        raise ValueError(v1_all_ones_message(where, n, bits, int(host[1])))
    raise ValueError(v1_zero_message(where, n, int(host[1])))


def _zero_points(src, size_n: int, bits: int, source: str, stream, ng_for_errors: int | None = None):
    bits, size_n, pf = _check_bits_n(bits, size_n)
    arrays = Arrays(stream)
    if source == "codes":
        require_native_byte_order(src, "zp")
        require_integer_dtype(src, "zp")
        if np.dtype(src.dtype).itemsize != 1 or np.dtype(src.dtype).kind == "i":
            if is_device_array(src):
                raise TypeError(f"device zp must be uint8 codes, got {src.dtype}")
            require_codes_in_range(src, bits, "zp")  # before the narrowing cast, which could wrap a value into range
            src = np.asarray(src).astype(np.uint8)
        d = arrays.take(src, "zp").view(np.uint8)
        rows, lead = _rows_view(d, "zp", size_n)
    else:
        d = arrays.take(src, "qzeros", np.uint32)
        require_pack_multiple(size_n, pf, "size_n", f"{source} qzeros pack {pf} zero points per word")
        rows, lead = _rows_view(d, "qzeros", size_n // pf)
    out_cols = padded_n(size_n) // pf
    out = arrays.empty((rows.shape[0], out_cols), np.uint32)
    error = _new_error_slot(arrays)
    total = rows.shape[0] * out_cols
    _zp_kernel(bits, source)[_blocks(total), THREADS, arrays.stream](rows, out, size_n, error)
    if source == "gptq_v1":
        ng = ng_for_errors if len(lead) == 2 else None
        _raise_v1_error(arrays, error, size_n, bits, ng, "all_ones")
    elif source == "codes":
        _raise_v1_error(arrays, error, size_n, bits, None, "code_range", rows, lead)
    return arrays.give(out.reshape(lead + (out_cols,)), np.int32)


def marlin_zero_points(zp, size_k: int, size_n: int, num_bits: int, *, stream=None):
    """Zero-point codes [ng, N] (or [E, ng, N]) -> Marlin zero points int32 [ng, N/pf]."""
    return _zero_points(zp, size_n, num_bits, "codes", stream)


def awq_to_marlin_zero_points(q_zp_packed, size_k: int, size_n: int, num_bits: int, *, stream=None):
    """AWQ qzeros int32 [ng, N/pf] (or [E, ng, N/pf]) -> Marlin zero points int32 [ng, N/pf]."""
    return _zero_points(q_zp_packed, size_n, num_bits, "awq", stream)


def repack_gptq_qzeros_to_marlin(qzeros, size_k: int, size_n: int, group_size: int, num_bits: int = 4, *,
                                 stream=None):
    """GPTQ v1 qzeros int32 [K/G, N/pf] (or [E, ...]) -> Marlin zero points (zero = stored + 1).

    A stored all-ones field raises ValueError naming (expert,) group, packed column and lane; the kernel marks it,
    and the host checks the mark after the launch (one 16-byte copy back).
    """
    return _zero_points(qzeros, size_n, num_bits, "gptq_v1", stream, _num_groups(size_k, group_size))


def _zero_points_inverse(zp_packed, size_n: int, bits: int, target: str, stream):
    bits, size_n, pf = _check_bits_n(bits, size_n)
    arrays = Arrays(stream)
    d = arrays.take(zp_packed, "zp_packed", np.uint32)
    rows, lead = _rows_view(d, "zp_packed", padded_n(size_n) // pf)
    if target != "codes":
        require_pack_multiple(size_n, pf, "size_n", f"{target} qzeros pack {pf} zero points per word")
    cols = size_n if target == "codes" else size_n // pf
    out = arrays.empty((rows.shape[0], cols), np.uint8 if target == "codes" else np.uint32)
    error = _new_error_slot(arrays)
    _zp_inverse_kernel(bits, target)[_blocks(rows.shape[0] * cols), THREADS, arrays.stream](rows, out, size_n, error)
    if target == "gptq_v1":
        _raise_v1_error(arrays, error, size_n, bits, None, "zero")
    out = out.reshape(lead + (cols,))
    return arrays.give(out) if target == "codes" else arrays.give(out, np.int32)


def marlin_zero_points_to_codes(zp_packed, size_k: int, size_n: int, num_bits: int, *, stream=None):
    """Inverse of marlin_zero_points: int32 [ng, N/pf] -> uint8 codes [ng, N]."""
    return _zero_points_inverse(zp_packed, size_n, num_bits, "codes", stream)


def marlin_to_awq_zero_points(zp_packed, size_k: int, size_n: int, num_bits: int, *, stream=None):
    """Inverse of awq_to_marlin_zero_points."""
    return _zero_points_inverse(zp_packed, size_n, num_bits, "awq", stream)


def marlin_to_gptq_qzeros(zp_packed, size_k: int, size_n: int, group_size: int, num_bits: int = 4, *, stream=None):
    """Inverse of repack_gptq_qzeros_to_marlin (v1: stored = zero - 1; a zero of 0 is an error)."""
    return _zero_points_inverse(zp_packed, size_n, num_bits, "gptq_v1", stream)


def gptq_qzeros_not_symmetric(qzeros_stacked, bits: int = 4, *, stream=None, experts: int | None = None):
    """int32 [E, ...] v1 qzeros -> bool [E]: expert e has a stored zero other than 2^(b-1) - 1 (host result).
    ``experts=1`` reads any shape as one matrix."""
    bits = check_bits(bits)
    arrays = Arrays(stream)
    d = arrays.take(qzeros_stacked, "qzeros", np.uint32)
    experts = d.shape[0] if experts is None else experts
    words = d.reshape((experts, int(np.prod(d.shape)) // experts))
    field = (1 << (bits - 1)) - 1
    symmetric_word = sum(field << (bits * j) for j in range(32 // bits))
    flags = arrays.take(np.zeros(experts, np.int32), "flags")
    _symmetric_kernel()[_blocks(int(np.prod(words.shape))), THREADS, arrays.stream](words, flags, symmetric_word)
    return arrays.to_host(flags).astype(bool)


def gptq_qzeros_are_symmetric_code7(qzeros, num_bits: int = 4, *, stream=None) -> bool:
    """True when every v1 stored zero is 2^(b-1) - 1 (symmetric GPTQ); an empty tensor is not symmetric."""
    if int(np.prod(qzeros.shape)) == 0:
        return False
    return not bool(gptq_qzeros_not_symmetric(qzeros, num_bits, stream=stream, experts=1)[0])


# ---------------------------------------------------------------------------------------------------------------
# block-FP8 scales: inverse scales [ceil(N/128), ceil(K/128)] -> Marlin [ceil(K/128), N_pad], ×2^8 (f16) or
# ×2^120 (bf16)
# ---------------------------------------------------------------------------------------------------------------
def block_fp8_scales_kernel_source(src_bf16: bool, act: str):
    mant_bits, bias = BF16_FORMAT if act == "bf16" else F16_FORMAT
    scale_log2 = 120 if act == "bf16" else 8  # the factor the bit move loses: formats.md, "Exponent bias in the scales"

    def block_fp8_scales(inv, out, groups, size_n, cols):
        """inv: raw bits [E, ceil(N/128), ceil(K/128)] (uint16 bf16 or uint32 f32); out uint16 [E, groups * cols],
        cols = N_pad (a column >= size_n is padding: 0)."""
        per_expert = groups * cols
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        for t in range(start, out.size, stride):
            e = t // per_expert
            d = t - e * per_expert
            if groups == 1:
                logical = d - (d & 31) + p32(d & 31)
            else:
                logical = d - (d & 63) + p64(d & 63)
            group = logical // cols
            column = logical - group * cols
            if column >= size_n:
                out[e, d] = 0
                continue
            raw = inv[e, column >> 7, group]
            if src_bf16:
                bits32 = uint32(uint32(raw) << uint32(16))
            else:
                bits32 = uint32(raw)
            out[e, d] = f32_bits_scaled_to_half_bits(bits32, scale_log2, mant_bits, bias)

    return block_fp8_scales


@functools.lru_cache(maxsize=None)
def _block_fp8_scales_kernel(src_bf16: bool, act: str):
    return jit(block_fp8_scales_kernel_source(src_bf16, act))


def block_fp8_group128_scales(inverse_scales, size_k: int, size_n: int, act_dtype=np.float16, *, stream=None):
    """Block-FP8 inverse scales [ceil(N/128), K/128] (bf16 or float32; or [E, ...]) -> Marlin scales [K/128, N].

    f16: ``f16(inv * 2^8)``; bf16: ``bf16(inv * 2^120)``, rounded once, as the reference. NumPy callers get
    act_dtype; device callers get the raw uint16 bits (CuPy has no bfloat16).
    """
    import ml_dtypes

    size_k, size_n = check_block_fp8_shapes(size_k, size_n)
    act = np.dtype(act_dtype)
    exponent_bias(act)  # float16 or bfloat16, else the reference's TypeError
    arrays = Arrays(stream)
    host_dtype = None if is_device_array(inverse_scales) else np.dtype(inverse_scales.dtype)
    d = arrays.take(inverse_scales, "inverse_scales")
    src_dtype = host_dtype or np.dtype(d.dtype)
    if src_dtype == np.dtype(ml_dtypes.bfloat16) or src_dtype == np.dtype(np.uint16):
        src_bf16 = True  # device bf16 arrives as its raw uint16 bits
        d = d.view(np.uint16)
    elif src_dtype == np.dtype(np.float32):
        src_bf16 = False
        d = d.view(np.uint32)
    else:
        raise TypeError(f"inverse_scales must be bfloat16 or float32, got {src_dtype}")
    rows, groups = block_scale_shape(size_k, size_n)
    shape = tuple(d.shape)
    if shape[-2:] != (rows, groups) or len(shape) not in (2, 3):
        raise ValueError(f"inverse_scales has shape {shape}, expected ({rows}, {groups}) = [ceil(N/128), "
                         f"ceil(K/128)]")
    stacked = len(shape) == 3
    inv = d.reshape(((shape[0] if stacked else 1), rows, groups))
    experts = inv.shape[0]
    cols = padded_n(size_n)
    out = arrays.empty((experts, groups * cols), np.uint16)
    act_name = "bf16" if act == np.dtype(ml_dtypes.bfloat16) else "f16"
    _block_fp8_scales_kernel(src_bf16, act_name)[_blocks(experts * groups * cols), THREADS, arrays.stream](
        inv, out, groups, size_n, cols)
    out = out.reshape((experts, groups, cols) if stacked else (groups, cols))
    if arrays.any_device:  # raw bits for CuPy / Numba (no bfloat16 dtype); torch tensors in act_dtype
        return arrays.give(out, act if getattr(arrays, "framework", None) == "torch" else None)
    return arrays.give(out).view(act)


def compile_targets():
    """(name, python function, argument types) of every kernel variant here, for the offline compile check."""
    from numba import types

    def arr(dt, nd):
        return types.Array(dt, nd, "C")

    for width in (32, 64):
        for raw in (types.uint16, types.uint32):
            yield f"permute[P{width},{raw}]", permute_kernel_source(width, "none"), (arr(raw, 2), arr(raw, 2))
        for conv in ("f16", "bf16"):
            yield (f"permute[P{width},f32->{conv}]", permute_kernel_source(width, conv),
                   (arr(types.uint32, 2), arr(types.uint16, 2)))
    for bits in (4, 8):
        yield (f"zero_points[{bits}-bit,codes]", zero_points_kernel_source(bits, "codes"),
               (arr(types.uint8, 2), arr(types.uint32, 2), types.int64, arr(types.int64, 1)))
        for source in ("awq", "gptq_v1"):
            yield (f"zero_points[{bits}-bit,{source}]", zero_points_kernel_source(bits, source),
                   (arr(types.uint32, 2), arr(types.uint32, 2), types.int64, arr(types.int64, 1)))
        yield (f"zero_points_inverse[{bits}-bit,codes]", zero_points_inverse_kernel_source(bits, "codes"),
               (arr(types.uint32, 2), arr(types.uint8, 2), types.int64, arr(types.int64, 1)))
        for target in ("awq", "gptq_v1"):
            yield (f"zero_points_inverse[{bits}-bit,{target}]", zero_points_inverse_kernel_source(bits, target),
                   (arr(types.uint32, 2), arr(types.uint32, 2), types.int64, arr(types.int64, 1)))
    yield "gptq_qzeros_not_symmetric", symmetric_kernel_source(), (arr(types.uint32, 2), arr(types.int32, 1),
                                                                   types.int64)
    for src_bf16, raw in ((True, types.uint16), (False, types.uint32)):
        for act in ("f16", "bf16"):
            yield (f"block_fp8_scales[{'bf16' if src_bf16 else 'f32'}->{act}]",
                   block_fp8_scales_kernel_source(src_bf16, act),
                   (arr(raw, 3), arr(types.uint16, 2), types.int64, types.int64, types.int64))
