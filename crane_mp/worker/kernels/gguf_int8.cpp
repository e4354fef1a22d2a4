// Matmuls on GGUF-quantized weights with 8-bit activations (CPU), the scheme llama.cpp computes with:
//
//   gguf_linear_int8(x [M, K] float32|bf16, w [N, row_bytes] uint8, qtype, K) -> [M, N] in x's dtype
//   gguf_grouped_linear_int8(x [R, K], ws [N, row_bytes] uint8 each, rows, qtype, K) -> [R, N]: run i of
//                            rows[i] rows of x times ws[i] (a mixture's experts)
//   gguf_linear_parts_int8(x [M, K], ws [N_i, row_bytes_i] uint8, qtypes, K) -> [M, sum N_i]: one
//                          layer's parts of different types side by side (q/k/v), in one pass
//   gguf_gate_up_silu_int8(x [M, K], gate [N, .], up [N, .], gate_type, up_type, K) -> [M, N]:
//                          silu(x . gate) * (x . up), the products never written out
//   gguf_moe_token_int8(x [1, H], ids [k], gates [k], gate_up [E, 2I, .], gate_up_type, down [E, H, .],
//                       down_type) -> [1, H]: one token through its k SiLU-gated experts, gates applied
//   gguf_quantize_activations(x [M, K] float32, qtype) -> (q int8 [M, K], d float32 [M, K / B],
//                                                          sums int16 [M, K / 16])           (tests)
//
// Activations are quantized once per call, in blocks the size of the weight type's: 256 for the
// K-quants (llama.cpp's Q8_K), 32 for the others (Q8_0). A block keeps one float scale d = amax / 127,
// its values round(x * 127 / amax) in [-127, 127], and the sums of every 16 and 32 values (the
// K-quants' mins and Q6_K's -32 offset, Q4_1/Q5_1's offsets, are applied through these sums). Since activation
// and weight blocks line up, each block's dot product is an exact integer sum (unsigned 4-6 bit
// weights times signed bytes, pairs into int16, then int32, scaled by the weight's integer sub-block
// scales), turned into float once per block. That is several times the arithmetic per instruction of
// widening every weight to float, and what keeps decode bound by the weights' bytes.
//
// Up to 4 activation rows share each decoded weight block. Rows of the weight are split across
// threads in tiles small enough to stay in L2 while every group of 4 activation rows passes over
// them, so prefill reads each weight from DRAM once too; nothing is dequantized to float. Q4_K,
// Q6_K and Q8_0 rows repacked eight at a time (gguf_repack.cpp) go through the same tiles, a group at a
// time (two Q4_K groups at once in 512-bit vectors with AVX512-VNNI, from 16 activation rows; Q6_K
// sixteen rows a group, 8 activation rows a call, where the CPU also has VBMI; Q4_0 sixteen rows a group
// with AVX512-VNNI); while the activations fit in L2, all of them pass over one group before the next.
// Prompts (kTileMinRows rows or more) take the sixteen-row groups and the eight-row Q8_0 ones through
// the AMX-INT8 tiles where those are on (gguf_tiles.cpp): the same integer sums and results.
// int16 sums never saturate: a pair of products is at most 2 * 63 * 127 (6-bit weights) or
// 2 * 128 * 127 (8-bit, through the sign trick) < 32767. With AVX512-VNNI (the avx512_bf16 and amx
// tiers) byte products go into int32 in one instruction; the integer results are the same.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <new>
#include <tuple>
#include <vector>

#if !defined(__AVX2__)
#error "gguf_int8.cpp is built per tier, every tier has AVX2 (loader.py)"
#endif
#include <immintrin.h>

#include "cpu_vec.h"
#include "gguf_blocks.h"
#include "gguf_int8.h"

namespace {

using namespace crane_mp::gguf;
using namespace crane_mp::int8;

bool k_quant(int64_t qtype) {
  return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K || qtype == kQ4KX8 || qtype == kQ6KX8 || qtype == kQ4KX16 ||
         qtype == kQ6KX16;
}

bool int8_type(int64_t qtype) {
  switch (qtype) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: case Q4_K: case Q5_K: case Q6_K: case MXFP4:
    case kQ4KX8: case kQ8_0X8: case kQ6KX8: case kQ4KX16: case kQ6KX16: case kQ4_0X16:
      return true;
  }
  return false;
}

// Activation rows per kernel call: 4 rows' accumulators and operands fill the 16 vector registers.
constexpr int64_t kRowGroup = 4;
// Activation rows the 512-bit kernels take a call (the tile kernels: kTileRowsPerCall).
constexpr int64_t kMaxRowsPerCall = 8;

// The kernel of a repacked type; nullptr for GGUF's own rows.
GroupDotFn group_dot(int64_t qtype) {
  if (qtype == kQ4KX8) return dot_q4_k_x8;
  if (qtype == kQ8_0X8) return dot_q8_0_x8;
  if (qtype == kQ6KX8) return dot_q6_k_x8;
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  if (qtype == kQ4KX16) return dot_q4_k_x16;
  if (qtype == kQ6KX16) return dot_q6_k_x16;
  if (qtype == kQ4_0X16) return dot_q4_0_x16;
#endif
  return nullptr;
}

// Weight rows a repacked group holds.
int64_t group_rows(int64_t qtype) { return qtype == kQ4KX16 || qtype == kQ6KX16 || qtype == kQ4_0X16 ? 16 : 8; }

// Activation rows a call takes: the 512-bit kernels unpack each weight vector once for 8 rows'
// vpdpbusd (1.13-1.25x at 16 rows against 4 a call); the 256-bit kernels' operands fill the registers
// at 4.
int64_t rows_per_call(int64_t qtype) { return group_rows(qtype) == 16 ? kMaxRowsPerCall : kRowGroup; }

int64_t group_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4KX8: return kQ4KX8Bytes;
    case kQ6KX8: return kQ6KX8Bytes;
    case kQ4KX16: return kQ4KX16Bytes;
    case kQ6KX16: return kQ6KX16Bytes;
    case kQ4_0X16: return kQ4_0X16Bytes;
  }
  return kQ8_0X8Bytes;
}

// ---- activations ------------------------------------------------------------------------------

inline float hmax(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// Divisions through intrinsics: -ffast-math may not turn them into reciprocals, and the tests'
// reference quantizer (float32 division, round half to even) must see the same values.
inline float divide(float a, float b) { return _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(a), _mm_set_ss(b))); }

