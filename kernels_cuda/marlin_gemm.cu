// Marlin mixed-precision GEMM:  C[M, N] = A[M, K] @ dequant(B)[K, N], A and C fp16 or bf16, B in Marlin tiles.
//
// NumPy spec:  C = (A.astype(f32) @ workbench.quantize.dequantize(...)).astype(act)   (fp32 accumulation)
//
// Work decomposition
// ------------------
//   block tile   BM x BN output (BM = 16 M_BLOCKS rows, BN = 64 N_TILES columns), BK = 16 KT rows of K per stage
//   slice        one block tile's column of the K loop: KI = K / BK iterations; slices are ordered
//                (m chunk, n column) and iterations (slice, k) form one linear range of T = chunks * cols * KI
//   blocks       gridDim.x <= #SMs x resident blocks per SM each take a contiguous, equal share of that range
//                ("striped" split-K), so every SM streams the same number of weight bytes whatever M, N, K are.
//
//     iterations:  | slice 0: k0 k1 k2 k3 | slice 1: k0 k1 k2 k3 | slice 2: ...
//     blocks:      |  block 0    | block 1     | block 2     | ...
//
//   A slice touched by several blocks is summed across them in a fixed order (see finish_slice), so the result
//   does not depend on which block finishes first:
//   * fp32 (default): every contributor stores its fp32 partial in its own C_tmp slot. The slice's first
//     contributor (it holds k = 0; the slice is the last of its range, so it is normally the last to get there)
//     waits for the others' counts, adds all slots in block order and writes C; the others count in and go on.
//     Blocks wait only on higher blocks' first slices, which wait on nothing (all blocks are resident: the host
//     checks the grid). Where no contributor has work after the slice (slice_held_whole: slice-aligned grids), all
//     of them wait for the count and each adds a share of the slots' elements, in the same order.
//   * in C: partials are rounded to the activation type and passed along in C, block by block, under a lock:
//     the block holding the end of the slice (it started there, so it is done first) goes first, then downwards;
//     each block waits only on blocks that started later in K order, never on work that has not begun.
//
// Inside a block: 8 warps; warp w owns 64-column tile nt = w % N_TILES and K_WARP consecutive k16 tiles of each
// stage (k group kg = w / N_TILES). Warps of the same nt are summed through shared memory when a slice ends.
//
// Pipeline: STAGES-deep cp.async ring over the block's iterations, continuing across slice boundaries:
//   fetch_stage(it + STAGES - 1)  while  compute_stage(it)
#include "marlin_mainloop.cuh"

namespace mwb {

// How partial sums of a slice shared by several blocks are combined (workbench/gemm/geometry.py REDUCE_*).
enum ReduceMode : int {
  kReduceInC = 0,     // lock-ordered; partials rounded to the activation type and kept in C
  kReduceFp32 = 1,    // per-block fp32 slots in C_tmp, summed in block order by the last block to arrive
  kReduceAtomic = 2,  // atomicAdd of activation-typed pairs into a zeroed C (not bitwise reproducible)
};

// n / d for 0 <= n < 2^31, through the host's plan for d (workbench/gemm/launch.py fast_div_plan): floor(n m / 2^s)
// with s = 31 + ceil(log2 d) and m = ceil(2^s / d) < 2^32 (passed as int32 bits). Exact for every such n: m d = 2^s + e
// with 0 <= e < d, so n m / 2^s exceeds n / d by less than 1 / d. Two instructions where a division by a runtime
// divisor takes ~20; used for the block's first iteration, in the code before its first load (docs/performance.md, "The
// dense GEMM", the prologue).
__device__ __forceinline__ int fast_div(int n, int magic, int shift) {
  return static_cast<int>((static_cast<unsigned long long>(static_cast<unsigned>(n)) * static_cast<unsigned>(magic)) >>
                          shift);
}

// The first of block b's iterations [b T / G, (b + 1) T / G) (T = total, G = the grid); the end of its range is
// block_range_start(b + 1). (The prologue forms the same values from the host's plan: fast_div.)
__device__ __forceinline__ long long block_range_start(long long b, long long total) { return b * total / gridDim.x; }

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
  const int first_slice_of_b = static_cast<int>(block_range_start(b, total)) / KI;
  return reinterpret_cast<float4*>(C_tmp) + static_cast<long long>(2 * b + (slice == first_slice_of_b ? 0 : 1)) *
                                                (BM * BN / 4);
}

// Whether the contributors first..last of `slice` hold iterations of this slice only (the first starts at its k = 0,
// the last ends at its k = KI - 1): then none of them has work left after it. Always so on a slice-aligned grid.
__device__ __forceinline__ bool slice_held_whole(int slice, int KI, long long total, int first, int last) {
  return block_range_start(first, total) == static_cast<long long>(slice) * KI &&
         block_range_start(last + 1, total) == static_cast<long long>(slice + 1) * KI;
}

// Sums a shared slice's slots (kReduceFp32) and writes C: share `share` of `shares` of the slot's fragments (slot
// fragment f = share + shares j), all of them by default. Called by the slice's first contributor once every other
// one has counted in (it then leaves the counter zero for the next launch), or, where the slice is held whole, by
// every contributor for its own share (see finish_slice_inline). All 8 warps share the work; a warp sums
// kFragBatch of its fragments at once, with the loads of kBatch contributors for each of them in flight together:
// ceil(count / kBatch) dependent L2 round trips per kFragBatch fragments. Every element is still summed from zero
// over the slots in block order (the caller's own included), so the result does not depend on the order of
// arrival, nor on the batching or the shares. kLoadsInFlight: float4 loads per lane in flight (8 = 32 registers; the
// 128-register two-block kernels spill above 4, measured with -Xptxas -v).
template <typename T, int M_BLOCKS, int N_TILES, int BM, int BN, int kLoadsInFlight>
__device__ __noinline__ void sum_fp32_slots(int slice, int KI, int cols, long long total, T* __restrict__ C,
                                            float* __restrict__ C_tmp, int* __restrict__ locks, const T* __restrict__ bias, int prob_m,
                                            int prob_n, int share = 0, int shares = 1) {
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int chunk = slice / cols, col = slice % cols;
  int first, last;
  slice_contributors(slice, KI, total, first, last);
  constexpr int kFrags = N_TILES * M_BLOCKS * 8;  // float4 fragments (x 32 lanes) of a slot
  constexpr int kFragsPerWarp = kFrags / kWarps;
  constexpr int kBatch = 4;
  constexpr int kFragBatch = (kLoadsInFlight / kBatch < 1) ? 1
                             : (kLoadsInFlight / kBatch < kFragsPerWarp ? kLoadsInFlight / kBatch : kFragsPerWarp);
  // Contributors after `first` hold the start of their range in this slice: it is their first slot (0). Only
  // `first` may be in its second.
  const float4* const first_slot = fp32_slot<BM, BN>(C_tmp, first, slice, KI, total);
  const float4* const slots = reinterpret_cast<const float4*>(C_tmp);
#pragma unroll
  for (int i0 = 0; i0 < kFragsPerWarp; i0 += kFragBatch) {
    if (i0 * kWarps * shares >= kFrags) break;  // (past this block's share: its fragments come first)
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
          const int f = share + shares * ((i0 + u) * kWarps + warp);  // slot order: (nt * M_BLOCKS + mb) * 8 + nb
          if (i0 + u < kFragsPerWarp && f < kFrags && b + j <= last) q[j][u] = __ldcg(theirs + f * 32 + lane);
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
      const int f = share + shares * ((i0 + u) * kWarps + warp);
      if (i0 + u >= kFragsPerWarp || f >= kFrags) continue;  // (a last, partial batch; past the share)
      const int f_nt = f / (M_BLOCKS * 8), f_mb = (f / 8) % M_BLOCKS, f_nb = f % 8;
      const int col_g = col * BN + f_nt * 64 + f_nb * 8 + 2 * (lane % 4);
      const int row_g = chunk * BM + f_mb * 16 + lane / 4;
      T* c_row = C + static_cast<long long>(row_g) * prob_n;
      const float2 bv = bias_pair(bias, col_g, prob_n);  // (the sums are final here)
      if (row_g < prob_m) store_c_pair(c_row, col_g, prob_n, sum[u].x + bv.x, sum[u].y + bv.y);
      if (row_g + 8 < prob_m)
        store_c_pair(c_row + 8LL * prob_n, col_g, prob_n, sum[u].z + bv.x, sum[u].w + bv.y);
    }
  }
  if (shares == 1 && tid == 0) locks[last] = 0;  // leave the counter zero for the next launch
}

