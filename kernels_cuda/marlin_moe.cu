// Fused Marlin MoE GEMM and the elementwise steps of an MoE layer (workbench/moe/).
//
// NumPy spec of marlin_moe (one GEMM phase, docs/formats.md, "Fused MoE layer"):
//   for every block b < num_tokens_post_padded / BS with e = expert_ids[b] >= 0, every id in
//   sorted_ids[b*BS : (b+1)*BS] with id < numel:   C[id] = rnd(w[id] * (A[id / top_k] @ dequant(B[e]) + bias[e]))
//   (w = 1 unless topk_weights is given, bias = 0 unless given; rows no block names are not written)
//   Any N and K a multiple of 8 (docs/formats.md, "Shapes that are not tile multiples"): each expert's arrays are those
//   of its weight zero-padded to ceil(K / 16) rows and ceil(N / 64) 64-column tiles; C is (numel, N).
//
// Work decomposition: an item is (block b of BS routed rows, column tile of BN columns), solved over the whole K by
// one CTA, so every output element has exactly one writer (no cross-CTA reduction, bitwise reproducible). A grid of
// at most #SMs CTAs walks the items with a grid stride, skipping blocks whose expert is -1, and its cp.async ring
// runs on across item boundaries, so a CTA never drains its pipeline between items:
//
//     items (b, col):   (0,0) (0,1) ... (0,C-1) (1,0) ...          CTA j takes items j, j + grid, j + 2 grid, ...
//     per item:         A rows gathered by sorted id  x  B[e] tiles (cols) streamed k-stage by k-stage
//
// The main loop is the dense kernel's (marlin_mainloop.cuh): the same stage layout (Geometry), the same weight /
// scale / zero-point fetch, the same per-warp stage work with the pairs cached per group (WarpLoop) and the same warp
// fold. What is this kernel's own: the work items over routed blocks, the A row gather by sorted id, skipping
// expert -1, and the scatter with the router weight. MIN_BLOCKS = 2 (16-row blocks only) cuts the kernel to 128
// registers so that two CTAs share an SM, as the dense kernel does for M <= 16.
//
//   silu_and_mul   h[r, j]  = rnd(silu(x[r, j]) * x[r, N + j])          gate = first N columns, up = last N
//   swiglu_oai_and_mul  h[r, j] = rnd((clip(u, -l, l) + 1) * g' * sigmoid(alpha * g')),  g' = min(g, l),
//                  g = x[r, j], u = x[r, N + j]: gpt-oss's clamped SwiGLU ("swigluoai") on the de-interleaved gate_up
//                  (workbench/moe/gpt_oss.py permutes gpt-oss's interleaved rows once, when the stack is built)
//   moe_sum        out[t, :] = rnd(sum_j w[t, j] * y[row(t, j), :])      the router-weighted sum over top_k
//   gather_rows    out[i, :] = x[rows[i], :]                             rows grouped by expert (batched path)
//   add_bias       y[r, :]   = rnd(y[r, :] + bias)                       bias of a single-expert view
//   moe_align      moe_align_block_size on the device (docs/formats.md, "moe_align_block_size";
//                  kernels_numba/moe_align.py is the same algorithm in Numba): one CuPy launch instead of Numba's
//                  per-call host dispatch
//
// All math in fp32, one rounding to the activation type at the end (workbench.moe.moe_reference rounds there too).
#include "marlin_mainloop.cuh"

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
  allow_dependent_launch();
  grid_dependency_wait();  // x is the gate_up GEMM's output
  const long long total = static_cast<long long>(rows) * n;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long r = i / n, j = i % n;
    const float g = to_f32(x[r * 2 * n + j]);
    const float u = to_f32(x[r * 2 * n + n + j]);
    out[i] = from_f32<T>(g / (1.f + expf(-g)) * u);
  }
}

// alpha and limit travel as the bits of float32 values in int32 parameters (the launch ABI's argument kinds are
// addresses and integers: workbench/moe/kernels.py PLAN_ARG_KINDS).
template <typename T>
__global__ void swiglu_oai_and_mul(const T* __restrict__ x,  // (rows, 2n): gate columns first, then up
                                   T* __restrict__ out,      // (rows, n)
                                   int rows, int n, int alpha_bits, int limit_bits) {
  allow_dependent_launch();
  grid_dependency_wait();  // x is the gate_up GEMM's output
  const float alpha = __int_as_float(alpha_bits), limit = __int_as_float(limit_bits);
  const long long total = static_cast<long long>(rows) * n;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long r = i / n, j = i % n;
    const float g = fminf(to_f32(x[r * 2 * n + j]), limit);
    const float u = fminf(fmaxf(to_f32(x[r * 2 * n + n + j]), -limit), limit);
    out[i] = from_f32<T>((u + 1.f) * (g / (1.f + expf(-alpha * g))));
  }
}

