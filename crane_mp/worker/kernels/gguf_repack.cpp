// GGUF weights repacked eight (or sixteen) rows at a time, and their 8-bit-activation kernels (CPU):
//
//   gguf_repack_q4_k_x8(w [N, K / 256 * 144] uint8, K) -> [N, K / 256 * 148] uint8   (N a multiple of 8)
//   gguf_repack_q4_k_x16(w [N, K / 256 * 144] uint8, K) -> [N, K / 256 * 148] uint8  (N a multiple of 16)
//   gguf_repack_q8_0_x8(w [N, K / 32 * 34] uint8, K)   -> [N, K / 32 * 34] uint8
//   gguf_repack_q6_k_x8(w [N, K / 256 * 210] uint8, K) -> [N, K / 256 * 210] uint8
//   gguf_repack_q6_k_x16(w [N, K / 256 * 210] uint8, K) -> [N, K / 256 * 210] uint8 (N a multiple of 16)
//   gguf_repack_q4_0_x16(w [N, K / 32 * 18] uint8, K)  -> [N, K / 32 * 18] uint8   (N a multiple of 16)
//   gguf_x16_supported(qtype) -> bool: this build and CPU run the type's x16 kernel (AVX512-VNNI, and
//                                       VBMI for Q6_K)
//
// In GGUF's layout each row's blocks follow one another, so a kernel sums each row's products
// across vector lanes and scales every block apart: a multiply per 32 weights besides the products,
// and a horizontal sum per row. Repacked, the eight rows' block b lie together, their quants
// interleaved 4 bytes a row: one 32-byte load holds 4 positions of all eight rows, each 32-bit lane
// stays one output row, the eight rows' scales apply in one multiply, and eight outputs are stored
// at once. That is what bounds batched steps and prompts.
//
// Q4_K, super-block b of a group of eight rows (1184 bytes; 32 more than the rows' own 1152, 2.8%:
// unpacked, the scales cost a few instructions a group):
//     0   d[8]            float16, each row's scale of scales
//    16   dmin[8]         float16
//    32   scales[8][8]    uint8 [sub-block j][row r], the 6-bit scales unpacked
//    96   mins[4][8][2]   uint8 [pair p][row r][t]: sub-block 2p + t's min, so that one widening to
//                         16 bits gives each row's lane the pair a 16-bit multiply-add takes
//   160   qs[8][4][8][4]  [sub-block j][position group k][row r][i]: low nibble element 32j + 4k + i
//                         of row r, high nibble element 32j + 16 + 4k + i
// Both nibbles of a byte belong to one sub-block, so a sub-block's products add up in 16-bit lanes
// (16 products of at most 15 x 127 per lane < 32767) before one multiply applies its scale; with
// AVX512-VNNI, vpdpbusd sums them in 32-bit lanes instead (Q6_K likewise).
//
// Q4_K, sixteen rows (x16, for AVX512-VNNI builds), super-block b of a group (2368 bytes, as two x8
// groups): the same fields for 16 rows, so that one 512-bit load holds 4 positions of every row and
// each 32-bit lane of a 512-bit vector stays one output row:
//     0   d[16]            float16
//    32   dmin[16]         float16
//    64   scales[8][16]    uint8 [sub-block j][row r]
//   192   mins[4][16][2]   uint8 [pair p][row r][t], as in x8
//   320   qs[8][4][16][4]  [sub-block j][position group k][row r][i], nibbles as in x8
//
// Q6_K, super-block b of a group of eight rows (1680 bytes, as the rows' own):
//     0   d[8]            float16
//    16   scales[16][8]   int8 [sub-block j][row r]
//   144   q[2][8][3][8][4] [half h][position group k][t][row r][i], t picking which bits of element
//                         e = 128h + 4k + i (e + 32s for s = 0..3) the byte holds: t = 0 the low 4 bits
//                         of e (low nibble) and e + 64 (high), t = 1 those of e + 32 and e + 96, t = 2
//                         the top 2 bits of e, e + 32, e + 64, e + 96 (bits 0-1, 2-3, 4-5, 6-7), as
//                         GGUF packs them (ql, ql + 32 and qh), now per row 4 bytes at a time.
// Values are 0-63 (the -32 goes through the activations' 16-sums), so two products summed by maddubs
// and two such sums stay below 32767 before a multiply by the sub-block's signed scale widens them.
//
// Q6_K, sixteen rows (x16, for AVX512-VNNI CPUs with VBMI: Zen 4, Ice Lake and later), super-block b
// of a group (3360 bytes, as the rows' own), each value's 6 bits kept together so that three
// instructions a 512-bit vector unpack them (vpermb spreads 6 bytes into each 8, vpmultishiftqb
// picks the eight 6-bit fields of each 64 bits, an and clears the top two bits), against ~17 for
// four vectors of GGUF's split bits:
//     0   d[16]            float16
//    32   scales[8][16][2] int8 [pair p][row r][t]: sub-block 2p + t's scale of row r, so that one
//                          widening to 16 bits gives each row's lane the pair vpdpwssd takes
//   288   q[64][8][6]      [position group k][row pair][6 bytes]: a 48-bit little-endian word with
//                          element 4k + i of row 2q at bits 6i, of row 2q + 1 at bits 24 + 6i
//
// Q4_0, sixteen rows (x16, for AVX512-VNNI builds), block b of a group (288 bytes, as the rows' own):
//     0   d[16]            float16
//    32   qs[4][16][4]     [position group k][row r][i]: low nibble element 4k + i of row r, high nibble
//                          element 16 + 4k + i (a Q4_K x16 sub-block's layout); values q - 8, the -8
//                          through the activations' 32-sums
//
// Q8_0, a group of eight rows with nb = K / 32 blocks (8 x nb x 34 bytes, as the rows' own):
//     0             qs[nb][8][8][4]  [block b][position group k][row r][i]: element 32b + 4k + i of row r
//     nb * 256      d[nb][8]         float16
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "gguf_blocks.h"
#include "gguf_int8.h"

