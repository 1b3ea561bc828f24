// The main loop shared by the dense Marlin GEMM (marlin_gemm.cu) and the fused MoE GEMM (marlin_moe.cu): the
// shared-memory layout of a pipeline stage, the weight / scale / zero-point part of the global -> shared fetch, and
// the register-level work of one stage (scale + offset pairs, B words from shared memory, A ldmatrix, dequant + mma).
//
// What stays in each kernel: which (rows, column tile, k step) a stage belongs to, the A fetch (dense: rows of A;
// MoE: rows gathered by sorted id), the pipeline order, and how a finished tile reaches C (dense: striped split-K and
// slice finishing; MoE: scatter with the router weight).
//
// One block = 8 warps. Warp w owns 64-column tile nt = w % N_TILES of the block tile and K_WARP consecutive k16 tiles
// of each stage (k group kg = w / N_TILES).
#pragma once

#include "dequant.cuh"

namespace mwb {

constexpr int kThreads = 256;  // 8 warps: enough independent mma chains per SM with one block per SM
constexpr int kWarps = kThreads / 32;

// How scales are indexed (workbench/gemm.py GROUP_*). A template parameter, so the hot loop has no branch on it.
enum GroupMode : int {
  kChannelwise = 0,  // one scale row (P32 layout), applied per element
  kGrouped = 1,      // group of Marlin row k = k >> log2(group_size) (P64 layout), staged per pipeline step
  kPerRow = 2,       // act-order on a K shard (is_k_full = false): group of row k = g_idx[k]
};

// Compile-time geometry of one kernel instantiation. Python mirrors kSmemBytes in workbench/gemm.py
// (TileGeometry.smem_bytes, used by both KernelConfig and MoeConfig).
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

  // Where A chunk c (16 bytes) of stage row r lives: c ^ (r % 8), so that ldmatrix's 8 row reads of one column
  // block hit 8 different bank groups.
  __device__ __forceinline__ static int a_index(int r, int c) { return r * (BK / 8) + (c ^ (r % 8)); }
};

// The dynamic shared memory of a kernel, carved into STAGES-deep rings (slot-major) and the warp-fold buffer.
template <typename G, int STAGES>
struct StageRings {
  int4* A;
  int4* B;
  int4* S;
  int4* Z;
  int4* Gi;   // g_idx (kPerRow only)
  float* red;  // warp fold of a finished tile (kRedI4)
  __device__ __forceinline__ explicit StageRings(int4* smem) {
    A = smem;
    B = A + STAGES * G::kAI4;
    S = B + STAGES * G::kBI4;
    Z = S + STAGES * G::kSI4;
    Gi = Z + STAGES * G::kZI4;
    red = reinterpret_cast<float*>(Gi + STAGES * G::kGI4);
  }
};