template <typename T>
__global__ void moe_sum(const T* __restrict__ y,            // (y_rows, k)
                        const float* __restrict__ weights,  // (m * top_k,) or null (weight 1)
                        const int* __restrict__ row_of,     // (m * top_k,) row of y per entry, -1 = none; or null
                        T* __restrict__ out,                // (m, k)
                        int m, int top_k, int k, int y_rows) {
  allow_dependent_launch();
  grid_dependency_wait();  // y is the down GEMM's output
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
  allow_dependent_launch();
  grid_dependency_wait();
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
  allow_dependent_launch();
  grid_dependency_wait();
  const long long total = static_cast<long long>(rows) * n;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    y[i] = from_f32<T>(to_f32(y[i]) + to_f32(bias[i % n]));
  }
}

// moe_align_block_size: group the routed (token, slot) entries by expert into blocks of block_size rows. One block
// of kAlignThreads >= num_experts threads (the host launches exactly that), four phases separated by barriers:
//   1. count    counts[e] += 1 for every flat entry with an expert in [0, E)           (shared atomics)
//   2. starts   starts[e] = sum over e' < e of roundup(counts[e'], block_size)          (Hillis-Steele scan, shared)
//   3. prefill  sorted_ids[:] = numel (sentinel); expert_ids[b] = local id of the expert owning block b, 0 past the
//               padded total
//   4. scatter  sorted_ids[starts[e]++] = i                                             (shared atomics)
// Every element of the three outputs is written. The order inside an expert's segment follows the atomics (as the
// Numba kernel's); the segments' content, expert_ids and num_post_padded match the NumPy spec exactly.
constexpr int kAlignThreads = 1024;
constexpr int kAlignMaxExperts = kAlignThreads;  // the scan gives each thread one expert

__global__ void __launch_bounds__(kAlignThreads)
moe_align(const int* __restrict__ topk_ids,    // (numel,) expert per routed entry; outside [0, E) = dropped
          int numel, int num_experts, int block_size,
          const int* __restrict__ expert_map,  // (E,) local id of each expert, -1 = on another device; or null
          int* __restrict__ sorted_ids,        // (cap,)
          int cap,
          int* __restrict__ expert_ids,        // (cap / block_size,)
          int* __restrict__ num_post_padded) { // (1,)
  __shared__ int counts[kAlignMaxExperts];
  __shared__ int starts[kAlignMaxExperts + 1];
  allow_dependent_launch();
  grid_dependency_wait();  // topk_ids may be the router's output; the outputs may still be read by the kernel before
  const int tid = threadIdx.x;
  for (int e = tid; e < num_experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int i = tid; i < numel; i += blockDim.x) {
    const int e = topk_ids[i];
    if (e >= 0 && e < num_experts) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  // starts[e + 1] = padded size of expert e, then an inclusive scan over 1..E turns it into the segment starts.
  if (tid < num_experts) starts[tid + 1] = (counts[tid] + block_size - 1) / block_size * block_size;
  if (tid == 0) starts[0] = 0;
  __syncthreads();
  for (int offset = 1; offset < num_experts; offset *= 2) {
    const int idx = tid + 1;
    const int add = (idx <= num_experts && idx > offset) ? starts[idx - offset] : 0;
    __syncthreads();
    if (idx <= num_experts) starts[idx] += add;
    __syncthreads();
  }
  const int total = starts[num_experts];
  if (tid == 0) num_post_padded[0] = total;
  for (int j = tid; j < cap; j += blockDim.x) sorted_ids[j] = numel;
  for (int b = total / block_size + tid; b < cap / block_size; b += blockDim.x) expert_ids[b] = 0;
  if (tid < num_experts) {
    const int local = expert_map ? expert_map[tid] : tid;
    for (int b = starts[tid] / block_size; b < starts[tid + 1] / block_size; ++b) expert_ids[b] = local;
  }
  __syncthreads();  // the prefill lands before the scatter overwrites part of it; starts[] becomes the cursors
  for (int i = tid; i < numel; i += blockDim.x) {
    const int e = topk_ids[i];
    if (e >= 0 && e < num_experts) sorted_ids[atomicAdd(&starts[e], 1)] = i;
  }
}

// SWAP (moe_block_size 8, M_BLOCKS = 1): one mma per 16x16 sub-block on the transposed problem (WarpLoop).
template <typename T, int W, int M_BLOCKS, int N_TILES, int K_WARP, int STAGES, int GROUP_MODE, int MIN_BLOCKS,
          bool SWAP>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS)
