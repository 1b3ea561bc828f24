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

// How scales are indexed (workbench/gemm/geometry.py GROUP_*): a template parameter, so the hot loop has no branch.
enum GroupMode : int {
  kChannelwise = 0,  // one scale row (P32 layout), applied per element
  kGrouped = 1,      // group of Marlin row k = k >> log2(group_size) (P64 layout), staged per pipeline step
  kPerRow = 2,       // act-order on a K shard (is_k_full = false): group of row k = g_idx[k]
};

// Floats of the warp-fold buffer (fold_warps): room for half the k groups to store a row-layout m16 tile (the fold
// pass by pass); the 8-row SWAP layout's one pass fits it too. (Room for the
// one-pass fold of a one-m16-block row-layout tile, 8 KiB more with 4 k groups, made the two-block M = 9..16 kernels
// slower: docs/performance.md, "Tried and did not pay".)
__host__ __device__ constexpr int fold_buffer_floats(int n_tiles) {
  return kWarps / n_tiles > 1 ? kWarps / n_tiles / 2 * n_tiles * 1024 : 0;
}

// Compile-time geometry of one kernel instantiation. Python mirrors kSmemBytes in workbench/gemm/geometry.py
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
  // 16-bit scale rows a stage can span (G >= 32); byte scales (Weight::kByteScales, G >= 16) span twice the rows
  // in the same bytes (WeightFetch::kSRowI4)
  static constexpr int kScaleRows = (BK / 32 > 1) ? BK / 32 : 1;

  static constexpr int kAI4 = BM * BK / 8;                 // A stage
  static constexpr int kBI4 = KT * N_TILES * kTileI4;      // B stage
  static constexpr int kSI4 = kScaleRows * BN / 8;         // scale rows of a stage
  static constexpr int kZI4 = Weight<W>::kHasZero ? kScaleRows * BN / kPack / 4 : 0;
  static constexpr int kGI4 = GROUP_MODE == kPerRow ? BK / 4 : 0;  // g_idx of a stage
  static constexpr int kStageI4 = kAI4 + kBI4 + kSI4 + kZI4 + kGI4;
  static constexpr int kRedI4 = fold_buffer_floats(N_TILES) / 4;
  static constexpr int kSmemBytes = 16 * (STAGES * kStageI4 + kRedI4);
  // A ring slot holds one whole stage (A, B, scales, zero points, g_idx, in that order: byte offsets below); the
  // warp-fold buffer follows the STAGES slots. Only where the bytes sit differs from a ring per operand: the same
  // bytes are copied and read, so results do not change.
  static constexpr int kAOff = 0;
  static constexpr int kBOff = kAOff + 16 * kAI4;
  static constexpr int kSOff = kBOff + 16 * kBI4;
  static constexpr int kZOff = kSOff + 16 * kSI4;
  static constexpr int kGOff = kZOff + 16 * kZI4;
  static constexpr int kStageBytes = 16 * kStageI4;
  static constexpr int kRingBytes = STAGES * kStageBytes;

  // Where A chunk c (16 bytes) of stage row r lives: c ^ (r % 8), so that ldmatrix's 8 row reads of one column
  // block hit 8 different bank groups.
  __device__ __forceinline__ static int a_index(int r, int c) { return r * (BK / 8) + (c ^ (r % 8)); }
};

// The dynamic shared memory of a kernel: STAGES stage slots (Geometry::kStageBytes each, addressed by 32-bit shared
// addresses) and the warp-fold buffer behind them.
template <typename G>
struct StageRing {
  unsigned base;  // shared address of slot 0
  float* red;     // warp fold of a finished tile (kRedI4)
  __device__ __forceinline__ explicit StageRing(int4* smem) {
    base = smem_addr(smem);
    red = reinterpret_cast<float*>(reinterpret_cast<char*>(smem) + G::kRingBytes);
  }
  // Shared address of slot i (0 <= i < STAGES).
  __device__ __forceinline__ unsigned slot(int i) const { return base + i * G::kStageBytes; }
};

// The slot the main loop computes on and the one it refills (STAGES - 1 slots ahead, i.e. the slot before it in the
// ring), rotated with a slot counter: a few integer ops per stage and no ring base to re-form.
template <typename G, int STAGES>
struct SlotCursor {
  unsigned slot;  // shared address of the compute slot
  int index;      // its index in the ring
  __device__ __forceinline__ explicit SlotCursor(unsigned base) : slot(base), index(0) {}
  __device__ __forceinline__ void advance() {
    const bool wrap = index + 1 == STAGES;
    slot = wrap ? slot - (STAGES - 1) * G::kStageBytes : slot + G::kStageBytes;
    index = wrap ? 0 : index + 1;
  }
};

