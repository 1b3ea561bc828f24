"""MoE expert stacks on the native Marlin GEMM: ``MarlinExpertStack``, ``fused_moe`` and the NumPy MoE reference.

A stack holds E experts' Marlin tiles for one matmul role (gate_up = w13, or down = w2) in one buffer with a
leading expert axis (``workbench.weight.MarlinWeight`` with ``num_experts``; docs/formats.md, "MoE expert stacks").
Three ways to run it:

* ``gemm_phase_batched(input, dispatches, output)`` — one dense Marlin GEMM per dispatch
  ``(expert, in_row_offset, out_row_offset, m)`` at the rows' and the expert's addresses (checked once per row
  count, see ``gemm.plan_marlin_gemm``), spread round-robin over a few CuPy streams (each with its own lock counters
  and partial-sum buffer), joined back to the caller's stream by events.
* ``gemm_phase_fused(input, sorted_token_ids, expert_ids, num_tokens_post_padded, output, prob_m,
  moe_block_size, top_k)`` — one launch of ``kernels_cuda/marlin_moe.cu``: every block of ``moe_block_size``
  routed rows reads its expert from ``expert_ids`` inside the kernel, gathers its A rows by sorted id, scatters
  its C rows, optionally scales them by the router weight; ``-1`` experts and sentinel rows are skipped.
* ``make_expert_linear(offset, n, bias)`` — one expert's column slice as a plain layer for the dense GEMM.

Formats: every integer and FP8 type of the dense GEMM, and the microscaled ones (``microscale``: NVFP4 with one fp32
global scale per expert, MXFP4, MXFP8; validated by the dense GEMM's ``MICROSCALE_RULES``), with optional per-expert
bias rows on the stack (``MarlinExpertStack(weight, bias=, global_scale=)``). ``gpt_oss`` builds gpt-oss's experts
(de-interleaved gate_up, biases, the clamped SwiGLU ``activation``) on top (docs/formats.md, "MoE FP4").

``fused_moe(hidden, w13, w2, topk_weights, topk_ids, path=..., activation=...)`` is an inference engine's MoE layer
on top: gate_up -> SiLU(gate) * up (or the clamped SwiGLU) -> down -> router-weighted sum over top_k.

``moe_reference`` is the NumPy spec of that layer (fp32 math on the exact dequantized weights, rounded to the
activation type where the kernels write activations) and ``moe_error_bound`` the per-element tolerance derived
from those roundings.

The package, by concept: ``reference`` (the NumPy spec), ``kernels`` (the elementwise and align kernels),
``config`` (the fused kernel's configuration), ``fused`` (one fused GEMM phase), ``stack`` (``MarlinExpertStack``)
and ``layer`` (``fused_moe`` and its plans). Every public name is importable from ``workbench.moe`` itself; the dense
GEMM is reached through ``workbench.gemm``'s public names only.

Arrays: CuPy arrays or PyTorch CUDA tensors (viewed as CuPy arrays through DLPack, without a copy).
Every output and every intermediate (workspace, partial sums, permuted or gathered activations) comes from the pool
of the framework the call's activations belong to: PyTorch's caching allocator for torch tensors, CuPy's pool
otherwise; when inputs are mixed, the activations' framework wins (``hidden`` for ``fused_moe``, ``input`` for the
stack's phases, the first array for the elementwise kernels).
"""
from __future__ import annotations

from workbench import gemm  # noqa: F401  (re-exported: moe.gemm is the dense GEMM the stacks run on)
from workbench.policy import DEFAULT_MOE_POLICY, MOE_GLOBALS, MoePolicy, install_deprecated_globals

# The policy of calls that pass none (config.default_policy reads it here; a deprecated module global rewrites it).
_default_policy: MoePolicy = DEFAULT_MOE_POLICY

from workbench.moe import activation, microscale  # noqa: E402,F401
from workbench.moe import config, fused, kernels, layer, reference, stack  # noqa: E402,F401
from workbench.moe import gpt_oss  # noqa: E402,F401
from workbench.moe.activation import Activation, activation_of  # noqa: E402,F401
from workbench.moe.gpt_oss import (GptOssExperts, deinterleave_gate_up, gate_up_permutation,  # noqa: E402,F401
                                   gpt_oss_expert_weights, route_topk_softmax)
from workbench.moe.microscale import (check_expert_global_scale, microscale_expert_stack,  # noqa: E402,F401
                                      random_microscale_experts, stack_format)
from workbench.moe.config import (MoeConfig, cached_moe_config, choose_block_size,  # noqa: E402,F401
                                  choose_moe_config, default_policy)
from workbench.moe.fused import UnsupportedError  # noqa: E402,F401
from workbench.moe.kernels import (ALIGN_MAX_EXPERTS, ALIGN_THREADS, MOE_KERNEL_SOURCE,  # noqa: E402,F401
                                   PLAN_ARG_KINDS, activation_and_mul, add_bias, gather_rows, get_moe_kernel,
                                   moe_align_block_size,
                                   moe_kernel_source, moe_sum, silu_and_mul)
from workbench.moe.layer import PATHS, fused_moe  # noqa: E402,F401
from workbench.moe.reference import UNIT_ROUNDOFF, moe_error_bound, moe_reference  # noqa: E402,F401
from workbench.moe.stack import (DEFAULT_STREAMS, ExpertLinear, MarlinExpertStack,  # noqa: E402,F401
                                 random_expert_stack, stack_marlin_weights)

_default = default_policy

install_deprecated_globals(__name__, MOE_GLOBALS, "workbench.policy.DEFAULT_MOE_POLICY")
