"""Stacked MoE experts (seed: load_stacked_gptq_vllm_marlin)."""
import numpy as np
import pytest

from workbench import ops
from workbench.formats import packing
from workbench.weight import workspace_size


def _experts(rng, num_experts, k, n, group_size, asymmetric_expert=None):
    ng = k // group_size
    qweights, scales, qzeros = [], [], []
    for e in range(num_experts):
        qweights.append(packing.pack_rows(rng.integers(0, 16, size=(k, n), dtype=np.uint8), 4))
        scales.append(rng.uniform(0.01, 0.1, size=(ng, n)).astype(np.float32))
        stored = np.full((ng, n), 7, np.uint8)
        if e == asymmetric_expert:
            stored = rng.integers(0, 15, size=(ng, n), dtype=np.uint8)
        qzeros.append(packing.pack_cols(stored, 4))
    return qweights, scales, qzeros


@pytest.mark.parametrize("asymmetric_expert", [None, 2])
def test_stack_equals_per_expert_ops(asymmetric_expert, rng):
    E, k, n, g = 4, 256, 128, 128
    qweights, scales, qzeros = _experts(rng, E, k, n, g, asymmetric_expert)
    stack = ops.stack_gptq_experts_to_marlin(qweights, scales, qzeros, 4, g, k, n)
    assert stack.num_experts == E and stack.qweight.shape == (E, k // 16, 2 * n)
    assert stack.qweight.flags["C_CONTIGUOUS"]
    stride = stack.qweight[0].size  # expert e starts at offset e·stride of the flat buffer
    for e in range(E):
        one = ops.gptq_marlin_repack(qweights[e], None, k, n, 4)
        assert np.array_equal(stack.qweight.ravel()[e * stride:(e + 1) * stride], one.ravel())
        s = ops.marlin_permute_scales(scales[e].astype(np.float16), k, n, g)
        assert np.array_equal(stack.scales[e], s)
        view = stack.expert(e)
        assert np.shares_memory(view.qweight, stack.qweight) and view.num_experts is None
    if asymmetric_expert is None:
        assert stack.zeros is None and stack.weight_type.label == "u4b8"
    else:
        assert stack.weight_type.label == "u4" and stack.zeros.shape == (E, 2, n // 8)
        for e in range(E):
            assert np.array_equal(stack.zeros[e], ops.repack_gptq_qzeros_to_marlin(qzeros[e], k, n, g))
    assert stack.workspace_size == workspace_size(n, E) == E * (n // 64) * 16


def test_expert_index_out_of_range(rng):
    stack = ops.stack_gptq_experts_to_marlin(*_experts(rng, 2, 128, 64, 128), 4, 128, 128, 64)
    with pytest.raises(ValueError, match=r"expert index 2 is outside \[0, 2\)"):
        stack.expert(2)


def test_bad_expert_shape_names_the_expert(rng):
    qweights, scales, qzeros = _experts(rng, 3, 128, 64, 128)
    qweights[1] = qweights[1][:8]
    with pytest.raises(ValueError, match=r"qweights\[1\] has shape \(8, 64\)"):
        ops.stack_gptq_experts_to_marlin(qweights, scales, qzeros, 4, 128, 128, 64)