// ---- finish a slice: sum the warps of each tile, then across blocks, then write C ---------------------------
// Kept out of line (finish_slice) and working on a local copy of the accumulators where inlining it made the hot
// loop's register allocation spill (measured: 0 vs ~1 KiB of spills at M_BLOCKS = 4); inlined where that measured
// faster (see kInlineFinish). FOLD = false: the caller has folded the warps already (SWAP kernels fold in the loop's
// own layout, on half the values). HELD < M_BLOCKS: the caller folded them split (fold_warps_split_in_ring): every
// warp holds the folded sums of m16 blocks mb0 .. mb0 + HELD - 1 of its tile (acc[mb0 + i]; out of line, acc is the
// local copy, so a runtime index costs nothing) and writes them; else k group 0's warps hold all M_BLOCKS and write
// them.
template <typename T, int M_BLOCKS, int N_TILES, int BM, int BN, int kLoadsInFlight, bool FOLD = true,
          int HELD = M_BLOCKS>
__device__ __forceinline__ void finish_slice_inline(float (&acc)[M_BLOCKS][8][4], float* sRed, int slice, int KI,
                                                    int cols, long long total, T* __restrict__ C,
                                                    float* __restrict__ C_tmp, int* __restrict__ locks, const T* __restrict__ bias, int prob_m,
                                                    int prob_n, int reduce_mode, int mb0 = 0) {
  static_assert(HELD == M_BLOCKS || !FOLD, "a split partial is folded already");
  using Pair = typename Act<T>::Pair;
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int nt = warp % N_TILES;
  const int kg = warp / N_TILES;

  // (1) warps sharing a 64-column tile fold their accumulators (marlin_mainloop.cuh).
  if constexpr (FOLD) fold_warps<M_BLOCKS, N_TILES>(acc, sRed);

  // (2) across blocks. Contributors of this slice are blocks first..last (rank = last - block).
  int first, last;
  slice_contributors(slice, KI, total, first, last);
  const int count = last - first + 1;
  const int chunk = slice / cols, col = slice % cols;
  // after (1), warps 0..N_TILES-1 hold the block's partial; a split partial is held by every warp
  const bool writer = HELD < M_BLOCKS || kg == 0;

  // Stores the block's accumulators into C (rows below M, columns below N only), converted to the activation type;
  // with the bias where the values are final.
  auto write_c = [&](bool final_sums) {
    const T* b = final_sums ? bias : nullptr;
#pragma unroll
    for (int mb = 0; mb < HELD; ++mb)
#pragma unroll
      for (int nb = 0; nb < 8; ++nb) {
        const int col_g = col * BN + nt * 64 + nb * 8 + 2 * (lane % 4);
        const int row_g = chunk * BM + (mb0 + mb) * 16 + lane / 4;
        T* c_row = C + static_cast<long long>(row_g) * prob_n;
        const float2 bv = bias_pair(b, col_g, prob_n);
        if (row_g < prob_m)
          store_c_pair(c_row, col_g, prob_n, acc[mb0 + mb][nb][0] + bv.x, acc[mb0 + mb][nb][1] + bv.y);
        if (row_g + 8 < prob_m)
          store_c_pair(c_row + 8LL * prob_n, col_g, prob_n, acc[mb0 + mb][nb][2] + bv.x, acc[mb0 + mb][nb][3] + bv.y);
      }
  };

  if (count == 1) {
    if (writer) write_c(true);
  } else if (reduce_mode == kReduceAtomic) {
    if (writer) {
#pragma unroll
      for (int mb = 0; mb < HELD; ++mb)
#pragma unroll
        for (int nb = 0; nb < 8; ++nb) {
          const int col_g = col * BN + nt * 64 + nb * 8 + 2 * (lane % 4);
          const int row_g = chunk * BM + (mb0 + mb) * 16 + lane / 4;
          T* c_row = C + static_cast<long long>(row_g) * prob_n;
          // (the first contributor's partial carries the bias: added once)
          const float2 bv = bias_pair(static_cast<int>(blockIdx.x) == first ? bias : nullptr, col_g, prob_n);
          if (row_g < prob_m)
            atomic_add_c_pair(c_row, col_g, prob_n, acc[mb0 + mb][nb][0] + bv.x, acc[mb0 + mb][nb][1] + bv.y);
          if (row_g + 8 < prob_m)
            atomic_add_c_pair(c_row + 8LL * prob_n, col_g, prob_n, acc[mb0 + mb][nb][2] + bv.x,
                              acc[mb0 + mb][nb][3] + bv.y);
        }
    }
  } else if (reduce_mode == kReduceFp32) {
    if (writer) {  // (the first contributor's own slot too: its other warps read it back in the sum)
      float4* mine = fp32_slot<BM, BN>(C_tmp, blockIdx.x, slice, KI, total);
#pragma unroll
      for (int mb = 0; mb < HELD; ++mb)
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)  // fragment-ordered slots: lane-contiguous float4s, one per (nt, mb, nb)
          __stcg(mine + ((nt * M_BLOCKS + mb0 + mb) * 8 + nb) * 32 + lane,
                 make_float4(acc[mb0 + mb][nb][0], acc[mb0 + mb][nb][1], acc[mb0 + mb][nb][2], acc[mb0 + mb][nb][3]));
    }
    // The barrier orders every writer's stores before thread 0's release (others) / before the sum's loads (first).
    __syncthreads();
    if (slice_held_whole(slice, KI, total, first, last)) {
      // No contributor has work left after this slice: all of them count in, wait for each other and sum a share
      // each (with count slots of 64 x 256 fp32 partials, one SM reading them all was bound by its L2 bandwidth: the
      // kernel took three times as long as with its finishing left out; docs/performance.md, "The dense GEMM"). The
      // last one out leaves the counter zero (count arrivals, then count departures).
      if (tid == 0) {
        red_add_release(locks + last, 1);
        while (load_acquire(locks + last) < count) {
        }
      }
      __syncthreads();  // (thread 0's acquire, then the barrier: every thread's loads below see the others' slots)
      sum_fp32_slots<T, M_BLOCKS, N_TILES, BM, BN, kLoadsInFlight>(slice, KI, cols, total, C, C_tmp, locks, bias,
                                                                   prob_m, prob_n, static_cast<int>(blockIdx.x) - first,
                                                                   count);
      if (tid == 0 && atomicAdd(locks + last, 1) == 2 * count - 1) locks[last] = 0;
      return;
    }
    if (static_cast<int>(blockIdx.x) != first) {
      // Count in with release semantics (the barrier above makes them cover every writer's slot stores: PTX
      // cumulativity), paired with the first contributor's acquire load; nobody here needs the count's value, so the
      // block goes straight back to its pipeline.
      if (tid == 0) red_add_release(locks + last, 1);
      return;
    }
    if (tid == 0) {
      while (load_acquire(locks + last) != count - 1) {
      }
    }
    __syncthreads();  // (thread 0's acquire, then the barrier: every thread's loads below see the others' slots)
    sum_fp32_slots<T, M_BLOCKS, N_TILES, BM, BN, kLoadsInFlight>(slice, KI, cols, total, C, C_tmp, locks, bias,
                                                                 prob_m, prob_n);
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
        for (int mb = 0; mb < HELD; ++mb) {
          const int row_g = chunk * BM + (mb0 + mb) * 16 + lane / 4;
          unsigned q[8][2];
#pragma unroll
          for (int nb = 0; nb < 8; ++nb) {  // all loads of this m16 block first: one L2 round trip, not eight
            const int col_g = col * BN + nt * 64 + nb * 8 + 2 * (lane % 4);
            const T* c_row = C + static_cast<long long>(row_g) * prob_n;
            q[nb][0] = row_g < prob_m ? load_c_pair(c_row, col_g, prob_n) : 0u;
            q[nb][1] = row_g + 8 < prob_m ? load_c_pair(c_row + 8LL * prob_n, col_g, prob_n) : 0u;
          }
#pragma unroll
          for (int nb = 0; nb < 8; ++nb) {
            const float2 lo = Act<T>::to_floats(as_pair<Pair>(q[nb][0]));
            const float2 hi = Act<T>::to_floats(as_pair<Pair>(q[nb][1]));
            acc[mb0 + mb][nb][0] += lo.x; acc[mb0 + mb][nb][1] += lo.y;
            acc[mb0 + mb][nb][2] += hi.x; acc[mb0 + mb][nb][3] += hi.y;
          }
        }
      }
    }
    if (writer) write_c(rank == count - 1);  // (the last in the chain writes the final sums)
    __syncthreads();  // every writer's C stores before thread 0's release (cumulativity), as for the fp32 count
    if (tid == 0) store_release(locks + last, rank == count - 1 ? 0 : rank + 1);
  }
}