// ---- fetch: global -> shared of the weight side of one stage ------------------------------------------------
// B: KT rows of N_TILES consecutive 16x64 tiles starting at k16 row kit * KT and 64-column tile col * N_TILES of a
// (K/16, n_tiles_total tiles) Marlin matrix (B points at its first tile: the expert's for MoE). One k16 row of the
// block tile is kRowI4 contiguous int4 in global memory and lands contiguously in the stage (row r at r kRowI4): shared
// memory holds exactly the global bytes, and a lane's 16 (4-bit) or 32 (8-bit) bytes of a tile stay contiguous.
// (Storing each lane's two 16-byte halves of an 8-bit tile 512 bytes apart would spare its two reads a 2-way bank
// conflict, but measured on the H200, with the destinations of a warp's copy not contiguous, the copies reached L2 as
// ~1 sector per request and each sector was read twice; the 8-bit kernels ran at about half speed, bound by that
// fetch: docs/performance.md, "The dense GEMM", 8-bit weights.)
// kRowThreads threads share a k16 row and thread t copies int4 t % kRowThreads + n kRowThreads of row t / kRowThreads
// (n < kCopies), so its copies differ by compile-time offsets on both sides and a stage costs one address per thread;
// a warp's copy is 32 contiguous int4 (512 bytes) or two halves of 256. Grouped scales (and zero points) of the group
// rows the stage spans; g_idx of its rows (kPerRow). All through cp.async; the caller commits.
//
// Per-thread state, formed when the fetch enters a slice (dense) or an item (MoE): begin(); each stage then adds
// kit times a stride (fetch()).
//
// PER_WARP (one or two 64-column tiles, K_WARP >= 2): every warp fetches the bytes of B, scales and zero points it
// reads, and the N_TILES warps of one k group (warps kg N_TILES + nt) together the g_idx they share (A: the caller,
// marlin_gemm.cu), so a warp waits for its own group's copies alone (the dense kernel's kWarpFetch). B with one tile
// already is so: the 32 lanes of warp w copy its K_WARP k16 rows; with two, lane l of warp (nt, kg) copies int4 l
// (and l + 32 for 8-bit) of tile nt in each of its rows. Scales / zero points: each k group has a region of
// kWarpScaleRows group rows (the rows its 16 K_WARP k rows span at most, G >= 32), laid out as the shared rows (BN / 8
// int4 a row), and warp nt copies tile nt's part of each row it needs (two k groups in one group copy the same row
// twice). g_idx: the int4 of the group's rows, at the shared place.
template <typename G, int W, int GROUP_MODE, bool PER_WARP = false>
struct WeightFetch {
  static constexpr int N_TILES = G::BN / 64;
  static constexpr int kRowI4 = N_TILES * G::kTileI4;     // int4 of one k16 row of the block tile's B
  static constexpr int kRowThreads = kThreads / G::KT;    // threads sharing one k16 row
  static constexpr int kCopies = kRowI4 / kRowThreads;    // B copies per thread per stage
  static_assert(kThreads % G::KT == 0 && kRowI4 % kRowThreads == 0 && kCopies * kThreads == G::kBI4,
                "every thread copies kCopies int4 of one k16 row");
  static constexpr int kZRowI4 = Weight<W>::kHasZero ? G::BN / Weight<W>::kPack / 4 : 1;  // int4 of a zero row
  static constexpr int kWarpRows = 16 * (G::KT / G::kWarpsPerN);  // PER_WARP: k rows of one warp (16 K_WARP)
  static constexpr int kSB = Weight<W>::kScaleBytes;      // bytes of one scale (2, or 1: microscaled formats)
  static constexpr int kSRowI4 = G::BN * kSB / 16;          // int4 of one group row of the block tile's scales
  static constexpr int kSTileI4 = 64 * kSB / 16;            // int4 of one 64-column tile's part of that row
  static constexpr int kMinGroup = Weight<W>::kMinGroup;    // the smallest group the fetch is sized for
  static constexpr int kWarpScaleRows = kWarpRows / kMinGroup > 1 ? kWarpRows / kMinGroup : 1;  // group rows it spans
  static constexpr int kZTileI4 = kZRowI4 / N_TILES > 1 ? kZRowI4 / N_TILES : 1;  // one tile's part of a zero row
  static constexpr bool kRemapB = PER_WARP && N_TILES > 1;  // two tiles: each warp copies its own tile's rows
  static constexpr int kLaneB = G::kTileI4 / 32;           // kRemapB: int4 of a tile row per lane (1, 8-bit 2)
  static_assert(!PER_WARP || (N_TILES <= 2 && kWarpRows >= 32 && (N_TILES > 1 || kRowThreads * kWarpRows / 16 == 32) &&
                              G::kWarpsPerN * kWarpScaleRows * kSRowI4 == G::kSI4 &&
                              (!Weight<W>::kHasZero || G::kWarpsPerN * kWarpScaleRows * kZRowI4 == G::kZI4)),
                "per-warp fetch: a warp's B rows copied by its own lanes, k groups' scale regions fill kSI4 / kZI4");
  // PER_WARP: shared int4 position (relative to the stage's scales / zero points) of lane `lane`'s copy in warp w:
  // row lane / kSTileI4 (lane / kZTileI4) of its k group's region, tile nt's part.
  __host__ __device__ static constexpr int s_dst_of(int w, int lane) {
    return (w / N_TILES * kWarpScaleRows + lane / kSTileI4) * kSRowI4 + w % N_TILES * kSTileI4 + lane % kSTileI4;
  }
  __host__ __device__ static constexpr int z_dst_of(int w, int lane) {
    return (w / N_TILES * kWarpScaleRows + lane / kZTileI4) * kZRowI4 + w % N_TILES * kZTileI4 + lane % kZTileI4;
  }

  // Copy n's position relative to copy 0's, in the row and in the stage (int4; the same on both sides).
  __host__ __device__ static constexpr int b_copy_delta(int n) { return n * kRowThreads; }
  // Shared position (int4, relative to the stage's B) of thread t's copy 0.
  __host__ __device__ static constexpr int b_dst_of(int t) { return (t / kRowThreads) * kRowI4 + t % kRowThreads; }
  // kRemapB: the same for warp w's lane l, copy n = j kLaneB + h (its row kt0 + j, int4 32 h + l of tile nt): copy
  // 0's position, and copy n's offset from it in shared memory (in global memory rows are n_tiles_total tiles apart).
  __host__ __device__ static constexpr int b_dst_warp(int w, int lane) {
    return w / N_TILES * (kWarpRows / 16) * kRowI4 + w % N_TILES * G::kTileI4 + lane;
  }
  __host__ __device__ static constexpr int b_warp_delta(int n) { return n / kLaneB * kRowI4 + n % kLaneB * 32; }
  // PER_WARP: the first int4 of warp w's k group's scale / zero-point region (its readers add their row and column).
  __host__ __device__ static constexpr int s_region(int w) { return w / N_TILES * kWarpScaleRows * kSRowI4; }
  __host__ __device__ static constexpr int z_region(int w) { return w / N_TILES * kWarpScaleRows * kZRowI4; }

