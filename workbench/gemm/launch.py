"""The launch record's adapter (docs/formats.md, "Launch record"): ``check_launch`` runs the record's own rules and
workbench.gemm.checks' shared ones, ``PreparedLaunch`` holds everything of a launch but its addresses and stream,
``prepare_launch`` caches one per record layout and policy, ``launch_marlin_mm`` launches a record.
"""
from __future__ import annotations

import ctypes
import dataclasses
import threading

import numpy as np

from workbench import cuda as rt
from workbench.cuda import arrays as rt_arrays
from workbench.cuda import launch as rt_launch
from workbench.gemm import checks
from workbench.gemm import kernels
from workbench.gemm.geometry import (GROUP_GROUPED, KERNEL_CLUSTER_SIZES, REDUCE_ATOMIC, REDUCE_FP32, REDUCE_IN_C,
                                     THREADS, KernelConfig, choose_config, choose_invariant_config, cluster_blocks,
                                     default_policy, grid_blocks, invariant_plan, k_steps,
                                     pairs_possible, pipeline_steps, THREAD_SHAPES, tiled_n, tile_k, two_block_smem)
from workbench.gemm_abi import (ABI_VERSION, ACT_TYPES, FLAG_BATCH_INVARIANT, FLAG_DETERMINISTIC, FLAG_HAS_ACT_ORDER,
                                FLAG_HAS_ZERO_POINTS, FLAG_IS_K_FULL, FLAG_USE_ATOMIC_ADD, FLAG_USE_FP32_REDUCE,
                                GEMM_WEIGHT_TYPES, KNOWN_FLAGS, MarlinLaunch)
from workbench.policy import GemmPolicy
from workbench.scalar_types import ScalarType

_default = default_policy


_TYPE_BY_CODE = {t.abi_code: t for t in ScalarType}


