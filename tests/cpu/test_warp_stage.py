"""The warp-stage maps: every operand map is a bijection onto its matrix, agrees with the fragment comments of
kernels_cuda/mma.cuh and with a warp-level matrix product, and the lanes' loads cover a tile once, in order."""
import numpy as np
import pytest

from workbench.formats import marlin_tile as mt
from workbench.formats import warp_stage as ws


def _covered(rows, cols, width):
    return np.array_equal(np.sort((rows * width + cols).ravel()), np.arange(rows.size))


def test_operand_maps_are_bijections():
    t = ws.fragment_tables()
    assert _covered(t["a"][..., 0], t["a"][..., 1], 16)  # 32 lanes × 8 = 256 = 16 × 16
    assert _covered(t["b"][..., 0], t["b"][..., 1], 8)  # 32 × 4 = 128 = 16 × 8
    assert _covered(t["c"][..., 0], t["c"][..., 1], 8)


def test_maps_agree_with_the_mma_header():
    """mma.cuh: lane l owns A rows l/4 and l/4+8, k pairs 2(l%4)+{0,1} and +8; C row l/4 (c0, c1) and l/4+8 (c2, c3),
    columns 2(l%4)+{0,1}."""
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a = [tuple(int(v) for v in ws.mma_a_fragment(lane, e)) for e in range(8)]
        assert a == [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1),
                     (g, 2 * t + 8), (g, 2 * t + 9), (g + 8, 2 * t + 8), (g + 8, 2 * t + 9)]
        c = [tuple(int(v) for v in ws.mma_c_fragment(lane, e)) for e in range(4)]
        assert c == [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]
        assert [tuple(int(v) for v in ws.mma_b_register(lane, r, h)) for r in range(2) for h in range(2)] == \
            [(2 * t, g), (2 * t + 1, g), (2 * t + 8, g), (2 * t + 9, g)]


def test_mma_reference_is_a_matrix_product(rng):
    a = rng.integers(-8, 8, (16, 16)).astype(np.float64)
    b = rng.integers(-8, 8, (16, 8)).astype(np.float64)
    t = ws.fragment_tables()
    c = ws.mma_reference(a[t["a"][..., 0], t["a"][..., 1]], b[t["b"][..., 0], t["b"][..., 1]], np.zeros((32, 4)))
    d = np.zeros((16, 8))
    d[t["c"][..., 0], t["c"][..., 1]] = c
    assert np.array_equal(d, a @ b)


@pytest.mark.parametrize("bits", [4, 8])
def test_lane_loads_cover_the_tile_in_order(bits):
    words = ws.lane_load_words(np.arange(32), bits)
    assert np.array_equal(words.ravel(), np.arange(mt.words_per_tile(bits)))
    spans = ws.lane_load_bytes(np.arange(32), bits).reshape(-1, 2)
    assert np.all(spans[:, 1] - spans[:, 0] == 16)
    assert np.array_equal(spans[:, 0], 16 * np.arange(spans.shape[0]))  # consecutive 16-byte loads
    # the lane that loads a word is the lane whose fragments it holds
    lanes = np.arange(32)
    for slot in range(mt.words_per_lane(bits)):
        k, n = mt.marlin_word_field_to_kn(words[:, slot], 0, 64, bits)
        owner, _ = mt.mma_b_fragment_owner(k % 16, n % 8)
        assert np.array_equal(owner, lanes)