  const int4* b_src;  // this thread's copy 0 at stage 0 of the current slice / item
  int b_row;          // kRemapB: int4 between consecutive k16 rows in global memory (n_tiles_total kTileI4)
  unsigned b_dst;     // byte offset of copy 0 inside a slot (from the slot's start)
  unsigned s_dst, z_dst, g_dst;  // byte offsets of this thread's scale / zero-point / g_idx int4 inside a slot
  const int4* s_src;  // grouped: this thread's scale int4 at group row 0 of the column tile
  const int4* z_src;  // grouped with zero points: the same for zero points
  const int* g_src;   // kPerRow: this thread's g_idx int4 at row 0
  int s_row, z_row;   // int4 per group row of scales / zero points
  bool s_on, z_on;    // this thread copies scale / zero-point bytes (threads < rows BN/8 / rows kZRowI4)
  bool g_on;          // this thread copies g_idx (threads < kGI4 = BK / 4)
  int k_first;        // PER_WARP: the first stage row whose scales / g_idx this thread's copies cover (its warp's)
  // The edges of K (docs/formats.md, "Shapes that are not tile multiples"): a stage past the weight's last k16 row,
  // group row or g_idx entry copies the last one that exists instead (clamped source, no branch). Those copies only
  // meet A columns >= size_k, which the A fetch zero-fills, so they add exact zeros; the copies stay in bounds.
  int b_last;         // the last k16 row of B, counted from this thread's first row in a stage
  int s_last, z_last; // the last group row of scales / zero points, counted from this thread's first row
  int g_last;         // the last g_idx int4 (entry index), counted from this thread's first entry in a stage

  // The first stage row this thread's scale / g_idx copies cover: 0, or with PER_WARP its warp's (a compile-time 0
  // where the whole block shares them, so those kernels add nothing per stage).
  __device__ __forceinline__ int first_row() const { return PER_WARP ? k_first : 0; }

  // Once per kernel: the thread's shared offsets, strides and roles. n_tiles_total: 64-column tiles of the weight
  // (ceil(size_n / 64): scale and zero-point rows are that many tiles wide); size_k: the true K.
  __device__ __forceinline__ void init(int n_tiles_total, int size_k, int group_size, unsigned ring_base) {
    const int tid = pinned_thread_index();
    b_row = n_tiles_total * G::kTileI4;
    b_dst = ring_base + G::kBOff + 16 * (kRemapB ? b_dst_warp(tid / 32, tid % 32) : b_dst_of(tid));
    s_row = n_tiles_total * 64 * kSB / 16;
    z_row = n_tiles_total * 64 / Weight<W>::kPack / 4;
    const int k16_rows = (size_k + 15) / 16;
    // (grouped: a power-of-two group, the last one possibly partial)
    const int groups = GROUP_MODE == kGrouped ? (size_k + group_size - 1) / group_size : 1;
    if constexpr (PER_WARP) {
      const int w = tid / 32, lane = tid % 32, kg = w / N_TILES;
      const int gi = tid % (32 * N_TILES);  // index among the k group's threads (g_idx is shared by its warps)
      s_dst = ring_base + G::kSOff + 16 * s_dst_of(w, lane);
      z_dst = ring_base + G::kZOff + 16 * z_dst_of(w, lane);
      g_dst = ring_base + G::kGOff + 16 * (kg * (kWarpRows / 4) + gi);
      k_first = kg * kWarpRows;
      const int rows = GROUP_MODE == kGrouped && kWarpRows > group_size ? kWarpRows / group_size : 1;
      s_on = GROUP_MODE == kGrouped && lane < rows * kSTileI4;
      z_on = GROUP_MODE == kGrouped && Weight<W>::kHasZero && lane < rows * kZTileI4;
      g_on = GROUP_MODE == kPerRow && gi < kWarpRows / 4;
      b_last = k16_rows - 1 - (kRemapB ? k_first / 16 : tid / kRowThreads);
      s_last = groups - 1 - lane / kSTileI4;
      z_last = groups - 1 - lane / kZTileI4;
      g_last = size_k - 4 - (k_first + 4 * gi);
    } else {
      s_dst = ring_base + G::kSOff + 16 * tid;
      z_dst = ring_base + G::kZOff + 16 * tid;
      g_dst = ring_base + G::kGOff + 16 * tid;
      // The group rows a stage spans: one when G >= BK, else BK / G (G and BK are powers of two >= kMinGroup).
      const int rows = GROUP_MODE == kGrouped && G::BK > group_size ? G::BK / group_size : 1;
      s_on = GROUP_MODE == kGrouped && tid < rows * kSRowI4;
      z_on = GROUP_MODE == kGrouped && Weight<W>::kHasZero && tid < rows * kZRowI4;
      g_on = GROUP_MODE == kPerRow && tid < G::kGI4;
      b_last = k16_rows - 1 - tid / kRowThreads;
      s_last = groups - 1 - tid / kSRowI4;
      z_last = groups - 1 - tid / kZRowI4;
      g_last = size_k - 4 - 4 * tid;
    }
  }

