// float32 linear layers whose weights are kept as bf16 and widened in registers, for CPUs without bf16
// math (AVX2, and AVX-512 without BF16): a bf16 checkpoint there computes in float32, and a float32
// copy of its weights takes twice the memory and twice the bytes a decode step reads. bf16 -> float32
// is exact (the upper half of the float's bits), so the products and sums are the float32 layer's up
// to summation order.
//
//   widened_pack_weight(weight [N, K] bf16) -> packed   pairs of k interleaved in blocks of 8 outputs
//   widened_linear(x [R, K] float32, packed, bias?) -> [R, N] float32
//   widened_embedding(ids [T], packed) -> [T, K] float32 = weight[ids], read back out of the packed
//                                         layout, so an LM head tied to the embedding needs no copy
//
// The packed layout is [N / 8][K / 2][8][2]: one 32-byte load holds two k of 8 outputs; a shift
// (even k) and a mask (odd k) make them two float32 vectors, each multiplied against one broadcast
// activation. Calls of up to kRows rows read each weight byte once; up to kGemmRows rows walk K in
// panels whose weights stay in L2 while every row tile passes over them, accumulating in the float32
// output; longer calls (prompts, large batches) widen a panel of weights once for all their rows (gemm).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <vector>

#include "packed_rows.h"

namespace {

constexpr int64_t kRows = 4;  // activation rows per micro-kernel call
// Most k pairs per panel of a call of kRows to kGemmRows rows: a micro-kernel call's weights (16
// outputs over 4096 pairs, 256 KiB) stay in a 512 KiB L2 while every row tile passes over them.
constexpr int64_t kPanelPairs = 4096;

// Outputs [n, n + 8 * B) of R activation rows over k pairs [kp0, kp1), added to `out` unless `first`;
// the `last` panel adds the bias.
template <int R, int B>
void micro_kernel(const float* x, int64_t K, const at::BFloat16* packed, int64_t n, int64_t kp0, int64_t kp1,
                  float* out, int64_t N, const float* bias, bool first, bool last) {
  const int64_t pairs = K / 2;
  __m256 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j)
      acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + r * N + n + 8 * j);
  const auto* panel = packed + (n / 8) * pairs * 16;
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    __m256 even[B], odd[B];
    for (int j = 0; j < B; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + (j * pairs + kp) * 16));
      even[j] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
      odd[j] = _mm256_castsi256_ps(_mm256_and_si256(w, high));
    }
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * K + 2 * kp);
      const __m256 b = _mm256_broadcast_ss(x + r * K + 2 * kp + 1);
      for (int j = 0; j < B; ++j) acc[r][j] = _mm256_fmadd_ps(b, odd[j], _mm256_fmadd_ps(a, even[j], acc[r][j]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j) {
      __m256 v = acc[r][j];
      if (last && bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n + 8 * j));
      _mm256_storeu_ps(out + r * N + n + 8 * j, v);
    }
}

// Few rows take four blocks (32 outputs) a call, more rows two (16 outputs): their accumulators and
// widened weights fit the 16 vector registers.
template <int R>
void micro_blocks(int64_t blocks, const float* x, int64_t K, const at::BFloat16* packed, int64_t n, int64_t kp0,
                  int64_t kp1, float* out, int64_t N, const float* bias, bool first, bool last) {
  constexpr int64_t kMost = R <= 2 ? 4 : 2;
  for (int64_t done = 0; done < blocks; done += kMost) {
    const int64_t take = std::min(kMost, blocks - done), at = n + 8 * done;
    if (take == kMost) {
      micro_kernel<R, kMost>(x, K, packed, at, kp0, kp1, out, N, bias, first, last);
    } else if (take == 1) {
      micro_kernel<R, 1>(x, K, packed, at, kp0, kp1, out, N, bias, first, last);
    } else if constexpr (kMost == 4) {
      if (take == 2) micro_kernel<R, 2>(x, K, packed, at, kp0, kp1, out, N, bias, first, last);
      else micro_kernel<R, 3>(x, K, packed, at, kp0, kp1, out, N, bias, first, last);
    }
  }
}