// ---- fetch: global -> shared of the weight side of one stage ------------------------------------------------
// B: KT rows of N_TILES consecutive 16x64 tiles starting at k16 row kit * KT and 64-column tile col * N_TILES of a
// (K/16, n_tiles_total tiles) Marlin matrix (B points at its first tile: the expert's for MoE). 8-bit tiles give
// each lane 32 bytes; storing the two 16-byte halves of all lanes apart (all first halves, then all second halves)
// keeps the lane reads conflict-free. Grouped scales (and zero points) of the group rows the stage spans; g_idx of
// its rows (kPerRow). All through cp.async; the caller commits.
template <typename G, int W, int GROUP_MODE>
__device__ __forceinline__ void fetch_weight_stage(int4* b_dst, int4* s_dst, int4* z_dst, int4* g_dst,
                                                   const int4* __restrict__ B, const int4* __restrict__ scales,
                                                   const int4* __restrict__ zeros, const int* __restrict__ g_idx,
                                                   int kit, int col, int n_tiles_total, int prob_n, int group_size,
                                                   int group_shift, unsigned long long weight_policy) {
  constexpr int N_TILES = G::BN / 64;
  const int tid = threadIdx.x;
  const int k0 = kit * G::BK;
  // A trip count known at compile time (not `i = tid; i < n; i += kThreads`, whose count depends on tid): the copies
  // unroll fully, without the remainder tests and per-copy index arithmetic the runtime loop compiled to.
  const int4* b_stage = B + (static_cast<long long>(kit) * G::KT * n_tiles_total + col * N_TILES) * G::kTileI4;
#pragma unroll
  for (int n = 0; n < (G::kBI4 + kThreads - 1) / kThreads; ++n) {
    const int i = tid + n * kThreads;
    if (G::kBI4 % kThreads != 0 && i >= G::kBI4) break;
    const int kt = i / (N_TILES * G::kTileI4);
    const int rem = i % (N_TILES * G::kTileI4);
    const int j = rem % G::kTileI4;
    const int swz = (G::kTileI4 == 64) ? (j % 2) * 32 + j / 2 : j;
    const int4* src = b_stage + static_cast<long long>(kt) * n_tiles_total * G::kTileI4 + rem;
    cp_async16_stream(b_dst + kt * N_TILES * G::kTileI4 + (rem - j) + swz, src, weight_policy);
  }
  if constexpr (GROUP_MODE == kGrouped) {
    // The group rows this stage spans: one when G >= BK, else BK / G (G and BK are powers of two >= 32).
    const int g0 = k0 >> group_shift;
    const int rows = G::BK > group_size ? G::BK >> group_shift : 1;  // <= kScaleRows
    // Bounded by the stage's capacity (kSI4 / kZI4) at compile time, the row count tested at run time (as above).
#pragma unroll
    for (int n = 0; n < (G::kSI4 + kThreads - 1) / kThreads; ++n) {
      const int i = tid + n * kThreads;
      if (i >= rows * (G::BN / 8)) break;
      const int r = i / (G::BN / 8), c = i % (G::BN / 8);
      cp_async16(s_dst + i, scales + (static_cast<long long>(g0 + r) * prob_n + col * G::BN) / 8 + c);
    }
    if constexpr (Weight<W>::kHasZero) {
      constexpr int kZRowI4 = G::BN / Weight<W>::kPack / 4;
#pragma unroll
      for (int n = 0; n < (G::kZI4 + kThreads - 1) / kThreads; ++n) {
        const int i = tid + n * kThreads;
        if (i >= rows * kZRowI4) break;
        const int r = i / kZRowI4, c = i % kZRowI4;
        cp_async16(z_dst + i, zeros + (static_cast<long long>(g0 + r) * prob_n / Weight<W>::kPack +
                                       col * G::BN / Weight<W>::kPack) / 4 + c);
      }
    }
  }
  if constexpr (GROUP_MODE == kPerRow) {
#pragma unroll
    for (int n = 0; n < (G::kGI4 + kThreads - 1) / kThreads; ++n) {
      const int i = tid + n * kThreads;
      if (G::kGI4 % kThreads != 0 && i >= G::kGI4) break;
      cp_async16(g_dst + i, g_idx + k0 + 4 * i);
    }
  }
}

// ---- the register side -------------------------------------------------------------------------------------
// One warp's accumulators and the current group's scale / offset pairs, and the work of one stage.
//
// Pairs for sub-block s, column half h are valid for every row of the current group (channelwise: the whole
// column tile). They are rebuilt only when the group changes, so the per-tile work is dequant + mma.
//
// SWAP (at most 8 rows, M_BLOCKS = 1): the four registers a lane dequantizes for a 16x16 sub-block are exactly the
// mma A fragment of its transpose (rows n0, n0 + 8 of W^T, k pairs 2t, 2t + 8), and the A tile's first 8 rows
// loaded by ldmatrix.x2 are the B fragment of A^T, so one mma.m16n8k16 gives C^T for the sub-block's 16 columns x
// 8 rows, instead of two mma (16 rows x 8 columns each, half of the rows padding). Same products, same k order.
template <typename T, int W, int M_BLOCKS, int N_TILES, int K_WARP, int STAGES, int GROUP_MODE, bool SWAP = false>
struct WarpLoop {
  using G = Geometry<T, W, M_BLOCKS, N_TILES, K_WARP, STAGES, GROUP_MODE>;
  using Pair = typename Act<T>::Pair;
  static_assert(!SWAP || M_BLOCKS == 1, "the swapped mma covers 8 rows");
  static constexpr bool kHasZero = Weight<W>::kHasZero;
  static constexpr int kWordsPerLane = 16 * 64 / Weight<W>::kPack / 32;  // 4 (4-bit) or 8 (8-bit) words of a tile
  static constexpr int kAccN = SWAP ? 4 : 8;

  // [m16 block][n8 block = 2 s + h][mma C registers]: C rows lane/4 (+8 for registers 2, 3), columns 8 nb + 2 (lane
  // % 4) (+1). SWAP: [0][sub-block s][r]: C^T, i.e. C columns 16 s + lane/4 (+8 for r = 2, 3), rows 2 (lane % 4)
  // (+1 for odd r); see rows_layout.
  float acc[M_BLOCKS][kAccN][4];
  Pair g_sc[4][2];
  unsigned g_off[4][2];    // (magic + zero) pairs
  unsigned g_off16[4][2];  // -(64 + zero) fp16 pairs (fp16 4-bit high nibbles)

  __device__ __forceinline__ void zero_acc() {
#pragma unroll
    for (int mb = 0; mb < M_BLOCKS; ++mb)
#pragma unroll
      for (int nb = 0; nb < kAccN; ++nb)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[mb][nb][r] = 0.f;
  }

