// Prompts through GGUF weights on the AMX-INT8 tiles (CPU): the sixteen-row Q4_K, Q6_K and Q4_0 groups and
// the eight-row Q8_0 groups of gguf_repack.cpp, as they are (no second copy of the weights), against up to 64
// activation rows a call.
//
//   gguf_tiles_available() -> bool      built with AMX-INT8 and the OS granted the tile state
//   gguf_tile_kernels(mode) -> int      which tile kernels gguf_int8.cpp's prompts take: 0 none (the
//                                       AVX512-VNNI kernels), 1 AMX, 2 the same kernels on software
//                                       tiles (tests, on CPUs without AMX); returns the previous mode
//
// Each 64-byte row of the x16 layouts holds 4 consecutive elements of each of the group's 16 weight
// rows (Q4_K's as nibbles, Q6_K's as 6-bit fields): a row of a tile multiply's B operand (K / 4 rows
// of 16 columns x 4 bytes) once unpacked. A call unpacks each super-block's quants into one B tile a
// sub-block in L1 (Q4_K: 32 elements, 8 rows; Q6_K: 16 elements, 4 rows), and every 16-row tile of
// activations meets each with one TDPBSUD (activations signed, weights unsigned): the sub-block's exact
// integer sums, which the VNNI kernels' integer scale multiply and float steps then turn into their
// results bit for bit.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "gguf_blocks.h"
#include "gguf_int8.h"
#include "tile_state.h"

namespace crane_mp::int8 {
namespace {

using crane_mp::TileConfig;

enum TileMode : int64_t { kNoTiles = 0, kAmxTiles = 1, kEmulatedTiles = 2 };
std::atomic<int64_t> tile_mode{kNoTiles};

bool amx_int8_built() {
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
  return true;
#else
  return false;
#endif
}

bool gguf_tiles_available() { return amx_int8_built() && tile_state_granted(); }

// Tile 0: C, 16 x `columns` int32; tile 1: A, 16 activation rows of `depth` bytes; tile 2: B, depth / 4
// rows of `columns` x 4 bytes. A 16-row tile always: the activation buffers keep 16 rows past the last
// (gguf_int8.cpp), and the outputs of rows past a call's are dropped.
TileConfig shapes(int depth, int columns) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  cfg.rows[0] = 16, cfg.colsb[0] = static_cast<uint16_t>(4 * columns);
  cfg.rows[1] = 16, cfg.colsb[1] = static_cast<uint16_t>(depth);
  cfg.rows[2] = static_cast<uint8_t>(depth / 4), cfg.colsb[2] = static_cast<uint16_t>(4 * columns);
  return cfg;
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
struct AmxTiles {
  static void configure(const TileConfig& cfg) { _tile_loadconfig(&cfg); }
  static void release() { _tile_release(); }
  // c (16 rows, ldc bytes apart) = a (16 rows, lda apart) . b (ldb apart); a's bytes signed, b's
  // unsigned or (kSignedB) signed.
  template <bool kSignedB>
  static void product(const int8_t* a, int64_t lda, const void* b, int64_t ldb, int32_t* c, int64_t ldc) {
    _tile_zero(0);
    _tile_loadd(1, a, lda);
    _tile_loadd(2, b, ldb);
    if constexpr (kSignedB)
      _tile_dpbssd(0, 1, 2);
    else
      _tile_dpbsud(0, 1, 2);
    _tile_stored(0, c, ldc);
  }
};
#endif

// The same instructions in software as Intel's manual defines them (shapes checked as the CPU
// would fault on them), so the kernels' layouts and arithmetic are tested on CPUs without AMX.
struct EmulatedTiles {
  static TileConfig& config() {
    thread_local TileConfig cfg{};
    return cfg;
  }
  static void configure(const TileConfig& cfg) { config() = cfg; }
  static void release() { config() = TileConfig{}; }
  template <bool kSignedB>
  static void product(const int8_t* a, int64_t lda, const void* b, int64_t ldb, int32_t* c, int64_t ldc) {
    const TileConfig& t = config();
    TORCH_CHECK(t.palette_id == 1 && t.rows[0] == t.rows[1] && t.colsb[1] == 4 * t.rows[2] && t.colsb[0] == t.colsb[2] &&
                t.rows[0] <= 16 && t.colsb[0] <= 64 && t.colsb[1] <= 64, "tile shapes TDPB*D faults on");
    const auto* bytes = static_cast<const uint8_t*>(b);
    for (int m = 0; m < t.rows[0]; ++m)
      for (int n = 0; n < t.colsb[0] / 4; ++n) {
        int32_t sum = 0;
        for (int k = 0; k < t.rows[2]; ++k)
          for (int i = 0; i < 4; ++i) {
            const uint8_t w = bytes[k * ldb + 4 * n + i];
            sum += int32_t{a[m * lda + 4 * k + i]} * (kSignedB ? int32_t{static_cast<int8_t>(w)} : int32_t{w});
          }
        reinterpret_cast<int32_t*>(reinterpret_cast<char*>(c) + m * ldc)[n] = sum;
      }
  }
};

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// isum[r] += c[r] * scale (lane by lane) for a C tile's 16 rows: a sub-block's sums under its scales.
inline void add_scaled(__m512i (&isum)[16], const int32_t (&c)[16][16], __m512i scale) {
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(_mm512_load_si512(c[r]), scale));
}

// The 4 rows of 64 bytes of packed nibbles at `p` as a B tile of 8 rows: the low nibbles (rows 0-3),
// then the high ones (4-7), the layout a Q4_K x16 sub-block and a Q4_0 x16 block share.
inline void split_nibbles(const uint8_t* p, uint8_t (&tile)[8][64]) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int k = 0; k < 4; ++k) {
    const __m512i raw = _mm512_loadu_si512(p + 64 * k);
    _mm512_store_si512(tile[k], _mm512_and_si512(raw, mask));
    _mm512_store_si512(tile[4 + k], _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask));
  }
}

