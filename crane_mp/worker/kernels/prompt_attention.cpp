// A prompt's causal attention with AVX512-BF16 dot products (vdpbf16ps), for CPUs that have them but no AMX
// (Zen 4 and 5, Cooper Lake). There torch's float32 flash attention runs near the float FMA's peak and its
// bf16 one no faster, while vdpbf16ps does two products for each of an FMA's one: a 2,000-token prompt of
// an 8B spent a seventh of its prefill in attention.
//
//   prompt_attention_available() -> bool             compiled for AVX512-BF16
//   prompt_attention_bf16(q [T, H, D], k [S, KH, D], v [S, KH, D], scale, offset) -> [T, H, D] in q's dtype:
//       query t (at position offset + t) attends keys 0 .. offset + t; H a multiple of KH, D of 32;
//       float32 or bf16 inputs.
//
// Queries, keys, values and the softmax weights are rounded to bf16 (as torch's bf16 attention does);
// logits, the softmax and every sum are float32. Each task takes 32 queries of one head over blocks of 64
// keys (flash attention's running maximum and sum): the logits of a block, its weights and the 32 output
// rows stay in L1. Keys and values are packed once per KV head, pairs of dimensions (keys) interleaved so
// that one 64-byte load gives 16 keys (dimensions) and a broadcast pair of the other operand goes with it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_vec.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

bool prompt_attention_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)

constexpr int64_t kQueries = 32;  // queries a task takes
constexpr int64_t kKeys = 64;     // keys a block
constexpr int64_t kRows = 4;      // query rows a micro-kernel call
constexpr float kMasked = -1e30f;  // finite: -ffast-math assumes no infinities

using Bf16 = at::BFloat16;

// Keys [S, D] of one head -> [S' / 16][D / 2][16][2] (S' = S rounded up to kKeys, zeros past S).
void pack_keys(const Bf16* k, int64_t stride, int64_t S, int64_t D, Bf16* out) {
  const int64_t padded = (S + kKeys - 1) / kKeys * kKeys;
  for (int64_t s = 0; s < padded; ++s)
    for (int64_t d = 0; d < D; ++d)
      out[((s / 16) * (D / 2) + d / 2) * 32 + (s % 16) * 2 + d % 2] = s < S ? k[s * stride + d] : Bf16(0.0f);
}

// Values [S, D] of one head -> [D / 16][S' / 2][16][2].
void pack_values(const Bf16* v, int64_t stride, int64_t S, int64_t D, Bf16* out) {
  const int64_t padded = (S + kKeys - 1) / kKeys * kKeys;
  for (int64_t s = 0; s < padded; ++s)
    for (int64_t d = 0; d < D; ++d)
      out[((d / 16) * (padded / 2) + s / 2) * 32 + (d % 16) * 2 + s % 2] = s < S ? v[s * stride + d] : Bf16(0.0f);
}

