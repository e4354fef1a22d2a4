// A few rows of bf16 activations times a plain (row-major, unpacked) bf16 weight, with AVX512-BF16
// dot products: bf16_gemv(x [R, K], weight [N, K]) -> [R, N] bf16, float32 sums.
//
//   bf16_gemv_available() -> bool   compiled for AVX512-BF16
//
// For an LM head tied to its embedding, which oneDNN cannot pack in place (the lookup reads the plain
// rows): at one to sixteen rows oneDNN multiplies a plain bf16 weight at well under the memory bus's
// rate, reordering it on every call; this reads each weight row once per four activation rows (the
// next four find it in cache) and runs at the bus's rate at one row. Four weight rows at a time, so
// that the activation chunk loaded from L1 serves four products and sixteen sums stay in registers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__)

// out[r, n + j] for r < R, j < W (W weight rows from row n); K a multiple of 32.
template <int R, int W>
void gemv_tile(const at::BFloat16* x, const at::BFloat16* w, float* out, int64_t n, int64_t K, int64_t N) {
  __m512 acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) acc[r][j] = _mm512_setzero_ps();
  const __m512i* rows[W];
  for (int j = 0; j < W; ++j) rows[j] = reinterpret_cast<const __m512i*>(w + (n + j) * K);
  for (int64_t k = 0; k < K / 32; ++k) {
    __m512bh b[W];
    for (int j = 0; j < W; ++j) b[j] = (__m512bh)_mm512_loadu_si512(rows[j] + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const __m512i*>(x + r * K) + k);
      for (int j = 0; j < W; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) out[r * N + n + j] = _mm512_reduce_add_ps(acc[r][j]);
}

template <int W>
void rows_tile(int64_t rows, const at::BFloat16* x, const at::BFloat16* w, float* out, int64_t n, int64_t K,
               int64_t N) {
  switch (rows) {
    case 1: gemv_tile<1, W>(x, w, out, n, K, N); break;
    case 2: gemv_tile<2, W>(x, w, out, n, K, N); break;
    case 3: gemv_tile<3, W>(x, w, out, n, K, N); break;
    default: gemv_tile<4, W>(x, w, out, n, K, N); break;
  }
}

#endif

bool bf16_gemv_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(bf16_gemv_available(), "bf16_gemv needs a build for AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "bf16_gemv: x [R, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bf16_gemv takes bf16");
  TORCH_CHECK(x.size(1) % 32 == 0, "bf16_gemv: K must be a multiple of 32");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t R = xc.size(0), K = xc.size(1), N = wc.size(0);
  at::Tensor sums = at::empty({R, N}, xc.options().dtype(at::kFloat));
#if defined(__AVX512BF16__)
  const auto* xp = xc.data_ptr<at::BFloat16>();
  const auto* wp = wc.data_ptr<at::BFloat16>();
  float* out = sums.data_ptr<float>();
  const int64_t blocks = N / 4;
  // 16 blocks of 4 rows (64 KiB of a 512-wide weight) at least per thread: fewer and the fork costs more.
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block)
      for (int64_t r0 = 0; r0 < R; r0 += 4)
        rows_tile<4>(std::min<int64_t>(4, R - r0), xp + r0 * K, wp, out + r0 * N, block * 4, K, N);
  });
  for (int64_t n = blocks * 4; n < N; ++n)
    for (int64_t r0 = 0; r0 < R; r0 += 4)
      rows_tile<1>(std::min<int64_t>(4, R - r0), xp + r0 * K, wp, out + r0 * N, n, K, N);
#endif
  return sums.to(at::kBFloat16);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(crane_mp, m) {
  m.def("bf16_gemv_available() -> bool", &bf16_gemv_available);
  m.def("bf16_gemv(Tensor x, Tensor weight) -> Tensor", &bf16_gemv);
}