// The out-of-line copy (see above: kernels with several m16 blocks spilled with the finish inlined).
template <typename T, int M_BLOCKS, int N_TILES, int BM, int BN, int kLoadsInFlight, bool FOLD = true>
__device__ __noinline__ void finish_slice(float (&acc)[M_BLOCKS][8][4], float* sRed, int slice, int KI, int cols,
                                          long long total, T* __restrict__ C, float* __restrict__ C_tmp,
                                          int* __restrict__ locks, const T* __restrict__ bias, int prob_m, int prob_n, int reduce_mode) {
  finish_slice_inline<T, M_BLOCKS, N_TILES, BM, BN, kLoadsInFlight, FOLD>(acc, sRed, slice, KI, cols, total, C, C_tmp,
                                                                          locks, bias, prob_m, prob_n, reduce_mode);
}

// v[0] = the sum of v[0..N) in fold_warps' tree order (halves added pairwise: (v0 + v2) + (v1 + v3) for N = 4), the
// order every warp fold keeps so that its sums are bit for bit fold_warps'.
template <int N>
__device__ __forceinline__ void tree_sum_f4(float4 (&v)[N]) {
#pragma unroll
  for (int step = N / 2; step >= 1; step /= 2)
#pragma unroll
    for (int j = 0; j < step; ++j) {
      v[j].x += v[j + step].x; v[j].y += v[j + step].y; v[j].z += v[j + step].z; v[j].w += v[j + step].w;
    }
}

// Every warp's row-layout partial summed over the k groups in the block's stage ring, every thread at work: each warp
// stores its partial at its k group's place (kg kF4 float4s from ring_base, in fragment order, as a C_tmp slot), one
// block barrier, then each thread sums a few float4s over the k groups in fold_warps' tree order (bit for bit its
// sums) and leaves the sum where k group 0's partial was. The caller makes sure the ring is idle (every warp past its
// last stage, no copy in flight) and passes a block barrier before the sums are read.
template <int M_BLOCKS, int N_TILES>
__device__ __forceinline__ void fold_warps_in_ring(const float (&acc)[M_BLOCKS][8][4], unsigned ring_base) {
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  constexpr int kF4 = N_TILES * M_BLOCKS * 8 * 32;  // float4s of a partial
  constexpr int kGroups = kWarps / N_TILES;          // k groups (warps per 64-column tile)
  const int nt = warp % N_TILES, kg = warp / N_TILES;
#pragma unroll
  for (int mb = 0; mb < M_BLOCKS; ++mb)
#pragma unroll
    for (int nb = 0; nb < 8; ++nb)
      sts128_f32(ring_base + 16 * (kg * kF4 + ((nt * M_BLOCKS + mb) * 8 + nb) * 32 + lane), acc[mb][nb][0],
                 acc[mb][nb][1], acc[mb][nb][2], acc[mb][nb][3]);
  if constexpr (kGroups > 1) {
    __syncthreads();
#pragma unroll
    for (int e = tid; e < kF4; e += kThreads) {
      float4 v[kGroups];
#pragma unroll
      for (int g = 0; g < kGroups; ++g) v[g] = ld_shared_f4(ring_base + 16 * (g * kF4 + e));
      tree_sum_f4(v);
      sts128_f32(ring_base + 16 * e, v[0].x, v[0].y, v[0].z, v[0].w);  // (only this thread reads element e)
    }
  }
}

// The same sums split over the k groups (a reduce-scatter): k group kg ends with the folded sums of m16 blocks
// kg HELD .. kg HELD + HELD - 1 of its tile (HELD = M_BLOCKS / k groups), in place in acc, so that every warp, not
// k group 0 alone, has a share of the finish to write. Each warp stores only the blocks other groups keep: group g's
// values for owner o (g != o) go to region g - (g > o) of (k groups - 1) partials in fragment order, so every region
// is written once and whole. One block barrier, then each warp loads the others' values of its own blocks and sums
// them in fold_warps' tree order (v[g] = group g's values: bit for bit fold_warps' sums). Where fold_warps needs a pass
// per m16 block (the fold buffer holds less than a partial: two barriers each), this takes one, and half the shared
// memory traffic with two groups. The caller makes sure the ring is idle (every warp past its last stage, no copy in
// flight); nothing may write the ring after it.
template <int M_BLOCKS, int N_TILES>
__device__ __forceinline__ void fold_warps_split_in_ring(float (&acc)[M_BLOCKS][8][4], unsigned ring_base) {
  constexpr int kGroups = kWarps / N_TILES;
  constexpr int HELD = M_BLOCKS / kGroups;
  static_assert(kGroups > 1 && M_BLOCKS % kGroups == 0, "every k group keeps the same number of m16 blocks");
  constexpr int kF4 = N_TILES * M_BLOCKS * 8 * 32;  // float4s of a partial (one region)
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int nt = warp % N_TILES, kg = warp / N_TILES;
  auto at = [&](int region, int mb, int nb) {
    return ring_base + 16 * (region * kF4 + ((nt * M_BLOCKS + mb) * 8 + nb) * 32 + lane);
  };
#pragma unroll
  for (int mb = 0; mb < M_BLOCKS; ++mb) {
    const int owner = mb / HELD;
    if (owner == kg) continue;
#pragma unroll
    for (int nb = 0; nb < 8; ++nb)
      sts128_f32(at(kg - (kg > owner), mb, nb), acc[mb][nb][0], acc[mb][nb][1], acc[mb][nb][2], acc[mb][nb][3]);
  }
  __syncthreads();
#pragma unroll
  for (int mb = 0; mb < M_BLOCKS; ++mb) {
    if (mb / HELD != kg) continue;
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) {
      float4 v[kGroups];
#pragma unroll
      for (int g = 0; g < kGroups; ++g)
        v[g] = g == kg ? make_float4(acc[mb][nb][0], acc[mb][nb][1], acc[mb][nb][2], acc[mb][nb][3])
                       : ld_shared_f4(at(g - (g > kg), mb, nb));
      tree_sum_f4(v);
      acc[mb][nb][0] = v[0].x; acc[mb][nb][1] = v[0].y; acc[mb][nb][2] = v[0].z; acc[mb][nb][3] = v[0].w;
    }
  }
}

// finish_slice, or on the block's last slice (no copy goes past it, so once they have landed and every warp is past a
// barrier the stage ring is idle) fold_warps_split_in_ring and the finish of the split partial, on the local copy of
// the accumulators. One out-of-line function for both, called from one place (sass_loop_count, sm_90, M_BLOCKS = 4):
// the split fold inlined in the kernel took the kernel to 255 registers and +1..+5 instructions a stage; a second
// out-of-line function beside finish_slice, ~0.5 KiB of spills in the kernel; this one leaves both as they were.
template <typename T, int M_BLOCKS, int N_TILES, int BM, int BN, int kLoadsInFlight>
__device__ __noinline__ void finish_slice_or_split(float (&acc)[M_BLOCKS][8][4], float* sRed, int slice, int KI,
                                                   int cols, long long total, T* __restrict__ C,
                                                   float* __restrict__ C_tmp, int* __restrict__ locks, const T* __restrict__ bias, int prob_m,
                                                   int prob_n, int reduce_mode) {
  const bool last = block_range_start(blockIdx.x + 1LL, total) <= (slice + 1LL) * KI;  // the block's range ends here
  if (last) {
    constexpr int HELD = M_BLOCKS / (kWarps / N_TILES);
    extern __shared__ int4 smem[];  // (the stage ring starts there: StageRing)
    cp_async_wait<0>();  // (nothing is in flight: no fetch goes past the block's range)
    __syncthreads();     // every warp past its last stage: the ring is idle
    fold_warps_split_in_ring<M_BLOCKS, N_TILES>(acc, smem_addr(smem));
    finish_slice_inline<T, M_BLOCKS, N_TILES, BM, BN, kLoadsInFlight, false, HELD>(
        acc, sRed, slice, KI, cols, total, C, C_tmp, locks, bias, prob_m, prob_n, reduce_mode,
        static_cast<int>(threadIdx.x / 32 / N_TILES) * HELD);
  } else {
    finish_slice_inline<T, M_BLOCKS, N_TILES, BM, BN, kLoadsInFlight>(acc, sRed, slice, KI, cols, total, C, C_tmp,
                                                                      locks, bias, prob_m, prob_n, reduce_mode);
  }
}