// Requests the next super-block's lines while this one's products run.
template <int64_t kBytes>
inline void prefetch_next(const uint8_t* block) {
  for (int64_t line = 0; line < kBytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + kBytes + line), _MM_HINT_T0);
}

// Q4_K x16 rows against activation rows m0 .. m0 + rows - 1 (rows <= kTileRowsPerCall): out[m * 16 + r],
// as q4_k_x16_rows computes it.
template <class Tiles>
void q4_k_x16_tiles(const uint8_t* group, const Acts& a, int64_t m0, int64_t rows, float* out) {
  alignas(64) float acc[kTileRowsPerCall][16] = {};
  alignas(64) uint8_t b_tiles[8][8][64];  // sub-block j: rows 0-3 its elements 0-15 (low nibbles), 4-7 16-31
  alignas(64) int32_t c[2][16][16];       // two: a sub-block's product need not wait for the last one's reads
  Tiles::configure(shapes(32, 16));
  for (int64_t b = 0; b < a.nb; ++b, group += kQ4KX16Bytes) {
    prefetch_next<kQ4KX16Bytes>(group);
    for (int j = 0; j < 8; ++j) split_nibbles(group + 320 + 256 * j, b_tiles[j]);
    const __m512 d = _mm512_cvtph_ps(load(group)), dmin = _mm512_cvtph_ps(load(group + 32));
    __m512i mins[4];  // sub-blocks 2p (low 16 bits) and 2p + 1 (high) of each row's lane
    for (int p = 0; p < 4; ++p) mins[p] = _mm512_cvtepu8_epi16(load(group + 192 + 32 * p));
    for (int64_t t = 0; 16 * t < rows; ++t) {
      const int64_t first = m0 + 16 * t;
      __m512i isum[16];
      for (int r = 0; r < 16; ++r) isum[r] = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        Tiles::template product<false>(a.q + first * a.K + 256 * b + 32 * j, a.K, b_tiles[j][0], 64, c[j % 2][0], 64);
        const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 64 + 16 * j));
        add_scaled(isum, c[j % 2], _mm512_cvtepu8_epi32(scales));
      }
      for (int64_t r = 0; r < std::min<int64_t>(16, rows - 16 * t); ++r) {
        const int64_t m = first + r;
        __m512i msum = _mm512_setzero_si512();
        for (int p = 0; p < 4; ++p) dpwssd_broadcast(msum, mins[p], a.sums32 + m * (a.K / 32) + 8 * b + 2 * p);
        const __m512 da = _mm512_set1_ps(a.d[m * a.nb + b]);
        float* row = acc[16 * t + r];
        const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, da), _mm512_load_ps(row));
        _mm512_store_ps(row, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, da), sum));
      }
    }
  }
  Tiles::release();
  std::memcpy(out, acc, rows * sizeof(acc[0]));
}