namespace crane_mp::int8 {
namespace {

using namespace crane_mp::gguf;

// Ends the expression `v` is in: left alone, GCC regroups a sub-block's 16-bit sums into a tree over
// all its products, which outnumber the vector registers and go through the stack.
inline void in_register(__m256i& v) {
#if defined(__AVX512VL__)
  __asm__("" : "+v"(v));  // any of the 32 vector registers
#else
  __asm__("" : "+x"(v));
#endif
}

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

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// Eight bytes (one per row) -> lane r holds byte r, zero- or sign-extended.
inline __m256i widened_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i widened_s8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Sub-block products into isum[m], VNNI: vpdpbusd adds 4 products into a 32-bit lane, so a sub-block's
// 32 products per lane take 8 instructions (against 16 maddubs and adds) and its scale one multiply.
template <int MR>
void q4_k_x8_sub_blocks(const uint8_t* group, const int8_t* x, int64_t K, int64_t b, __m256i* isum) {
  const __m256i mask = low4();
  const uint8_t* qs = group + 160;
  for (int j = 0; j < 8; ++j) {
    __m256i lo_sum[MR], hi_sum[MR];  // two chains a row: one chain of 8 would wait on its own latency
    for (int m = 0; m < MR; ++m) lo_sum[m] = hi_sum[m] = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      const __m256i raw = load(qs + (4 * j + k) * 32);
      const __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
      for (int m = 0; m < MR; ++m) {
        const int8_t* xs = x + m * K + 256 * b + 32 * j + 4 * k;
        lo_sum[m] = _mm256_dpbusd_epi32(lo_sum[m], lo, broadcast32(xs));
        hi_sum[m] = _mm256_dpbusd_epi32(hi_sum[m], hi, broadcast32(xs + 16));
      }
    }
    const __m256i scale = widened_u8(group + 32 + 8 * j);
    for (int m = 0; m < MR; ++m)
      isum[m] = _mm256_add_epi32(isum[m], _mm256_mullo_epi32(_mm256_add_epi32(lo_sum[m], hi_sum[m]), scale));
  }
}
#else
// AVX2: a sub-block's products add up in 16-bit lanes, then one multiply-add applies its scale.
template <int MR>
void q4_k_x8_sub_blocks(const uint8_t* group, const int8_t* x, int64_t K, int64_t b, __m256i* isum) {
  const __m256i mask = low4();
  const uint8_t* qs = group + 160;
  for (int j = 0; j < 8; ++j) {
    __m256i sum[MR];
    for (int m = 0; m < MR; ++m) sum[m] = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      const __m256i raw = load(qs + (4 * j + k) * 32);
      const __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
      for (int m = 0; m < MR; ++m) {
        const int8_t* xs = x + m * K + 256 * b + 32 * j + 4 * k;
        sum[m] = _mm256_add_epi16(sum[m], _mm256_maddubs_epi16(lo, broadcast32(xs)));
        sum[m] = _mm256_add_epi16(sum[m], _mm256_maddubs_epi16(hi, broadcast32(xs + 16)));
        in_register(sum[m]);
      }
    }
    const __m256i scale = in_both_halves(group + 32 + 8 * j);
    for (int m = 0; m < MR; ++m) isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(sum[m], scale));
  }
}
#endif

