// bf16 linear layers with AVX512-BF16 dot products (vdpbf16ps), for CPUs that have them but no AMX
// (Zen 4 and 5, Cooper Lake): oneDNN streams a packed bf16 weight at about half the memory bus's rate
// at one row, and multiplies a plain one slower still.
//
//   bf16_linear_available() -> bool                  compiled for AVX512-BF16
//   bf16_pack_weight(weight [N, K]) -> packed        pairs of k interleaved in blocks of 16 outputs
//   bf16_packed_linear(x [R, K], packed, bias?) -> [R, N]
//   bf16_packed_embedding(ids [T], packed) -> [T, K] = weight[ids]: rows read back out of the packed
//                                                    layout, so an LM head tied to the embedding needs
//                                                    no second copy
//
// The packed layout is [N / 16][K / 2][16][2]: one 64-byte load holds two k of 16 outputs, the pair of
// an activation row broadcast against it accumulates 16 outputs in one register, no horizontal sums.
// The micro-kernel keeps 4 rows x 96 outputs in 24 registers (six loads of weights and four
// broadcasts per 24 dot products). Decode-sized calls (up to 4 rows) read each weight byte once, at
// the bus's rate (1.4-1.7x oneDNN's packed GEMV); larger calls walk K in blocks of at most 2560 so
// that the weights of 96 outputs stay in L2 for every row (0.99-1.2x oneDNN's GEMM at 16 to 256
// rows; benchmarks/RESULTS.md). Sums in float32, rounded once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "packed_rows.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 4;       // activation rows per micro-kernel call
constexpr int64_t kBlocks = 6;     // 16-output blocks per micro-kernel call: 96 outputs (fewer at the end)
// Most k pairs per block of a call with more than kRows rows: the weights of 96 outputs over 1280 pairs
// (480 KiB) stay in a Zen 4 core's 1 MiB L2 while every row tile passes over them.
constexpr int64_t kPanelPairs = 1280;

#if defined(__AVX512BF16__)

// Outputs [n, n + 16 * B) of R activation rows over k pairs [kp0, kp1). `sums` holds the running
// float sums of an earlier block (unless `first`); on the `last` block the bias is added and the
// rows are written as bf16 to `out` instead.
template <int R, int B>
void micro_kernel(const at::BFloat16* x, int64_t K, const at::BFloat16* packed, int64_t n, int64_t kp0,
                  int64_t kp1, float* sums, at::BFloat16* out, int64_t N, const float* bias, bool first, bool last) {
  const int64_t pairs = K / 2;
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j)
      acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + r * N + n + 16 * j);
  const auto* panel = packed + (n / 16) * pairs * 32;
  const auto* xi = reinterpret_cast<const int32_t*>(x);
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    __m512bh w[B];
    for (int j = 0; j < B; ++j)
      w[j] = (__m512bh)_mm512_loadu_si512(panel + (j * pairs + kp) * 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xi[r * pairs + kp]);
      for (int j = 0; j < B; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, w[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j) {
      if (!last) {
        _mm512_storeu_ps(sums + r * N + n + 16 * j, acc[r][j]);
        continue;
      }
      __m512 v = acc[r][j];
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n + 16 * j));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * N + n + 16 * j), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

template <int B>
void micro_rows(int64_t rows, const at::BFloat16* x, int64_t K, const at::BFloat16* packed, int64_t n, int64_t kp0,
                int64_t kp1, float* sums, at::BFloat16* out, int64_t N, const float* bias, bool first, bool last) {
  switch (rows) {
    case 1: micro_kernel<1, B>(x, K, packed, n, kp0, kp1, sums, out, N, bias, first, last); break;
    case 2: micro_kernel<2, B>(x, K, packed, n, kp0, kp1, sums, out, N, bias, first, last); break;
    case 3: micro_kernel<3, B>(x, K, packed, n, kp0, kp1, sums, out, N, bias, first, last); break;
    default: micro_kernel<4, B>(x, K, packed, n, kp0, kp1, sums, out, N, bias, first, last); break;
  }
}

void micro_call(int64_t rows, int64_t blocks, const at::BFloat16* x, int64_t K, const at::BFloat16* packed, int64_t n,
                int64_t kp0, int64_t kp1, float* sums, at::BFloat16* out, int64_t N, const float* bias, bool first,
                bool last) {
  switch (blocks) {
    case 1: micro_rows<1>(rows, x, K, packed, n, kp0, kp1, sums, out, N, bias, first, last); break;
    case 2: micro_rows<2>(rows, x, K, packed, n, kp0, kp1, sums, out, N, bias, first, last); break;
    case 3: micro_rows<3>(rows, x, K, packed, n, kp0, kp1, sums, out, N, bias, first, last); break;
    case 4: micro_rows<4>(rows, x, K, packed, n, kp0, kp1, sums, out, N, bias, first, last); break;
    case 5: micro_rows<5>(rows, x, K, packed, n, kp0, kp1, sums, out, N, bias, first, last); break;
    default: micro_rows<6>(rows, x, K, packed, n, kp0, kp1, sums, out, N, bias, first, last); break;
  }
}

