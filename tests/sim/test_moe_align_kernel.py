"""The Numba moe_align_block_size kernel against the NumPy reference (spec §8.1), in the simulator at tiny shapes.

Segments are compared as sets (the order inside one is implementation-defined); everything else — the padded total,
the expert of every block, the sentinel padding — exactly. Outputs start poisoned, so an unwritten element fails.
"""
import numpy as np
import pytest

from kernels_numba import moe_align as kernel
from kernels_numba._launch import poison_outputs
from workbench.formats import moe_align as ref

THREADS = 32  # one warp: each simulated thread costs ~1 ms


def _check_against_reference(topk_ids, block, num_experts, expert_map=None):
    with poison_outputs():
        got = kernel.moe_align_block_size(topk_ids, block, num_experts, expert_map, threads=THREADS)
    want = ref.moe_align_block_size(topk_ids, block, num_experts, expert_map=expert_map)
    sorted_ids, expert_ids, total = (np.asarray(x) for x in got)
    assert [x.dtype for x in (sorted_ids, expert_ids, total)] == [np.dtype(np.int32)] * 3
    assert sorted_ids.shape == want[0].shape and expert_ids.shape == want[1].shape
    assert total.tolist() == want[2].tolist()
    assert np.array_equal(expert_ids, want[1])  # block -> expert is deterministic: exact
    numel = topk_ids.size
    assert ref.segments(sorted_ids, expert_ids, total, block, numel) == \
        ref.segments(*want, block, numel)
    # every slot outside the real entries is the sentinel (tail included), and each real entry appears once
    real = sorted_ids[sorted_ids != numel]
    assert np.array_equal(np.sort(real), np.sort(want[0][want[0] != numel]))
    # spec §8.1: an expert's segment holds its entries first, then sentinels. Segments by global expert, from the
    # reference without the map (the same blocks): with it, two non-local experts in a row both read -1
    owner = ref.moe_align_block_size(topk_ids, block, num_experts)[1]
    starts = [0] + [b * block for b in range(1, int(total[0]) // block) if owner[b] != owner[b - 1]]
    for lo, hi in zip(starts, starts[1:] + [int(total[0])]):
        pad = sorted_ids[lo:hi] == numel
        assert not np.any(pad[:-1] & ~pad[1:]), f"sentinel before a real entry in segment [{lo}, {hi})"
    return sorted_ids, expert_ids, total


@pytest.mark.parametrize("m,top_k,num_experts,block", [(1, 1, 4, 8), (7, 2, 8, 8), (5, 6, 64, 16), (3, 2, 4, 48)])
def test_random_routing_matches_reference(m, top_k, num_experts, block, rng):
    ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(m)]).astype(np.int32)
    _check_against_reference(ids, block, num_experts)


def test_all_tokens_to_one_expert_and_ignored_ids(rng):
    ids = np.full((9, 1), 3, np.int32)
    ids[2, 0], ids[5, 0] = -1, 11  # -1 and ids >= E are skipped
    sorted_ids, expert_ids, total = _check_against_reference(ids, 8, 4)
    assert total[0] == 8 and expert_ids[0] == 3


def test_experts_without_tokens_get_no_block(rng):
    ids = rng.choice([1, 6], size=(6, 1)).astype(np.int32)
    _, expert_ids, total = _check_against_reference(ids, 8, 8)
    assert set(expert_ids[:total[0] // 8].tolist()) <= {1, 6}


def test_expert_map_marks_non_local_blocks(rng):
    ids = np.stack([rng.choice(4, 2, replace=False) for _ in range(5)]).astype(np.int32)
    emap = np.array([-1, 0, -1, 1], np.int32)
    _, expert_ids, total = _check_against_reference(ids, 8, 4, emap)
    assert -1 in expert_ids[:total[0] // 8].tolist()


def test_adjacent_non_local_experts_keep_their_own_segments():
    # experts 0 and 2 both map to -1 and sit side by side: each segment is checked on its own (CI once failed a
    # correct kernel here when the check split segments by mapped id)
    ids = np.array([[0, 2], [0, 3], [0, 3], [2, 3], [2, 0]], np.int32)
    _, expert_ids, total = _check_against_reference(ids, 8, 4, np.array([-1, 0, -1, 1], np.int32))
    assert expert_ids[:total[0] // 8].tolist() == [-1, -1, 1]  # experts 0, 2 (non-local), 3; 1 has no token


def test_bad_input_is_rejected_before_launch():
    ids = np.zeros((2, 2), np.int32)
    with pytest.raises(TypeError, match="topk_ids dtype = int64 must be int32"):
        kernel.moe_align_block_size(ids.astype(np.int64), 8, 4)
    with pytest.raises(ValueError, match=r"must be 2-D \(M, top_k\), got shape \(4,\)"):
        kernel.moe_align_block_size(ids.reshape(-1), 8, 4)
    with pytest.raises(ValueError, match="block_size = 0"):
        kernel.moe_align_block_size(ids, 0, 4)
    with pytest.raises(ValueError, match="num_experts = 2000 exceeds MAX_EXPERTS"):
        kernel.moe_align_block_size(ids, 8, 2000)
    with pytest.raises(ValueError, match=r"expert_map has shape \(3,\), expected \(4,\)"):
        kernel.moe_align_block_size(ids, 8, 4, np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="threads = 48"):
        kernel.moe_align_block_size(ids, 8, 4, threads=48)
