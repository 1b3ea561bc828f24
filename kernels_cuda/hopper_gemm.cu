// The Hopper (sm_90a) dense GEMM: C = A @ dequant(B) computed transposed, C^T = W^T A^T, so that the dequantized
// weight is the register-sourced A operand of wgmma.mma_async (m64 x n x k16: A from registers, B = the activations
// from 128-byte-swizzled shared memory, fp32 accumulators).
//
// Why the Marlin tile serves unchanged: a warpgroup's register A fragment of m64k16 is four warps each holding an
// m16k16 fragment laid out like mma.sync's m16n8k16 A fragment. For one 16(k) x 16(n) sub-block s of a Marlin tile, a
// lane's dequantized B registers b[h][r] (dequant.cuh: column n0 + 8h, rows k0 + 8r) are exactly that fragment of the
// sub-block's transpose in the order {b[0][0], b[1][0], b[0][1], b[1][1]} (rows n0, n0 + 8; columns k0, k0 + 8). A
// lane's 16 bytes of a tile hold all four sub-blocks, so warp w of a warpgroup takes tile w of four consecutive tiles
// (one conflict-free 16-byte shared read per k16 step) and wgmma s multiplies sub-block s of each warp's tile:
// wgmma row 16 w + i is problem column 64 w + 16 s + i.
//
// One block = two warpgroups (256 threads), 256 problem columns (4 Marlin tiles) x BM rows of A. All threads fetch a
// stage (cp.async, STAGE_K = 64 or 128 k: STAGE_K / 16 k16 rows of weights, the group rows of scales they span, BM
// rows of A written with the 128-byte swizzle the wgmma descriptor names); STAGES slots, refilled two stages after
// their use so that the one wgmma group a warpgroup leaves in flight never reads a slot being overwritten. The two warpgroups split the block's work:
//   SPLIT_M = false: both take all BM rows, warpgroup g the k16 steps g and g + 2 of each stage (their sums are folded
//                    through shared memory at the end);
//   SPLIT_M = true:  warpgroup g takes rows g BM/2 .. of every k16 step (each dequantizes the stage's weights).
// Scales multiply the weight before the MMA (grouped scales, groups of >= 64 rows: at most two rows per stage), so the
// numerics are those of the mma.sync kernel's grouped path: fp16 weight = round((code - 8) x scale), fp32 sums.
// Epilogue: accumulators -> shared fp32 tile [BM][256] -> 16-byte rows of C; with split-K over blocks (gridDim.z > 1)
// every block writes its fp32 partial, and the last block of a tile (a counter, reset by that block) sums them in
// split order, so results do not depend on which block finishes last.
#pragma once

#include "dequant.cuh"

