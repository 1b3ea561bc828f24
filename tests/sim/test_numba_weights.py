"""Weight repacks: every Numba kernel equals its NumPy reference bit for bit (simulator, or a GPU if present).

Shapes: one to four 16×64 tiles, plus a column chunk that is not a multiple of the kernel's 512-column block, and
stacked experts. Fresh random codes every run; every output buffer starts as the poison pattern 0xA5A5A5A5.
"""
import dataclasses

import numpy as np
import pytest
from numba import cuda

from kernels_numba import marlin_repack as kr
from kernels_numba._launch import POISON_BYTE, poison_outputs
from workbench import ops
from workbench.formats import fp8 as fp8_fmt
from workbench.formats import marlin_tile, packing
from workbench.policy import RepackPolicy

# (K, N): 1 tile, 4 tiles (2×2), and 576 = 9 n-tiles, which crosses the kernels' 512-column block edge.
# The simulator runs one Python thread per CUDA thread (256 per block), so shapes stay this small on CI.
SHAPES = [(16, 64), (32, 128), (16, 576)]
SMALL_SHAPES = [(16, 64), (32, 128)]
POISON_WORD = np.uint32(int.from_bytes(bytes([POISON_BYTE] * 4), "little"))


def _codes(rng, k, n, bits):
    return rng.integers(0, 1 << bits, size=(k, n), dtype=np.uint8)


def test_poison_pattern_is_visible(rng):
    """The poison must actually land in an unwritten output (else the comparisons below prove less)."""
    with poison_outputs():
        from kernels_numba._launch import Arrays

        arrays = Arrays(None)
        out = arrays.give(arrays.empty((4, 8), np.uint32))
    assert np.all(out == POISON_WORD)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_marlin_repack_matches_reference(bits, k, n, act_order, rng):
    codes = _codes(rng, k, n, bits)
    qweight = packing.pack_rows(codes, bits)
    perm = rng.permutation(k).astype(np.int32) if act_order else None
    expected = marlin_tile.marlin_repack_codes(codes, bits, perm)
    with poison_outputs():
        got = ops.gptq_marlin_repack(qweight, perm, k, n, bits, backend="numba")
    assert isinstance(got, np.ndarray) and got.dtype == np.int32
    assert np.array_equal(got, expected)
    assert np.array_equal(got, ops.gptq_marlin_repack(qweight, perm, k, n, bits, backend="numpy"))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n", SHAPES)
def test_awq_marlin_repack_matches_reference(bits, k, n, rng):
    codes = _codes(rng, k, n, bits)
    with poison_outputs():
        got = ops.awq_marlin_repack(packing.awq_pack(codes, bits), k, n, bits, backend="numba")
    assert np.array_equal(got, marlin_tile.marlin_repack_codes(codes, bits))


@pytest.mark.parametrize("k,n", SHAPES)
def test_fp8_raw_bits_and_block_fp8_repacks_match_reference(k, n, rng):
    raw = rng.integers(0, 256, size=(n, k), dtype=np.uint8)  # row-major [N, K] E4M3 bytes, every code possible
    k_major = fp8_fmt.pack_fp8_to_int32(raw)
    expected = marlin_tile.marlin_repack_codes(np.ascontiguousarray(raw.T), 8)
    with poison_outputs():
        got_raw = ops.fp8_marlin_repack_raw_bits(k_major, k, n, backend="numba")
    assert np.array_equal(got_raw, expected)
    if k % fp8_fmt.BLOCK == 0:
        with poison_outputs():
            got_block = ops.block_fp8_group128_repack(raw.view(fp8_fmt.E4M3), k, n, backend="numba")
        assert np.array_equal(got_block, expected)
    with poison_outputs():  # the kernel itself has no K % 128 rule: the direct gather is the 8-bit tiling
        assert np.array_equal(kr.block_fp8_group128_repack(raw, k, n), expected)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n", SMALL_SHAPES)