// One row of K floats into `block`-sized blocks of int8 values, their scales and 16- and 32-value sums.
void quantize_row(const float* x, int64_t K, int64_t block, int8_t* q, float* d, int16_t* sums, int16_t* sums32) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / block; ++b) {
    const float* xb = x + b * block;
    __m256 vmax = _mm256_setzero_ps();
    for (int64_t i = 0; i < block; i += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
    const float amax = hmax(vmax);
    d[b] = divide(amax, 127.0f);
    const __m256 iscale = _mm256_set1_ps(amax > 0.0f ? divide(127.0f, amax) : 0.0f);
    for (int64_t i = 0; i < block; i += 32) {
      // cvtps rounds half to even (the default MXCSR mode); packs saturate, never needed past +-127.
      __m256i v[4];
      for (int j = 0; j < 4; ++j) v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * j), iscale));
      const __m256i words = _mm256_packs_epi32(v[0], v[1]), words2 = _mm256_packs_epi32(v[2], v[3]);
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * block + i), bytes);
    }
  }
  for (int64_t g = 0; g < K / 16; ++g) {
    int sum = 0;
    for (int i = 0; i < 16; ++i) sum += q[g * 16 + i];
    sums[g] = static_cast<int16_t>(sum);
  }
  for (int64_t g = 0; g < K / 32; ++g) sums32[g] = static_cast<int16_t>(sums[2 * g] + sums[2 * g + 1]);
}

// ---- integer dot products ---------------------------------------------------------------------

// 16 bytes of packed nibbles -> 32 values 0..15: low nibbles are elements 0-15, high ones 16-31.
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4());
}

// Q5_0/Q5_1's 32 fifth bits (a little-endian uint32, bit l for element l) -> 0x10 in byte l where set.
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), spread);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}

// pshufb masks that broadcast one 16-bit word of each 128-bit lane to the whole lane: word[j] picks
// word j in both lanes; pair[s] picks word 2s in the low lane and 2s + 1 in the high one.
struct WordMasks {
  alignas(32) uint8_t word[8][32];
  alignas(32) uint8_t pair[4][32];
  constexpr WordMasks() : word{}, pair{} {
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 32; ++i) word[j][i] = static_cast<uint8_t>(2 * j + (i & 1));
    for (int s = 0; s < 4; ++s)
      for (int i = 0; i < 32; ++i) pair[s][i] = static_cast<uint8_t>(4 * s + (i < 16 ? 0 : 2) + (i & 1));
  }
};
constexpr WordMasks kMasks;

// Each kernel: one weight row against activation rows m0 .. m0 + MR - 1; out[m] = row . x[m0 + m].

// Types with 32-element blocks and signed values (Q8_0, Q4_0 as q - 8, Q5_0 as q - 16, MXFP4's codes
// as their integer values, at most 12 in magnitude).
template <int MR, int64_t kType>
void dot_signed32(const uint8_t* row, const Acts& a, int64_t m0, float* out) {
  constexpr int64_t kBytes = kType == Q8_0 ? 34 : (kType == Q4_0 ? 18 : (kType == MXFP4 ? 17 : 22));
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  const int8_t* x = a.q + m0 * a.K;
  const float* dx = a.d + m0 * a.nb;
  for (int64_t b = 0; b < a.nb; ++b, row += kBytes) {
    prefetch_ahead<1>(row);  // blocks of 18-34 bytes: a line ahead covers each
    __m256i w;
    if constexpr (kType == Q8_0) {
      w = load(row + 2);
    } else if constexpr (kType == Q4_0) {
      w = _mm256_sub_epi8(nibbles32(row + 2), _mm256_set1_epi8(8));
    } else if constexpr (kType == MXFP4) {
      const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Values));
      w = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), nibbles32(row + 1));
    } else {
      w = _mm256_sub_epi8(_mm256_or_si256(nibbles32(row + 6), fifth_bits(row + 2)), _mm256_set1_epi8(16));
    }
    const __m256i wabs = _mm256_sign_epi8(w, w);
    const float dw = kType == MXFP4 ? e8m0_half(row[0]) : half_to_float(row);
    for (int m = 0; m < MR; ++m) {
      const __m256i p = dot_u8s8(wabs, _mm256_sign_epi8(load(x + m * a.K + 32 * b), w));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * dx[m * a.nb + b]), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = hsum(acc[m]);
}

// Q4_1, Q5_1: unsigned values q with weight d * q + min; the mins meet the activations' block sums.
template <int MR, int64_t kType>
void dot_offset32(const uint8_t* row, const Acts& a, int64_t m0, float* out) {
  constexpr int64_t kBytes = kType == Q4_1 ? 20 : 24;
  __m256 acc[MR];
  float offsets[MR] = {};
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  const int8_t* x = a.q + m0 * a.K;
  const float* dx = a.d + m0 * a.nb;
  const int16_t* sx = a.sums + m0 * (a.K / 16);
  for (int64_t b = 0; b < a.nb; ++b, row += kBytes) {
    prefetch_ahead<1>(row);
    const __m256i u = kType == Q4_1 ? nibbles32(row + 4) : _mm256_or_si256(nibbles32(row + 8), fifth_bits(row + 4));
    const float dw = half_to_float(row), mw = half_to_float(row + 2);
    for (int m = 0; m < MR; ++m) {
      const float da = dx[m * a.nb + b];
      const __m256i p = dot_u8s8(u, load(x + m * a.K + 32 * b));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * da), acc[m]);
      const int16_t* s = sx + m * (a.K / 16) + 2 * b;
      offsets[m] += mw * da * static_cast<float>(s[0] + s[1]);
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = hsum(acc[m]) + offsets[m];
}

// A Q4_K/Q5_K block's first 16 bytes (d, dmin, 12 bytes of 6-bit scales and mins) -> 8 scale bytes
// (low half of `scales`) and 8 min bytes (low half of `mins`). As 32-bit words w1-w3 of the 16:
// w1 holds scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; w2 the same for the mins; w3
// the low 4 bits of scales 4-7 (low nibbles) and of mins 4-7 (high nibbles).
inline void k_scales_mins(const uint8_t* block, __m128i& scales, __m128i& mins) {
  const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
  const __m128i low6 = _mm_and_si128(w, _mm_set1_epi8(0x3F));                                   // lanes 1, 2
  const __m128i w3 = _mm_shuffle_epi32(w, 0xFF);
  const __m128i low4 = _mm_and_si128(_mm_srlv_epi32(w3, _mm_setr_epi32(0, 0, 4, 0)), _mm_set1_epi8(0x0F));
  const __m128i top2 = _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(w, 6), _mm_set1_epi8(0x03)), 4);
  const __m128i high = _mm_or_si128(low4, top2);                                                // lanes 1, 2
  scales = _mm_unpackhi_epi64(_mm_unpacklo_epi32(low6, high), _mm_setzero_si128());  // [low6.1, high.1]
  mins = _mm_unpackhi_epi32(low6, high);                                             // [low6.2, high.2, ...]
}

