// Decode attention that reads K/V straight from the paged cache (CPU).
//
// One task per (sequence, kv head): its G = H / KH query heads share every key and value row, so
// each row is loaded once, converted to float once, and used G times. Scores live in a per-task
// float buffer; softmax and the weighted sum of V rows are exact float32 math.
//
//   q            [B, H, D]          (float32 or bfloat16, contiguous)
//   k/v_cache    [NB, BS, KH, D]    same dtype as q
//   block_tables [B, MAXB] int64    key j of sequence b sits in block_tables[b][j / BS], row j % BS
//   ctx_lens     [B] int64          keys 0 .. ctx_lens[b]-1 (window: only the last `window` of them)
//   out          [B, H, D]          same dtype as q
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// HEAD_DIM > 0 fixes the head size at compile time (fully unrolled, vectorised loops); 0 = any size.
template <typename scalar_t, int64_t HEAD_DIM>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& ctx_lens, at::Tensor& out,
                           double scale, int64_t window) {
  const int64_t B = q.size(0), H = q.size(1);
  const int64_t D = HEAD_DIM > 0 ? HEAD_DIM : q.size(2);
  const int64_t BS = k_cache.size(1), KH = k_cache.size(2);
  const int64_t G = H / KH;
  const int64_t MAXB = block_tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * KH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), row(D), scores, denom(G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KH, kh = task % KH;
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      scores.resize(G * n);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_float(qp[(b * H + kh * G + g) * D + d]) * fscale;

      // Walk the keys block by block: one table lookup per block, then rows at a fixed stride (a
      // division per key would cost more than the key's arithmetic).
      const int64_t stride = KH * D;
      auto for_each_row = [&](const scalar_t* base, auto&& body) {
        for (int64_t pos = first, j = 0; pos < len;) {
          const int64_t off = pos % BS, count = std::min(BS - off, len - pos);
          const scalar_t* rows = base + ((bt[b * MAXB + pos / BS] * BS + off) * KH + kh) * D;
          for (int64_t i = 0; i < count; ++i, ++j) body(j, rows + i * stride);
          pos += count;
        }
      };

      for_each_row(kp, [&](int64_t j, const scalar_t* krow) {
        for (int64_t d = 0; d < D; ++d) row[d] = to_float(krow[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
          scores[g * n + j] = s;
        }
      });

      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sg[j]);
        float sum = 0.f;
        // Vectorised exp (glibc's libmvec): a scalar exp per score would dominate the whole kernel.
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
          sg[j] = std::exp(sg[j] - mx);
          sum += sg[j];
        }
        denom[g] = sum;
      }

      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_row(vp, [&](int64_t j, const scalar_t* vrow) {
        for (int64_t d = 0; d < D; ++d) row[d] = to_float(vrow[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * n + j];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
        }
      });
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          op[(b * H + kh * G + g) * D + d] = static_cast<scalar_t>(acc[g * D + d] / denom[g]);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& ctx_lens, double scale,
                                  int64_t window) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && ctx_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  at::Tensor out = at::empty_like(q);
  const at::Tensor tables = block_tables.contiguous(), lens = ctx_lens.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    switch (q.size(2)) {
      case 64: decode_attention_impl<scalar_t, 64>(q, k_cache, v_cache, tables, lens, out, scale, window); break;
      case 128: decode_attention_impl<scalar_t, 128>(q, k_cache, v_cache, tables, lens, out, scale, window); break;
      default: decode_attention_impl<scalar_t, 0>(q, k_cache, v_cache, tables, lens, out, scale, window);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(crane_mp, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor ctx_lens, "
        "float scale, int window) -> Tensor", &paged_decode_attention);
}
