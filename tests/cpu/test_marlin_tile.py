"""The Marlin tile maps: each named map exhaustively, their composition against the spec's closed form and against
vLLM's table construction, and the repack reference on vLLM's repack grid."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oracles import vllm_style_marlin_weights, vllm_style_weight_perm
from workbench import ops
from workbench.formats import marlin_tile as mt
from workbench.formats import packing


def test_b_fragment_is_a_bijection_onto_the_16x8_block():
    lane, e = np.meshgrid(np.arange(32), np.arange(4), indexing="ij")
    dk, dn = mt.mma_b_fragment(lane, e)
    cells = set(zip(dk.ravel().tolist(), dn.ravel().tolist()))
    assert cells == {(k, n) for k in range(16) for n in range(8)}
    back_lane, back_e = mt.mma_b_fragment_owner(dk, dn)
    assert np.array_equal(back_lane, lane) and np.array_equal(back_e, e)


def test_b_fragment_matches_ptx_description():
    # lane t holds column t//4, rows 2(t%4)+{0,1} and 2(t%4)+8+{0,1}
    for t in range(32):
        rows = sorted(mt.mma_b_fragment(t, e)[0] for e in range(4))
        assert rows == [2 * (t % 4), 2 * (t % 4) + 1, 2 * (t % 4) + 8, 2 * (t % 4) + 9]
        assert {int(mt.mma_b_fragment(t, e)[1]) for e in range(4)} == {t // 4}


@pytest.mark.parametrize("bits", [4, 8])
def test_slot_element_map_is_a_bijection(bits):
    pf = 32 // bits
    slot, element = np.meshgrid(np.arange(mt.words_per_lane(bits)), np.arange(pf), indexing="ij")
    warp, half, e = mt.slot_element_to_fragment(slot, element, bits)
    assert len(set(zip(warp.ravel(), half.ravel(), e.ravel()))) == 32
    s2, el2 = mt.fragment_to_slot_element(warp, half, e, bits)
    assert np.array_equal(s2, slot) and np.array_equal(el2, element)


def test_field_interleave_puts_row_pairs_16_bits_apart():
    # 4-bit: fields j and j+4 hold rows k and k+1 of the same column (dequant pulls them as one half2)
    for j in range(4):
        k0, n0 = mt.marlin_word_field_to_kn(0, j, 64, 4)
        k1, n1 = mt.marlin_word_field_to_kn(0, j + 4, 64, 4)
        assert (k1 - k0, n1 - n0) == (1, 0)
    # 8-bit: bytes (0, 2) and (1, 3) hold rows (k, k+1) and (k+8, k+9)
    ks = [int(mt.marlin_word_field_to_kn(0, j, 64, 8)[0]) for j in range(4)]
    assert ks == [0, 8, 1, 9]


@pytest.mark.parametrize("bits", [4, 8])
def test_composition_is_a_bijection_and_inverse(bits):
    size_k, size_n = 32, 192  # 2 × 3 tiles
    pf = 32 // bits
    words, fields = np.meshgrid(np.arange(size_k * size_n // pf), np.arange(pf), indexing="ij")
    k, n = mt.marlin_word_field_to_kn(words, fields, size_n, bits)
    assert len(set(zip(k.ravel().tolist(), n.ravel().tolist()))) == size_k * size_n
    assert k.min() == 0 and k.max() == size_k - 1 and n.max() == size_n - 1
    w2, f2 = mt.marlin_kn_to_word_field(k, n, size_n, bits)
    assert np.array_equal(w2, words) and np.array_equal(f2, fields)


@pytest.mark.parametrize("bits", [4, 8])
def test_composition_equals_spec_closed_form(bits):
    size_n = 128
    pf = 32 // bits
    wpt = 1024 // pf
    for word in range(2 * wpt * (size_n // 64)):
        tile, wit = divmod(word, wpt)
        k_tile, n_tile = divmod(tile, size_n // 64)
        if bits == 4:
            thread, warp = divmod(wit, 4)
            half = 0
        else:
            thread, lane = divmod(wit, 8)
            warp, half = divmod(lane, 2)
        col, row2 = divmod(thread, 4)
        k0, n0 = 16 * k_tile + 2 * row2, 64 * n_tile + 16 * warp + col + 8 * half
        for j in range(pf):
            if bits == 4:
                expect = (k0 + (j >> 2) + 8 * (j & 1), n0 + 8 * ((j >> 1) & 1))
            else:
                expect = (k0 + (j >> 1) + 8 * (j & 1), n0)
            got = mt.marlin_word_field_to_kn(word, j, size_n, bits)
            assert (int(got[0]), int(got[1])) == expect, (word, j)


@pytest.mark.parametrize("bits", [4, 8])
def test_tile_permutation_equals_vllm_table(bits):
    # vLLM's table indexes sub-block-major positions p = 256*(n//16) + 16*(k%16) + n%16; ours indexes k*64 + n
    table = vllm_style_weight_perm(bits)
    ours = mt.tile_permutation(bits)
    k, n = np.divmod(ours, 64)
    assert np.array_equal(256 * (n // 16) + 16 * k + n % 16, table)


# vLLM's repack test grid (docs/formats.md "vLLM test grid and tolerances"): K = 128·k_factor, N = n_chunk·n_factor, act-order on/off
@pytest.mark.parametrize("n_factor,k_factor", [(4, 8), (7, 5), (13, 11)])
@pytest.mark.parametrize("n_chunk", [64, 256])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_repack_matches_vllm_reference_grid(n_factor, k_factor, n_chunk, bits, act_order, rng):
    size_k, size_n = 128 * k_factor, n_chunk * n_factor
    codes = rng.integers(0, 1 << bits, size=(size_k, size_n), dtype=np.uint8)
    perm = rng.permutation(size_k).astype(np.int32) if act_order else None
    got = ops.gptq_marlin_repack(packing.pack_rows(codes, bits), perm, size_k, size_n, bits)
    expect = vllm_style_marlin_weights(codes[perm] if act_order else codes, bits)
    assert got.dtype == np.int32 and got.shape == (size_k // 16, size_n * 16 * bits // 32)
    assert np.array_equal(got, expect)
    back = ops.marlin_to_gptq_qweight(got, perm, size_k, size_n, bits)
    assert np.array_equal(back, packing.pack_rows(codes, bits))


@pytest.mark.parametrize("bits", [4, 8])
def test_awq_repack_equals_gptq_repack_of_same_codes(bits, rng):
    size_k, size_n = 256, 320
    codes = rng.integers(0, 1 << bits, size=(size_k, size_n), dtype=np.uint8)
    awq = ops.awq_marlin_repack(packing.awq_pack(codes, bits), size_k, size_n, bits)
    assert np.array_equal(awq, vllm_style_marlin_weights(codes, bits))
    assert np.array_equal(ops.marlin_to_awq_qweight(awq, size_k, size_n, bits), packing.awq_pack(codes, bits))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(k_tiles=st.integers(1, 6), n_tiles=st.integers(1, 4), bits=st.sampled_from([4, 8]), seed=st.integers(0, 2**31))
def test_repack_round_trip_property(k_tiles, n_tiles, bits, seed):
    rng = np.random.default_rng(seed)
    size_k, size_n = 16 * k_tiles, 64 * n_tiles
    codes = rng.integers(0, 1 << bits, size=(size_k, size_n), dtype=np.uint8)
    marlin = mt.marlin_repack_codes(codes, bits)
    assert np.array_equal(mt.marlin_unpack_codes(marlin, size_k, size_n, bits), codes)
    # every element sits where the map says
    k = rng.integers(0, size_k, 20)
    n = rng.integers(0, size_n, 20)
    word, field = mt.marlin_kn_to_word_field(k, n, size_n, bits)
    vals = (marlin.ravel().view(np.uint32)[word] >> (field * bits).astype(np.uint32)) & ((1 << bits) - 1)
    assert np.array_equal(vals, codes[k, n])


def test_describe_position_names_every_coordinate():
    d = mt.describe_position(k=25, n=83, size_n=128, bits=4)
    assert (d["k_tile"], d["n_tile"], d["subblock"], d["half"]) == (1, 1, 1, 0)
    k, n = mt.marlin_word_field_to_kn(d["word"], d["field"], 128, 4)
    assert (int(k), int(n)) == (25, 83)
    assert d["lane"] == 4 * (83 % 8) + (25 % 8) // 2


@pytest.mark.parametrize("bits", [4, 8])
def test_fast_repack_puts_every_tile_element_where_the_maps_say(bits):
    # Tag every tile element with its index dk*64 + dn, written in base 2^bits digit planes; repack each plane;
    # the digits found at packed position p must spell tile_permutation[p]. Exhaustive over the 1024 elements.
    index = np.arange(1024)
    found = np.zeros(1024, dtype=np.int64)
    for d in range(3 if bits == 4 else 2):
        plane = ((index >> (bits * d)) & ((1 << bits) - 1)).astype(np.uint8).reshape(16, 64)
        fields = packing.unpack_rows(mt.marlin_repack_codes(plane, bits).reshape(-1, 1), bits).ravel()
        found |= fields.astype(np.int64) << (bits * d)
    assert np.array_equal(found, mt.tile_permutation(bits))