// Q4_K/Q5_K: 8 sub-blocks of 32, each with a 6-bit scale and min; weight = d * s_j * q - dmin * m_j.
template <int MR, bool kFive>
void dot_qk(const uint8_t* row, const Acts& a, int64_t m0, float* out) {
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  const int8_t* x = a.q + m0 * a.K;
  const float* dx = a.d + m0 * a.nb;
  const int16_t* sx = a.sums + m0 * (a.K / 16);
  for (int64_t b = 0; b < a.nb; ++b, row += kFive ? 176 : 144) {
    prefetch_ahead<kFive ? 176 : 144>(row);
    const float d = half_to_float(row), dmin = half_to_float(row + 2);
    __m128i scale_bytes, min_bytes;
    k_scales_mins(row, scale_bytes, min_bytes);
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scale_bytes));  // words 0-7, both lanes
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(min_bytes, min_bytes));  // m_j at words 2j, 2j+1
    const uint8_t* q = row + (kFive ? 48 : 16);
    __m256i high = kFive ? load(row + 16) : _mm256_setzero_si256();
    __m256i isum[MR];
    for (int m = 0; m < MR; ++m) isum[m] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = load(q + 32 * c);
      __m256i lo = _mm256_and_si256(raw, low4()), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4());
      if constexpr (kFive) {  // bit 2c of each qh byte for sub-block 2c, bit 2c + 1 for 2c + 1
        const __m256i one = _mm256_set1_epi8(1), two = _mm256_set1_epi8(2);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(high, one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(high, two), 3));
        high = _mm256_srli_epi16(high, 2);
      }
      const __m256i s_lo = _mm256_shuffle_epi8(scales, load(kMasks.word[2 * c]));
      const __m256i s_hi = _mm256_shuffle_epi8(scales, load(kMasks.word[2 * c + 1]));
      for (int m = 0; m < MR; ++m) {
        const int8_t* xs = x + m * a.K + 256 * b + 64 * c;
        isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load(xs)), s_lo));
        isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load(xs + 32)), s_hi));
      }
    }
    for (int m = 0; m < MR; ++m) {
      const float da = dx[m * a.nb + b];
      const __m256i min_sums = _mm256_madd_epi16(mins, load(sx + m * (a.K / 16) + 16 * b));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_set1_ps(d * da), acc[m]);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(min_sums), _mm256_set1_ps(-dmin * da), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = hsum(acc[m]);
}

// Q6_K: 16 sub-blocks of 16 with signed 8-bit scales; weight = d * s_j * (q - 32), q 6-bit unsigned.
template <int MR>
void dot_q6_k(const uint8_t* row, const Acts& a, int64_t m0, float* out) {
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  const int8_t* x = a.q + m0 * a.K;
  const float* dx = a.d + m0 * a.nb;
  const int16_t* sx = a.sums + m0 * (a.K / 16);
  for (int64_t b = 0; b < a.nb; ++b, row += 210) {
    prefetch_ahead<210>(row);
    const float d = half_to_float(row + 208);
    const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 192)));
    __m256i isum[MR];
    for (int m = 0; m < MR; ++m) isum[m] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i half_scales = h == 0 ? _mm256_permute2x128_si256(scales, scales, 0x00)
                                         : _mm256_permute2x128_si256(scales, scales, 0x11);
      const uint8_t* ql = row + 64 * h;
      __m256i q[4];
      q6_k_values(load(ql), load(ql + 32), load(row + 128 + 32 * h), q);
      for (int s = 0; s < 4; ++s) {
        const __m256i sc = _mm256_shuffle_epi8(half_scales, load(kMasks.pair[s]));
        for (int m = 0; m < MR; ++m) {
          const __m256i p = _mm256_maddubs_epi16(q[s], load(x + m * a.K + 256 * b + 128 * h + 32 * s));
          isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(p, sc));
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      // The -32 of every value: 32 * sum_j s_j * (sum of sub-block j's activations).
      const __m256i offset = _mm256_madd_epi16(scales, load(sx + m * (a.K / 16) + 16 * b));
      isum[m] = _mm256_sub_epi32(isum[m], _mm256_slli_epi32(offset, 5));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_set1_ps(d * dx[m * a.nb + b]), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = hsum(acc[m]);
}

using DotFn = void (*)(const uint8_t*, const Acts&, int64_t, float*);

template <int MR>
DotFn dot_for(int64_t qtype) {
  switch (qtype) {
    case Q8_0: return dot_signed32<MR, Q8_0>;
    case Q4_0: return dot_signed32<MR, Q4_0>;
    case Q5_0: return dot_signed32<MR, Q5_0>;
    case MXFP4: return dot_signed32<MR, MXFP4>;
    case Q4_1: return dot_offset32<MR, Q4_1>;
    case Q5_1: return dot_offset32<MR, Q5_1>;
    case Q4_K: return dot_qk<MR, false>;
    case Q5_K: return dot_qk<MR, true>;
    case Q6_K: return dot_q6_k<MR>;
  }
  TORCH_CHECK(false, "gguf_linear_int8: no integer kernel for GGML type ", qtype);
}

// ---- driver -----------------------------------------------------------------------------------

// Weight rows a thread walks before the next group of activation rows: ~128 KB, resident in L2
// while every group passes over them.
constexpr int64_t kTileBytes = 128 * 1024;
// Up to this many bytes of quantized activations (16 rows of K = 12288, 64 of 4096), every activation
// row passes over one weight group before the next: the activations stay in L2, and each weight
// block is read from memory into L1 once, with the next ones prefetched while it is used.
constexpr int64_t kGroupFirstBytes = 256 * 1024;
// Weight rows of each of gate and up a task of gguf_gate_up_silu_int8 takes at least: with a call's
// rows, a few hundred KB of weights and outputs that stay in L2.
constexpr int64_t kFusedColumns = 64;

// Allocates on cache-line boundaries: glibc starts a large allocation 16 bytes into its page, and a tile
// load's 64-byte rows that straddle two lines took twice as long (one thread's Q4_K tile kernel 1.13x).
template <class T>
struct LineAligned {
  using value_type = T;
  static constexpr std::align_val_t kLine{64};
  LineAligned() = default;
  template <class U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kLine)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kLine); }
  bool operator==(const LineAligned&) const { return true; }
  bool operator!=(const LineAligned&) const { return false; }
};

template <class T>
using LineVector = std::vector<T, LineAligned<T>>;

struct QuantizedActs {
  LineVector<int8_t> q;
  LineVector<int8_t> steps;
  LineVector<float> d;
  LineVector<int16_t> sums;
  LineVector<int16_t> sums32;
};

