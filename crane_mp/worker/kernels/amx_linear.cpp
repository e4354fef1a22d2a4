// bfloat16 linear layers on Intel AMX tiles (CPU), for weights packed once at load time.
//
// oneDNN reaches ~20% of the tile units' peak on decode-sized GEMMs (32 rows) here; this kernel,
// with the weight laid out tile by tile in the order it is read and prefetched ahead, runs the
// model's decode GEMMs about 2x faster (benchmarks/RESULTS.md).
//
//   amx_available() -> bool                 compiled with AMX and the kernel granted tile state
//   amx_pack_weight(w [N, K]) -> packed     [N/16, K/32, 16, 32]: tile (nb, kb) row r holds, for
//                                           each column j of the block, the pair w[nb*16+j][kb*32+2r+{0,1}]
//   amx_linear(x [M, K], packed, bias?) -> [M, N] = x @ w.T + bias   (float accumulation, one rounding)
//   amx_linear_silu_mul(x, packed, bias?) -> [M, N/2] = silu(gate) * up, for a gate/up weight packed
//                                           with its halves interleaved in 16-row blocks (no [M, N] temporary)
//   amx_embedding(ids [T], packed) -> [T, K] = w[ids]   rows read back out of the packed layout, so an
//                                           LM head tied to the embedding needs no second copy
//
// N and K must be multiples of 32 (the caller falls back to oneDNN otherwise).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_vec.h"
#include "packed_rows.h"
#include "tile_state.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define CRANE_MP_HAVE_AMX 1
#include <immintrin.h>
#endif

namespace {

bool amx_available() {
#if defined(CRANE_MP_HAVE_AMX)
  return crane_mp::tile_state_granted();
#else
  return false;
#endif
}

at::Tensor amx_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "amx_pack_weight wants a 2-D bf16 weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % 32 == 0 && K % 32 == 0, "AMX packing needs N and K to be multiples of 32");
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty({N / 16, K / 32, 16, 32}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t KB = K / 32;
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t kb = 0; kb < KB; ++kb) {
        uint16_t* tile = dst + (nb * KB + kb) * 512;
        for (int64_t r = 0; r < 16; ++r)
          for (int64_t j = 0; j < 16; ++j) {
            const uint16_t* pair = src + (nb * 16 + j) * K + kb * 32 + 2 * r;
            tile[r * 32 + 2 * j] = pair[0];
            tile[r * 32 + 2 * j + 1] = pair[1];
          }
      }
  });
  return out;
}

#if defined(CRANE_MP_HAVE_AMX)
using crane_mp::TileConfig;

constexpr int64_t kRowBlock = 32;                 // rows per pass: two 16-row A tiles
constexpr int64_t kWeightGroupBytes = 512 * 1024;  // weight tiles kept in L2 while the row blocks sweep them
constexpr int64_t kPrefetch = 4;                  // weight tiles fetched ahead of use

// Tiles: C 0-3 (2 row blocks x 2 column blocks), A 4-5, B 6-7. A row block of x has up to 32 rows:
// `rows0` in the first A tile, `rows1` (0 = unused) in the second; tiles read only those rows, so a
// partial block needs no padded copy and a single row costs half the tile products.
void configure_tiles(int rows0, int rows1) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows[t]);
    cfg.colsb[t] = rows[t] > 0 ? 64 : 0;
  }
  crane_mp::load_tile_config(cfg);
}

// Rows [begin, end) of a row block's output for column pair p from the C tiles stored in `c`.
// kSiluMul: the weight's column pairs are (gate block, up block) of the same 16 intermediate
// columns (see amx_linear_silu_mul), and the output is silu(gate) * up, N / 2 columns wide.
template <bool kSiluMul>
inline void write_rows(float (*c)[16][16], int64_t begin, int64_t end, int64_t p, const float* bias,
                       c10::BFloat16* out, int64_t out_width) {
  for (int64_t m = begin; m < end; ++m) {
    const int64_t blk = (m / 16) * 2;
    c10::BFloat16* out_row = out + m * out_width;
    if constexpr (kSiluMul) {
      float* gate = &c[blk][m % 16][0];
      float* up = &c[blk + 1][m % 16][0];
      if (bias != nullptr) {
        _mm512_store_ps(gate, _mm512_add_ps(_mm512_load_ps(gate), _mm512_loadu_ps(bias + p * 32)));
        _mm512_store_ps(up, _mm512_add_ps(_mm512_load_ps(up), _mm512_loadu_ps(bias + p * 32 + 16)));
      }
#pragma omp simd aligned(gate, up : 64)
      for (int j = 0; j < 16; ++j) gate[j] = gate[j] / (1.f + std::exp(-gate[j])) * up[j];
      const __m256bh packed16 = _mm512_cvtneps_pbh(_mm512_load_ps(gate));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_row + p * 16), reinterpret_cast<const __m256i&>(packed16));
    } else {
      for (int64_t cb = 0; cb < 2; ++cb) {
        __m512 v = _mm512_load_ps(&c[blk + cb][m % 16][0]);
        if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + p * 32 + cb * 16));
        const __m256bh packed16 = _mm512_cvtneps_pbh(v);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_row + p * 32 + cb * 16),
                            reinterpret_cast<const __m256i&>(packed16));
      }
    }
  }
}

