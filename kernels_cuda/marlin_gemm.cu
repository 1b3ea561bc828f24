// Marlin mixed-precision GEMM:  C[M, N] = A[M, K] @ dequant(B)[K, N], A and C fp16 or bf16, B in Marlin tiles.
//
// NumPy spec:  C = (A.astype(f32) @ workbench.quantize.dequantize(...)).astype(act)   (fp32 accumulation)
//
// Work decomposition
// ------------------
//   block tile   BM x BN output (BM = 16 M_BLOCKS rows, BN = 64 N_TILES columns), BK = 16 KT rows of K per stage
//   slice        one block tile's column of the K loop: KI = K / BK iterations; slices are ordered
//                (m chunk, n column) and iterations (slice, k) form one linear range of T = chunks * cols * KI
//   blocks       gridDim.x <= #SMs x resident blocks per SM each take a contiguous, equal share of that range ("striped" split-K),
//                so every SM streams the same number of weight bytes whatever M, N, K are.
//
//     iterations:  | slice 0: k0 k1 k2 k3 | slice 1: k0 k1 k2 k3 | slice 2: ...
//     blocks:      |  block 0    | block 1     | block 2     | ...
//
//   A slice touched by several blocks is summed across them in a fixed order (see finish_slice), so the result
//   does not depend on which block finishes first:
//   * fp32 (default): every contributor stores its fp32 partial in its own C_tmp slot and counts itself in; the
//     last to arrive adds all slots in block order and writes C. Nobody waits. (A block whose range goes on past
//     the slice looks at its arrival rank only when its range is done: see finish_slice's `defer`.)
//   * in C: partials are rounded to the activation type and passed along in C, block by block, under a lock:
//     the block holding the end of the slice (it started there, so it is done first) goes first, then downwards;
//     each block waits only on blocks that started later in K order, never on work that has not begun.
//
// Inside a block: 8 warps; warp w owns 64-column tile nt = w % N_TILES and K_WARP consecutive k16 tiles of each
// stage (k group kg = w / N_TILES). Warps of the same nt are summed through shared memory when a slice ends.
//
// Pipeline: STAGES-deep cp.async ring over the block's iterations, continuing across slice boundaries:
//   fetch_stage(it + STAGES - 1)  while  compute_stage(it)
#include "dequant.cuh"

namespace mwb {

constexpr int kThreads = 256;  // 8 warps: enough independent mma chains per SM with one block per SM
constexpr int kWarps = kThreads / 32;

// How partial sums of a slice shared by several blocks are combined (workbench/gemm.py REDUCE_*).
enum ReduceMode : int {
  kReduceInC = 0,     // lock-ordered; partials rounded to the activation type and kept in C
  kReduceFp32 = 1,    // per-block fp32 slots in C_tmp, summed in block order by the last block to arrive
  kReduceAtomic = 2,  // atomicAdd of activation-typed pairs into a zeroed C (not bitwise reproducible)
};

// How scales are indexed (workbench/gemm.py GROUP_*). A template parameter, so the hot loop has no branch on it.
enum GroupMode : int {
  kChannelwise = 0,  // one scale row (P32 layout), applied per element
  kGrouped = 1,      // group of Marlin row k = k >> log2(group_size) (P64 layout), staged per pipeline step
  kPerRow = 2,       // act-order on a K shard (is_k_full = false): group of row k = g_idx[k]
};

// Compile-time geometry of one kernel instantiation. Python mirrors smem_bytes() in workbench/gemm.py.
template <typename T, int W, int M_BLOCKS, int N_TILES, int K_WARP, int STAGES, int GROUP_MODE>
struct Geometry {
  static_assert(M_BLOCKS >= 1 && M_BLOCKS <= 4, "M_BLOCKS is 1..4 (16..64 rows)");
  static_assert(N_TILES == 1 || N_TILES == 2 || N_TILES == 4, "N_TILES must divide the 8 warps");
  static constexpr int kWarpsPerN = kWarps / N_TILES;  // warps that split K inside one 64-column tile
  static constexpr int KT = K_WARP * kWarpsPerN;       // k16 tiles per stage
  static constexpr int BM = 16 * M_BLOCKS;
  static constexpr int BN = 64 * N_TILES;
  static constexpr int BK = 16 * KT;
  static_assert(BK >= 64, "the A swizzle needs rows of at least 8 16-byte chunks");
  static constexpr int kPack = Weight<W>::kPack;
  static constexpr int kTileI4 = 16 * 64 / kPack / 4;  // int4 per 16x64 weight tile (32 or 64)
  static constexpr int kScaleRows = (BK / 32 > 1) ? BK / 32 : 1;  // group rows a stage can span (G >= 32)