template <int MR>
void q4_k_x8_rows(const uint8_t* group, const Acts& a, int64_t m0, float* out) {
  // The running sums stay in memory: kept in registers with the 8 sub-block sums and the operands
  // they would outnumber the 16 vector registers, and the compiler would spill inside the hot loop.
  alignas(32) float acc[MR][8] = {};
  const int8_t* x = a.q + m0 * a.K;
  const float* dx = a.d + m0 * a.nb;
  const int16_t* sx = a.sums32 + m0 * (a.K / 32);
  for (int64_t b = 0; b < a.nb; ++b, group += kQ4KX8Bytes) {
    prefetch_ahead<kQ4KX8Bytes>(group);
    __m256i isum[MR];
    for (int m = 0; m < MR; ++m) isum[m] = _mm256_setzero_si256();
    q4_k_x8_sub_blocks<MR>(group, x, a.K, b, isum);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 16)));
    for (int m = 0; m < MR; ++m) {
      __m256i msum = _mm256_setzero_si256();  // sum_j min_j * (sum of sub-block j's activations), two j at a time
      for (int p = 0; p < 4; ++p)
        msum = _mm256_add_epi32(msum, _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(
                                                             reinterpret_cast<const __m128i*>(group + 96 + 16 * p))),
                                                        broadcast32(sx + m * (a.K / 32) + 8 * b + 2 * p)));
      const __m256 da = _mm256_set1_ps(dx[m * a.nb + b]);
      __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_mul_ps(d, da), _mm256_load_ps(acc[m]));
      _mm256_store_ps(acc[m], _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, da), sum));
    }
  }
  for (int m = 0; m < MR; ++m) std::memcpy(out + 8 * m, acc[m], sizeof(acc[m]));
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// Sixteen Q4_K x16 rows against activation rows m0 .. m0 + MR - 1 (up to 8: one nibble split serves
// all of them): out[m * 16 + r]. vpdpbusd on 512 bits does twice the products of a 256-bit one in
// about the same time, and the loads, splits and scales per product halve.
template <int MR>
void q4_k_x16_rows(const uint8_t* group, const Acts& a, int64_t m0, float* out) {
  constexpr int C = MR <= 4 ? 2 : 1;  // chains a row per sub-block (nibbles apart below 5 rows): 8 at least
  alignas(64) float acc[MR][16] = {};  // updated once a super-block: memory spares MR registers
  const int8_t* x = a.q + m0 * a.K;
  const float* dx = a.d + m0 * a.nb;
  const int16_t* sx = a.sums32 + m0 * (a.K / 32);
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < a.nb; ++b, group += kQ4KX16Bytes) {
    prefetch_ahead<320>(group);  // the rest a line at a time, below
    __m512i isum[MR];
    for (int m = 0; m < MR; ++m) isum[m] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i sum[C][MR];
      for (int c = 0; c < C; ++c)
        for (int m = 0; m < MR; ++m) sum[c][m] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        prefetch_line_ahead(group + 320 + (4 * j + k) * 64);
        const __m512i raw = _mm512_loadu_si512(group + 320 + (4 * j + k) * 64);
        const __m512i lo = _mm512_and_si512(raw, mask), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
        for (int m = 0; m < MR; ++m) {
          const int8_t* xs = x + m * a.K + 256 * b + 32 * j + 4 * k;
          dpbusd_broadcast(sum[0][m], lo, xs);
          dpbusd_broadcast(sum[C - 1][m], hi, xs + 16);
        }
      }
      const __m512i scale = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 64 + 16 * j)));
      for (int m = 0; m < MR; ++m) {
        const __m512i total = C == 2 ? _mm512_add_epi32(sum[0][m], sum[C - 1][m]) : sum[0][m];
        isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(total, scale));
      }
    }
    const __m512 d = _mm512_cvtph_ps(load(group)), dmin = _mm512_cvtph_ps(load(group + 32));
    __m512i mins[4];  // sub-blocks 2p (low 16 bits) and 2p + 1 (high) of each row's lane
    for (int p = 0; p < 4; ++p) mins[p] = _mm512_cvtepu8_epi16(load(group + 192 + 32 * p));
    for (int m = 0; m < MR; ++m) {
      __m512i msum = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) dpwssd_broadcast(msum, mins[p], sx + m * (a.K / 32) + 8 * b + 2 * p);
      const __m512 da = _mm512_set1_ps(dx[m * a.nb + b]);
      const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(d, da), _mm512_load_ps(acc[m]));
      _mm512_store_ps(acc[m], _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, da), sum));
    }
  }
  std::memcpy(out, acc, sizeof(acc));
}
#endif

// Q8_0: signed bytes, so each product goes through the sign trick (|w| times x with w's sign) and
// each 32-bit lane sums its 4 products at once; one float multiply per block and row.
template <int MR>
void q8_0_x8_rows(const uint8_t* group, const Acts& a, int64_t m0, float* out) {
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  const int8_t* x = a.q + m0 * a.K;
  const float* dx = a.d + m0 * a.nb;
  const uint8_t* scales = group + a.nb * 256;
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* qs = group + 256 * b;
    prefetch_ahead<256>(qs);
    if (b % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(scales + 16 * b + 256), _MM_HINT_T0);
    __m256i isum[MR];
    for (int m = 0; m < MR; ++m) isum[m] = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {
      const __m256i w = load(qs + 32 * k);
      const __m256i wabs = _mm256_abs_epi8(w);
      for (int m = 0; m < MR; ++m) {
        isum[m] = dot_u8s8_add(isum[m], wabs, _mm256_sign_epi8(broadcast32(x + m * a.K + 32 * b + 4 * k), w));
        in_register(isum[m]);
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 16 * b)));
    for (int m = 0; m < MR; ++m)
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_mul_ps(d, _mm256_set1_ps(dx[m * a.nb + b])), acc[m]);
  }
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(out + 8 * m, acc[m]);
}