// Q4_0 x16 rows likewise, as q4_0_x16_rows computes them: a block's quants are a Q4_K x16 sub-block's
// layout, the -8 of every value goes through the activations' 32-sums.
template <class Tiles>
void q4_0_x16_tiles(const uint8_t* group, const Acts& a, int64_t m0, int64_t rows, float* out) {
  alignas(64) float acc[kTileRowsPerCall][16] = {};
  alignas(64) uint8_t b_tile[8][64];  // rows 0-3 the block's elements 0-15 (low nibbles), 4-7 16-31
  alignas(64) int32_t c[16][16];
  Tiles::configure(shapes(32, 16));
  for (int64_t b = 0; b < a.nb; ++b, group += kQ4_0X16Bytes) {
    prefetch_next<kQ4_0X16Bytes>(group);
    split_nibbles(group + 32, b_tile);
    const __m512 d = _mm512_cvtph_ps(load(group));
    for (int64_t t = 0; 16 * t < rows; ++t) {
      const int64_t first = m0 + 16 * t;
      Tiles::template product<false>(a.q + first * a.K + 32 * b, a.K, b_tile[0], 64, c[0], 64);
      for (int64_t r = 0; r < std::min<int64_t>(16, rows - 16 * t); ++r) {
        const int64_t m = first + r;
        const __m512i offset = _mm512_set1_epi32(8 * int32_t{a.sums32[m * (a.K / 32) + b]});
        const __m512i isum = _mm512_sub_epi32(_mm512_load_si512(c[r]), offset);
        float* row = acc[16 * t + r];
        const __m512 scaled = _mm512_mul_ps(d, _mm512_set1_ps(a.d[m * a.nb + b]));
        _mm512_store_ps(row, _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scaled, _mm512_load_ps(row)));
      }
    }
  }
  Tiles::release();
  std::memcpy(out, acc, rows * sizeof(acc[0]));
}

// Q8_0 x8 rows (eight a group: tiles of 8 columns) likewise, as q8_0_x8_rows computes them: a block's
// 32 signed values of the eight rows are already a B tile (8 rows of 8 columns x 4 bytes), read in place.
template <class Tiles>
void q8_0_x8_tiles(const uint8_t* group, const Acts& a, int64_t m0, int64_t rows, float* out) {
  alignas(32) float acc[kTileRowsPerCall][8] = {};
  alignas(64) int32_t c[16][8];
  const uint8_t* scales = group + a.nb * 256;
  Tiles::configure(shapes(32, 8));
  for (int64_t b = 0; b < a.nb; ++b) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 16 * b)));
    for (int64_t t = 0; 16 * t < rows; ++t) {
      const int64_t first = m0 + 16 * t;
      Tiles::template product<true>(a.q + first * a.K + 32 * b, a.K, group + 256 * b, 32, c[0], 32);
      for (int64_t r = 0; r < std::min<int64_t>(16, rows - 16 * t); ++r) {
        const __m256 scaled = _mm256_mul_ps(d, _mm256_set1_ps(a.d[(first + r) * a.nb + b]));
        float* row = acc[16 * t + r];
        _mm256_store_ps(row, _mm256_fmadd_ps(_mm256_cvtepi32_ps(load(c[r])), scaled, _mm256_load_ps(row)));
      }
    }
  }
  Tiles::release();
  std::memcpy(out, acc, rows * sizeof(acc[0]));
}