  static constexpr int kAI4 = BM * BK / 8;                 // A stage
  static constexpr int kBI4 = KT * N_TILES * kTileI4;      // B stage
  static constexpr int kSI4 = kScaleRows * BN / 8;         // scale rows of a stage
  static constexpr int kZI4 = Weight<W>::kHasZero ? kScaleRows * BN / kPack / 4 : 0;
  static constexpr int kGI4 = GROUP_MODE == kPerRow ? BK / 4 : 0;  // g_idx of a stage
  static constexpr int kStageI4 = kAI4 + kBI4 + kSI4 + kZI4 + kGI4;
  static constexpr int kRedI4 = (kWarpsPerN > 1) ? (kWarpsPerN / 2) * N_TILES * 16 * 64 / 4 : 0;
  static constexpr int kSmemBytes = 16 * (STAGES * kStageI4 + kRedI4);
};

// Converts and stores two fp32 values as one activation-typed pair.
template <typename T>
__device__ __forceinline__ void store_pair(T* dst, float lo, float hi) {
  *reinterpret_cast<typename Act<T>::Pair*>(dst) = Act<T>::from_floats(lo, hi);
}

// Blocks first..last contribute to slice `slice` (block b holds iterations [b T / G, (b + 1) T / G)).
__device__ __forceinline__ void slice_contributors(int slice, int KI, long long total, int& first, int& last) {
  const long long grid = gridDim.x;
  auto owner = [&](long long i) -> int { return static_cast<int>(((i + 1) * grid - 1) / total); };
  first = owner(static_cast<long long>(slice) * KI);
  last = owner(static_cast<long long>(slice) * KI + KI - 1);
}

// fp32 slot of block b's partial of `slice`: a block writes partials for at most two slices (its first and its
// last), hence two slots per block.
template <int BM, int BN>
__device__ __forceinline__ float4* fp32_slot(float* C_tmp, int b, int slice, int KI, long long total) {
  const int first_slice_of_b = static_cast<int>(b * total / gridDim.x) / KI;
  return reinterpret_cast<float4*>(C_tmp) + static_cast<long long>(2 * b + (slice == first_slice_of_b ? 0 : 1)) *
                                                (BM * BN / 4);
}

// The last block to count itself in for a shared slice (kReduceFp32) sums every contributor's slot and writes C,
// then leaves the counter zero for the next launch. All 8 warps share the sum; a warp sums kFragBatch of its
// fragments at once, with the loads of kBatch contributors for each of them in flight together:
// ceil(count / kBatch) dependent L2 round trips per kFragBatch fragments. Every element is still summed from zero
// over the slots in block order (the caller's own included), so the result does not depend on who arrived last,
// nor on the batching. kLoadsInFlight: float4 loads per lane in flight (8 = 32 registers; the 128-register
// two-block kernels spill above 4, measured with -Xptxas -v).
template <typename T, int M_BLOCKS, int N_TILES, int BM, int BN, int kLoadsInFlight>
__device__ __noinline__ void sum_fp32_slots(int slice, int KI, int cols, long long total, T* __restrict__ C,
                                            float* __restrict__ C_tmp, int* __restrict__ locks, int prob_m,
                                            int prob_n) {
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int chunk = slice / cols, col = slice % cols;
  int first, last;
  slice_contributors(slice, KI, total, first, last);
  __threadfence();
  constexpr int kFragsPerWarp = N_TILES * M_BLOCKS * 8 / kWarps;  // float4 fragments (x 32 lanes) of a slot
  constexpr int kBatch = 4;
  constexpr int kFragBatch = (kLoadsInFlight / kBatch < 1) ? 1
                             : (kLoadsInFlight / kBatch < kFragsPerWarp ? kLoadsInFlight / kBatch : kFragsPerWarp);
  // Contributors after `first` hold the start of their range in this slice: it is their first slot (0). Only
  // `first` may be in its second.
  const float4* const first_slot = fp32_slot<BM, BN>(C_tmp, first, slice, KI, total);
  const float4* const slots = reinterpret_cast<const float4*>(C_tmp);
#pragma unroll
  for (int i0 = 0; i0 < kFragsPerWarp; i0 += kFragBatch) {
    float4 sum[kFragBatch];
#pragma unroll
    for (int u = 0; u < kFragBatch; ++u) sum[u] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int b = first; b <= last; b += kBatch) {
      float4 q[kBatch][kFragBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const float4* theirs =
            (b + j == first) ? first_slot : slots + static_cast<long long>(2 * (b + j)) * (BM * BN / 4);
#pragma unroll
        for (int u = 0; u < kFragBatch; ++u) {
          const int f = (i0 + u) * kWarps + warp;  // slot order: (nt * M_BLOCKS + mb) * 8 + nb
          if (i0 + u < kFragsPerWarp && b + j <= last) q[j][u] = __ldcg(theirs + f * 32 + lane);
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
#pragma unroll
        for (int u = 0; u < kFragBatch; ++u)
          if (i0 + u < kFragsPerWarp && b + j <= last) {
            sum[u].x += q[j][u].x; sum[u].y += q[j][u].y; sum[u].z += q[j][u].z; sum[u].w += q[j][u].w;
          }
    }
#pragma unroll
    for (int u = 0; u < kFragBatch; ++u) {
      if (i0 + u >= kFragsPerWarp) continue;  // (a last, partial batch when kFragBatch does not divide)
      const int f = (i0 + u) * kWarps + warp;
      const int f_nt = f / (M_BLOCKS * 8), f_mb = (f / 8) % M_BLOCKS, f_nb = f % 8;
      const int col_g = col * BN + f_nt * 64 + f_nb * 8 + 2 * (lane % 4);
      const int row_g = chunk * BM + f_mb * 16 + lane / 4;
      T* c_lo = C + static_cast<long long>(row_g) * prob_n + col_g;
      if (row_g < prob_m) store_pair(c_lo, sum[u].x, sum[u].y);
      if (row_g + 8 < prob_m) store_pair(c_lo + 8LL * prob_n, sum[u].z, sum[u].w);
    }
  }
  if (tid == 0) locks[last] = 0;  // leave the counter zero for the next launch
}

// ---- finish a slice: sum the warps of each tile, then across blocks, then write C ---------------------------
// Kept out of line and working on a local copy of the accumulators: it runs at most twice per block, and inlined
// it made the hot loop's register allocation spill (measured: 0 vs ~1 KiB of spills at M_BLOCKS = 4).
//
// defer (kReduceFp32 only): the slice ends in the middle of this block's range (its first slice, shared with the
// blocks before it). Then finish_slice returns after the barrier that follows the slot stores (returning the lock
// index; -1 when nothing was deferred): the caller's thread 0 fences and counts the block in, inline, so that the
// atomic's result (the block's arrival rank) is needed only when the block's range is done (settle_deferred), where
// the block sums the slice if it turned out to be the last to arrive; the other warps go straight back to the
// pipeline.
template <typename T, int M_BLOCKS, int N_TILES, int BM, int BN, int kWarpsPerN, int kLoadsInFlight>
__device__ __noinline__ int finish_slice(float (&acc)[M_BLOCKS][8][4], float* sRed, int slice, int KI, int cols,
                                         long long total, T* __restrict__ C, float* __restrict__ C_tmp,
                                         int* __restrict__ locks, int prob_m, int prob_n, int reduce_mode,
                                         bool defer) {
  using Pair = typename Act<T>::Pair;
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int nt = warp % N_TILES;
  const int kg = warp / N_TILES;

  // (1) warps sharing a 64-column tile fold their accumulators pairwise through shared memory, one m16 block
  //     at a time so the buffer stays 16 KiB.
  if constexpr (kWarpsPerN > 1) {
#pragma unroll
    for (int mb = 0; mb < M_BLOCKS; ++mb) {
#pragma unroll
      for (int step = kWarpsPerN / 2; step >= 1; step /= 2) {
        if (kg >= step && kg < 2 * step) {
          float* dst = sRed + ((kg - step) * N_TILES + nt) * 1024;
#pragma unroll
          for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int r = 0; r < 4; ++r) dst[(nb * 4 + r) * 32 + lane] = acc[mb][nb][r];
        }
        __syncthreads();
        if (kg < step) {
          const float* src = sRed + (kg * N_TILES + nt) * 1024;
#pragma unroll
          for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[mb][nb][r] += src[(nb * 4 + r) * 32 + lane];
        }
        __syncthreads();
      }
    }
  }

  // (2) across blocks. Contributors of this slice are blocks first..last (rank = last - block).
  int first, last;
  slice_contributors(slice, KI, total, first, last);
  const int count = last - first + 1;
  const int chunk = slice / cols, col = slice % cols;
  const bool writer = kg == 0;  // after (1), warps 0..N_TILES-1 hold the block's partial
  __shared__ int s_last_arrival;

  // Stores the block's accumulators into C (rows below M only), converted to the activation type.
  auto write_c = [&]() {
#pragma unroll
    for (int mb = 0; mb < M_BLOCKS; ++mb)
#pragma unroll
      for (int nb = 0; nb < 8; ++nb) {
        const int col_g = col * BN + nt * 64 + nb * 8 + 2 * (lane % 4);
        const int row_g = chunk * BM + mb * 16 + lane / 4;
        T* c_lo = C + static_cast<long long>(row_g) * prob_n + col_g;
        if (row_g < prob_m) store_pair(c_lo, acc[mb][nb][0], acc[mb][nb][1]);
        if (row_g + 8 < prob_m) store_pair(c_lo + 8LL * prob_n, acc[mb][nb][2], acc[mb][nb][3]);
      }
  };

  if (count == 1) {
    if (writer) write_c();
  } else if (reduce_mode == kReduceAtomic) {
    if (writer) {
#pragma unroll
      for (int mb = 0; mb < M_BLOCKS; ++mb)
#pragma unroll
        for (int nb = 0; nb < 8; ++nb) {
          const int col_g = col * BN + nt * 64 + nb * 8 + 2 * (lane % 4);
          const int row_g = chunk * BM + mb * 16 + lane / 4;
          T* c_lo = C + static_cast<long long>(row_g) * prob_n + col_g;
          if (row_g < prob_m)
            atomicAdd(reinterpret_cast<Pair*>(c_lo), Act<T>::from_floats(acc[mb][nb][0], acc[mb][nb][1]));
          if (row_g + 8 < prob_m)
            atomicAdd(reinterpret_cast<Pair*>(c_lo + 8LL * prob_n),
                      Act<T>::from_floats(acc[mb][nb][2], acc[mb][nb][3]));
        }
    }
  } else if (reduce_mode == kReduceFp32) {
    if (writer) {
      float4* mine = fp32_slot<BM, BN>(C_tmp, blockIdx.x, slice, KI, total);
#pragma unroll
      for (int mb = 0; mb < M_BLOCKS; ++mb)
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)  // fragment-ordered slots: lane-contiguous float4s, one per (nt, mb, nb)
          __stcg(mine + ((nt * M_BLOCKS + mb) * 8 + nb) * 32 + lane,
                 make_float4(acc[mb][nb][0], acc[mb][nb][1], acc[mb][nb][2], acc[mb][nb][3]));
    }
    // The barrier orders every writer's stores before thread 0's fence, which makes them visible device-wide
    // before the count (the cooperative-groups grid barrier pattern).
    __syncthreads();
    if (defer) return last;  // the caller's thread 0 fences and counts in (see the kernel's main loop)
    if (tid == 0) {
      __threadfence();
      s_last_arrival = (atomicAdd(locks + last, 1) == count - 1);
    }
    __syncthreads();
    if (s_last_arrival)
      sum_fp32_slots<T, M_BLOCKS, N_TILES, BM, BN, kLoadsInFlight>(slice, KI, cols, total, C, C_tmp, locks, prob_m,
                                                                   prob_n);
  } else {  // kReduceInC: pass the partial along in C under the lock, highest block first
    const int rank = last - static_cast<int>(blockIdx.x);
    if (rank > 0) {
      if (tid == 0) {
        while (load_acquire(locks + last) != rank) {
        }
      }
      __syncthreads();
      if (writer) {
#pragma unroll
        for (int mb = 0; mb < M_BLOCKS; ++mb) {
          const int row_g = chunk * BM + mb * 16 + lane / 4;
          unsigned q[8][2];
#pragma unroll
          for (int nb = 0; nb < 8; ++nb) {  // all loads of this m16 block first: one L2 round trip, not eight
            const int col_g = col * BN + nt * 64 + nb * 8 + 2 * (lane % 4);
            const unsigned* c_lo = reinterpret_cast<const unsigned*>(C + static_cast<long long>(row_g) * prob_n +
                                                                     col_g);
            q[nb][0] = row_g < prob_m ? __ldcg(c_lo) : 0u;
            q[nb][1] = row_g + 8 < prob_m ? __ldcg(c_lo + 4LL * prob_n) : 0u;
          }
#pragma unroll
          for (int nb = 0; nb < 8; ++nb) {
            const float2 lo = Act<T>::to_floats(as_pair<Pair>(q[nb][0]));
            const float2 hi = Act<T>::to_floats(as_pair<Pair>(q[nb][1]));
            acc[mb][nb][0] += lo.x; acc[mb][nb][1] += lo.y;
            acc[mb][nb][2] += hi.x; acc[mb][nb][3] += hi.y;
          }
        }
      }
    }
    if (writer) write_c();
    __threadfence();
    __syncthreads();
    if (tid == 0) store_release(locks + last, rank == count - 1 ? 0 : rank + 1);
  }
  return -1;
}