  // When the fetch enters a slice / item: B, scales, zeros, g_idx of the matrix (the expert's for MoE), column
  // tile col (BN columns).
  __device__ __forceinline__ void begin(const int4* __restrict__ B, const int4* __restrict__ scales,
                                        const int4* __restrict__ zeros, const int* __restrict__ g_idx, int col,
                                        int n_tiles_total) {
    const int tid = threadIdx.x;
    if constexpr (kRemapB)
      b_src = B + (static_cast<long long>(k_first / 16) * n_tiles_total + col * N_TILES + tid / 32 % N_TILES) *
                      G::kTileI4 + tid % 32;
    else
      b_src = B + (static_cast<long long>(tid / kRowThreads) * n_tiles_total + col * N_TILES) * G::kTileI4 +
              tid % kRowThreads;
    if constexpr (PER_WARP) {  // (lane, tile nt): row lane / kSTileI4 (/ kZTileI4) of the region, int4 of tile nt
      const int lane = tid % 32, nt = tid / 32 % N_TILES;
      if constexpr (GROUP_MODE == kGrouped) {
        s_src = scales + static_cast<long long>(lane / kSTileI4) * s_row + col * kSRowI4 + nt * kSTileI4 +
                lane % kSTileI4;
        if constexpr (Weight<W>::kHasZero)
          z_src = zeros + static_cast<long long>(lane / kZTileI4) * z_row + col * kZRowI4 + nt * kZTileI4 +
                  lane % kZTileI4;
      }
      if constexpr (GROUP_MODE == kPerRow) g_src = g_idx + k_first + 4 * (tid % (32 * N_TILES));
    } else {
      if constexpr (GROUP_MODE == kGrouped) {
        s_src = scales + static_cast<long long>(tid / kSRowI4) * s_row + col * kSRowI4 + tid % kSRowI4;
        if constexpr (Weight<W>::kHasZero)
          z_src = zeros + static_cast<long long>(tid / kZRowI4) * z_row + col * kZRowI4 + tid % kZRowI4;
      }
      if constexpr (GROUP_MODE == kPerRow) g_src = g_idx + 4 * tid;
    }
  }

  // Stage kit of the current slice / item into the slot at shared address `slot`.
  // Rows past the weight's edge copy its last row (b_last, s_last, z_last, g_last: see init).
  __device__ __forceinline__ void fetch(unsigned slot, int kit, int group_shift) const {
    if constexpr (kRemapB) {
#pragma unroll
      for (int n = 0; n < kCopies; ++n)
        cp_async16_at(slot + b_dst + 16 * b_warp_delta(n),
                      b_src + min(kit * G::KT + n / kLaneB, b_last) * b_row + n % kLaneB * 32);
    } else {
      const int4* b = b_src + min(kit * G::KT, b_last) * b_row;
#pragma unroll
      for (int n = 0; n < kCopies; ++n)
        // no L2 cache-policy hint: see cp_async16_at
        cp_async16_at(slot + b_dst + 16 * b_copy_delta(n), b + b_copy_delta(n));
    }
    if constexpr (GROUP_MODE == kGrouped) {
      const int g0 = (kit * G::BK + first_row()) >> group_shift;  // first group row of the stage (PER_WARP: the warp's)
      if (s_on) cp_async16_at(slot + s_dst, s_src + min(g0, s_last) * s_row);
      if constexpr (Weight<W>::kHasZero)
        if (z_on) cp_async16_at(slot + z_dst, z_src + min(g0, z_last) * z_row);
    }
    if constexpr (GROUP_MODE == kPerRow) {
      if (g_on) cp_async16_at(slot + g_dst, g_src + min(kit * G::BK, g_last));
    }
  }
};

// Where late scaling (WarpLoop::kLateScale) pays. A flush costs one FFMA per accumulator (SWAP 16, rows layout 32 per
// warp) where each k16 tile saves 16 HMUL2. Measured on the H200 against scaling every pair: SWAP kernels gained on
// every layer; the rows layout with one block per SM gained at K_WARP = 4, tied at 2 (8-bit) and lost at K_WARP = 1;
// the 128-register two-block rows-layout kernels lost and spilled with bf16 or zero points (docs/performance.md,
// "The dense GEMM", late scaling).
template <int MIN_BLOCKS, int SWAP, int K_WARP>
__host__ __device__ constexpr bool late_scale_pays() {
  return SWAP == 1 || (MIN_BLOCKS == 1 && K_WARP >= 2);
}

// ---- the register side -------------------------------------------------------------------------------------
// One warp's accumulators and the current group's scale / offset pairs, and the work of one stage.
//
// Pairs for sub-block s, column half h are valid for every row of the current group (channelwise: the whole
// column tile). They are rebuilt only when the group changes, so the per-tile work is dequant + mma.
//
// SWAP = 1 (at most 8 rows, M_BLOCKS = 1; 0: the row layout): the four registers a lane dequantizes for a 16x16
// sub-block are exactly the mma A fragment of its transpose (rows n0, n0 + 8 of W^T, k pairs 2t, 2t + 8), and the 8
// rows of the A tile loaded by ldmatrix are the B fragment of their transpose, so one mma.m16n8k16 gives C^T for the
// sub-block's 16 columns x 8 rows: one mma instead of two (16 rows x 8 columns each, half of the rows padding).
// Same products, same k order.
// LATE_SCALE = false: scales applied to every dequantized pair even where kLateScale could apply (for kernels whose
// register budget or stage shape make it slower: late_scale_pays).
// PER_WARP: the stage's scales / zero points lie where WeightFetch<..., PER_WARP = true> puts them (each warp's group
// rows in a region of its own, counted from the warp's first k row).
// K_BASE > 0 (the batch-invariant kernels' merged stages): the stage is K_WARP / K_BASE consecutive stages of the
// K_WARP = K_BASE tile, and warp (nt, kg) takes k16 tiles kg K_BASE + j + f kWarpsPerN K_BASE (f = i / K_BASE,
// j = i % K_BASE) in that order: the same tiles in the same order per warp, the same fold, as K_BASE-wide stages one
// after another, so the same sums bit for bit with a stage's fixed cost paid once per K_WARP / K_BASE of them.
template <typename T, int W, int M_BLOCKS, int N_TILES, int K_WARP, int STAGES, int GROUP_MODE, int SWAP = 0,
          bool LATE_SCALE = true, bool PER_WARP = false, int K_BASE = 0>
