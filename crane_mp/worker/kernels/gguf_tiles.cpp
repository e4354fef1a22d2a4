// Prompts through GGUF weights on the AMX-INT8 tiles (CPU): the sixteen-row Q4_K, Q6_K and Q4_0 groups and
// the eight-row Q8_0 groups of gguf_repack.cpp, as they are (no second copy of the weights), up to
// kTileGroups of them against up to kTileRowsPerCall activation rows a call (the activations in the
// tiles' order: Acts::steps).
//
//   gguf_tiles_available() -> bool      built with AMX-INT8 and the OS granted the tile state
//   gguf_tile_kernels(mode) -> int      which tile kernels gguf_int8.cpp's prompts take: 0 none (the
//                                       AVX512-VNNI kernels), 1 AMX, 2 the same kernels on software
//                                       tiles (tests, on CPUs without AMX); returns the previous mode
//
// Each 64-byte row of the x16 layouts holds 4 consecutive elements of each of the group's 16 weight
// rows (Q4_K's as nibbles, Q6_K's as 6-bit fields): a row of a tile multiply's B operand (K / 4 rows
// of 16 columns x 4 bytes) once unpacked. Q4_K and Q6_K take a super-block in one pass over its 256
// elements: every weight times its sub-block's scale, as a 16-bit product split into a low and a high
// byte, makes two B operands, and low sums + 256 x high sums are the VNNI kernels' scaled integer sums,
// which their float steps then turn into the same results bit for bit. Q4_0 and Q8_0 take one tile
// multiply a 32-element block (a float scale each).
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

// One tile multiply's shapes: tile 0 C, 16 x `columns` int32; tile 1 A, 16 activation rows of `depth`
// bytes; tile 2 B, depth / 4 rows of `columns` x 4 bytes. A 16-row tile always: the activation buffers
// keep 16 rows past the last (gguf_int8.cpp), and the outputs of rows past a call's are dropped.
TileConfig shapes(int depth, int columns) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  cfg.rows[0] = 16, cfg.colsb[0] = static_cast<uint16_t>(4 * columns);
  cfg.rows[1] = 16, cfg.colsb[1] = static_cast<uint16_t>(depth);
  cfg.rows[2] = static_cast<uint8_t>(depth / 4), cfg.colsb[2] = static_cast<uint16_t>(4 * columns);
  return cfg;
}

// The super-block kernels' eight tiles, each 16 rows of 64 bytes: 0-3 C (low and high sums of A tile
// 4, then of A tile 5), 4-5 A (two 16-row tiles of activations), 6-7 B (low and high weight bytes).
TileConfig square_tiles() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  return cfg;
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
// The tile instructions with the tile number a template argument (GCC's intrinsics paste theirs into the
// instruction as written), and with the memory clobbers its tileloadd and tilestored lack: without them,
// the vector loads of a stored C tile may be scheduled before the store.
struct AmxTiles {
  static void configure(const TileConfig& cfg) { crane_mp::load_tile_config(cfg); }
  static void release() { _tile_release(); }
  template <int kTile>
  static void zero() {
    __asm__ volatile("tilezero %%tmm%c0" ::"i"(kTile));
  }
  template <int kTile>
  static void load(const void* p, int64_t stride) {
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(kTile) : "memory");
  }
  template <int kTile>
  static void store(void* p, int64_t stride) {
    __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(kTile) : "memory");
  }
  // Tile kC += kA . kB: kA's bytes signed, kB's unsigned or (kSignedB) signed.
  template <int kC, int kA, int kB, bool kSignedB>
  static void dot() {
    if constexpr (kSignedB)
      __asm__ volatile("tdpbssd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(kC), "i"(kA), "i"(kB));
    else
      __asm__ volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(kC), "i"(kA), "i"(kB));
  }
};
#endif