// ---- the slice sum inside a thread-block cluster (sm_90) ------------------------------------------------------
// On a slice-aligned grid (workbench/gemm/geometry.py grid_blocks) every slice is split over the same number s of
// consecutive blocks; launched in clusters of CLUSTER = s blocks (marlin_gemm_cluster), a slice's contributors are one
// cluster and read each other's shared memory. Each block puts its folded partial in its own stage ring (idle: the
// block's range is this one slice). Unless FOLDED (k group 0's warps hold it), the fold happens there
// (fold_warps_in_ring, every thread at work instead of one warp in passes: measured faster on every row-layout cell).
// One cluster barrier, then block r sums float4s [r E / s, (r + 1) E / s) of the folded partial over the cluster's
// blocks in rank order (rank = block - first contributor: block order, the same sums as sum_fp32_slots, bit for bit)
// and writes them to C; a second barrier keeps every block's shared memory alive until the others have read it. No
// C_tmp slot, lock or global round trip, and no block waits on a block outside its cluster (whose blocks the hardware
// makes co-resident). `acc`: in the row layout; FOLDED: k group 0's warps hold the block's partial, else each warp its
// own.
template <typename T, int M_BLOCKS, int N_TILES, int BM, int BN, int CLUSTER, bool FOLDED>
__device__ __forceinline__ void finish_slice_cluster(const float (&acc)[M_BLOCKS][8][4], unsigned ring_base,
                                                     int slice, int cols, T* __restrict__ C,
                                                     const T* __restrict__ bias, int prob_m, int prob_n) {
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  constexpr int kF4 = N_TILES * M_BLOCKS * 8 * 32;  // float4s of a partial (fragment order, as a C_tmp slot)
  static_assert(kF4 % CLUSTER == 0, "a cluster's blocks share the partial evenly");
  constexpr int kShare = kF4 / CLUSTER;
  const int nt = warp % N_TILES, kg = warp / N_TILES;
  if constexpr (FOLDED) {  // (fold_warps_in_ring's stores, for k group 0 only; a shared helper changed every cluster
                           // kernel's SASS, nvcc 13 sm_90)
    if (kg == 0) {
#pragma unroll
      for (int mb = 0; mb < M_BLOCKS; ++mb)
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
          sts128_f32(ring_base + 16 * (kg * kF4 + ((nt * M_BLOCKS + mb) * 8 + nb) * 32 + lane), acc[mb][nb][0],
                     acc[mb][nb][1], acc[mb][nb][2], acc[mb][nb][3]);
    }
  } else {
    __syncthreads();  // every warp is past its last stage: the ring is idle
    fold_warps_in_ring<M_BLOCKS, N_TILES>(acc, ring_base);
  }
  cluster_sync();
  const int chunk = slice / cols, col = slice % cols;
  const int rank = static_cast<int>(cluster_ctarank());
  // Sums first, C after the second barrier: its release then has no C stores in flight to wait for (ptxas makes it
  // MEMBAR.ALL.GPU; a barrier without release semantics was faster on every cluster cell but is not ordered under the
  // PTX memory model: docs/performance.md, "Tried and did not pay").
  constexpr int kIters = (kShare + kThreads - 1) / kThreads;
  float4 sums[kIters];
  T* c_row[kIters];
  int c_col[kIters];
  int rows_live[kIters];  // 0: padding (nothing summed or written), 1: row_g only, 2: row_g and row_g + 8
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int i = tid + it * kThreads;
    rows_live[it] = 0;
    if (i >= kShare) continue;
    const int e = rank * kShare + i;
    const int f = e / 32, l = e % 32;
    const int f_nt = f / (M_BLOCKS * 8), f_mb = (f / 8) % M_BLOCKS, f_nb = f % 8;
    const int row_g = chunk * BM + f_mb * 16 + l / 4;
    if (row_g >= prob_m) continue;  // (row_g + 8 too): padding rows are neither summed nor written
    float4 theirs[CLUSTER];
#pragma unroll
    for (int q = 0; q < CLUSTER; ++q) theirs[q] = ld_cluster_f4(cluster_map(ring_base + 16 * e, q));
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int q = 0; q < CLUSTER; ++q) {
      sum.x += theirs[q].x; sum.y += theirs[q].y; sum.z += theirs[q].z; sum.w += theirs[q].w;
    }
    const int col_g = col * BN + f_nt * 64 + f_nb * 8 + 2 * (l % 4);
    const float2 bv = bias_pair(bias, col_g, prob_n);
    sums[it] = make_float4(sum.x + bv.x, sum.y + bv.y, sum.z + bv.x, sum.w + bv.y);
    c_row[it] = C + static_cast<long long>(row_g) * prob_n;
    c_col[it] = col_g;
    rows_live[it] = row_g + 8 < prob_m ? 2 : 1;
  }
  cluster_sync();
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    if (rows_live[it] == 0) continue;
    store_c_pair(c_row[it], c_col[it], prob_n, sums[it].x, sums[it].y);
    if (rows_live[it] == 2) store_c_pair(c_row[it] + 8LL * prob_n, c_col[it], prob_n, sums[it].z, sums[it].w);
  }
}

// How a block finishes its part of a slice (GemmTraits::kFinish). Every strategy sums the warps of a tile and then
// the slice's blocks in the same order, so they give the same bits; they differ in where the sums happen.
enum class Finish {
  kCluster,    // CLUSTER > 1: the slice's blocks add their partials in each other's shared memory
               //   (finish_slice_cluster; the warps fold there too, in the idle ring, unless SWAP folded them)
  kInline,     // one m16 block, where the finish inlined did not spill: fold_warps (unless SWAP folded already),
               //   then finish_slice_inline in the kernel's own code
  kRingFold,   // out of line, row layout, <= 2 m16 blocks, one block per SM: the block's last slice folds its warps
               //   in the idle stage ring (fold_last_slice_in_ring), earlier slices in finish_slice
  kSplitFold,  // out of line, row layout, several m16 blocks that the ring holds split over the k groups:
               //   finish_slice_or_split (on the last slice every warp folds and writes a share)
  kOutOfLine,  // everything else: finish_slice, which folds the warps through the fold buffer
};

// Every mode of gemm_block, derived once from its template parameters:
//
// MIN_BLOCKS: resident blocks per SM the register budget is cut for (2: 128 registers). Two blocks hide the dependent
// LDS -> dequant -> mma chain of one block's 8 warps, but only pay when every block has a long run of pipeline steps
// (workbench/gemm/geometry.py chooses); the 64-row accumulators need one block's registers.
// SWAP = 1: at most 8 rows (M_BLOCKS = 1), the loop on the transposed problem (WarpLoop); 0: row layout.
// CLUSTER > 1 (sm_90, marlin_gemm_cluster): the grid is slice-aligned with CLUSTER blocks per slice, launched in
// clusters of CLUSTER blocks; slices are summed through distributed shared memory (finish_slice_cluster) in the fp32
// reduction's order. The host takes it only for the fp32 reduction.
// LATE_OFF (the batch-invariant kernels, marlin_gemm_invariant): no late scaling whatever late_scale_pays says, so a
// 16-row kernel sums a row exactly as the 32..64-row kernels of its tile do (they never late-scale). K_BASE > 0: the
// stage merges K_WARP / K_BASE stages of the K_BASE-wide tile (WarpLoop's K_BASE: the same sums as that tile).
template <typename T, int W, int M_BLOCKS, int N_TILES, int K_WARP, int STAGES, int GROUP_MODE, int MIN_BLOCKS,
          int SWAP, int CLUSTER, bool LATE_OFF = false, int K_BASE = 0>
struct GemmTraits {
  static_assert(MIN_BLOCKS == 1 || (MIN_BLOCKS == 2 && M_BLOCKS == 1), "two blocks per SM only with 16-row tiles");
  static_assert(CLUSTER == 1 || (M_BLOCKS == 1 && CLUSTER <= 8), "cluster sums: 16-row tiles, at most 8 blocks");
  static_assert(SWAP == 0 || (SWAP == 1 && M_BLOCKS == 1), "the swapped loop covers the 8 rows of one m16 block");
  static_assert(!Weight<W>::kByteScales || GROUP_MODE == kGrouped, "microscaled formats have grouped scales only");
  using G = Geometry<T, W, M_BLOCKS, N_TILES, K_WARP, STAGES, GROUP_MODE>;
  static_assert(CLUSTER == 1 || G::kWarpsPerN * G::BM * G::BN * 4 <= G::kSmemBytes,
                "every k group's partial fits the idle stage ring and fold buffer");
  static constexpr int BM = G::BM, BN = G::BN;