def check_launch(launch: MarlinLaunch, compute_capability: int, device_sms: int, smem_limit: int, sm_smem: int = 0,
                 policy: GemmPolicy | None = None) -> tuple[KernelConfig, int, int]:
    """Every rule a record can be checked against without knowing buffer extents (the rules of
    workbench.gemm_checks, plus the record's own fields), then the configuration ``policy`` chooses. Returns
    (config, sms, grid)."""
    if not isinstance(launch, MarlinLaunch):
        raise TypeError(f"expected a MarlinLaunch record, got {type(launch).__name__}")
    if launch.abi_version != ABI_VERSION:
        raise ValueError(f"abi_version = {launch.abi_version} is not supported (this build speaks {ABI_VERSION})")
    if launch.struct_size != ctypes.sizeof(MarlinLaunch):
        raise ValueError(f"struct_size = {launch.struct_size} does not match sizeof(MarlinLaunch) = "
                         f"{ctypes.sizeof(MarlinLaunch)}")
    if launch.flags & ~KNOWN_FLAGS:
        raise ValueError(f"flags = {launch.flags:#x} has unknown bits {launch.flags & ~KNOWN_FLAGS:#x}")
    codes = _TYPE_BY_CODE
    act = codes.get(launch.a_type)
    if act not in ACT_TYPES:
        raise ValueError(f"a_type = {launch.a_type} is not an activation type (f16 = 1, bf16 = 2)")
    scale = codes.get(launch.scale_type)
    if launch.c_type != launch.a_type or scale not in (act, ScalarType.FE4M3FN, ScalarType.FE8M0FNU):
        raise ValueError(f"c_type = {launch.c_type} must equal a_type = {launch.a_type} (16-bit activations) and "
                         f"scale_type = {launch.scale_type} must be a_type or a scale-byte type (fe4m3fn = "
                         f"{ScalarType.FE4M3FN.abi_code}, fe8m0fnu = {ScalarType.FE8M0FNU.abi_code})")
    weight = codes.get(launch.b_type)
    if weight not in GEMM_WEIGHT_TYPES:
        raise ValueError(f"b_type = {launch.b_type} is not a Marlin weight type "
                         f"({', '.join(f'{t} = {t.abi_code}' for t in GEMM_WEIGHT_TYPES)})")
    for name in ("a_scales",):
        if launch.pointer(name):
            raise ValueError(f"{name} is not supported with 16-bit activations (pass null)")
    global_scale = launch.pointer("global_scale")
    if global_scale % 4:
        raise ValueError(f"global_scale must be aligned to 4 bytes (address {global_scale:#x})")
    microscaled = checks.microscale_rule(weight, scale, act) is not None
    m, n, k, lda = launch.prob_m, launch.prob_n, launch.prob_k, launch.lda
    checks.check_sizes(m, n, k, weight)
    checks.check_row_stride(lda, k, "lda")
    flags = launch.flags
    has_zp = bool(flags & FLAG_HAS_ZERO_POINTS)
    if has_zp != bool(launch.pointer("zero_points")):
        raise ValueError(f"HAS_ZERO_POINTS flag = {has_zp} disagrees with zero_points = "
                         f"{launch.pointer('zero_points'):#x}")
    checks.check_zero_points(has_zp, weight)
    act_order = bool(flags & FLAG_HAS_ACT_ORDER)
    k_full = bool(flags & FLAG_IS_K_FULL)
    if act_order != bool(launch.pointer("group_index")) or act_order != bool(launch.pointer("permutation")):
        raise ValueError(f"HAS_ACT_ORDER flag = {act_order} needs group_index and permutation "
                         f"(got {launch.pointer('group_index'):#x}, {launch.pointer('permutation'):#x})")
    ng, gs = launch.num_groups, launch.group_size
    checks.check_act_order(weight, act_order, k_full, ng)
    expected_gs = checks.check_groups(weight, k, ng, act_order, k_full, microscaled=microscaled)
    checks.check_microscale(weight, scale, act, -1 if ng == 1 else gs, bool(global_scale), act_order, n)
    if ng == 1:  # (the record carries the group size beside the count: they must agree)
        if gs not in (-1, k):
            raise ValueError(f"group_size = {gs} with num_groups = 1 must be -1 (channelwise) or size_k = {k}")
    elif gs != expected_gs:
        raise ValueError(f"group_size = {gs} does not give num_groups = {ng} groups over size_k = {k} (expected "
                         f"{expected_gs}: size_k / group, or ceil(size_k / group) with a partial last group)")
    atomic = bool(flags & FLAG_USE_ATOMIC_ADD)
    invariant = bool(flags & FLAG_BATCH_INVARIANT)
    checks.check_reduction(atomic, bool(flags & FLAG_DETERMINISTIC), invariant)
    if compute_capability < 80:
        raise ValueError(f"the Marlin kernels need sm_80 or newer; device {launch.device} is sm_{compute_capability}")
    fp32_reduce = bool(flags & FLAG_USE_FP32_REDUCE) and not atomic
    checks.check_pointers({name: launch.pointer(name) for name in _POINTER_NAMES}, uses_c_tmp=fp32_reduce,
                          has_zero_points=has_zp, act_order=act_order)
    sms = launch.sms if launch.sms > 0 else device_sms
    if sms > device_sms:
        raise ValueError(f"sms = {sms} exceeds the device's {device_sms} SMs (blocks must all be resident)")
    per_row = act_order and not k_full
    group_size = -1 if ng == 1 else gs
    fp32_reduce = bool(flags & FLAG_USE_FP32_REDUCE) and not atomic
    if invariant:  # (one tile and one K partition for every M and sms: geometry.invariant_plan)
        cfg = choose_invariant_config(act, weight, max(m, 1), n, k, group_size, per_row, smem_limit,
                                      launch.thread_k_init, launch.thread_n_init, policy=policy)
        checks.check_pipeline_steps(pipeline_steps(cfg, max(m, 1), n, k))
        cfg = dataclasses.replace(cfg, e8m0_scales=scale is ScalarType.FE8M0FNU)
        cfg, launches = invariant_plan(cfg, max(m, 1), n, k, sms, device_sms, compute_capability, fp32_reduce,
                                       policy, smem_limit)
        return cfg, sms, launches[0][2]
    cfg = choose_config(act, weight, max(m, 1), n, k, group_size, per_row, smem_limit,
                        launch.thread_k_init, launch.thread_n_init, sm_smem=sm_smem, sms=sms,
                        pairs=pairs_possible(compute_capability, fp32_reduce, policy), policy=policy)
    checks.check_pipeline_steps(pipeline_steps(cfg, max(m, 1), n, k))
    grid = grid_blocks(cfg, max(m, 1), n, k, sms, policy=policy)
    cluster = cluster_blocks(cfg, max(m, 1), n, k, grid, compute_capability, fp32_reduce, policy=policy)
    # cluster_blocks decides (a pair choice comes back from choose_config with cluster = 2; kept only where it applies)
    return dataclasses.replace(cfg, cluster=cluster, e8m0_scales=scale is ScalarType.FE8M0FNU), sms, grid


