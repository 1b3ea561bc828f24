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
// PER_WARP (the dense kernel's per-warp pipeline): for every stage and group size, each warp's lanes copy every scale
// (and zero-point) int4 its loop reads (WarpLoop::load_group at the warp's region, group row counted from its first k
// row) from the right group row, into its own region; regions of different warps are disjoint and lie in kSI4 / kZI4.
template <int W, int KW>
int check_per_warp() {
  using G = Geometry<__half, W, 1, 1, KW, 4, kGrouped>;
  using F = WeightFetch<G, W, kGrouped, true>;
  constexpr bool kZero = Weight<W>::kHasZero;
  int bad = 0;
  for (int g : {32, 64, 128, 256, 1024}) {
    int sh = 0;
    while ((1 << sh) < g) ++sh;
    for (int kit = 0; kit < 3; ++kit) {
      std::vector<int> s_src(G::kSI4, -1), s_owner(G::kSI4, -1), z_src(G::kZI4 > 0 ? G::kZI4 : 1, -1);
      for (int w = 0; w < kWarps; ++w) {
        const int k_first = w * F::kWarpRows;
        const int rows = F::kWarpRows > g ? F::kWarpRows / g : 1;
        const int g0 = (kit * G::BK + k_first) >> sh;
        for (int lane = 0; lane < 32; ++lane) {
          if (lane < rows * (G::BN / 8)) {  // source: group row g0 + lane / (BN/8), int4 lane % (BN/8)
            const int d = F::s_dst_of(w, lane);
            if (d < 0 || d >= G::kSI4 || s_owner[d] != -1) ++bad;
            else { s_owner[d] = w; s_src[d] = (g0 + lane / (G::BN / 8)) * (G::BN / 8) + lane % (G::BN / 8); }
          }
          if (kZero && lane < rows * F::kZRowI4) {
            const int d = F::z_dst_of(w, lane);
            if (d < 0 || d >= G::kZI4) ++bad;
            else z_src[d] = (g0 + lane / F::kZRowI4) * F::kZRowI4 + lane % F::kZRowI4;
          }
        }
      }
      for (int w = 0; w < kWarps; ++w)
        for (int i = 0; i < KW; ++i) {
          const int k = kit * G::BK + w * F::kWarpRows + 16 * i;  // tile i's first row
          const int rel = (k >> sh) - ((kit * G::BK + w * F::kWarpRows) >> sh);
          for (int lane = 0; lane < 32; ++lane) {
            const int d = F::s_dst_of(w, 0) + rel * (G::BN / 8) + lane / 4;  // load_group's scale int4
            if (d >= G::kSI4 || s_owner[d] != w || s_src[d] != (k >> sh) * (G::BN / 8) + lane / 4) ++bad;
            if (kZero) {  // the int4 holding this lane's zero-point word(s) (at byte 4 (lane / 4) (bits / 4))
              const int zi = 4 * (lane / 4) * (Weight<W>::kBits / 4) / 16;
              const int zd = F::z_dst_of(w, 0) + rel * F::kZRowI4 + zi;
              if (zd >= G::kZI4 || z_src[zd] != (k >> sh) * F::kZRowI4 + zi) ++bad;
            }
          }
        }
    }
  }
  std::printf("per-warp W=%d K_WARP=%d: %s\n", W, KW, bad ? "MISMATCH" : "ok");
  return bad;
}
int main() {
  int bad = 0;
  bad += check_per_warp<5, 4>() + check_per_warp<5, 2>() + check_per_warp<4, 4>() + check_per_warp<4, 2>();
  bad += check_per_warp<7, 2>() + check_per_warp<7, 4>() + check_per_warp<6, 2>() + check_per_warp<6, 4>();
  // every (N_TILES, K_WARP) the dense and MoE kernels use, 4-bit (u4b8) and 8-bit (u8b128) tiles
  bad += check<5, 2, 4>() + check<5, 2, 2>() + check<5, 1, 1>() + check<5, 4, 2>() + check<5, 2, 1>();
  bad += check<5, 1, 2>();
  bad += check<7, 2, 4>() + check<7, 2, 2>() + check<7, 1, 1>() + check<7, 4, 2>() + check<7, 2, 1>();
  bad += check<7, 1, 2>();
  return bad != 0;
}
