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

// Barrier `id` (1..15; 0 is __syncthreads') of `threads` threads, whole warps (PTX bar.sync: memory ordering among
// the participating threads, as __syncthreads among all).
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// threadIdx.x read once through volatile asm: values derived from it (a lane's shared offsets) are then kept in
// registers across the main loop; from the plain threadIdx.x, NVVM re-derived them inside the loop every stage.
__device__ __forceinline__ int pinned_thread_index() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t;
}

// ---- shared memory through 32-bit addresses (PTX state space .shared) --------------------------------------
// The main loop keeps its stage slots as 32-bit shared addresses formed once (smem_addr) and adds compile-time
// offsets, instead of converting generic pointers every stage (each conversion re-reads the shared window base).
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// cp.async (PTX ISA "cp.async"): 16-byte global->shared copy that bypasses L1 (.cg). When `valid` is false the
// source size is 0, so nothing is read and the 16 shared bytes are zero-filled: rows past M cost no memory traffic
// and need no branch. (No variant with an L2 cache-policy hint: with one, ptxas 13.0 emitted LDGSTS [R+UR],
// desc[UR odd] for some instantiations, which the H200 rejects as an illegal instruction; docs/performance.md,
// "The dense GEMM", copies without an L2 cache hint.)
__device__ __forceinline__ void cp_async16_at(unsigned smem, const void* gmem, bool valid = true) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(src_bytes));
}

// ldmatrix.x4: the four 8x8 b16 matrices whose row addresses lanes 0-7, 8-15, 16-23, 24-31 supply, one register
// each. With lane l pointing at row l%16, column block l/16 of a 16x16 A tile, the registers come out in exactly
// the mma A-fragment order (PTX ISA "ldmatrix").
__device__ __forceinline__ void ldmatrix_x4_at(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// ldmatrix.x2: two 8x8 b16 matrices whose row addresses lanes 0-7 and 8-15 supply (lanes 16-31: ignored, any
// valid address). With lane l pointing at row l%8, column block (l/8)%2 of an 8x16 A tile, the registers are the
// mma B fragment of that tile's transpose (PTX ISA "ldmatrix").
__device__ __forceinline__ void ldmatrix_x2_at(unsigned (&r)[2], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

__device__ __forceinline__ int4 lds128(unsigned addr) {
  int4 v;
  asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

__device__ __forceinline__ unsigned lds32(unsigned addr) {
  unsigned v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}

// A zero that ptxas cannot prove warp-uniform: this thread's own shared word, written and read back. Fetch slot
// offsets carried from it stay in per-thread registers. Why: when a warp-uniform slot value reached a cache-hinted
// cp.async address, ptxas 13.0 split the address into register + uniform register beside the policy descriptor
// (LDGSTS [R+UR], desc[UR odd]), an encoding the H200 rejects (docs/performance.md, "The dense GEMM").
__device__ __forceinline__ unsigned opaque_zero(unsigned own_word) {
  unsigned z;
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(own_word), "r"(0u) : "memory");
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(z) : "r"(own_word) : "memory");
  return z;
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

// Adds v at gpu scope with release semantics, no value returned. sm_90 SASS: MEMBAR.ALL.GPU + REDG, where
// __threadfence() + atomicAdd is MEMBAR.SC.GPU + CCTL.IVALL + ATOMG (a sequentially consistent fence, L1 dropped).
__device__ __forceinline__ void red_add_release(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// ---- thread-block clusters (sm_90): a cluster's blocks read each other's shared memory ---------------------
// (PTX ISA "mapa", "ld.shared::cluster", "barrier.cluster"). Only the cluster kernels use these, and the host launches
// those only on sm_90 and newer; the sm_80 bodies are never reached.
__device__ __forceinline__ unsigned cluster_ctarank() {
  unsigned r = 0;
#if __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
  return r;
}

// The shared::cluster address of the same shared variable in the cluster's block `rank`.
__device__ __forceinline__ unsigned cluster_map(unsigned smem, unsigned rank) {
  unsigned out = smem;
#if __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(smem), "r"(rank));
#endif
  return out;
}

__device__ __forceinline__ float4 ld_cluster_f4(unsigned addr) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
#endif
  return v;
}

__device__ __forceinline__ float4 ld_shared_f4(unsigned addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

__device__ __forceinline__ void sts128_f32(unsigned addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// Every thread of every block of the cluster: shared-memory writes before it are visible to reads after it in any
// block of the cluster (release / acquire at cluster scope). A block-wide barrier too.
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
  __syncthreads();
#endif
}

// ---- programmatic dependent launch (sm_90; PTX ISA "griddepcontrol") --------------------------------------------
// A grid launched with programmatic stream serialization (GemmPolicy.programmatic_launch) may start while the
// grid before it in the stream still runs. grid_dependency_wait() returns once that grid has completed and its writes
// are visible; a kernel reads nothing the grid before may write, and writes nothing, before it. Without the launch
// attribute (and on sm_80) it returns at once. allow_dependent_launch(): the grid after this one may be scheduled
// once every block of this one has called it (or exited); it only lets that grid's blocks take SM space as ours
// retire: they still wait for our completion at their own grid_dependency_wait().
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
inline constexpr bool kProgrammaticLaunch = true;  // the device code can be launched programmatically
#else
inline constexpr bool kProgrammaticLaunch = false;
#endif

__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace mwb