struct WarpLoop {
  using G = Geometry<T, W, M_BLOCKS, N_TILES, K_WARP, STAGES, GROUP_MODE>;
  using Fetch = WeightFetch<G, W, GROUP_MODE, PER_WARP>;
  using Pair = typename Act<T>::Pair;
  static_assert(SWAP == 0 || (M_BLOCKS == 1 && SWAP == 1), "the swapped loop covers the 8 rows of one m16 block");
  static constexpr bool kHasZero = Weight<W>::kHasZero;
  static constexpr int kWordsPerLane = 16 * 64 / Weight<W>::kPack / 32;  // 4 (4-bit) or 8 (8-bit) words of a tile
  static constexpr int kAccM = SWAP ? 1 : M_BLOCKS;  // SWAP: one 8-row half
  static constexpr int kAccN = SWAP ? 4 : 8;
  // Late scaling: with one m16 block and one scale per (group, column) (grouped or channelwise, not per-row groups),
  // the tiles are dequantized without their scale (exact: code - zero, FP8 the moved bits), a stage's mma of one
  // group sum into `part`, and acc += scale * part in fp32 when the group ends (flush_part). The scale multiply of
  // every weight pair becomes one FFMA per accumulator per group and stage (where it pays: late_scale_pays).
  // (The scale multiply of every pair cost 11-17% of the 4-bit kernels: docs/performance.md, "The dense GEMM".)
  // Numerics: the weight is never rounded to the activation type (the reference dequantizer rounds it), so results
  // differ from dequantize-then-multiply by up to one rounding u |a| @ |w| — and are closer to exact; identity products
  // stay exact (round(scale x (code - zero)) once, at the output). Not for FP8: measured no faster with fp16 (its
  // dequant is bit moves, its kernels bound by the fetch), and with bf16 the unscaled E4M3 bits carry 2^-120, whose
  // products with activations fall below fp32's normal range.
  // Not for the microscaled formats either: their unscaled moved bits carry 2^-14 (fp16) / 2^-126 (bf16), as
  // vLLM's, and are only brought into range by the scale multiply (dequant.cuh).
  static constexpr bool kLateScale = LATE_SCALE && M_BLOCKS == 1 && GROUP_MODE != kPerRow && !Weight<W>::kIsFp8 &&
                                     !Weight<W>::kByteScales;
  // The k16 tiles of one K_BASE-wide sub-stage (K_BASE > 0; else the warp's K_WARP tiles are consecutive).
  static constexpr int kBase = K_BASE > 0 ? K_BASE : K_WARP;
  static_assert(K_BASE == 0 || (K_WARP % kBase == 0 && !kLateScale && !PER_WARP &&
                                (2 * G::kWarpsPerN * K_BASE) % 8 == 0),
                "merged stages: whole sub-stages, no late scaling, block-wide fetch, sub-stages of whole A swizzle rows");
  // Tile i of the warp, counted from its first (kt0): i % kBase + (i / kBase) kWarpsPerN kBase.
  __host__ __device__ static constexpr int tile_of(int i) { return i % kBase + i / kBase * G::kWarpsPerN * kBase; }
  // K rows from the warp's first tile to the end of its last: where a group can end inside the warp's tiles.
  static constexpr int kSpan = 16 * (tile_of(K_WARP - 1) + 1);

  // [m16 block][n8 block = 2 s + h][mma C registers]: C rows lane/4 (+8 for registers 2, 3), columns 8 nb + 2 (lane
  // % 4) (+1). SWAP: [8-row half][sub-block s][r]: C^T, i.e. C columns 16 s + lane/4 (+8 for r = 2, 3), rows 8 half
  // + 2 (lane % 4) (+1 for odd r); see rows_layout.
  float acc[kAccM][kAccN][4];
  float part[kAccM][kAccN][4];  // kLateScale: this stage's sums of the current group, unscaled
  float l_sc[kAccN][2];            // kLateScale: the scale of acc[.][nb][r] is l_sc[nb][late_half(r)]
  Pair g_sc[4][2];
  unsigned g_off[4][2];    // (magic + zero) pairs
  unsigned g_off16[4][2];  // -(64 + zero) fp16 pairs (fp16 4-bit high nibbles)

  __device__ __forceinline__ static void zero(float (&x)[kAccM][kAccN][4]) {
#pragma unroll
    for (int mb = 0; mb < kAccM; ++mb)
#pragma unroll
      for (int nb = 0; nb < kAccN; ++nb)
#pragma unroll
        for (int r = 0; r < 4; ++r) x[mb][nb][r] = 0.f;
  }
  __device__ __forceinline__ void zero_acc() { zero(acc); }