// The same instructions in software as Intel's manual defines them (shapes checked as the CPU
// would fault on them), so the kernels' layouts and arithmetic are tested on CPUs without AMX.
struct EmulatedTiles {
  struct State {
    TileConfig cfg{};
    alignas(64) uint8_t data[8][16][64];
  };
  static State& state() {
    thread_local State s{};
    return s;
  }
  static void configure(const TileConfig& cfg) { state().cfg = cfg; }
  static void release() { state().cfg = TileConfig{}; }
  template <int kTile>
  static void zero() {
    std::memset(state().data[kTile], 0, sizeof(State::data[kTile]));
  }
  template <int kTile>
  static void load(const void* p, int64_t stride) {
    State& s = state();
    TORCH_CHECK(s.cfg.palette_id == 1 && s.cfg.rows[kTile] > 0, "tile ", kTile, " is not configured");
    for (int r = 0; r < s.cfg.rows[kTile]; ++r)
      std::memcpy(s.data[kTile][r], static_cast<const uint8_t*>(p) + r * stride, s.cfg.colsb[kTile]);
  }
  template <int kTile>
  static void store(void* p, int64_t stride) {
    State& s = state();
    TORCH_CHECK(s.cfg.palette_id == 1 && s.cfg.rows[kTile] > 0, "tile ", kTile, " is not configured");
    for (int r = 0; r < s.cfg.rows[kTile]; ++r)
      std::memcpy(static_cast<uint8_t*>(p) + r * stride, s.data[kTile][r], s.cfg.colsb[kTile]);
  }
  template <int kC, int kA, int kB, bool kSignedB>
  static void dot() {
    State& s = state();
    const TileConfig& t = s.cfg;
    TORCH_CHECK(t.palette_id == 1 && t.rows[kC] == t.rows[kA] && t.colsb[kA] == 4 * t.rows[kB] &&
                t.colsb[kC] == t.colsb[kB] && t.rows[kC] <= 16 && t.colsb[kC] <= 64 && t.colsb[kA] <= 64,
                "tile shapes TDPB*D faults on");
    for (int m = 0; m < t.rows[kC]; ++m)
      for (int n = 0; n < t.colsb[kC] / 4; ++n) {
        int32_t sum;
        std::memcpy(&sum, &s.data[kC][m][4 * n], 4);
        for (int k = 0; k < t.rows[kB]; ++k)
          for (int i = 0; i < 4; ++i) {
            const uint8_t w = s.data[kB][k][4 * n + i];
            const int32_t a = static_cast<int8_t>(s.data[kA][m][4 * k + i]);
            sum += a * (kSignedB ? int32_t{static_cast<int8_t>(w)} : int32_t{w});
          }
        std::memcpy(&s.data[kC][m][4 * n], &sum, 4);
      }
  }
};

// c (16 rows, ldc bytes apart) = a (16 rows of the tile order) . b (ldb apart), in shapes(depth, columns).
template <class Tiles, bool kSignedB>
void product(const int8_t* a, const void* b, int64_t ldb, int32_t* c, int64_t ldc) {
  Tiles::template zero<0>();
  Tiles::template load<1>(a, 64);
  Tiles::template load<2>(b, ldb);
  Tiles::template dot<0, 1, 2, kSignedB>();
  Tiles::template store<0>(c, ldc);
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// Requests the next super-block's lines while this one's products run.
template <int64_t kBytes>
inline void prefetch_next(const uint8_t* block) {
  for (int64_t line = 0; line < kBytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + kBytes + line), _MM_HINT_T0);
}

// A super-block's weights as two B operands per 64 of its elements (4 K steps of 16 rows x 64 bytes):
// each weight times its sub-block's scale (a 16-bit product) split into its low byte (unsigned) and
// its high byte (kSignedHigh: signed), so low sums + 256 x high sums are the super-block's scaled
// integer sums in one pass over K, with no stores between sub-blocks.
struct ScaledWeights {
  alignas(64) uint8_t low[4][16][64];
  alignas(64) uint8_t high[4][16][64];
};