// `tile_order`: a tile kernel will read them (Acts::steps), which the caller decides (tiles_read).
Acts quantize(const at::Tensor& x, int64_t block, QuantizedActs& buffers, bool tile_order) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / block;
  const bool steps = tile_order && M >= kTileMinRows;
  const int64_t stride = M + 16;  // tiles read 16 rows from any row
  buffers.q.resize(std::max<size_t>(buffers.q.size(), M * K));
  if (steps) buffers.steps.resize(std::max<size_t>(buffers.steps.size(), stride * ((K + 63) / 64) * 64));
  buffers.d.resize(std::max<size_t>(buffers.d.size(), M * nb));
  buffers.sums.resize(std::max<size_t>(buffers.sums.size(), M * (K / 16)));
  buffers.sums32.resize(std::max<size_t>(buffers.sums32.size(), M * (K / 32)));
  const float* xs = x.data_ptr<float>();
  int8_t* q = buffers.q.data();
  float* d = buffers.d.data();
  int16_t* sums = buffers.sums.data();
  int16_t* sums32 = buffers.sums32.data();
  at::parallel_for(0, M, std::max<int64_t>(1, 32768 / K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      quantize_row(xs + m * K, K, block, q + m * K, d + m * nb, sums + m * (K / 16), sums32 + m * (K / 32));
      if (steps)
        for (int64_t k = 0; k < K; k += 64)
          std::memcpy(&buffers.steps[((k / 64) * stride + m) * 64], q + m * K + k, std::min<int64_t>(64, K - k));
    }
  });
  return {q, d, sums, sums32, K, nb, steps ? buffers.steps.data() : nullptr, steps ? stride : 0, 0, K};
}

// A run of `rows` activation rows through weights of `qtype` takes a tile kernel (its activations then
// come in the tiles' order too).
bool tiles_read(int64_t qtype, int64_t rows) { return rows >= kTileMinRows && tile_dot(qtype) != nullptr; }

// Activation rows every thread's weight tiles take before any takes the next rows: a tile kernel call's
// (`per_call`, the rows that stay in L2), so that the weights are streamed again for each call's rows
// rather than all the activations for each weight tile (an 8B's down and gate/up at 1,024 rows:
// 0.86-0.98x the time). The VNNI and AVX2 kernels' few rows a call take kVnniPassRows (a whole multiple
// of their calls' rows): a 2,000-token prompt's 8 MiB of activations read again for each 128 KiB weight
// tile cost a Zen 4 host 1.1-1.25x the time of passes of 256 rows over its gate/up and down.
constexpr int64_t kVnniPassRows = 256;

int64_t tile_pass_rows(bool tiled, int64_t per_call, int64_t rows) {
  if (tiled) return per_call;
  return std::min(rows, std::max<int64_t>(1, kVnniPassRows / per_call) * per_call);
}

at::Tensor as_float(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, op, ": x must be [M, ", K, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": x must be float32 or bfloat16");
  return x.to(at::kFloat).contiguous();
}

int64_t block_of(int64_t qtype) {
  TORCH_CHECK(int8_type(qtype), "no 8-bit activation scheme for GGML type ", qtype);
  return k_quant(qtype) ? 256 : 32;
}

void check_int8_weight(const at::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(qtype != kQ4KX16 || gguf_x16_supported(Q4_K), "gguf_linear_int8: Q4_K rows repacked by 16 need "
              "AVX512-VNNI, which this build lacks");
  TORCH_CHECK(qtype != kQ6KX16 || gguf_x16_supported(Q6_K), "gguf_linear_int8: Q6_K rows repacked by 16 need "
              "AVX512-VNNI and VBMI, which this build or CPU lacks");
  TORCH_CHECK(qtype != kQ4_0X16 || gguf_x16_supported(Q4_0), "gguf_linear_int8: Q4_0 rows repacked by 16 need "
              "AVX512-VNNI, which this build lacks");
  if (group_dot(qtype) == nullptr) return check_weight(w, qtype, K);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "gguf weights must be a contiguous CPU uint8 [N, row_bytes] tensor");
  const int64_t block = k_quant(qtype) ? 256 : 32, rows = group_rows(qtype);
  TORCH_CHECK(K > 0 && K % block == 0 && w.size(0) % rows == 0 && w.size(1) == K / block * (group_bytes(qtype) / rows),
              "repacked weights of shape ", w.sizes(), " do not hold ", K, " columns in groups of ", rows, " rows");
}

// One tile's output rows [n0, n1) for activation rows m0 .. m0 + rows - 1, row-major GGUF weights.
void rows_tile(const uint8_t* src, int64_t row_bytes, const DotFn fn, const Acts& acts, int64_t m0, int64_t rows,
               int64_t n0, int64_t n1, int64_t N, float* ys) {
  float dots[kRowGroup];
  for (int64_t n = n0; n < n1; ++n) {
    fn(src + n * row_bytes, acts, m0, dots);
    for (int64_t m = 0; m < rows; ++m) ys[(m0 + m) * N + n] = dots[m];
  }
}

// The same over weights repacked `rows_per_group` rows at a time (n0, n1 multiples of it), for
// activation rows [m_begin, m_end): each group against all of them before the next.
void groups_tile(const uint8_t* src, int64_t row_bytes, int64_t rows_per_group, int64_t per_call, const GroupDotFn fn,
                 const Acts& acts, int64_t m_begin, int64_t m_end, int64_t n0, int64_t n1, int64_t N, float* ys) {
  float dots[kMaxRowsPerCall * 16];
  for (int64_t n = n0; n < n1; n += rows_per_group) {
    for (int64_t m0 = m_begin; m0 < m_end; m0 += per_call) {
      const int64_t rows = std::min(per_call, m_end - m0);
      fn(src + n * row_bytes, acts, m0, rows, dots);
      for (int64_t m = 0; m < rows; ++m)
        std::memcpy(ys + (m0 + m) * N + n, dots + m * rows_per_group, rows_per_group * sizeof(float));
    }
  }
}

// The same through a tile kernel, kTileGroups groups a call; one a call for 32 activation rows or fewer
// (a decode batch), which stream the weights with little reuse of the activations (Q6_K at 32 rows took
// 1.08x the time four at a time).
void groups_tiled(const uint8_t* src, int64_t row_bytes, int64_t rows_per_group, int64_t per_call, const TileDotFn fn,
                  const Acts& acts, int64_t m_begin, int64_t m_end, int64_t n0, int64_t n1, int64_t N, float* ys) {
  const int64_t span = rows_per_group * (m_end - m_begin > 32 ? kTileGroups : 1);
  for (int64_t n = n0; n < n1; n += span) {
    const int64_t count = std::min(span, n1 - n) / rows_per_group;
    for (int64_t m0 = m_begin; m0 < m_end; m0 += per_call)
      fn(src + n * row_bytes, rows_per_group * row_bytes, count, acts, m0, std::min(per_call, m_end - m0),
         ys + m0 * N + n, N);
  }
}

