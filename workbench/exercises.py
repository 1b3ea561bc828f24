"""Exercises for the teaching notebooks, and the checker that gives feedback on an answer.

Each exercise has an id (``"02.owner"``: notebook 02), a prompt, and a check that compares the answer with the
workbench's own maps — never with a copy of the answer kept here. Answers are values (a number, a tuple, a list) or
functions (a map to write); a function is tried on every input of its domain, and the feedback names the first
input where it goes wrong and which part of the result is wrong, without printing the expected value.

    >>> check("02.owner", (5, 2))     # in a notebook: the feedback is shown as the cell's output
    ✗ 02.owner: ...

The solutions are in ``workbench.exercise_solutions``, which the notebooks call from a collapsed cell so that strict
nbval runs every check.
"""
from __future__ import annotations

import dataclasses
import html
from typing import Any, Callable

import numpy as np

from workbench.formats import fp8 as f8
from workbench.formats import marlin_tile as mt
from workbench.formats import packing
from workbench.formats import register_dequant as rd
from workbench.formats import scales as sc
from workbench.quantize import act_order_g_idx


@dataclasses.dataclass(frozen=True)
class Feedback:
    exercise: str
    ok: bool
    message: str

    def __repr__(self) -> str:
        return f"{'✓' if self.ok else '✗'} {self.exercise}: {self.message}"

    def _repr_html_(self) -> str:
        color = "#1b7f3b" if self.ok else "#b00020"
        return f'<p class="wb-feedback" style="color:{color}">{html.escape(repr(self))}</p>'


@dataclasses.dataclass(frozen=True)
class Exercise:
    id: str
    prompt: str
    check: Callable[[Any], tuple[bool, str]]  # answer -> (correct, message)


EXERCISES: dict[str, Exercise] = {}


def exercise(id: str, prompt: str):
    def register(fn):
        EXERCISES[id] = Exercise(id, prompt, fn)
        return fn

    return register


def check(exercise_id: str, answer) -> Feedback:
    """Feedback on ``answer`` for the exercise ``exercise_id``. Never raises for a wrong answer (a learner's function
    that raises is reported as feedback too)."""
    if exercise_id not in EXERCISES:
        raise KeyError(f"no exercise {exercise_id!r}; the exercises are {sorted(EXERCISES)}")
    if answer is None or answer is ...:
        return Feedback(exercise_id, False, "not answered yet: replace the placeholder with your answer")
    try:
        ok, message = EXERCISES[exercise_id].check(answer)
    except Exception as exc:  # the learner's code failed: say how, in one line
        ok, message = False, f"your answer raised {type(exc).__name__}: {exc}"
    return Feedback(exercise_id, ok, message)


def prompt(exercise_id: str) -> str:
    return EXERCISES[exercise_id].prompt


# ---------------------------------------------------------------------------------------------------------------
# helpers for the checks
# ---------------------------------------------------------------------------------------------------------------
def _as_ints(answer, length: int, what: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in np.ravel(np.asarray(answer)))
    if len(values) != length:
        raise ValueError(f"expected {length} numbers ({what}), got {len(values)}")
    return values


def _compare_parts(got: tuple, expected: tuple, names: tuple[str, ...]) -> tuple[bool, str]:
    wrong = [name for name, g, e in zip(names, got, expected) if g != e]
    if not wrong:
        return True, "correct"
    right = [name for name in names if name not in wrong]
    return False, (f"{' and '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} not right"
                   + (f" ({', '.join(right)} {'is' if len(right) == 1 else 'are'})" if right else ""))


def _check_map(fn, inputs, expected_fn, names: tuple[str, ...], hint: str) -> tuple[bool, str]:
    """Try ``fn`` on every input tuple; report the first where a part of the result differs."""
    if not callable(fn):
        return False, "expected a function"
    for args in inputs:
        result = fn(*args)
        if result is None:
            return False, f"your function returned None for {args}: return the {', '.join(names)}"
        got = tuple(int(v) for v in np.ravel(np.asarray(result, dtype=object)))
        expected = tuple(int(v) for v in np.ravel(np.asarray(expected_fn(*args))))
        if got != expected:
            ok, message = _compare_parts(got + (None,) * (len(expected) - len(got)), expected, names)
            call = ", ".join(str(a) for a in args)
            return False, f"at ({call}): {message}. {hint}"
    return True, f"correct on all {len(inputs)} inputs"


