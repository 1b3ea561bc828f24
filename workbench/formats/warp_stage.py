"""The warp's view of one pipeline stage, as named maps: which lane loads which 16 bytes of a Marlin tile, what lands
in shared memory, which registers form the operands of one ``mma.m16n8k16``, and which outputs a lane accumulates.

One stage of one warp, one 16×64 tile of B and one 16×16 tile of A (rows m, columns k)::

    global ──16 B per lane──▶ shared ──16 B per lane──▶ registers ──dequant──▶ b[h][r] ──▶ mma.m16n8k16 × 8
    (lane l: words 4l..4l+3)   (the same bytes,          (words[0..3]: one       (4 per      (sub-block s, half h:
                                same positions)          word per sub-block)     sub-block)   columns 16s + 8h..)

* **Loads** (``lane_load_words``): a lane's words of a tile are consecutive ("The Marlin 16×64 tile" in
  docs/formats.md), so lane l copies words ``wpl*l .. wpl*l + wpl - 1``: one 16-byte ``cp.async`` (4-bit) or two
  (8-bit). The warp's 32 copies are 512 (1024) consecutive bytes: every global transaction is fully used.
* **Shared memory** holds the tile's bytes at the same offsets as global memory, so the lane that copied a word is
  the lane that later reads it (``lds128``): no lane waits for another's data inside a tile.
* **Operands** (PTX ISA, "Matrix Fragments for mma.m16n8k16"): with g = lane // 4 (groupID) and t = lane % 4
  (threadID_in_group), A (16×16, row-major) is 4 registers a0..a3 = rows (g, g+8, g, g+8), k pairs (2t, 2t, 2t+8,
  2t+8); B (16×8) is 2 registers b0, b1 = k pairs 2t and 2t+8 of column g (``mma_b_fragment``); C/D (16×8 fp32) is
  c0..c3 = row g (c0, c1) and g+8 (c2, c3), columns 2t, 2t+1. Element i of a register pair: low half = lower index.
"""
from __future__ import annotations

import numpy as np

from workbench.formats._checks import check_bits
from workbench.formats.marlin_tile import LANES, mma_b_fragment, words_per_lane


def mma_a_fragment(lane, e):
    """(lane, element e in 0..7) -> (row, k) inside the 16×16 A operand. Register e // 2, half e % 2. Vectorized."""
    lane = np.asarray(lane)
    e = np.asarray(e)
    reg, half = e // 2, e % 2
    return lane // 4 + 8 * (reg % 2), 2 * (lane % 4) + half + 8 * (reg // 2)


def mma_c_fragment(lane, e):
    """(lane, element e in 0..3) -> (row, column) inside the 16×8 fp32 accumulator C/D. Vectorized."""
    lane = np.asarray(lane)
    e = np.asarray(e)
    return lane // 4 + 8 * (e // 2), 2 * (lane % 4) + e % 2


def mma_b_register(lane, reg, half):
    """(lane, B register 0/1, 16-bit half) -> (k, column) inside the 16×8 B operand: element 2 reg + half."""
    return mma_b_fragment(lane, 2 * np.asarray(reg) + np.asarray(half))


def lane_load_words(lane, bits: int) -> np.ndarray:
    """(..., words_per_lane) word indices inside a tile that lane ``lane`` copies (and later reads). Vectorized."""
    wpl = words_per_lane(check_bits(bits))
    return wpl * np.asarray(lane)[..., None] + np.arange(wpl)


def lane_load_bytes(lane, bits: int) -> np.ndarray:
    """(..., loads, 2) [first, end) byte offsets inside the tile of the lane's 16-byte loads (1 for 4-bit, 2 for
    8-bit)."""
    first = 4 * lane_load_words(lane, bits)[..., ::4]
    return np.stack([first, first + 16], axis=-1)


def fragment_tables() -> dict[str, np.ndarray]:
    """The operand maps as int32 lookup tables, for kernels that take the maps as data (the teaching kernel):
    ``a`` (32, 8, 2) lane, element -> (row, k); ``b`` (32, 4, 2) lane, element -> (k, column); ``c`` (32, 4, 2)
    lane, element -> (row, column)."""
    lane = np.arange(LANES)[:, None]

    def table(fragment, elements):
        return np.stack(np.broadcast_arrays(*fragment(lane, np.arange(elements)[None, :])), axis=-1).astype(np.int32)

    return {"a": table(mma_a_fragment, 8), "b": table(mma_b_fragment, 4), "c": table(mma_c_fragment, 4)}


def mma_reference(a_frags, b_frags, c_frags) -> np.ndarray:
    """What one warp-wide ``mma.m16n8k16`` does, from the lanes' point of view: the 32 lanes' A (32, 8) and B (32, 4)
    fragment values are placed by the maps, multiplied, and each lane gets its (32, 4) C elements added to
    ``c_frags``. (The hardware's summation order is unspecified; sums that are exact do not depend on it.)"""
    t = fragment_tables()
    a = np.zeros((16, 16), dtype=np.float64)
    b = np.zeros((16, 8), dtype=np.float64)
    a[t["a"][..., 0], t["a"][..., 1]] = a_frags
    b[t["b"][..., 0], t["b"][..., 1]] = b_frags
    d = a @ b
    return np.asarray(c_frags, dtype=np.float64) + d[t["c"][..., 0], t["c"][..., 1]]