// The products of even bytes `e` and odd bytes `o` (values in 16-bit lanes) with `scale` (16-bit lanes),
// split into their low and high bytes, each back in its byte's place.
inline void split_products(__m512i e, __m512i o, __m512i scale, uint8_t* low, uint8_t* high) {
  constexpr __mmask64 kEven = 0x5555555555555555ULL;
  const __m512i pe = _mm512_mullo_epi16(e, scale), po = _mm512_mullo_epi16(o, scale);
  _mm512_store_si512(low, _mm512_mask_blend_epi8(kEven, _mm512_slli_epi16(po, 8), pe));
  _mm512_store_si512(high, _mm512_mask_blend_epi8(kEven, po, _mm512_srli_epi16(pe, 8)));
}

// Sums are the products of activation rows m .. m + 15 (kPair: + 31) over super-block b and `w`: tiles 0
// and 1 the low and high sums of the first 16 rows, 2 and 3 the next 16's. between(s) runs after K step
// s's products are issued. The operands are loaded in the order the products use them, and the low bytes'
// products come first: tiles are not renamed, so each load waits for the last product that reads the
// tile it overwrites, and this order frees each one earliest (Q4_K 1-7 % faster than all four loads first).
template <class Tiles, bool kSignedHigh, bool kPair, class Between>
void take_sums(const Acts& a, int64_t m, int64_t b, const ScaledWeights& w, Between between) {
  for (int s = 0; s < 4; ++s) {
    const int8_t* x = step_rows(a, m, 256 * b + 64 * s);
    Tiles::template load<6>(w.low[s][0], 64);
    Tiles::template load<4>(x, 64);
    Tiles::template dot<0, 4, 6, false>();
    if constexpr (kPair) {
      Tiles::template load<5>(x + 16 * 64, 64);
      Tiles::template dot<2, 5, 6, false>();
    }
    Tiles::template load<7>(w.high[s][0], 64);
    Tiles::template dot<1, 4, 7, kSignedHigh>();
    if constexpr (kPair) Tiles::template dot<3, 5, 7, kSignedHigh>();
    between(s);
  }
}

// take_sums' tiles into c (c[0] and c[1] the first 16 rows' low and high sums, c[2] and c[3] the
// next's), zeroed for the next pair.
template <class Tiles, bool kPair>
void store_sums(int32_t (&c)[4][16][16]) {
  Tiles::template store<0>(c[0][0], 64);
  Tiles::template store<1>(c[1][0], 64);
  Tiles::template zero<0>();
  Tiles::template zero<1>();
  if constexpr (kPair) {
    Tiles::template store<2>(c[2][0], 64);
    Tiles::template store<3>(c[3][0], 64);
    Tiles::template zero<2>();
    Tiles::template zero<3>();
  }
}

// Rows r0 .. r1 - 1 (0-31) of store_sums' output as low + 256 x high: each(sum, i) for row r0 + i. Addresses
// advance by a row, none recomputed from r.
template <class Each>
inline void scaled_sums(const int32_t (&c)[4][16][16], int64_t r0, int64_t r1, Each each) {
  for (int64_t r = r0; r < r1;) {
    const int64_t half_end = std::min<int64_t>(r1, (r / 16 + 1) * 16);
    const int32_t* low = c[2 * (r / 16)][r % 16];
    const int32_t* high = c[2 * (r / 16) + 1][r % 16];
    for (; r < half_end; ++r, low += 16, high += 16)
      each(_mm512_add_epi32(_mm512_load_si512(low), _mm512_slli_epi32(_mm512_load_si512(high), 8)), r - r0);
  }
}

