"""A probe kernel that runs ``dequant_subblock`` (kernels_cuda/dequant.cuh) on arrays of cases, for comparing the
kernel's registers with the NumPy mirror ``workbench.formats.register_dequant``: built offline in tests/compile,
run in tests/gpu."""
import re

from workbench import gemm

# Thread i dequantizes case i: words[kW i ..], the zero (or fixed bias) and the scale of both column halves, and
# writes b[h][r] to out[4 i + 2 h + r]. Offsets are built as WarpLoop::group_params builds them.
PROBE = r"""
using namespace mwb;
template <typename T, int W, bool SCALED>
__global__ void dequant_probe(const unsigned* words, const int* zeros, const unsigned short* scales, unsigned* out,
                              int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  using Pair = typename Act<T>::Pair;
  unsigned off[2][2], off16[2][2];
  Pair sc[2][2];
  for (int h = 0; h < 2; ++h) {
    const int z = zeros[2 * i + h];
    off[h][0] = off[h][1] = splat_bits(offset_bits<T, W>(z));
    off16[h][0] = off16[h][1] = splat_bits(neg_offset16_bits(z));
    sc[h][0] = sc[h][1] = as_pair<Pair>(splat_bits(scales[2 * i + h]));
  }
  unsigned b[2][2];
  dequant_subblock<T, W, SCALED>(words + Weight<W>::kWordsPerSubblock * i, off, off16, sc, b);
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < 2; ++r) out[4 * i + 2 * h + r] = b[h][r];
}
"""
_INCLUDE = re.compile(r'^\s*#include\s+"[^"]+"\s*$', re.M)
ACT_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}


def source() -> str:
    """mma.cuh and dequant.cuh inlined (no local includes left), then the probe."""
    text = "".join(_INCLUDE.sub("", (gemm.KERNEL_DIR / name).read_text()) for name in ("mma.cuh", "dequant.cuh"))
    return text.replace("#pragma once", "") + PROBE


def name_expression(act: str, abi_code: int, scaled: bool) -> str:
    return f"dequant_probe<{ACT_TYPES[act]}, {abi_code}, {'true' if scaled else 'false'}>"