marlin_moe(const int4* __restrict__ A,              // (prob_m, lda) activations, lda % 8 == 0
           const int4* __restrict__ B,              // (E, K/16, N*16/pack) int32 Marlin tiles
           T* __restrict__ C,                       // (numel, N) output rows, one per routed entry
           const int4* __restrict__ scales,         // (E, num_groups, N) act type, Marlin-permuted
           const int4* __restrict__ zeros,          // (E, num_groups, N/pack) int32 or null; NVFP4: (E,) fp32 global
                                                    // scales (vLLM's per-expert global_scale, exponent correction in)
           const int* __restrict__ sorted_ids,      // (n_blocks * block_size,) flat entry ids, >= numel = padding
           const int* __restrict__ expert_ids,      // (n_blocks,) expert of each block, -1 = not on this device
           const int* __restrict__ num_post_padded, // (1,) rows of sorted_ids in use
           const float* __restrict__ topk_weights,  // (numel,) router weight per entry, or null
           const T* __restrict__ bias,              // (E, N) added before the router weight, or null
           int n_blocks, int block_size, int numel, int top_k, int prob_n, int prob_k, int lda, int group_size,
           int num_experts) {
  static_assert(GROUP_MODE == kChannelwise || GROUP_MODE == kGrouped, "act-order stacks take the batched path");
  static_assert(MIN_BLOCKS == 1 || (MIN_BLOCKS == 2 && M_BLOCKS == 1), "two CTAs per SM only with 16-row blocks");
  static_assert(!SWAP || M_BLOCKS == 1, "the swapped loop covers 8-row blocks");
  static_assert(!Weight<W>::kByteScales || GROUP_MODE == kGrouped, "microscaled formats have grouped scales only");
  using G = Geometry<T, W, M_BLOCKS, N_TILES, K_WARP, STAGES, GROUP_MODE>;
  using Loop = WarpLoop<T, W, M_BLOCKS, N_TILES, K_WARP, STAGES, GROUP_MODE, SWAP,
                        late_scale_pays<MIN_BLOCKS, SWAP, K_WARP>()>;
  constexpr int BN = G::BN, BK = G::BK;
  constexpr bool kHasZero = Weight<W>::kHasZero;
  constexpr int kPack = Weight<W>::kPack;
  constexpr int kAChunks = (G::kAI4 + kThreads - 1) / kThreads;  // A chunks (16 bytes) a thread fetches per stage
  // NVFP4 has no zero points: its launch passes one fp32 global scale per expert in the zero-point slot (the dense
  // kernel passes its one there too), applied to the item's fp32 sums before the bias (as the dense epilogue).
  const float* const global_scale = reinterpret_cast<const float*>(zeros);

  // Under a programmatic launch (workbench/moe/layer.py) this grid may start while the kernel before it runs: every
  // read below depends on the routing (which expert's weights), so all of it waits; only the launch itself overlaps.
  allow_dependent_launch();
  grid_dependency_wait();
  extern __shared__ int4 smem[];
  const StageRing<G> ring(smem);
  // Every cp.async destination below derives from fetch_base, a per-thread register that ptxas cannot prove
  // warp-uniform (opaque_zero; the fold buffer is free until the first tile ends), so no uniform register enters a
  // cache-hinted copy's address (docs/performance.md, "The dense GEMM", copies without an L2 cache hint).
  const unsigned zero_t = opaque_zero(smem_addr(ring.red) + 4 * threadIdx.x);
  const unsigned fetch_base = ring.base + zero_t;

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int nt = warp % N_TILES;
  const int kg = warp / N_TILES;

  // Tile counts rounded up (the host picks BN dividing the padded width); the last k step may run past K (weight rows
  // clamped by WeightFetch, A columns >= K zero-filled below).
  const int n_tiles_total = (prob_n + 63) / 64;
  const int n_pad = n_tiles_total * 64;  // the weight arrays' width
  const int KI = (prob_k + BK - 1) / BK;
  const int cols = n_pad / BN;
  constexpr int kARowI4 = BK / 8;
  // ---- routing, read one item ahead ------------------------------------------------------------------------
  // An item's routing (its block's expert and the sorted ids of the rows this thread copies) is loaded when the fetch
  // enters the item before it, so no fetch waits on a routing load (docs/performance.md, "The fused MoE kernel"); the
  // first item's routing is loaded beside num_post_padded. Any block < n_blocks is inside both arrays; whether it is in
  // use (< num_post_padded / block_size) is decided when its item is reached.
  struct Routing {
    int expert;
    int ids[kAChunks];  // the sorted id of each A copy's row (numel for rows past the block)
  };
  auto load_routing = [&](int w, Routing& r) {
    const int b = w / cols;
    r.expert = -1;
#pragma unroll
    for (int j = 0; j < kAChunks; ++j) r.ids[j] = numel;
    if (b >= n_blocks) return;
    r.expert = expert_ids[b];
#pragma unroll
    for (int j = 0; j < kAChunks; ++j) {
      const int i = tid + j * kThreads;
      const int row = i / kARowI4;
      if (i < G::kAI4 && row < block_size) r.ids[j] = sorted_ids[static_cast<long long>(b) * block_size + row];
    }
  };
  // The output rows of an item (warps 0..N_TILES-1, which store them): each lane's two rows per m16 block. Their
  // sorted ids are loaded an item ahead (the first item's at the start, before any copy is in flight), their router
  // weights when the item starts: the finishing waits on no load (it waited on two dependent ones before).
  unsigned out_id[M_BLOCKS][2], next_out_id[M_BLOCKS][2];
  float out_scale[M_BLOCKS][2];
  int next_out_item = blockIdx.x;  // the item whose ids next_out_id holds
  auto load_out_ids = [&](int w) {
    next_out_item = w;
    if (kg != 0) return;
    const int b = w / cols;
#pragma unroll
    for (int mb = 0; mb < M_BLOCKS; ++mb)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = mb * 16 + lane / 4 + 8 * half;
        next_out_id[mb][half] = r < block_size && b < n_blocks
                                    ? static_cast<unsigned>(sorted_ids[static_cast<long long>(b) * block_size + r])
                                    : static_cast<unsigned>(numel);
      }
  };
  Routing f_route;  // the routing of the next item the fetch enters
  load_routing(blockIdx.x, f_route);
  load_out_ids(blockIdx.x);
  const int used_blocks = min(num_post_padded[0] / block_size, n_blocks);  // never past the arrays' end
  const int total_items = max(used_blocks, 0) * cols;
  auto start_out_rows = [&](int w) {
    if (next_out_item != w) load_out_ids(w);  // (the item before was followed by skipped ones: expert maps only)
    if (kg == 0) {
#pragma unroll
      for (int mb = 0; mb < M_BLOCKS; ++mb)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          out_id[mb][half] = next_out_id[mb][half];
          out_scale[mb][half] = topk_weights && out_id[mb][half] < static_cast<unsigned>(numel)
                                    ? topk_weights[out_id[mb][half]]
                                    : 1.f;
        }
    }
    if (w + gridDim.x < total_items) load_out_ids(w + gridDim.x);
  };
  const int group_shift = GROUP_MODE == kGrouped ? __ffs(group_size) - 1 : 0;
  const int num_groups = GROUP_MODE == kGrouped ? (prob_k + group_size - 1) >> group_shift : 1;  // (last: partial)
  const long long b_expert_i4 = static_cast<long long>((prob_k + 15) / 16) * (n_pad * 16 / kPack) / 4;
  // (scale bytes of the microscaled formats: one byte per (group, column), half the 16-bit scales' int4)
  const long long s_expert_i4 = static_cast<long long>(num_groups) * n_pad * Weight<W>::kScaleBytes / 16;
  const long long z_expert_i4 = static_cast<long long>(num_groups) * n_pad / kPack / 4;

  // The next item at or after w on this CTA's stride whose block has a local expert (ids outside [0, E) are
  // skipped too: -1 marks experts on other devices, anything else would read past the weights); r holds w's routing
  // on entry and the returned item's on exit (a skip loads the next one's at once: only with an expert map).
  auto settle = [&](int w, Routing& r) -> int {
    while (w < total_items && static_cast<unsigned>(r.expert) >= static_cast<unsigned>(num_experts)) {
      w += gridDim.x;
      load_routing(w, r);
    }
    return w;
  };

  // ---- fetch: global -> shared of k-stage kit of item w into a ring slot ---------------------------------------
  // A: thread t copies chunk t % (BK / 8) of rows t / (BK / 8) + j kThreads / (BK / 8) of the item's block; the
  // rows' pointers (gathered by sorted id, at k = 0) are formed when the fetch enters an item, a stage adds k0 / 8.
  // Padding rows (invalid ids) change per item: they are zero-filled by their copies (source size 0, from A's first
  // row).
  static_assert((kThreads / kARowI4) % 8 == 0, "copies of one thread share the swizzle");
  const unsigned a_dst = fetch_base + G::kAOff + 16 * G::a_index(tid / kARowI4, tid % kARowI4);
  const int4* a_src[kAChunks];  // this thread's row of each copy at k = 0 (A's first row for padding)
  unsigned a_valid = 0;         // bit j: copy j's row is a routed entry
  auto gather_rows = [&](const Routing& r) {
    a_valid = 0;
#pragma unroll
    for (int j = 0; j < kAChunks; ++j) {
      const unsigned id = static_cast<unsigned>(r.ids[j]);
      long long row_i4 = 0;
      if (id < static_cast<unsigned>(numel)) {
        row_i4 = static_cast<long long>(id / top_k) * (lda / 8);
        a_valid |= 1u << j;
      }
      a_src[j] = A + row_i4 + tid % kARowI4;
    }
  };
  WeightFetch<G, W, GROUP_MODE> wfetch;
  wfetch.init(n_tiles_total, prob_k, group_size, fetch_base);
  // A's columns >= K zero-filled (the dense kernel's fetch_a): this thread's chunk column leaves a_left columns of K.
  const int a_left = prob_k - 8 * (tid % kARowI4);
  // The fetched item's column tile and expert, set at its first stage (every item's fetches start at kit 0): no
  // division, no routing load and no pointer formation per stage. Entering an item starts the next one's routing.
  int f_col = 0;
  auto fetch_stage = [&](unsigned slot, int w, int kit) {
    if (kit == 0) {
      const int b = w / cols;
      f_col = w - b * cols;
      const int e = f_route.expert;
      gather_rows(f_route);
      wfetch.begin(B + e * b_expert_i4, scales + e * s_expert_i4, zeros + (kHasZero ? e * z_expert_i4 : 0), nullptr,
                   f_col, n_tiles_total);
      if (w + gridDim.x < total_items) load_routing(w + gridDim.x, f_route);  // (else never read: settle stops)
    }
    // SWAP reads rows 0..7 only (kThreads / kARowI4 >= 8 rows per copy): the copies of rows 8.. are not made.
    const int bytes = a_chunk_bytes(a_left - kit * BK);
    const int a_step = bytes > 0 ? kit * (BK / 8) : 0;
#pragma unroll
    for (int j = 0; j < (SWAP ? 1 : kAChunks); ++j) {
      if (G::kAI4 % kThreads == 0 || tid + j * kThreads < G::kAI4)
        cp_async16_zfill_at(slot + a_dst + 16 * j * kThreads, a_src[j] + a_step, (a_valid >> j) & 1u ? bytes : 0);
    }
    wfetch.fetch(slot, kit, group_shift);
  };

  // ---- per-item state: this warp's accumulators and the current group's pairs (marlin_mainloop.cuh) ----------
  Loop loop;
  const typename Loop::LaneOffsets lane_off = Loop::lane_offsets();
  auto load_channelwise = [&](int w, int e) {
    const int col = w % cols;
    loop.load_channelwise(reinterpret_cast<const T*>(scales + e * s_expert_i4) + col * BN + nt * 64,
                          reinterpret_cast<const unsigned*>(zeros + (kHasZero ? e * z_expert_i4 : 0)) +
                              (col * BN + nt * 64) / kPack);
  };

  // ---- finish an item: fold the warps of each 64-column tile, then scatter rows to C --------------------------
  auto finish_item = [&](int w, int e) {
    // Fold in the loop's own layout (elementwise: the same sums as folding after the transpose, on half the values
    // when swapped), then only the warps holding the item's sums take the row layout (keeps the 128-register
    // two-CTA kernels free of spills).
    fold_warps<M_BLOCKS, N_TILES>(loop.acc, ring.red);
    if (kg != 0) return;  // warps 0..N_TILES-1 hold the item's sums
    float acc[M_BLOCKS][8][4];  // the item's sums in row layout
    loop.rows_layout(acc);
    if constexpr (Weight<W>::kGlobalScale) {  // NVFP4: the expert's global scale on the fp32 sums
      const float gs = __ldg(global_scale + e);
#pragma unroll
      for (int mb = 0; mb < M_BLOCKS; ++mb)
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[mb][nb][r] *= gs;
    }
    const int col = w % cols;
    const int col0 = col * BN + nt * 64 + 2 * (lane % 4);  // this lane's first column; n8 block nb adds 8 nb
    // the item's expert's bias row (columns >= N are neither read nor written)
    const T* b_row = bias != nullptr ? bias + static_cast<long long>(e) * prob_n : nullptr;
    float2 bv[8];
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) bv[nb] = bias_pair(b_row, col0 + nb * 8, prob_n);
#pragma unroll
    for (int mb = 0; mb < M_BLOCKS; ++mb)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const unsigned id = out_id[mb][half];
        if (id >= static_cast<unsigned>(numel)) continue;
        const float scale = out_scale[mb][half];
        T* c_row = C + static_cast<long long>(id) * prob_n;
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
          store_c_pair(c_row, col0 + nb * 8, prob_n, scale * (acc[mb][nb][2 * half] + bv[nb].x),
                       scale * (acc[mb][nb][2 * half + 1] + bv[nb].y));
      }
  };

  // ---- main loop: one ring over this CTA's (item, k-stage) sequence -------------------------------------------
  int f_item = settle(blockIdx.x, f_route), f_kit = 0;  // next stage to fetch
  int c_item = f_item;                                   // next item to compute
  int c_expert = f_route.expert;                         // its expert
  auto advance_fetch = [&]() {
    if (++f_kit == KI) {
      f_kit = 0;
      f_item = settle(f_item + gridDim.x, f_route);
    }
  };
  const unsigned last_off = zero_t + (STAGES - 1) * G::kStageBytes;
  unsigned fetch_off = last_off;  // the main loop's first refill: slot STAGES - 1, then 0, 1, ...
  // (Not unrolled: each unrolled stage carried the item entry's code, 4336 SASS instructions against 2744 in a
  // V2-Lite-like M = 1 kernel.)