// The super-block kernels' walk over `count` groups' blocks (kBlockBytes each, the groups group_bytes
// apart) and activation rows m0 .. m0 + rows - 1, 32 rows at a time: scale(block, w) turns a block's
// weights into tile operands once, and add(g, block, b, c, first, r0, r1) adds the scaled sums c of rows
// first + r0 .. first + r1 - 1 (counted from m0) of group g's block b into the call's accumulators. Each
// 32 rows' activation tiles go through every group's block while they are in L1 (read from L2 once for
// all of them: with one group a call, waiting on those reads took over half the kernel's time). A
// product's sums are added a quarter after each K step of the next product, so that the tile unit works
// while the vector units do (Q4_K 1.26-1.39x the VNNI kernel at 1,024 rows, against 1.18-1.25x with the
// additions all after the next products).
template <class Tiles, bool kSignedHigh, int64_t kBlockBytes, class Scale, class Add>
void super_blocks(const uint8_t* groups, int64_t group_bytes, int64_t count, const Acts& a, int64_t m0, int64_t rows,
                  Scale scale, Add add) {
  alignas(64) ScaledWeights w[kTileGroups];
  alignas(64) int32_t c[2][4][16][16];
  struct Pending {
    const uint8_t* block = nullptr;
    int64_t g = 0, b = 0, first = 0, count = 0;
  } pending;
  int slot = 0;
  Tiles::configure(square_tiles());
  Tiles::template zero<0>();
  Tiles::template zero<1>();
  Tiles::template zero<2>();
  Tiles::template zero<3>();
  for (int64_t b = a.k_begin / 256; b < a.k_end / 256; ++b) {
    for (int64_t first = 0; first < rows; first += 32) {
      const bool pair = first + 16 < rows;
      for (int64_t g = 0; g < count; ++g) {
        // Each group's block becomes operands just before its first products, while the previous group's
        // products run (all four first, at 16 rows a call, kept the tile unit waiting: 1.2x the time).
        const uint8_t* block = groups + g * group_bytes + b * kBlockBytes;
        if (first == 0) {
          prefetch_next<kBlockBytes>(block);
          scale(block, w[g]);
        }
        const auto between = [&](int s) {
          const int64_t r0 = 8 * s, r1 = std::min<int64_t>(r0 + 8, pending.count);
          if (pending.block != nullptr && r0 < r1)
            add(pending.g, pending.block, pending.b, c[slot ^ 1], pending.first, r0, r1);
        };
        if (pair)
          take_sums<Tiles, kSignedHigh, true>(a, m0 + first, b, w[g], between);
        else
          take_sums<Tiles, kSignedHigh, false>(a, m0 + first, b, w[g], between);
        if (pair)
          store_sums<Tiles, true>(c[slot]);
        else
          store_sums<Tiles, false>(c[slot]);
        pending = {block, g, b, first, std::min<int64_t>(32, rows - first)};
        slot ^= 1;
      }
    }
  }
  if (pending.block != nullptr) add(pending.g, pending.block, pending.b, c[slot ^ 1], pending.first, 0, pending.count);
  Tiles::release();
}

// The accumulators of `count` groups of kUnit columns for `rows` rows at their start: zeros, or where the
// call takes a later range of K, the sums out (rows ldo floats apart) holds so far.
template <int64_t kUnit>
void start_rows(float (&acc)[kTileGroups][kTileRowsPerCall][kUnit], int64_t count, int64_t rows, const Acts& a,
                const float* out, int64_t ldo) {
  for (int64_t g = 0; g < count; ++g) {
    if (a.k_begin == 0)
      std::memset(acc[g], 0, rows * sizeof(acc[g][0]));
    else
      for (int64_t r = 0; r < rows; ++r) std::memcpy(acc[g][r], out + r * ldo + kUnit * g, sizeof(acc[g][r]));
  }
}

// The accumulators of `count` groups of kUnit columns for `rows` rows into out (rows ldo floats apart).
template <int64_t kUnit>
void store_rows(const float (&acc)[kTileGroups][kTileRowsPerCall][kUnit], int64_t count, int64_t rows, float* out,
                int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < count; ++g) std::memcpy(out + r * ldo + kUnit * g, acc[g][r], sizeof(acc[g][r]));
}

