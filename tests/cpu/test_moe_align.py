"""moe_align_block_size reference (docs/formats.md "moe_align_block_size")."""
import numpy as np
import pytest

from workbench.formats.moe_align import aligned_capacity, moe_align_block_size, segments


def test_docstring_example():
    ids = np.array([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]])
    sorted_ids, expert_ids, total = moe_align_block_size(ids, 4, 5)
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert expert_ids[:4].tolist() == [1, 2, 3, 4] and total.tolist() == [16]
    assert np.all(sorted_ids[16:] == 12) and sorted_ids.size == aligned_capacity(12, 4, 5)


@pytest.mark.parametrize("m,top_k,num_experts,block", [(1, 1, 4, 8), (7, 2, 8, 16), (64, 6, 64, 16),
                                                       (257, 8, 64, 64), (33, 2, 4, 48)])
def test_properties(m, top_k, num_experts, block, rng):
    ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(m)]).astype(np.int32)
    sorted_ids, expert_ids, total = moe_align_block_size(ids, block, num_experts)
    numel = ids.size
    counts = np.bincount(ids.ravel(), minlength=num_experts)
    assert total[0] == sum(-(-c // block) * block for c in counts)
    assert total[0] <= sorted_ids.size and sorted_ids.size % block == 0
    segs = segments(sorted_ids, expert_ids, total, block, numel)
    for e in range(num_experts):
        assert segs.get(e, set()) == set(np.flatnonzero(ids.ravel() == e).tolist())
    assert set(segs) == set(np.flatnonzero(counts).tolist())  # unused experts get no block


def test_all_tokens_to_one_expert_and_ignored_ids():
    ids = np.array([[3], [3], [-1], [9]])
    sorted_ids, expert_ids, total = moe_align_block_size(ids, 8, 4)
    assert total[0] == 8 and expert_ids[0] == 3 and sorted_ids[:8].tolist() == [0, 1] + [4] * 6


def test_expert_map_marks_non_local_blocks():
    ids = np.array([[0, 1], [1, 2]])
    _, expert_ids, total = moe_align_block_size(ids, 8, 3, expert_map=np.array([-1, 0, 1]))
    assert expert_ids[: total[0] // 8].tolist() == [-1, 0, 1]


def test_bad_input():
    with pytest.raises(TypeError, match="integer"):
        moe_align_block_size(np.zeros((2, 2), np.float32), 8, 4)
    with pytest.raises(ValueError, match="2-D"):
        moe_align_block_size(np.zeros(4, np.int32), 8, 4)
    with pytest.raises(ValueError, match=r"expert_map has shape \(2,\), expected \(4,\)"):
        moe_align_block_size(np.zeros((2, 2), np.int32), 8, 4, expert_map=np.zeros(2))