void micro_call(int64_t rows, int64_t blocks, const float* x, int64_t K, const at::BFloat16* packed, int64_t n,
                int64_t kp0, int64_t kp1, float* out, int64_t N, const float* bias, bool first, bool last) {
  switch (rows) {
    case 1: micro_blocks<1>(blocks, x, K, packed, n, kp0, kp1, out, N, bias, first, last); break;
    case 2: micro_blocks<2>(blocks, x, K, packed, n, kp0, kp1, out, N, bias, first, last); break;
    case 3: micro_blocks<3>(blocks, x, K, packed, n, kp0, kp1, out, N, bias, first, last); break;
    default: micro_blocks<4>(blocks, x, K, packed, n, kp0, kp1, out, N, bias, first, last); break;
  }
}

// Calls of kGemmRows rows or more (below, the kernel above is faster: 1.1-1.5x at 8-24 rows on Zen 3,
// 0.75-0.9x from 32): a task widens the weights of 16 outputs over kGemmPairs pairs of K into float32
// once (64 KiB: they stay in L2) and every tile of kTileRows rows multiplies them there, with 12
// accumulators, two weight loads and six broadcasts per k and no conversions in the loop.
constexpr int64_t kGemmRows = 32;
constexpr int64_t kTileRows = 6;
constexpr int64_t kGemmPairs = 512;

// Rows [0, R) of x times widened weights w [k1 - k0][8 * B] (k from k0), into outputs [n, n + 8 * B).
template <int R, int B>
void gemm_tile(const float* x, int64_t K, const float* w, int64_t k0, int64_t k1, float* out, int64_t N, int64_t n,
               const float* bias, bool first, bool last) {
  __m256 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j)
      acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + r * N + n + 8 * j);
  for (int64_t k = k0; k < k1; ++k, w += 8 * B) {
    __m256 wk[B];
    for (int j = 0; j < B; ++j) wk[j] = _mm256_loadu_ps(w + 8 * j);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * K + k);
      for (int j = 0; j < B; ++j) acc[r][j] = _mm256_fmadd_ps(a, wk[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j) {
      __m256 v = acc[r][j];
      if (last && bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n + 8 * j));
      _mm256_storeu_ps(out + r * N + n + 8 * j, v);
    }
}

template <int B>
void gemm_rows(int64_t rows, const float* x, int64_t K, const float* w, int64_t k0, int64_t k1, float* out, int64_t N,
               int64_t n, const float* bias, bool first, bool last) {
  switch (rows) {
    case 1: gemm_tile<1, B>(x, K, w, k0, k1, out, N, n, bias, first, last); break;
    case 2: gemm_tile<2, B>(x, K, w, k0, k1, out, N, n, bias, first, last); break;
    case 3: gemm_tile<3, B>(x, K, w, k0, k1, out, N, n, bias, first, last); break;
    case 4: gemm_tile<4, B>(x, K, w, k0, k1, out, N, n, bias, first, last); break;
    case 5: gemm_tile<5, B>(x, K, w, k0, k1, out, N, n, bias, first, last); break;
    default: gemm_tile<6, B>(x, K, w, k0, k1, out, N, n, bias, first, last); break;
  }
}

// Pairs [kp0, kp1) of B packed blocks (from `block`) widened to float32, [2 * (kp1 - kp0)][8 * B].
void widen_panel(const at::BFloat16* packed, int64_t pairs, int64_t block, int B, int64_t kp0, int64_t kp1, float* to) {
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int j = 0; j < B; ++j) {
    const auto* from = packed + ((block + j) * pairs + kp0) * 16;
    float* dst = to + 8 * j;
    for (int64_t kp = kp0; kp < kp1; ++kp, from += 16, dst += 16 * B) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from));
      _mm256_storeu_ps(dst, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
      _mm256_storeu_ps(dst + 8 * B, _mm256_castsi256_ps(_mm256_and_si256(w, high)));
    }
  }
}

void gemm(const float* x, int64_t R, int64_t K, const at::BFloat16* packed, int64_t N, float* out, const float* bias) {
  const int64_t pairs = K / 2, blocks = N / 8;
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(2 * kGemmPairs * 16);
    for (int64_t group = begin; group < end; ++group) {
      const int64_t block = 2 * group;
      const int B = blocks - block >= 2 ? 2 : 1;
      for (int64_t kp0 = 0; kp0 < pairs; kp0 += kGemmPairs) {
        const int64_t kp1 = std::min(pairs, kp0 + kGemmPairs);
        widen_panel(packed, pairs, block, B, kp0, kp1, panel.data());
        for (int64_t r0 = 0; r0 < R; r0 += kTileRows) {
          const int64_t rows = std::min(kTileRows, R - r0);
          if (B == 2)
            gemm_rows<2>(rows, x + r0 * K, K, panel.data(), 2 * kp0, 2 * kp1, out + r0 * N, N, 8 * block, bias,
                         kp0 == 0, kp1 == pairs);
          else
            gemm_rows<1>(rows, x + r0 * K, K, panel.data(), 2 * kp0, 2 * kp1, out + r0 * N, N, 8 * block, bias,
                         kp0 == 0, kp1 == pairs);
        }
      }
    }
  });
}