def test_inverse_repacks_round_trip(bits, k, n, rng):
    codes = _codes(rng, k, n, bits)
    perm = rng.permutation(k).astype(np.int32)
    marlin = marlin_tile.marlin_repack_codes(codes, bits)
    marlin_perm = marlin_tile.marlin_repack_codes(codes, bits, perm)
    with poison_outputs():
        gptq = kr.marlin_to_gptq_qweight(marlin, None, k, n, bits)
        gptq_perm = kr.marlin_to_gptq_qweight(marlin_perm, perm, k, n, bits)
        awq = kr.marlin_to_awq_qweight(marlin, k, n, bits)
    assert np.array_equal(gptq, ops.marlin_to_gptq_qweight(marlin, None, k, n, bits))
    assert np.array_equal(gptq_perm, packing.pack_rows(codes, bits))
    assert np.array_equal(awq, ops.marlin_to_awq_qweight(marlin, k, n, bits))
    if bits == 8:
        with poison_outputs():
            raw_bits = kr.marlin_to_fp8_raw_bits(marlin, k, n)
            row_major = kr.marlin_to_block_fp8_row_major(marlin, k, n)
        assert np.array_equal(raw_bits, ops.marlin_to_fp8_raw_bits(marlin, k, n))
        assert np.array_equal(row_major, np.ascontiguousarray(codes.T))


@pytest.mark.parametrize("bits", [4, 8])
def test_stacked_experts_repack_in_one_launch(bits, rng):
    experts, k, n = 3, 16, 64
    codes = [_codes(rng, k, n, bits) for _ in range(experts)]
    perms = np.stack([rng.permutation(k) for _ in range(experts)]).astype(np.int32)
    stacked = np.stack([packing.pack_rows(c, bits) for c in codes])
    with poison_outputs():
        got = kr.gptq_marlin_repack(stacked, None, k, n, bits)
        got_perm = kr.gptq_marlin_repack(stacked, perms, k, n, bits)
        back = kr.marlin_to_gptq_qweight(got_perm, perms, k, n, bits)
    for e in range(experts):
        assert np.array_equal(got[e], marlin_tile.marlin_repack_codes(codes[e], bits))
        assert np.array_equal(got_perm[e], marlin_tile.marlin_repack_codes(codes[e], bits, perms[e]))
    assert np.array_equal(back, stacked)


def test_device_arrays_in_give_device_arrays_out(rng):
    """backend='auto' with a device array runs the kernel and hands back a device array (no host round trip)."""
    k, n, bits = 16, 64, 4
    codes = _codes(rng, k, n, bits)
    qweight = packing.pack_rows(codes, bits)
    d_in = cuda.to_device(qweight)
    got = ops.gptq_marlin_repack(d_in, None, k, n, bits, backend="auto")
    assert not isinstance(got, np.ndarray)
    host = got.get() if hasattr(got, "get") else got.copy_to_host()
    assert np.array_equal(host, marlin_tile.marlin_repack_codes(codes, bits))
    assert np.array_equal(d_in.copy_to_host(), qweight)  # input untouched


def test_kernels_never_mutate_their_inputs(rng):
    k, n, bits = 32, 128, 8
    qweight = packing.pack_rows(_codes(rng, k, n, bits), bits)
    perm = rng.permutation(k).astype(np.int32)
    before = (qweight.copy(), perm.copy())
    ops.gptq_marlin_repack(qweight, perm, k, n, bits, backend="numba")
    assert np.array_equal(qweight, before[0]) and np.array_equal(perm, before[1])


