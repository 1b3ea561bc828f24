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
// PER_WARP (the dense kernel's per-warp pipeline, one or two tiles): for every stage and group size, each warp's
// lanes copy every scale (and zero-point) int4 its loop reads (WarpLoop::load_group in its k group's region, group
// row counted from the group's first k row, tile nt's columns) from the right group row and column, into a place no
// other warp writes; with two tiles, every int4 of the stage's B is copied once, by the warp that reads it.
template <int W, int NT, int KW>
int check_per_warp() {
  using G = Geometry<__half, W, 1, NT, KW, 4, kGrouped>;
  using F = WeightFetch<G, W, kGrouped, true>;
  constexpr bool kZero = Weight<W>::kHasZero;
  constexpr int kTileS = 8;  // scale int4 of one tile's part of a row
  int bad = 0;
  if constexpr (F::kRemapB) {  // B: warp (nt, kg) reads rows kg KW .. + KW - 1 of tile nt
    std::vector<int> owner(G::kBI4, -1);
    for (int w = 0; w < kWarps; ++w)
      for (int lane = 0; lane < 32; ++lane)
        for (int n = 0; n < F::kCopies; ++n) {
          const int d = F::b_dst_warp(w, lane) + F::b_warp_delta(n);
          const int row = d / F::kRowI4, tile = d % F::kRowI4 / G::kTileI4;
          if (d < 0 || d >= G::kBI4 || owner[d] != -1 || tile != w % NT || row / KW != w / NT) ++bad;
          else owner[d] = w;
          // global: row kt0 + n / kLaneB of tile nt, int4 32 (n % kLaneB) + lane, i.e. the same (row, int4) as d
          const int src_row = w / NT * KW + n / F::kLaneB, src_i = n % F::kLaneB * 32 + lane;
          if (src_row != row || tile * G::kTileI4 + src_i != d % F::kRowI4) ++bad;
        }
    for (int o : owner) bad += o == -1;
  }
  for (int g : {32, 64, 128, 256, 1024}) {
    int sh = 0;
    while ((1 << sh) < g) ++sh;
    for (int kit = 0; kit < 3; ++kit) {
      std::vector<int> s_src(G::kSI4, -1), s_owner(G::kSI4, -1), z_src(G::kZI4 > 0 ? G::kZI4 : 1, -1),
          z_owner(G::kZI4 > 0 ? G::kZI4 : 1, -1);
      for (int w = 0; w < kWarps; ++w) {
        const int nt = w % NT, k_first = w / NT * F::kWarpRows;
        const int rows = F::kWarpRows > g ? F::kWarpRows / g : 1;
        const int g0 = (kit * G::BK + k_first) >> sh;
        for (int lane = 0; lane < 32; ++lane) {
          if (lane < rows * kTileS) {  // source: group row g0 + lane / 8, int4 nt 8 + lane % 8
            const int d = F::s_dst_of(w, lane);
            if (d < 0 || d >= G::kSI4 || s_owner[d] != -1) ++bad;
            else { s_owner[d] = w; s_src[d] = (g0 + lane / kTileS) * (G::BN / 8) + nt * kTileS + lane % kTileS; }
          }
          if (kZero && lane < rows * F::kZTileI4) {
            const int d = F::z_dst_of(w, lane);
            if (d < 0 || d >= G::kZI4 || z_owner[d] != -1) ++bad;
            else {
              z_owner[d] = w;
              z_src[d] = (g0 + lane / F::kZTileI4) * F::kZRowI4 + nt * F::kZTileI4 + lane % F::kZTileI4;
            }
          }
        }
      }
      for (int w = 0; w < kWarps; ++w)
        for (int i = 0; i < KW; ++i) {
          const int nt = w % NT, k_first = w / NT * F::kWarpRows;
          const int k = kit * G::BK + k_first + 16 * i;  // tile i's first row
          const int rel = (k >> sh) - ((kit * G::BK + k_first) >> sh);
          for (int lane = 0; lane < 32; ++lane) {
            const int col = nt * kTileS + lane / 4;  // load_group's scale int4 (o.s: nt 8 + lane / 4)
            const int d = F::s_region(w) + rel * (G::BN / 8) + col;
            if (d >= G::kSI4 || s_owner[d] != w || s_src[d] != (k >> sh) * (G::BN / 8) + col) ++bad;
            if (kZero) {  // o.z: byte 4 (nt (64 / pack) + (lane / 4) (bits / 4)) of the row
              const int zi = 4 * (nt * (64 / Weight<W>::kPack) + (lane / 4) * (Weight<W>::kBits / 4)) / 16;
              const int zd = F::z_region(w) + rel * F::kZRowI4 + zi;
              if (zd >= G::kZI4 || z_owner[zd] != w || z_src[zd] != (k >> sh) * F::kZRowI4 + zi) ++bad;
            }
          }
        }
    }
  }
  std::printf("per-warp W=%d N_TILES=%d K_WARP=%d: %s\n", W, NT, KW, bad ? "MISMATCH" : "ok");
  return bad;
}
int main() {
  int bad = 0;
  bad += check_per_warp<5, 1, 4>() + check_per_warp<5, 1, 2>() + check_per_warp<4, 1, 4>() + check_per_warp<4, 1, 2>();
  bad += check_per_warp<7, 1, 2>() + check_per_warp<7, 1, 4>() + check_per_warp<6, 1, 2>() + check_per_warp<6, 1, 4>();
  bad += check_per_warp<5, 2, 4>() + check_per_warp<5, 2, 2>() + check_per_warp<4, 2, 4>() + check_per_warp<4, 2, 2>();
  bad += check_per_warp<7, 2, 2>() + check_per_warp<7, 2, 4>() + check_per_warp<6, 2, 2>() + check_per_warp<6, 2, 4>();
  // every (N_TILES, K_WARP) the dense and MoE kernels use, 4-bit (u4b8) and 8-bit (u8b128) tiles
  bad += check<5, 2, 4>() + check<5, 2, 2>() + check<5, 1, 1>() + check<5, 4, 2>() + check<5, 2, 1>();
  bad += check<5, 1, 2>();
  bad += check<7, 2, 4>() + check<7, 2, 2>() + check<7, 1, 1>() + check<7, 4, 2>() + check<7, 2, 1>();
  bad += check<7, 1, 2>();
  return bad != 0;
}