void check_packed(const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kBFloat16 && packed.size(0) % 8 == 0 &&
                  packed.size(1) % 2 == 0 && packed.is_contiguous(),
              "a weight from widened_pack_weight");
}

at::Tensor widened_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight [N, K] bf16");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % 8 == 0 && K % 2 == 0, "widened_pack_weight: N a multiple of 8, K even");
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({N, K}, w.options());
  // A pair of bf16 moves as one 32-bit word: each block of 8 rows is a [8][pairs] -> [pairs][8] transpose.
  const auto* src = reinterpret_cast<const int32_t*>(w.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<int32_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t pairs = K / 2;
  at::parallel_for(0, N / 8, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int32_t* from = src + block * 8 * pairs;
      int32_t* to = dst + block * 8 * pairs;
      for (int64_t kp = 0; kp < pairs; ++kp)
        for (int64_t i = 0; i < 8; ++i) to[kp * 8 + i] = from[i * pairs + kp];
    }
  });
  return packed;
}

at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  check_packed(packed);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == packed.size(1), "x [R, K] float32");
  const at::Tensor xc = x.contiguous();
  const int64_t R = xc.size(0), K = xc.size(1), N = packed.size(0), pairs = K / 2;
  at::Tensor out = at::empty({R, N}, xc.options());
  at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  if (R == 0) return out;
  if (R >= kGemmRows) {
    gemm(xc.data_ptr<float>(), R, K, packed.data_ptr<at::BFloat16>(), N, out.data_ptr<float>(),
         bias_f.defined() ? bias_f.data_ptr<float>() : nullptr);
    return out;
  }
  // Decode-sized calls take the whole K in one pass; larger ones equal panels of at most kPanelPairs.
  const int64_t panels = R <= kRows ? 1 : (pairs + kPanelPairs - 1) / kPanelPairs;
  const int64_t step = (pairs + panels - 1) / panels;
  const float* xp = xc.data_ptr<float>();
  const auto* wp = packed.data_ptr<at::BFloat16>();
  float* op = out.data_ptr<float>();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  constexpr int64_t kGroup = 4;  // blocks of 8 outputs a task takes: 32 outputs
  const int64_t blocks = N / 8;
  at::parallel_for(0, (blocks + kGroup - 1) / kGroup, 1, [&](int64_t begin, int64_t end) {
    for (int64_t kp0 = 0; kp0 < pairs; kp0 += step) {
      const int64_t kp1 = std::min(pairs, kp0 + step);
      for (int64_t group = begin; group < end; ++group)
        for (int64_t r0 = 0; r0 < R; r0 += kRows)
          micro_call(std::min(kRows, R - r0), std::min(kGroup, blocks - group * kGroup), xp + r0 * K, K, wp,
                     group * kGroup * 8, kp0, kp1, op + r0 * N, N, bp, kp0 == 0, kp1 == pairs);
    }
  });
  return out;
}

at::Tensor widened_embedding(const at::Tensor& ids, const at::Tensor& packed) {
  check_packed(packed);
  const int64_t N = packed.size(0), K = packed.size(1), pairs = K / 2;
  auto [flat, out] = crane_mp::packed_row_lookup(ids, N, K, packed.options().dtype(at::kFloat));
  const int64_t T = flat.numel();
  const int64_t* idp = flat.data_ptr<int64_t>();
  // A row's values sit in pairs (32 bits), one per k pair of its block, 32 bytes apart.
  const auto* src = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr<float>());
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint32_t* block = src + (idp[t] / 8) * pairs * 8 + idp[t] % 8;
      uint32_t* row = dst + t * K;
      for (int64_t kp = 0; kp < pairs; ++kp) {
        const uint32_t word = block[kp * 8];
        row[2 * kp] = word << 16;
        row[2 * kp + 1] = word & 0xFFFF0000u;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(crane_mp, m) {
  m.def("widened_pack_weight(Tensor weight) -> Tensor", &widened_pack_weight);
  m.def("widened_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &widened_linear);
  m.def("widened_embedding(Tensor ids, Tensor packed) -> Tensor", &widened_embedding);
}
