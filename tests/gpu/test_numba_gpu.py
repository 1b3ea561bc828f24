"""GPU tier: the compiled Numba kernels equal the NumPy references bit for bit at real shapes.

Shapes: Llama-3 8B (K×N = 4096×14336 gate/up, 14336×4096 down), Llama-3 70B (8192×28672, 28672×8192), the smallest
legal K and N, and 64 stacked experts of 2048×1408. Inputs arrive as NumPy, CuPy and PyTorch arrays; device inputs
must come back as device arrays. Outputs are poisoned before the launch. Skipped with a reason without a GPU.
"""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

from workbench import hardware

pytestmark = pytest.mark.gpu
if hardware.gpu_skip_reason():
    pytest.skip(hardware.gpu_skip_reason(), allow_module_level=True)

from numba import cuda  # noqa: E402

from kernels_numba import marlin_repack as kr  # noqa: E402
from kernels_numba import moe as kmoe  # noqa: E402
from kernels_numba import scales as ks  # noqa: E402
from kernels_numba._launch import poison_outputs  # noqa: E402
from workbench import backends, ops  # noqa: E402
from workbench.formats import fp8 as fp8_fmt  # noqa: E402
from workbench.formats import gptq, marlin_tile, packing  # noqa: E402
from workbench.formats import scales as sc  # noqa: E402
from workbench.policy import RepackPolicy  # noqa: E402

cupy = pytest.importorskip("cupy", reason="CuPy is needed for the device-array half of the GPU tier")
BF16 = np.dtype(ml_dtypes.bfloat16)

LLAMA3_8B = [(4096, 14336), (14336, 4096)]
LLAMA3_70B = [(8192, 28672), (28672, 8192)]
SMALLEST = [(16, 64)]


def _host(a):
    if a is None:
        return None
    if hasattr(a, "get"):
        return a.get()
    if hasattr(a, "copy_to_host"):
        return a.copy_to_host()
    if type(a).__module__.startswith("torch"):  # torch callers get torch tensors back
        return a.cpu().numpy()
    return np.asarray(a)


def _codes(rng, k, n, bits):
    return rng.integers(0, 1 << bits, size=(k, n), dtype=np.uint8)


_CASES = {}


class _Case(dict):
    """Fresh random codes of one (K, N, bits) and their NumPy references, each computed on first use."""

    def __init__(self, k, n, bits):
        super().__init__()
        rng = np.random.default_rng()
        self.codes = _codes(rng, k, n, bits)
        self.bits = bits
        self["perm"] = rng.permutation(k).astype(np.int32)

    def __missing__(self, name):
        codes, bits = self.codes, self.bits
        make = {"gptq": lambda: packing.pack_rows(codes, bits), "awq": lambda: packing.awq_pack(codes, bits),
                "marlin": lambda: marlin_tile.marlin_repack_codes(codes, bits),
                "act_order": lambda: marlin_tile.marlin_repack_codes(codes, bits, self["perm"])}[name]
        self[name] = make()
        return self[name]


def _case(k, n, bits):
    """The _Case of (K, N, bits), shared by every test and switch setting in this module run: the references at
    8B/70B shapes cost seconds each on the host, and the tests that share them check different kernels (or switch
    settings) against the same expected arrays."""
    if (k, n, bits) not in _CASES:
        _CASES[(k, n, bits)] = _Case(k, n, bits)
    return _CASES[(k, n, bits)]


@pytest.mark.parametrize("k,n", LLAMA3_8B + LLAMA3_70B[:1] + SMALLEST)
@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_repack_real_shapes_cupy_in_cupy_out(k, n, bits):
    case = _case(k, n, bits)
    perm, qweight = case["perm"], case["gptq"]
    d_q, d_perm = cupy.asarray(qweight), cupy.asarray(perm)
    with poison_outputs():
        plain = ops.gptq_marlin_repack(d_q, None, k, n, bits, backend="auto")
        act_order = ops.gptq_marlin_repack(d_q, d_perm, k, n, bits, backend="auto")
    assert isinstance(plain, cupy.ndarray) and plain.dtype == np.int32
    assert np.array_equal(plain.get(), case["marlin"])
    assert np.array_equal(act_order.get(), case["act_order"])
    with poison_outputs():
        back = kr.marlin_to_gptq_qweight(act_order, d_perm, k, n, bits)
    assert isinstance(back, cupy.ndarray) and np.array_equal(back.get(), qweight)
    assert np.array_equal(d_q.get(), qweight)  # input untouched