// One weight matrix against activation rows [m_begin, m_end), row m_begin's outputs at `out`, each
// next row's ld floats further.
struct Run {
  const uint8_t* src;  // [rows, row_bytes] of qtype, laid out as the kernels read it
  int64_t rows, row_bytes, qtype;
  const Acts* acts;
  int64_t m_begin, m_end;
  float* out;
  int64_t ld;
  // Instead of out: a bfloat16 tensor whose column `column` takes weight row 0 (multiply_rounded).
  at::Tensor* rounded = nullptr;
  int64_t column = 0;
};

// The kernels a run takes, chosen once for all its tiles.
struct Kernels {
  TileDotFn tiled = nullptr;
  GroupDotFn group = nullptr;
  DotFn tail[kRowGroup + 1] = {};
  int64_t unit = 1;      // weight rows a group holds (1: GGUF's own rows)
  int64_t span = 1;      // weight rows a call takes: tiles' column ranges are multiples of it
  int64_t per_call = 1;  // activation rows a call takes
};

Kernels kernels_for(const Run& run) {
  Kernels k;
  const bool tile_rows = run.m_end - run.m_begin >= kTileMinRows && run.acts->steps != nullptr;
  k.tiled = tile_rows ? tile_dot(run.qtype) : nullptr;
  k.group = k.tiled != nullptr ? nullptr : group_dot(run.qtype);
  const bool grouped = k.tiled != nullptr || k.group != nullptr;
  if (!grouped) {
    k.tail[1] = dot_for<1>(run.qtype);
    k.tail[2] = dot_for<2>(run.qtype);
    k.tail[3] = dot_for<3>(run.qtype);
    k.tail[kRowGroup] = dot_for<kRowGroup>(run.qtype);
  }
  k.unit = grouped ? group_rows(run.qtype) : 1;
  k.span = k.tiled != nullptr ? k.unit * kTileGroups : k.unit;
  k.per_call = k.tiled != nullptr ? tile_rows_per_call(run.acts->k_end - run.acts->k_begin)
                                   : (grouped ? rows_per_call(run.qtype) : kRowGroup);
  return k;
}

// Weight rows [n0, n1) of `src` against activation rows [m_begin, m_end): row m_begin's outputs at `out`,
// each next row's ld floats further, weight row n's in column n.
void multiply(const uint8_t* src, int64_t row_bytes, const Kernels& k, const Acts& acts, int64_t m_begin, int64_t m_end,
              int64_t n0, int64_t n1, float* out, int64_t ld) {
  float* rows_out = out - m_begin * ld;  // the tile functions write row m at m * ld
  for (int64_t m0 = m_begin; m0 < m_end; m0 += k.per_call) {
    const int64_t count = std::min(k.per_call, m_end - m0);
    if (k.tiled != nullptr)
      groups_tiled(src, row_bytes, k.unit, k.per_call, k.tiled, acts, m0, m0 + count, n0, n1, ld, rows_out);
    else if (k.group != nullptr)
      groups_tile(src, row_bytes, k.unit, k.per_call, k.group, acts, m0, m0 + count, n0, n1, ld, rows_out);
    else
      rows_tile(src, row_bytes, k.tail[count], acts, m0, count, n0, n1, ld, rows_out);
  }
}

// `rows` rows of `width` float sums (ld apart) rounded into out (bfloat16) at row m_begin, column `column`.
void round_into(const float* sums, int64_t ld, int64_t rows, int64_t width, at::Tensor& out, int64_t m_begin,
                int64_t column) {
  AT_DISPATCH_REDUCED_FLOATING_TYPES(out.scalar_type(), "round_into", [&] {
    scalar_t* rows_out = out.data_ptr<scalar_t>() + m_begin * out.stride(0) + column;
    for (int64_t m = 0; m < rows; ++m) crane_mp::narrow(sums + m * ld, rows_out + m * out.stride(0), width);
  });
}

// Weight rows [n0, n1) against activation rows [m_begin, m_end) as multiply computes them, rounded into
// `out` (bfloat16, [M, N]) at rows m_begin.. and columns column + n0..: through a float buffer of the
// task's rows and columns that stays in L2, so the [M, N] float32 product is never written out and
// converted after (bfloat16 prompts on the tile kernels; bit for bit the same values).
void multiply_rounded(const uint8_t* src, int64_t row_bytes, const Kernels& k, const Acts& acts, int64_t m_begin,
                      int64_t m_end, int64_t n0, int64_t n1, at::Tensor& out, int64_t column) {
  thread_local LineVector<float> buffer;
  const int64_t width = n1 - n0, rows = m_end - m_begin;
  buffer.resize(std::max<size_t>(buffer.size(), rows * width));
  multiply(src + n0 * row_bytes, row_bytes, k, acts, m_begin, m_end, 0, width, buffer.data(), width);
  round_into(buffer.data(), width, rows, width, out, m_begin, column + n0);
}

// Products of bfloat16 activations go through multiply_rounded where tile kernels take them (`tiled`);
// float32 ones, and those of the other kernels, are written as float32 (and converted after).
bool rounds(const at::Tensor& x_in, bool tiled) { return tiled && x_in.scalar_type() != at::kFloat; }