  // kLateScale: which of l_sc[nb]'s two scales belongs to mma register r. SWAP: registers 0, 1 are column n0 of
  // sub-block nb, 2, 3 column n0 + 8 (h); rows layout: registers 0, 2 are column 2 (lane % 4) of n8 block nb, 1, 3
  // the next one.
  __device__ __forceinline__ static int late_half(int r) { return SWAP ? r >> 1 : r & 1; }
  __device__ __forceinline__ void flush_part() {
#pragma unroll
    for (int mb = 0; mb < kAccM; ++mb)
#pragma unroll
      for (int nb = 0; nb < kAccN; ++nb)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[mb][nb][r] = fmaf(l_sc[nb][late_half(r)], part[mb][nb][r], acc[mb][nb][r]);
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
#pragma unroll
          for (int half = 0; half < 2; ++half) {  // rows 8 half + lane / 4: mma register r + 2 half
            if (half < kAccM) {
              const float even = __shfl_sync(0xffffffffu, acc[half][nb / 2][2 * (nb % 2)], src);
              const float odd = __shfl_sync(0xffffffffu, acc[half][nb / 2][2 * (nb % 2) + 1], src);
              out[0][nb][r + 2 * half] = (row % 2) ? odd : even;
            } else {
              out[0][nb][r + 2 * half] = 0.f;
            }
          }
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
        if constexpr (kLateScale && SWAP) l_sc[s_][h] = static_cast<float>(v);
        if constexpr (kLateScale && !SWAP) {  // the accumulator's columns 2 (lane % 4) + j of n8 block 2 s + h
#pragma unroll
          for (int j = 0; j < 2; ++j)
            l_sc[2 * s_ + h][j] = static_cast<float>(sp[channelwise_scale_index(2 * (threadIdx.x % 4) + j, s_, h)]);
        }
      }
    unsigned zw[2] = {0u, 0u};
    if constexpr (kHasZero) {
      zw[0] = zp[lane_col * (Weight<W>::kBits / 4)];
      if (Weight<W>::kBits == 8) zw[1] = zp[2 * lane_col + 1];
    }
    set_offsets(zw);
  }

  // Grouped: the pairs of group row g of the stage in slot `slot` (a P64 16-byte vector: word s = (scale(s,0),
  // scale(s,1))). s_lane / z_lane: this lane's byte offsets (lane_offsets).
  // kLateScale (rows layout): s_acc_lane is the byte offset of column 2 (lane % 4)'s vector (LaneOffsets::s_acc).
  __device__ __forceinline__ void load_group(unsigned slot, int g, unsigned s_lane, unsigned z_lane,
                                             unsigned s_acc_lane) {
    unsigned w[4];
    if constexpr (Weight<W>::kByteScales) {  // the lane's 8 scale bytes, widened to the 16-bit vector's words
      const unsigned row = slot + s_lane + g * G::BN;
      const unsigned u[2] = {lds32(row), lds32(row + 4)};
      scale_pairs<T, W>(u, w);
    } else {
      const int4 sv = lds128(slot + s_lane + g * (G::BN / 8) * 16);
      w[0] = sv.x; w[1] = sv.y; w[2] = sv.z; w[3] = sv.w;
    }
#pragma unroll
    for (int s_ = 0; s_ < 4; ++s_) {
      g_sc[s_][0] = as_pair<Pair>(__byte_perm(w[s_], 0, 0x1010));  // low half twice
      g_sc[s_][1] = as_pair<Pair>(__byte_perm(w[s_], 0, 0x3232));  // high half twice
      if constexpr (kLateScale && SWAP) {
        const float2 f = Act<T>::to_floats(as_pair<Pair>(w[s_]));
        l_sc[s_][0] = f.x;
        l_sc[s_][1] = f.y;
      }
    }
    if constexpr (kLateScale && !SWAP) {
      // Columns c = 2 (lane % 4) + j: vectors at 8 c; value e = 2 s + h = nb of a vector is column c + 8 e.
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int4 v = lds128(slot + s_acc_lane + 16 * j + g * (G::BN / 8) * 16);
        const unsigned u[4] = {static_cast<unsigned>(v.x), static_cast<unsigned>(v.y), static_cast<unsigned>(v.z),
                               static_cast<unsigned>(v.w)};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = Act<T>::to_floats(as_pair<Pair>(u[q]));
          l_sc[2 * q][j] = f.x;
          l_sc[2 * q + 1][j] = f.y;
        }
      }
    }
    unsigned zw[2] = {0u, 0u};
    if constexpr (kHasZero) {
      const unsigned zrow = slot + z_lane + g * (G::BN / Weight<W>::kPack) * 4;
      zw[0] = lds32(zrow);
      if (Weight<W>::kBits == 8) zw[1] = lds32(zrow + 4);
    }
    set_offsets(zw);
  }

  // This lane's byte offsets inside a stage slot, fixed for the whole kernel (a warp always reads the same part of
  // a stage): tile kt = kg K_WARP + i of the warp's B is b + i N_TILES kTileI4 16; its A ldmatrix row address is
  // a ^ 32 i (see compute_stage); scale / zero-point words of group row g: s / z + g * row bytes; g_idx of row
  // k0 + 16 kt + 2 (lane % 4): gi + 64 i.
  struct LaneOffsets {
    unsigned a, b, s, z, gi, s_acc;
    int k;  // 16 kt0: the warp's first K row inside a stage
  };
  __device__ __forceinline__ static LaneOffsets lane_offsets() {
    const int tid = pinned_thread_index();
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int nt = warp % N_TILES;
    const int kg = warp / N_TILES;
    const int kt0 = kg * kBase;
    LaneOffsets o;
    // SWAP: ldmatrix.x2 rows lane % 8, column block (lane / 8) % 2; else .x4 rows lane % 16, block lane / 16.
    o.a = G::kAOff + 16 * (SWAP ? G::a_index(lane % 8, 2 * kt0 + (lane / 8) % 2)
                                : G::a_index(lane % 16, 2 * kt0 + lane / 16));
    o.b = G::kBOff + 16 * ((kt0 * N_TILES + nt) * G::kTileI4 + lane * (G::kTileI4 / 32));
    o.s = G::kSOff + 8 * Weight<W>::kScaleBytes * (nt * 8 + lane / 4);  // the 8 scales of column lane / 4
    o.s_acc = G::kSOff + 16 * (nt * 8 + 2 * (lane % 4));
    o.z = G::kZOff + 4 * (nt * (64 / Weight<W>::kPack) + (lane / 4) * (Weight<W>::kBits / 4));
    if constexpr (PER_WARP) {  // the k group's own region
      o.s += 16 * Fetch::s_region(warp);
      o.s_acc += 16 * Fetch::s_region(warp);
      o.z += 16 * Fetch::z_region(warp);
    }
    o.gi = G::kGOff + 4 * (16 * kt0 + 2 * (lane % 4));
    o.k = 16 * kt0;
    return o;
  }

  // This warp's K_WARP k16 tiles of the stage in the slot at shared address `slot`, k0 its first K row; o: this
  // lane's offsets (lane_offsets). kPerRow reads scales / zero points from global memory through the stage's
  // g_idx: scales / zeros point at the column tile's matrices (num_groups, prob_n), col = the block's column tile.
  // RELOADS: groups may end inside the warp's K_WARP tiles (G < kSpan = 16 K_WARP; grouped scales only), so the
  // group's pairs are reloaded (and kLateScale's sums flushed) between tiles under a runtime test. RELOADS = false is
  // for callers that know G >= kSpan: without that test between the tiles, ptxas schedules the stage as one
  // region instead of one per k16 tile. (K_BASE: a group can end only between sub-stages unless G < 16 K_BASE.)
  template <bool RELOADS = true>
  __device__ __forceinline__ void compute_stage(unsigned slot, const LaneOffsets& o, int k0, int group_size,
                                                int group_shift, const int4* __restrict__ scales,
                                                const int4* __restrict__ zeros, int prob_n, int col) {
    if constexpr (kLateScale) zero(part);
    // kLateScale: the mma write the unscaled sums of the current group
    float(&sums)[kAccM][kAccN][4] = kLateScale ? part : acc;
#pragma unroll
    for (int i = 0; i < K_WARP; ++i) {
      if constexpr (GROUP_MODE == kGrouped) {
        // A warp's K_WARP tiles lie in one group when G >= 16 K_WARP (both powers of two, aligned): load once.
        if (i == 0 || (RELOADS && (K_BASE == 0 || i % kBase == 0 ? group_size < kSpan : group_size < 16 * kBase))) {
          if constexpr (kLateScale) {
            if (i > 0) {  // the previous group's sums, with its scales, before they are replaced
              flush_part();
              zero(part);
            }
          }
          load_group(slot, ((k0 + o.k + 16 * tile_of(i)) >> group_shift) - ((k0 + (PER_WARP ? o.k : 0)) >> group_shift),
                     o.s, o.z, o.s_acc);
        }
      }
      // Per-row groups: the scale vectors and zero words of this lane's rows k0, k0+1, k0+8, k0+9.
      int4 sv[GROUP_MODE == kPerRow ? 4 : 1];
      unsigned zw[GROUP_MODE == kPerRow ? 4 : 1][2];
      if constexpr (GROUP_MODE == kPerRow) {
        const int nt = (threadIdx.x / 32) % N_TILES;
        const int lane_col = (threadIdx.x % 32) / 4;
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // rows 16 kt + 2 (lane % 4) + (r & 1) + 8 (r >> 1) of the stage
          const long long g = static_cast<int>(lds32(slot + o.gi + 4 * (16 * tile_of(i) + (r & 1) + 8 * (r >> 1))));
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
      const unsigned tile = slot + o.b + 16 * tile_of(i) * N_TILES * G::kTileI4;  // tile (kt, nt), this lane's int4
      {
        const int4 w0 = lds128(tile);
        words[0] = w0.x; words[1] = w0.y; words[2] = w0.z; words[3] = w0.w;
        if constexpr (kWordsPerLane == 8) {
          const int4 w1 = lds128(tile + 16);  // a lane's 32 bytes are contiguous (as in global memory)
          words[4] = w1.x; words[5] = w1.y; words[6] = w1.z; words[7] = w1.w;
        }
      }

      // A fragments of every m16 block for this k16 tile (lane -> row lane % 16, column block lane / 16); SWAP: the
      // B fragment of the transpose of rows 0..7: a_t[0].
      unsigned a[M_BLOCKS][4];
      unsigned a_t[1][2];
      // Column block c = 2 kt + (0 or 1) of row r sits at chunk c ^ (r % 8) of the row: 2 kt = 2 kt0 + 2 i adds
      // without carry into the bits r % 8 flips (kt0 = kg K_WARP is a multiple of K_WARP, 2 i < 2 K_WARP), so tile i's
      // chunk is tile 0's with bit 1..2 flipped by 2 i; rows are 2 BK >= 128 bytes apart, so in bytes: o.a ^ 32 i
      // (o.a is relative to the slot, whose start need not be 128-byte aligned). K_BASE: the sub-stage's chunks are
      // the first's 2 kWarpsPerN K_BASE further on, a whole number of 8-chunk swizzle groups (the static_assert).
      const unsigned a_lane = (o.a ^ (32u * (i % kBase))) + 32u * (i / kBase) * G::kWarpsPerN * kBase;
      if constexpr (SWAP) {
        ldmatrix_x2_at(a_t[0], slot + a_lane);
      } else {
#pragma unroll
        for (int mb = 0; mb < M_BLOCKS; ++mb) ldmatrix_x4_at(a[mb], slot + a_lane + mb * 16 * (G::BK / 8) * 16);
      }

#pragma unroll
      for (int s = 0; s < 4; ++s) {
        Pair sc[2][2];
        unsigned off[2][2], off16[2][2];
        group_params(s, sc, off, off16);
        unsigned b[2][2];
        dequant_subblock<T, W, !kLateScale>(words + s * Weight<W>::kWordsPerSubblock, off, off16, sc, b);
        if constexpr (SWAP) {
          const unsigned w_t[4] = {b[0][0], b[1][0], b[0][1], b[1][1]};  // A fragment of the sub-block's W^T
          mma_m16n8k16<Act<T>::kIsBf16>(w_t, a_t[0], sums[0][s]);
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int mb = 0; mb < M_BLOCKS; ++mb) mma_m16n8k16<Act<T>::kIsBf16>(a[mb], b[h], sums[mb][2 * s + h]);
        }
      }
    }
    if constexpr (kLateScale) flush_part();
  }
};