// A block's output written while the tile unit computes the next block's: the vector work of the
// epilogue (SiLU's exponentials above all) runs beside the tile products instead of after them.
template <bool kSiluMul>
struct PendingBlock {
  float (*c)[16][16] = nullptr;  // the stored C tiles; nullptr: nothing pending
  int64_t rows = 0, p = 0, done = 0;
  const float* bias = nullptr;
  c10::BFloat16* out = nullptr;
  int64_t out_width = 0;

  // Rows of the pending block up to `fraction_num / fraction_den` of it.
  inline void write_until(int64_t fraction_num, int64_t fraction_den) {
    if (c == nullptr) return;
    const int64_t until = rows * fraction_num / fraction_den;
    if (until > done) write_rows<kSiluMul>(c, done, until, p, bias, out, out_width);
    done = std::max(done, until);
  }
  inline void finish() {
    write_until(1, 1);
    c = nullptr;
  }
};

// One row block (16 rows per A tile, `kTwoTiles` for up to 32) times two 16-column weight blocks into
// `c`, writing `pending` a share of its rows after each K step. `prefetch` on the first pass over the
// weight blocks; later passes find them in cache.
template <bool prefetch, bool kTwoTiles, bool kSiluMul>
inline void block_product(const char* a, int64_t lda, const char* b0, const char* b1, int64_t KB, float (*c)[16][16],
                          PendingBlock<kSiluMul>& pending) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kTwoTiles) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < KB; ++kb) {
    if constexpr (prefetch) {
      const char* ahead0 = b0 + (kb + kPrefetch) * 1024;
      const char* ahead1 = b1 + (kb + kPrefetch) * 1024;
      for (int line = 0; line < 16; ++line) {
        _mm_prefetch(ahead0 + line * 64, _MM_HINT_T0);
        _mm_prefetch(ahead1 + line * 64, _MM_HINT_T0);
      }
    }
    _tile_loadd(4, a + kb * 64, lda);
    _tile_loadd(6, b0 + kb * 1024, 64);
    _tile_loadd(7, b1 + kb * 1024, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwoTiles) {
      _tile_loadd(5, a + 16 * lda + kb * 64, lda);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    pending.write_until(kb + 1, KB);
  }
  pending.finish();
  _tile_stored(0, &c[0][0][0], 64);
  _tile_stored(1, &c[1][0][0], 64);
  if constexpr (kTwoTiles) {
    _tile_stored(2, &c[2][0][0], 64);
    _tile_stored(3, &c[3][0][0], 64);
  }
  // The stored tiles are read by vector loads later (the next block's K steps): keep those after it.
  __asm__ volatile("" ::: "memory");
}