at::Tensor gguf_linear_int8(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, int64_t K) {
  check_int8_weight(w, qtype, K);
  const int64_t block = block_of(qtype);
  const at::Tensor x = as_float(x_in, K, "gguf_linear_int8");
  const int64_t M = x.size(0), N = w.size(0), row_bytes = w.size(1);
  if (M == 0 || N == 0) return at::empty({M, N}, x_in.options());
  // Kept per calling thread across calls: a fresh buffer would be page-faulted in on every call.
  thread_local QuantizedActs buffers;
  const bool tiled = tiles_read(qtype, M);
  // Long rows through the tile kernels go in chunks of K, every thread's tiles through one before the next
  // (one range, all of K, otherwise).
  const int64_t chunks = tiled ? tile_k_chunks(K) : 1;
  std::vector<Acts> ranges(chunks, quantize(x, block, buffers, tiled));
  for (int64_t c = 0; c < chunks; ++c) {
    ranges[c].k_begin = tile_k_chunk_begin(K, c, chunks);
    ranges[c].k_end = tile_k_chunk_begin(K, c + 1, chunks);
  }
  const uint8_t* src = w.data_ptr<uint8_t>();
  const Kernels k = kernels_for({src, N, row_bytes, qtype, &ranges.back(), 0, M, nullptr, N});
  const bool group_first = (k.tiled != nullptr || k.group != nullptr) && M * K <= kGroupFirstBytes;
  const bool rounded = rounds(x_in, k.tiled != nullptr);
  at::Tensor out = at::empty({M, N}, rounded ? x_in.options() : x.options());
  float* ys = rounded ? nullptr : out.data_ptr<float>();
  // One tile per thread at least, so a small matrix still spreads over every core; whole groups (for the
  // tile kernels, a call's worth of them where the matrix has enough for every thread).
  const int64_t threads = at::get_num_threads();
  const int64_t unit =
      k.tiled != nullptr ? k.unit * std::clamp<int64_t>(N / (k.unit * threads), 1, kTileGroups) : k.unit;
  const int64_t per_thread = (N / unit + threads - 1) / threads;
  const int64_t tile = unit * std::max<int64_t>(1, std::min(kTileBytes / (row_bytes * unit), per_thread));
  const int64_t pass_rows = tile_pass_rows(k.tiled != nullptr, k.per_call, M);
  // In chunks, a pass's float sums until its last chunk, where a bfloat16 output rounds them (the calling
  // thread's buffer: the pool's threads reach it through `partial`, not by its thread_local name).
  thread_local LineVector<float> partial_buffer;
  if (chunks > 1 && rounded) partial_buffer.resize(std::max<size_t>(partial_buffer.size(), std::min(pass_rows, M) * N));
  float* const partial = partial_buffer.data();
  for (int64_t p0 = 0; p0 < M; p0 += pass_rows) {
    const int64_t p1 = std::min(M, p0 + pass_rows);
    for (int64_t c = 0; c < chunks; ++c) {
      at::parallel_for(0, (N + tile - 1) / tile, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
          if (chunks > 1) {
            multiply(src, row_bytes, k, ranges[c], p0, p1, n0, n1, rounded ? partial : ys + p0 * N, N);
            if (rounded && c + 1 == chunks) round_into(partial + n0, N, p1 - p0, n1 - n0, out, p0, n0);
          } else if (rounded) {
            multiply_rounded(src, row_bytes, k, ranges[c], p0, p1, n0, n1, out, 0);
          } else if (!group_first) {
            multiply(src, row_bytes, k, ranges[c], p0, p1, n0, n1, ys + p0 * N, N);
          } else if (k.tiled != nullptr) {
            groups_tiled(src, row_bytes, k.unit, k.per_call, k.tiled, ranges[c], p0, p1, n0, n1, N, ys);
          } else {
            groups_tile(src, row_bytes, k.unit, k.per_call, k.group, ranges[c], p0, p1, n0, n1, N, ys);
          }
        }
      });
    }
  }
  return rounded || x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
}

// Every run's tiles shared out among the threads in one pass: two cores stream different matrices
// (experts, or a layer's q/k/v parts) at once instead of meeting after each small one.
void run_tiles(const std::vector<Run>& runs) {
  std::vector<Kernels> kernels(runs.size());
  std::vector<int64_t> tile(runs.size()), first_tile(runs.size()), pass_rows(runs.size());
  int64_t tiles = 0, passes = 1;
  for (size_t r = 0; r < runs.size(); ++r) {
    kernels[r] = kernels_for(runs[r]);
    const int64_t span = kernels[r].span, rows = runs[r].m_end - runs[r].m_begin;
    tile[r] = span * std::max<int64_t>(1, kTileBytes / (runs[r].row_bytes * span));
    first_tile[r] = tiles;
    tiles += (runs[r].rows + tile[r] - 1) / tile[r];
    pass_rows[r] = std::max<int64_t>(1, tile_pass_rows(kernels[r].tiled != nullptr, kernels[r].per_call, rows));
    passes = std::max(passes, (rows + pass_rows[r] - 1) / pass_rows[r]);
  }
  for (int64_t pass = 0; pass < passes; ++pass) {
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      size_t r = 0;
      for (int64_t t = begin; t < end; ++t) {
        while (r + 1 < runs.size() && first_tile[r + 1] <= t) ++r;
        const Run& run = runs[r];
        const int64_t m_begin = run.m_begin + pass * pass_rows[r], m_end = std::min(run.m_end, m_begin + pass_rows[r]);
        if (m_begin >= m_end) continue;
        const int64_t n0 = (t - first_tile[r]) * tile[r], n1 = std::min(run.rows, n0 + tile[r]);
        if (run.rounded != nullptr)
          multiply_rounded(run.src, run.row_bytes, kernels[r], *run.acts, m_begin, m_end, n0, n1, *run.rounded,
                           run.column);
        else
          multiply(run.src, run.row_bytes, kernels[r], *run.acts, m_begin, m_end, n0, n1,
                   run.out + (m_begin - run.m_begin) * run.ld, run.ld);
      }
    });
  }
}

// Experts of a mixture: x's rows [R, K] in runs, run i of rows[i] rows multiplied by ws[i] (every one
// [N, row_bytes] of type qtype) -> [R, N]. The activations are quantized once.
at::Tensor gguf_grouped_linear_int8(const at::Tensor& x_in, at::TensorList ws, at::IntArrayRef rows, int64_t qtype,
                                    int64_t K) {
  TORCH_CHECK(ws.size() == rows.size() && !ws.empty(), "gguf_grouped_linear_int8: one weight per run of rows");
  for (const at::Tensor& w : ws) {
    check_int8_weight(w, qtype, K);
    TORCH_CHECK(w.sizes() == ws[0].sizes(), "gguf_grouped_linear_int8: the runs' weights must be alike");
  }
  const int64_t block = block_of(qtype);
  const at::Tensor x = as_float(x_in, K, "gguf_grouped_linear_int8");
  const int64_t R = x.size(0), N = ws[0].size(0), runs = ws.size();
  std::vector<int64_t> first(runs + 1, 0);
  for (int64_t i = 0; i < runs; ++i) {
    TORCH_CHECK(rows[i] >= 0, "gguf_grouped_linear_int8: negative run");
    first[i + 1] = first[i] + rows[i];
  }
  TORCH_CHECK(first[runs] == R, "gguf_grouped_linear_int8: the runs hold ", first[runs], " rows, x ", R);
  at::Tensor out = at::empty({R, N}, x.options());
  if (R == 0 || N == 0) return out.to(x_in.scalar_type());
  thread_local QuantizedActs buffers;
  const Acts acts = quantize(x, block, buffers, tiles_read(qtype, *std::max_element(rows.begin(), rows.end())));
  std::vector<Run> work;
  for (int64_t i = 0; i < runs; ++i) {
    if (rows[i] == 0) continue;
    work.push_back({ws[i].data_ptr<uint8_t>(), N, ws[i].size(1), qtype, &acts, first[i], first[i + 1],
                    out.data_ptr<float>() + first[i] * N, N});
  }
  run_tiles(work);
  return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
}