// ---- the edges of K on the A side -----------------------------------------------------------------------------
// Bytes of a 16-byte A chunk (8 activations) that lie inside K, given the columns of K left from the chunk's first:
// 16, 0 past K, or the 8 bytes of the half inside K (an 8-bit weight's K may end mid-chunk).
__device__ __forceinline__ int a_chunk_bytes(int cols_left) { return min(max(2 * cols_left, 0), 16); }

// cp.async of 16 bytes of which the first `bytes` are read and the rest zero-filled (0: all zeros; gmem must still
// be a valid address).
__device__ __forceinline__ void cp_async16_zfill_at(unsigned smem, const void* gmem, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(bytes));
}

// ---- the output edge and the bias epilogue ----------------------------------------------------------------------
// C is (rows, size_n) contiguous with the true size_n (any width, odd too: docs/formats.md, "Shapes that are not tile
// multiples"); an accumulator pair is columns col, col + 1 (col even) of one row. Columns >= size_n are never written
// nor read. With an even size_n every pair is 4-byte aligned and wholly inside or outside; with an odd one rows start
// at odd elements, so pairs go element by element.
// bias: (size_n,) activation-typed or null; added to the fp32 sums before their one rounding (the finishing code
// adds it only where a value is final).
template <typename T>
__device__ __forceinline__ float2 bias_pair(const T* __restrict__ bias, int col, int size_n) {
  if (bias == nullptr) return make_float2(0.f, 0.f);
  float2 b = make_float2(0.f, 0.f);
  if (col < size_n) b.x = static_cast<float>(bias[col]);
  if (col + 1 < size_n) b.y = static_cast<float>(bias[col + 1]);
  return b;
}

