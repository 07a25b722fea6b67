// Byte layout of the two FP8 paged KV-cache formats (docs/formats.md) and the scalar
// dequantization rule, shared by the CPU handlers and the CUDA kernels.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define JSM_HD __host__ __device__ __forceinline__
#else
#define JSM_HD inline
#endif

namespace jsm {

enum class KVFormat : int32_t { kV32 = 0, kModel1 = 1 };

constexpr int kDimV = 512;          // d_v: every format yields 512 value dims
constexpr int kRopeDims = 64;       // bf16 RoPE dims stored unquantized

// V32 (DeepSeek V3.2): token after token, 656 bytes each.
struct V32Layout {
  static constexpr int kDimQK = 576;
  static constexpr int kNopeDims = 512;
  static constexpr int kTileDims = 128;          // dims sharing one scale
  static constexpr int kNumTiles = 4;
  static constexpr int kBytesPerToken = 656;
  static constexpr int kScaleOffset = 512;       // 4 x float32
  static constexpr int kRopeOffset = 528;        // 64 x bf16
};

// MODEL1: page-planar. Region A holds [448 fp8 | 64 bf16] per token (576 B),
// region B after it holds 8 scale bytes per token (7 UE8M0 + 1 pad).
struct Model1Layout {
  static constexpr int kDimQK = 512;
  static constexpr int kNopeDims = 448;
  static constexpr int kTileDims = 64;
  static constexpr int kNumTiles = 7;
  static constexpr int kBytesPerToken = 584;
  static constexpr int kDataBytes = 576;         // region A stride
  static constexpr int kScaleBytes = 8;          // region B stride
  static constexpr int kRopeOffset = 448;        // inside region A
};

JSM_HD int dim_qk(KVFormat f) { return f == KVFormat::kV32 ? V32Layout::kDimQK : Model1Layout::kDimQK; }
JSM_HD int nope_dims(KVFormat f) { return f == KVFormat::kV32 ? V32Layout::kNopeDims : Model1Layout::kNopeDims; }
JSM_HD int bytes_per_token(KVFormat f) {
  return f == KVFormat::kV32 ? V32Layout::kBytesPerToken : Model1Layout::kBytesPerToken;
}

// Where one token's bytes live. `token` is the flat index page * page_size + offset.
struct TokenAddress {
  const uint8_t* nope;    // fp8 NoPE codes
  const uint8_t* rope;    // bf16 RoPE dims (little-endian)
  const uint8_t* scales;  // V32: 4 float32; MODEL1: 7 UE8M0 bytes
};

JSM_HD TokenAddress token_address(const uint8_t* cache, KVFormat f, int64_t page_size, int64_t token) {
  const int64_t page = token / page_size;
  const int64_t slot = token - page * page_size;
  TokenAddress a;
  if (f == KVFormat::kV32) {
    const uint8_t* base = cache + token * V32Layout::kBytesPerToken;
    a.nope = base;
    a.scales = base + V32Layout::kScaleOffset;
    a.rope = base + V32Layout::kRopeOffset;
  } else {
    const uint8_t* page_base = cache + page * page_size * Model1Layout::kBytesPerToken;
    const uint8_t* data = page_base + slot * Model1Layout::kDataBytes;
    a.nope = data;
    a.rope = data + Model1Layout::kRopeOffset;
    a.scales = page_base + page_size * Model1Layout::kDataBytes + slot * Model1Layout::kScaleBytes;
  }
  return a;
}

// ---- scalar conversions (host reference path; kernels may use intrinsics) ----

JSM_HD float bits_to_float(uint32_t bits) {
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

JSM_HD uint32_t float_to_bits(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  return bits;
}

JSM_HD float bf16_bits_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// Round-to-nearest-even float32 -> bf16 bits; NaN stays NaN.
JSM_HD uint16_t float_to_bf16_bits(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

JSM_HD float round_to_bf16(float f) { return bf16_bits_to_float(float_to_bf16_bits(f)); }

// OCP float8_e4m3fn: bias 7, no infinities, S.1111.111 is NaN.
JSM_HD float fp8_e4m3_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exp = (b >> 3) & 0xfu;
  const uint32_t man = b & 0x7u;
  if (exp == 0xfu && man == 0x7u) return bits_to_float(sign | 0x7fc00000u);
  if (exp == 0) {  // subnormal: man/8 * 2^-6, exact in float32
    const float mag = static_cast<float>(man) * 0.001953125f;  // 2^-9
    return sign ? -mag : mag;
  }
  return bits_to_float(sign | ((exp + 120u) << 23) | (man << 20));
}

// UE8M0 scale byte: 2^(e-127); 255 is NaN. Built from exponent bits (exact): e << 23, plus
// bit 22 for e = 0 (2^-127, a float32 subnormal) and e = 255 (inf -> NaN). Without branches:
// the GPU kernels decode 14-16 of these a block, and as early returns they compiled to a
// divergent branch each (a fifth of MODEL1's 16-head consumer samples, session 25).
JSM_HD float ue8m0_to_float(uint8_t e) {
  const uint32_t bits = static_cast<uint32_t>(e) << 23;
  const bool special = static_cast<uint8_t>(e + 1) <= 1;  // e is 255 or 0
  return bits_to_float(bits | (special ? 0x00400000u : 0u));
}

JSM_HD float load_f32_le(const uint8_t* p) {
  uint32_t u = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
               (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
  return bits_to_float(u);
}

JSM_HD uint16_t load_u16_le(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (p[1] << 8));
}

// Scale of NoPE dim `d` of a token, already rounded to bf16 (docs/formats.md, Dequantizing:
// the scale is rounded to bf16 before the product).
JSM_HD float nope_scale(const TokenAddress& a, KVFormat f, int d) {
  if (f == KVFormat::kV32) return round_to_bf16(load_f32_le(a.scales + 4 * (d / V32Layout::kTileDims)));
  return ue8m0_to_float(a.scales[d / Model1Layout::kTileDims]);
}

// Dequantized key dim `d` (0 <= d < d_qk) as float (a bf16 value). Values are dims < 512.
JSM_HD float dequant_dim(const TokenAddress& a, KVFormat f, int d) {
  const int nope = nope_dims(f);
  if (d < nope) return round_to_bf16(fp8_e4m3_to_float(a.nope[d]) * nope_scale(a, f, d));
  return bf16_bits_to_float(load_u16_le(a.rope + 2 * (d - nope)));
}

}  // namespace jsm