@pytest.mark.parametrize("k,n", LLAMA3_8B + SMALLEST)
@pytest.mark.parametrize("bits", [4, 8])
def test_awq_repack_and_inverse_real_shapes(k, n, bits):
    case = _case(k, n, bits)
    awq = case["awq"]
    with poison_outputs():
        got = ops.awq_marlin_repack(awq, k, n, bits, backend="numba")
        back = kr.marlin_to_awq_qweight(got, k, n, bits)
    assert np.array_equal(got, case["marlin"])
    assert np.array_equal(back, awq)


@pytest.mark.parametrize("k,n", LLAMA3_8B + [(128, 64)])
def test_fp8_repacks_real_shapes_torch_in(k, n, rng):
    torch = pytest.importorskip("torch", reason="PyTorch is needed for the torch-tensor inputs")
    raw = rng.integers(0, 256, size=(n, k), dtype=np.uint8)
    expected = marlin_tile.marlin_repack_codes(np.ascontiguousarray(raw.T), 8)
    t_raw = torch.from_numpy(raw).cuda()
    t_kmajor = torch.from_numpy(fp8_fmt.pack_fp8_to_int32(raw)).cuda()
    with poison_outputs():
        direct = ops.block_fp8_group128_repack(backends.normalize(t_raw), k, n, backend="auto")
        via_words = ops.fp8_marlin_repack_raw_bits(backends.normalize(t_kmajor), k, n, backend="auto")
        kernel_direct = kr.block_fp8_group128_repack(t_raw, k, n)  # the wrapper takes torch tensors itself
        back = kr.marlin_to_block_fp8_row_major(direct, k, n)
    assert all(type(got).__module__.startswith("torch") for got in (direct, via_words, kernel_direct))
    for got in (direct, via_words, kernel_direct):
        assert np.array_equal(_host(got), expected)
    assert np.array_equal(_host(back), raw)


@pytest.mark.parametrize("k,n,group_size", [(4096, 14336, 128), (14336, 4096, -1), (8192, 28672, 128),
                                            (128, 64, 128), (128, 64, 32)])
def test_scales_and_zero_points_real_shapes(k, n, group_size, rng):
    ng = sc.num_groups(k, group_size)
    for dtype in (np.float16, BF16):
        s = rng.standard_normal((ng, n)).astype(dtype)
        with poison_outputs():
            got = ops.marlin_permute_scales(s, k, n, group_size, backend="numba")
        assert np.array_equal(got.view(np.uint16), np.ascontiguousarray(sc.permute_scales(s, k, n, group_size))
                              .view(np.uint16))
    for bits in (4, 8):
        zeros = rng.integers(1, 1 << bits, (ng, n), dtype=np.uint8)
        expected = sc.zero_points_to_marlin(zeros, k, n, bits)
        v1 = packing.pack_cols(zeros - np.uint8(1), bits)
        with poison_outputs():
            assert np.array_equal(ops.marlin_zero_points(cupy.asarray(zeros), k, n, bits).get(), expected)
            assert np.array_equal(ops.awq_to_marlin_zero_points(packing.awq_pack(zeros, bits), k, n, bits,
                                                                backend="numba"), expected)
            assert np.array_equal(ops.repack_gptq_qzeros_to_marlin(v1, k, n, group_size, bits, backend="numba"),
                                  gptq.repack_gptq_qzeros_to_marlin(v1, k, n, group_size, bits))
            assert np.array_equal(ks.marlin_zero_points_to_codes(expected, k, n, bits), zeros)