#endif

bool bf16_linear_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

void check_bf16(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(bf16_linear_available(), "the bf16 kernels need a build for AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [R, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bf16 inputs only");
}

at::Tensor bf16_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight [N, K] bf16");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 2 == 0, "bf16_pack_weight: N a multiple of 16, K even");
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({N, K}, w.options());
  // A pair of bf16 moves as one 32-bit word: each block of 16 rows is a [16][pairs] -> [pairs][16] transpose.
  const auto* src = reinterpret_cast<const int32_t*>(w.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<int32_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t pairs = K / 2;
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int32_t* from = src + block * 16 * pairs;
      int32_t* to = dst + block * 16 * pairs;
      for (int64_t kp = 0; kp < pairs; ++kp)
        for (int64_t i = 0; i < 16; ++i) to[kp * 16 + i] = from[i * pairs + kp];
    }
  });
  return packed;
}

at::Tensor bf16_packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  check_bf16(x, packed);
  const at::Tensor xc = x.contiguous();
  const int64_t R = xc.size(0), K = xc.size(1), N = packed.size(0);
  TORCH_CHECK(N % 16 == 0 && K % 2 == 0, "bf16_packed_linear: a weight from bf16_pack_weight");
  at::Tensor out = at::empty({R, N}, xc.options());
  at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
#if defined(__AVX512BF16__)
  const int64_t pairs = K / 2;
  // Decode-sized calls take the whole K in one pass; larger ones equal blocks of at most kPanelPairs.
  const int64_t num_steps = R <= kRows ? 1 : (pairs + kPanelPairs - 1) / kPanelPairs;
  const int64_t step = (pairs + num_steps - 1) / num_steps;
  at::Tensor sums = step < pairs ? at::empty({R, N}, xc.options().dtype(at::kFloat)) : at::Tensor();
  const auto* xp = xc.data_ptr<at::BFloat16>();
  const auto* wp = packed.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  float* sp = sums.defined() ? sums.data_ptr<float>() : nullptr;
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const int64_t blocks = N / 16;
  at::parallel_for(0, (blocks + kBlocks - 1) / kBlocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t kp0 = 0; kp0 < pairs; kp0 += step) {
      const int64_t kp1 = std::min(pairs, kp0 + step);
      for (int64_t group = begin; group < end; ++group)
        for (int64_t r0 = 0; r0 < R; r0 += kRows)
          micro_call(std::min(kRows, R - r0), std::min(kBlocks, blocks - group * kBlocks), xp + r0 * K, K, wp,
                     group * kBlocks * 16, kp0, kp1, sp == nullptr ? nullptr : sp + r0 * N, op + r0 * N, N, bp,
                     kp0 == 0, kp1 == pairs);
    }
  });
#endif
  return out;
}

at::Tensor bf16_packed_embedding(const at::Tensor& ids, const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) % 16 == 0 && packed.size(1) % 2 == 0, "a bf16_pack_weight weight");
  const int64_t N = packed.size(0), K = packed.size(1), pairs = K / 2;
  auto [flat, out] = crane_mp::packed_row_lookup(ids, N, K, packed.options());
  const int64_t T = flat.numel();
  const int64_t* idp = flat.data_ptr<int64_t>();
  // A row's values sit in pairs (32 bits), one per k pair of its block, 64 bytes apart.
  const auto* src = reinterpret_cast<const int32_t*>(packed.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<int32_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, T, crane_mp::parallel_grain(K), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int32_t* block = src + (idp[t] / 16) * pairs * 16 + idp[t] % 16;
      for (int64_t kp = 0; kp < pairs; ++kp) dst[t * pairs + kp] = block[kp * 16];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(crane_mp, m) {
  m.def("bf16_linear_available() -> bool", &bf16_linear_available);
  m.def("bf16_pack_weight(Tensor weight) -> Tensor", &bf16_pack_weight);
  m.def("bf16_packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &bf16_packed_linear);
  m.def("bf16_packed_embedding(Tensor ids, Tensor packed) -> Tensor", &bf16_packed_embedding);
}