  // The accumulators in the row layout (acc's when !SWAP) that the kernels' finishing code reads. SWAP: a transpose
  // across lanes (two shuffles per value, once per finished tile); rows 8..15 (padding) are zero.
  __device__ __forceinline__ void rows_layout(float (&out)[M_BLOCKS][8][4]) const {
    if constexpr (!SWAP) {
#pragma unroll
      for (int mb = 0; mb < M_BLOCKS; ++mb)
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
          for (int r = 0; r < 4; ++r) out[mb][nb][r] = acc[mb][nb][r];
    } else {
      // out[0][nb][r] (r < 2) = C[row i = lane / 4][column 8 nb + 2 (lane % 4) + r], held by the lane with
      // lane / 4 = that column's offset in its sub-block s = nb / 2 (modulo 8) and lane % 4 = i / 2, in acc
      // register 2 (nb % 2) + i % 2.
      const int lane = threadIdx.x % 32;
      const int row = lane / 4;
#pragma unroll
      for (int nb = 0; nb < 8; ++nb)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int src = 4 * (2 * (lane % 4) + r) + row / 2;
          const float even = __shfl_sync(0xffffffffu, acc[0][nb / 2][2 * (nb % 2)], src);
          const float odd = __shfl_sync(0xffffffffu, acc[0][nb / 2][2 * (nb % 2) + 1], src);
          out[0][nb][r] = (row % 2) ? odd : even;
          out[0][nb][r + 2] = 0.f;
        }
    }
  }

  // Offsets of (s, h) from this lane's zero-point words (or the fixed bias).
  __device__ __forceinline__ void set_offsets(const unsigned* zw) {
#pragma unroll
    for (int s_ = 0; s_ < 4; ++s_)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int z = kHasZero ? zero_of<W>(zw, s_, h) : Weight<W>::kBias;
        g_off[s_][h] = splat_bits(offset_bits<T, W>(z));
        g_off16[s_][h] = splat_bits(neg_offset16_bits(z));
      }
  }

  // Channelwise: the pairs of this warp's 64-column tile. sp / zp: the scale row / zero-point row (global) at the
  // tile's first column (zp unused without zero points).
  __device__ __forceinline__ void load_channelwise(const T* sp, const unsigned* zp) {
    const int lane_col = (threadIdx.x % 32) / 4;
#pragma unroll
    for (int s_ = 0; s_ < 4; ++s_)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const T v = sp[channelwise_scale_index(lane_col, s_, h)];
        g_sc[s_][h] = Act<T>::pair(v, v);
      }
    unsigned zw[2] = {0u, 0u};
    if constexpr (kHasZero) {
      zw[0] = zp[lane_col * (Weight<W>::kBits / 4)];
      if (Weight<W>::kBits == 8) zw[1] = zp[2 * lane_col + 1];
    }
    set_offsets(zw);
  }

  // Grouped: the pairs of group row g of a stage (a P64 16-byte vector: word s = (scale(s,0), scale(s,1))).
  __device__ __forceinline__ void load_group(const int4* s_stage, const int4* z_stage, int g, int nt) {
    const int lane_col = (threadIdx.x % 32) / 4;
    const int4 sv = s_stage[g * (G::BN / 8) + nt * 8 + lane_col];
    const unsigned w[4] = {static_cast<unsigned>(sv.x), static_cast<unsigned>(sv.y), static_cast<unsigned>(sv.z),
                           static_cast<unsigned>(sv.w)};
#pragma unroll
    for (int s_ = 0; s_ < 4; ++s_) {
      g_sc[s_][0] = as_pair<Pair>(__byte_perm(w[s_], 0, 0x1010));  // low half twice
      g_sc[s_][1] = as_pair<Pair>(__byte_perm(w[s_], 0, 0x3232));  // high half twice
    }
    unsigned zw[2] = {0u, 0u};
    if constexpr (kHasZero) {
      const unsigned* zrow = reinterpret_cast<const unsigned*>(z_stage) + g * (G::BN / Weight<W>::kPack) +
                             nt * (64 / Weight<W>::kPack);
      zw[0] = zrow[lane_col * (Weight<W>::kBits / 4)];
      if (Weight<W>::kBits == 8) zw[1] = zrow[2 * lane_col + 1];
    }
    set_offsets(zw);
  }

  // This warp's K_WARP k16 tiles of one stage: a_src / b_src / s_stage / z_stage / g_stage are the stage's slots
  // in shared memory, k0 its first K row. kPerRow reads scales / zero points from global memory through the stage's
  // g_idx: scales / zeros point at the column tile's matrices (num_groups, prob_n), col = the block's column tile.
  __device__ __forceinline__ void compute_stage(const int4* a_src, const int4* b_src, const int4* s_stage,
                                                const int4* z_stage, const int4* g_stage, int k0, int group_size,
                                                int group_shift, const int4* __restrict__ scales,
                                                const int4* __restrict__ zeros, int prob_n, int col) {
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int nt = warp % N_TILES;
    const int kg = warp / N_TILES;
    const int lane_col = lane / 4;
#pragma unroll
    for (int i = 0; i < K_WARP; ++i) {
      const int kt = kg * K_WARP + i;

      if constexpr (GROUP_MODE == kGrouped) {
        // A warp's K_WARP tiles lie in one group when G >= 16 K_WARP (both powers of two, aligned): load once.
        if (i == 0 || group_size < 16 * K_WARP)
          load_group(s_stage, z_stage, ((k0 + 16 * kt) >> group_shift) - (k0 >> group_shift), nt);
      }
      // Per-row groups: the scale vectors and zero words of this lane's rows k0, k0+1, k0+8, k0+9.
      int4 sv[GROUP_MODE == kPerRow ? 4 : 1];
      unsigned zw[GROUP_MODE == kPerRow ? 4 : 1][2];
      if constexpr (GROUP_MODE == kPerRow) {
        const int* grp = reinterpret_cast<const int*>(g_stage);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int krow = 16 * kt + 2 * (lane % 4) + (r & 1) + 8 * (r >> 1);
          const long long g = grp[krow];
          sv[r] = __ldg(scales + (g * prob_n + col * G::BN + nt * 64) / 8 + lane_col);
          if constexpr (kHasZero) {
            const unsigned* zrow = reinterpret_cast<const unsigned*>(zeros) +
                                   (g * prob_n + col * G::BN + nt * 64) / Weight<W>::kPack;
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

      // A fragments of every m16 block for this k16 tile (lane -> row lane % 16, column block lane / 16); SWAP: the
      // B fragment of the first 8 rows' transpose (lane -> row lane % 8, column block (lane / 8) % 2).
      unsigned a[M_BLOCKS][4];
      unsigned a_t[2];
      if constexpr (SWAP) {
        ldmatrix_x2(a_t, a_src + G::a_index(lane % 8, 2 * kt + (lane / 8) % 2));
      } else {
#pragma unroll
        for (int mb = 0; mb < M_BLOCKS; ++mb) {
          const int r = mb * 16 + lane % 16;
          const int c = 2 * kt + lane / 16;
          ldmatrix_x4(a[mb], a_src + G::a_index(r, c));
        }
      }

#pragma unroll
      for (int s = 0; s < 4; ++s) {
        Pair sc[2][2];
        unsigned off[2][2], off16[2][2];
        group_params(s, sc, off, off16);
        unsigned b[2][2];
        dequant_subblock<T, W>(words + s * Weight<W>::kWordsPerSubblock, off, off16, sc, b);
        if constexpr (SWAP) {
          const unsigned w_t[4] = {b[0][0], b[1][0], b[0][1], b[1][1]};  // A fragment of the sub-block's W^T
          mma_m16n8k16<Act<T>::kIsBf16>(w_t, a_t, acc[0][s]);
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int mb = 0; mb < M_BLOCKS; ++mb) mma_m16n8k16<Act<T>::kIsBf16>(a[mb], b[h], acc[mb][2 * s + h]);
        }
      }
    }
  }
};