// After the block's range: a deferred slice end (see finish_slice) is settled. Thread 0 holds the block's arrival
// rank; if it was the last of the slice's contributors, the block sums the slice now. No other block waits on this.
template <typename T, int M_BLOCKS, int N_TILES, int BM, int BN, int kLoadsInFlight>
__device__ __noinline__ void settle_deferred(int slice, int rank, int KI, int cols, long long total,
                                             T* __restrict__ C, float* __restrict__ C_tmp, int* __restrict__ locks,
                                             int prob_m, int prob_n) {
  __shared__ int s_was_last;
  if (threadIdx.x == 0) {
    int first, last;
    slice_contributors(slice, KI, total, first, last);
    s_was_last = rank == last - first;
  }
  __syncthreads();
  if (s_was_last)
    sum_fp32_slots<T, M_BLOCKS, N_TILES, BM, BN, kLoadsInFlight>(slice, KI, cols, total, C, C_tmp, locks, prob_m,
                                                                 prob_n);
}

// MIN_BLOCKS: resident blocks per SM the register budget is cut for (2: 128 registers). Two blocks hide the dependent
// LDS -> dequant -> mma chain of one block's 8 warps, but only pay when every block has a long run of pipeline steps
// (workbench/gemm.py chooses; measured in bench/NOTES_gemm.md); the 64-row accumulators need one block's registers.
template <typename T, int W, int M_BLOCKS, int N_TILES, int K_WARP, int STAGES, int GROUP_MODE, int MIN_BLOCKS>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS)
marlin_gemm(const int4* __restrict__ A,       // (M, lda) activations, 16-byte rows (lda % 8 == 0)
            const int4* __restrict__ B,       // (K/16, N*16/pack) int32 Marlin tiles
            T* __restrict__ C,                // (M, N) output
            float* __restrict__ C_tmp,        // (2 gridDim.x, BM*BN) fp32 partial slots (kReduceFp32 only)
            const int4* __restrict__ scales,  // (num_groups, N) act type, Marlin-permuted
            const int4* __restrict__ zeros,   // (num_groups, N/pack) int32 Marlin zero points, or null
            const int* __restrict__ g_idx,    // (K,) sorted group of each Marlin row (kPerRow only)
            int* __restrict__ locks,          // (>= gridDim.x,) int32, zero on entry and on exit
            int prob_m, int prob_n, int prob_k, int lda,
            int group_size,                   // rows per group (a power of two), Marlin row order; -1 = channelwise
            int reduce_mode) {
  static_assert(MIN_BLOCKS == 1 || (MIN_BLOCKS == 2 && M_BLOCKS == 1), "two blocks per SM only with 16-row tiles");
  using G = Geometry<T, W, M_BLOCKS, N_TILES, K_WARP, STAGES, GROUP_MODE>;
  using Pair = typename Act<T>::Pair;
  constexpr int BM = G::BM, BN = G::BN, BK = G::BK, KT = G::KT;
  constexpr bool kHasZero = Weight<W>::kHasZero;
  constexpr int kWordsPerLane = 16 * 64 / Weight<W>::kPack / 32;  // 4 (4-bit) or 8 (8-bit) words of a tile
  constexpr int kLoadsInFlight = MIN_BLOCKS == 1 ? 8 : 4;  // float4 loads per lane in the fp32 cross-block sum

  extern __shared__ int4 smem[];
  int4* const sA = smem;
  int4* const sB = sA + STAGES * G::kAI4;
  int4* const sS = sB + STAGES * G::kBI4;
  int4* const sZ = sS + STAGES * G::kSI4;
  int4* const sG = sZ + STAGES * G::kZI4;
  float* const sRed = reinterpret_cast<float*>(sG + STAGES * G::kGI4);

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int nt = warp % N_TILES;  // this warp's 64-column tile inside the block tile
  const int kg = warp / N_TILES;  // this warp's share of K inside a stage
  const int lane_col = lane / 4;  // the B-fragment column c of this lane

  const int n_tiles_total = prob_n / 64;
  const int KI = prob_k / BK;
  const int cols = prob_n / BN;
  const int chunks = (prob_m + BM - 1) / BM;
  const long long total = static_cast<long long>(chunks) * cols * KI;  // < 2^31: the host checks
  const long long grid = gridDim.x;
  const int it_begin = static_cast<int>(blockIdx.x * total / grid);
  const int it_end = static_cast<int>((blockIdx.x + 1) * total / grid);
  const int group_shift = GROUP_MODE == kGrouped ? __ffs(group_size) - 1 : 0;  // group of row k = k >> shift
  const unsigned long long weight_policy = evict_first_policy();


  // ---- fetch: global -> shared for linear iteration `it` into ring slot `slot` -------------------------------
  auto fetch_stage = [&](int slot, int slice, int kit) {
    const int chunk = slice / cols, col = slice % cols;
    const int row0 = chunk * BM, k0 = kit * BK;
    // A: BM rows x BK columns, 16-byte chunk c of row r stored at c ^ (r % 8) so that ldmatrix's 8 row reads of
    // one column block hit 8 different bank groups.
    int4* a_dst = sA + slot * G::kAI4;
#pragma unroll
    for (int i = tid; i < G::kAI4; i += kThreads) {
      const int r = i / (BK / 8), c = i % (BK / 8);
      const int row = row0 + r;
      const bool valid = row < prob_m;
      const int4* src = A + (valid ? static_cast<long long>(row) * (lda / 8) + k0 / 8 + c : 0);
      cp_async16(a_dst + r * (BK / 8) + (c ^ (r % 8)), src, valid);
    }
    // B: KT rows of N_TILES consecutive 16x64 tiles. 8-bit tiles give each lane 32 bytes; storing the two 16-byte
    // halves of all lanes apart (all first halves, then all second halves) keeps the lane reads conflict-free.
    int4* b_dst = sB + slot * G::kBI4;
#pragma unroll
    for (int i = tid; i < G::kBI4; i += kThreads) {
      const int kt = i / (N_TILES * G::kTileI4);
      const int rem = i % (N_TILES * G::kTileI4);
      const int j = rem % G::kTileI4;
      const int swz = (G::kTileI4 == 64) ? (j % 2) * 32 + j / 2 : j;
      const int4* src = B + (static_cast<long long>(kit * KT + kt) * n_tiles_total + col * N_TILES) * G::kTileI4 + rem;
      cp_async16_stream(b_dst + kt * N_TILES * G::kTileI4 + (rem - j) + swz, src, weight_policy);
    }
    if constexpr (GROUP_MODE == kGrouped) {
      // The group rows this stage spans: one when G >= BK, else BK / G (G and BK are powers of two >= 32).
      const int g0 = k0 >> group_shift;
      const int rows = BK > group_size ? BK >> group_shift : 1;
      int4* s_dst = sS + slot * G::kSI4;
      for (int i = tid; i < rows * (BN / 8); i += kThreads) {
        const int r = i / (BN / 8), c = i % (BN / 8);
        cp_async16(s_dst + i, scales + (static_cast<long long>(g0 + r) * prob_n + col * BN) / 8 + c);
      }
      if constexpr (kHasZero) {
        constexpr int kZRowI4 = BN / Weight<W>::kPack / 4;
        int4* z_dst = sZ + slot * G::kZI4;
        for (int i = tid; i < rows * kZRowI4; i += kThreads) {
          const int r = i / kZRowI4, c = i % kZRowI4;
          cp_async16(z_dst + i, zeros + (static_cast<long long>(g0 + r) * prob_n / Weight<W>::kPack + col * BN /
                                         Weight<W>::kPack) / 4 + c);
        }
      }
    }
    if constexpr (GROUP_MODE == kPerRow) {
      int4* g_dst = sG + slot * G::kGI4;
      for (int i = tid; i < BK / 4; i += kThreads) cp_async16(g_dst + i, g_idx + k0 + 4 * i);
    }
  };

  // ---- per-slice state: accumulators and the current group's scale / offset pairs ---------------------------
  float acc[M_BLOCKS][8][4];  // [m16 block][n8 block = 2 s + h][mma C registers]
  // Pairs for sub-block s, column half h, valid for every row of the current group (channelwise: the whole
  // slice). Rebuilt only when the group changes, so the per-tile work is dequant + mma.
  Pair g_sc[4][2];
  unsigned g_off[4][2];    // (magic + zero) pairs
  unsigned g_off16[4][2];  // -(64 + zero) fp16 pairs (fp16 4-bit high nibbles)

  auto zero_acc = [&]() {
#pragma unroll
    for (int mb = 0; mb < M_BLOCKS; ++mb)
#pragma unroll
      for (int nb = 0; nb < 8; ++nb)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[mb][nb][r] = 0.f;
  };

  // Offsets of (s, h) from this lane's zero-point words (or the fixed bias).
  auto set_offsets = [&](const unsigned* zw) {
#pragma unroll
    for (int s_ = 0; s_ < 4; ++s_)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int z = kHasZero ? zero_of<W>(zw, s_, h) : Weight<W>::kBias;
        g_off[s_][h] = splat_bits(offset_bits<T, W>(z));
        g_off16[s_][h] = splat_bits(neg_offset16_bits(z));
      }
  };

  auto load_channelwise = [&](int col) {
    const T* sp = reinterpret_cast<const T*>(scales) + col * BN + nt * 64;
#pragma unroll
    for (int s_ = 0; s_ < 4; ++s_)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const T v = sp[channelwise_scale_index(lane_col, s_, h)];
        g_sc[s_][h] = Act<T>::pair(v, v);
      }
    unsigned zw[2] = {0u, 0u};
    if constexpr (kHasZero) {
      const unsigned* z = reinterpret_cast<const unsigned*>(zeros) + (col * BN + nt * 64) / Weight<W>::kPack;
      zw[0] = z[lane_col * (Weight<W>::kBits / 4)];
      if (Weight<W>::kBits == 8) zw[1] = z[2 * lane_col + 1];
    }
    set_offsets(zw);
  };

  // Grouped: the pairs of group row g of stage `slot` (a P64 16-byte vector: word s = (scale(s,0), scale(s,1))).
  auto load_group = [&](int slot, int g) {
    const int4 sv = sS[slot * G::kSI4 + g * (BN / 8) + nt * 8 + lane_col];
    const unsigned w[4] = {static_cast<unsigned>(sv.x), static_cast<unsigned>(sv.y), static_cast<unsigned>(sv.z),
                           static_cast<unsigned>(sv.w)};
#pragma unroll
    for (int s_ = 0; s_ < 4; ++s_) {
      g_sc[s_][0] = as_pair<Pair>(__byte_perm(w[s_], 0, 0x1010));  // low half twice
      g_sc[s_][1] = as_pair<Pair>(__byte_perm(w[s_], 0, 0x3232));  // high half twice
    }
    unsigned zw[2] = {0u, 0u};
    if constexpr (kHasZero) {
      const unsigned* zrow = reinterpret_cast<const unsigned*>(sZ + slot * G::kZI4) + g * (BN / Weight<W>::kPack) +
                             nt * (64 / Weight<W>::kPack);
      zw[0] = zrow[lane_col * (Weight<W>::kBits / 4)];
      if (Weight<W>::kBits == 8) zw[1] = zrow[2 * lane_col + 1];
    }
    set_offsets(zw);
  };

  // ---- compute: one stage of this warp's k16 tiles ---------------------------------------------------------
  auto compute_stage = [&](int slot, int slice, int kit) {
    const int col = slice % cols;
    const int k0 = kit * BK;
    const int4* a_src = sA + slot * G::kAI4;
    const int4* b_src = sB + slot * G::kBI4;
#pragma unroll
    for (int i = 0; i < K_WARP; ++i) {
      const int kt = kg * K_WARP + i;

      if constexpr (GROUP_MODE == kGrouped) {
        // A warp's K_WARP tiles lie in one group when G >= 16 K_WARP (both powers of two, aligned): load once.
        if (i == 0 || group_size < 16 * K_WARP) load_group(slot, ((k0 + 16 * kt) >> group_shift) - (k0 >> group_shift));
      }
      // Per-row groups: the scale vectors and zero words of this lane's rows k0, k0+1, k0+8, k0+9.
      int4 sv[GROUP_MODE == kPerRow ? 4 : 1];
      unsigned zw[GROUP_MODE == kPerRow ? 4 : 1][2];
      if constexpr (GROUP_MODE == kPerRow) {
        const int* grp = reinterpret_cast<const int*>(sG + slot * G::kGI4);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int krow = 16 * kt + 2 * (lane % 4) + (r & 1) + 8 * (r >> 1);
          const long long g = grp[krow];
          sv[r] = __ldg(scales + (g * prob_n + col * BN + nt * 64) / 8 + lane_col);
          if constexpr (kHasZero) {
            const unsigned* zrow = reinterpret_cast<const unsigned*>(zeros) +
                                   (g * prob_n + col * BN + nt * 64) / Weight<W>::kPack;
            zw[r][0] = __ldg(zrow + lane_col * (Weight<W>::kBits / 4));
            zw[r][1] = (Weight<W>::kBits == 8) ? __ldg(zrow + 2 * lane_col + 1) : 0u;
          }
        }
      }
      // Scale and offset pairs of sub-block s: [h][r], r = rows (k0, k0+1) / (k0+8, k0+9).
      auto group_params = [&](int s, Pair (&sc)[2][2], unsigned (&off)[2][2], unsigned (&off16)[2][2]) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (GROUP_MODE != kPerRow) {
            sc[h][0] = sc[h][1] = g_sc[s][h];
            off[h][0] = off[h][1] = g_off[s][h];
            off16[h][0] = off16[h][1] = g_off16[s][h];
          } else {
#pragma unroll
            for (int p = 0; p < 2; ++p) {
              const T lo = reinterpret_cast<const T*>(&sv[2 * p])[grouped_scale_slot(s, h)];
              const T hi = reinterpret_cast<const T*>(&sv[2 * p + 1])[grouped_scale_slot(s, h)];
              const int zlo = kHasZero ? zero_of<W>(zw[2 * p], s, h) : Weight<W>::kBias;
              const int zhi = kHasZero ? zero_of<W>(zw[2 * p + 1], s, h) : Weight<W>::kBias;
              sc[h][p] = Act<T>::pair(lo, hi);
              off[h][p] = pair_bits(offset_bits<T, W>(zlo), offset_bits<T, W>(zhi));
              off16[h][p] = pair_bits(neg_offset16_bits(zlo), neg_offset16_bits(zhi));
            }
          }
        }
      };

      // This lane's weight words of tile (kt, nt): word s (4-bit) or words 2s, 2s+1 (8-bit) belong to sub-block s.
      unsigned words[kWordsPerLane];
      const int4* tile = b_src + (kt * N_TILES + nt) * G::kTileI4;
      {
        const int4 w0 = tile[lane];
        words[0] = w0.x; words[1] = w0.y; words[2] = w0.z; words[3] = w0.w;
        if constexpr (kWordsPerLane == 8) {
          const int4 w1 = tile[32 + lane];
          words[4] = w1.x; words[5] = w1.y; words[6] = w1.z; words[7] = w1.w;
        }
      }

      // A fragments of every m16 block for this k16 tile (lane -> row lane % 16, column block lane / 16).
      unsigned a[M_BLOCKS][4];