// A Q4_K x16 super-block's weights, each times its sub-block's scale (0-945: high bytes unsigned too).
// Each of sub-block j's 4 rows of 64 bytes holds 4 of its elements 0-15 (low nibbles) and 4 of 16-31 (high
// nibbles) for each of the 16 weight rows; they become B rows 8 (j % 2) .. + 7 of K step j / 2.
inline void q4_k_scaled(const uint8_t* group, ScaledWeights& w) {
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  for (int j = 0; j < 8; ++j) {
    const __m512i s32 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 64 + 16 * j)));
    const __m512i scale = _mm512_or_si512(s32, _mm512_slli_epi32(s32, 16));  // row r's in both 16-bit halves
    const int s = j / 2, row = 8 * (j % 2);
    for (int k = 0; k < 4; ++k) {
      const __m512i x = _mm512_loadu_si512(group + 320 + 256 * j + 64 * k);
      split_products(_mm512_and_si512(x, low4), _mm512_and_si512(_mm512_srli_epi16(x, 8), low4), scale,
                     w.low[s][row + k], w.high[s][row + k]);
      split_products(_mm512_and_si512(_mm512_srli_epi16(x, 4), low4), _mm512_srli_epi16(x, 12), scale,
                     w.low[s][row + 4 + k], w.high[s][row + 4 + k]);
    }
  }
}

// Q4_K x16 groups against activation rows m0 .. m0 + rows - 1 (rows <= kTileRowsPerCall), a TileDotFn,
// as q4_k_x16_rows computes them (the same integer sums, the same float steps).
template <class Tiles>
void q4_k_x16_tiles(const uint8_t* groups, int64_t group_bytes, int64_t count, const Acts& a, int64_t m0,
                    int64_t rows, float* out, int64_t ldo) {
  alignas(64) float acc[kTileGroups][kTileRowsPerCall][16];
  start_rows(acc, count, rows, a, out, ldo);
  const auto add = [&](int64_t g, const uint8_t* block, int64_t b, const int32_t(&c)[4][16][16], int64_t first,
                       int64_t r0, int64_t r1) {
    const __m512 d = _mm512_cvtph_ps(load(block)), dmin = _mm512_cvtph_ps(load(block + 32));
    __m512i mins[4];  // sub-blocks 2p (low 16 bits) and 2p + 1 (high) of each row's lane
    for (int p = 0; p < 4; ++p) mins[p] = _mm512_cvtepu8_epi16(load(block + 192 + 32 * p));
    const int64_t m = m0 + first + r0, sums_stride = a.K / 32, nb = a.nb;
    const int16_t* sums = a.sums32 + m * sums_stride + 8 * b;
    const float* scales = a.d + m * nb + b;
    float* sums_of_rows = acc[g][first + r0];
    scaled_sums(c, r0, r1, [&](__m512i isum, int64_t i) {
      __m512i msum = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) dpwssd_broadcast(msum, mins[p], sums + i * sums_stride + 2 * p);
      const __m512 da = _mm512_set1_ps(scales[i * nb]);
      float* row = sums_of_rows + 16 * i;
      const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, da), _mm512_load_ps(row));
      _mm512_store_ps(row, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, da), sum));
    });
  };
  super_blocks<Tiles, false, kQ4KX16Bytes>(groups, group_bytes, count, a, m0, rows, q4_k_scaled, add);
  store_rows(acc, count, rows, out, ldo);
}

// The 4 rows of 64 bytes of packed nibbles at `p` as a B tile of 8 rows: the low nibbles (rows 0-3),
// then the high ones (4-7), a Q4_0 x16 block's layout.
inline void split_nibbles(const uint8_t* p, uint8_t (&tile)[8][64]) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int k = 0; k < 4; ++k) {
    const __m512i raw = _mm512_loadu_si512(p + 64 * k);
    _mm512_store_si512(tile[k], _mm512_and_si512(raw, mask));
    _mm512_store_si512(tile[4 + k], _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask));
  }
}

