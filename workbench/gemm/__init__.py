"""Native Marlin GEMM (``kernels_cuda/marlin_gemm.cu``), compiled at first use (workbench.cuda).

Three entry points, each one layer on top of the next:

* ``launch_marlin_mm(record)`` — the launch-record ABI (docs/formats.md, "Launch record"): a ``MarlinLaunch`` record
  of raw device pointers (``workbench.gemm_abi``). Checks everything a record can say (types, flags, sizes,
  alignment) and launches. No allocation and no host synchronisation: capturable in a CUDA graph.
* ``gptq_marlin_gemm(a, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type, size_m, size_n, size_k,
  ...)`` — vLLM's op and argument order, on CuPy arrays, torch CUDA tensors or ``__cuda_array_interface__`` arrays.
  Checks every shape, dtype and device rule (docs/formats.md, "Host checks") before building the record.
* ``marlin_gemm(a, weight)`` — the convenience form over a ``MarlinWeight`` whose arrays are on the GPU
  (``upload_weight``).

Scratch buffers (all int32/fp32 on the GPU): ``workspace`` (≥ ``sms`` lock counters, zero, left zero by every
launch), ``c_tmp`` (fp32 partial sums, ≥ ``c_tmp_numel(sms)``), ``a_tmp`` (act-order activations, ≥ M·K).

Residency: in the fp32 (default) and in-C reductions a block may wait for another block's count, so every block of
a launch must be able to become resident. The grid never exceeds ``sms`` × the blocks per SM the driver reports,
and in practice a GPU dispatches all of a grid's blocks before a later grid's (not a documented guarantee; the
lock-ordered reduction of the public Marlin kernel relies on the same), so kernels on other streams delay a launch
without starving it; where SMs are partitioned (MPS limits, green contexts), pass ``sms`` no larger than the
partition.
Atomic-add mode never waits; nor do the thread-block cluster sums (sm_90+, fp32 reduction, slices split over two
blocks: ``cluster_blocks``), where a slice's blocks are one cluster the hardware schedules together.

The package, by concept (each imports only those above it):

* ``geometry``: tile shapes, shared memory, config choice, grids, clusters, scratch sizes (pure);
* ``checks``: every rule with its one message, and the array checks built on them (pure);
* ``kernels``: compiling the kernels and what the driver says about them (residency, programmatic launches);
* ``launch``: the launch record's adapter and the prepared launches (one per record layout and policy);
* ``api``: ``gptq_marlin_gemm``, ``marlin_gemm``, ``plan_marlin_gemm``, ``upload_weight``, scratch buffers.

Every public name of those modules is importable from ``workbench.gemm`` itself.
"""
from __future__ import annotations

from workbench.policy import DEFAULT_GEMM_POLICY, GEMM_GLOBALS, GemmPolicy, install_deprecated_globals
from workbench.scalar_types import ScalarType  # noqa: F401

# The policy of calls that pass none (geometry.default_policy reads it here; a deprecated module global rewrites it).
_default_policy: GemmPolicy = DEFAULT_GEMM_POLICY

from workbench.gemm import geometry, checks, kernels, launch, api  # noqa: E402  (they read _default_policy)
from workbench.gemm.api import (UNIT_ROUNDOFF, error_bound_factor, gptq_marlin_gemm, marlin_gemm,  # noqa: E402
                                plan_marlin_gemm, scratch_buffers, upload_weight)
from workbench.gemm.checks import (A_CHUNK, GROUP_SIZES, TILE_K, TILE_N, GemmPlan, act_numpy_dtype,  # noqa: E402
                                   act_scalar_type, check_bias, check_gemm_shapes, check_groups, check_size_k,
                                   group_size_of,
                                   padded_shape)
from workbench.gemm.geometry import (GROUP_CHANNELWISE, GROUP_GROUPED, GROUP_PER_ROW,  # noqa: E402
                                     KERNEL_CLUSTER_SIZES, MAX_BLOCK_M, MAX_BLOCK_N, MAX_BLOCKS_PER_SM, REDUCE_ATOMIC,
                                     REDUCE_FP32, REDUCE_IN_C, RESERVED_SMEM_PER_BLOCK, SMEM_RESERVED_PER_BLOCK,
                                     THREAD_SHAPES, THREADS, KernelConfig, TileGeometry, c_tmp_numel, choose_config,
                                     cluster_blocks, default_policy, grid_blocks, k_steps, pairs_possible,
                                     pipeline_steps, swap_halves, thread_shapes, tile_k, tiled_n, two_block_smem,
                                     workspace_numel)
from workbench.gemm.kernels import (KERNEL_DIR, KERNEL_SOURCE, config_for, device_properties,  # noqa: E402
                                    function_ptr, get_kernel, kernel_source, pin_occupancy_of, pinned_smem,
                                    precompile, programmatic_launches, resident_blocks, resident_clusters)
from workbench.gemm.launch import (KERNEL_ARG_KINDS, PreparedLaunch, check_launch, fast_div_plan,  # noqa: E402
                                   launch_marlin_mm, prepare_launch)
from workbench.gemm_abi import (ABI_VERSION, ACT_TYPES, FLAG_DETERMINISTIC, FLAG_HAS_ACT_ORDER,  # noqa: E402,F401
                                FLAG_HAS_ZERO_POINTS, FLAG_IS_K_FULL, FLAG_USE_ATOMIC_ADD, FLAG_USE_FP32_REDUCE,
                                GEMM_WEIGHT_TYPES, KNOWN_FLAGS, MarlinLaunch, MarlinMmBuffers, MarlinMmExecution,
                                MarlinMmProblem, MarlinMmRequest)

_default = default_policy

install_deprecated_globals(__name__, GEMM_GLOBALS, "workbench.policy.DEFAULT_GEMM_POLICY")