// Q6_K x16 rows likewise, as q6_k_x16_rows computes them; the -32 of every value through the
// activations' 16-sums.
template <class Tiles>
__attribute__((target("avx512vbmi"))) void q6_k_x16_tiles(const uint8_t* group, const Acts& a, int64_t m0,
                                                          int64_t rows, float* out) {
  const __mmask64 forty_eight = 0xFFFFFFFFFFFFULL;
  const __m512i to_eights = _mm512_load_si512(kSixToEight.index);
  const __m512i fields = _mm512_set1_epi64(0x2A241E18120C0600LL);  // bit offsets 0, 6, .., 42 of each 64
  const __m512i low6 = _mm512_set1_epi8(0x3F);
  const __m512i first_of_pair = _mm512_set1_epi32(1), second_of_pair = _mm512_set1_epi32(0x10000);
  alignas(64) float acc[kTileRowsPerCall][16] = {};
  alignas(64) uint8_t b_tiles[16][4][64];  // sub-block j: its 16 elements, 4 a row
  alignas(64) int32_t c[2][16][16];
  Tiles::configure(shapes(16, 16));
  for (int64_t b = 0; b < a.nb; ++b, group += kQ6KX16Bytes) {
    prefetch_next<kQ6KX16Bytes>(group);
    for (int k = 0; k < 64; ++k) {
      const __m512i packed = _mm512_maskz_loadu_epi8(forty_eight, group + 288 + 48 * k);
      const __m512i v = _mm512_and_si512(_mm512_multishift_epi64_epi8(fields, _mm512_permutexvar_epi8(to_eights, packed)), low6);
      _mm512_store_si512(b_tiles[k / 4][k % 4], v);
    }
    const __m512 d = _mm512_cvtph_ps(load(group));
    for (int64_t t = 0; 16 * t < rows; ++t) {
      const int64_t first = m0 + 16 * t;
      __m512i isum[16];
      for (int r = 0; r < 16; ++r) isum[r] = _mm512_setzero_si512();
      for (int j = 0; j < 16; ++j) {
        Tiles::template product<false>(a.q + first * a.K + 256 * b + 16 * j, a.K, b_tiles[j][0], 64, c[j % 2][0], 64);
        const __m512i pair = _mm512_cvtepi8_epi16(load(group + 32 + 32 * (j / 2)));
        add_scaled(isum, c[j % 2], _mm512_madd_epi16(pair, j % 2 == 0 ? first_of_pair : second_of_pair));
      }
      for (int64_t r = 0; r < std::min<int64_t>(16, rows - 16 * t); ++r) {
        const int64_t m = first + r;
        __m512i offset = _mm512_setzero_si512();
        for (int p = 0; p < 8; ++p)
          dpwssd_broadcast(offset, _mm512_cvtepi8_epi16(load(group + 32 + 32 * p)), a.sums + m * (a.K / 16) + 16 * b + 2 * p);
        const __m512i total = _mm512_sub_epi32(isum[r], _mm512_slli_epi32(offset, 5));
        const __m512 scaled = _mm512_mul_ps(d, _mm512_set1_ps(a.d[m * a.nb + b]));
        float* row = acc[16 * t + r];
        _mm512_store_ps(row, _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), scaled, _mm512_load_ps(row)));
      }
    }
  }
  Tiles::release();
  std::memcpy(out, acc, rows * sizeof(acc[0]));
}
#endif

// The build and CPU run the emulated kernels: they are the AVX512-VNNI x16 kernels' arithmetic.
bool emulation_built(int64_t qtype) { return gguf_x16_supported(qtype); }

int64_t gguf_tile_kernels(int64_t mode) {
  TORCH_CHECK(mode == kNoTiles || mode == kAmxTiles || mode == kEmulatedTiles, "gguf_tile_kernels: mode ", mode,
              " is none of 0 (off), 1 (AMX), 2 (emulated)");
  TORCH_CHECK(mode != kAmxTiles || gguf_tiles_available(), "gguf_tile_kernels: this build or CPU has no AMX-INT8 "
              "tiles (or the OS withheld the tile state)");
  TORCH_CHECK(mode != kEmulatedTiles || emulation_built(gguf::Q4_K), "gguf_tile_kernels: the emulated tiles need the "
              "AVX512-VNNI kernels, which this build or CPU lacks");
  return tile_mode.exchange(mode);
}

}  // namespace

GroupDotFn tile_dot(int64_t qtype) {
  const int64_t mode = tile_mode.load(std::memory_order_relaxed);
  if (mode == kNoTiles) return nullptr;
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  if (mode == kEmulatedTiles) {
    if (qtype == kQ4KX16) return q4_k_x16_tiles<EmulatedTiles>;
    if (qtype == kQ6KX16 && emulation_built(gguf::Q6_K)) return q6_k_x16_tiles<EmulatedTiles>;
    if (qtype == kQ8_0X8) return q8_0_x8_tiles<EmulatedTiles>;
    if (qtype == kQ4_0X16) return q4_0_x16_tiles<EmulatedTiles>;
  }
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
  if (mode == kAmxTiles) {
    if (qtype == kQ4KX16) return q4_k_x16_tiles<AmxTiles>;
    if (qtype == kQ6KX16) return q6_k_x16_tiles<AmxTiles>;
    if (qtype == kQ8_0X8) return q8_0_x8_tiles<AmxTiles>;
    if (qtype == kQ4_0X16) return q4_0_x16_tiles<AmxTiles>;
  }
#endif
#endif
  return nullptr;
}

}  // namespace crane_mp::int8

TORCH_LIBRARY_FRAGMENT(crane_mp, m) {
  m.def("gguf_tiles_available() -> bool", &crane_mp::int8::gguf_tiles_available);
  m.def("gguf_tile_kernels(int mode) -> int", &crane_mp::int8::gguf_tile_kernels);
}
