// Host check: WeightFetch's thread -> (k16 row, int4) assignment copies every int4 of a stage's B exactly once, to
// the shared position the straightforward enumeration (HEAD's fetch_weight_stage) used.
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
      const int kt = t / F::kRowThreads, rem = t % F::kRowThreads + n * F::kRowThreads;  // source (row, int4)
      const int i = kt * F::kRowI4 + rem;  // HEAD's linear index of that source int4
      const int j = rem % G::kTileI4;
      const int swz = (G::kTileI4 == 64) ? (j % 2) * 32 + j / 2 : j;
      const int head_dst = kt * NT * G::kTileI4 + (rem - j) + swz;
      const int new_dst = F::b_dst_of(t) + F::b_copy_delta(n);
      if (rem >= F::kRowI4 || head_dst != new_dst) ++bad;
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