  // A pipeline per warp: with one or two 64-column tiles, one m16 block and K_WARP >= 2 every warp fetches the bytes
  // it reads (its K_WARP k16 rows of B, the group rows of scales / zero points they span), the N_TILES warps of a k
  // group (warps kg N_TILES + nt) together the A chunks and g_idx they share, and each waits for its own copies and
  // its group (one warp: __syncwarp; two: a named barrier of 64 threads) only: no block barrier per stage, so a group
  // whose stage has landed computes while others' still arrive. Slots are refilled by the group that reads them,
  // after its barrier, so releasing one needs no block barrier either. One block per SM (the A copies' pointers cost
  // registers).
  static constexpr bool kWarpFetch = N_TILES <= 2 && M_BLOCKS == 1 && K_WARP >= 2 && MIN_BLOCKS == 1 && K_BASE == 0;
  // Scales applied to fp32 partial sums once per group instead of to every dequantized pair (late_scale_pays).
  static constexpr bool kLateScale = !LATE_OFF && late_scale_pays<MIN_BLOCKS, SWAP, K_WARP>();
  using Loop = WarpLoop<T, W, M_BLOCKS, N_TILES, K_WARP, STAGES, GROUP_MODE, SWAP, kLateScale, kWarpFetch, K_BASE>;
  // float4 loads per lane in flight in the fp32 cross-block sum (the 128-register kernels spill above 4)
  static constexpr int kLoadsInFlight = MIN_BLOCKS == 1 ? 8 : 4;
  // The slice finishing inlined in every one-m16-block kernel, where it measured faster (M <= 8 and the two-block
  // M = 16 kernels). Not where it spilled: several m16 blocks, and the 128-register two-block kernels of weights with
  // zero points or with act-order groups.
  static constexpr bool kInlineFinish =
      M_BLOCKS == 1 && (SWAP || MIN_BLOCKS == 1 || (!Weight<W>::kHasZero && GROUP_MODE != kPerRow));
  // A stage without group reloads between the warp's k16 tiles where the groups span them (grouped scales with
  // G >= 16 K_WARP; the host allows G >= 32 for 16-bit scales, so always for K_WARP <= 2, and G = 16 for NVFP4's
  // byte scales; channelwise and per-row groups never reload
  // there): a second compute_stage form. One block per SM only: with the stage as one scheduling region a swapped
  // two-block kernel ran 24% slower, and the two-block rows-layout kernel spills.
  static constexpr bool kSplitReloads = GROUP_MODE == kGrouped && MIN_BLOCKS == 1;
  // The block's last slice in the row layout without clusters folds its warps in the stage ring, idle by then,
  // every thread at work, instead of fold_warps' passes through the fold buffer (bit for bit the same sums; earlier
  // slices cannot: the next slice's stages are in flight in the ring). Only where the finish is out of line
  // (fold_warps then works on the accumulators' local copy; the inlined one-m16-block finishes did not gain), one
  // block per SM and at most two m16 blocks (the 128-register kernels and a four-block one spilled with it).
  static constexpr bool kRingFold = CLUSTER == 1 && SWAP == 0 && !kInlineFinish && MIN_BLOCKS == 1 && M_BLOCKS <= 2 &&
                                    G::kWarpsPerN > 1 && G::kWarpsPerN * BM * BN * 4 <= G::kRingBytes;
  // Where that does not apply and the ring holds the k groups' exchange, the last slice folds split over the k groups
  // (fold_warps_split_in_ring: one barrier instead of two per m16 block, and every warp writes its share).
  static constexpr bool kSplitFold = !kRingFold && CLUSTER == 1 && SWAP == 0 && !kInlineFinish && MIN_BLOCKS == 1 &&
                                     G::kWarpsPerN > 1 && M_BLOCKS % G::kWarpsPerN == 0 &&
                                     (G::kWarpsPerN - 1) * BM * BN * 4 <= G::kRingBytes;
  static constexpr Finish kFinish = CLUSTER > 1   ? Finish::kCluster
                                    : kSplitFold  ? Finish::kSplitFold
                                    : kInlineFinish ? Finish::kInline
                                    : kRingFold   ? Finish::kRingFold
                                                  : Finish::kOutOfLine;
  // One stage loop per slice segment of the block's range, the finishing after it rather than under a branch inside
  // it, where the finish is inlined or summed in a cluster; else one loop with the finish behind a branch.
  static constexpr bool kSegmentedLoop = kInlineFinish || CLUSTER > 1;
};

// The ring-fold strategy's fold of a block's last slice (Finish::kRingFold): every warp's partial summed over the
// k groups in the idle stage ring (fold_warps_in_ring), then k group 0's warps take their tile's sums back into
// `partial` (fragment order). Nothing may be in flight into the ring; the caller's warps are past their last stage.
template <int M_BLOCKS, int N_TILES, bool kWarpFetch>
__device__ __forceinline__ void fold_last_slice_in_ring(float (&partial)[M_BLOCKS][8][4], unsigned ring_base) {
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  cp_async_wait<0>();  // (nothing is in flight: no fetch goes past the block's range)
  if constexpr (!kWarpFetch) __syncthreads();  // every warp past its last stage: the ring is idle
  fold_warps_in_ring<M_BLOCKS, N_TILES>(partial, ring_base);
  __syncthreads();
  if (warp < N_TILES) {
#pragma unroll
    for (int mb = 0; mb < M_BLOCKS; ++mb)
#pragma unroll
      for (int nb = 0; nb < 8; ++nb) {
        const float4 v = ld_shared_f4(ring_base + 16 * (((warp * M_BLOCKS + mb) * 8 + nb) * 32 + tid % 32));
        partial[mb][nb][0] = v.x; partial[mb][nb][1] = v.y; partial[mb][nb][2] = v.z; partial[mb][nb][3] = v.w;
      }
  }
}

template <typename T, int W, int M_BLOCKS, int N_TILES, int K_WARP, int STAGES, int GROUP_MODE, int MIN_BLOCKS,
          int SWAP, int CLUSTER, bool LATE_OFF = false, int K_BASE = 0>
