// Everything between the QKV projection and attention, in one pass per token (CPU):
// optional per-head q/k RMSNorm (before or after rope), rope on queries and keys, and the write of
// keys and values into the paged cache. Returns the queries; all math in float, one rounding per value.
//
//   qkv            [T, (H + 2 * KH) * D]   the projection's output (bias included)
//   cos, sin       [T, D]                  rope rows for each token's position; sin carries
//                                          rotate-half's sign on its first half (see rope.py)
//   qk_norm_weight [H + KH, D] or none     per-head norm weights, queries' rows then keys'
//   qk_norm_position                       0: no norm, 1: before rope (Qwen3), 2: after rope (Hunyuan)
//   slot_mapping   [T] int64               flat KV slot of each token
//   k/v_cache      [NB, BS, KH, D]         in the cache's own dtype (float32, bfloat16 or float16)
//   -> q           [T, H, D]               in qkv's dtype
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace {

using crane_mp::narrow;
using crane_mp::rms_norm_row;
using crane_mp::widen;

template <typename scalar_t, typename cache_t>
void qkv_rope_cache_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const float* norm_w,
                         int64_t norm_position, float eps, const at::Tensor& slot_mapping, at::Tensor& k_cache,
                         at::Tensor& v_cache, at::Tensor& q_out, int64_t H) {
  const int64_t T = qkv.size(0), KH = k_cache.size(2), D = k_cache.size(3);
  const int64_t half = D / 2, row_width = (H + 2 * KH) * D;
  const scalar_t* in = qkv.data_ptr<scalar_t>();
  const scalar_t* cp = cos.data_ptr<scalar_t>();
  const scalar_t* sp = sin.data_ptr<scalar_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  cache_t* kc = k_cache.data_ptr<cache_t>();
  cache_t* vc = v_cache.data_ptr<cache_t>();
  scalar_t* qo = q_out.data_ptr<scalar_t>();

  at::parallel_for(0, T, crane_mp::parallel_grain(row_width), [&](int64_t begin, int64_t end) {
    std::vector<float> c(D), s(D), x(D), y(D), v(KH * D);
    for (int64_t t = begin; t < end; ++t) {
      widen(cp + t * D, c.data(), D);
      widen(sp + t * D, s.data(), D);
      const scalar_t* row = in + t * row_width;
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < H + KH; ++h) {
        widen(row + h * D, x.data(), D);
        if (norm_position == 1) rms_norm_row(x.data(), norm_w + h * D, D, eps);
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) y[d] = x[d] * c[d] + x[d + half] * s[d];
#pragma omp simd
        for (int64_t d = half; d < D; ++d) y[d] = x[d] * c[d] + x[d - half] * s[d];
        if (norm_position == 2) rms_norm_row(y.data(), norm_w + h * D, D, eps);
        if (h < H) {
          narrow(y.data(), qo + (t * H + h) * D, D);
        } else {
          narrow(y.data(), kc + (slot * KH + (h - H)) * D, D);
        }
      }
      if constexpr (std::is_same_v<scalar_t, cache_t>) {
        std::memcpy(vc + slot * KH * D, row + (H + KH) * D, KH * D * sizeof(scalar_t));
      } else {
        widen(row + (H + KH) * D, v.data(), KH * D);
        narrow(v.data(), vc + slot * KH * D, KH * D);
      }
    }
  });
}

at::Tensor qkv_rope_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          const std::optional<at::Tensor>& qk_norm_weight, int64_t qk_norm_position, double eps,
                          const at::Tensor& slot_mapping, at::Tensor& k_cache, at::Tensor& v_cache,
                          int64_t num_heads) {
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "int64 slot mapping");
  const int64_t T = qkv.size(0), KH = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) == (num_heads + 2 * KH) * D, "qkv width does not match the heads");
  TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D && slot_mapping.numel() == T, "one rope row per token");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type(), "rope tables must be in qkv's dtype");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type());
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "KV slot ", slots[t], " is outside the cache");
  std::vector<float> norm_w;
  if (qk_norm_position != 0) {
    TORCH_CHECK(qk_norm_weight.has_value() && qk_norm_weight->numel() == (num_heads + KH) * D,
                "q/k norm weights must be [heads + kv_heads, head_dim]");
    TORCH_CHECK(qk_norm_weight->is_contiguous() && qk_norm_weight->scalar_type() == qkv.scalar_type());
    norm_w.resize((num_heads + KH) * D);
  }
  at::Tensor q = at::empty({T, num_heads, D}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "qkv_rope_cache", [&] {
    if (!norm_w.empty()) widen(qk_norm_weight->data_ptr<scalar_t>(), norm_w.data(), norm_w.size());
    crane_mp::dispatch_kv(k_cache.scalar_type(), [&](auto tag) {
      qkv_rope_cache_impl<scalar_t, decltype(tag)>(qkv, cos, sin, norm_w.data(), qk_norm_position,
                                                   static_cast<float>(eps), slot_mapping, k_cache, v_cache, q,
                                                   num_heads);
    });
  });
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(crane_mp, m) {
  m.def("qkv_rope_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor? qk_norm_weight, int qk_norm_position, "
        "float eps, Tensor slot_mapping, Tensor(a!) k_cache, Tensor(b!) v_cache, int num_heads) -> Tensor",
        &qkv_rope_cache);
}