namespace mwb {
namespace hopper {

constexpr int kThreads = 256;  // two warpgroups
constexpr int kBlockN = 256;   // problem columns per block: four 64-column Marlin tiles
constexpr int kAtomK = 64;     // k of one 128-byte swizzle row of 16-bit activations

// STAGE_K: k per stage, 64 or 128 (one or two swizzle atoms of A side by side: atom j holds k 64 j .. 64 j + 63 of
// the stage's BM rows); a longer stage spreads the stage's barrier and fetch issue over more wgmma.
template <typename T, int W, int BM, bool SPLIT_M, int STAGES, int STAGE_K>
struct Tile {
  static_assert(Weight<W>::kBits == 4, "this stage of the family reads 4-bit weights");
  static_assert(STAGES >= 3, "slots are refilled two stages after their use");
  static_assert(STAGE_K == 64 || STAGE_K == 128, "stages of one or two swizzle atoms");
  static constexpr int WN = SPLIT_M ? BM / 2 : BM;  // wgmma n: rows of A per warpgroup
  static_assert(WN == 32 || WN == 64, "wgmma n of 32 or 64 (accumulators: 2 WN floats a thread)");
  static constexpr int kSteps = STAGE_K / 16;               // k16 steps per stage
  static constexpr int kAtoms = STAGE_K / kAtomK;
  static constexpr int kAtomBytes = BM * 128;               // BM rows x 64 k, 128-byte swizzled
  static constexpr int kABytes = kAtoms * kAtomBytes;
  static constexpr int kBBytes = kSteps * 4 * 512;          // kSteps k16 rows of four 512-byte tiles
  static constexpr int kSBytes = 1024;  // up to two group rows (512 bytes each; groups >= 64), slots stay aligned
  static constexpr int kAOff = 0, kBOff = kABytes, kSOff = kABytes + kBBytes;
  static constexpr int kStageBytes = kABytes + kBBytes + kSBytes;  // a multiple of 1024 (the swizzle's period)
  static constexpr int kRedStride = kBlockN + 4;  // floats per row of the epilogue tile (+4: conflict-free stores)
  static constexpr int kRedBytes = BM * kRedStride * 4;
  static constexpr int kBodyBytes = STAGES * kStageBytes > kRedBytes ? STAGES * kStageBytes : kRedBytes;
  static constexpr int kSmemBytes = kBodyBytes + 1024;  // + slack to align the base to 1024 bytes
};

// ---- wgmma (PTX ISA "Asynchronous Warpgroup Level Matrix Multiply-Accumulate") ------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy writes to shared memory (cp.async, st.shared) made visible to the async proxy that wgmma reads
// its shared operands through.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle: start address >> 4 (bits 0-13),
// leading byte offset (unused for a swizzled K-major tile whose k extent fits the 128-byte row; 1 by convention,
// bits 16-29), stride byte offset 1024 >> 4 between 8-row groups (bits 32-45), base offset 0 (the tile is
// 1024-aligned), layout 1 = 128-byte swizzle (bits 62-63). A k16 step inside the row adds 32 bytes to the start.
__device__ __forceinline__ unsigned long long sw128_desc(unsigned smem) {
  return static_cast<unsigned long long>((smem & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

template <bool kBf16, int N> struct Wgmma;

#define MWB_WGMMA_TYPE(BF) BF ? "bf16.bf16" : "f16.f16"

template <bool kBf16>
struct Wgmma<kBf16, 32> {
  __device__ __forceinline__ static void mma(float (&d)[16], const unsigned (&a)[4], unsigned long long desc) {
    if constexpr (kBf16) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
          "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
            "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
    } else {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
          "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
            "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
    }
  }
};

#define MWB_D64                                                                                                     \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),       \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),      \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define MWB_N64_OPERANDS                                                                                           \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29," \
  "%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"

template <bool kBf16>
struct Wgmma<kBf16, 64> {
  __device__ __forceinline__ static void mma(float (&d)[32], const unsigned (&a)[4], unsigned long long desc) {
    if constexpr (kBf16) {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " MWB_N64_OPERANDS
                   : MWB_D64
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
    } else {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " MWB_N64_OPERANDS
                   : MWB_D64
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1));
    }
  }
};
#undef MWB_D64
#undef MWB_N64_OPERANDS
#undef MWB_WGMMA_TYPE

#define MWB_HOPPER_PARAMS                                                                                         \
  const int4 *__restrict__ A, const int4 *__restrict__ B, T *__restrict__ C, float *__restrict__ partial,         \
      int *__restrict__ counters, const int4 *__restrict__ scales, int prob_m, int prob_n, int prob_k, int lda, int group_size

// Grid: (prob_n / 256 column blocks, ceil(prob_m / BM) row tiles, splits of K). partial: splits x BM x 256 fp32 per
// (row tile, column block) when splits > 1; counters: one int per (row tile, column block), zero between calls.
// lda: A's row stride in elements (a multiple of 8).
template <typename T, int W, int BM, bool SPLIT_M, int STAGES, int STAGE_K>
__global__ void __launch_bounds__(kThreads, 1) hopper_gemm(MWB_HOPPER_PARAMS) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using G = Tile<T, W, BM, SPLIT_M, STAGES, STAGE_K>;
  constexpr int kSteps = G::kSteps;
  using Pair = typename Act<T>::Pair;
  constexpr int WN = G::WN;
  extern __shared__ int4 smem_raw[];
  const unsigned raw_base = smem_addr(smem_raw);
  const unsigned base = (raw_base + 1023u) & ~1023u;  // the swizzle repeats every 1024 bytes of address
  float* red = reinterpret_cast<float*>(reinterpret_cast<char*>(smem_raw) + (base - raw_base));

  const int tid = pinned_thread_index();
  const int lane = tid % 32;
  const int wg = tid / 128;       // warpgroup
  const int wl = (tid / 32) % 4;  // warp in its warpgroup: the Marlin tile it dequantizes
  const int nb = blockIdx.x, mt = blockIdx.y, z = blockIdx.z, splits = gridDim.z;
  const int m0 = mt * BM;
  const int n_tiles = prob_n / 64;
  const int total_stages = prob_k / STAGE_K;
  const int scale_rows = STAGE_K > group_size ? STAGE_K / group_size : 1;  // group rows a stage spans (1 or 2)
  const int st_begin = static_cast<int>(static_cast<long long>(z) * total_stages / splits);
  const int st_end = static_cast<int>(static_cast<long long>(z + 1) * total_stages / splits);
  const int n_st = st_end - st_begin;

