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


def test_table_lines_put_every_timed_path_in_its_column():
    cell = dict(config="mixtral", experts=8, k=4096, n=14336, top_k=2, m=1, experts_touched=2, moe_block_size=8,
                align_cuda_us=4.9, align_cuda_call_us=5.0, align_numba_call_us=400.0)
    rows = [dict(cell, method="fused", us=26.4, gbs=2296.5, pct_copy=53.8),
            dict(cell, method="fused graph", us=19.8, gbs=3000.0, pct_copy=71.6),
            dict(cell, method="copy graph", us=17.1, gbs=3500.0, pct_copy=82.3)]
    header, rule, line = bench_moe.table_lines(rows)
    names = [x.strip() for x in header.strip("|").split("|")]
    cells = dict(zip(names, (x.strip() for x in line.strip("|").split("|")), strict=True))
    assert rule.count("---") == len(names)
    assert (cells["fused µs"], cells["fused graph µs"], cells["copy graph µs"], cells["copy graph % copy"],
            cells["batched µs"]) == ("26.4", "19.8", "17.1", "82.3", "—")
