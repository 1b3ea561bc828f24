// Register-level dequantization of Marlin weight words into mma.m16n8k16 B fragments, and the maps that say where
// a lane finds its scales and zero points. Shared by the dense GEMM and the fused MoE GEMM.
//
// One lane, one 16(k) x 16(n) sub-block s of a 16x64 Marlin tile (docs/formats.md, "Closed form and the 1024-entry
// permutation"):
//
//            column n0 = 16s + lane/4        column n0 + 8
//   rows k0, k0+1     b[0][0]                  b[1][0]          k0 = 2 (lane % 4)
//   rows k0+8, k0+9   b[0][1]                  b[1][1]
//
// b[h][r] is one 32-bit register = two activation-typed values (low half = the lower k row), i.e. exactly the B
// operand registers of two mma.m16n8k16 (columns n0 and n0 + 8).
//
//   4-bit: one word per sub-block; field j sits at bits 4j..4j+3 and holds (dk, dn) =
//          j: 0:(0,0) 1:(8,0) 2:(0,8) 3:(8,8) 4:(1,0) 5:(9,0) 6:(1,8) 7:(9,8)
//          so (word >> 8h) & 0x000f000f is the pair (rows k0, k0+1) of column n0 + 8h, and >> 4 more gives rows
//          k0+8, k0+9.
//   8-bit: two words per sub-block (column n0, then n0+8); byte j holds dk = 0, 8, 1, 9. Bytes (0, 2) are rows
//          (k0, k0+1), bytes (1, 3) rows (k0+8, k0+9).
//
// Integer codes become numbers through the exponent of a "magic" float: OR-ing a code c < 2^m into the mantissa
// of 2^m gives exactly 2^m + c, and subtracting 2^m + zero leaves the exact small integer c - zero. That needs
// 10 mantissa bits for 8-bit codes, so 8-bit codes always go through fp16 (2^10 = 1024, 0x6400); 4-bit codes in
// bf16 use 2^7 = 128 (0x4300). The difference is exact, so the one rounding happens in the scale multiply, as in
// the reference dequantizer (workbench.quantize.dequantize).
//
// FP8 E4M3 bytes become fp16 / bf16 by moving bits: sign to bit 15, the 7 exponent+mantissa bits below it. The
// exponent field is copied unchanged, so the value is off by 2^(15-7) = 2^8 (fp16) or 2^(127-7) = 2^120 (bf16):
// the host folds that factor into the scales (docs/formats.md, "Exponent bias in the scales"), so no extra multiply
// happens here.
//
// FP4 E2M1 nibbles (NVFP4, MXFP4) become fp16 / bf16 the same way, as vLLM's Marlin does: the sign to bit 15, the
// 2 exponent bits and the mantissa bit to the top of the carrier's exponent and mantissa (fp16 bits 11..9, bf16 bits
// 8..6). An E2M1 subnormal (code 1, 0.5) lands on the carrier's subnormal of the same weight, so every code is exact,
// off by 2^(15-1) = 2^14 (fp16) or 2^(127-1) = 2^126 (bf16). Where that factor is folded:
//   NVFP4: into the fp32 global scale (x 2^14 / 2^7 = 2^7 for fp16, x 2^126 / 2^7 = 2^119 for bf16; the 2^7 is the
//          S0E5M3 scale byte's, see scale_pairs below; workbench/formats/fp4_marlin.py, step 4), applied to the fp32
//          sums at the end of a slice;
//   MXFP4 / MXFP8 (bf16, E8M0 scales up to 2^127, so the factor fits no scale): one multiply of every dequantized
//          pair by 2^126 (E2M1) or 2^120 (E4M3), exact, before the scale's (kBiasPair).
#pragma once

#include "mma.cuh"