__device__ __forceinline__ void
gemm_block(const int4* __restrict__ A,       // (M, lda) activations, 16-byte rows (lda % 8 == 0)
           const int4* __restrict__ B,       // (K/16, N*16/pack) int32 Marlin tiles
           T* __restrict__ C,                // (M, N) output
           float* __restrict__ C_tmp,        // (2 gridDim.x, BM*BN) fp32 partial slots (kReduceFp32 only)
           const int4* __restrict__ scales,  // (num_groups, N) act type, Marlin-permuted
           const int4* __restrict__ zeros,   // (num_groups, N/pack) int32 Marlin zero points, or null
           const int* __restrict__ g_idx,    // (K,) sorted group of each Marlin row (kPerRow only)
           int* __restrict__ locks,          // (>= gridDim.x,) int32, zero on entry and on exit
           const T* __restrict__ bias,       // (N,) added to C before its rounding, or null
           // the true sizes: any N (C is (M, N) contiguous), K a multiple of 8 (A's 16-byte chunks); the weight's
           // arrays are those of the weight zero-padded to ceil(K / 16) rows and ceil(N / 64) 64-column tiles
           int prob_m, int prob_n, int prob_k, int lda,
           int group_size,                   // rows per group (a power of two), Marlin row order; -1 = channelwise
           int reduce_mode,
           // the host's division plan (PreparedLaunch._kernel_ints): total steps = steps_q grid + steps_r, and
           // fast_div's (magic, shift) for the grid, KI = ceil(prob_k / BK) and cols = n_tiles_total 64 / BN
           int steps_q, int steps_r, int grid_magic, int grid_shift, int ki_magic, int ki_shift, int cols_magic,
           int cols_shift) {
  using Tr = GemmTraits<T, W, M_BLOCKS, N_TILES, K_WARP, STAGES, GROUP_MODE, MIN_BLOCKS, SWAP, CLUSTER, LATE_OFF,
                        K_BASE>;
  using G = typename Tr::G;
  using Loop = typename Tr::Loop;
  constexpr bool kWarpFetch = Tr::kWarpFetch;
  constexpr int BM = G::BM, BN = G::BN, BK = G::BK;
  constexpr int kLoadsInFlight = Tr::kLoadsInFlight;

  allow_dependent_launch();  // (the next grid's blocks may take SM space as ours retire; see mma.cuh)
  extern __shared__ int4 smem[];
  const StageRing<G> ring(smem);
  // Every cp.async destination below derives from fetch_base, a per-thread register that ptxas cannot prove
  // warp-uniform (opaque_zero; the fold buffer is free until the first tile ends), so no uniform register enters a
  // cache-hinted copy's address (docs/performance.md, "The dense GEMM", copies without an L2 cache hint).
  const unsigned zero_t = opaque_zero(smem_addr(ring.red) + 4 * threadIdx.x);
  const unsigned fetch_base = ring.base + zero_t;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int nt = warp % N_TILES;  // this warp's 64-column tile inside the block tile

  // Tile counts rounded up (the host picks BN dividing the padded width); the last k step may run past K: its
  // weight rows are clamped copies (WeightFetch), its A columns >= K zero-filled (fetch_a).
  const int n_tiles_total = (prob_n + 63) / 64;
  const int n_pad = n_tiles_total * 64;  // the weight arrays' width
  const int KI = (prob_k + BK - 1) / BK;
  const int cols = n_pad / BN;
  const int chunks = (prob_m + BM - 1) / BM;
  const long long total = static_cast<long long>(chunks) * cols * KI;  // < 2^31: the host checks
  // [it_begin, it_end) = [b total / G, (b + 1) total / G) on a grid of G blocks: b steps_q + b steps_r / G
  // (b steps_r < G^2)
  const int block = static_cast<int>(blockIdx.x);
  const int it_begin = block * steps_q + fast_div(block * steps_r, grid_magic, grid_shift);
  int it_end;  // (set after the first weight fetch: that fetch does not need it)
  const int group_shift = GROUP_MODE == kGrouped ? __ffs(group_size) - 1 : 0;  // group of row k = k >> shift
  // NVFP4 has no zero points: its launch passes the fp32 global scale (vLLM's `const float*`, exponent corrections
  // folded in: dequant.cuh) in the zero-point slot (workbench/gemm/launch.py PreparedLaunch.launch).
  const float* const global_scale = reinterpret_cast<const float*>(zeros);

  // ---- fetch: global -> shared of linear iteration (slice = chunk * cols + col, kit) into a ring slot ----------
  // A: BM rows x BK columns (swizzled, Geometry::a_index). Thread t copies chunk c = t % kARowI4 of rows
  // t / kARowI4 + n kARowsPerPass (n < kACopies): one pass of the block covers kARowsPerPass rows. Where that is a
  // multiple of 8, every copy has the same swizzle and its shared position is copy 0's + n kThreads int4; with 4 rows
  // per pass (BK = 512) the swizzle of odd copies is that of row t / kARowI4 + 4, so they start from a_dst_odd.
  // Pointers to the rows (at k = 0) are formed when the fetch enters a chunk; a stage adds k0 / 8.
  constexpr int kARowI4 = BK / 8;
  constexpr int kARowsPerPass = kThreads / kARowI4;
  constexpr int kACopies = (G::kAI4 + kThreads - 1) / kThreads;
  static_assert(kARowsPerPass % 8 == 0 || kARowsPerPass == 4, "copies of one thread share one of two swizzles");
  // SWAP = 1 reads rows 0..7 only: copies whose rows are all >= 8 are never made.
  constexpr int kACopiesUsed = SWAP == 1 ? (8 + kARowsPerPass - 1) / kARowsPerPass : kACopies;
  const bool a_thread_on = G::kAI4 % kThreads == 0 || tid < G::kAI4;  // (BM BK / 8 < 256: the first threads)
  const unsigned a_dst = fetch_base + G::kAOff + 16 * G::a_index(tid / kARowI4, tid % kARowI4);
  const unsigned a_dst_odd =
      fetch_base + G::kAOff + 16 * (G::a_index(tid / kARowI4 + kARowsPerPass, tid % kARowI4) - kThreads);
  // One m16 chunk (prob_m <= BM): the block's rows never change, and rows >= prob_m are never copied, so they hold
  // whatever the shared memory held. That is harmless: row r of the product (column r in the swapped loop) reads row r
  // of A only, every later step (late scaling, the warp and cross-block sums, the C stores) works element by element,
  // and padding rows are never stored. (Zeroing them once in every slot ran before the first weight fetch: ~300
  // instructions a thread at M = 1 with 3 stages, a measurable share of the smallest layers' time; docs/performance.md,
  // "The dense GEMM", the prologue.) With several chunks the last one's padding rows are zero-filled by each copy (the
  // slot held another chunk's rows).
  const bool one_chunk = chunks == 1;
  const int4* a_src[kACopies];  // (row, chunk t % kARowI4, k = 0) of each copy; row 0 for a padding row
  unsigned a_valid = 0;          // bit n: copy n's row is < prob_m
  unsigned a_issue = 0;          // bit n: copy n is made (valid, or zero-filling a padding row when several chunks)
  auto begin_a = [&](int chunk) {
    a_valid = 0;
#pragma unroll
    for (int n = 0; n < kACopies; ++n) {
      const int row = chunk * BM + tid / kARowI4 + n * kARowsPerPass;
      const bool valid = row < prob_m;
      a_valid |= valid ? 1u << n : 0u;
      a_src[n] = A + (valid ? static_cast<long long>(row) * (lda / 8) : 0) + tid % kARowI4;
    }
    a_issue = one_chunk ? a_valid : ~0u;
  };
  // kWarpFetch: the k group's A instead: thread g (of the group's 32 N_TILES) copies n = chunk j = i % kWarpAChunks of
  // row i / kWarpAChunks of its k range (i = g + 32 N_TILES n; chunk 2 kt0 + j of the row), rows the loop reads only
  // (0..7 for SWAP = 1).
  constexpr int kGroupThreads = 32 * N_TILES;
  constexpr int kWarpAChunks = 2 * K_WARP;
  constexpr int kWarpARows = SWAP == 1 ? 8 : BM;
  constexpr int kWarpACopies = kWarpFetch ? (kWarpARows * kWarpAChunks + kGroupThreads - 1) / kGroupThreads : 1;
  const int warp_chunk0 = 2 * K_WARP * (warp / N_TILES);  // the group's first A chunk of a row (kt0 = kg K_WARP)
  const int group_thread = tid % kGroupThreads;
  const int4* wa_src[kWarpACopies];
  unsigned wa_dst[kWarpACopies];
  auto begin_a_warp = [&](int chunk) {
    a_valid = 0;
#pragma unroll
    for (int n = 0; n < kWarpACopies; ++n) {
      const int i = group_thread + kGroupThreads * n;
      const int r = i / kWarpAChunks, c = warp_chunk0 + i % kWarpAChunks;
      const int row = chunk * BM + r;
      const bool valid = i < kWarpARows * kWarpAChunks && row < prob_m;
      a_valid |= valid ? 1u << n : 0u;
      wa_src[n] = A + (valid ? static_cast<long long>(row) * (lda / 8) : 0) + c;
      wa_dst[n] = fetch_base + G::kAOff + 16 * G::a_index(r < kWarpARows ? r : 0, c);
    }
    // (one chunk: padding rows are never copied; several: each copy of a padding row zero-fills it)
    a_issue = 0;
#pragma unroll
    for (int n = 0; n < kWarpACopies; ++n)
      a_issue |= ((one_chunk ? (a_valid >> n) & 1u : 1u) && group_thread + kGroupThreads * n < kWarpARows *
                  kWarpAChunks) ? 1u << n : 0u;
  };
  WeightFetch<G, W, GROUP_MODE, kWarpFetch> wfetch;
  wfetch.init(n_tiles_total, prob_k, group_size, fetch_base);
  auto begin_slice_a = [&](int chunk) {
    if constexpr (kWarpFetch)
      begin_a_warp(chunk);
    else
      begin_a(chunk);
  };
  auto begin_slice = [&](int chunk, int col) {
    begin_slice_a(chunk);
    wfetch.begin(B, scales, zeros, g_idx, col, n_tiles_total);
  };
  // A's columns >= K (the last k step of a K that BK does not divide) are zero-filled, from the row's first chunk:
  // they meet the weight's padding or clamped rows, whose products must be exact zeros (an 8-bit K = 4 mod 8 ends
  // inside a chunk: its first bytes are copied). Every copy of a thread reads the same chunk column of its rows
  // (kWarpFetch: the group's 32 N_TILES threads are a multiple of its chunks per row), so one bound per thread: a_left,
  // the columns of K from that chunk's column at k step 0.
  static_assert(!kWarpFetch || kGroupThreads % kWarpAChunks == 0, "a thread's A copies share their chunk column");
  const int a_left = prob_k - 8 * (kWarpFetch ? warp_chunk0 + group_thread % kWarpAChunks : tid % kARowI4);
  auto fetch_a = [&](unsigned slot, int kit) {
    const int bytes = a_chunk_bytes(a_left - kit * BK);
    const int a_step = bytes > 0 ? kit * (BK / 8) : 0;
    if constexpr (kWarpFetch) {
#pragma unroll
      for (int n = 0; n < kWarpACopies; ++n)
        if ((a_issue >> n) & 1u)
          cp_async16_zfill_at(slot + wa_dst[n], wa_src[n] + a_step, (a_valid >> n) & 1u ? bytes : 0);
    } else if (a_thread_on) {
#pragma unroll
      for (int n = 0; n < kACopiesUsed; ++n) {
        if ((a_issue >> n) & 1u)
          cp_async16_zfill_at(slot + ((kARowsPerPass % 8 != 0 && n % 2) ? a_dst_odd : a_dst) + 16 * n * kThreads,
                              a_src[n] + a_step, (a_valid >> n) & 1u ? bytes : 0);
      }
    }
  };
  auto fetch_stage = [&](unsigned slot, int kit) {
    fetch_a(slot, kit);
    wfetch.fetch(slot, kit, group_shift);
  };

  // ---- per-slice state: this warp's accumulators and the current group's pairs (marlin_mainloop.cuh) ---------
  Loop loop;
  const typename Loop::LaneOffsets lane_off = Loop::lane_offsets();
  auto load_channelwise = [&](int col) {
    loop.load_channelwise(reinterpret_cast<const T*>(scales) + col * BN + nt * 64,
                          reinterpret_cast<const unsigned*>(zeros) + (col * BN + nt * 64) / Weight<W>::kPack);
  };
  // (groups are >= kMinGroup rows: 32, or NVFP4's 16, which reloads at K_WARP = 2 too)
  const bool stage_reloads = Loop::kSpan > Weight<W>::kMinGroup && group_size < Loop::kSpan;
  auto compute_stage = [&](unsigned slot, int slice, int kit) {
    if (Tr::kSplitReloads && !stage_reloads)
      loop.template compute_stage<false>(slot, lane_off, kit * BK, group_size, group_shift, scales, zeros, n_pad,
                                         slice % cols);
    else
      loop.compute_stage(slot, lane_off, kit * BK, group_size, group_shift, scales, zeros, n_pad, slice % cols);
  };
  auto zero_acc = [&]() { loop.zero_acc(); };

  // ---- main loop -------------------------------------------------------------------------------------------
  zero_acc();
  // The block's first iteration (slice, k step), and that slice's (chunk, col) (fast_div: no division instructions in
  // the code before the block's first load).
  const int slice0 = fast_div(it_begin, ki_magic, ki_shift);
  const int kit0 = it_begin - slice0 * KI;
  int f_kit = kit0;  // next iteration to fetch
  int f_chunk = fast_div(slice0, cols_magic, cols_shift);
  int f_col = slice0 - f_chunk * cols;  // its slice's (chunk, col), kept without a division per stage
  auto advance = [&](int& sl, int& kk) {
    if (++kk == KI) {
      kk = 0;
      ++sl;
    }
  };
  int it_fetch = it_begin;
  // After a fetch: the next iteration; entering a new slice forms its pointers (only if it is still this block's).
  auto advance_fetch = [&]() {
    ++it_fetch;
    if (++f_kit == KI) {
      f_kit = 0;
      if (++f_col == cols) {
        f_col = 0;
        ++f_chunk;
      }
      if (it_fetch < it_end) begin_slice(f_chunk, f_col);
    }
  };
  const unsigned last_off = zero_t + (STAGES - 1) * G::kStageBytes;
  unsigned fetch_off = last_off;  // the main loop's first refill: slot STAGES - 1, then 0, 1, ...
  // The first STAGES - 1 stages. Under a programmatic dependent launch the activations may still be being written by
  // the grid before this one; the weights, scales, zero points and g_idx are not. With one chunk (A's pointers never
  // change) stage 0's weights are fetched before the wait, its activations after it, in the same commit group; the
  // other stages after the wait as usual (fetching all of the prologue's weights first made stage 0 wait for them
  // all where the launch is plain). Not on sm_80 (no such launch).
  // The weights' pointers first, then (weights_first) stage 0's weights in flight, then the end of the block's range
  // and the activations' pointers, which that fetch does not need: every instruction before a block's first load
  // delays all of its stages. ptxas hoists arithmetic above a cp.async, not above the __syncwarp, so the fence keeps
  // the first copies early (without it the one-block swapped kernels of weights with zero points lost up to 5%).
  // Both stay before the wait, where a block that starts while the grid before still runs has time to spare.
  const bool weights_first = kProgrammaticLaunch && one_chunk;
  // (No block's range is empty: the host launches at most one block per pipeline step, grid <= total.)
  wfetch.begin(B, scales, zeros, g_idx, f_col, n_tiles_total);
  if (weights_first) wfetch.fetch(zero_t, f_kit, group_shift);
  __syncwarp();
  it_end = (block + 1) * steps_q + fast_div((block + 1) * steps_r, grid_magic, grid_shift);
  begin_slice_a(f_chunk);
  grid_dependency_wait();
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (it_fetch < it_end) {
      if (st == 0 && weights_first)
        fetch_a(zero_t, f_kit);
      else
        fetch_stage(zero_t + st * G::kStageBytes, f_kit);
    }
    cp_async_commit();
    advance_fetch();
  }
  SlotCursor<G, STAGES> cursor(ring.base);
  int slice = slice0, kit = kit0;
  // One pipeline stage: wait for the compute slot, refill the slot STAGES - 1 ahead, compute.
  // The compute slot visible to the warps that read it, the slot fetched below released by them: the whole block, or
  // with kWarpFetch this warp's k group alone (it fetched every byte it reads and refills only those).
  auto stage_barrier = [&]() {
    if constexpr (kWarpFetch && N_TILES == 1)
      __syncwarp();
    else if constexpr (kWarpFetch)
      named_barrier(1 + warp / N_TILES, kGroupThreads);
    else
      __syncthreads();
  };
  auto run_stage = [&](int slice_, int kit_) {
    cp_async_wait<STAGES - 2>();
    stage_barrier();  // the compute slot is visible to its readers; the slot fetched below was released by them
    if (it_fetch < it_end) fetch_stage(fetch_off, f_kit);
    cp_async_commit();
    advance_fetch();
    compute_stage(cursor.slot, slice_, kit_);
    cursor.advance();
    fetch_off = fetch_off == last_off ? zero_t : fetch_off + G::kStageBytes;
  };
  // The end of this block's part of slice slice_ (last: no stage of the block's range follows it), by the traits'
  // finishing strategy (Finish). SWAP kernels fold the warps in the loop's own layout first (elementwise: the same
  // sums as after the transpose, on half the values).
  auto end_slice = [&](int slice_, bool last) {
    // kWarpFetch: every warp done with its stages before the finishing reuses shared memory (the fold buffer, the
    // cluster kernels' idle ring), and the previous fold's reads of the fold buffer done (with a barrier per stage,
    // a stage lies between two folds)
    if constexpr (kWarpFetch) __syncthreads();
    float partial[M_BLOCKS][8][4];
    if constexpr (SWAP) fold_warps<Loop::kAccM, N_TILES>(loop.acc, ring.red);
    loop.rows_layout(partial);
    if constexpr (Weight<W>::kGlobalScale) {  // NVFP4: every block's fp32 partial times the global scale
      const float gs = __ldg(global_scale);
#pragma unroll
      for (int mb = 0; mb < M_BLOCKS; ++mb)
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
          for (int r = 0; r < 4; ++r) partial[mb][nb][r] *= gs;
    }
    if constexpr (Tr::kFinish == Finish::kCluster) {  // (row-layout warps are folded there)
      cp_async_wait<0>();  // (nothing is in flight: the last fetch was waited for before its compute)
      finish_slice_cluster<T, M_BLOCKS, N_TILES, BM, BN, CLUSTER, SWAP != 0>(partial, ring.base, slice_, cols, C,
                                                                             bias, prob_m, prob_n);
    } else if constexpr (Tr::kFinish == Finish::kSplitFold) {
      finish_slice_or_split<T, M_BLOCKS, N_TILES, BM, BN, kLoadsInFlight>(partial, ring.red, slice_, KI, cols, total,
                                                                          C, C_tmp, locks, bias, prob_m, prob_n,
                                                                          reduce_mode);
    } else if constexpr (Tr::kFinish == Finish::kInline) {
      if constexpr (!SWAP) fold_warps<M_BLOCKS, N_TILES>(partial, ring.red);
      finish_slice_inline<T, M_BLOCKS, N_TILES, BM, BN, kLoadsInFlight, false>(
          partial, ring.red, slice_, KI, cols, total, C, C_tmp, locks, bias, prob_m, prob_n, reduce_mode);
    } else if constexpr (Tr::kFinish == Finish::kRingFold) {
      if (last) {
        fold_last_slice_in_ring<M_BLOCKS, N_TILES, kWarpFetch>(partial, ring.base);
        finish_slice<T, M_BLOCKS, N_TILES, BM, BN, kLoadsInFlight, false>(partial, ring.red, slice_, KI, cols, total,
                                                                          C, C_tmp, locks, bias, prob_m, prob_n,
                                                                          reduce_mode);
      } else {
        finish_slice<T, M_BLOCKS, N_TILES, BM, BN, kLoadsInFlight>(partial, ring.red, slice_, KI, cols, total, C,
                                                                   C_tmp, locks, bias, prob_m, prob_n, reduce_mode);
      }
    } else {  // Finish::kOutOfLine (FOLD unless SWAP folded)
      finish_slice<T, M_BLOCKS, N_TILES, BM, BN, kLoadsInFlight, SWAP == 0>(partial, ring.red, slice_, KI, cols, total,
                                                                            C, C_tmp, locks, bias, prob_m, prob_n,
                                                                            reduce_mode);
    }
    zero_acc();
  };
  if constexpr (Tr::kSegmentedLoop) {  // (at most the first and the last segment end mid-slice)
    for (int it = it_begin; it < it_end;) {
      const int seg_end = it_end < it + (KI - kit) ? it_end : it + (KI - kit);
      if constexpr (GROUP_MODE == kChannelwise) load_channelwise(slice % cols);
      for (; it < seg_end; ++it, ++kit) run_stage(slice, kit);
      end_slice(slice, it == it_end);
      kit = 0;  // a next segment starts a new slice at its first k step
      ++slice;
    }
  } else {
    for (int it = it_begin; it < it_end; ++it) {
      if constexpr (GROUP_MODE == kChannelwise) {
        if (it == it_begin || kit == 0) load_channelwise(slice % cols);
      }
      run_stage(slice, kit);
      if (kit + 1 == KI || it + 1 == it_end) end_slice(slice, it + 1 == it_end);
      advance(slice, kit);
    }
  }
  cp_async_wait<0>();
}

