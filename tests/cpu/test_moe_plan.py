"""fused_moe's layer plans and cached kernel configuration, on the stand-in CuPy and driver (tests/fake_device.py).

The first call with a key takes the checked path (HEAD's: every rule, CuPy-called kernels); later calls launch the
same five kernels (align, gate_up, SiLU, down, top-k sum) from the plan through the driver. Here: a cached call
launches exactly what the checked call launched (same kernels, grids, shared memory, stream, scalars; the caller's
addresses; one consistent set of intermediates), allocates only its output, and every change under the key
(shape, dtype, device, top_k, block size, expert map, stream, stacks, MOE_* settings) gets a fresh check.
"""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

from fake_device import PLAIN_MOE_POLICY, FakeArray, installed
from workbench import moe
from workbench.policy import DEFAULT_MOE_POLICY
from workbench.scalar_types import ScalarType as S
from workbench.weight import MarlinWeight

BF16 = np.dtype(ml_dtypes.bfloat16)
E, HID, INTER = 8, 512, 256  # experts, hidden size (w13 K, w2 N), intermediate size (w2 K; w13 N = 2 x)


@pytest.fixture
def fake():
    with installed() as (cupy, driver):
        yield cupy, driver


def stack(k, n, experts=E, act=np.float16, wt=S.U4B8, group=128, device=0, zeros=False):
    pf = wt.pack_factor
    ng = k // group
    w = MarlinWeight(FakeArray((experts, k // 16, n * 16 // pf), np.int32, device=device),
                     FakeArray((experts, ng, n), act, device=device),
                     FakeArray((experts, ng, n // pf), np.int32, device=device) if zeros else None,
                     None, None, k, n, group, wt, np.dtype(act), num_experts=experts)
    return moe.MarlinExpertStack(w)


def layer(m=1, top_k=2, act=np.float16, device=0, experts=E, **kw):
    w13 = stack(HID, 2 * INTER, experts, act, device=device, **kw)
    w2 = stack(INTER, HID, experts, act, device=device, **kw)
    return dict(hidden=FakeArray((m, HID), act, device=device), w13_stack=w13, w2_stack=w2,
                topk_weights=FakeArray((m, top_k), np.float32, device=device),
                topk_ids=FakeArray((m, top_k), np.int32, device=device))


def plans(args):
    """The layer plans kept for the layer (on its w13 stack)."""
    return len(args["w13_stack"]._fused_plans)


def call(args, **changes):
    kw = dict(args)
    kw.update(changes)
    return moe.fused_moe(**kw)


def named(driver, records):
    """[(kernel name, grid, smem, stream, args)] of CuPy calls or driver launches."""
    out = []
    for r in records:
        if len(r) == 6:  # driver launch: (f, grid3, block3, smem, stream, args)
            f, grid, _, smem, stream, args = r
            out.append((driver.moe_names[f], grid[0], smem, stream, args))
        else:  # CuPy call: (f, grid, smem, stream, args)
            f, grid, smem, stream, args = r
            out.append((driver.moe_names[f], grid[0], smem, stream, args))
    return out


def take(driver):
    """The launches recorded since the last take, named (and forgotten)."""
    out = named(driver, driver.launches)
    driver.launches.clear(), driver.programmatic.clear()
    return out


KINDS = ("moe_align", "marlin_moe", "silu_and_mul", "marlin_moe", "moe_sum")


def check_same_launches(checked, cached, args, checked_args=None):
    """The cached call's launches equal the checked call's up to the intermediates' addresses, which must be used
    consistently (align's outputs feed both GEMMs, gate_up's output feeds SiLU, ...)."""
    assert [c[0].split("<")[0] for c in checked] == [f"mwb::{k}" for k in KINDS]
    assert [c[:4] for c in cached] == [c[:4] for c in checked], "kernel, grid, shared memory, stream"
    a1, m1, s1, m2, sum1 = (c[4] for c in cached)
    b1, n1, t1, n2, sum2 = (c[4] for c in checked)
    # scalars equal
    for got, want, kinds in ((a1, b1, "piiippipp"), (m1, n1, "ppppppppp" + "i" * 9), (s1, t1, "ppii"),
                             (m2, n2, "ppppppppp" + "i" * 9), (sum1, sum2, "ppppiiii")):
        assert [g for g, k in zip(got, kinds) if k == "i"] == [w for w, k in zip(want, kinds) if k == "i"]
    for launches, args in (((a1, m1, s1, m2, sum1), args), ((b1, n1, t1, n2, sum2), checked_args or args)):
        h, w13, w2 = args["hidden"], args["w13_stack"].weight, args["w2_stack"].weight
        ids, tw = args["topk_ids"], args["topk_weights"]
        al, g, si, d, su = launches
        sorted_ids, experts, post = al[5], al[7], al[8]
        assert al[0] == ids.data.ptr and al[4] == (0 if args.get("expert_map") is None
                                                   else args["expert_map"].data.ptr)
        assert g[:2] == (h.data.ptr, w13.qweight.data.ptr) and g[3] == w13.scales.data.ptr
        assert g[5:9] == (sorted_ids, experts, post, 0) and d[5:9] == (sorted_ids, experts, post, tw.data.ptr)
        assert d[1] == w2.qweight.data.ptr and d[3] == w2.scales.data.ptr
        assert si[0] == g[2] and si[1] == d[0] and su[0] == d[2], "gate_up -> SiLU -> down -> sum"
        assert len({sorted_ids, experts, post, g[2], si[1], d[2], su[3]}) == 7, "distinct buffers"


def test_cached_call_launches_what_the_checked_call_launched(fake):
    cupy, driver = fake
    args = layer(m=3, top_k=2)
    out1 = call(args)
    checked = take(driver)  # (the checked path's five launches: the same runtime call as the plan's)
    assert plans(args) == 1 and not cupy.state.memsets
    allocations = cupy.state.allocations
    out2 = call(args)
    cached = named(driver, driver.launches)
    assert cupy.state.allocations == allocations + 1, "only the output is allocated"
    assert out2.shape == out1.shape == (3, HID) and out2.dtype == np.float16
    assert cached[4][4][3] == out2.data.ptr
    check_same_launches(checked, cached, args)
    # the down GEMM's output is zeroed in stream order before that GEMM (non-local rows stay 0), as cupy.zeros did
    (ptr, value, size, stream), = cupy.state.memsets
    assert (ptr, value, size, stream) == (cached[3][4][2], 0, 3 * 2 * HID * 2, 0)
    # a third call: the same intermediates, a new output
    driver.launches.clear()
    out3 = call(args)
    again = named(driver, driver.launches)
    assert [c[4] for c in again[:4]] == [c[4] for c in cached[:4]] and again[4][4][3] == out3.data.ptr


@pytest.mark.parametrize("top_k", [1, 2, 6, 8])
@pytest.mark.parametrize("act", [np.float16, BF16])
def test_cached_launches_follow_the_checked_path(fake, top_k, act):
    _, driver = fake
    args = layer(m=5, top_k=top_k, act=act, experts=64 if top_k > 2 else E, zeros=top_k == 6, wt=S.U4
                 if top_k == 6 else S.U4B8)
    call(args)
    checked = take(driver)
    call(args)
    check_same_launches(checked, named(driver, driver.launches), args)


def test_expert_map_and_stream_and_block_size(fake):
    _, driver = fake
    args = layer(m=2, top_k=2)
    emap = FakeArray((16,), np.int32)
    for kw in (dict(expert_map=emap), dict(stream=0x7770), dict(block_size=32)):
        driver.launches.clear()
        call(args, **kw)
        checked = take(driver)
        call(args, **kw)
        full = dict(args, **kw)
        cached = named(driver, driver.launches)
        check_same_launches(checked, cached, full)
        if "stream" in kw:
            assert {c[3] for c in cached} == {0x7770}
        if "block_size" in kw:
            assert cached[0][4][3] == 32
        if "expert_map" in kw:
            assert cached[0][4][2] == 16, "num_experts of the align = the map's global experts"
    assert plans(args) == 3


def test_each_stream_gets_its_own_plan_and_intermediates(fake):
    _, driver = fake
    args = layer(m=2, top_k=2)
    call(args)
    call(args)
    default = named(driver, driver.launches)
    driver.launches.clear()
    call(args, stream=0x7770)
    call(args, stream=0x7770)
    other = named(driver, driver.launches)
    assert {c[3] for c in default} == {0} and {c[3] for c in other} == {0x7770}
    assert default[1][4][2] != other[1][4][2], "concurrent streams never share intermediates"
    assert plans(args) == 2


def test_a_dropped_layer_frees_its_plans_without_the_garbage_collector(fake):
    import gc
    import weakref

    args = layer(m=2, top_k=2)
    call(args)
    call(args)
    assert plans(args) == 1
    refs = [weakref.ref(args["w13_stack"]), weakref.ref(args["w2_stack"])]
    gc.disable()
    try:
        del args
        assert [r() for r in refs] == [None, None], "a plan kept its stacks alive (a reference cycle)"
    finally:
        gc.enable()


def test_large_layers_allocate_intermediates_per_call(fake):
    cupy, driver = fake
    args = layer(m=3, top_k=2)
    args["policy"] = dataclasses.replace(PLAIN_MOE_POLICY, plan_max_workspace_bytes=0)
    call(args)
    checked = take(driver)
    allocations = cupy.state.allocations
    call(args)
    assert cupy.state.allocations == allocations + 7, "the output and the six intermediates"
    first = take(driver)
    check_same_launches(checked, first, args)
    call(args)
    second = named(driver, driver.launches)
    check_same_launches(checked, second, args)
    assert first[1][4][2] != second[1][4][2], "fresh intermediates reach the kernels"
    assert cupy.state.memsets[-1][0] == second[3][4][2]


def test_new_addresses_reach_the_kernels(fake):
    _, driver = fake
    args = layer(m=4, top_k=2)
    call(args)
    checked = take(driver)
    call(args)
    fresh = dict(args, hidden=FakeArray((4, HID), np.float16), topk_ids=FakeArray((4, 2), np.int32),
                 topk_weights=FakeArray((4, 2), np.float32))
    driver.launches.clear()
    call(fresh)
    assert plans(args) == 1
    check_same_launches(checked, named(driver, driver.launches), fresh, args)


CHANGES = {
    # name: (change to the layer's arguments, the error a checked call raises, or None: a new plan, no error)
    "M": (lambda a: dict(hidden=FakeArray((2, HID), np.float16), topk_ids=FakeArray((2, 2), np.int32),
                         topk_weights=FakeArray((2, 2), np.float32)), None),
    "hidden dtype": (lambda a: dict(hidden=FakeArray((4, HID), BF16)), (TypeError, "hidden dtype = bfloat16")),
    "hidden shape": (lambda a: dict(hidden=FakeArray((4, 2 * HID), np.float16)), (ValueError, "hidden has shape")),
    "hidden device": (lambda a: dict(hidden=FakeArray((4, HID), np.float16, device=1)),
                      (ValueError, "input is on device 1 but the stack is on 0")),
    "hidden strides": (lambda a: dict(hidden=FakeArray((4, HID), np.float16, strides=(2 * HID + 2, 2))),
                       (ValueError, "input.stride")),
    "ids dtype": (lambda a: dict(topk_ids=FakeArray((4, 2), np.int64)), (TypeError, "topk_ids dtype = int64")),
    "weights dtype": (lambda a: dict(topk_weights=FakeArray((4, 2), np.float16)),
                      (TypeError, "topk_weights dtype = float16")),
    "top_k": (lambda a: dict(topk_ids=FakeArray((4, 3), np.int32)), (ValueError, "must both be")),
    "ids device": (lambda a: dict(topk_ids=FakeArray((4, 2), np.int32, device=1)),
                   (ValueError, "sorted_token_ids is on device 1")),
    "weights device": (lambda a: dict(topk_weights=FakeArray((4, 2), np.float32, device=1)),
                       (ValueError, "topk_weights is on device 1")),
    "block size": (lambda a: dict(block_size=24), (ValueError, "unsupported moe_block_size=24")),
    "block size type": (lambda a: dict(block_size=16.0), (TypeError, "block_size must be an int")),
    "expert map dtype": (lambda a: dict(expert_map=FakeArray((8,), np.int64)), (TypeError, "expert_map dtype")),
    "expert map device": (lambda a: dict(expert_map=FakeArray((8,), np.int32, device=1)),
                          (ValueError, "expert_map is on device 1")),
    "w2 stack": (lambda a: dict(w2_stack=stack(INTER, 2 * HID)), (ValueError, "w2 n_per_expert")),
    "w13 stack act": (lambda a: dict(w13_stack=stack(HID, 2 * INTER, act=BF16)), (TypeError, "stacks bfloat16")),
    "misaligned hidden": (lambda a: dict(hidden=FakeArray((4, HID), np.float16, ptr=a["hidden"].data.ptr + 2)),
                          (ValueError, "input must be aligned to 16 bytes")),
}


@pytest.mark.parametrize("name", list(CHANGES))
def test_a_warm_plan_does_not_excuse_a_changed_input(fake, name):
    """Warm the plan (and a plan with an expert map), then change one thing: the checked path's verdict."""
    args = layer(m=4, top_k=2)
    call(args)
    call(args)
    for _ in range(2):
        call(args, expert_map=FakeArray((8,), np.int32))
        call(args, block_size=16)
    change, error = CHANGES[name]
    changed = change(args)
    if error is None:
        before = plans(args)
        call(args, **changed)
        assert plans(args) == before + 1
    else:
        exc, message = error
        for _ in range(2):  # and it never becomes a plan
            with pytest.raises(exc, match=message):
                call(args, **changed)


def test_replaced_stack_weight_is_not_served_a_stale_plan(fake):
    _, driver = fake
    args = layer(m=2, top_k=2)
    call(args)
    call(args)
    w13 = args["w13_stack"]
    # new arrays, same shapes: a new plan reads the new addresses
    w13.weight = stack(HID, 2 * INTER).weight
    driver.launches.clear()
    call(args)
    checked = take(driver)
    call(args)
    check_same_launches(checked, named(driver, driver.launches), args)
    # an array replaced inside the weight (same shape and dtype): its address reaches the kernel
    w13.weight.scales = FakeArray(w13.weight.scales.shape, np.float16)
    driver.launches.clear()
    call(args)
    checked = take(driver)
    call(args)
    check_same_launches(checked, named(driver, driver.launches), args)
    # a field changed: checked again
    w13.weight = stack(HID, 2 * INTER).weight
    call(args)
    w13.weight.size_n = 4 * INTER
    with pytest.raises(ValueError):
        call(args)


def test_changed_policy_changes_the_configuration(fake):
    """A layer planned under one policy is not served to a call under another: the plans key on the policy value."""
    _, driver = fake
    args = layer(m=1, top_k=2)
    call(args)
    call(args)
    first = named(driver, driver.launches)[1][0]
    other = dataclasses.replace(PLAIN_MOE_POLICY, blocks_per_sm=1 if "1>" not in first.split(",")[-2] + ">" else 2)
    expected = moe.choose_moe_config(S.F16, S.U4B8, 8, 2 * INTER, HID, 128, 2, 132, 227 * 1024, 228 * 1024,
                                     policy=other)
    assert expected.name_expression != first
    driver.launches.clear()
    call(args, policy=other)
    call(args, policy=other)
    assert named(driver, driver.launches)[1][0] == expected.name_expression
    driver.launches.clear()
    call(args)  # the first policy again: its plan
    assert named(driver, driver.launches)[1][0] == first


def test_config_cache_keys_on_arguments_and_policy():
    moe.config._config_cache.clear()
    args = (S.F16, S.U4B8, 8, 28672, 4096, 128, 2, 132, 227 * 1024, 228 * 1024)
    first = moe.cached_moe_config(*args)
    assert moe.cached_moe_config(*args) is first and len(moe.config._config_cache) == 1
    for i, other in ((2, 16), (3, 14336), (4, 7168), (5, 64), (6, 200), (7, 66), (8, 100 * 1024), (9, 0)):
        changed = list(args)
        changed[i] = other
        assert moe.cached_moe_config(*changed) == moe.choose_moe_config(*changed)
    assert moe.cached_moe_config(S.BF16, *args[1:]).act is S.BF16
    assert moe.cached_moe_config(args[0], S.U8B128, *args[2:]).weight is S.U8B128
    n = len(moe.config._config_cache)
    one = dataclasses.replace(DEFAULT_MOE_POLICY, blocks_per_sm=1)
    assert moe.cached_moe_config(*args, one) == moe.choose_moe_config(*args, policy=one)
    assert moe.cached_moe_config(*args, one).blocks_per_sm == 1 and len(moe.config._config_cache) == n + 1
    equal = dataclasses.replace(DEFAULT_MOE_POLICY, blocks_per_sm=1)  # an equal value: the same entry
    assert moe.cached_moe_config(*args, equal) is moe.cached_moe_config(*args, one)
    assert len(moe.config._config_cache) == n + 1


def test_no_plan_for_non_cupy_or_non_contiguous_arguments(fake):
    cupy, driver = fake
    args = layer(m=2, top_k=2)
    ids = FakeArray((2, 2), np.int32, strides=(16, 4))  # rows 16 bytes apart: not contiguous
    with pytest.raises(AssertionError):  # the stand-in's ascontiguousarray only passes contiguous arrays through
        call(args, topk_ids=ids)
    assert not plans(args)
    no_plans = dataclasses.replace(PLAIN_MOE_POLICY, layer_plans=False)
    driver.launches.clear()
    call(args, policy=no_plans)
    call(args, policy=no_plans)
    # (a plan's run starts with its memset; the checked path launches its five kernels each time)
    assert not plans(args) and not cupy.state.memsets and len(driver.launches) == 10


@pytest.mark.parametrize("name", list(moe.PLAN_ARG_KINDS))
def test_argument_kinds_follow_the_kernels_parameter_lists(name):
    """The plans write 64-bit addresses and int32 scalars per parameter: the kernels' signatures."""
    import re

    source = moe.moe_kernel_source()
    match = re.search(r"__global__ void(?: __launch_bounds__\([^)]*\))?\s+" + name + r"\(([^{]*)\)\s*\{", source)
    assert match, f"{name} not found in marlin_moe.cu"
    params = [p.strip() for p in re.sub(r"//[^\n]*", "", match.group(1)).split(",")]
    kinds = "".join("p" if "*" in p else "i" if re.match(r"(const )?int\b", p) else "?" for p in params)
    assert kinds == moe.PLAN_ARG_KINDS[name], params


def test_programmatic_layer_launches_the_same_kernels(fake, monkeypatch):
    """MoePolicy.programmatic_launch on sm_90: a planned layer launches its five kernels through cuLaunchKernelEx (each
    waits for the one before: kernels_cuda/marlin_moe.cu), with the zeroing memset before the first, and the same
    kernels, grids, arguments and blocks as plain launches; the GEMMs' shared memory is pin_occupancy_of's. The
    checked path's GEMMs (gemm_phase_fused's launch) are programmatic too, with the same values as its CuPy call."""
    from workbench import gemm

    cupy, driver = fake
    monkeypatch.setattr(gemm.kernels, "pin_occupancy_of", lambda kernel, device, smem, blocks_per_sm: smem + 128)
    args = layer(m=3, top_k=2)
    args["policy"] = DEFAULT_MOE_POLICY  # (programmatic: the stand-in's own default is plain)
    call(args)
    checked_gemms = [x for x in driver.launches if "marlin_moe" in driver.moe_names[x[0]]]
    assert len(checked_gemms) == 2 and driver.programmatic == [1, 3], "the checked path's two GEMMs"
    driver.launches.clear(), driver.programmatic.clear()
    call(args)
    assert driver.programmatic == [0, 1, 2, 3, 4]
    programmatic = list(driver.launches)
    (ptr, _, _, _), = cupy.state.memsets[-1:]
    assert ptr == programmatic[3][5][2], "the memset zeroes the down GEMM's output"
    with installed() as (_, plain):
        plain_args = layer(m=3, top_k=2)
        call(plain_args)
        checked_plain = take(plain)
        call(plain_args)
        reference = plain.launches
    # the checked path's GEMMs: the values of its plain launches (but the addresses) and the pinned memory
    for got, want in zip(named(driver, checked_gemms), [c for c in checked_plain if "marlin_moe" in c[0]],
                         strict=True):
        assert (got[0], got[1], got[2], got[4][9:]) == (want[0], want[1], want[2] + 128, want[4][9:])
    for got, want in zip(programmatic, reference, strict=True):
        gemm_kernel = "marlin_moe" in driver.moe_names[got[0]]
        assert got[1:3] == want[1:3] and got[3] == want[3] + 128 * gemm_kernel, "grid, block, shared memory"
        kinds = moe.PLAN_ARG_KINDS[next(k for k in moe.PLAN_ARG_KINDS if k in driver.moe_names[got[0]])]
        assert [v for v, k in zip(got[5], kinds) if k == "i"] == [v for v, k in zip(want[5], kinds) if k == "i"]


@pytest.mark.parametrize("block, n, k, items, expected", [
    (8, 1408, 2048, 6, (1, 2, 4, 1)),  # dsv2-lite M = 1: 6 items of 8 rows, one CTA per SM, 4 stages (8 were slower)
    (32, 14336, 4096, 12, (2, 4, 4, 1)),  # mixtral M = 64: 32-row items (two m16 blocks)
    (8, 1408, 2048, 48, (2, 4, 3, 2)),  # dsv2-lite M = 8: enough items for two CTAs per SM, 3 stages as before
    (64, 14336, 4096, 64, (2, 1, 4, 1)),  # 64-row items: (4, 3) as before
])
def test_fused_moe_stage_order(block, n, k, items, expected):
    """(n_tiles, k_warp, stages, CTAs per SM) on the H200's limits: one-CTA kernels of at most two m16 blocks take
    MoePolicy.one_block_stages (4 first: one CTA with 8 stages was slower everywhere, docs/performance.md, "The fused
    MoE kernel")."""
    cfg = moe.choose_moe_config(S.F16, S.U4B8, block, n, k, 128, items, 132, 227 * 1024, 228 * 1024)
    assert (cfg.n_tiles, cfg.k_warp, cfg.stages, cfg.blocks_per_sm) == expected