// x quantized once for each block size its parts' types take (the K-quants' 256 values, the others' 32),
// in the tiles' order too where some part of that size takes a tile kernel.
struct PartActs {
  Acts by_256{}, by_32{};
  const Acts* of(int64_t qtype) const { return block_of(qtype) == 256 ? &by_256 : &by_32; }
};

PartActs quantize_parts(const at::Tensor& x, at::IntArrayRef qtypes) {
  thread_local QuantizedActs k_blocks, small_blocks;
  bool used[2] = {}, tiled[2] = {};  // [0]: 32-value blocks, [1]: 256
  for (const int64_t qtype : qtypes) {
    const int sized = block_of(qtype) == 256;
    used[sized] = true;
    tiled[sized] = tiled[sized] || tiles_read(qtype, x.size(0));
  }
  PartActs acts;
  if (used[1]) acts.by_256 = quantize(x, 256, k_blocks, tiled[1]);
  if (used[0]) acts.by_32 = quantize(x, 32, small_blocks, tiled[0]);
  return acts;
}

// The parts of one layer's projection side by side (q, k and v of a Q4_K_M file, some of them Q6_K):
// x [M, K] times ws[i] ([N_i, row_bytes] of qtypes[i]) -> [M, N_0 + N_1 + ...], the activations
// quantized once for each block size and every part's tiles shared out in one pass.
at::Tensor gguf_linear_parts_int8(const at::Tensor& x_in, at::TensorList ws, at::IntArrayRef qtypes, int64_t K) {
  TORCH_CHECK(!ws.empty() && ws.size() == qtypes.size(), "gguf_linear_parts_int8: one type per part");
  int64_t total = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    check_int8_weight(ws[i], qtypes[i], K);
    total += ws[i].size(0);
  }
  const at::Tensor x = as_float(x_in, K, "gguf_linear_parts_int8");
  const int64_t M = x.size(0);
  if (M == 0 || total == 0) return at::empty({M, total}, x_in.options());
  const PartActs acts = quantize_parts(x, qtypes);
  // One output for all parts: rounded where every part takes a tile kernel.
  const bool rounded =
      rounds(x_in, std::all_of(qtypes.begin(), qtypes.end(), [&](int64_t qtype) { return tiles_read(qtype, M); }));
  at::Tensor out = at::empty({M, total}, rounded ? x_in.options() : x.options());
  std::vector<Run> work;
  int64_t column = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    Run run{ws[i].data_ptr<uint8_t>(), ws[i].size(0), ws[i].size(1), qtypes[i], acts.of(qtypes[i]), 0, M,
            rounded ? nullptr : out.data_ptr<float>() + column, total};
    if (rounded) run.rounded = &out, run.column = column;
    work.push_back(run);
    column += ws[i].size(0);
  }
  run_tiles(work);
  return rounded || x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
}

// Values as a tensor of `type` holds them: rounded to it and back to float.
void round_to(c10::ScalarType type, float* values, int64_t n) {
  if (type == at::kFloat) return;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(type, "round_to", [&] {
    scalar_t stored[kFusedColumns];
    for (int64_t i = 0; i < n; i += kFusedColumns) {
      const int64_t count = std::min(kFusedColumns, n - i);
      crane_mp::narrow(values + i, stored, count);
      crane_mp::widen(stored, values + i, count);
    }
  });
}

// A gated MLP's gate and up projections with SiLU between them: x [M, K] times gate and up ([N, row_bytes]
// each, of their types) -> [M, N] = silu(x . gate) * (x . up) in x's dtype, bit for bit what
// gguf_linear_parts_int8 (each product rounded to x's dtype) and then silu_and_mul give. Each thread
// takes a few columns of both at a time into buffers that stay in its L2: the [M, 2N] projection is
// never written out and read back (silu_and_mul's pass over it was 9 % of an 8B model's 2,000-token
// prefill).
at::Tensor gguf_gate_up_silu_int8(const at::Tensor& x_in, const at::Tensor& gate, const at::Tensor& up,
                                  int64_t gate_type, int64_t up_type, int64_t K) {
  check_int8_weight(gate, gate_type, K);
  check_int8_weight(up, up_type, K);
  TORCH_CHECK(gate.size(0) == up.size(0), "gguf_gate_up_silu_int8: gate has ", gate.size(0), " rows, up ",
              up.size(0));
  const at::Tensor x = as_float(x_in, K, "gguf_gate_up_silu_int8");
  const int64_t M = x.size(0), N = gate.size(0);
  const c10::ScalarType dtype = x_in.scalar_type();
  at::Tensor out = at::empty({M, N}, x_in.options());
  if (M == 0 || N == 0) return out;
  const std::array<int64_t, 2> qtypes{gate_type, up_type};
  const PartActs acts = quantize_parts(x, qtypes);
  const Run gate_run{gate.data_ptr<uint8_t>(), N, gate.size(1), gate_type, acts.of(gate_type), 0, M, nullptr, 0};
  const Run up_run{up.data_ptr<uint8_t>(), N, up.size(1), up_type, acts.of(up_type), 0, M, nullptr, 0};
  const Kernels gate_k = kernels_for(gate_run), up_k = kernels_for(up_run);
  // Columns a task takes (a multiple of both kernels' spans, all powers of two), and rows a chunk.
  const int64_t columns = std::max(kFusedColumns, std::max(gate_k.span, up_k.span));
  const int64_t chunk = std::max(gate_k.per_call, up_k.per_call), buffered = std::min(chunk, M) * columns;
  // Columns n0 .. n0 + width - 1 of activation rows [p0, p1), `chunk` rows at a time.
  const auto columns_of = [&](int64_t n0, int64_t width, int64_t p0, int64_t p1, float* gates, float* ups) {
    for (int64_t m0 = p0; m0 < p1; m0 += chunk) {
      const int64_t m1 = std::min(p1, m0 + chunk);
      multiply(gate_run.src + n0 * gate_run.row_bytes, gate_run.row_bytes, gate_k, *gate_run.acts, m0, m1, 0, width,
               gates, columns);
      multiply(up_run.src + n0 * up_run.row_bytes, up_run.row_bytes, up_k, *up_run.acts, m0, m1, 0, width, ups, columns);
      for (int64_t m = m0; m < m1; ++m) {
        float* g = gates + (m - m0) * columns;
        float* u = ups + (m - m0) * columns;
        round_to(dtype, g, width);
        round_to(dtype, u, width);
        crane_mp::silu_mul(g, u, width);
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "gguf_gate_up_silu_int8", [&] {
          crane_mp::narrow(g, out.data_ptr<scalar_t>() + m * N + n0, width);
        });
      }
    }
  };
  const int64_t pass_rows = tile_pass_rows(gate_k.tiled != nullptr || up_k.tiled != nullptr, chunk, M);
  for (int64_t p0 = 0; p0 < M; p0 += pass_rows) {
    at::parallel_for(0, (N + columns - 1) / columns, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> gates, ups;
      gates.resize(std::max<size_t>(gates.size(), buffered));
      ups.resize(std::max<size_t>(ups.size(), buffered));
      for (int64_t t = begin; t < end; ++t)
        columns_of(t * columns, std::min(N, (t + 1) * columns) - t * columns, p0, std::min(M, p0 + pass_rows),
                   gates.data(), ups.data());
    });
  }
  return out;
}