#define MWB_GEMM_PARAMS                                                                                          \
  const int4 *__restrict__ A, const int4 *__restrict__ B, T *__restrict__ C, float *__restrict__ C_tmp,           \
      const int4 *__restrict__ scales, const int4 *__restrict__ zeros, const int *__restrict__ g_idx,              \
      int *__restrict__ locks, const T *__restrict__ bias, int prob_m, int prob_n, int prob_k, int lda,           \
      int group_size, int reduce_mode,                                                                            \
      int steps_q, int steps_r, int grid_magic, int grid_shift, int ki_magic, int ki_shift, int cols_magic,        \
      int cols_shift
#define MWB_GEMM_ARGS                                                                                            \
  A, B, C, C_tmp, scales, zeros, g_idx, locks, bias, prob_m, prob_n, prob_k, lda, group_size, reduce_mode,       \
      steps_q, steps_r, grid_magic, grid_shift, ki_magic, ki_shift, cols_magic, cols_shift

template <typename T, int W, int M_BLOCKS, int N_TILES, int K_WARP, int STAGES, int GROUP_MODE, int MIN_BLOCKS,
          int SWAP>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS) marlin_gemm(MWB_GEMM_PARAMS) {
  gemm_block<T, W, M_BLOCKS, N_TILES, K_WARP, STAGES, GROUP_MODE, MIN_BLOCKS, SWAP, 1>(MWB_GEMM_ARGS);
}

