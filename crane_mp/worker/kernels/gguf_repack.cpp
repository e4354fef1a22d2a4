// Q4_K weights repacked eight rows at a time, and their 8-bit-activation kernel (CPU):
//
//   gguf_repack_q4_k_x8(w [N, K / 256 * 144] uint8, K) -> [N, K / 256 * 148] uint8   (N a multiple of 8)
//
// In GGUF's layout each row's super-blocks follow one another, so a kernel sums each row's products
// across vector lanes and scales every 32 of them apart: a multiply per 32 weights besides the
// products, and a horizontal sum per row. Repacked, the eight rows' super-block b lie together, their
// quants interleaved 4 bytes a row: one 32-byte load holds 4 positions of all eight rows, each
// 32-bit lane stays one output row, the products of a whole 32-element sub-block add up in 16-bit
// lanes (8 x 2 x 15 x 127 < 32767) before one multiply applies the eight rows' scales, and eight
// outputs are stored at once. Per weight that is about half the multiplies of the row kernel, which
// is what bounds batched steps and prompts.
//
// Super-block b of a group of eight rows (1184 bytes):
//     0   d[8]            float16, each row's scale of scales
//    16   dmin[8]         float16
//    32   scales[8][8]    uint8 [sub-block j][row r], the 6-bit scales unpacked
//    96   mins[8][8]      uint8, likewise
//   160   qs[4][8][8][4]  [sub-block pair c][position group k][row r]: row r's GGUF bytes
//                         qs[32c + 4k .. 32c + 4k + 3] (low nibbles: sub-block 2c, high: 2c + 1)
// 32 bytes more than the rows' own 1152 (2.8%): unpacked, the scales cost a few instructions a group.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "gguf_blocks.h"
#include "gguf_int8.h"

namespace crane_mp::int8 {
namespace {

using namespace crane_mp::gguf;

inline __m256i broadcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Eight bytes (one per row) -> each 32-bit lane holds its row's byte in both 16-bit halves.
inline __m256i in_both_halves(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
}

// Two runs of eight bytes -> lane r holds the first run's byte r (low half), the second's (high half).
inline __m256i paired(const uint8_t* first, const uint8_t* second) {
  const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(first)));
  const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(second)));
  return _mm256_or_si256(lo, _mm256_slli_epi32(hi, 16));
}

template <int MR>
void dot_x8(const uint8_t* group, const Acts& a, int64_t m0, float* out) {
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  const int8_t* x = a.q + m0 * a.K;
  const float* dx = a.d + m0 * a.nb;
  const int16_t* sx = a.sums32 + m0 * (a.K / 32);
  const __m256i mask = low4();
  for (int64_t b = 0; b < a.nb; ++b, group += kQ4KX8Bytes) {
    prefetch_ahead<kQ4KX8Bytes>(group);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 16)));
    __m256i isum[MR], msum[MR];
    for (int m = 0; m < MR; ++m) isum[m] = msum[m] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {  // sum_j min_j * (sum of sub-block j's activations), two j at a time
      const __m256i mins = paired(group + 96 + 16 * p, group + 104 + 16 * p);
      for (int m = 0; m < MR; ++m)
        msum[m] = _mm256_add_epi32(msum[m], _mm256_madd_epi16(mins, broadcast32(sx + m * (a.K / 32) + 8 * b + 2 * p)));
    }
    const uint8_t* qs = group + 160;
    for (int c = 0; c < 4; ++c) {
      __m256i lo_sum[MR], hi_sum[MR];
      for (int m = 0; m < MR; ++m) lo_sum[m] = hi_sum[m] = _mm256_setzero_si256();
      for (int k = 0; k < 8; ++k) {
        const __m256i raw = load(qs + (8 * c + k) * 32);
        const __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        for (int m = 0; m < MR; ++m) {
          const int8_t* xs = x + m * a.K + 256 * b + 64 * c + 4 * k;
          lo_sum[m] = _mm256_add_epi16(lo_sum[m], _mm256_maddubs_epi16(lo, broadcast32(xs)));
          hi_sum[m] = _mm256_add_epi16(hi_sum[m], _mm256_maddubs_epi16(hi, broadcast32(xs + 32)));
        }
      }
      const __m256i s_lo = in_both_halves(group + 32 + 16 * c), s_hi = in_both_halves(group + 40 + 16 * c);
      for (int m = 0; m < MR; ++m)
        isum[m] = _mm256_add_epi32(isum[m], _mm256_add_epi32(_mm256_madd_epi16(lo_sum[m], s_lo),
                                                             _mm256_madd_epi16(hi_sum[m], s_hi)));
    }
    for (int m = 0; m < MR; ++m) {
      const __m256 da = _mm256_set1_ps(dx[m * a.nb + b]);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_mul_ps(d, da), acc[m]);
      acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum[m]), _mm256_mul_ps(dmin, da), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(out + 8 * m, acc[m]);
}

at::Tensor gguf_repack_q4_k_x8(const at::Tensor& w, int64_t K) {
  check_weight(w, Q4_K, K);
  TORCH_CHECK(w.size(0) % 8 == 0, "gguf_repack_q4_k_x8: rows come in groups of 8, got ", w.size(0));
  const int64_t N = w.size(0), nb = K / 256, row_bytes = w.size(1);
  at::Tensor out = at::empty({N, nb * (kQ4KX8Bytes / 8)}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / 8, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* block = dst + (g * nb + b) * kQ4KX8Bytes;
        for (int64_t r = 0; r < 8; ++r) {
          const uint8_t* row = src + (g * 8 + r) * row_bytes + b * 144;
          std::memcpy(block + 2 * r, row, 2);
          std::memcpy(block + 16 + 2 * r, row + 2, 2);
          for (int j = 0; j < 8; ++j) {
            float scale, min;
            k_scale_min(row + 4, j, scale, min);
            block[32 + 8 * j + r] = static_cast<uint8_t>(scale);
            block[96 + 8 * j + r] = static_cast<uint8_t>(min);
          }
          for (int c = 0; c < 4; ++c)
            for (int k = 0; k < 8; ++k) std::memcpy(block + 160 + ((8 * c + k) * 8 + r) * 4, row + 16 + 32 * c + 4 * k, 4);
        }
      }
    }
  });
  return out;
}

}  // namespace

void dot_q4_k_x8(const uint8_t* group, const Acts& a, int64_t m0, int64_t rows, float* out) {
  switch (rows) {
    case 1: return dot_x8<1>(group, a, m0, out);
    case 2: return dot_x8<2>(group, a, m0, out);
    case 3: return dot_x8<3>(group, a, m0, out);
    default: return dot_x8<4>(group, a, m0, out);
  }
}

}  // namespace crane_mp::int8

TORCH_LIBRARY_FRAGMENT(crane_mp, m) {
  m.def("gguf_repack_q4_k_x8(Tensor w, int K) -> Tensor", &crane_mp::int8::gguf_repack_q4_k_x8);
}