@pytest.mark.parametrize("bits,source", [(4, "gptq"), (8, "gptq"), (8, "row_major_bytes")])
@pytest.mark.parametrize("k_tiles_per_thread", [2, 4])
def test_direct_kernel_with_several_k_tiles_per_thread(bits, source, k_tiles_per_thread, rng):
    """The benchmark's launch-shape variant (a thread loads several k-tiles before storing); K = 48 leaves a
    partial group of k-tiles for the bounds check."""
    k, n = 48, 128
    codes = _codes(rng, k, n, bits)
    src = packing.pack_rows(codes, bits) if source == "gptq" else np.ascontiguousarray(codes.T)
    src_words = np.ascontiguousarray(src).view(np.uint32)[None]
    with poison_outputs():
        from kernels_numba._launch import Arrays

        arrays = Arrays(None)
        d_src = arrays.take(src_words, "src")
        out = arrays.empty((1, k // 16, n * 16 // (32 // bits)), np.uint32)
        grid = kr.direct_grid(k, n, bits, 1, k_tiles_per_thread)
        kr._direct_repack_kernel(bits, source, k_tiles_per_thread)[grid, kr.DIRECT_THREADS, arrays.stream](
            d_src, out, n)
        got = arrays.give(out[0], np.int32)
    assert np.array_equal(got, marlin_tile.marlin_repack_codes(codes, bits))


def _run_kernel(kernel, grid, threads, out_shape, inputs, size_n, out_view=None):
    """Launch ``kernel(*inputs, out, size_n)`` with a poisoned uint32 output (passed viewed as ``out_view``, e.g.
    uint64 for kernels that store 8-byte words); return the output as int32."""
    from kernels_numba._launch import Arrays

    with poison_outputs():
        arrays = Arrays(None)
        d_inputs = [arrays.take(a, f"input{i}") for i, a in enumerate(inputs)]
        out = arrays.empty(out_shape, np.uint32)
        kernel[grid, threads, arrays.stream](*d_inputs, out if out_view is None else out.view(out_view), size_n)
        return arrays.give(out, np.int32)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k_tiles_per_thread", [1, 2])
@pytest.mark.parametrize("kernel_kind", ["one-pass gather", "two-pass pass 2"])
def test_act_order_gather_kernels_with_several_k_tiles_per_thread(bits, k_tiles_per_thread, kernel_kind, rng):
    """The direct act-order gather (GPTQ rows in), and pass 2 of the two-pass repack (N-packed rows in, read
    through perm); K = 48 leaves a partial group of k-tiles; 2 stacked experts with their own perms."""
    experts, k, n = 2, 48, 128
    codes = [_codes(rng, k, n, bits) for _ in range(experts)]
    perms = np.stack([rng.permutation(k) for _ in range(experts)]).astype(np.int32)
    if kernel_kind == "one-pass gather":
        src = np.stack([packing.pack_rows(c, bits) for c in codes]).view(np.uint32)
        kernel = kr._perm_repack_kernel(bits, k_tiles_per_thread)
        grid = kr.perm_grid(k, n, bits, experts, k_tiles_per_thread)
    else:
        src = np.stack([packing.pack_cols(c, bits) for c in codes]).view(np.uint32)
        kernel = kr._awq_direct_repack_kernel(bits, k_tiles_per_thread, kr.DIRECT_THREADS, True, True)
        grid = kr.awq_grid(k, n, bits, experts, k_tiles_per_thread)
    got = _run_kernel(kernel, grid, kr.DIRECT_THREADS, (experts, k // 16, n * bits // 2), [src, perms], n)
    for e in range(experts):
        assert np.array_equal(got[e], marlin_tile.marlin_repack_codes(codes[e], bits, perms[e]))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k_tiles_per_thread", [1, 2])
def test_direct_awq_kernel_with_several_k_tiles_per_thread(bits, k_tiles_per_thread, rng):
    k, n = 48, 128
    codes = _codes(rng, k, n, bits)
    src = packing.awq_pack(codes, bits).view(np.uint32)[None]
    grid = kr.awq_grid(k, n, bits, 1, k_tiles_per_thread)
    got = _run_kernel(kr._awq_direct_repack_kernel(bits, k_tiles_per_thread), grid, kr.DIRECT_THREADS,
                      (1, k // 16, n * bits // 2), [src], n)
    assert np.array_equal(got[0], marlin_tile.marlin_repack_codes(codes, bits))


def test_transpose_tile_crosses_its_k_block_edge(rng):
    """Row-major FP8 <-> Marlin through the shared-memory tile: K = 144 = 9 k-tiles, one full block of
    TRANSPOSE_K_TILES = 8 and a partial one (only 4 of its 32 row words exist), 2 n-tiles."""
    assert kr.TRANSPOSE_K_TILES == 8  # the shape below is chosen for this value
    k, n = 144, 128
    raw = rng.integers(0, 256, size=(n, k), dtype=np.uint8)
    expected = marlin_tile.marlin_repack_codes(np.ascontiguousarray(raw.T), 8)
    with poison_outputs():
        got = kr.block_fp8_group128_repack(raw, k, n)
        back = kr.marlin_to_block_fp8_row_major(expected, k, n)
    assert np.array_equal(got, expected)
    assert np.array_equal(back, raw)


@pytest.mark.parametrize("bits,target", [(4, "gptq"), (8, "gptq"), (8, "row_major_bytes")])
@pytest.mark.parametrize("k_tiles_per_thread", [1, 2, 4])
def test_direct_unpack_with_several_k_tiles_per_thread(bits, target, k_tiles_per_thread, rng):
    """Inverse direct kernel, loads of several k-tiles before the stores; K = 48 leaves a partial group."""
    k, n = 48, 128
    codes = _codes(rng, k, n, bits)
    marlin = marlin_tile.marlin_repack_codes(codes, bits).view(np.uint32)[None]
    expected = packing.pack_rows(codes, bits) if target == "gptq" else np.ascontiguousarray(codes.T).view(np.int32)
    grid = kr.direct_grid(k, n, bits, 1, k_tiles_per_thread)
    got = _run_kernel(kr._direct_unpack_kernel(bits, target, k_tiles_per_thread), grid, kr.DIRECT_THREADS,
                      (1,) + expected.shape, [marlin], n)
    assert np.array_equal(got[0], expected)


# ---------------------------------------------------------------------------------------------------------------
# The inverse tile, the AWQ inverse's store forms, two-pass act-order: each against the reference, poisoned
# outputs, several experts, partial blocks
# ---------------------------------------------------------------------------------------------------------------
def test_transpose_tile_inverse(rng):
    """Marlin -> row-major FP8 through the inverse tile: K = 144 (one full block of 8 k-tiles, one with 1), 2
    experts."""
    experts, k, n = 2, 144, 128
    raws = [rng.integers(0, 256, size=(n, k), dtype=np.uint8) for _ in range(experts)]
    marlin = np.stack([marlin_tile.marlin_repack_codes(np.ascontiguousarray(r.T), 8) for r in raws]).view(np.uint32)
    got = _run_kernel(kr._transpose_repack_kernel(True), kr.transpose_grid(k, n, experts),
                      kr.TRANSPOSE_THREADS, (experts, n, k // 4), [marlin], n)
    for e in range(experts):
        assert np.array_equal(got[e].view(np.uint8), raws[e])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("wide_stores,n_fastest", [(False, False), (True, False), (True, True)])
def test_awq_unpack_store_widths(bits, wide_stores, n_fastest, rng):
    """Marlin -> AWQ with 4-byte and 8-byte stores, k- or n-fastest grid; 2 experts, N = 576 (the last block of
    n-tiles is partial)."""
    experts, k, n = 2, 32, 576
    codes = [_codes(rng, k, n, bits) for _ in range(experts)]
    marlin = np.stack([marlin_tile.marlin_repack_codes(c, bits) for c in codes]).view(np.uint32)
    kernel = kr._awq_direct_unpack_kernel(bits, wide_stores, n_fastest)
    grid = kr.awq_grid(k, n, bits, experts, 1, kr.DIRECT_THREADS, n_fastest)
    out_shape = (experts, k, n * bits // 32)
    got = _run_kernel(kernel, grid, kr.DIRECT_THREADS, out_shape, [marlin], n, np.uint64 if wide_stores else None)
    for e in range(experts):
        assert np.array_equal(got[e], packing.awq_pack(codes[e], bits))


@pytest.mark.parametrize("k_tiles_per_thread", [1, 2])
def test_paired_8bit_unpack(k_tiles_per_thread, rng):
    """Marlin W8 -> GPTQ 8-bit rows, two columns per thread and 8-byte stores; K = 48 (a partial group of
    k-tiles at 2 per thread), N = 320 (5 n-tiles: the second block of 4 is partial), 2 experts."""
    experts, k, n = 2, 48, 320
    codes = [_codes(rng, k, n, 8) for _ in range(experts)]
    marlin = np.stack([marlin_tile.marlin_repack_codes(c, 8) for c in codes]).view(np.uint32)
    got = _run_kernel(kr._paired_unpack_8bit_kernel(k_tiles_per_thread),
                      kr.paired_unpack_grid(k, n, experts, k_tiles_per_thread), kr.DIRECT_THREADS,
                      (experts, k // 4, n), [marlin], n, np.uint64)
    for e in range(experts):
        assert np.array_equal(got[e], packing.pack_rows(codes[e], 8))


@pytest.mark.parametrize("bits", [4, 8])
def test_npacked_pass_of_the_two_pass_act_order(bits, rng):
    """Pass 1: GPTQ rows -> N-packed rows (packing.pack_cols) through the shared tile; N = 576 leaves the column
    block (1024 / 512 columns) partial, 2 experts, 2 k-tiles."""
    experts, k, n = 2, 32, 576
    codes = [_codes(rng, k, n, bits) for _ in range(experts)]
    src = np.stack([packing.pack_rows(c, bits) for c in codes]).view(np.uint32)
    got = _run_kernel(kr._npacked_kernel(bits), kr.npacked_grid(k, n, bits, experts), kr.NPACK_THREADS,
                      (experts, k, n * bits // 32), [src], n)
    for e in range(experts):
        assert np.array_equal(got[e], packing.pack_cols(codes[e], bits))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("route", ["one-pass", "two-pass", "two-pass k-fastest"])
def test_act_order_wrapper_routes(bits, route, rng):
    """gptq_marlin_repack with a perm on one matrix: the one-pass gather and the two-pass route with pass 2 on an
    n-fastest (default) or k-fastest grid; K = 48 (a partial k-block at 2 k-tiles per thread), N = 576."""
    policy = dataclasses.replace(RepackPolicy(), act_order_two_pass=route != "one-pass",
                                 act_order_pass2_n_fastest=route == "two-pass")
    k, n = 48, 576
    codes = _codes(rng, k, n, bits)
    perm = rng.permutation(k).astype(np.int32)
    with poison_outputs():
        got = kr.gptq_marlin_repack(packing.pack_rows(codes, bits), perm, k, n, bits, policy=policy)
    assert np.array_equal(got, marlin_tile.marlin_repack_codes(codes, bits, perm))


@pytest.mark.parametrize("n_fastest", [False, True])
def test_awq_repack_wrapper_on_both_grid_orders(n_fastest, rng):
    """The AWQ repack wrapper with the grid-order switch both ways (True is the default): K = 48, N = 320."""
    policy = dataclasses.replace(RepackPolicy(), awq_repack_n_fastest=n_fastest)
    k, n, bits = 48, 320, 4
    codes = _codes(rng, k, n, bits)
    with poison_outputs():
        got = kr.awq_marlin_repack(packing.awq_pack(codes, bits), k, n, bits, policy=policy)
    assert np.array_equal(got, marlin_tile.marlin_repack_codes(codes, bits))


def test_awq_repack_on_an_n_fastest_grid(rng):
    """The direct AWQ repack built for an n-fastest grid (the default): 2 experts, K = 32, N = 576."""
    experts, k, n, bits = 2, 32, 576, 4
    codes = [_codes(rng, k, n, bits) for _ in range(experts)]
    src = np.stack([packing.awq_pack(c, bits) for c in codes]).view(np.uint32)
    got = _run_kernel(kr._awq_direct_repack_kernel(bits, 1, kr.DIRECT_THREADS, False, False, True),
                      kr.awq_grid(k, n, bits, experts, 1, kr.DIRECT_THREADS, True), kr.DIRECT_THREADS,
                      (experts, k // 16, n * 16 * bits // 32), [src], n)
    for e in range(experts):
        assert np.array_equal(got[e], marlin_tile.marlin_repack_codes(codes[e], bits))


@pytest.mark.parametrize("bits", [4, 8])
def test_round3_switches_off_give_the_round2_kernels_exactly(bits, rng):
    """The A/B's old variants stay reachable through the wrappers: Marlin -> AWQ with 4-byte stores, Marlin -> GPTQ
    8-bit through the direct unpack."""
    policy = dataclasses.replace(RepackPolicy(), awq_unpack_wide_stores=False,
                                 awq_unpack_n_fastest=False, paired_unpack_8bit=False)
    k, n = 32, 128
    codes = _codes(rng, k, n, bits)
    marlin = marlin_tile.marlin_repack_codes(codes, bits)
    with poison_outputs():
        awq = kr.marlin_to_awq_qweight(marlin, k, n, bits, policy=policy)
        gptq = kr.marlin_to_gptq_qweight(marlin, None, k, n, bits, policy=policy)
    assert np.array_equal(awq, packing.awq_pack(codes, bits))
    assert np.array_equal(gptq, packing.pack_rows(codes, bits))


@pytest.mark.parametrize("bits", [4, 8])
def test_n_fastest_grids_fall_back_when_k_blocks_exceed_grid_y(bits, rng, monkeypatch):
    """K/16 above gridDim.y's limit (65535, K > ~1M rows) sends the AWQ inverse and act-order pass 2 back to the
    k-fastest grid; the limit is lowered (to 0) here so a small K takes that path."""
    monkeypatch.setattr(kr, "MAX_GRID_Y", 0)
    k, n = 32, 128
    assert not kr.grid_n_fastest_fits(k)
    grid_orders = []  # the n_fastest argument of every AWQ-kernel grid the wrappers build
    awq_grid = kr.awq_grid

    def recording_awq_grid(*args, **kwargs):
        grid_orders.append(args[6] if len(args) > 6 else kwargs.get("n_fastest", False))
        return awq_grid(*args, **kwargs)

    monkeypatch.setattr(kr, "awq_grid", recording_awq_grid)
    codes = _codes(rng, k, n, bits)
    perm = rng.permutation(k).astype(np.int32)
    with poison_outputs():
        awq = kr.marlin_to_awq_qweight(marlin_tile.marlin_repack_codes(codes, bits), k, n, bits)
        act_order = kr.gptq_marlin_repack(packing.pack_rows(codes, bits), perm, k, n, bits)
    assert grid_orders == [False, False]  # the inverse's grid and pass 2's, both k-fastest
    assert np.array_equal(awq, packing.awq_pack(codes, bits))
    assert np.array_equal(act_order, marlin_tile.marlin_repack_codes(codes, bits, perm))


def test_old_module_switches_are_deprecated_shims_over_the_policy():
    """Setting an old switch warns and changes the default policy; reading it warns and reads the policy."""
    saved = kr._policy
    try:
        with pytest.warns(DeprecationWarning, match="act_order_two_pass"):
            kr.ACT_ORDER_TWO_PASS = False
        assert kr._policy == dataclasses.replace(saved, act_order_two_pass=False)
        with pytest.warns(DeprecationWarning, match="perm_k_tiles_per_thread"):
            assert kr.PERM_K_TILES_PER_THREAD == {4: 2, 8: 1}
        with pytest.warns(DeprecationWarning):
            kr.PERM_K_TILES_PER_THREAD = {4: 1, 8: 1}
        assert kr._policy.per_bits("perm_k_tiles_per_thread", 4) == 1
    finally:
        kr.__dict__["_policy"] = saved


def test_removed_transpose_inverse_mode_warns_and_changes_nothing():
    """TRANSPOSE_INVERSE_MODE went with the inverse tile's earlier modes: writing it warns that it has no effect and
    leaves the policy as it was; reading it warns and gives the one mode left."""
    saved = kr._policy
    with pytest.warns(DeprecationWarning, match="TRANSPOSE_INVERSE_MODE was removed and has no effect"):
        kr.TRANSPOSE_INVERSE_MODE = "loads_first"
    assert kr._policy is saved and "TRANSPOSE_INVERSE_MODE" not in vars(kr)
    with pytest.warns(DeprecationWarning, match="was removed"):
        assert kr.TRANSPOSE_INVERSE_MODE == "staged_marlin"