// Sixteen sub-blocks' int8 scales of eight rows -> for sub-block j, each 32-bit lane holding its row's
// scale in both halves (`both[j]`), and for the pair 2p, 2p + 1 the first's scale in the low half and
// the second's in the high one (`pairs[p]`).
inline void signed_scales(const uint8_t* scales, __m256i* both, __m256i* pairs) {
  for (int p = 0; p < 8; ++p) {
    const __m256i words = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 16 * p)));
    // 64-bit quarters: rows 0-3 of sub-block 2p, of 2p + 1, rows 4-7 of 2p, of 2p + 1
    const __m256i v = _mm256_permute4x64_epi64(words, 0xD8);
    both[2 * p] = _mm256_unpacklo_epi16(v, v);
    both[2 * p + 1] = _mm256_unpackhi_epi16(v, v);
    pairs[p] = _mm256_unpacklo_epi16(v, _mm256_srli_si256(v, 8));
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// Q6_K's products into isum[m], VNNI: a sub-block's sixteen products a lane add up in 32 bits through
// vpdpbusd, then one multiply by its scale; `scales` (16-bit, for maddubs sums) is not needed.
template <int MR>
void q6_k_x8_products(const uint8_t* group, const int8_t* x, int64_t K, int64_t b, const __m256i*, __m256i* isum) {
  const uint8_t* qs = group + 144;
  prefetch_ahead<kQ6KX8Bytes - 144>(qs);  // all at once: spread over the work they gained nothing
  for (int h = 0; h < 2; ++h) {
    for (int half = 0; half < 2; ++half) {  // position groups 4 * half .. + 3: sub-blocks 8h + 2s + half
      __m256i sum[4][MR];
      for (int s = 0; s < 4; ++s)
        for (int m = 0; m < MR; ++m) sum[s][m] = _mm256_setzero_si256();
      for (int k = 4 * half; k < 4 * half + 4; ++k) {
        __m256i q[4];
        const uint8_t* p = qs + (h * 8 + k) * 96;
        q6_k_values(load(p), load(p + 32), load(p + 64), q);
        for (int s = 0; s < 4; ++s)
          for (int m = 0; m < MR; ++m) {
            const int8_t* xs = x + m * K + 256 * b + 128 * h + 32 * s + 4 * k;
            sum[s][m] = _mm256_dpbusd_epi32(sum[s][m], q[s], broadcast32(xs));
            in_register(sum[s][m]);
          }
      }
      for (int s = 0; s < 4; ++s) {
        const __m256i scale = widened_s8(group + 16 + 8 * (8 * h + 2 * s + half));
        for (int m = 0; m < MR; ++m) isum[m] = _mm256_add_epi32(isum[m], _mm256_mullo_epi32(sum[s][m], scale));
      }
    }
  }
}
#else
// AVX2: two position groups' products add up in 16 bits, then a multiply-add by their sub-block's scale.
template <int MR>
void q6_k_x8_products(const uint8_t* group, const int8_t* x, int64_t K, int64_t b, const __m256i* scales,
                      __m256i* isum) {
  const uint8_t* qs = group + 144;
  for (int h = 0; h < 2; ++h) {
    for (int k = 0; k < 8; k += 2) {  // two position groups' products share a 16-bit sum
      // Lines requested as the work reaches them: all 27 at once cost 6-10 % at 2-16 rows (Zen 4, avx2 tier).
      for (int l = 0; l < 192; l += 64) prefetch_line_ahead(qs + (h * 8 + k) * 96 + l);
      __m256i q[2][4];
      for (int u = 0; u < 2; ++u) {
        const uint8_t* p = qs + (h * 8 + k + u) * 96;
        q6_k_values(load(p), load(p + 32), load(p + 64), q[u]);
      }
      for (int s = 0; s < 4; ++s) {
        const __m256i scale = scales[8 * h + 2 * s + k / 4];
        for (int m = 0; m < MR; ++m) {
          const int8_t* xs = x + m * K + 256 * b + 128 * h + 32 * s + 4 * k;
          const __m256i sum = _mm256_add_epi16(_mm256_maddubs_epi16(q[0][s], broadcast32(xs)),
                                               _mm256_maddubs_epi16(q[1][s], broadcast32(xs + 4)));
          isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(sum, scale));
          in_register(isum[m]);
        }
      }
    }
  }
}
#endif