// Warps sharing a 64-column tile fold their accumulators pairwise through shared memory (red: kRedI4 of the
// Geometry), one m16 block at a time so the buffer stays 16 KiB. Afterwards warps kg = 0 (warps 0..N_TILES-1) hold
// the tile's sums. Every thread of the block must call it (barriers).
// Elementwise, so it works on either accumulator layout (NB = 8: rows; NB = 4: WarpLoop's SWAP layout).
template <int M_BLOCKS, int N_TILES, int NB>
__device__ __forceinline__ void fold_warps(float (&acc)[M_BLOCKS][NB][4], float* red) {
  constexpr int kWarpsPerN = kWarps / N_TILES;
  if constexpr (kWarpsPerN > 1) {
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int nt = warp % N_TILES;
    const int kg = warp / N_TILES;
#pragma unroll
    for (int mb = 0; mb < M_BLOCKS; ++mb) {
#pragma unroll
      for (int step = kWarpsPerN / 2; step >= 1; step /= 2) {
        if (kg >= step && kg < 2 * step) {
          float* dst = red + ((kg - step) * N_TILES + nt) * 1024;
#pragma unroll
          for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int r = 0; r < 4; ++r) dst[(nb * 4 + r) * 32 + lane] = acc[mb][nb][r];
        }
        __syncthreads();
        if (kg < step) {
          const float* src = red + (kg * N_TILES + nt) * 1024;
#pragma unroll
          for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[mb][nb][r] += src[(nb * 4 + r) * 32 + lane];
        }
        __syncthreads();
      }
    }
  }
}

}  // namespace mwb
