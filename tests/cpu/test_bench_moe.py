"""bench/bench_moe.py's rotated routings (the "fused graph" timing): at decode sizes consecutive routings touch
disjoint experts, so no call in the graph finds its weights in L2; past them the routings keep the single calls'
distribution (a pool cut to the experts the previous routing left would touch fewer and time other work)."""
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import bench_moe  # noqa: E402


class _HostArrays:
    """Stands in for CuPy: the routings stay NumPy arrays."""

    @staticmethod
    def asarray(x):
        return np.asarray(x)


def expected_touched(e: int, m: int, top_k: int) -> float:
    """Mean distinct experts of m tokens choosing top_k of e uniformly (distinct per token)."""
    return e * (1 - (1 - top_k / e) ** m)


@pytest.mark.parametrize("e,top_k", [(8, 2), (64, 6), (256, 8)])
def test_decode_routings_avoid_the_previous_experts(e, top_k):
    routings, touched = bench_moe.rotated_routings(_HostArrays, np.random.default_rng(1), 1, e, top_k, 20)
    assert touched == [top_k] * 20
    block = bench_moe.moe.choose_block_size(1, top_k, e)
    experts = [set(expert_ids[:int(post[0]) // block].tolist()) for _, expert_ids, post in routings]
    assert all(len(x) == top_k for x in experts)
    for before, after in zip(experts, experts[1:]):
        assert not before & after, (before, after)


@pytest.mark.parametrize("e,top_k,m", [(8, 2, 8), (64, 6, 8), (256, 8, 64)])
def test_larger_routings_keep_the_uniform_distribution(e, top_k, m):
    _, touched = bench_moe.rotated_routings(_HostArrays, np.random.default_rng(2), m, e, top_k, 40)
    assert abs(np.mean(touched) - expected_touched(e, m, top_k)) < 0.08 * expected_touched(e, m, top_k)