template <int MR>
void q6_k_x8_rows(const uint8_t* group, const Acts& a, int64_t m0, float* out) {
  alignas(32) float acc[MR][8] = {};
  const int8_t* x = a.q + m0 * a.K;
  const float* dx = a.d + m0 * a.nb;
  const int16_t* sx = a.sums + m0 * (a.K / 16);
  for (int64_t b = 0; b < a.nb; ++b, group += kQ6KX8Bytes) {
    prefetch_ahead<144>(group);  // the quants' lines: q6_k_x8_products
    __m256i scales[16], pairs[8];
    signed_scales(group + 16, scales, pairs);
    __m256i isum[MR];
    for (int m = 0; m < MR; ++m) {
      // The -32 of every value: 32 * sum_j s_j * (sum of sub-block j's activations), two j at a time.
      __m256i offset = _mm256_setzero_si256();
      for (int p = 0; p < 8; ++p)
        offset = _mm256_add_epi32(offset, _mm256_madd_epi16(pairs[p], broadcast32(sx + m * (a.K / 16) + 16 * b + 2 * p)));
      isum[m] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset, 5));
    }
    q6_k_x8_products<MR>(group, x, a.K, b, scales, isum);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group)));
    for (int m = 0; m < MR; ++m) {
      const __m256 da = _mm256_set1_ps(dx[m * a.nb + b]);
      _mm256_store_ps(acc[m], _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_mul_ps(d, da), _mm256_load_ps(acc[m])));
    }
  }
  for (int m = 0; m < MR; ++m) std::memcpy(out + 8 * m, acc[m], sizeof(acc[m]));
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// Sixteen Q6_K x16 rows against activation rows m0 .. m0 + MR - 1 (up to 8: the unpacking of each
// weight vector is shared by all of them); out[m * 16 + r]. One vpdpbusd adds 4 products of every row
// (a 32-bit lane each), a sub-block's 16 products take four, then one multiply applies its scale; the
// -32 goes through the activations' 16-sums, as in the x8 kernel.
template <int MR>
__attribute__((target("avx512vbmi"))) void q6_k_x16_rows(const uint8_t* group, const Acts& a, int64_t m0, float* out) {
  constexpr int U = MR <= 4 ? 2 : 1;  // sub-blocks side by side: at least 8 chains of vpdpbusd
  const __mmask64 forty_eight = 0xFFFFFFFFFFFFULL;
  const __m512i to_eights = _mm512_load_si512(kSixToEight.index);
  const __m512i fields = _mm512_set1_epi64(0x2A241E18120C0600LL);  // bit offsets 0, 6, .., 42 of each 64
  const __m512i low6 = _mm512_set1_epi8(0x3F);
  alignas(64) float acc[MR][16] = {};  // updated once a super-block: memory spares MR registers
  const int8_t* x = a.q + m0 * a.K;
  const float* dx = a.d + m0 * a.nb;
  const int16_t* sx = a.sums + m0 * (a.K / 16);
  for (int64_t b = 0; b < a.nb; ++b, group += kQ6KX16Bytes) {
    prefetch_ahead<288>(group);  // the rest a few lines at a time, below
    // The -32 of every value: each sub-block's sums start from -32 * (the sum of its activations), which
    // its scale multiplies with the products (a vpdpwssd of the sums and scales took the multipliers'
    // time, that a vpdpbusd waits for on Zen 4, where a broadcast load does not).
    alignas(64) int32_t offsets[MR][16];
    for (int m = 0; m < MR; ++m) {
      const __m512i sums = _mm512_cvtepi16_epi32(load(sx + m * (a.K / 16) + 16 * b));
      _mm512_store_si512(offsets[m], _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sums, 5)));
    }
    __m512i isum[MR];
    for (int m = 0; m < MR; ++m) isum[m] = _mm512_setzero_si512();
    for (int j = 0; j < 16; j += U) {
      for (int l = 0; l < 192 * U; l += 64) prefetch_line_ahead(group + 288 + 192 * j + l);
      __m512i sum[U][MR];
      for (int u = 0; u < U; ++u)
        for (int m = 0; m < MR; ++m) sum[u][m] = _mm512_set1_epi32(offsets[m][j + u]);
      // Unrolled whole, or GCC keeps `sum` in memory and stores every vpdpbusd's result.
#pragma GCC unroll 8
      for (int kk = 0; kk < 4; ++kk)
#pragma GCC unroll 2
        for (int u = 0; u < U; ++u) {
          const int k = 4 * (j + u) + kk;
          const __m512i packed = _mm512_maskz_loadu_epi8(forty_eight, group + 288 + 48 * k);
          const __m512i v = _mm512_and_si512(_mm512_multishift_epi64_epi8(fields, _mm512_permutexvar_epi8(to_eights, packed)), low6);
          for (int m = 0; m < MR; ++m) dpbusd_broadcast(sum[u][m], v, x + m * a.K + 256 * b + 4 * k);
        }
      for (int u = 0; u < U; ++u) {
        // Row r's lane holds its pair of scales as one sign-extended int16; shifts pick either (no multiply).
        const __m512i pair = _mm512_cvtepi16_epi32(load(group + 32 + 32 * ((j + u) / 2)));
        const __m512i scale = (j + u) % 2 == 0 ? _mm512_srai_epi32(_mm512_slli_epi32(pair, 24), 24)
                                               : _mm512_srai_epi32(pair, 8);
        for (int m = 0; m < MR; ++m) isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(sum[u][m], scale));
      }
    }
    const __m512 d = _mm512_cvtph_ps(load(group));
    for (int m = 0; m < MR; ++m) {
      const __m512 scaled = _mm512_mul_ps(d, _mm512_set1_ps(dx[m * a.nb + b]));
      _mm512_store_ps(acc[m], _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), scaled, _mm512_load_ps(acc[m])));
    }
  }
  std::memcpy(out, acc, sizeof(acc));
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// Sixteen Q4_0 x16 rows against activation rows m0 .. m0 + MR - 1 (up to 8): out[m * 16 + r]. The
// unsigned nibbles' products through vpdpbusd, then q - 8's offset from the block's activation sum.
template <int MR>
void q4_0_x16_rows(const uint8_t* group, const Acts& a, int64_t m0, float* out) {
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  const int8_t* x = a.q + m0 * a.K;
  const float* dx = a.d + m0 * a.nb;
  const int16_t* sx = a.sums32 + m0 * (a.K / 32);
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < a.nb; ++b, group += kQ4_0X16Bytes) {
    prefetch_line_ahead(group);
    prefetch_line_ahead(group + 64);
    prefetch_line_ahead(group + 128);
    prefetch_line_ahead(group + 192);
    prefetch_line_ahead(group + 256);
    __m512i lo_sum[MR], hi_sum[MR];
    for (int m = 0; m < MR; ++m) lo_sum[m] = hi_sum[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m512i raw = _mm512_loadu_si512(group + 32 + 64 * k);
      const __m512i lo = _mm512_and_si512(raw, mask), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
      for (int m = 0; m < MR; ++m) {
        dpbusd_broadcast(lo_sum[m], lo, x + m * a.K + 32 * b + 4 * k);
        dpbusd_broadcast(hi_sum[m], hi, x + m * a.K + 32 * b + 16 + 4 * k);
      }
    }
    const __m512 d = _mm512_cvtph_ps(load(group));
    for (int m = 0; m < MR; ++m) {
      const __m512i offset = _mm512_set1_epi32(8 * int32_t{sx[m * (a.K / 32) + b]});
      const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(lo_sum[m], hi_sum[m]), offset);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(dx[m * a.nb + b])), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(out + 16 * m, acc[m]);
}
#endif