// One Q4_0 x16 group's products over the call's range of K added into acc (rows of 16 floats), in shapes(32, 16).
template <class Tiles>
void q4_0_x16_group(const uint8_t* group, const Acts& a, int64_t m0, int64_t rows, float (&acc)[kTileRowsPerCall][16],
                    uint8_t (&b_tile)[8][64], int32_t (&c)[16][16]) {
  group += a.k_begin / 32 * kQ4_0X16Bytes;
  for (int64_t b = a.k_begin / 32; b < a.k_end / 32; ++b, group += kQ4_0X16Bytes) {
    prefetch_next<kQ4_0X16Bytes>(group);
    split_nibbles(group + 32, b_tile);
    const __m512 d = _mm512_cvtph_ps(load(group));
    for (int64_t t = 0; 16 * t < rows; ++t) {
      const int64_t first = m0 + 16 * t;
      product<Tiles, false>(step_rows(a, first, 32 * b), b_tile[0], 64, c[0], 64);
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
}

// The one-group-at-a-time kernels' call (Q4_0 x16, Q8_0 x8): group(its bytes, its accumulators, started
// by start_rows) for each of `count` groups in one tile configuration, then the accumulators (kUnit columns
// a group) into out.
template <class Tiles, int64_t kUnit, class Group>
void group_at_a_time(const TileConfig& cfg, const uint8_t* groups, int64_t group_bytes, int64_t count, const Acts& a,
                     int64_t rows, float* out, int64_t ldo, Group group) {
  alignas(64) float acc[kTileGroups][kTileRowsPerCall][kUnit];
  start_rows(acc, count, rows, a, out, ldo);
  Tiles::configure(cfg);
  for (int64_t g = 0; g < count; ++g) group(groups + g * group_bytes, acc[g]);
  Tiles::release();
  store_rows(acc, count, rows, out, ldo);
}

// Q4_0 x16 groups likewise, as q4_0_x16_rows computes them, a group at a time: a block's quants are a B
// tile of 8 rows once split, the -8 of every value goes through the activations' 32-sums.
template <class Tiles>
void q4_0_x16_tiles(const uint8_t* groups, int64_t group_bytes, int64_t count, const Acts& a, int64_t m0,
                    int64_t rows, float* out, int64_t ldo) {
  alignas(64) uint8_t b_tile[8][64];  // rows 0-3 the block's elements 0-15 (low nibbles), 4-7 16-31
  alignas(64) int32_t c[16][16];
  group_at_a_time<Tiles, 16>(shapes(32, 16), groups, group_bytes, count, a, rows, out, ldo,
                             [&](const uint8_t* group, float (&acc)[kTileRowsPerCall][16]) {
                               q4_0_x16_group<Tiles>(group, a, m0, rows, acc, b_tile, c);
                             });
}

// One Q8_0 x8 group's products over the call's range of K added into acc (rows of 8 floats), in shapes(32, 8):
// a block's 32 signed values of the eight rows are already a B tile (8 rows of 8 columns x 4 bytes), read in
// place.
template <class Tiles>
void q8_0_x8_group(const uint8_t* group, const Acts& a, int64_t m0, int64_t rows, float (&acc)[kTileRowsPerCall][8],
                   int32_t (&c)[16][8]) {
  const uint8_t* scales = group + a.nb * 256;
  for (int64_t b = a.k_begin / 32; b < a.k_end / 32; ++b) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 16 * b)));
    for (int64_t t = 0; 16 * t < rows; ++t) {
      const int64_t first = m0 + 16 * t;
      product<Tiles, true>(step_rows(a, first, 32 * b), group + 256 * b, 32, c[0], 32);
      for (int64_t r = 0; r < std::min<int64_t>(16, rows - 16 * t); ++r) {
        const __m256 scaled = _mm256_mul_ps(d, _mm256_set1_ps(a.d[(first + r) * a.nb + b]));
        float* row = acc[16 * t + r];
        _mm256_store_ps(row, _mm256_fmadd_ps(_mm256_cvtepi32_ps(load(c[r])), scaled, _mm256_load_ps(row)));
      }
    }
  }
}

// Q8_0 x8 groups (eight rows a group: tiles of 8 columns) likewise, as q8_0_x8_rows computes them, a
// group at a time.
template <class Tiles>
void q8_0_x8_tiles(const uint8_t* groups, int64_t group_bytes, int64_t count, const Acts& a, int64_t m0,
                   int64_t rows, float* out, int64_t ldo) {
  alignas(64) int32_t c[16][8];
  group_at_a_time<Tiles, 8>(shapes(32, 8), groups, group_bytes, count, a, rows, out, ldo,
                            [&](const uint8_t* group, float (&acc)[kTileRowsPerCall][8]) {
                              q8_0_x8_group<Tiles>(group, a, m0, rows, acc, c);
                            });
}

