// Tensor-core and asynchronous-copy primitives shared by the Marlin GEMM kernels (dense and, later, MoE).
//
// Everything here is a thin, named wrapper around one PTX instruction, so that kernels read as
// "fetch -> ldmatrix -> dequant -> mma" instead of inline assembly. PTX ISA sections are named beside each.
// Build only for sm_80 and newer: cp.async, ldmatrix and bf16 mma.sync do not exist below that.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "kernels_cuda needs sm_80 or newer (cp.async, ldmatrix, bf16 mma.sync)"
#endif

namespace mwb {

// ---- activation-type traits ---------------------------------------------------------------------------
// T is the activation (= output) scalar type; Pair is the two-element vector that one 32-bit mma operand
// register holds.
template <typename T> struct Act;

template <> struct Act<__half> {
  using Pair = __half2;
  static constexpr bool kIsBf16 = false;
  __device__ __forceinline__ static Pair from_floats(float lo, float hi) { return __floats2half2_rn(lo, hi); }
  __device__ __forceinline__ static float2 to_floats(Pair p) { return __half22float2(p); }
  __device__ __forceinline__ static Pair pair(__half lo, __half hi) { return __halves2half2(lo, hi); }
};

template <> struct Act<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  static constexpr bool kIsBf16 = true;
  __device__ __forceinline__ static Pair from_floats(float lo, float hi) { return __floats2bfloat162_rn(lo, hi); }
  __device__ __forceinline__ static float2 to_floats(Pair p) { return __bfloat1622float2(p); }
  __device__ __forceinline__ static Pair pair(__nv_bfloat16 lo, __nv_bfloat16 hi) { return __halves2bfloat162(lo, hi); }
};

// Reinterpret a 32-bit register as a pair and back (no conversion).
template <typename P> __device__ __forceinline__ unsigned as_u32(P p) { return *reinterpret_cast<unsigned*>(&p); }
template <typename P> __device__ __forceinline__ P as_pair(unsigned u) { return *reinterpret_cast<P*>(&u); }

// ---- mma.sync.m16n8k16 (PTX ISA "Warp-level matrix multiply-accumulate", fragment layouts for .m16n8k16) ----
// A (16x16, row-major) is four .b32 registers, B (16x8, "col") two, C/D (16x8 fp32) four floats.
// Lane l owns: A rows l/4 and l/4+8, k pairs 2(l%4)+{0,1} and +8; B column l/4, k rows 2(l%4)+{0,1} (b[0]) and
// 2(l%4)+8+{0,1} (b[1]); C row l/4 (c[0], c[1]) and l/4+8 (c[2], c[3]), columns 2(l%4)+{0,1}.
template <bool kBf16>
__device__ __forceinline__ void mma_m16n8k16(const unsigned (&a)[4], const unsigned (&b)[2], float (&c)[4]) {
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// ldmatrix.x4: the four 8x8 b16 matrices whose row addresses lanes 0-7, 8-15, 16-23, 24-31 supply, one register
// each. With lane l pointing at row l%16, column block l/16 of a 16x16 A tile, the registers come out in exactly
// the mma A-fragment order (PTX ISA "ldmatrix").
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem_row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// ldmatrix.x2: two 8x8 b16 matrices whose row addresses lanes 0-7 and 8-15 supply (lanes 16-31: ignored, any
// valid address). With lane l pointing at row l%8, column block (l/8)%2 of an 8x16 A tile, the registers are the
// mma B fragment of that tile's transpose (PTX ISA "ldmatrix").
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* smem_row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// ---- cp.async (PTX ISA "cp.async") --------------------------------------------------------------------
// 16-byte global->shared copy that bypasses L1 (.cg). When `valid` is false the source size is 0, so nothing is
// read and the 16 shared bytes are zero-filled: rows past M cost no memory traffic and need no branch.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid = true) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem), "r"(src_bytes));
}

// The same copy with an L2 evict-first policy: weights are streamed exactly once per launch, so they should not
// push activations and partial sums out of L2 (PTX ISA "createpolicy").
__device__ __forceinline__ void cp_async16_stream(void* smem, const void* gmem, unsigned long long policy) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem),
               "l"(policy));
}

__device__ __forceinline__ unsigned long long evict_first_policy() {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// ---- inter-block signalling for the lock-ordered reduction ---------------------------------------------
__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.global.acquire.gpu.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release(int* p, int v) {
  asm volatile("st.global.release.gpu.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

}  // namespace mwb