// Checks `w` (GGUF rows of `qtype`, a multiple of `rows` of them), allocates the repacked tensor
// [N, out_row_bytes] and fills it a group of `rows` rows at a time, each_group(g, src, dst, row_bytes)
// writing group g, the groups spread over the threads.
template <typename EachGroup>
at::Tensor repacked(const at::Tensor& w, int64_t K, int64_t qtype, int64_t rows, int64_t out_row_bytes,
                    const char* op, EachGroup each_group) {
  check_weight(w, qtype, K);
  TORCH_CHECK(w.size(0) % rows == 0, op, ": rows come in groups of ", rows, ", got ", w.size(0));
  at::Tensor out = at::empty({w.size(0), out_row_bytes}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  at::parallel_for(0, w.size(0) / rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) each_group(g, src, dst, row_bytes);
  });
  return out;
}

// One Q4_K row's super-block as the repacked layouts hold it: 6-bit scales and mins unpacked, and
// for sub-block j, nibbles[j][t] holds element t in its low nibble and t + 16 in its high one.
struct Q4KParts {
  uint8_t scales[8], mins[8], nibbles[8][16];
};

inline Q4KParts q4_k_parts(const uint8_t* block) {
  Q4KParts parts;
  for (int j = 0; j < 8; ++j) {
    float scale, min;
    k_scale_min(block + 4, j, scale, min);
    parts.scales[j] = static_cast<uint8_t>(scale);
    parts.mins[j] = static_cast<uint8_t>(min);
  }
  // Sub-blocks 2p and 2p + 1 are the low and high nibbles of the 32 bytes at 32p.
  const __m128i low = _mm_set1_epi8(0x0F), high = _mm_set1_epi8(static_cast<char>(0xF0));
  for (int p = 0; p < 4; ++p) {
    const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 + 32 * p));
    const __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 + 32 * p));
    const __m128i even = _mm_or_si128(_mm_and_si128(first, low), _mm_slli_epi16(_mm_and_si128(second, low), 4));
    const __m128i odd = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(first, 4), low), _mm_and_si128(second, high));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(parts.nibbles[2 * p]), even);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(parts.nibbles[2 * p + 1]), odd);
  }
  return parts;
}

// Q4_K rows repacked R at a time (x8, x16): the two layouts differ only in the row count.
template <int R>
at::Tensor q4_k_repacked(const at::Tensor& w, int64_t K, const char* op) {
  constexpr int64_t bytes = 148 * R;
  const int64_t nb = K / 256;
  return repacked(w, K, Q4_K, R, nb * 148, op, [&](int64_t g, const uint8_t* src, uint8_t* dst, int64_t row_bytes) {
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* block = dst + (g * nb + b) * bytes;
      for (int64_t r = 0; r < R; ++r) {
        const uint8_t* row = src + (g * R + r) * row_bytes + b * 144;
        std::memcpy(block + 2 * r, row, 2);
        std::memcpy(block + 2 * R + 2 * r, row + 2, 2);
        const Q4KParts parts = q4_k_parts(row);
        for (int j = 0; j < 8; ++j) {
          block[4 * R + R * j + r] = parts.scales[j];
          block[12 * R + 2 * R * (j / 2) + 2 * r + j % 2] = parts.mins[j];
          for (int k = 0; k < 4; ++k) std::memcpy(block + 20 * R + ((4 * j + k) * R + r) * 4, parts.nibbles[j] + 4 * k, 4);
        }
      }
    }
  });
}

at::Tensor gguf_repack_q4_k_x8(const at::Tensor& w, int64_t K) {
  static_assert(148 * 8 == kQ4KX8Bytes);
  return q4_k_repacked<8>(w, K, "gguf_repack_q4_k_x8");
}