# ---------------------------------------------------------------------------------------------------------------
# 00 — the tour
# ---------------------------------------------------------------------------------------------------------------
@exercise("00.shape", "A u4b8 weight has K = 64, N = 256. What shape does its Marlin qweight have? (rows, columns)")
def _(answer):
    got = _as_ints(answer, 2, "rows, columns")
    return _compare_parts(got, (64 // mt.TILE_K, 256 * mt.TILE_K // packing.pack_factor(4)), ("rows", "columns"))


@exercise("00.words8", "How many 32-bit words does one lane load per 16×64 tile for 8-bit weights?")
def _(answer):
    ok = int(answer) == mt.words_per_lane(8)
    return ok, "correct" if ok else "not right: a tile is 1024 codes of 8 bits, shared by the 32 lanes of a warp"


# ---------------------------------------------------------------------------------------------------------------
# 01 — GPTQ / AWQ packing
# ---------------------------------------------------------------------------------------------------------------
@exercise("01.gptq_position", "Write gptq_position(k, n) -> (row, column, field): where GPTQ's 4-bit qweight "
                              "[K/8, N] keeps the code of element (k, n).")
def _(fn):
    inputs = [(k, n) for k in range(32) for n in range(0, 16, 3)]
    return _check_map(fn, inputs, lambda k, n: (k // 8, n, k % 8), ("row", "column", "field"),
                      "GPTQ packs 8 consecutive rows of one column into a word, lowest row in the lowest bits.")


@exercise("01.decode", "List the 8 codes of the GPTQ word 0x87654321, field 0 first.")
def _(answer):
    got = _as_ints(answer, 8, "codes")
    expected = tuple(int(v) for v in packing.unpack_rows(np.array([[0x87654321]], dtype=np.uint32), 4)[:, 0])
    if got == expected:
        return True, "correct"
    if got == expected[::-1]:
        return False, "reversed: field 0 is the lowest 4 bits (the rightmost hex digit)"
    return False, f"fields {[j for j in range(8) if got[j] != expected[j]]} are not right: field j is bits 4j..4j+3"


@exercise("01.awq_field", "In an AWQ word of 4-bit codes, which field holds column 8c + 1 (c: the word's column)?")
def _(answer):
    ok = int(answer) == int(packing.AWQ_UNDO[4][1])
    return ok, "correct" if ok else "not right: field j holds column 8c + AWQ_ORDER[j], AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]"


# ---------------------------------------------------------------------------------------------------------------
# 02 — the Marlin tile
# ---------------------------------------------------------------------------------------------------------------
@exercise("02.owner", "Which lane owns element (dk = 9, dn = 5) of a 16×8 B fragment, and as which element e?")
def _(answer):
    got = _as_ints(answer, 2, "lane, e")
    lane, e = mt.mma_b_fragment_owner(9, 5)
    return _compare_parts(got, (int(lane), int(e)), ("lane", "e"))


@exercise("02.kn_to_word_field", "Write kn_to_word_field(k, n) -> (word, field) for a 4-bit Marlin weight with "
                                 "N = 128 (K = 32), by composing the four maps of this notebook.")
def _(fn):
    inputs = [(k, n) for k in range(32) for n in range(128)]
    return _check_map(fn, inputs, lambda k, n: mt.marlin_kn_to_word_field(k, n, 128, 4), ("word", "field"),
                      "Check the maps one at a time: tile, sub-block and half, lane and e, slot, field interleave.")


@exercise("02.find_bug", "broken_permutation() below is tile_permutation(4) with one mistake. Which packed "
                         "positions p are wrong? (a sorted list)")
def _(answer):
    got = sorted(int(p) for p in np.ravel(answer))
    expected = sorted(int(p) for p in np.flatnonzero(broken_permutation() != mt.tile_permutation(4)))
    if got == expected:
        return True, "correct: those positions take each other's elements (two fields of one word swapped)"
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    return False, (f"{len(missing)} wrong position(s) missing, {len(extra)} right one(s) listed: decode each position p "
                   "to (word, field) = divmod(p, 8) and compare the (k, n) it takes with marlin_word_field_to_kn")


def broken_permutation() -> np.ndarray:
    """tile_permutation(4) with the fields 2 and 3 of word 37 exchanged: the bug of exercise 02.find_bug."""
    perm = mt.tile_permutation(4).copy()
    perm[[37 * 8 + 2, 37 * 8 + 3]] = perm[[37 * 8 + 3, 37 * 8 + 2]]
    return perm


# ---------------------------------------------------------------------------------------------------------------
# 03 — scales
# ---------------------------------------------------------------------------------------------------------------
@exercise("03.p64", "Predict SCALE_PERM_64[d] for d = 10, 11 and 19 (a list of three).")
def _(answer):
    got = _as_ints(answer, 3, "P64[10], P64[11], P64[19]")
    expected = tuple(int(sc.SCALE_PERM_64[d]) for d in (10, 11, 19))
    wrong = [d for d, g, e in zip((10, 11, 19), got, expected) if g != e]
    return (not wrong, "correct" if not wrong else
            f"d = {wrong} not right: P64 is the transpose of an 8×8 block, d = 8 row + column -> 8 column + row")


@exercise("03.p32", "Write p32(d) -> source index, for d in 0..31: the channelwise permutation, the transpose of a "
                    "4×4 block of column pairs.")
def _(fn):
    return _check_map(fn, [(d,) for d in range(32)], lambda d: sc.SCALE_PERM_32[d], ("source",),
                      "d = 8 row + 2 pair + j (j: which column of the pair); the source swaps row and pair.")


# ---------------------------------------------------------------------------------------------------------------
# 04 — FP8
# ---------------------------------------------------------------------------------------------------------------
@exercise("04.bit_move", "The kernel moves E4M3 byte 0x5A into fp16 bits. Which 16-bit pattern comes out? (an int)")
def _(answer):
    expected = int(f8.kernel_bit_move_f16(np.array([0x5A], np.uint8)).view(np.uint16)[0])
    ok = int(answer) == expected
    return ok, "correct" if ok else "not right: (b & 0x80) << 8 | (b & 0x7F) << 7"


@exercise("04.bf16_factor", "By what factor is the bit-moved bf16 value too small? (a power of two, e.g. 2**8)")
def _(answer):
    ok = float(answer) == f8.exponent_bias(f8.BF16)
    return ok, "correct" if ok else "not right: the exponent field is copied, so the bias difference 127 − 7 counts"


# ---------------------------------------------------------------------------------------------------------------
# 05 — act-order
# ---------------------------------------------------------------------------------------------------------------
ACT_ORDER_G_IDX = act_order_g_idx(16, 4, np.random.default_rng(5))  # 16 rows, groups of 4


@exercise("05.perm", "Write the act-order permutation for g_idx = ACT_ORDER_G_IDX: Marlin row k is checkpoint row "
                     "perm[k], rows of group 0 first, then group 1, ...; inside a group in checkpoint order.")
def _(answer):
    got = _as_ints(answer, ACT_ORDER_G_IDX.size, "perm")
    expected = tuple(int(v) for v in np.argsort(ACT_ORDER_G_IDX, kind="stable"))
    if got == expected:
        return True, "correct"
    if sorted(got) != list(range(ACT_ORDER_G_IDX.size)):
        return False, "not a permutation of 0..15"
    groups = ACT_ORDER_G_IDX[list(got)]
    if np.all(np.diff(groups) >= 0):
        return False, "groups are in order, but inside a group keep the checkpoint order (a stable sort)"
    return False, "g_idx[perm] must be sorted: Marlin rows group by group"


@exercise("05.expert_offset", "A stack of 4 u4b8 experts, each K = 128 × N = 64, keeps its qweight as one buffer. "
                              "At which flat int32 word does expert 3's qweight start?")
def _(answer):
    expected = 3 * (128 // mt.TILE_K) * (64 * mt.TILE_K // packing.pack_factor(4))
    ok = int(answer) == expected
    return ok, "correct" if ok else ("not right: each expert is a complete Marlin qweight [K/16, 2N], and expert e "
                                     "starts e of those after the first")


# ---------------------------------------------------------------------------------------------------------------
# 06 — accuracy
# ---------------------------------------------------------------------------------------------------------------
@exercise("06.relative_error", "Write relative_error(w_q, w) -> ‖w_q − w‖ / ‖w‖ (Frobenius norms).")
def _(fn):
    rng = np.random.default_rng(6)
    for shape in ((4, 8), (16, 16)):
        w = rng.standard_normal(shape)
        w_q = w + 0.01 * rng.standard_normal(shape)
        got, expected = float(fn(w_q, w)), float(np.linalg.norm(w_q - w) / np.linalg.norm(w))
        if not np.isclose(got, expected, rtol=1e-9):  # the same formula in another summation order
            return False, f"for a {shape} weight you give {got:.6g}: divide the norm of the difference by ‖w‖"
    return True, "correct"


@exercise("06.zero_points", "At group size 128, which loses less: 'u4' (asymmetric, with zero points) or 'u4b8' "
                            "(symmetric)? Answer with the type's name, and check on any weight you like.")
def _(answer):
    from workbench.render.accuracy import quantization_errors

    w = np.random.default_rng(7).standard_normal((128, 128)).astype(np.float32)
    rows = quantization_errors({"w": w}, {"u4": (128,), "u4b8": (128,)})
    best = min(rows, key=lambda r: r["rel_error"])["type"]
    if str(answer) not in ("u4", "u4b8"):
        return False, "answer 'u4' or 'u4b8'"
    ok = str(answer) == best
    return ok, "correct" if ok else "not right: a zero point lets the 16 levels cover [min, max] instead of ±max"


# ---------------------------------------------------------------------------------------------------------------
# 08 — registers
# ---------------------------------------------------------------------------------------------------------------
@exercise("08.lop3", "For the u4b8 word 0x0000A3F1 and fp16: which register does lop3(word, 0x000f000f, 0x64006400) "
                     "give? (an int)")
def _(answer):
    ok = int(answer) == int(rd.and_or(0x0000A3F1, rd.LO_MASK, 0x64006400))
    return ok, "correct" if ok else "not right: keep the low nibble of each 16-bit half, then OR in 0x6400 twice"


@exercise("08.values", "Same word, u4b8, scale 1: the four values of b[0][0] (low, high) and b[0][1] (low, high).")
def _(answer):
    got = tuple(float(v) for v in np.ravel(answer))
    if len(got) != 4:
        return False, "expected 4 numbers"
    regs = rd.dequant_subblock(np.array([[0x0000A3F1]], np.uint32), "u4b8", np.float16, np.ones((1, 2), np.float16))
    lo, hi = rd.halves(regs[0, 0], np.float16)
    expected = (float(lo[0]), float(hi[0]), float(lo[1]), float(hi[1]))
    return _compare_parts(got, expected, ("b[0][0] low", "b[0][0] high", "b[0][1] low", "b[0][1] high")) if \
        got != expected else (True, "correct")


@exercise("08.register_of", "Write register_of(k, n) -> (lane, h, r, half): which register half of which lane "
                            "holds element (k, n) of a 16×16 sub-block.")
def _(fn):
    def expected(k, n):
        for lane in range(32):
            for h in range(2):
                for r in range(2):
                    for half in range(2):
                        if tuple(int(v) for v in rd.b_register_element(lane, h, r, half)) == (k, n):
                            return lane, h, r, half
    inputs = [(k, n) for k in range(16) for n in range(16)]
    return _check_map(fn, inputs, expected, ("lane", "h", "r", "half"),
                      "lane = 4 (n % 8) + (k % 8) // 2; h is the column half, r the row half, half the row's parity.")


# ---------------------------------------------------------------------------------------------------------------
# 10 — microscaling
# ---------------------------------------------------------------------------------------------------------------
@exercise("10.s0e5m3", "Which S0E5M3 byte does the NVFP4 scale 3.0 (E4M3 byte 0x44) become for fp16 activations? "
                       "(an int)")
def _(answer):
    from workbench.formats import fp4_marlin

    raw, _ = fp4_marlin.nvfp4_marlin_process_scales(np.full((1, 64), 0x44, np.uint8), a_dtype=np.float16)
    expected = int(raw[0, 0])
    ok = int(answer) == expected
    return ok, "correct" if ok else "not right: a normal E4M3 byte gains 120 (its exponent re-biased by 15)"


@exercise("10.e8m0", "Which E8M0 code scales a group by 1/8? (an int)")
def _(answer):
    ok = float(np.ldexp(1.0, int(answer) - 127)) == 0.125
    return ok, "correct" if ok else "not right: code c stands for 2^(c − 127)"