  // ---- fetch of stage st (global) into slot (shared address) ----
  auto fetch = [&](int st, unsigned slot) {
    // weights: kSteps k16 rows x four tiles x 32 int4, contiguous per k16 row in global memory
#pragma unroll
    for (int n = 0; n < kSteps * 128 / kThreads; ++n) {
      const int i = tid + n * kThreads;
      const int r = i / 128, within = i % 128;
      const int4* src = B + (static_cast<long long>(st * kSteps + r) * n_tiles + nb * 4) * 32 + within;
      cp_async16_at(slot + G::kBOff + 16 * i, src);
    }
    // scales: the stage's group rows, this block's 256 columns (32 int4 a row)
    if (tid < 32 * scale_rows) {
      const int g = st * STAGE_K / group_size + tid / 32;
      cp_async16_at(slot + G::kSOff + 16 * tid,
                    scales + (static_cast<long long>(g) * prob_n + nb * kBlockN) / 8 + tid % 32);
    }
    // activations: per atom, BM rows x 8 chunks of 16 bytes; chunk c of row r at c ^ (r % 8) (the 128-byte swizzle)
#pragma unroll
    for (int n = 0; n < G::kAtoms * BM * 8 / kThreads; ++n) {
      const int i = tid + n * kThreads;
      const int atom = i / (BM * 8), r = (i / 8) % BM, c = i % 8;
      const int row = m0 + r;
      const bool valid = row < prob_m;
      const int4* src = A + (static_cast<long long>(valid ? row : 0) * lda + st * STAGE_K + atom * kAtomK) / 8 + c;
      cp_async16_at(slot + G::kAOff + atom * G::kAtomBytes + r * 128 + 16 * (c ^ (r % 8)), src, valid);
    }
  };

  float acc[4][WN / 2];
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int j = 0; j < WN / 2; ++j) acc[s][j] = 0.f;

  // u4b8: every code's offset is the fixed bias 8
  unsigned off[2][2], off16[2][2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      off[h][r] = splat_bits(offset_bits<T, W>(Weight<W>::kBias));
      off16[h][r] = splat_bits(neg_offset16_bits(Weight<W>::kBias));
    }

#pragma unroll
  for (int p = 0; p < STAGES - 2; ++p) {
    if (p < n_st) fetch(st_begin + p, base + p * G::kStageBytes);
    cp_async_commit();
  }

