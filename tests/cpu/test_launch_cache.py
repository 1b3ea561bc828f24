"""The launch path's caches, on a stand-in CuPy and driver (tests/fake_device.py): a repeated call reuses the
checked plan and launches with the same arguments as the first; anything that changed under the key (shape, dtype,
device, flags, exact int types) runs the checks again; what the key leaves out (addresses, devices of the other
arrays) is checked on every call. The stand-in driver decodes cuLaunchKernel's void* table, so a wrong argument
block fails here too.
"""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

from fake_device import PLAIN_GEMM_POLICY, PROPS, SMS, FakeArray, _Stream, installed
from workbench import gemm, gemm_abi
from workbench.cuda import arrays as rt_arrays
from workbench.policy import DEFAULT_GEMM_POLICY
from workbench.scalar_types import ScalarType as S

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture
def fake():
    with installed() as (cupy, driver):
        yield cupy, driver


def dense(m=1, k=512, n=256, group=128, act=np.float16, wt=S.U4B8, zeros=False, act_order=False, device=0):
    pf = wt.pack_factor
    ng = 1 if group == -1 else k // group
    arrays = dict(a=FakeArray((m, k), act, device=device),
                  b_q_weight=FakeArray((k // 16, n * 16 // pf), np.int32, device=device),
                  b_scales=FakeArray((ng, n), act, device=device),
                  b_zeros=FakeArray((ng, n // pf), np.int32, device=device) if zeros else None,
                  g_idx=FakeArray((k,), np.int32, device=device) if act_order else None,
                  perm=FakeArray((k,), np.int32, device=device) if act_order else None,
                  workspace=FakeArray((gemm.workspace_numel(SMS),), np.int32, device=device),
                  b_q_type=wt, size_m=m, size_n=n, size_k=k,
                  c=FakeArray((m, n), act, device=device),
                  c_tmp=FakeArray((gemm.c_tmp_numel(SMS),), np.float32, device=device))
    return arrays


def call(args, **changes):
    kw = dict(args)
    kw.update(changes)
    return gemm.gptq_marlin_gemm(**kw)


def kernel_args(launch):
    """(pointers a, b, c, c_tmp, scales, zeros, g_idx, locks, bias), (m, n, k, lda, group_size, mode) of one
    launch."""
    args = launch[5]
    return args[:9], args[9:15]


def fast_div(n, magic, shift):
    """kernels_cuda/marlin_gemm.cu fast_div: the int32 magic's bits as unsigned, a 64-bit product, a shift."""
    return (n * (magic & 0xFFFFFFFF)) >> shift


def block_ranges(launch, grid):
    """[it_begin, it_end) of every block as the kernel forms them from the launch's division plan."""
    steps_q, steps_r, grid_magic, grid_shift = launch[5][15:19]
    return [(b * steps_q + fast_div(b * steps_r, grid_magic, grid_shift),
             (b + 1) * steps_q + fast_div((b + 1) * steps_r, grid_magic, grid_shift)) for b in range(grid)]


def test_repeated_call_reuses_the_plan_and_launches_identically(fake):
    cupy, driver = fake
    args = dense()
    call(args)
    assert len(gemm.api._array_plans) == 1 and len(gemm.launch._prepared) == 1
    allocations, switches = cupy.state.allocations, cupy.state.switches
    for _ in range(3):
        call(args)
    assert len(driver.launches) == 4 and all(x == driver.launches[0] for x in driver.launches)
    assert (cupy.state.allocations, cupy.state.switches) == (allocations, switches), "no allocation, no switch"
    pointers, scalars = kernel_args(driver.launches[0])
    a = args
    assert pointers == (a["a"].data.ptr, a["b_q_weight"].data.ptr, a["c"].data.ptr, a["c_tmp"].data.ptr,
                        a["b_scales"].data.ptr, 0, 0, a["workspace"].data.ptr, 0)
    assert scalars == (1, 256, 512, 512, 128, gemm.REDUCE_FP32)
    cfg, sms, grid = gemm.check_launch(_record_of(args), *PROPS)
    assert driver.launches[0][1:4] == ((grid, 1, 1), (gemm.THREADS, 1, 1), cfg.smem_bytes)
    ki, cols = 512 // cfg.block_k, 256 // cfg.block_n
    total = ki * cols
    assert block_ranges(driver.launches[0], grid) == [(b * total // grid, (b + 1) * total // grid) for b in range(grid)]
    assert driver.launches[0][5][19:] == (*gemm.fast_div_plan(ki), *gemm.fast_div_plan(cols))


def test_fast_div_plan_is_exact_for_every_numerator_below_2_31():
    """n // d == fast_div(n, *fast_div_plan(d)) on the edges (d = 1, powers of two and their neighbours, the largest
    divisors; n at 0, around multiples of d and at 2**31 - 1) and on random pairs: the kernel's block ranges and
    first (slice, k step) rest on it."""
    rng = np.random.default_rng(20261130)
    divisors = [1, 2, 3, 7, 8, 9, 112, 127, 128, 129, 132, 224, 264, 2**16 + 1, 2**30 - 1, 2**30, 2**30 + 1,
                2**31 - 1] + [int(d) for d in rng.integers(1, 2**31, 300)]
    for d in divisors:
        magic, shift = gemm.fast_div_plan(d)
        assert -2**31 <= magic < 2**31 and shift <= 62
        top = (2**31 - 1) // d * d
        for n in [0, 1, d - 1, d, d + 1, top - 1, top, 2**31 - 2, 2**31 - 1] + [int(x) for x in
                                                                                rng.integers(0, 2**31, 200)]:
            if 0 <= n < 2**31:
                assert fast_div(n, magic, shift) == n // d, (n, d)
    for bad in (0, -3, 2**31):
        with pytest.raises(ValueError, match=str(bad)):
            gemm.fast_div_plan(bad)


def _record_of(args, stream=0):
    p = args
    return gemm_abi.MarlinMmRequest(
        weight_type=p["b_q_type"],
        buffers=gemm_abi.MarlinMmBuffers(a=p["a"].data.ptr, b=p["b_q_weight"].data.ptr, c=p["c"].data.ptr,
                                         c_tmp=p["c_tmp"].data.ptr, b_scales=p["b_scales"].data.ptr,
                                         workspace=p["workspace"].data.ptr),
        problem=gemm_abi.MarlinMmProblem(m=p["size_m"], n=p["size_n"], k=p["size_k"], lda=p["size_k"],
                                         num_groups=p["b_scales"].shape[0], group_size=128),
        execution=gemm_abi.MarlinMmExecution(stream=stream, sms=SMS)).into_launch()


def test_new_addresses_reach_the_kernel_without_a_new_plan(fake):
    _, driver = fake
    args = dense()
    call(args)
    other_a, other_c = FakeArray((1, 512), np.float16), FakeArray((1, 256), np.float16)
    call(args, a=other_a, c=other_c)
    assert len(gemm.api._array_plans) == 1
    pointers, _ = kernel_args(driver.launches[-1])
    assert pointers[0] == other_a.data.ptr and pointers[2] == other_c.data.ptr


def test_a_changed_shape_gets_its_own_plan(fake):
    _, driver = fake
    call(dense(m=1))
    call(dense(m=16))
    assert len(gemm.api._array_plans) == 2
    assert kernel_args(driver.launches[0])[1][0] == 1 and kernel_args(driver.launches[1])[1][0] == 16


@pytest.mark.parametrize("change,exc,message", [
    (dict(b_scales=FakeArray((4, 256), np.float32)), TypeError, "b_scales dtype = float32"),
    (dict(b_scales=FakeArray((4, 256), BF16)), TypeError, "b_scales dtype = bfloat16"),  # same strides as fp16
    (dict(b_q_weight=FakeArray((32, 512), np.float32)), TypeError, "b_q_weight dtype = float32"),
    (dict(b_scales=FakeArray((4, 128), np.float16)), ValueError, r"b_scales dim 1 = 128 is not ceil\(size_n / 64\) \* 64 = 256"),
    (dict(a=FakeArray((1, 512), BF16)), TypeError, "c dtype = float16 must equal a dtype = bfloat16"),
    (dict(size_n=256.0), TypeError, "size_n must be an int"),
    (dict(size_m=True), TypeError, "size_m must be an int"),
    (dict(sms=True), TypeError, "sms must be an int"),
    (dict(c=FakeArray((2, 256), np.float16)), ValueError, "Shape mismatch: c.size"),
    (dict(c=FakeArray((1, 256), np.float16, strides=(1024, 4))), ValueError, "c is not contiguous"),
    (dict(workspace=FakeArray((10,), np.int32)), ValueError, "workspace.numel = 10 is below"),
    (dict(c_tmp=FakeArray((10,), np.float32)), ValueError, "c_tmp.numel = 10 is below"),
    (dict(use_atomic_add=True, deterministic=True), ValueError, "cannot be deterministic"),
    (dict(b_q_type=S.U4), ValueError, "b_type must be u4b8, u8b128 or fe4m3fn when has_zp = False"),
    (dict(sms=500), ValueError, "workspace.numel = 264 is below min_workspace_size = 1000"),
    (dict(sms=500, workspace=FakeArray((1000,), np.int32), c_tmp=FakeArray((gemm.c_tmp_numel(500),), np.float32)),
     ValueError, "sms = 500 exceeds the device's 132 SMs"),
])
def test_a_cached_call_does_not_excuse_a_changed_input(fake, change, exc, message):
    args = dense()
    call(args)
    call(args)
    with pytest.raises(exc, match=message):
        call(args, **change)


@pytest.mark.parametrize("name", ["b_q_weight", "b_scales", "workspace", "c", "c_tmp"])
def test_every_array_s_device_is_checked_on_every_call(fake, name):
    args = dense()
    call(args)
    moved = args[name]
    elsewhere = FakeArray(moved.shape, moved.dtype, device=1, strides=moved.strides)
    with pytest.raises(ValueError, match=f"{name} is on device 1 but A is on device 0"):
        call(args, **{name: elsewhere})


def test_addresses_are_checked_on_every_call(fake):
    args = dense(m=2)
    call(args)
    with pytest.raises(ValueError, match=r"a must be aligned to 16 bytes \(address 0x[0-9a-f]+ % 16 = 2\)"):
        call(args, a=FakeArray((2, 512), np.float16, ptr=args["a"].data.ptr + 2))
    with pytest.raises(ValueError, match="b_scales must be aligned to 16 bytes"):
        call(args, b_scales=FakeArray((4, 256), np.float16, ptr=args["b_scales"].data.ptr + 8))


def test_inputs_on_another_device_take_their_own_plan_and_switch_device(fake):
    cupy, driver = fake
    call(dense(device=0))
    call(dense(device=1))
    assert len(gemm.api._array_plans) == 2 and cupy.state.switches >= 1
    assert cupy.state.current == 0, "the caller's device is restored"


def test_output_allocated_on_the_inputs_device_and_scratch_reused(fake):
    cupy, driver = fake
    args = dense(device=1)
    args.pop("c")
    args.pop("c_tmp")
    c1 = call(args)
    c2 = call(args)
    assert c1.data.device_id == 1 and c2.data.device_id == 1 and c1.data.ptr != c2.data.ptr
    assert c1.shape == (1, 256) and c1.dtype == np.float16
    c_tmps = {kernel_args(x)[0][3] for x in driver.launches}
    assert c_tmps == {gemm.api._scratch[(1, 0, SMS, "cupy")][1].data.ptr}


def test_atomic_mode_zeroes_c_before_each_launch(fake):
    cupy, driver = fake
    args = dense(m=3)
    for _ in range(2):
        call(args, use_atomic_add=True, use_fp32_reduce=False)
    assert cupy.state.memsets == [(args["c"].data.ptr, 0, 3 * 256 * 2, 0)] * 2
    assert all(kernel_args(x)[1][5] == gemm.REDUCE_ATOMIC and kernel_args(x)[0][3] == 0 for x in driver.launches)


def test_act_order_gathers_into_a_tmp_first(fake):
    _, driver = fake
    args = dense(m=3, act_order=True)
    a_tmp = FakeArray((3, 512), np.float16)
    for _ in range(2):
        call(args, a_tmp=a_tmp)
    assert len(driver.launches) == 4
    permute, kernel = driver.launches[2:]
    assert permute[1][0] == 3 and permute[5] == (args["a"].data.ptr, args["perm"].data.ptr, a_tmp.data.ptr, 3,
                                                   512, 512)
    pointers, scalars = kernel_args(kernel)
    assert pointers[0] == a_tmp.data.ptr and pointers[6] == args["g_idx"].data.ptr
    assert scalars[3] == 512


def test_zero_points_are_passed_and_required(fake):
    _, driver = fake
    args = dense(wt=S.U4, zeros=True)
    call(args)
    call(args)
    assert kernel_args(driver.launches[-1])[0][5] == args["b_zeros"].data.ptr
    with pytest.raises(ValueError, match="b_zeros is on device 1"):
        call(args, b_zeros=FakeArray(args["b_zeros"].shape, np.int32, device=1))


# ---- the record path ----------------------------------------------------------------------------------------------
def test_record_layout_is_checked_once_and_addresses_every_time(fake):
    _, driver = fake
    args = dense()
    gemm.launch_marlin_mm(_record_of(args))
    gemm.launch_marlin_mm(_record_of(args))
    assert len(gemm.launch._prepared) == 1 and driver.launches[0] == driver.launches[1]
    bad = _record_of(args)
    bad.c = args["c"].data.ptr + 4
    with pytest.raises(ValueError, match="c must be aligned to 16 bytes"):
        gemm.launch_marlin_mm(bad)
    null = _record_of(args)
    null.workspace = None
    with pytest.raises(ValueError, match="workspace is null"):
        gemm.launch_marlin_mm(null)
    other = _record_of(args)
    other.prob_k = 516  # (not a multiple of u4b8's pack factor 8)
    with pytest.raises(ValueError, match="size_k = 516 is not a multiple of the pack factor 8"):
        gemm.launch_marlin_mm(other)
    with pytest.raises(TypeError, match="MarlinLaunch"):
        gemm.launch_marlin_mm(object())


def test_record_stream_reaches_the_launch(fake):
    _, driver = fake
    gemm.launch_marlin_mm(_record_of(dense(), stream=0x7770))
    assert driver.launches[-1][4] == 0x7770


# ---- marlin_gemm and the MoE batched path --------------------------------------------------------------------------
def device_weight(k=512, n=256, experts=None, wt=S.U4B8, group=128):
    from workbench.weight import MarlinWeight

    lead = () if experts is None else (experts,)
    pf = wt.pack_factor
    return MarlinWeight(FakeArray(lead + (k // 16, n * 16 // pf), np.int32), FakeArray(lead + (k // group, n),
                        np.float16), None, None, None, k, n, group, wt, np.dtype(np.float16), num_experts=experts)


def test_marlin_gemm_uses_the_stream_s_scratch(fake):
    _, driver = fake
    w = device_weight()
    a = FakeArray((1, 512), np.float16)
    gemm.marlin_gemm(a, w, stream=0x7770)
    gemm.marlin_gemm(a, w, stream=0x7770)
    ws, ct = gemm.api._scratch[(0, 0x7770, SMS, "cupy")]
    pointers, _ = kernel_args(driver.launches[-1])
    assert (pointers[3], pointers[7], driver.launches[-1][4]) == (ct.data.ptr, ws.data.ptr, 0x7770)
    assert len(gemm.api._array_plans) == 1


def test_batched_dispatches_launch_at_their_rows_and_experts(fake):
    from workbench.moe import MarlinExpertStack

    _, driver = fake
    _Stream.log.clear()
    w = device_weight(experts=8)
    stack = MarlinExpertStack(w, num_streams=4)
    x = FakeArray((12, 512), np.float16)
    y = FakeArray((12, 256), np.float16)
    dispatches = [(e, e, 11 - e, 1) for e in range(8)] + [(3, 8, 0, 3)]
    for _ in range(2):
        stack.gemm_phase_batched(x, dispatches, y)
    ws, c_tmp, streams, sms = stack._scratch[(0, "cupy")]
    launches = driver.launches[-len(dispatches):]
    for i, ((e, r_in, r_out, m), launch) in enumerate(zip(dispatches, launches)):
        lane = i % 4
        pointers, scalars = kernel_args(launch)
        assert pointers[0] == x.data.ptr + r_in * 1024 and pointers[2] == y.data.ptr + r_out * 512
        assert pointers[1] == w.qweight.data.ptr + e * w.qweight.strides[0]
        assert pointers[4] == w.scales.data.ptr + e * w.scales.strides[0]
        assert pointers[3] == c_tmp.data.ptr + lane * c_tmp.strides[0]
        assert pointers[7] == ws.data.ptr + lane * gemm.workspace_numel(sms) * 4
        assert scalars[0] == m and launch[4] == streams[lane].ptr
    assert len(stack._plans) == 2  # m = 1 and m = 3
    # the lanes wait for the caller's event, the caller for each lane's
    log = _Stream.log[-13:]
    ready = log[0][1]
    assert log[0] == ("record", ready, 0)
    assert log[1:5] == [("wait", s.ptr, ready) for s in streams]
    for lane, s in enumerate(streams):
        kind, event, where = log[5 + 2 * lane]
        assert (kind, where) == ("record", s.ptr) and log[6 + 2 * lane] == ("wait", 0, event)


def test_batched_path_keeps_every_check(fake):
    from workbench.moe import MarlinExpertStack

    stack = MarlinExpertStack(device_weight(experts=4))
    x, y = FakeArray((4, 512), np.float16), FakeArray((4, 256), np.float16)
    stack.gemm_phase_batched(x, [(0, 0, 0, 2)], y)
    with pytest.raises(ValueError, match=r"expert_idx = 4 is outside \[0, 4\)"):
        stack.gemm_phase_batched(x, [(4, 0, 0, 2)], y)
    with pytest.raises(ValueError, match="overlapping output rows"):
        stack.gemm_phase_batched(x, [(0, 0, 0, 2), (1, 2, 1, 2)], y)
    with pytest.raises(ValueError, match="input is on device 1 but the stack is on device 0"):
        stack.gemm_phase_batched(FakeArray((4, 512), np.float16, device=1), [(0, 0, 0, 2)], y)
    with pytest.raises(ValueError, match="a must be aligned to 16 bytes"):
        stack.gemm_phase_batched(FakeArray((4, 512), np.float16, ptr=x.data.ptr + 2), [(0, 0, 0, 2)], y)
    with pytest.raises(ValueError, match=r"A.stride\(0\) = 516 must be"):
        stack.gemm_phase_batched(FakeArray((4, 512), np.float16, strides=(1032, 2)), [(0, 0, 0, 2)], y)


def test_batched_plans_follow_a_replaced_weight(fake):
    from workbench.moe import MarlinExpertStack

    stack = MarlinExpertStack(device_weight(experts=4))
    x, y = FakeArray((4, 512), np.float16), FakeArray((4, 256), np.float16)
    stack.gemm_phase_batched(x, [(0, 0, 0, 2)], y)
    bad = device_weight(experts=4)
    bad.scales = FakeArray((4, 4, 256), np.float32)
    stack.weight = bad
    with pytest.raises(TypeError, match="b_scales dtype = float32"):
        stack.gemm_phase_batched(x, [(0, 0, 0, 2)], y)


@pytest.mark.parametrize("name", ["marlin_gemm", "permute_cols"])
def test_argument_blocks_follow_the_kernels_parameter_lists(name):
    """The direct launch writes 64-bit addresses and int32 scalars in a fixed order: the kernel's signature."""
    import re

    source = gemm.kernel_source()
    match = re.search(r"__global__ void(?: __launch_bounds__\([^)]*\))?\s+" + name + r"\(([^{]*)\)\s*\{", source)
    assert match, f"{name} not found in marlin_gemm.cu"
    text = match.group(1).strip()
    if re.fullmatch(r"\w+", text):  # a parameter-list macro (shared by the kernel and its cluster launch)
        macro = re.search(r"#define " + text + r"\s+((?:[^\n]*\\\n)*[^\n]*)", source)
        assert macro, f"#define {text} not found"
        text = macro.group(1).replace("\\\n", " ")
    params = [re.sub(r"//[^\n]*", "", p).strip() for p in re.sub(r"//[^\n]*", "", text).split(",")]
    kinds = "".join("p" if "*" in p else "i" if re.match(r"(const )?int\b", p) else "?" for p in params)
    assert kinds == gemm.KERNEL_ARG_KINDS[name], params


@pytest.mark.parametrize("cc, switch, programmatic", [(90, True, True), (90, False, False), (80, True, False)])
def test_programmatic_launch_on_sm90_only(fake, monkeypatch, cc, switch, programmatic):
    """sm_90+ with GemmPolicy.programmatic_launch: cuLaunchKernelEx with programmatic stream serialization (the kernel waits
    before it reads A or writes anything: kernels_cuda/mma.cuh); else cuLaunchKernel. Same grid, shared memory and
    arguments either way; the act-order gather before it stays a plain launch."""
    _, driver = fake
    policy = dataclasses.replace(DEFAULT_GEMM_POLICY, programmatic_launch=switch)
    monkeypatch.setattr(gemm.kernels, "device_properties", lambda device: (cc,) + PROPS[1:])
    # a stand-in pin (programmatic_pin_occupancy): 128 bytes more where the plan has one block per SM
    monkeypatch.setattr(gemm.kernels, "pin_occupancy_of",
                        lambda kernel, device, smem, blocks_per_sm: smem + 128 * (blocks_per_sm < 2))
    call(dense(), policy=policy)
    call(dense(m=3, act_order=True), policy=policy)
    assert driver.programmatic == ([0, 2] if programmatic else [])
    with installed() as (_, plain):
        call(dense(), policy=PLAIN_GEMM_POLICY)
        call(dense(m=3, act_order=True), policy=PLAIN_GEMM_POLICY)
        reference = plain.launches
    # (fresh arrays there: compare all but the addresses); a programmatic launch's shared memory is pin_occupancy_of's
    for i, (launch, plain_launch) in enumerate(zip(driver.launches, reference, strict=True)):
        smem = plain_launch[3]
        if i in driver.programmatic:
            cfg = [p for p in gemm.launch._prepared.values() if p._function == launch[0]][0].cfg
            smem = gemm.kernels.pin_occupancy_of(None, 0, smem, cfg.blocks_per_sm)
            assert cfg.blocks_per_sm > 1 or smem > plain_launch[3]
        assert launch[1:5] + launch[5][-3:] == plain_launch[1:3] + (smem, plain_launch[4]) + plain_launch[5][-3:]


class _Kernel:
    class kernel:  # noqa: N801  (the shape of cupy.RawKernel.kernel)
        ptr = 1234


def test_residency_query_binds_a_context_in_a_fresh_thread(monkeypatch):
    """precompile() loads kernels in worker threads; the occupancy query must not fail there for want of a current
    context (it did on the H200: two-block kernels then launched on half their grid)."""
    calls = []

    class Driver:
        current = 0

        def ctxGetCurrent(self):
            return self.current

        def occupancyMaxActiveBlocksPerMultiprocessor(self, ptr, threads, smem):
            if not self.current:
                raise RuntimeError("CUDA_ERROR_INVALID_CONTEXT")
            calls.append((ptr, threads, smem))
            return 2

    driver = Driver()

    class Runtime:
        def free(self, ptr):
            assert ptr == 0
            driver.current = 99  # cudaFree(0) binds the primary context

    monkeypatch.setattr(gemm.kernels, "_driver_apis", lambda: (driver, Runtime()))
    assert gemm.kernels._resident_blocks(_Kernel, 96256) == 2
    assert calls == [(1234, gemm.THREADS, 96256)]


def test_residency_query_failure_is_conservative(monkeypatch):
    class Driver:
        def ctxGetCurrent(self):
            return 7

        def occupancyMaxActiveBlocksPerMultiprocessor(self, *args):
            raise RuntimeError("no")

    monkeypatch.setattr(gemm.kernels, "_driver_apis", lambda: (Driver(), None))
    assert gemm.kernels._resident_blocks(_Kernel, 1024) == 1


@pytest.mark.parametrize("smem, blocks_per_sm", [(33792, 1), (33792, 2), (100352, 1), (66560, 3), (120000, 1)])
def test_pinned_smem_is_the_least_that_keeps_the_planned_blocks(smem, blocks_per_sm):
    """PROGRAMMATIC_PIN_OCCUPANCY: the smallest 128-byte multiple >= the kernel's shared memory with which the H200's
    SM (228 KiB, 1 KiB reserved per block) holds no more than the planned blocks, found here by trying every one."""
    sm_smem, reserved = 233472, 1024

    def fits(s):
        return sm_smem // (s + reserved)

    want = next(s for s in range(smem, sm_smem, 128) if fits(s) <= blocks_per_sm)
    assert gemm.pinned_smem(smem, blocks_per_sm, sm_smem, reserved) in (want, smem)
    assert gemm.pinned_smem(smem, blocks_per_sm, sm_smem, reserved) == (want if fits(smem) > blocks_per_sm else smem)


def test_pin_occupancy_raises_the_kernels_limit_and_checks_the_query(monkeypatch):
    import contextlib
    import types

    class Kernel:
        max_dynamic_shared_size_bytes = 49152

    kernel = Kernel()
    resident = {}
    monkeypatch.setattr(rt_arrays, "_cupy_module", types.SimpleNamespace(  # (CuPy's device switch, stood in)
        cuda=types.SimpleNamespace(Device=lambda device: contextlib.nullcontext())))
    monkeypatch.setattr(gemm.kernels, "device_properties", lambda device: (90, 132, 232448, 233472))
    monkeypatch.setattr(gemm.kernels, "_resident_blocks", lambda k, smem: resident.get(smem, 233472 // (smem + 1024)))
    # a 33 KiB kernel: six fit
    assert gemm.pin_occupancy_of(kernel, 0, 33792, 1) == 115840 == kernel.max_dynamic_shared_size_bytes
    assert gemm.pin_occupancy_of(kernel, 0, 33792, 6) == 33792, "as many as planned fit already"
    resident[76928] = 3  # the driver disagrees (e.g. a different reservation): launch as planned
    assert gemm.pin_occupancy_of(kernel, 0, 33792, 2) == 33792