// One token through a mixture's SiLU-gated experts (a lone decode step's): x [1, H]; ids [k] (distinct
// experts) and gates [k]; gate_up [E, 2I, bytes] of gate_up_type (each expert's gate rows, then its up
// rows), down [E, H, bytes] of down_type -> [1, H]: the gates' sum, in ascending expert order, of each
// expert's down(silu(gate) * up). What is otherwise a dozen small ops a layer in one call: the token
// quantized once for all its experts, both cores on every expert's tiles of each projection.
at::Tensor gguf_moe_token_int8(const at::Tensor& x_in, const at::Tensor& ids, const at::Tensor& gates,
                               const at::Tensor& gate_up, int64_t gate_up_type, const at::Tensor& down,
                               int64_t down_type) {
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(0) == down.size(0) && gate_up.is_contiguous() &&
              down.is_contiguous(), "gguf_moe_token_int8: stacks must be contiguous [experts, rows, row_bytes]");
  const int64_t experts = gate_up.size(0), width = gate_up.size(1) / 2, H = down.size(1);
  check_int8_weight(gate_up[0], gate_up_type, H);
  check_int8_weight(down[0], down_type, width);
  const at::Tensor x = as_float(x_in, H, "gguf_moe_token_int8");
  TORCH_CHECK(x.size(0) == 1, "gguf_moe_token_int8: one token");
  const at::Tensor chosen = ids.to(at::kLong).contiguous(), weights = gates.to(at::kFloat).contiguous();
  TORCH_CHECK(chosen.dim() == 1 && weights.sizes() == chosen.sizes() && chosen.numel() > 0,
              "gguf_moe_token_int8: ids and gates must be [k]");
  const int64_t k = chosen.numel();
  std::vector<std::pair<int64_t, float>> order(k);
  for (int64_t i = 0; i < k; ++i) {
    order[i] = {chosen.data_ptr<int64_t>()[i], weights.data_ptr<float>()[i]};
    TORCH_CHECK(order[i].first >= 0 && order[i].first < experts, "gguf_moe_token_int8: expert ", order[i].first,
                " of ", experts);
  }
  std::sort(order.begin(), order.end());
  // Expert i's runs: the token's one row into projected row i, then hidden row i into ys row i.
  thread_local QuantizedActs token_buffers, hidden_buffers;
  at::Tensor projected = at::empty({k, 2 * width}, x.options());
  const Acts token = quantize(x, block_of(gate_up_type), token_buffers, false);
  std::vector<Run> work;
  for (int64_t i = 0; i < k; ++i) {
    work.push_back({gate_up.data_ptr<uint8_t>() + order[i].first * gate_up.stride(0), 2 * width, gate_up.size(2),
                    gate_up_type, &token, 0, 1, projected.data_ptr<float>() + i * 2 * width, 2 * width});
  }
  run_tiles(work);
  at::Tensor hidden = at::empty({k, width}, x.options());
  const float* gu = projected.data_ptr<float>();
  float* h = hidden.data_ptr<float>();
  for (int64_t i = 0; i < k; ++i)
    for (int64_t j = 0; j < width; ++j) {
      // exp's argument kept finite: the build's -ffast-math assumes no infinities (silu(-80) is ~0).
      const float gate = gu[i * 2 * width + j];
      h[i * width + j] = gate / (1.0f + std::exp(std::min(-gate, 80.0f))) * gu[i * 2 * width + width + j];
    }
  at::Tensor ys = at::empty({k, H}, x.options());
  const Acts hiddens = quantize(hidden, block_of(down_type), hidden_buffers, false);
  work.clear();
  for (int64_t i = 0; i < k; ++i) {
    work.push_back({down.data_ptr<uint8_t>() + order[i].first * down.stride(0), H, down.size(2), down_type, &hiddens, i,
                    i + 1, ys.data_ptr<float>() + i * H, H});
  }
  run_tiles(work);
  at::Tensor out = at::zeros({1, H}, x.options());
  float* o = out.data_ptr<float>();
  const float* y = ys.data_ptr<float>();
  for (int64_t i = 0; i < k; ++i)
    for (int64_t n = 0; n < H; ++n) o[n] += y[i * H + n] * order[i].second;
  return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gguf_quantize_activations(const at::Tensor& x_in, int64_t qtype) {
  const int64_t block = block_of(qtype);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % block == 0, "x must be [M, K] with K a multiple of ", block);
  const at::Tensor x = as_float(x_in, x_in.size(1), "gguf_quantize_activations");
  const int64_t M = x.size(0), K = x.size(1);
  QuantizedActs buffers;
  const Acts acts = quantize(x, block, buffers, false);
  const auto opts = x.options();
  at::Tensor q = at::empty({M, K}, opts.dtype(at::kChar)), d = at::empty({M, K / block}, opts);
  at::Tensor sums = at::empty({M, K / 16}, opts.dtype(at::kShort));
  std::memcpy(q.data_ptr(), acts.q, M * K);
  std::memcpy(d.data_ptr(), acts.d, M * (K / block) * sizeof(float));
  std::memcpy(sums.data_ptr(), acts.sums, M * (K / 16) * sizeof(int16_t));
  return {q, d, sums};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(crane_mp, m) {
  m.def("gguf_linear_int8(Tensor x, Tensor w, int qtype, int K) -> Tensor", &gguf_linear_int8);
  m.def("gguf_quantize_activations(Tensor x, int qtype) -> (Tensor, Tensor, Tensor)", &gguf_quantize_activations);
  m.def("gguf_grouped_linear_int8(Tensor x, Tensor[] ws, int[] rows, int qtype, int K) -> Tensor",
        &gguf_grouped_linear_int8);
  m.def("gguf_linear_parts_int8(Tensor x, Tensor[] ws, int[] qtypes, int K) -> Tensor", &gguf_linear_parts_int8);
  m.def("gguf_gate_up_silu_int8(Tensor x, Tensor gate, Tensor up, int gate_type, int up_type, int K) -> Tensor",
        &gguf_gate_up_silu_int8);
  m.def("gguf_moe_token_int8(Tensor x, Tensor ids, Tensor gates, Tensor gate_up, int gate_up_type, Tensor down, "
        "int down_type) -> Tensor", &gguf_moe_token_int8);
}
