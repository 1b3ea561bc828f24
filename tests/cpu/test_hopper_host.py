"""The wgmma family's host side without a GPU (workbench.gemm.hopper): tile and split-K grid choice, the family
choice and its refusals, the split-K scratch kept per stream."""
import pytest

from workbench.gemm import hopper
from workbench.policy import DEFAULT_GEMM_POLICY
from workbench.scalar_types import ScalarType as S


def test_tile_and_grid_choice():
    p = DEFAULT_GEMM_POLICY
    assert hopper.choose_config(S.F16, S.U4B8, 32, p).block_m == 32
    assert hopper.choose_config(S.F16, S.U4B8, 33, p).block_m == 64
    big = hopper.choose_config(S.F16, S.U4B8, 1000, p)
    assert big.block_m == 128 and big.split_m
    # 16 column blocks of a 4096-wide layer: K split 8 ways fills 128 of 132 SMs; a 28672-wide one needs no split
    assert hopper.grid(64, 4096, 4096, 64, 132, p) == (16, 1, 8)
    assert hopper.grid(64, 28672, 8192, 64, 132, p) == (112, 1, 1)
    # each split keeps at least wgmma_min_split_stages k steps of 64, in whole stages
    assert hopper.grid(32, 256, 512, 32, 132, p) == (1, 1, 2)
    assert hopper.grid(32, 256, 1024, 32, 132, p, stage_k=128) == (1, 1, 4)
    assert hopper.grid(32, 256, 512, 32, 132, p, stage_k=128) == (1, 1, 2)
    assert hopper.grid(1024, 4096, 4096, 128, 132, p) == (16, 8, 1)


def test_family_choice_and_refusals():
    assert hopper.choose_family(0, 64) == "mma_sync"  # the default table is empty: no device query
    with pytest.raises(ValueError, match=r"family = 'mma': one of mma_sync, wgmma"):
        hopper.choose_family(0, 64, family="mma")
    ok = dict(act=S.F16, weight=S.U4B8, size_n=4096, size_k=4096, group_size=128, act_order=False, lda=4096, cc=90)
    assert hopper.unsupported(**ok) is None
    for change, words in ((dict(cc=80), "compute capability 9.0); this one is 8.0"),
                          (dict(weight=S.U4), "u4b8 weights so far, not u4"),
                          (dict(act=S.BF16), "fp16 activations so far"),
                          (dict(act_order=True), "no act-order"),
                          (dict(group_size=-1), "groups of 64 or 128 rows, not -1"),
                          (dict(size_n=4096 + 64), "multiple of 256, got 4160"),
                          (dict(size_k=4096 + 64), "size_k a multiple of 128, got 4160"),
                          (dict(lda=4100), "multiple of 8 elements, got 4100")):
        assert words in hopper.unsupported(**{**ok, **change})


class _TorchLike:
    """Stands in for a torch tensor: ``size`` is a method, as torch's."""

    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


def test_scratch_grows_by_its_recorded_sizes(monkeypatch):
    made = []

    def empty(framework, n, dtype, device, zero=False):
        made.append((framework, n, zero))
        return _TorchLike(n)

    monkeypatch.setattr(hopper.rt_arrays, "empty", empty)
    monkeypatch.setattr(hopper, "_scratch", {})
    first = hopper._scratch_for(0, 7, "torch", 1000, 16)
    assert hopper._scratch_for(0, 7, "torch", 500, 8) is first  # large enough: kept
    grown = hopper._scratch_for(0, 7, "torch", 2000, 4)
    assert (grown.partial_floats, grown.n_counters) == (2000, 16)
    assert hopper._scratch_for(0, 8, "torch", 10, 1) is not grown  # another stream: its own
    assert made[:2] == [("torch", 1000, False), ("torch", 16, True)]  # counters start zero
