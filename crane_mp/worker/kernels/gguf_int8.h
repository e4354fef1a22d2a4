// What the 8-bit-activation GGUF kernels share: quantized activation rows, vector helpers, and the
// kernels on rows repacked eight at a time (gguf_repack.cpp), which gguf_int8.cpp's driver calls.
#pragma once

#include <cstdint>

#include <immintrin.h>

namespace crane_mp::int8 {

// Activation rows quantized in blocks (gguf_int8.cpp): values, one scale per block, sums of 16 and 32.
struct Acts {
  const int8_t* q;        // [M, K]
  const float* d;         // [M, nb]
  const int16_t* sums;    // [M, K / 16]
  const int16_t* sums32;  // [M, K / 32]
  int64_t K;
  int64_t nb;  // blocks per row
  // The same values in the tile kernels' order (gguf_tiles.cpp), where those run: each 64 elements of
  // every row, row after row, before the next 64 ([K / 64, stride, 64]), so that 16 rows from any row
  // are one contiguous kilobyte (rows K bytes apart fall in one L1 set and one page each when K is a
  // multiple of 4,096). Rows past the last (16 at least) are there, their values of no account.
  const int8_t* steps = nullptr;
  int64_t stride = 0;
  // The elements [k_begin, k_end) a tile kernel call takes (multiples of 256, or K): past 0, its output
  // already holds the sums over [0, k_begin), which the call goes on adding to (gguf_int8.cpp's chunks).
  int64_t k_begin = 0;
  int64_t k_end = 0;
};

// Row m's elements k .. k + 63 (k a multiple of 32) in the tile order, the next rows 64 bytes apart.
inline const int8_t* step_rows(const Acts& a, int64_t m, int64_t k) {
  return a.steps + ((k / 64) * a.stride + m) * 64 + k % 64;
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline __m256i load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

inline __m256i low4() { return _mm256_set1_epi8(0x0F); }

// Q6_K's 6-bit values from GGUF's packing, 32 bytes of each part: `lo` (ql) holds the low 4 bits of
// values 0 (low nibbles) and 2 (high), `hi` (ql + 32) those of values 1 and 3, `top` (qh) the top 2
// bits of values 0-3 (bits 0-1, 2-3, 4-5, 6-7). q[s] = value s of each byte position, 0-63.
inline void q6_k_values(__m256i lo, __m256i hi, __m256i top, __m256i q[4]) {
  const __m256i top2 = _mm256_set1_epi8(0x30);
  q[0] = _mm256_or_si256(_mm256_and_si256(lo, low4()), _mm256_and_si256(_mm256_slli_epi16(top, 4), top2));
  q[1] = _mm256_or_si256(_mm256_and_si256(hi, low4()), _mm256_and_si256(_mm256_slli_epi16(top, 2), top2));
  q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 4), low4()), _mm256_and_si256(top, top2));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(hi, 4), low4()),
                         _mm256_and_si256(_mm256_srli_epi16(top, 2), top2));
}

// acc + 8 int32 lanes, each the sum of 4 adjacent products u[i] * s[i] (u unsigned, s signed bytes).
inline __m256i dot_u8s8_add(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

inline __m256i dot_u8s8(__m256i u, __m256i s) { return dot_u8s8_add(_mm256_setzero_si256(), u, s); }

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// acc += u . (the 4 signed bytes at p in every 32-bit lane), the broadcast folded into vpdpbusd as an
// embedded {1to16} operand: GCC 12 emits a separate vpbroadcastd for each, which cost the 512-bit
// kernels 5-13 % on Zen 4.
inline void dpbusd_broadcast(__m512i& acc, __m512i u, const int8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(p)));
}

// acc += the pairs of signed 16-bit products of w and (the two int16 at p in every 32-bit lane).
inline void dpwssd_broadcast(__m512i& acc, __m512i w, const int16_t* p) {
  __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
}

// vpermb's index giving each 64 bits of a vector their row pair's 6 bytes: byte 8q + i <- 6q + i.
struct SixBytesToEight {
  alignas(64) uint8_t index[64];
  constexpr SixBytesToEight() : index{} {
    for (int i = 0; i < 64; ++i) index[i] = static_cast<uint8_t>(6 * (i / 8) + (i % 8 < 6 ? i % 8 : 5));
  }
};
inline constexpr SixBytesToEight kSixToEight;
#endif

// Weight bytes are requested this far ahead of the block being decoded: the hardware prefetcher alone
// left a fifth to a third of the DRAM bandwidth unused with two threads streaming weights.
constexpr int64_t kPrefetchDistance = 1024;

// Prefetch the cache lines of the block kBytes long that lies kPrefetchDistance past `block`.
template <int64_t kBytes>
inline void prefetch_ahead(const uint8_t* block) {
  const char* ahead = reinterpret_cast<const char*>(block) + kPrefetchDistance;
  for (int64_t line = 0; line < kBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
}

// One cache line kPrefetchDistance past `p`. The 512-bit kernels request their blocks' lines spread
// over the work on them: all 37 or 53 at once filled the core's miss buffers and stalled the loads
// behind them (Q6_K x16 1.1-1.3x at 2-16 rows, same process).
inline void prefetch_line_ahead(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchDistance, _MM_HINT_T0);
}