  const unsigned a_rows = SPLIT_M ? wg * WN * 128 : 0;  // this warpgroup's rows of A in a slot (a multiple of 1024)
  for (int it = 0; it < n_st; ++it) {
    cp_async_wait<STAGES - 3>();
    fence_proxy_async();
    __syncthreads();
    {
      const int nf = it + STAGES - 2;  // slot (it - 2) % STAGES: its wgmma groups are complete (see the header)
      if (nf < n_st) fetch(st_begin + nf, base + (nf % STAGES) * G::kStageBytes);
      cp_async_commit();
    }
    const unsigned slot = base + (it % STAGES) * G::kStageBytes;
    // scale pairs of this lane's columns 64 wl + 16 s + lane / 4 + 8 h (P64: value 2 s + h of the lane's vector) in
    // group row `row` of the stage
    Pair sc[4][2][2];
    auto load_scales = [&](int row) {
      const int4 v = lds128(slot + G::kSOff + 512 * row + 16 * (wl * 8 + lane / 4));
      const unsigned w[4] = {static_cast<unsigned>(v.x), static_cast<unsigned>(v.y), static_cast<unsigned>(v.z),
                             static_cast<unsigned>(v.w)};
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        sc[s][0][0] = sc[s][0][1] = as_pair<Pair>(__byte_perm(w[s], 0, 0x1010));
        sc[s][1][0] = sc[s][1][1] = as_pair<Pair>(__byte_perm(w[s], 0, 0x3232));
      }
    };
    constexpr int kMySteps = SPLIT_M ? kSteps : kSteps / 2;
#pragma unroll
    for (int q = 0; q < kMySteps; ++q) {
      const int step = SPLIT_M ? q : 2 * q + wg;
      // a stage of 128 with groups of 64 spans two group rows: the second from step 4 on
      auto row_of = [&](int k16) { return STAGE_K > group_size && k16 * 16 >= group_size ? 1 : 0; };
      if (q == 0 || row_of(step) != row_of(step - (SPLIT_M ? 1 : 2))) load_scales(row_of(step));
      const int4 wv = lds128(slot + G::kBOff + 16 * ((step * 4 + wl) * 32 + lane));
      const unsigned words[4] = {static_cast<unsigned>(wv.x), static_cast<unsigned>(wv.y),
                                 static_cast<unsigned>(wv.z), static_cast<unsigned>(wv.w)};
      unsigned a[4][4];
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        unsigned b[2][2];
        dequant_subblock<T, W, true>(words + s, off, off16, sc[s], b);
        a[s][0] = b[0][0];
        a[s][1] = b[1][0];
        a[s][2] = b[0][1];
        a[s][3] = b[1][1];
      }
      const unsigned long long desc =
          sw128_desc(slot + G::kAOff + (step / 4) * G::kAtomBytes + a_rows + 32 * (step % 4));
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s) Wgmma<Act<T>::kIsBf16, WN>::mma(acc[s], a[s], desc);
      wgmma_commit();
      // One group left in flight while the next step dequantizes. SPLIT_M retires it at the stage's end: with a group
      // in flight across the loop's back edge, ptxas 13.0 serializes every wgmma of that instantiation (C7515).
      if (SPLIT_M && q == kMySteps - 1) {
        wgmma_wait<0>();
      } else {
        wgmma_wait<1>();
      }
    }
  }
  wgmma_wait<0>();
  cp_async_wait<0>();
  __syncthreads();  // the ring is free: the epilogue tile reuses it

  // accumulator (s, 4 i + r): wgmma row 16 wl + lane / 4 + 8 (r / 2) = problem column 64 wl + 16 s + lane / 4 + 8 (r / 2),
  // wgmma column 8 i + 2 (lane % 4) + r % 2 = problem row (of this warpgroup's rows)
  auto red_at = [&](int s, int e) -> float& {
    const int i = e / 4, r = e % 4;
    const int col = 64 * wl + 16 * s + lane / 4 + 8 * (r / 2);
    const int row = (SPLIT_M ? wg * WN : 0) + 8 * i + 2 * (lane % 4) + r % 2;
    return red[row * G::kRedStride + col];
  };
  if (SPLIT_M || wg == 1) {
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int e = 0; e < WN / 2; ++e) red_at(s, e) = acc[s][e];
  }
  __syncthreads();
  if (!SPLIT_M) {
    if (wg == 0) {  // warpgroup 0's sums after warpgroup 1's: one fixed order
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int e = 0; e < WN / 2; ++e) red_at(s, e) = acc[s][e] + red_at(s, e);
    }
    __syncthreads();  // (every thread: a barrier inside the branch would pair with another one of warpgroup 1)
  }

  // 256 threads, 8 consecutive columns each: 8 rows of the tile per pass
  const int col = (tid % 32) * 8;
  const long long tile_id = static_cast<long long>(mt) * gridDim.x + nb;
  auto store_c = [&](int r, const float (&v)[8]) {
    const int row = m0 + r;
    if (row >= prob_m) return;
    int4 out;
    unsigned* o = reinterpret_cast<unsigned*>(&out);
#pragma unroll
    for (int j = 0; j < 4; ++j) o[j] = as_u32(Act<T>::from_floats(v[2 * j], v[2 * j + 1]));
    *reinterpret_cast<int4*>(C + static_cast<long long>(row) * prob_n + nb * kBlockN + col) = out;
  };
  if (splits == 1) {
    for (int r = tid / 32; r < BM; r += kThreads / 32) {
      float v[8];
      const float4 x = *reinterpret_cast<const float4*>(red + r * G::kRedStride + col);
      const float4 y = *reinterpret_cast<const float4*>(red + r * G::kRedStride + col + 4);
      v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w; v[4] = y.x; v[5] = y.y; v[6] = y.z; v[7] = y.w;
      store_c(r, v);
    }
    return;
  }
  float* mine = partial + (tile_id * splits + z) * (BM * kBlockN);
  for (int r = tid / 32; r < BM; r += kThreads / 32) {
    float4* dst = reinterpret_cast<float4*>(mine + r * kBlockN + col);
    dst[0] = *reinterpret_cast<const float4*>(red + r * G::kRedStride + col);
    dst[1] = *reinterpret_cast<const float4*>(red + r * G::kRedStride + col + 4);
  }
  __threadfence();
  __syncthreads();
  __shared__ int last;
  if (tid == 0) {
    const int prev = atomicAdd(counters + tile_id, 1);
    last = prev == splits - 1;
    if (last) counters[tile_id] = 0;  // every split has arrived: ready for the next call
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const float* all = partial + tile_id * splits * (BM * kBlockN);
  for (int r = tid / 32; r < BM; r += kThreads / 32) {
    if (m0 + r >= prob_m) continue;
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int zz = 0; zz < splits; ++zz) {  // split order, whoever arrived last
      const float4* p = reinterpret_cast<const float4*>(all + zz * (BM * kBlockN) + r * kBlockN + col);
      const float4 x = __ldcg(p), y = __ldcg(p + 1);
      v[0] += x.x; v[1] += x.y; v[2] += x.z; v[3] += x.w; v[4] += y.x; v[5] += y.y; v[6] += y.z; v[7] += y.w;
    }
    store_c(r, v);
  }
#endif
}

}  // namespace hopper
}  // namespace mwb
