"""Numba-CUDA ports of every Marlin repack, scale and zero-point transform (same source: GPU and CUDA simulator).

Each host wrapper takes the positional arguments of its ``workbench.ops`` op plus ``stream=``, checks shapes before
any launch, and returns NumPy for NumPy input or a device array (CuPy, else Numba) for device input. Every kernel
accepts a leading expert axis, so a stack of experts is one launch.

* ``marlin_repack`` — GPTQ (4/8-bit, act-order perm), AWQ, FP8 raw bits, block-FP8 row-major → Marlin, and back
* ``scales``        — scale permutations (P64/P32), zero points (codes, AWQ, GPTQ v1 with the code-15 error),
                      block-FP8 scales (×2^8 → f16 / ×2^120 → bf16), and their inverses
* ``moe``           — the stacked-experts loader (one launch per tensor for device stacks; one-expert staging
                      for host inputs)
* ``float_bits``    — float32 → f16/bf16 rounding in integer arithmetic (bit-identical in both worlds)
* ``_launch``       — device-array, stream and poison plumbing shared by the wrappers, and the launch of every
                      kernel through the project's runtime (``workbench.cuda``) on a GPU; call plans of the ops
* ``teaching_gemm`` — a short, readable Marlin GEMM (u4b8 / u8b128) for notebook 08: the mma step emulated per
                      lane through shared memory; not dispatched by any op

``workbench.backends.dispatch`` maps op names to these wrappers (``backend="numba"`` / ``"auto"``).
"""