_POINTER_NAMES = ("a", "b", "c", "c_tmp", "b_scales", "zero_points", "group_index", "permutation", "a_tmp",
                  "workspace")  # what gemm_checks.check_pointers reads
_POINTER_FIELDS = tuple(f for f, t in MarlinLaunch._fields_ if t is ctypes.c_void_p)
_SCALARS_OFFSET = MarlinLaunch.prob_m.offset  # the record's non-pointer tail: sizes, types, device, sms, flags

# The argument blocks below, as 'p' (64-bit address) / 'i' (int32) per kernel parameter.
KERNEL_ARG_KINDS = {"marlin_gemm": "ppppppppp" + "iiiiii" + "iiiiiiii", "permute_cols": "ppp" + "iii"}


def fast_div_plan(divisor: int) -> tuple[int, int]:
    """(magic, shift) for kernels_cuda/marlin_gemm.cu fast_div: n // divisor == (n * magic) >> shift for every
    0 <= n < 2**31, with shift = 31 + ceil(log2 divisor) and magic = ceil(2**shift / divisor) < 2**32, returned as
    the int32 with magic's bits (the kernel reads it back as unsigned)."""
    if not 1 <= divisor < 2**31:
        raise ValueError(f"fast_div_plan: divisor {divisor} is not in [1, 2**31)")
    shift = 31 + (divisor - 1).bit_length()
    magic = -(-(1 << shift) // divisor)
    return (magic - (1 << 32) if magic >= 1 << 31 else magic), shift


class PreparedLaunch:
    """One validated launch with everything but the addresses and the stream decided: kernel handle, grid, shared
    memory, scalar arguments, reduction mode. Built once per (shapes, dtypes, flags, device) from a record that
    passed ``check_launch``; ``launch`` then only checks the addresses (non-null where needed, 16-byte aligned) and
    launches: no allocation, no host synchronisation, no record.

    The kernel's arguments live in a workbench.cuda.ArgBlock reused by every call (a lock keeps two threads from
    interleaving fill and launch; the launch copies the block before it returns), launched through workbench.cuda's
    one launch call as a plain or (the policy's programmatic_launch, sm_90+) programmatic launch."""

    def __init__(self, launch: MarlinLaunch, cfg: KernelConfig, sms: int, grid: int,
                 policy: GemmPolicy | None = None):
        policy = self.policy = policy or _default()
        m, n, k = launch.prob_m, launch.prob_n, launch.prob_k
        flags = launch.flags
        self.device = launch.device
        self.cfg, self.sms, self.m, self.n, self.k = cfg, sms, m, n, k
        self.act_order = bool(flags & FLAG_HAS_ACT_ORDER)
        self.atomic = bool(flags & FLAG_USE_ATOMIC_ADD)
        self.uses_c_tmp = bool(flags & FLAG_USE_FP32_REDUCE) and not self.atomic
        self.has_zero_points = bool(flags & FLAG_HAS_ZERO_POINTS)
        # NVFP4: the kernel reads its fp32 global scale through the zero-point slot (it has no zero points)
        self.has_global_scale = bool(launch.global_scale)
        self.mode = REDUCE_ATOMIC if self.atomic else (REDUCE_FP32 if flags & FLAG_USE_FP32_REDUCE else REDUCE_IN_C)
        self.group_size = -1 if launch.num_groups == 1 else launch.group_size
        self.lda = launch.lda
        self.smem = cfg.smem_bytes
        self.c_bytes = m * n * 2  # the atomic mode sums into C: zeroed first
        self.grid = grid  # (final once the kernel's residency is known: set_grid)
        # batch-invariant plans of more rows than one launch takes: (first row, rows, grid) per launch
        self.pieces = ()
        if flags & FLAG_BATCH_INVARIANT and m > 0:
            cc, device_sms = kernels.device_properties(self.device)[:2]
            _, self.pieces = invariant_plan(cfg, m, n, k, sms, device_sms, cc, self.uses_c_tmp, policy)
            if len(self.pieces) == 1:
                self.pieces = ()
        self._lock = threading.Lock()
        self._kernel = None
        self._function = self._permute_function = 0
        if m > 0:
            kernels.get_kernel(cfg.name_expression, self.device, self.smem)
            resident = kernels.resident_blocks(cfg.name_expression, self.device)
            if resident < cfg.blocks_per_sm and flags & FLAG_BATCH_INVARIANT:  # (its grid is its partition)
                raise ValueError(f"batch_invariant: the driver keeps {resident} blocks of {cfg.name_expression} "
                                 f"per SM")
            if resident < cfg.blocks_per_sm:  # the driver keeps fewer blocks resident than planned: launch fewer
                self.grid = grid_blocks(cfg, m, n, k, sms, resident, policy=policy)
                if cfg.cluster > 1:  # (sm_90+ and fp32: the planned grid had clusters) the new grid's, if any
                    cfg = self.cfg = dataclasses.replace(
                        cfg, cluster=cluster_blocks(cfg, m, n, k, self.grid, 90, True, policy=policy))
            if cfg.cluster > 1 and self.grid // cfg.cluster > kernels.resident_clusters(cfg, self.device, self.grid):
                # clusters that do not all fit at once run in a second wave (the H200 keeps 30 clusters of 4 of a
                # one-block-per-SM kernel, not the 32 a 128-block grid needs: docs/performance.md, "The dense GEMM");
                # the same grid sums in global memory instead
                cfg = self.cfg = dataclasses.replace(cfg, cluster=1)
            self._kernel = kernels.get_kernel(cfg.name_expression, self.device, self.smem)
            self._function = kernels.function_ptr(cfg.name_expression, self.device, self.smem)
            if self.act_order:
                name = f"mwb::permute_cols<{'__half' if cfg.act is ScalarType.F16 else '__nv_bfloat16'}>"
                self._permute_function = kernels.function_ptr(name, self.device)
        # (9,) u64 addresses then (14,) i32 scalars: mwb::marlin_gemm's parameter list (KERNEL_ARG_KINDS, checked
        # against the source by tests/cpu)
        self._args = rt.ArgBlock(KERNEL_ARG_KINDS["marlin_gemm"])
        self._ptrs, self._ints, self._args_address = self._args.ptrs, self._args.ints, self._args.address
        self._ints[:] = self._kernel_ints()
        # every launch of a plan in pieces: (A's and C's byte offsets, its argument block, its launch), filled below
        self._piece_launches = []
        # permute_cols(A, perm, out, prob_m, prob_k, lda): (3,) u64 + (3,) i32
        self._perm_args = rt.ArgBlock(KERNEL_ARG_KINDS["permute_cols"])
        self._perm_args.ints[:] = (m, k, self.lda)
        self.launch_smem = self.smem  # what a programmatic launch asks for (pinned_smem)
        self.programmatic = m > 0 and kernels.programmatic_launches(self.device, policy.programmatic_launch)
        if self.programmatic and policy.programmatic_pin_occupancy:
            self.launch_smem = kernels.pin_occupancy_of(self._kernel, self.device, self.smem, cfg.blocks_per_sm)
        self._main = self._gather = None
        if m > 0:
            self._main = rt.Launch(self._function, self.grid, THREADS, self.launch_smem,
                                   programmatic=self.programmatic)
            self.programmatic = self.programmatic and self._main.supported  # (no driver bindings: plain)
            if self.act_order:  # (the gather before it stays a plain launch)
                self._gather = rt.Launch(self._permute_function, m, THREADS, 0)
            kernel_lda = k if self.act_order else self.lda
            for row0, rows, blocks in self.pieces:
                args = rt.ArgBlock(KERNEL_ARG_KINDS["marlin_gemm"])
                args.ints[:] = self._kernel_ints(rows, blocks)
                self._piece_launches.append((row0 * kernel_lda * 2, row0 * n * 2, args, rt.Launch(
                    self._function, blocks, THREADS, self.launch_smem, programmatic=self.programmatic)))

    def _kernel_ints(self, m: int | None = None, grid: int | None = None) -> list[int]:
        """The kernel's int32 arguments: problem, group size, reduction mode, then its division plan for this grid
        (the block ranges' steps per block, quotient and remainder, and fast_div_plan of the grid, of the k steps per
        slice and of the slices per m16 chunk). ``m`` / ``grid``: a launch of a plan in pieces (default: the plan's)."""
        cfg, n, k = self.cfg, self.n, self.k
        m = self.m if m is None else m
        grid = self.grid if grid is None else grid
        kernel_lda = k if self.act_order else self.lda  # act-order runs on the gathered M x K copy in a_tmp
        head = [m, n, k, kernel_lda, self.group_size, self.mode]
        if m == 0:  # (never launched)
            return head + [0] * 8
        # (the chunk-walking kernel: one 64-row chunk's plan, which every chunk runs in turn)
        steps = pipeline_steps(cfg, min(m, cfg.block_m) if cfg.walk else m, n, k)
        return head + [steps // grid, steps % grid, *fast_div_plan(grid),
                       *fast_div_plan(k_steps(k, cfg.block_k)), *fast_div_plan(tiled_n(n) // cfg.block_n)]

    def set_grid(self, blocks: int) -> None:
        """Launch ``blocks`` blocks instead of the planned grid (a forced grid: prepare_launch's ``grid``): the kernel's
        division plan and the programmatic launch's configuration, built for the planned grid, follow."""
        self.grid = int(blocks)
        if self.m > 0:
            self._ints[:] = self._kernel_ints()
            self._main.set_grid(self.grid)

    def launch(self, a: int, b: int, c: int, c_tmp: int, scales: int, zero_points: int, group_index: int,
               permutation: int, a_tmp: int, workspace: int, stream: int, global_scale: int = 0,
               bias: int = 0) -> None:
        """Launch on raw addresses (ints, 0 = none) and a raw stream handle; ValueError before launching if one is
        null where the plan needs it or not 16-byte aligned (``global_scale``: NVFP4's fp32, 4-byte aligned).
        ``bias``: the address of an (N,) activation-typed bias added before C's rounding (0: none; checked by the
        caller, e.g. gptq_marlin_gemm's ``bias=``)."""
        if self.has_global_scale:
            if not global_scale or global_scale % 4:
                raise ValueError(f"global_scale = {global_scale:#x}: this NVFP4 plan needs the address of one float32"
                                 " (non-null, 4-byte aligned)")
            zero_points = global_scale  # (the kernel's zero-point slot: marlin_gemm.cu gemm_block)
        if (a | b | c | c_tmp | scales | zero_points | group_index | permutation | a_tmp) & 15 or not (
                a and b and c and scales and workspace and (c_tmp or not self.uses_c_tmp)
                and (zero_points or not self.has_zero_points)
                and ((group_index and permutation and a_tmp) or not self.act_order)):
            self._refuse(dict(a=a, b=b, c=c, c_tmp=c_tmp, b_scales=scales, zero_points=zero_points,
                              group_index=group_index, permutation=permutation, a_tmp=a_tmp, workspace=workspace))
        if self.m == 0:
            return
        if not self.has_zero_points and not self.has_global_scale:
            zero_points = 0
        if not self.uses_c_tmp:
            c_tmp = 0
        if not self.act_order:
            group_index = 0
        cupy = rt_arrays.cupy()
        runtime = cupy.cuda.runtime
        if runtime.getDevice() != self.device:  # switch only when another device is current
            with cupy.cuda.Device(self.device):
                self._launch(a, b, c, c_tmp, scales, zero_points, group_index, permutation, a_tmp, workspace,
                             stream, runtime, bias)
        else:
            self._launch(a, b, c, c_tmp, scales, zero_points, group_index, permutation, a_tmp, workspace, stream,
                         runtime, bias)

    def _launch(self, a, b, c, c_tmp, scales, zero_points, group_index, permutation, a_tmp, workspace, stream,
                runtime, bias):
        if self.atomic:
            runtime.memsetAsync(c, 0, self.c_bytes, stream)
        launch = rt_launch.launch_kernel
        with self._lock:
            if self.act_order:
                pp = self._perm_args.ptrs
                pp[0], pp[1], pp[2] = a, permutation, a_tmp
                launch(self._gather, stream, self._perm_args.address)
                a = a_tmp
            if self._piece_launches:  # (one stream: the pieces share the scratch in order, each leaves it zero)
                for a_off, c_off, args, piece in self._piece_launches:
                    args.ptrs[:] = (a + a_off, b, c + c_off, c_tmp, scales, zero_points, group_index, workspace,
                                    bias)
                    launch(piece, stream, args.address)
                return
            p = self._ptrs
            p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8] = (a, b, c, c_tmp, scales, zero_points, group_index,
                                                                    workspace, bias)
            launch(self._main, stream, self._args_address)

    def _refuse(self, pointers: dict[str, int]) -> None:
        checks.check_pointers(pointers, uses_c_tmp=self.uses_c_tmp, has_zero_points=self.has_zero_points,
                              act_order=self.act_order)
        raise AssertionError("refused a launch without a reason")  # pragma: no cover - the checks above mirror it


MAX_PLANS = 4096  # cached plans per cache (a serving loop sees a few dozen shapes; the bound keeps a sweep finite)
_prepared: dict[tuple, PreparedLaunch] = {}


def _record_key(launch: MarlinLaunch) -> tuple:
    """Everything check_launch reads except addresses: the record's scalar tail and which pointers are null."""
    return (bytes(launch)[_SCALARS_OFFSET:],) + tuple(not getattr(launch, f) for f in _POINTER_FIELDS)


def prepare_launch(launch: MarlinLaunch, *, config: KernelConfig | None = None, grid: int | None = None,
                   policy: GemmPolicy | None = None) -> PreparedLaunch:
    """check_launch on the device's properties, then the prepared launch (cached per record layout and policy).

    ``config`` / ``grid`` force the kernel configuration and the number of blocks instead of choose_config /
    grid_blocks, to time or check a partition the policy would not choose (the alternatives a policy rule is
    measured against): checked by ``_prepare_forced``, never cached."""
    if not isinstance(launch, MarlinLaunch):
        raise TypeError(f"expected a MarlinLaunch record, got {type(launch).__name__}")
    policy = policy or _default()
    if config is not None or grid is not None:
        return _prepare_forced(launch, config, grid, policy)
    key = (_record_key(launch), policy)
    prepared = _prepared.get(key)
    if prepared is None:
        cc, device_sms, smem_limit, sm_smem = kernels.device_properties(launch.device)
        cfg, sms, grid = check_launch(launch, cc, device_sms, smem_limit, sm_smem, policy)
        prepared = PreparedLaunch(launch, cfg, sms, grid, policy)
        if len(_prepared) >= MAX_PLANS:
            _prepared.clear()
        _prepared[key] = prepared
    return prepared


def _prepare_forced(launch: MarlinLaunch, config: KernelConfig | None, grid: int | None,
                    policy: GemmPolicy) -> PreparedLaunch:
    """prepare_launch with a forced configuration and/or grid: every rule of check_launch, then ValueError unless the
    configuration is one the kernel computes this problem correctly with (same types and group mode, tile divides
    (K, N) and the group size, swap only for M <= 8, two blocks per SM only with 16-row tiles, shared
    memory fits)
    and every block of the grid can be resident (the in-C and fp32 reductions wait on other blocks; the scratch buffers
    hold sms x blocks_per_sm blocks)."""
    if launch.flags & FLAG_BATCH_INVARIANT:
        raise ValueError("batch_invariant fixes the configuration and the grid: config / grid cannot be forced")
    cc, device_sms, smem_limit, sm_smem = kernels.device_properties(launch.device)
    default, sms, _ = check_launch(launch, cc, device_sms, smem_limit, sm_smem, policy)
    cfg = default if config is None else config
    if not isinstance(cfg, KernelConfig):
        raise TypeError(f"config must be a KernelConfig, got {type(cfg).__name__}")
    m, n, k = max(launch.prob_m, 1), launch.prob_n, launch.prob_k
    if (cfg.act, cfg.weight, cfg.group_mode) != (default.act, default.weight, default.group_mode):
        raise ValueError(f"config (act, weight, group_mode) = ({cfg.act}, {cfg.weight}, {cfg.group_mode}) does not "
                         f"match the problem's ({default.act}, {default.weight}, {default.group_mode})")
    if (cfg.n_tiles, cfg.k_warp) not in THREAD_SHAPES or not 1 <= cfg.m_blocks <= 4:
        raise ValueError(f"config (m_blocks, n_tiles, k_warp) = ({cfg.m_blocks}, {cfg.n_tiles}, {cfg.k_warp}) is not a "
                         f"kernel shape (m_blocks 1..4, (n_tiles, k_warp) in {sorted(THREAD_SHAPES)})")
    group_size = -1 if launch.num_groups == 1 else launch.group_size
    k_fit = tile_k(k, -1 if cfg.group_mode != GROUP_GROUPED else group_size)
    if k_fit % cfg.block_k or tiled_n(n) % cfg.block_n:
        raise ValueError(f"config tile (thread_k, thread_n) = ({cfg.block_k}, {cfg.block_n}) does not divide "
                         f"(size_k, size_n) = ({k}, {n}) as planned: ({k_fit}, {tiled_n(n)}) (geometry.tile_k, "
                         f"tiled_n)")
    if cfg.group_mode == GROUP_GROUPED and group_size % cfg.block_k and cfg.block_k % group_size:
        raise ValueError(f"config thread_k = {cfg.block_k} and group_size = {group_size}: neither divides the other")
    if cfg.blocks_per_sm not in (1, 2) or (cfg.blocks_per_sm == 2 and cfg.m_blocks != 1):
        raise ValueError(f"config blocks_per_sm = {cfg.blocks_per_sm} with m_blocks = {cfg.m_blocks}: 1, or 2 with "
                         f"m_blocks = 1")
    if cfg.swap not in (0, 1):
        raise ValueError(f"config swap = {cfg.swap!r} is not 0 or 1 (the row layout or the swapped loop)")
    if cfg.swap and (cfg.m_blocks != 1 or m > 8):
        raise ValueError(f"config swap = {cfg.swap} needs m_blocks = 1 and size_m <= 8 (got {cfg.m_blocks}, {m})")
    limit = smem_limit if cfg.blocks_per_sm == 1 else two_block_smem(smem_limit, sm_smem)
    if cfg.smem_bytes > limit:
        raise ValueError(f"config needs {cfg.smem_bytes} bytes of shared memory; {cfg.blocks_per_sm} block(s) per SM "
                         f"leave {limit}")
    iterations = pipeline_steps(cfg, m, n, k)
    checks.check_pipeline_steps(iterations)
    if grid is None:
        grid = grid_blocks(cfg, m, n, k, sms, policy=policy)
    most = min(iterations, sms * cfg.blocks_per_sm)
    if isinstance(grid, bool) or not isinstance(grid, (int, np.integer)) or not 1 <= grid <= most:
        raise ValueError(f"grid = {grid!r} must be an int in [1, {most}] (min(pipeline steps = {iterations}, "
                         f"sms = {sms} x blocks_per_sm = {cfg.blocks_per_sm}))")
    fp32_reduce = bool(launch.flags & FLAG_USE_FP32_REDUCE) and not launch.flags & FLAG_USE_ATOMIC_ADD
    fits = cluster_blocks(cfg, m, n, k, int(grid), cc, fp32_reduce, enabled=True, sizes=KERNEL_CLUSTER_SIZES)
    if config is None:  # the default configuration: clusters where the policy would give this grid some
        cfg = dataclasses.replace(cfg, cluster=cluster_blocks(cfg, m, n, k, int(grid), cc, fp32_reduce,
                                                              policy=policy))
    elif cfg.cluster != 1 and cfg.cluster != fits:
        raise ValueError(f"config cluster = {cfg.cluster} needs sm_90+, the fp32 reduction, m_blocks = 1 and a grid of "
                         f"cluster x slices blocks with cluster in {KERNEL_CLUSTER_SIZES} and <= the slice's pipeline "
                         f"steps (got sm_{cc}, fp32 = {fp32_reduce}, m_blocks = {cfg.m_blocks}, grid = {grid}: cluster "
                         f"{fits} fits)")
    prepared = PreparedLaunch(launch, cfg, sms, int(grid), policy)
    if launch.prob_m > 0:
        resident = kernels.resident_blocks(cfg.name_expression, launch.device)
        if grid > sms * resident:
            raise ValueError(f"grid = {grid} blocks cannot all be resident: the driver keeps {resident} block(s) of "
                             f"{cfg.name_expression} per SM on {sms} SMs")
        prepared.set_grid(grid)  # (PreparedLaunch shrinks the planned grid when fewer blocks are resident)
    return prepared


def launch_marlin_mm(launch: MarlinLaunch) -> None:
    """Launch one GEMM described by a launch record (docs/formats.md, "Launch record"). Raises ValueError/TypeError
    before touching the GPU.

    The first record of a layout runs every check of ``check_launch``; later records with the same scalar fields and
    the same null pointers reuse that verdict and re-check only the addresses (``PreparedLaunch.launch``)."""
    prepared = prepare_launch(launch)
    ptr = launch.pointer
    prepared.launch(ptr("a"), ptr("b"), ptr("c"), ptr("c_tmp"), ptr("b_scales"), ptr("zero_points"),
                    ptr("group_index"), ptr("permutation"), ptr("a_tmp"), ptr("workspace"), ptr("stream"),
                    ptr("global_scale"), ptr("b_bias"))
