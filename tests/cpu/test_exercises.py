"""The exercise checker: every solution passes, wrong answers fail with feedback that says what is wrong (without
the expected value), unanswered placeholders and failing learner code give feedback instead of exceptions."""
import numpy as np
import pytest

from workbench import exercises as ex
from workbench.exercise_solutions import SOLUTIONS, check_solution

WRONG = {  # exercise -> (a wrong answer, a phrase the feedback must contain)
    "00.shape": ((4, 256), "columns is not right (rows is)"),
    "00.words8": (4, "not right"),
    "01.gptq_position": (lambda k, n: (k // 8, n, 7 - k % 8), "at (0, 0): field is not right (row, column are)"),
    "01.decode": ([8, 7, 6, 5, 4, 3, 2, 1], "reversed"),
    "01.awq_field": (1, "AWQ_ORDER"),
    "02.owner": ((21, 3), "lane is not right (e is)"),
    "02.kn_to_word_field": (lambda k, n: (0, 0), "at (0, 1): word is not right (field is)"),
    "02.find_bug": ([37 * 8 + 2], "1 wrong position(s) missing, 0 right one(s) listed"),
    "03.p64": ((10, 25, 26), "d = [10] not right"),
    "03.p32": (lambda d: d, "at (2): source is not right"),
    "04.bit_move": (0x5A << 8, "not right"),
    "04.bf16_factor": (2**8, "127"),
    "05.perm": (list(range(16)), "g_idx[perm] must be sorted"),
    "05.expert_offset": (3 * 8 * 64, "complete Marlin qweight"),
    "06.zero_points": ("u4b8", "zero point lets"),
    "06.relative_error": (lambda w_q, w: np.linalg.norm(w_q - w), "divide the norm of the difference"),
    "08.lop3": (0x64016401, "not right"),
    "08.values": ((-7.0, -8.0, -8.0, 7.0), "b[0][1] low and b[0][1] high are not right"),
    "08.register_of": (lambda k, n: (0, 0, 0, 0), "at (0, 1): lane is not right"),
    "10.s0e5m3": (0x44, "gains 120"),
    "10.e8m0": (119, "2^(c − 127)"),
}


def test_every_exercise_has_a_solution_and_a_wrong_answer_test():
    assert set(ex.EXERCISES) == set(SOLUTIONS) == set(WRONG)
    notebooks = {name.split(".")[0] for name in ex.EXERCISES}
    assert notebooks == {"00", "01", "02", "03", "04", "05", "06", "08", "10"}


@pytest.mark.parametrize("exercise_id", sorted(SOLUTIONS))
def test_the_solution_is_correct(exercise_id):
    feedback = check_solution(exercise_id)
    assert feedback.ok, feedback
    assert repr(feedback).startswith(f"✓ {exercise_id}: correct")


@pytest.mark.parametrize("exercise_id", sorted(WRONG))
def test_a_wrong_answer_is_named_wrong(exercise_id):
    answer, phrase = WRONG[exercise_id]
    feedback = ex.check(exercise_id, answer)
    assert not feedback.ok and phrase in feedback.message, feedback
    assert repr(feedback).startswith("✗") and 'color:#b00020' in feedback._repr_html_()


@pytest.mark.parametrize("placeholder", [None, ...])
def test_an_unanswered_exercise_says_so(placeholder):
    feedback = ex.check("02.owner", placeholder)
    assert not feedback.ok and "not answered yet" in feedback.message


def test_learner_code_that_raises_is_feedback():
    feedback = ex.check("02.kn_to_word_field", lambda k, n: 1 / 0)
    assert not feedback.ok and feedback.message == "your answer raised ZeroDivisionError: division by zero"
    feedback = ex.check("00.shape", (1, 2, 3))
    assert "expected 2 numbers (rows, columns), got 3" in feedback.message


def test_the_bug_of_find_bug_is_one_swap():
    from workbench.formats import marlin_tile as mt

    wrong = np.flatnonzero(ex.broken_permutation() != mt.tile_permutation(4))
    assert wrong.size == 2 and np.array_equal(np.sort(ex.broken_permutation()), np.arange(1024))


def test_unknown_exercise_names_the_known_ones():
    with pytest.raises(KeyError, match="02.owner"):
        ex.check("99.nothing", 1)
