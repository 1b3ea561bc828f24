"""Solutions to ``workbench.exercises``: try the exercise first. Each notebook calls ``check_solution`` in a
collapsed cell, so strict nbval runs every checker on a right answer."""
from __future__ import annotations

import numpy as np

from workbench.exercises import ACT_ORDER_G_IDX, Feedback, check


def _kn_to_word_field(k, n):
    k_tile, dk = divmod(k, 16)  # map 2: tile and sub-block
    n_tile, nn = divmod(n, 64)
    subblock, rest = divmod(nn, 16)
    half, dn = divmod(rest, 8)
    lane, e = 4 * dn + (dk % 8) // 2, dk % 2 + 2 * (dk // 8)  # map 1: fragment ownership
    slot, element = subblock, 4 * half + e  # map 3: one word per sub-block, natural element (half, e)
    field = [0, 4, 1, 5, 2, 6, 3, 7][element]  # map 4: the inverse of the interleave [0, 2, 4, 6, 1, 3, 5, 7]
    return (k_tile * 2 + n_tile) * 128 + 4 * lane + slot, field  # N = 128: two tiles per k-tile row


def _p32(d):
    row, rest = divmod(d, 8)
    pair, j = divmod(rest, 2)
    return 8 * pair + 2 * row + j


def _register_of(k, n):
    h, dn = divmod(n, 8)
    r, row = divmod(k, 8)
    return 4 * dn + row // 2, h, r, row % 2


SOLUTIONS = {
    "00.shape": (4, 512),
    "00.words8": 8,
    "01.gptq_position": lambda k, n: (k // 8, n, k % 8),
    "01.decode": [1, 2, 3, 4, 5, 6, 7, 8],
    "01.awq_field": 4,
    "02.owner": (20, 3),
    "02.kn_to_word_field": _kn_to_word_field,
    "02.find_bug": [37 * 8 + 2, 37 * 8 + 3],
    "03.p64": (17, 25, 26),
    "03.p32": _p32,
    "04.bit_move": 0x2D00,
    "04.bf16_factor": 2**120,
    "05.perm": list(np.argsort(ACT_ORDER_G_IDX, kind="stable")),
    "05.expert_offset": 3 * 8 * 128,
    "06.zero_points": "u4",
    "06.relative_error": lambda w_q, w: np.linalg.norm(w_q - w) / np.linalg.norm(w),
    "08.lop3": 0x64006401,
    "08.values": (-7.0, -8.0, 7.0, -8.0),
    "08.register_of": _register_of,
    "10.s0e5m3": 0x44 + 120,
    "10.e8m0": 124,
}


def check_solution(exercise_id: str) -> Feedback:
    """The checker's feedback on the solution (a notebook's collapsed cell asserts that it is correct)."""
    return check(exercise_id, SOLUTIONS[exercise_id])

