// MoE pieces around the Marlin GEMM (workbench/moe.py): the elementwise steps of an MoE layer.
//
//   silu_and_mul   h[r, j]  = rnd(silu(x[r, j]) * x[r, N + j])          gate = first N columns, up = last N
//   moe_sum        out[t, :] = rnd(sum_j w[t, j] * y[row(t, j), :])      the router-weighted sum over top_k
//   gather_rows    out[i, :] = x[rows[i], :]                             rows grouped by expert (batched path)
//   add_bias       y[r, :]   = rnd(y[r, :] + bias)                       bias of a single-expert view
//
// All math in fp32, one rounding to the activation type at the end (workbench.moe.moe_reference rounds there too).
#include "mma.cuh"

namespace mwb {

template <typename T> __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T>
__global__ void silu_and_mul(const T* __restrict__ x,  // (rows, 2n)
                             T* __restrict__ out,      // (rows, n)
                             int rows, int n) {
  const long long total = static_cast<long long>(rows) * n;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long r = i / n, j = i % n;
    const float g = to_f32(x[r * 2 * n + j]);
    const float u = to_f32(x[r * 2 * n + n + j]);
    out[i] = from_f32<T>(g / (1.f + expf(-g)) * u);
  }
}

template <typename T>
__global__ void moe_sum(const T* __restrict__ y,            // (y_rows, k)
                        const float* __restrict__ weights,  // (m * top_k,) or null (weight 1)
                        const int* __restrict__ row_of,     // (m * top_k,) row of y per entry, -1 = none; or null
                        T* __restrict__ out,                // (m, k)
                        int m, int top_k, int k, int y_rows) {
  const long long total = static_cast<long long>(m) * k;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long t = i / k, c = i % k;
    float acc = 0.f;
    for (int j = 0; j < top_k; ++j) {
      const long long entry = t * top_k + j;
      const long long row = row_of ? row_of[entry] : entry;
      if (row < 0 || row >= y_rows) continue;
      const float w = weights ? weights[entry] : 1.f;
      acc += w * to_f32(y[row * k + c]);
    }
    out[i] = from_f32<T>(acc);
  }
}

// 16-byte chunks: rows are K % 8 == 0 activation values long.
__global__ void gather_rows(const int4* __restrict__ x, const int* __restrict__ rows, int4* __restrict__ out, int n,
                            int chunks_per_row, int x_rows) {
  const long long total = static_cast<long long>(n) * chunks_per_row;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long r = i / chunks_per_row, c = i % chunks_per_row;
    const int src = rows[r];
    out[i] = (src >= 0 && src < x_rows) ? x[static_cast<long long>(src) * chunks_per_row + c] : make_int4(0, 0, 0, 0);
  }
}

template <typename T>
__global__ void add_bias(T* __restrict__ y, const T* __restrict__ bias, int rows, int n) {
  const long long total = static_cast<long long>(rows) * n;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    y[i] = from_f32<T>(to_f32(y[i]) + to_f32(bias[i % n]));
  }
}

}  // namespace mwb