// Rows repacked eight (or sixteen) at a time (gguf_repack.cpp): our own type ids, beyond ggml's, and
// the bytes of one block of a group.
constexpr int64_t kQ4KX8 = 0x10000 + 12;
constexpr int64_t kQ4KX8Bytes = 1184;
constexpr int64_t kQ8_0X8 = 0x10000 + 8;
constexpr int64_t kQ8_0X8Bytes = 272;
constexpr int64_t kQ6KX8 = 0x10000 + 14;
constexpr int64_t kQ6KX8Bytes = 1680;
constexpr int64_t kQ6KX16 = 0x20000 + 14;
constexpr int64_t kQ6KX16Bytes = 3360;
constexpr int64_t kQ4KX16 = 0x20000 + 12;
constexpr int64_t kQ4KX16Bytes = 2368;
constexpr int64_t kQ4_0X16 = 0x20000 + 2;
constexpr int64_t kQ4_0X16Bytes = 288;

// This build and CPU run the x16 kernel of GGML type `qtype` (gguf_repack.cpp).
bool gguf_x16_supported(int64_t qtype);

// A repacked group (`unit` rows) against activation rows m0 .. m0 + rows - 1: out[m * unit + r].
using GroupDotFn = void (*)(const uint8_t* group, const Acts& a, int64_t m0, int64_t rows, float* out);

// Activation rows a tile kernel takes a call at most, and the fewest a matrix needs to go through them:
// below, the VNNI kernels (one decode row is bound by the weights' bytes, not by products).
constexpr int64_t kTileRowsPerCall = 256;
constexpr int64_t kTileMinRows = 16;

// Bytes of a tile kernel call's activations that stay in L2 beside the weights: every weight group of a
// call reads all of them (from L3, a Q4_K call of 256 rows of K = 12288 ran no faster than the VNNI kernel).
constexpr int64_t kActivationBytes = 1536 * 1024;

// Rows a tile kernel call takes of activations K bytes long: as many as stay in L2, since each call turns
// its weights into tile operands once.
inline int64_t tile_rows_per_call(int64_t K) {
  const int64_t rows = kActivationBytes / K / 32 * 32;
  return rows < 64 ? 64 : (rows > kTileRowsPerCall ? kTileRowsPerCall : rows);
}

// Ranges of K the tile kernel calls of gguf_linear_int8 take one after another, each adding to the sums of
// the ones before: so many that kTileRowsPerCall rows of each stay in L2 (an 8B's down projection, K =
// 14,336, otherwise took 96 rows a call and turned its weights into operands for every 3 row pairs).
inline int64_t tile_k_chunks(int64_t K) {
  constexpr int64_t kLongest = kActivationBytes / kTileRowsPerCall;
  return (K + kLongest - 1) / kLongest;
}

// Chunk c's first element of K's `chunks`: a multiple of 256 (the K-quants' super-blocks), K after the last.
inline int64_t tile_k_chunk_begin(int64_t K, int64_t c, int64_t chunks) {
  return c >= chunks ? K : K / 256 * c / chunks * 256;
}

// Weight groups a tile kernel call takes side by side: each activation tile, read from L2 once, is
// multiplied by every one of them while it is in L1.
constexpr int64_t kTileGroups = 4;

// `count` (1 .. kTileGroups) consecutive repacked groups (group_bytes apart, `unit` rows each) against
// activation rows m0 .. m0 + rows - 1: row m0 + i's dot with group g's row r at out[i * ldo + unit * g + r].
using TileDotFn = void (*)(const uint8_t* groups, int64_t group_bytes, int64_t count, const Acts& a, int64_t m0,
                           int64_t rows, float* out, int64_t ldo);

// The tile kernel (gguf_tiles.cpp) of a repacked group type (Q4_K, Q6_K and Q4_0 x16, Q8_0 x8) where
// tiles are on; nullptr otherwise.
// They read activations in the tile order (Acts::steps), 16 rows from any row they start at.
TileDotFn tile_dot(int64_t qtype);

// Eight repacked rows (one group) against activation rows m0 .. m0 + rows - 1 (rows <= 4):
// out[m * 8 + r] = row r . x[m0 + m].
void dot_q4_k_x8(const uint8_t* group, const Acts& a, int64_t m0, int64_t rows, float* out);
void dot_q8_0_x8(const uint8_t* group, const Acts& a, int64_t m0, int64_t rows, float* out);
void dot_q6_k_x8(const uint8_t* group, const Acts& a, int64_t m0, int64_t rows, float* out);
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// Sixteen rows repacked together against up to 8 activation rows: out[m * 16 + r]. Q6_K's needs
// VBMI besides (gguf_x16_supported).
void dot_q4_k_x16(const uint8_t* group, const Acts& a, int64_t m0, int64_t rows, float* out);
void dot_q6_k_x16(const uint8_t* group, const Acts& a, int64_t m0, int64_t rows, float* out);
void dot_q4_0_x16(const uint8_t* group, const Acts& a, int64_t m0, int64_t rows, float* out);
#endif

}  // namespace crane_mp::int8