def test_code15_is_an_exception_on_the_gpu(rng):
    k, n, g = 4096, 14336, 128
    v1 = packing.pack_cols(rng.integers(0, 15, (k // g, n), dtype=np.uint8), 4)
    v1.view(np.uint32)[17, 1000] |= np.uint32(0xF << 12)
    with pytest.raises(ValueError, match="group=17 packed_col=1000 lane=3 has code 15"):
        ops.repack_gptq_qzeros_to_marlin(cupy.asarray(v1), k, n, g, 4)


@pytest.mark.parametrize("k,n", LLAMA3_8B + LLAMA3_70B + [(128, 64)])
@pytest.mark.parametrize("src", [BF16, np.float32])
@pytest.mark.parametrize("act", [np.float16, BF16])
def test_block_fp8_scales_real_shapes(k, n, src, act, rng):
    shape = (-(-n // 128), k // 128)
    inv = (rng.random(shape) * 2.0 ** rng.integers(-30, 10, shape)).astype(src)
    with poison_outputs():
        got = ops.block_fp8_group128_scales(inv, k, n, act, backend="numba")
    assert np.array_equal(got.view(np.uint16),
                          np.ascontiguousarray(fp8_fmt.block_fp8_group128_scales(inv, k, n, act)).view(np.uint16))


def test_64_stacked_experts_one_launch_and_staged(rng):
    experts, k, n, g, bits = 64, 2048, 1408, 128, 4
    codes = rng.integers(0, 16, (experts, k, n), dtype=np.uint8)
    qws = np.stack([packing.pack_rows(codes[e], bits) for e in range(experts)])
    scs = rng.standard_normal((experts, k // g, n)).astype(np.float32)
    qzs = np.stack([packing.pack_cols(rng.integers(0, 15, (k // g, n), dtype=np.uint8), bits)
                    for _ in range(experts)])
    ref = ops.stack_gptq_experts_to_marlin(list(qws), list(scs), list(qzs), bits, g, k, n, np.float16,
                                           backend="numpy")
    with poison_outputs():
        on_device = kmoe.stack_gptq_experts_to_marlin(cupy.asarray(qws), cupy.asarray(scs), cupy.asarray(qzs), bits,
                                                      g, k, n, np.float16)
        staged = kmoe.stack_gptq_experts_to_marlin(list(qws), list(scs), list(qzs), bits, g, k, n, np.float16)
    for qw, s, z, asym in (tuple(_host(a) for a in on_device[:3]) + (on_device[3],), staged):
        assert asym is True
        assert np.array_equal(qw, ref.qweight)
        assert np.array_equal(s.view(np.uint16), ref.scales.view(np.uint16))
        assert np.array_equal(z, ref.zeros)


def test_stream_argument_is_honoured(rng):
    k, n, bits = 4096, 14336, 4
    codes = _codes(rng, k, n, bits)
    q = cupy.asarray(packing.pack_rows(codes, bits))
    stream = cupy.cuda.Stream(non_blocking=True)
    with poison_outputs():
        got = ops.gptq_marlin_repack(q, None, k, n, bits, stream=stream)
    stream.synchronize()
    assert np.array_equal(got.get(), marlin_tile.marlin_repack_codes(codes, bits))
    numba_stream = cuda.stream()
    got2 = kr.gptq_marlin_repack(q, None, k, n, bits, stream=numba_stream)
    numba_stream.synchronize()
    assert np.array_equal(got2.get(), marlin_tile.marlin_repack_codes(codes, bits))


def test_array_on_another_device_is_a_clear_error(rng):
    """An array that says it lives on cuda:1 is refused before any launch (a stand-in object keeps this testable on
    a one-GPU machine: it shares a real buffer's interface but reports device 1, as a PyTorch tensor would)."""
    import types

    q = cupy.asarray(packing.pack_rows(_codes(rng, 16, 64, 4), 4))

    class OnDeviceOne:
        device = types.SimpleNamespace(type="cuda", index=1)

        @property
        def __cuda_array_interface__(self):
            return q.__cuda_array_interface__

    with pytest.raises(ValueError, match="b_q_weight is on cuda:1 but the kernels run on cuda:0"):
        kr.gptq_marlin_repack(OnDeviceOne(), None, 16, 64, 4)


def test_non_contiguous_cupy_array_is_a_clear_error(rng):
    q = cupy.asarray(packing.pack_rows(_codes(rng, 16, 128, 4), 4))[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        ops.gptq_marlin_repack(q, None, 16, 64, 4)


# ---------------------------------------------------------------------------------------------------------------
# The policy's variants at real shapes: every switch value of the wrappers, compiled integer semantics, poisoned outputs
# ---------------------------------------------------------------------------------------------------------------
ROUND3_SHAPES = [(4096, 14336), (14336, 4096), (16, 64)]


@pytest.mark.parametrize("k,n", ROUND3_SHAPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("new", [False, True], ids=["round2", "round4"])
def test_round3_inverse_and_act_order_switches(k, n, bits, new):
    """round2: every switch off (one-pass act-order, 4-byte AWQ stores, direct GPTQ u8 inverse); round4: the
    defaults (two-pass act-order with pass 2 on the n-fastest grid, AWQ inverse with 8-byte stores, the transpose
    network and the n-fastest grid, paired GPTQ u8 inverse)."""
    policy = dataclasses.replace(RepackPolicy(), act_order_two_pass=new, act_order_pass2_n_fastest=new,
                                 awq_unpack_wide_stores=new, awq_unpack_n_fastest=new,
                                 paired_unpack_8bit=new)
    case = _case(k, n, bits)
    d_marlin = cupy.asarray(case["marlin"])
    with poison_outputs():
        act_order = kr.gptq_marlin_repack(cupy.asarray(case["gptq"]), cupy.asarray(case["perm"]), k, n, bits,
                                          policy=policy)
        awq = kr.marlin_to_awq_qweight(d_marlin, k, n, bits, policy=policy)
        gptq = kr.marlin_to_gptq_qweight(d_marlin, None, k, n, bits, policy=policy)
    assert np.array_equal(act_order.get(), case["act_order"])
    assert np.array_equal(awq.get(), case["awq"])
    assert np.array_equal(gptq.get(), case["gptq"])
    assert np.array_equal(d_marlin.get(), case["marlin"])  # input untouched


@pytest.mark.parametrize("k,n", ROUND3_SHAPES[:2])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n_fastest", [False, True])
def test_round4_awq_inverse_mixed_switches(k, n, bits, n_fastest):
    """The AWQ inverse's grid order alone, 8-byte stores on (every switch off and all on: the switch test above)."""
    policy = dataclasses.replace(RepackPolicy(), awq_unpack_n_fastest=n_fastest)
    case = _case(k, n, bits)
    with poison_outputs():
        awq = kr.marlin_to_awq_qweight(cupy.asarray(case["marlin"]), k, n, bits, policy=policy)
    assert np.array_equal(awq.get(), case["awq"])


_ROW_MAJOR = {}


@pytest.mark.parametrize("k,n", ROUND3_SHAPES + [(144, 128)])
def test_row_major_inverse_real_shapes(k, n):
    if (k, n) not in _ROW_MAJOR:  # one fresh input per shape and module run
        raw = np.random.default_rng().integers(0, 256, size=(n, k), dtype=np.uint8)
        _ROW_MAJOR[(k, n)] = raw, marlin_tile.marlin_repack_codes(np.ascontiguousarray(raw.T), 8)
    raw, marlin = _ROW_MAJOR[(k, n)]
    with poison_outputs():
        back = kr.marlin_to_block_fp8_row_major(cupy.asarray(marlin), k, n)
    assert np.array_equal(back.get(), raw)


@pytest.mark.parametrize("bits", [4, 8])
def test_round3_stacked_act_order_keeps_the_one_pass_kernel(bits, rng):
    """64 stacked experts with their own perms: one launch of the one-pass gather (no temporary)."""
    experts, k, n = 64, 2048, 1408
    codes = rng.integers(0, 1 << bits, size=(experts, k, n), dtype=np.uint8)
    perms = np.stack([rng.permutation(k) for _ in range(experts)]).astype(np.int32)
    stacked = np.stack([packing.pack_rows(c, bits) for c in codes])
    with poison_outputs():
        got = kr.gptq_marlin_repack(cupy.asarray(stacked), cupy.asarray(perms), k, n, bits).get()
    for e in (0, 31, 63):
        assert np.array_equal(got[e], marlin_tile.marlin_repack_codes(codes[e], bits, perms[e]))


# ---- the microscaled formats (kernels_numba/fp4_repack.py): the sector kernels and the scale tile kernels ----------
from kernels_numba import fp4_repack as kf  # noqa: E402
from workbench.formats import fp4_marlin as fm  # noqa: E402

# (K, N): the 70B layers (>= 100 MB), the smallest tile, a k-tile count that leaves a warp and a block partial (65 =
# 4 * 16 + 1), an odd number of 16-groups and a group count past one 32-group scale tile
FP4_SHAPES = LLAMA3_70B + [(16, 64), (1040, 320), (48, 192), (32 * 33, 128)]
FP4_LAUNCHES = [(1, False, 4, False), (2, False, 4, False), (1, True, 4, False), (2, True, 4, False),
                (1, False, 8, False), (1, True, 8, False), (1, False, 4, True), (1, True, 4, True)]


def _device_bytes(shape):
    return cupy.random.randint(0, 256, size=shape, dtype=cupy.int32).astype(cupy.uint8)


def _launch_id(v):
    return f"g{v[0]}-{'n' if v[1] else 'k'}fast-w{v[2]}" + ("-warpsync" if v[3] else "")


@pytest.mark.parametrize("launch", FP4_LAUNCHES, ids=_launch_id)
@pytest.mark.parametrize("k,n", FP4_SHAPES)
def test_fp4_and_mxfp8_weights_every_launch_shape(k, n, launch):
    """Against vLLM's route on the GPTQ kernel (``weight.view(int32).T`` through gptq_marlin_repack, checked against
    NumPy in this module) and the block-FP8 transpose tile; small shapes also against the NumPy references."""
    packed, fp8 = _device_bytes((n, k // 2)), _device_bytes((n, k))
    want4 = kr.gptq_marlin_repack(cupy.ascontiguousarray(packed.view(cupy.int32).T), None, k, n, 4)
    want8 = kr.block_fp8_group128_repack(fp8, k, n)
    with poison_outputs():
        got4 = kf.fp4_marlin_repack(packed, k, n, launch=launch)
        back4 = kf.marlin_to_fp4(got4, k, n, launch=launch)
        got8 = kf.mxfp8_marlin_repack(fp8, k, n, launch=launch)
    assert isinstance(got4, cupy.ndarray) and got4.dtype == np.int32 and got4.shape == (k // 16, 2 * n)
    assert isinstance(got8, cupy.ndarray) and got8.dtype == np.int32 and got8.shape == (k // 16, 4 * n)
    assert bool(cupy.array_equal(got4, want4)) and bool(cupy.array_equal(got8, want8))
    assert back4.dtype == np.uint8 and bool(cupy.array_equal(back4, packed))
    if k * n <= 1 << 20:
        assert np.array_equal(got4.get(), fm.fp4_marlin_repack(packed.get(), k, n))
        assert np.array_equal(got8.get(), fm.mxfp8_marlin_repack(fp8.get(), k, n))


def test_fp4_weights_public_ops_torch_stacked_and_unaligned(rng):
    torch = pytest.importorskip("torch", reason="PyTorch is needed for the torch-tensor inputs")
    k, n = 512, 192
    packed = rng.integers(0, 256, size=(3, n, k // 2), dtype=np.uint8)
    fp8 = rng.integers(0, 256, size=(3, n, k), dtype=np.uint8)
    with poison_outputs():
        q = ops.fp4_marlin_repack(torch.from_numpy(packed[1]).cuda(), k, n)  # backend auto: the kernels
        q8 = ops.mxfp8_marlin_repack(torch.from_numpy(fp8[2]).cuda(), k, n)
        stacked = kf.fp4_marlin_repack(cupy.asarray(packed), k, n)
        stacked8 = kf.mxfp8_marlin_repack(cupy.asarray(fp8), k, n)
        # an input 1 byte past an aligned address (a view into another buffer): copied to an aligned one first
        buf = cupy.zeros(packed[0].size + 1, cupy.uint8)
        buf[1:] = cupy.asarray(packed[0]).ravel()
        unaligned = buf[1:].reshape(n, k // 2)
        assert unaligned.data.ptr % 8 == 1
        q_unaligned = kf.fp4_marlin_repack(unaligned, k, n)
        words = cupy.zeros(stacked[0].size + 1, cupy.int32)  # Marlin words 4 bytes past an aligned address
        words[1:] = stacked[0].ravel()
        back_unaligned = kf.marlin_to_fp4(words[1:].reshape(k // 16, 2 * n), k, n)
    assert type(q).__module__.startswith("torch") and type(q8).__module__.startswith("torch")
    assert np.array_equal(_host(q), fm.fp4_marlin_repack(packed[1], k, n))
    assert np.array_equal(_host(q8), fm.mxfp8_marlin_repack(fp8[2], k, n))
    for e in range(3):
        assert np.array_equal(stacked[e].get(), fm.fp4_marlin_repack(packed[e], k, n))
        assert np.array_equal(stacked8[e].get(), fm.mxfp8_marlin_repack(fp8[e], k, n))
    assert np.array_equal(q_unaligned.get(), fm.fp4_marlin_repack(packed[0], k, n))
    assert np.array_equal(back_unaligned.get(), packed[0])
    assert bool((buf[1:] == cupy.asarray(packed[0]).ravel()).all())  # input untouched


@pytest.mark.parametrize("k,n", FP4_SHAPES)
def test_fp4_scale_routes_real_shapes(k, n):
    """NVFP4 (fp16, and bf16 with its computed factor) and MX scales both ways against the NumPy references, and
    the NaN errors with the references' messages."""
    rng = np.random.default_rng()
    nv = rng.integers(0, 0x7F, size=(n, k // 16), dtype=np.uint8)  # every E4M3 magnitude but NaN
    with poison_outputs():
        got, sf = kf.nvfp4_marlin_scales(cupy.asarray(nv), k, n, np.float16)
        back = kf.marlin_to_nvfp4_scales(got, k, n, sf)
        got_b, sf_b = kf.nvfp4_marlin_scales(cupy.asarray(np.maximum(nv, 0x20)), k, n, BF16)  # bf16: factor 1
    want, want_sf = fm.nvfp4_marlin_scales(nv, k, n, np.float16)
    want_b, want_sf_b = fm.nvfp4_marlin_scales(np.maximum(nv, 0x20), k, n, BF16)
    assert sf == want_sf and np.array_equal(got.get(), want) and np.array_equal(back.get(), nv)
    assert sf_b == want_sf_b and np.array_equal(got_b.get(), want_b)
    bad = nv.copy()
    bad[n // 2, (k // 16) // 2] = 0x7F
    bad[n - 1, 0] = 0xFF
    with pytest.raises(ValueError) as ref:
        fm.nvfp4_marlin_scales(bad, k, n, np.float16)
    with pytest.raises(ValueError) as kern:
        kf.nvfp4_marlin_scales(cupy.asarray(bad), k, n, np.float16)
    assert str(kern.value) == str(ref.value)
    if k % 32:
        return
    codes = rng.integers(0, 255, size=(n, k // 32), dtype=np.uint8)
    with poison_outputs():
        got = kf.mx_marlin_scales(cupy.asarray(codes), k, n, "mxfp4")
        back = kf.marlin_to_mx_scales(got, k, n, "mxfp4")
    assert np.array_equal(got.get(), fm.mx_marlin_scales(codes, k, n, "mxfp4")) and np.array_equal(back.get(), codes)
    codes[n // 3, (k // 32) - 1] = 0xFF
    with pytest.raises(ValueError) as ref:
        fm.mx_marlin_scales(codes, k, n, "mxfp4")
    with pytest.raises(ValueError) as kern:
        kf.mx_marlin_scales(cupy.asarray(codes), k, n, "mxfp4")
    assert str(kern.value) == str(ref.value)