at::Tensor gguf_repack_q4_k_x16(const at::Tensor& w, int64_t K) {
  static_assert(148 * 16 == kQ4KX16Bytes);
  return q4_k_repacked<16>(w, K, "gguf_repack_q4_k_x16");
}

at::Tensor gguf_repack_q8_0_x8(const at::Tensor& w, int64_t K) {
  const int64_t nb = K / 32;
  return repacked(w, K, Q8_0, 8, nb * 34, "gguf_repack_q8_0_x8",
                  [&](int64_t g, const uint8_t* src, uint8_t* dst, int64_t row_bytes) {
    uint8_t* group = dst + g * 8 * row_bytes;
    for (int64_t r = 0; r < 8; ++r) {
      const uint8_t* row = src + (g * 8 + r) * row_bytes;
      for (int64_t b = 0; b < nb; ++b) {
        std::memcpy(group + nb * 256 + 16 * b + 2 * r, row + 34 * b, 2);
        for (int k = 0; k < 8; ++k) std::memcpy(group + 256 * b + (8 * k + r) * 4, row + 34 * b + 2 + 4 * k, 4);
      }
    }
  });
}

at::Tensor gguf_repack_q6_k_x8(const at::Tensor& w, int64_t K) {
  const int64_t nb = K / 256;
  return repacked(w, K, Q6_K, 8, nb * 210, "gguf_repack_q6_k_x8",
                  [&](int64_t g, const uint8_t* src, uint8_t* dst, int64_t row_bytes) {
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* block = dst + (g * nb + b) * kQ6KX8Bytes;
      for (int64_t r = 0; r < 8; ++r) {
        const uint8_t* row = src + (g * 8 + r) * row_bytes + b * 210;  // ql[128], qh[64], scales[16], d
        std::memcpy(block + 2 * r, row + 208, 2);
        for (int j = 0; j < 16; ++j) block[16 + 8 * j + r] = row[192 + j];
        for (int h = 0; h < 2; ++h)
          for (int k = 0; k < 8; ++k) {
            uint8_t* p = block + 144 + (h * 8 + k) * 96 + 4 * r;
            std::memcpy(p, row + 64 * h + 4 * k, 4);
            std::memcpy(p + 32, row + 64 * h + 32 + 4 * k, 4);
            std::memcpy(p + 64, row + 128 + 32 * h + 4 * k, 4);
          }
      }
    }
  });
}

// Values 4k .. 4k + 3 of a Q6_K super-block's 256 (0..63) as one 24-bit field each, value 4k + i at
// bits 6i: q6_k_values gives each value a byte, multiply-adds then gather each four.
inline void q6_k_fields(const uint8_t* block, uint32_t* fields) {
  const __m256i pairs = _mm256_set1_epi16(0x4001), quads = _mm256_set1_epi32(0x10000001);
  for (int h = 0; h < 2; ++h) {  // values 128h + 32s + l: s from the part, l from the byte position
    __m256i q[4];
    q6_k_values(load(block + 64 * h), load(block + 64 * h + 32), load(block + 128 + 32 * h), q);
    for (int s = 0; s < 4; ++s) {
      const __m256i v = _mm256_madd_epi16(_mm256_maddubs_epi16(q[s], pairs), quads);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(fields + 32 * h + 8 * s), v);
    }
  }
}

at::Tensor gguf_repack_q6_k_x16(const at::Tensor& w, int64_t K) {
  const int64_t nb = K / 256;
  return repacked(w, K, Q6_K, 16, nb * 210, "gguf_repack_q6_k_x16",
                  [&](int64_t g, const uint8_t* src, uint8_t* dst, int64_t row_bytes) {
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* block = dst + (g * nb + b) * kQ6KX16Bytes;
      uint32_t fields[16][64];
      for (int64_t r = 0; r < 16; ++r) {
        const uint8_t* row = src + (g * 16 + r) * row_bytes + b * 210;  // ql[128], qh[64], scales[16], d
        std::memcpy(block + 2 * r, row + 208, 2);
        for (int j = 0; j < 16; ++j) block[32 + 32 * (j / 2) + 2 * r + j % 2] = row[192 + j];
        q6_k_fields(row, fields[r]);
      }
      for (int k = 0; k < 64; ++k)
        for (int q = 0; q < 8; ++q) {
          const uint64_t word = fields[2 * q][k] | static_cast<uint64_t>(fields[2 * q + 1][k]) << 24;
          std::memcpy(block + 288 + 48 * k + 6 * q, &word, 6);  // little-endian: the low 48 bits
        }
    }
  });
}

at::Tensor gguf_repack_q4_0_x16(const at::Tensor& w, int64_t K) {
  const int64_t nb = K / 32;
  return repacked(w, K, Q4_0, 16, nb * 18, "gguf_repack_q4_0_x16",
                  [&](int64_t g, const uint8_t* src, uint8_t* dst, int64_t row_bytes) {
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* block = dst + (g * nb + b) * kQ4_0X16Bytes;
      for (int64_t r = 0; r < 16; ++r) {
        const uint8_t* row = src + (g * 16 + r) * row_bytes + b * 18;  // d, then qs[16]: GGUF's nibble order
        std::memcpy(block + 2 * r, row, 2);
        for (int k = 0; k < 4; ++k) std::memcpy(block + 32 + (16 * k + r) * 4, row + 2 + 4 * k, 4);
      }
    }
  });
}

}  // namespace