template <bool kSiluMul>
void amx_gemm(const c10::BFloat16* x, int64_t M, int64_t K, const c10::BFloat16* packed, int64_t N,
              const float* bias, c10::BFloat16* out) {
  const int64_t out_width = kSiluMul ? N / 2 : N;
  const int64_t KB = K / 32, pairs = N / 32, lda = K * 2;
  const int64_t full_rows = M / kRowBlock * kRowBlock, tail_rows = M - full_rows;
  const char* bp = reinterpret_cast<const char*>(packed);
  // Each thread owns a range of column pairs and walks it in groups whose weight tiles stay in L2,
  // sweeping every row block over a group: the row block of x stays in L1, and the weight streams
  // from memory once per group (the only pass when M <= 32, i.e. decode). Full 32-row blocks first,
  // then the partial block under its own tile shapes. Two C buffers: one block's output is written
  // during the next block's products.
  const int64_t group = std::max<int64_t>(1, kWeightGroupBytes / (KB * 2048));
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float c[2][4][16][16];  // [buffer][row tile * 2 + column block][row][column]
    int64_t next = 0;
    PendingBlock<kSiluMul> pending;
    auto defer = [&](int64_t rows, int64_t p, c10::BFloat16* block_out) {
      pending.c = c[next];
      pending.rows = rows, pending.p = p, pending.done = 0;
      pending.bias = bias, pending.out = block_out, pending.out_width = out_width;
      next ^= 1;
    };
    for (int64_t g0 = begin; g0 < end; g0 += group) {
      const int64_t g1 = std::min(end, g0 + group);
      if (full_rows > 0) configure_tiles(16, 16);
      for (int64_t row = 0; row < full_rows; row += kRowBlock) {
        const char* a = reinterpret_cast<const char*>(x + row * K);
        for (int64_t p = g0; p < g1; ++p) {
          const char* b0 = bp + 2 * p * KB * 1024;
          if (row == 0)
            block_product<true, true>(a, lda, b0, b0 + KB * 1024, KB, c[next], pending);
          else
            block_product<false, true>(a, lda, b0, b0 + KB * 1024, KB, c[next], pending);
          defer(kRowBlock, p, out + row * out_width);
        }
      }
      if (tail_rows > 0) {
        // New tile shapes: the pending block's C tiles are already stored, its rows only to write.
        configure_tiles(std::min<int>(16, tail_rows), std::max<int>(0, tail_rows - 16));
        const char* a = reinterpret_cast<const char*>(x + full_rows * K);
        for (int64_t p = g0; p < g1; ++p) {
          const char* b0 = bp + 2 * p * KB * 1024;
          const char* b1 = b0 + KB * 1024;
          float (*cn)[16][16] = c[next];
          if (full_rows == 0 && tail_rows <= 16)
            block_product<true, false>(a, lda, b0, b1, KB, cn, pending);
          else if (full_rows == 0)
            block_product<true, true>(a, lda, b0, b1, KB, cn, pending);
          else if (tail_rows <= 16)
            block_product<false, false>(a, lda, b0, b1, KB, cn, pending);
          else
            block_product<false, true>(a, lda, b0, b1, KB, cn, pending);
          defer(tail_rows, p, out + full_rows * out_width);
        }
      }
    }
    pending.finish();
    _tile_release();
  });
}
#endif

template <bool kSiluMul>
at::Tensor amx_linear_impl(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_available(), "AMX is not available on this CPU or build");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "amx_linear is bf16 only");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 32, "weight not packed by amx_pack_weight");
  const int64_t K = x.size(-1), N = packed.size(0) * 16;
  TORCH_CHECK(packed.size(1) * 32 == K, "input width ", K, " does not match the packed weight");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = kSiluMul ? N / 2 : N;
  at::Tensor out = at::empty(out_shape, x.options());
  if (M == 0) return out;
  std::vector<float> bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == at::kBFloat16 && bias->is_contiguous(), "bias");
    bias_f.resize(N);
    crane_mp::widen(bias->data_ptr<c10::BFloat16>(), bias_f.data(), N);
  }
#if defined(CRANE_MP_HAVE_AMX)
  amx_gemm<kSiluMul>(x2.data_ptr<c10::BFloat16>(), M, K, packed.data_ptr<c10::BFloat16>(), N,
                     bias_f.empty() ? nullptr : bias_f.data(), out.data_ptr<c10::BFloat16>());
#endif
  return out;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  return amx_linear_impl<false>(x, packed, bias);
}

// The weight (and bias) must have been packed with gate and up rows interleaved in blocks of 16:
// [gate 0-15, up 0-15, gate 16-31, up 16-31, ...] (cpu_packing.py does this).
at::Tensor amx_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  return amx_linear_impl<true>(x, packed, bias);
}

at::Tensor amx_embedding(const at::Tensor& ids, const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 32, "weight not packed by amx_pack_weight");
  const int64_t N = packed.size(0) * 16, KB = packed.size(1), K = KB * 32;
  auto [flat, out] = crane_mp::packed_row_lookup(ids, N, K, packed.options());
  const int64_t T = flat.numel();
  const int64_t* idp = flat.data_ptr<int64_t>();
  // A row's values sit in pairs (32 bits), one pair per tile row, 64 bytes apart.
  const uint32_t* src = reinterpret_cast<const uint32_t*>(packed.data_ptr());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, T, crane_mp::parallel_grain(K), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t nb = idp[t] / 16, j = idp[t] % 16;
      for (int64_t kb = 0; kb < KB; ++kb) {
        const uint32_t* tile = src + (nb * KB + kb) * 256;
        for (int64_t r = 0; r < 16; ++r) dst[t * (K / 2) + kb * 16 + r] = tile[r * 16 + j];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(crane_mp, m) {
  m.def("amx_available() -> bool", &amx_available);
  m.def("amx_pack_weight(Tensor weight) -> Tensor", &amx_pack_weight);
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &amx_linear);
  m.def("amx_linear_silu_mul(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &amx_linear_silu_mul);
  m.def("amx_embedding(Tensor ids, Tensor packed) -> Tensor", &amx_embedding);
}