// The same kernel launched in clusters of CLUSTER blocks (compile-time cluster shape: a plain launch of a grid that
// CLUSTER divides). sm_90 and newer; the attribute is left out of sm_80 device code, where it is never launched.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define MWB_CLUSTER_DIMS(n) __cluster_dims__(n, 1, 1)
#else
#define MWB_CLUSTER_DIMS(n)
#endif
template <typename T, int W, int M_BLOCKS, int N_TILES, int K_WARP, int STAGES, int GROUP_MODE, int MIN_BLOCKS,
          int SWAP, int CLUSTER>
__global__ void MWB_CLUSTER_DIMS(CLUSTER) __launch_bounds__(kThreads, MIN_BLOCKS)
    marlin_gemm_cluster(MWB_GEMM_PARAMS) {
  gemm_block<T, W, M_BLOCKS, N_TILES, K_WARP, STAGES, GROUP_MODE, MIN_BLOCKS, SWAP, CLUSTER>(MWB_GEMM_ARGS);
}
template <typename T, int W, int M_BLOCKS, int N_TILES, int K_WARP, int STAGES, int GROUP_MODE, int MIN_BLOCKS,
          int SWAP, int CLUSTER, int K_BASE>
__global__ void MWB_CLUSTER_DIMS(CLUSTER) __launch_bounds__(kThreads, MIN_BLOCKS)
    marlin_gemm_cluster_invariant(MWB_GEMM_PARAMS) {
  gemm_block<T, W, M_BLOCKS, N_TILES, K_WARP, STAGES, GROUP_MODE, MIN_BLOCKS, SWAP, CLUSTER, true, K_BASE>(
      MWB_GEMM_ARGS);
}
#undef MWB_CLUSTER_DIMS

// The batch-invariant mode's kernels (workbench/gemm/geometry.py choose_invariant_config; docs/performance.md, "Batch
// invariance"): marlin_gemm without late scaling (LATE_OFF), so that its 16-row kernels, swapped or not, sum a row as
// the 32..64-row kernels of the same tile do, and the mode can take the default's tiles for every M
// (marlin_gemm_cluster_invariant: the same in clusters). K_BASE > 0 (16-row kernels): each pipeline stage is
// K_WARP / K_BASE stages of the K_WARP = K_BASE tile, summed as that tile sums them (WarpLoop), so that the 16-row
// kernel pays a stage's fixed cost once per merged stage and still gives the bits of the 32..64-row kernels; the host
// merges only where every block's range is whole merged stages.
// WALK = 1 (four m16 blocks, the fp32 reduction, a slice-aligned grid of s > 1 blocks per column slice): one launch
// over every 64-row chunk of A, each block summing the same k steps of its slice in chunk after chunk (the host's
// division plan is one chunk's), instead of one launch per chunk. Chunk c keeps its partials in the blocks' C_tmp
// slots of parity c % 2 and counts in the locks [(c % 2) G, (c % 2 + 1) G): a slice-aligned block writes one partial
// per chunk, in its first slot (slot 2 b), so the second (2 b + 1) is free; a block can reach chunk c + 2 only once
// every block of its slice has counted in to chunk c + 1, i.e. finished reading chunk c's slots and left its lock
// zero, so the two parities never overlap. The rows of a chunk are summed as in a launch of that chunk alone: the
// same bits.
template <typename T, int W, int M_BLOCKS, int N_TILES, int K_WARP, int STAGES, int GROUP_MODE, int MIN_BLOCKS,
          int SWAP, int WALK, int K_BASE>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS) marlin_gemm_invariant(MWB_GEMM_PARAMS) {
  if constexpr (WALK == 0) {
    gemm_block<T, W, M_BLOCKS, N_TILES, K_WARP, STAGES, GROUP_MODE, MIN_BLOCKS, SWAP, 1, true, K_BASE>(MWB_GEMM_ARGS);
  } else {
    static_assert(M_BLOCKS == 4 && SWAP == 0 && MIN_BLOCKS == 1 && K_BASE == 0, "the chunk walk is for 64-row tiles");
    constexpr int BM = 16 * M_BLOCKS, BN = 64 * N_TILES;
    const int chunks = (prob_m + BM - 1) / BM;
    for (int chunk = 0; chunk < chunks; ++chunk) {
      if (chunk > 0) __syncthreads();  // every warp done with the ring and the fold buffer before the next prologue
      const int parity = chunk & 1;
      gemm_block<T, W, M_BLOCKS, N_TILES, K_WARP, STAGES, GROUP_MODE, MIN_BLOCKS, SWAP, 1, true>(
          A + static_cast<long long>(chunk) * BM * (lda / 8), B, C + static_cast<long long>(chunk) * BM * prob_n,
          C_tmp + parity * (BM * BN), scales, zeros, g_idx, locks + parity * static_cast<int>(gridDim.x), bias,
          prob_m - chunk * BM < BM ? prob_m - chunk * BM : BM, prob_n, prob_k, lda, group_size, reduce_mode, steps_q,
          steps_r, grid_magic, grid_shift, ki_magic, ki_shift, cols_magic, cols_shift);
    }
  }
}
#undef MWB_GEMM_ARGS
#undef MWB_GEMM_PARAMS

// A'[m, k] = A[m, perm[k]]: act-order activations gathered into Marlin row order (docs/formats.md, "Act-order"). One
// block per row.
template <typename T>
__global__ void permute_cols(const T* __restrict__ A, const int* __restrict__ perm, T* __restrict__ out, int prob_m,
                             int prob_k, int lda) {
  const long long row = blockIdx.x;
  for (int k = threadIdx.x; k < prob_k; k += blockDim.x) out[row * prob_k + k] = A[row * lda + perm[k]];
}

}  // namespace mwb