bool gguf_x16_supported(int64_t qtype) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  if (qtype == Q4_K || qtype == Q4_0) return true;
  if (qtype == Q6_K) return __builtin_cpu_supports("avx512vbmi");
#endif
  (void)qtype;
  return false;
}

void dot_q4_k_x8(const uint8_t* group, const Acts& a, int64_t m0, int64_t rows, float* out) {
  switch (rows) {
    case 1: return q4_k_x8_rows<1>(group, a, m0, out);
    case 2: return q4_k_x8_rows<2>(group, a, m0, out);
    case 3: return q4_k_x8_rows<3>(group, a, m0, out);
    default: return q4_k_x8_rows<4>(group, a, m0, out);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
void dot_q4_k_x16(const uint8_t* group, const Acts& a, int64_t m0, int64_t rows, float* out) {
  switch (rows) {
    case 1: return q4_k_x16_rows<1>(group, a, m0, out);
    case 2: return q4_k_x16_rows<2>(group, a, m0, out);
    case 3: return q4_k_x16_rows<3>(group, a, m0, out);
    case 4: return q4_k_x16_rows<4>(group, a, m0, out);
    case 5: return q4_k_x16_rows<5>(group, a, m0, out);
    case 6: return q4_k_x16_rows<6>(group, a, m0, out);
    case 7: return q4_k_x16_rows<7>(group, a, m0, out);
    default: return q4_k_x16_rows<8>(group, a, m0, out);
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
void dot_q4_0_x16(const uint8_t* group, const Acts& a, int64_t m0, int64_t rows, float* out) {
  switch (rows) {
    case 1: return q4_0_x16_rows<1>(group, a, m0, out);
    case 2: return q4_0_x16_rows<2>(group, a, m0, out);
    case 3: return q4_0_x16_rows<3>(group, a, m0, out);
    case 4: return q4_0_x16_rows<4>(group, a, m0, out);
    case 5: return q4_0_x16_rows<5>(group, a, m0, out);
    case 6: return q4_0_x16_rows<6>(group, a, m0, out);
    case 7: return q4_0_x16_rows<7>(group, a, m0, out);
    default: return q4_0_x16_rows<8>(group, a, m0, out);
  }
}
#endif

void dot_q8_0_x8(const uint8_t* group, const Acts& a, int64_t m0, int64_t rows, float* out) {
  switch (rows) {
    case 1: return q8_0_x8_rows<1>(group, a, m0, out);
    case 2: return q8_0_x8_rows<2>(group, a, m0, out);
    case 3: return q8_0_x8_rows<3>(group, a, m0, out);
    default: return q8_0_x8_rows<4>(group, a, m0, out);
  }
}

void dot_q6_k_x8(const uint8_t* group, const Acts& a, int64_t m0, int64_t rows, float* out) {
  switch (rows) {
    case 1: return q6_k_x8_rows<1>(group, a, m0, out);
    case 2: return q6_k_x8_rows<2>(group, a, m0, out);
    case 3: return q6_k_x8_rows<3>(group, a, m0, out);
    default: return q6_k_x8_rows<4>(group, a, m0, out);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
void dot_q6_k_x16(const uint8_t* group, const Acts& a, int64_t m0, int64_t rows, float* out) {
  switch (rows) {
    case 1: return q6_k_x16_rows<1>(group, a, m0, out);
    case 2: return q6_k_x16_rows<2>(group, a, m0, out);
    case 3: return q6_k_x16_rows<3>(group, a, m0, out);
    case 4: return q6_k_x16_rows<4>(group, a, m0, out);
    case 5: return q6_k_x16_rows<5>(group, a, m0, out);
    case 6: return q6_k_x16_rows<6>(group, a, m0, out);
    case 7: return q6_k_x16_rows<7>(group, a, m0, out);
    default: return q6_k_x16_rows<8>(group, a, m0, out);
  }
}
#endif

}  // namespace crane_mp::int8

TORCH_LIBRARY_FRAGMENT(crane_mp, m) {
  m.def("gguf_repack_q4_k_x8(Tensor w, int K) -> Tensor", &crane_mp::int8::gguf_repack_q4_k_x8);
  m.def("gguf_repack_q4_k_x16(Tensor w, int K) -> Tensor", &crane_mp::int8::gguf_repack_q4_k_x16);
  m.def("gguf_repack_q8_0_x8(Tensor w, int K) -> Tensor", &crane_mp::int8::gguf_repack_q8_0_x8);
  m.def("gguf_repack_q6_k_x8(Tensor w, int K) -> Tensor", &crane_mp::int8::gguf_repack_q6_k_x8);
  m.def("gguf_repack_q6_k_x16(Tensor w, int K) -> Tensor", &crane_mp::int8::gguf_repack_q6_k_x16);
  m.def("gguf_repack_q4_0_x16(Tensor w, int K) -> Tensor", &crane_mp::int8::gguf_repack_q4_0_x16);
  m.def("gguf_x16_supported(int qtype) -> bool", &crane_mp::int8::gguf_x16_supported);
}