namespace mwb {

// Weight-type codes: the launch ABI's scalar codes (workbench.scalar_types.ScalarType.abi_code), plus 16 where the
// scales are E8M0 codes (the MX formats): the scale type is part of a kernel's weight format, like the bits.
//   kFE2M1      NVFP4: E2M1 codes, S0E5M3 scale bytes (group 16), an fp32 global scale
//   kFE2M1E8M0  MXFP4: E2M1 codes, E8M0 scale bytes (group 32), bf16 only
//   kFE4M3E8M0  MXFP8: E4M3 codes, E8M0 scale bytes (group 32), bf16 only
enum WeightCode : int { kU4 = 4, kU4B8 = 5, kU8 = 6, kU8B128 = 7, kFE4M3 = 8, kFE2M1 = 9, kE8M0Scales = 16,
                        kFE4M3E8M0 = kFE4M3 + kE8M0Scales, kFE2M1E8M0 = kFE2M1 + kE8M0Scales };

template <int W> struct Weight {
  static_assert(W == kU4 || W == kU4B8 || W == kU8 || W == kU8B128 || W == kFE4M3 || W == kFE2M1 ||
                W == kFE4M3E8M0 || W == kFE2M1E8M0, "unknown weight code");
  static constexpr bool kIsFp4 = (W == kFE2M1 || W == kFE2M1E8M0);
  static constexpr int kBits = (W == kU4 || W == kU4B8 || kIsFp4) ? 4 : 8;
  static constexpr int kPack = 32 / kBits;          // codes per 32-bit word
  static constexpr bool kHasZero = (W == kU4 || W == kU8);
  static constexpr bool kIsFp8 = (W == kFE4M3 || W == kFE4M3E8M0);
  static constexpr int kBias = (W == kU4B8) ? 8 : (W == kU8B128 ? 128 : 0);  // symmetric types: code - bias
  static constexpr int kWordsPerSubblock = kBits / 4;  // 4-bit: one word covers both columns; 8-bit: one each
  // Microscaled formats: one scale byte per (group, column) instead of an activation-typed scale.
  static constexpr bool kE8M0 = (W == kFE4M3E8M0 || W == kFE2M1E8M0);
  static constexpr bool kByteScales = kE8M0 || W == kFE2M1;
  static constexpr int kScaleBytes = kByteScales ? 1 : 2;
  static constexpr bool kGlobalScale = (W == kFE2M1);  // NVFP4's fp32 per-tensor scale, applied to fp32 sums
  // Byte scales take groups down to 16 rows (NVFP4); a stage then holds BK / 16 group rows of BN bytes, the same
  // bytes as BK / 32 rows of 16-bit scales (Geometry::kSmemBytes does not change).
  static constexpr int kMinGroup = kByteScales ? 16 : 32;
};

// (a & b) | c in one instruction (PTX ISA "lop3": immLut = (0xF0 & 0xCC) | 0xAA = 0xEA).
__device__ __forceinline__ unsigned and_or(unsigned a, unsigned b, unsigned c) {
  unsigned d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Does the integer path of (T, W) carry codes in bf16 (4-bit, bf16 activations) or in fp16 (everything else)?
template <typename T, int W>
struct Carrier {
  static constexpr bool kBf16 = Act<T>::kIsBf16 && Weight<W>::kBits == 4;
  static constexpr unsigned kMagicPair = kBf16 ? 0x43004300u : 0x64006400u;  // (2^7, 2^7) bf16 / (2^10, 2^10) fp16
  static constexpr int kMagic = kBf16 ? 128 : 1024;
};

// The 16-bit pattern of (magic + zero) in the carrier type: what to subtract from (magic + code).
// zero is the zero point (u4/u8) or the fixed bias (u4b8/u8b128). Both magics have an ulp of exactly 1 over the
// codes' range (fp16 1024..2047, bf16 128..255), so magic + zero is the magic's bit pattern OR zero: no conversion.
template <typename T, int W>
__device__ __forceinline__ unsigned short offset_bits(int zero) {
  return static_cast<unsigned short>((Carrier<T, W>::kMagicPair & 0xFFFFu) | static_cast<unsigned>(zero));
}

__device__ __forceinline__ unsigned pair_bits(unsigned short lo, unsigned short hi) {
  return static_cast<unsigned>(lo) | (static_cast<unsigned>(hi) << 16);
}

// fp16 pattern of -(64 + zero): the high-nibble path below carries 1024 + 16 code, and (1024 + 16 code) / 16 -
// (64 + zero) = code - zero exactly (64 + zero < 128 has an ulp of 2^-4, and 1/16 is a power of two), so one hfma2
// replaces a shift, a mask and a subtraction.
__device__ __forceinline__ unsigned short neg_offset16_bits(int zero) {
  return static_cast<unsigned short>(0xD400u | (static_cast<unsigned>(zero) << 4));
}

// Both halves of a 32-bit pair set to the same 16-bit pattern.
__device__ __forceinline__ unsigned splat_bits(unsigned short v) { return static_cast<unsigned>(v) * 0x10001u; }

// magic-carried pair minus offset pair -> exact (code - zero) pair, in the activation type.
template <typename T, int W>
__device__ __forceinline__ typename Act<T>::Pair int_pair(unsigned raw, unsigned off) {
  using Pair = typename Act<T>::Pair;
  if constexpr (Carrier<T, W>::kBf16) {
    return __hsub2(as_pair<__nv_bfloat162>(raw), as_pair<__nv_bfloat162>(off));
  } else if constexpr (Act<T>::kIsBf16) {
    // 8-bit codes in bf16: subtract in fp16 (exact, |code - zero| <= 255), then convert (exact: integers <= 256).
    const __half2 d = __hsub2(as_pair<__half2>(raw), as_pair<__half2>(off));
    return __float22bfloat162_rn(__half22float2(d));
  } else {
    return static_cast<Pair>(__hsub2(as_pair<__half2>(raw), as_pair<__half2>(off)));
  }
}

// The MX formats' exponent correction of the moved bits, as a bf16 pair: 2^126 (E2M1: exponent field 253) or 2^120
// (E4M3: 247). Only bf16 carries the MX formats (static_assert in scale_pairs).
template <int W>
constexpr unsigned kBiasPair = Weight<W>::kIsFp4 ? 0x7E807E80u : 0x7B807B80u;

// Byte scales -> the four pairs (scale(s, 0), scale(s, 1)) of sub-blocks s = 0..3, as the 16-bit scales' vector
// words. u[0], u[1]: a lane's 8 scale bytes (values e = 2 s + h of the P64 vector), shuffled [0, 2, 1, 3] in fours
// on the host (workbench/formats/fp4_marlin.py, step 2), so word j holds (e 4j, e 4j+2, e 4j+1, e 4j+3): bytes (0, 2)
// are sub-block 2j's pair, bytes (1, 3) sub-block 2j+1's, and one mask picks either pair into the halves.
//   S0E5M3 (NVFP4): the byte is bits 14..7 of fp16(s 2^7) (its 3 mantissa bits are all of E4M3's), so byte << 7 is
//     that fp16 exactly; bf16 takes it through fp32 (exact: E5M3 values are bf16 values; a zero scale stays zero).
//   E8M0 (MX): code c is 2^(c - 127), bf16's exponent field: c << 7 (code 0, 2^-127, reads as 0; products with such a
//     scale are below bf16's normal range anyway).
template <typename T, int W>
__device__ __forceinline__ void scale_pairs(const unsigned (&u)[2], unsigned (&w)[4]) {
  static_assert(Weight<W>::kByteScales, "16-bit scales are read as they are");
  static_assert(!Weight<W>::kE8M0 || Act<T>::kIsBf16, "the MX formats run with bf16 activations (as vLLM)");
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const unsigned lo = u[j] & 0x00FF00FFu, hi = (u[j] >> 8) & 0x00FF00FFu;  // bytes (0, 2), bytes (1, 3)
    if constexpr (Weight<W>::kE8M0) {
      w[2 * j] = lo << 7;
      w[2 * j + 1] = hi << 7;
    } else if constexpr (Act<T>::kIsBf16) {
      w[2 * j] = as_u32(__float22bfloat162_rn(__half22float2(as_pair<__half2>(lo << 7))));
      w[2 * j + 1] = as_u32(__float22bfloat162_rn(__half22float2(as_pair<__half2>(hi << 7))));
    } else {
      w[2 * j] = lo << 7;
      w[2 * j + 1] = hi << 7;
    }
  }
}

// Dequantize one lane's share of one 16x16 sub-block: q[] holds kWordsPerSubblock words, off[h][r] the offset pairs
// (magic + zero), off16[h][r] the fp16 pairs -(64 + zero) (fp16 4-bit only), scale[h][r] the scale pairs (all unused
// where the type has no zero / no offset). Writes the four B registers b[h][r] (see the picture above).
// SCALED = false leaves the scale out: b holds the exact unscaled values (code - zero; FP8: the moved bits), for
// loops that apply the scales to fp32 partial sums instead (WarpLoop::kLateScale).
template <typename T, int W, bool SCALED = true>
__device__ __forceinline__ void dequant_subblock(const unsigned* q, const unsigned (&off)[2][2],
                                                 const unsigned (&off16)[2][2],
                                                 const typename Act<T>::Pair (&scale)[2][2], unsigned (&b)[2][2]) {
  using Pair = typename Act<T>::Pair;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    Pair v[2];
    if constexpr (Weight<W>::kIsFp4) {
      const unsigned x = h ? q[0] >> 8 : q[0];
      // fields (0, 4) at nibbles 0 and 4 of x: rows (k0, k0+1); fields (1, 5) at nibbles 1 and 5: rows (k0+8, k0+9)
      constexpr int kShift = Act<T>::kIsBf16 ? 6 : 9;  // the nibble's e e m bits to the carrier's bits
      v[0] = as_pair<Pair>(((x & 0x00080008u) << 12) | ((x & 0x00070007u) << kShift));
      v[1] = as_pair<Pair>(((x & 0x00800080u) << 8) | ((x & 0x00700070u) << (kShift - 4)));
    } else if constexpr (Weight<W>::kIsFp8) {
      const unsigned x = q[h];
      unsigned r0, r1;  // bytes (0, 2) -> rows (k0, k0+1); bytes (1, 3) -> rows (k0+8, k0+9)
      if constexpr (Act<T>::kIsBf16) {
        r0 = ((x << 8) & 0x80008000u) | ((x << 4) & 0x07F007F0u);
        r1 = (x & 0x80008000u) | ((x >> 4) & 0x07F007F0u);
      } else {
        r0 = ((x << 8) & 0x80008000u) | ((x << 7) & 0x3F803F80u);
        r1 = (x & 0x80008000u) | ((x >> 1) & 0x3F803F80u);
      }
      v[0] = as_pair<Pair>(r0);
      v[1] = as_pair<Pair>(r1);
    } else if constexpr (Weight<W>::kBits == 4 && !Carrier<T, W>::kBf16) {
      const unsigned x = h ? q[0] >> 8 : q[0];
      // low nibbles (fields 0, 4): 1024 + code; high nibbles (fields 1, 5): 1024 + 16 code
      const __half2 lo = as_pair<__half2>(and_or(x, 0x000f000fu, 0x64006400u));
      const __half2 hi = as_pair<__half2>(and_or(x, 0x00f000f0u, 0x64006400u));
      v[0] = static_cast<Pair>(__hsub2(lo, as_pair<__half2>(off[h][0])));
      v[1] = static_cast<Pair>(__hfma2(hi, __half2(__ushort_as_half(0x2C00), __ushort_as_half(0x2C00)),  // 1/16
                                       as_pair<__half2>(off16[h][1])));
    } else if constexpr (Weight<W>::kBits == 4) {
      const unsigned x = h ? q[0] >> 8 : q[0];
      constexpr unsigned kMagic = Carrier<T, W>::kMagicPair;
      v[0] = int_pair<T, W>(and_or(x, 0x000f000fu, kMagic), off[h][0]);
      v[1] = int_pair<T, W>(and_or(x >> 4, 0x000f000fu, kMagic), off[h][1]);
    } else {
      const unsigned x = q[h];
      // byte_perm picks bytes of {x, 0x64646464}: [x.b0, 0x64, x.b2, 0x64] = fp16 pair (1024 + b0, 1024 + b2)
      v[0] = int_pair<T, W>(__byte_perm(x, 0x64646464u, 0x4240), off[h][0]);
      v[1] = int_pair<T, W>(__byte_perm(x, 0x64646464u, 0x4341), off[h][1]);
    }
    if constexpr (Weight<W>::kE8M0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) v[r] = __hmul2(v[r], as_pair<Pair>(kBiasPair<W>));
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) b[h][r] = SCALED ? as_u32(__hmul2(v[r], scale[h][r])) : as_u32(v[r]);
  }
}