#pragma unroll 1
  for (int st = 0; st < STAGES - 1; ++st) {
    if (f_item < total_items) {
      fetch_stage(zero_t + st * G::kStageBytes, f_item, f_kit);
      advance_fetch();
    }
    cp_async_commit();
  }
  loop.zero_acc();
  SlotCursor<G, STAGES> cursor(ring.base);
  // One stage loop per item (every item runs all KI stages), the item's finishing after it: the stage loop has no
  // finishing under a branch inside it.
  // The compute side walks the fetch's item sequence behind it: the next item's expert is read when an item starts.
  while (c_item < total_items) {
    if (GROUP_MODE == kChannelwise) load_channelwise(c_item, c_expert);
    start_out_rows(c_item);
    Routing c_next;
    c_next.expert = c_item + gridDim.x < total_items ? expert_ids[(c_item + gridDim.x) / cols] : -1;
    for (int c_kit = 0; c_kit < KI; ++c_kit) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // the compute slot is visible; the slot refilled below was released by every warp
      if (f_item < total_items) {
        fetch_stage(fetch_off, f_item, f_kit);
        advance_fetch();
      }
      cp_async_commit();
      loop.compute_stage(cursor.slot, lane_off, c_kit * BK, group_size, group_shift, nullptr, nullptr, prob_n, 0);
      cursor.advance();
      fetch_off = fetch_off == last_off ? zero_t : fetch_off + G::kStageBytes;
    }
    finish_item(c_item, c_expert);
    loop.zero_acc();
    c_item = settle(c_item + gridDim.x, c_next);
    c_expert = c_next.expert;
  }
  cp_async_wait<0>();
}

}  // namespace mwb
