// Host check: WeightFetch's thread -> (k16 row, int4) assignment copies every int4 of a stage's B exactly once, to the
// same position in shared memory as in the stage's global rows (row kt at kt kRowI4: shared holds the global bytes),
// and the lanes of a warp that copy from one row copy consecutive int4 on both sides (512 or 2 x 256 bytes).
#include <cstdio>
#include <vector>
#include "marlin_mainloop.cuh"
using namespace mwb;
template <int W, int NT, int KW>
int check() {
  using G = Geometry<__half, W, 1, NT, KW, 4, kGrouped>;
  using F = WeightFetch<G, W, kGrouped>;
  std::vector<int> seen(G::kBI4, 0);
  int bad = 0;
  for (int t = 0; t < kThreads; ++t)
    for (int n = 0; n < F::kCopies; ++n) {
      const int kt = t / F::kRowThreads;                            // source row inside the stage
      const int c = t % F::kRowThreads + F::b_copy_delta(n);         // source int4 inside the row
      const int i = kt * F::kRowI4 + c;
      const int dst = F::b_dst_of(t) + F::b_copy_delta(n);
      if (kt >= G::KT || c >= F::kRowI4 || dst != i) ++bad;
      // the lanes of this warp that share t's row: int4 consecutive by lane
      const int lane = t % 32, first = (lane / F::kRowThreads) * F::kRowThreads, t0 = t - lane + first;
      if (F::kRowThreads < 32 && 32 % F::kRowThreads != 0) ++bad;
      if (t0 / F::kRowThreads != kt || t0 % F::kRowThreads + F::b_copy_delta(n) + (lane - first) != c) ++bad;
      if (i >= 0 && i < G::kBI4) ++seen[i];
    }
  for (int c : seen) bad += c != 1;
  std::printf("W=%d N_TILES=%d K_WARP=%d copies=%d row_threads=%d: %s\n", W, NT, KW, F::kCopies, F::kRowThreads,
              bad ? "MISMATCH" : "ok");
  return bad;
}
int main() {
  int bad = 0;
  // every (N_TILES, K_WARP) the dense and MoE kernels use, 4-bit (u4b8) and 8-bit (u8b128) tiles
  bad += check<5, 2, 4>() + check<5, 2, 2>() + check<5, 1, 1>() + check<5, 4, 2>() + check<5, 2, 1>();
  bad += check<5, 1, 2>();
  bad += check<7, 2, 4>() + check<7, 2, 2>() + check<7, 1, 1>() + check<7, 4, 2>() + check<7, 2, 1>();
  bad += check<7, 1, 2>();
  return bad != 0;
}