// logits[r][c] = scale * q_r . key (k0 + c) for rows q .. q + kRows - 1 (q_stride apart), 64 keys.
void block_logits(const Bf16* q, int64_t q_stride, const Bf16* keys, int64_t D, int64_t k0, float scale,
                  float* logits) {
  __m512 acc[kRows][4];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const Bf16* panel = keys + (k0 / 16) * (D / 2) * 32;
  for (int64_t p = 0; p < D / 2; ++p) {
    __m512bh w[4];
    for (int j = 0; j < 4; ++j) w[j] = (__m512bh)_mm512_loadu_si512(panel + (j * (D / 2) + p) * 32);
    for (int r = 0; r < kRows; ++r) {
      int32_t pair;
      std::memcpy(&pair, q + r * q_stride + 2 * p, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, w[j]);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(logits + r * kKeys + 16 * j, _mm512_mul_ps(acc[r][j], s));
}

// out[r][d0 .. d0 + 63] += weights[r] . values (k0 .. k0 + 63, same dimensions), kRows rows.
void block_values(const Bf16* weights, const Bf16* values, int64_t padded, int64_t k0, int64_t d0, float* out,
                  int64_t D) {
  __m512 acc[kRows][4];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_loadu_ps(out + r * D + d0 + 16 * j);
  for (int64_t p = 0; p < kKeys / 2; ++p) {
    __m512bh w[4];
    for (int j = 0; j < 4; ++j)
      w[j] = (__m512bh)_mm512_loadu_si512(values + ((d0 / 16 + j) * (padded / 2) + k0 / 2 + p) * 32);
    for (int r = 0; r < kRows; ++r) {
      int32_t pair;
      std::memcpy(&pair, weights + r * kKeys + 2 * p, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, w[j]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + r * D + d0 + 16 * j, acc[r][j]);
}

// Queries t0 .. t0 + rows - 1 of one head (q rows `q_stride` apart, bf16) into out (float32, D apart).
void attend_block(const Bf16* q, int64_t q_stride, int64_t t0, int64_t rows, int64_t offset, const Bf16* keys,
                  const Bf16* values, int64_t S, int64_t D, float scale, float* out) {
  const int64_t padded = (S + kKeys - 1) / kKeys * kKeys;
  alignas(64) float logits[kQueries * kKeys];
  alignas(64) Bf16 weights[kQueries * kKeys];
  float maximum[kQueries], total[kQueries];
  // Rows past `rows` repeat the last query (the micro-kernels take kRows at a time) and are not written.
  std::vector<Bf16> padded_q;
  const Bf16* qs = q + t0 * q_stride;
  int64_t stride = q_stride;
  if (rows % kRows != 0) {
    padded_q.resize(kQueries * D);
    for (int64_t r = 0; r < kQueries; ++r) std::memcpy(&padded_q[r * D], qs + std::min(r, rows - 1) * q_stride, D * 2);
    qs = padded_q.data();
    stride = D;
  }
  const int64_t row_groups = (rows + kRows - 1) / kRows * kRows;
  std::fill(maximum, maximum + kQueries, kMasked);
  std::fill(total, total + kQueries, 0.0f);
  std::fill(out, out + row_groups * D, 0.0f);
  const int64_t end = std::min(S, offset + t0 + rows);  // keys the last row sees
  for (int64_t k0 = 0; k0 < end; k0 += kKeys) {
    for (int64_t r = 0; r < row_groups; r += kRows)
      block_logits(qs + r * stride, stride, keys, D, k0, scale, logits + r * kKeys);
    for (int64_t r = 0; r < row_groups; ++r) {
      float* row = logits + r * kKeys;
      const int64_t seen = std::min(offset + t0 + std::min(r, rows - 1) + 1, S) - k0;  // keys of this row here
      for (int64_t c = std::max<int64_t>(seen, 0); c < kKeys; ++c) row[c] = kMasked;
      float block_max = kMasked;
      for (int64_t c = 0; c < kKeys; ++c) block_max = std::max(block_max, row[c]);
      const float next = std::max(maximum[r], block_max);
      const float rescale = std::exp(maximum[r] - next);
      maximum[r] = next;
      for (int64_t c = 0; c < kKeys; ++c) row[c] = std::exp(row[c] - next);
      crane_mp::narrow(row, weights + r * kKeys, kKeys);
      float sum = 0.0f;  // of the weights as the values meet them
      for (int64_t c = 0; c < kKeys; ++c) sum += static_cast<float>(weights[r * kKeys + c]);
      total[r] = total[r] * rescale + sum;
      if (rescale != 1.0f)
        for (int64_t d = 0; d < D; ++d) out[r * D + d] *= rescale;
    }
    for (int64_t r = 0; r < row_groups; r += kRows)
      for (int64_t d0 = 0; d0 < D; d0 += 64)
        block_values(weights + r * kKeys, values, padded, k0, d0, out + r * D, D);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; ++d) out[r * D + d] /= total[r];
}

at::Tensor prompt_attention_bf16(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, double scale,
                                 int64_t offset) {
  TORCH_CHECK(q_in.dim() == 3 && k_in.dim() == 3 && v_in.dim() == 3 && k_in.sizes() == v_in.sizes(),
              "prompt_attention_bf16: q [T, H, D], k and v [S, KH, D]");
  const int64_t T = q_in.size(0), H = q_in.size(1), D = q_in.size(2), S = k_in.size(0), KH = k_in.size(1);
  TORCH_CHECK(k_in.size(2) == D && D % 64 == 0 && KH > 0 && H % KH == 0, "prompt_attention_bf16: head size ", D,
              " (a multiple of 64), ", H, " query heads over ", KH, " KV heads");
  TORCH_CHECK(offset >= 0 && offset + T <= S, "prompt_attention_bf16: queries at ", offset, " .. ", offset + T,
              " over ", S, " keys");
  const at::Tensor q = q_in.to(at::kBFloat16).contiguous(), k = k_in.to(at::kBFloat16).contiguous();
  const at::Tensor v = v_in.to(at::kBFloat16).contiguous();
  at::Tensor out = at::empty({T, H, D}, q_in.options().dtype(at::kFloat));
  if (T == 0) return out.to(q_in.scalar_type());
  const int64_t padded = (S + kKeys - 1) / kKeys * kKeys;
  std::vector<Bf16> keys(KH * padded * D), values(KH * padded * D);
  at::parallel_for(0, 2 * KH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i / 2;
      if (i % 2 == 0)
        pack_keys(k.data_ptr<Bf16>() + g * D, KH * D, S, D, keys.data() + g * padded * D);
      else
        pack_values(v.data_ptr<Bf16>() + g * D, KH * D, S, D, values.data() + g * padded * D);
    }
  });
  const int64_t blocks = (T + kQueries - 1) / kQueries, group = H / KH;
  // Heads outermost: each thread's share of tasks has every query block's mix of short and long ones.
  at::parallel_for(0, H * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rows(kQueries * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks, t0 = (task % blocks) * kQueries, n = std::min(kQueries, T - t0);
      const int64_t g = h / group;
      attend_block(q.data_ptr<Bf16>() + h * D, H * D, t0, n, offset, keys.data() + g * padded * D,
                   values.data() + g * padded * D, S, D, static_cast<float>(scale), rows.data());
      float* dst = out.data_ptr<float>() + (t0 * H + h) * D;
      for (int64_t r = 0; r < n; ++r) std::memcpy(dst + r * H * D, &rows[r * D], D * sizeof(float));
    }
  });
  return out.scalar_type() == q_in.scalar_type() ? out : out.to(q_in.scalar_type());
}

#else

at::Tensor prompt_attention_bf16(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t) {
  TORCH_CHECK(false, "prompt_attention_bf16: this kernel tier has no AVX512-BF16");
}

#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(crane_mp, m) {
  m.def("prompt_attention_available() -> bool", &prompt_attention_available);
  m.def("prompt_attention_bf16(Tensor q, Tensor k, Tensor v, float scale, int offset) -> Tensor",
        &prompt_attention_bf16);
}