#pragma unroll
      for (int mb = 0; mb < M_BLOCKS; ++mb) {
        const int r = mb * 16 + lane % 16;
        const int c = 2 * kt + lane / 16;
        ldmatrix_x4(a[mb], a_src + r * (BK / 8) + (c ^ (r % 8)));
      }

#pragma unroll
      for (int s = 0; s < 4; ++s) {
        Pair sc[2][2];
        unsigned off[2][2], off16[2][2];
        group_params(s, sc, off, off16);
        unsigned b[2][2];
        dequant_subblock<T, W>(words + s * Weight<W>::kWordsPerSubblock, off, off16, sc, b);
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int mb = 0; mb < M_BLOCKS; ++mb) mma_m16n8k16<Act<T>::kIsBf16>(a[mb], b[h], acc[mb][2 * s + h]);
      }
    }
  };

  // ---- main loop -------------------------------------------------------------------------------------------
  zero_acc();
  int f_slice = it_begin / KI, f_kit = it_begin % KI;  // next iteration to fetch
  auto advance = [&](int& sl, int& kk) {
    if (++kk == KI) {
      kk = 0;
      ++sl;
    }
  };
  int it_fetch = it_begin;
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (it_fetch < it_end) fetch_stage(st, f_slice, f_kit);
    cp_async_commit();
    ++it_fetch;
    advance(f_slice, f_kit);
  }
  int slot = 0;
  int slice = it_begin / KI, kit = it_begin % KI;
  int deferred_slice = -1, deferred_rank = 0;  // a slice end whose count was deferred (rank: thread 0 only)
  for (int it = it_begin; it < it_end; ++it) {
    if constexpr (GROUP_MODE == kChannelwise) {
      if (it == it_begin || kit == 0) load_channelwise(slice % cols);
    }
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage `slot` is visible to all warps; the slot fetched below was released by all of them
    if (it_fetch < it_end) fetch_stage((slot + STAGES - 1) % STAGES, f_slice, f_kit);
    cp_async_commit();
    ++it_fetch;
    advance(f_slice, f_kit);
    compute_stage(slot, slice, kit);
    slot = (slot + 1 == STAGES) ? 0 : slot + 1;
    if (kit + 1 == KI || it + 1 == it_end) {
      float partial[M_BLOCKS][8][4];
#pragma unroll
      for (int mb = 0; mb < M_BLOCKS; ++mb)
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
          for (int r = 0; r < 4; ++r) partial[mb][nb][r] = acc[mb][nb][r];
      const int lock = finish_slice<T, M_BLOCKS, N_TILES, BM, BN, G::kWarpsPerN, kLoadsInFlight>(
          partial, sRed, slice, KI, cols, total, C, C_tmp, locks, prob_m, prob_n, reduce_mode, it + 1 < it_end);
      if (lock >= 0) {  // block-uniform
        deferred_slice = slice;
        if (tid == 0) {
          __threadfence();  // the slot stores (ordered before this by finish_slice's barrier), then the count
          deferred_rank = atomicAdd(locks + lock, 1);
        }
      }
      zero_acc();
    }
    advance(slice, kit);
  }
  cp_async_wait<0>();
  if (deferred_slice >= 0)
    settle_deferred<T, M_BLOCKS, N_TILES, BM, BN, kLoadsInFlight>(deferred_slice, deferred_rank, KI, cols, total, C,
                                                                  C_tmp, locks, prob_m, prob_n);
}

// A'[m, k] = A[m, perm[k]]: act-order activations gathered into Marlin row order (spec §6). One block per row.
template <typename T>
__global__ void permute_cols(const T* __restrict__ A, const int* __restrict__ perm, T* __restrict__ out, int prob_m,
                             int prob_k, int lda) {
  const long long row = blockIdx.x;
  for (int k = threadIdx.x; k < prob_k; k += blockDim.x) out[row * prob_k + k] = A[row * lda + perm[k]];
}

}  // namespace mwb