// ---- where a lane finds its scales and zero points ----------------------------------------------------------
// Within one 64-column tile, lane l's columns are c + 16 s + 8 h with c = l / 4 (sub-block s, column half h).
//
// Grouped scales use the 64-wide permutation P64 (docs/formats.md, "Scale permutation"): the 8 values at offset 8c
// are columns c + 8e, so value e = 2s + h of that 16-byte vector belongs to (s, h).
__device__ __forceinline__ int grouped_scale_slot(int s, int h) { return 2 * s + h; }

// Channelwise scales (one group) use the 32-wide pair permutation P32: column c + 16 s + 8 h of the tile sits at
// 32 (s / 2) + 8 (c / 2) + 4 (s % 2) + 2 h + c % 2.
__device__ __forceinline__ int channelwise_scale_index(int c, int s, int h) {
  return 32 * (s / 2) + 8 * (c / 2) + 4 * (s % 2) + 2 * h + (c % 2);
}

// Zero points are P64-permuted, then interleaved inside each word so that dequant pairs line up, then packed
// (docs/formats.md, "Marlin zero points"). For lane column c of a 64-column tile:
//   4-bit: one word (index c of the tile's 8); (s, h) is field s + 4 h.
//   8-bit: two words (2c, 2c + 1); e = 2s + h lives in word e / 4, byte [0, 2, 1, 3][e % 4].
template <int W>
__device__ __forceinline__ int zero_of(const unsigned* zw, int s, int h) {
  if constexpr (Weight<W>::kBits == 4) {
    return (zw[0] >> (4 * (s + 4 * h))) & 0xF;
  } else {
    const int e = 2 * s + h;
    const int byte = (e & 1) * 2 + ((e >> 1) & 1);  // [0, 2, 1, 3][e % 4]
    return (zw[e >> 2] >> (8 * byte)) & 0xFF;
  }
}

}  // namespace mwb