// A Q6_K x16 super-block's weights less 32 (the -32 of every value in the weights, not the activations'
// 16-sums) times their sub-block's signed scale: -4,064..4,096, high bytes signed. Row k of its 64 rows of
// 48 packed bytes holds elements 4k .. 4k + 3 of the 16 rows: B row k % 16 of K step k / 16.
__attribute__((target("avx512vbmi"))) inline void q6_k_scaled(const uint8_t* group, ScaledWeights& w) {
  const __mmask64 forty_eight = 0xFFFFFFFFFFFFULL;
  const __m512i to_eights = _mm512_load_si512(kSixToEight.index);
  const __m512i fields = _mm512_set1_epi64(0x2A241E18120C0600LL);  // bit offsets 0, 6, .., 42 of each 64
  const __m512i low6 = _mm512_set1_epi8(0x3F), low8 = _mm512_set1_epi16(0x00FF), offset = _mm512_set1_epi16(32);
  // A sub-block pair's 32 scale bytes alternate (row r: 2r the even sub-block's, 2r + 1 the odd one's):
  // these byte shuffles give each row's 32 bits two copies of one of them as 16-bit lanes.
  const __m512i even_scale = _mm512_broadcast_i32x4(_mm_set_epi64x(0x0D0C0D0C09080908LL, 0x0504050401000100LL));
  const __m512i odd_scale = _mm512_broadcast_i32x4(_mm_set_epi64x(0x0F0E0F0E0B0A0B0ALL, 0x0706070603020302LL));
  for (int p = 0; p < 8; ++p) {
    const __m512i pair = _mm512_cvtepi8_epi16(load(group + 32 + 32 * p));
    for (int half = 0; half < 2; ++half) {
      const __m512i scale = _mm512_shuffle_epi8(pair, half == 0 ? even_scale : odd_scale);
      for (int i = 0; i < 4; ++i) {
        const int k = 8 * p + 4 * half + i;
        const __m512i packed = _mm512_maskz_loadu_epi8(forty_eight, group + 288 + 48 * k);
        const __m512i v =
            _mm512_and_si512(_mm512_multishift_epi64_epi8(fields, _mm512_permutexvar_epi8(to_eights, packed)), low6);
        split_products(_mm512_sub_epi16(_mm512_and_si512(v, low8), offset),
                       _mm512_sub_epi16(_mm512_srli_epi16(v, 8), offset), scale, w.low[k / 16][k % 16],
                       w.high[k / 16][k % 16]);
      }
    }
  }
}

// Q6_K x16 groups likewise, as q6_k_x16_rows computes them.
template <class Tiles>
__attribute__((target("avx512vbmi"))) void q6_k_x16_tiles(const uint8_t* groups, int64_t group_bytes, int64_t count,
                                                          const Acts& a, int64_t m0, int64_t rows, float* out,
                                                          int64_t ldo) {
  alignas(64) float acc[kTileGroups][kTileRowsPerCall][16];
  start_rows(acc, count, rows, a, out, ldo);
  const auto add = [&](int64_t g, const uint8_t* block, int64_t b, const int32_t(&c)[4][16][16], int64_t first,
                       int64_t r0, int64_t r1) {
    const __m512 d = _mm512_cvtph_ps(load(block));
    const int64_t nb = a.nb;
    const float* scales = a.d + (m0 + first + r0) * nb + b;
    float* sums_of_rows = acc[g][first + r0];
    scaled_sums(c, r0, r1, [&](__m512i isum, int64_t i) {
      const __m512 scaled = _mm512_mul_ps(d, _mm512_set1_ps(scales[i * nb]));
      float* row = sums_of_rows + 16 * i;
      _mm512_store_ps(row, _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scaled, _mm512_load_ps(row)));
    });
  };
  super_blocks<Tiles, true, kQ6KX16Bytes>(groups, group_bytes, count, a, m0, rows, q6_k_scaled, add);
  store_rows(acc, count, rows, out, ldo);
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

TileDotFn tile_dot(int64_t qtype) {
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