// row: the row's first element. Converts (lo, hi) and stores the columns that exist.
template <typename T>
__device__ __forceinline__ void store_c_pair(T* row, int col, int size_n, float lo, float hi) {
  if ((size_n & 1) == 0) {
    if (col < size_n) *reinterpret_cast<typename Act<T>::Pair*>(row + col) = Act<T>::from_floats(lo, hi);
  } else {
    const typename Act<T>::Pair p = Act<T>::from_floats(lo, hi);
    if (col < size_n) row[col] = reinterpret_cast<const T*>(&p)[0];
    if (col + 1 < size_n) row[col + 1] = reinterpret_cast<const T*>(&p)[1];
  }
}

// The pair's bits as stored (L2 only: written by another block), zero for columns that do not exist. Element by
// element whatever the parity of size_n: one code path (a second one for odd widths made the 128-register two-block
// kernels spill); only the in-C reduction reads C.
template <typename T>
__device__ __forceinline__ unsigned load_c_pair(const T* row, int col, int size_n) {
  const unsigned short* r = reinterpret_cast<const unsigned short*>(row);
  const unsigned lo = col < size_n ? __ldcg(r + col) : 0u;
  const unsigned hi = col + 1 < size_n ? __ldcg(r + col + 1) : 0u;
  return lo | (hi << 16);
}

template <typename T>
__device__ __forceinline__ void atomic_add_c_pair(T* row, int col, int size_n, float lo, float hi) {
  using Pair = typename Act<T>::Pair;
  if ((size_n & 1) == 0) {
    if (col < size_n) atomicAdd(reinterpret_cast<Pair*>(row + col), Act<T>::from_floats(lo, hi));
  } else {
    const Pair p = Act<T>::from_floats(lo, hi);
    if (col < size_n) atomicAdd(row + col, reinterpret_cast<const T*>(&p)[0]);
    if (col + 1 < size_n) atomicAdd(row + col + 1, reinterpret_cast<const T*>(&p)[1]);
  }
}

// Warps sharing a 64-column tile fold their accumulators through shared memory (red: kRedI4 of the Geometry);
// afterwards warps kg = 0 (warps 0..N_TILES-1) hold the tile's sums. Every thread of the block must call it.
// Elementwise, so it works on either accumulator layout (NB = 8: rows; NB = 4: WarpLoop's SWAP layout). The sums are
// always the same pairwise tree over k groups (P = warps per tile: step P/2, then P/4, ..., 1: v[j] += v[j + step]),
// so the result does not depend on which form below runs:
// * one pass where every other group's values fit in red at once ((P - 1) * N_TILES * M_BLOCKS * NB * 128 floats:
//   the SWAP layout always, a one-m16-block row layout with 2 k groups; see fold_buffer_floats): groups kg > 0
//   store, one barrier, groups kg = 0 load them all and run the tree in registers;
// * else pass by pass, one m16 block at a time (two barriers per tree step).
// No barrier follows the last read: the caller must pass a barrier before red is written again (both kernels do: a
// pipeline stage lies between two folds).
template <int M_BLOCKS, int N_TILES, int NB>
__device__ __forceinline__ void fold_warps(float (&acc)[M_BLOCKS][NB][4], float* red) {
  constexpr int kWarpsPerN = kWarps / N_TILES;
  if constexpr (kWarpsPerN > 1) {
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int nt = warp % N_TILES;
    const int kg = warp / N_TILES;
    constexpr int kWarpFloats = NB * 4 * 32;  // one warp's values of one m16 block
    constexpr int kRedFloats = fold_buffer_floats(N_TILES);
    if constexpr ((kWarpsPerN - 1) * N_TILES * M_BLOCKS * kWarpFloats <= kRedFloats) {
      if (kg > 0) {
        float* dst = red + ((kg - 1) * N_TILES + nt) * M_BLOCKS * kWarpFloats;
#pragma unroll
        for (int mb = 0; mb < M_BLOCKS; ++mb)
#pragma unroll
          for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int r = 0; r < 4; ++r) dst[((mb * NB + nb) * 4 + r) * 32 + lane] = acc[mb][nb][r];
      }
      __syncthreads();
      if (kg == 0) {
#pragma unroll
        for (int mb = 0; mb < M_BLOCKS; ++mb)
#pragma unroll
          for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              float v[kWarpsPerN];
              v[0] = acc[mb][nb][r];
#pragma unroll
              for (int g = 1; g < kWarpsPerN; ++g)
                v[g] = red[(((g - 1) * N_TILES + nt) * M_BLOCKS * NB + mb * NB + nb) * 4 * 32 + r * 32 + lane];
#pragma unroll
              for (int step = kWarpsPerN / 2; step >= 1; step /= 2)
#pragma unroll
                for (int j = 0; j < step; ++j) v[j] += v[j + step];
              acc[mb][nb][r] = v[0];
            }
      }
    } else {
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
          if (mb + 1 < M_BLOCKS || step > 1) __syncthreads();  // (red is rewritten by the next pass)
        }
      }
    }
  }
}

}  // namespace mwb
