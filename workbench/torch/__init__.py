"""The PyTorch surface: ``torch.ops.workbench.*`` custom ops with vLLM's names and arguments, and drop-in modules.

Importing this package registers the ops (``workbench.torch.ops``); ``import workbench`` alone never imports torch.
See docs/torch.md for the op list, the vLLM commit they mirror, and what is not implemented yet.
"""
from workbench.torch import ops
from workbench.torch.ops import (allocate_align_buffers, awq_marlin_repack, awq_to_marlin_zero_points,
                                 gptq_marlin_gemm, gptq_marlin_repack, make_workspace, marlin_gemm,
                                 marlin_permute_scales, marlin_to_awq_qweight, marlin_to_gptq_qweight,
                                 marlin_unpermute_scales, marlin_zero_points, moe_align_block_size,
                                 moe_wna16_marlin_gemm)
from workbench.torch.modules import MarlinLinear, MarlinMoE, ReplaceReport, quantizable, replace_linears
from workbench.torch.scalar_ids import as_type_id, from_vllm_id, vllm_id

__all__ = ["ops", "allocate_align_buffers", "awq_marlin_repack", "awq_to_marlin_zero_points", "gptq_marlin_gemm",
           "gptq_marlin_repack", "make_workspace", "marlin_gemm", "marlin_permute_scales", "marlin_to_awq_qweight",
           "marlin_to_gptq_qweight", "marlin_unpermute_scales", "marlin_zero_points", "moe_align_block_size",
           "moe_wna16_marlin_gemm", "MarlinLinear", "MarlinMoE", "ReplaceReport",
           "quantizable", "replace_linears", "as_type_id", "from_vllm_id", "vllm_id"]
