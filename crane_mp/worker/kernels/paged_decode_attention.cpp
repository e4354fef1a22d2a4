// Decode attention that reads K/V straight from the paged cache (CPU).
//
// One task per (sequence, kv head): its G = H / KH query heads share every key and value row, so
// each row is loaded once, converted to float once, and used G times. Scores live in a per-task
// float buffer; softmax and the weighted sum of V rows are exact float32 math.
//
//   q            [B, H, D]          (float32, bfloat16 or float16, contiguous)
//   k/v_cache    [NB, BS, KH, D]    the cache's own dtype (float32, bfloat16 or float16), read as stored
//   block_tables [B, MAXB] int64    key j of sequence b sits in block_tables[b][j / BS], row j % BS
//   ctx_lens     [B] int64          keys 0 .. ctx_lens[b]-1 (window: only the last `window` of them)
//   sinks        [H] optional       a logit per query head the softmax takes with no value row (gpt-oss)
//   out          [B, H, D]          same dtype as q
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace {

using crane_mp::widen;

#if defined(__AVX512BF16__)
// The lane sums of 16 vectors, as one vector: out[j] = sum(a[j]). A reduction tree that folds
// halves of pairs of vectors, ~3 instructions per vector instead of ~9 for one reduction each.
inline __m512 sum_lanes16(const __m512* a) {
  __m512 b[8], c[4], e[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: a[2i] folded to 8 values, lanes 8-15: a[2i+1]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit block k: a[4i+k] folded to 4 values
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // block k: [a[8i+k] x2, a[8i+4+k] x2], interleaved
    e[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[2 * i], c[2 * i + 1]), _mm512_unpackhi_ps(c[2 * i], c[2 * i + 1]));
  const __m512 f = _mm512_add_ps(  // block k: [a[k], a[4+k], a[8+k], a[12+k]]
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(e[0]), _mm512_castps_pd(e[1]))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(e[0]), _mm512_castps_pd(e[1]))));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, f);
}
#endif

// A cache row as float: float rows are read in place, others widened into `buffer`.
template <typename scalar_t>
inline const float* as_float_row(const scalar_t* row, float* buffer, int64_t D) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return row;
  } else {
    widen(row, buffer, D);
    return buffer;
  }
}

// scores[j] = scale * q . k_j for `count` key rows `stride` apart. The generic version widens the
// rows to float first; bfloat16 rows with AVX512-BF16 go straight into dot-product instructions
// (exact products, float accumulation), 16 keys at a time.
template <typename scalar_t, typename cache_t, int64_t HEAD_DIM>
inline void key_scores(const scalar_t* q, const float* q_float, const cache_t* rows, int64_t stride, int64_t count,
                       int64_t D, float scale, float* tile, float* scores) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16> && HEAD_DIM > 0 &&
                HEAD_DIM % 32 == 0) {
    constexpr int64_t kPairs = HEAD_DIM / 32;
    __m512bh qv[kPairs];
    for (int64_t c = 0; c < kPairs; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t i0 = 0; i0 < count; i0 += 16) {
      const int64_t m = std::min<int64_t>(16, count - i0);
      __m512 acc[16];
      for (int64_t i = 0; i < 16; ++i) {
        acc[i] = _mm512_setzero_ps();
        if (i >= m) continue;
        const cache_t* k = rows + (i0 + i) * stride;
        for (int64_t c = 0; c < kPairs; ++c)
          acc[i] = _mm512_dpbf16_ps(acc[i], qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
      }
      _mm512_mask_storeu_ps(scores + i0, static_cast<__mmask16>((1u << m) - 1),
                            _mm512_mul_ps(sum_lanes16(acc), vscale));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < count; ++i) {
    const float* k = as_float_row(rows + i * stride, tile, D);
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; ++d) s += q_float[d] * k[d];
    scores[i] = s * scale;
  }
}

#if defined(__AVX512BF16__)
// acc[g] += sum_i p[g][i] * v_i for GB query heads at once, bfloat16 rows widened in registers and
// every accumulator held in registers across the block's rows.
template <int64_t HEAD_DIM, int GB>
inline void value_rows_bf16(const c10::BFloat16* rows, int64_t stride, int64_t count, const float* p, int64_t p_stride,
                            float* acc) {
  constexpr int V = HEAD_DIM / 16;
  __m512 a[GB][V];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < V; ++c) a[g][c] = _mm512_loadu_ps(acc + g * HEAD_DIM + 16 * c);
  for (int64_t i = 0; i < count; ++i) {
    const c10::BFloat16* row = rows + i * stride;
    __m512 v[V];
    for (int c = 0; c < V; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * c));
      v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    for (int g = 0; g < GB; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * p_stride + i]);
      for (int c = 0; c < V; ++c) a[g][c] = _mm512_fmadd_ps(pg, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(acc + g * HEAD_DIM + 16 * c, a[g][c]);
}
#endif

// acc[g] += sum_i p[g][i] * v_i over a block's `count` value rows, for the G query heads of a task.
template <typename cache_t, int64_t HEAD_DIM>
inline void value_rows(const cache_t* rows, int64_t stride, int64_t count, const float* p, int64_t p_stride,
                       int64_t G, int64_t D, float* tile, float* acc) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<cache_t, c10::BFloat16> && HEAD_DIM > 0 && HEAD_DIM % 16 == 0) {
    constexpr int GB = HEAD_DIM <= 64 ? 4 : 2;  // 16 accumulator registers
    int64_t g = 0;
    for (; g + GB <= G; g += GB)
      value_rows_bf16<HEAD_DIM, GB>(rows, stride, count, p + g * p_stride, p_stride, acc + g * HEAD_DIM);
    for (; g < G; ++g) value_rows_bf16<HEAD_DIM, 1>(rows, stride, count, p + g * p_stride, p_stride, acc + g * HEAD_DIM);
    return;
  }
#endif
  // Float rows are read in place (stride apart); others are widened once into the tile (D apart).
  const float* first = tile;
  int64_t row_step = D;
  if constexpr (std::is_same_v<cache_t, float>) {
    first = rows;
    row_step = stride;
  } else {
    for (int64_t i = 0; i < count; ++i) widen(rows + i * stride, tile + i * D, D);
  }
  for (int64_t g = 0; g < G; ++g) {
    float* ag = acc + g * D;
    for (int64_t i = 0; i < count; ++i) {
      const float pi = p[g * p_stride + i];
      const float* vrow = first + i * row_step;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += pi * vrow[d];
    }
  }
}

// HEAD_DIM > 0 fixes the head size at compile time (fully unrolled, vectorised loops); 0 = any size.
template <typename scalar_t, typename cache_t, int64_t HEAD_DIM>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& ctx_lens, at::Tensor& out,
                           double scale, int64_t window, const float* sinks) {
  const int64_t B = q.size(0), H = q.size(1);
  const int64_t D = HEAD_DIM > 0 ? HEAD_DIM : q.size(2);
  const int64_t BS = k_cache.size(1), KH = k_cache.size(2);
  const int64_t G = H / KH;
  const int64_t MAXB = block_tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kp = k_cache.data_ptr<cache_t>();
  const cache_t* vp = v_cache.data_ptr<cache_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * KH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), tile(BS * D), scores, denom(G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KH, kh = task % KH;
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      scores.resize(G * n);
      const scalar_t* q_task = qp + (b * H + kh * G) * D;
      widen(q_task, qf.data(), G * D);

      // Walk the keys block by block: one table lookup per block, then rows at a fixed stride (a
      // division per key would cost more than the key's arithmetic).
      const int64_t stride = KH * D;
      // Blocks are scattered over the cache, out of the hardware prefetcher's sight: fetch the next
      // block's rows while this one is processed.
      const int64_t row_bytes = D * static_cast<int64_t>(sizeof(cache_t));
      auto for_each_block = [&](const cache_t* base, auto&& body) {
        for (int64_t pos = first, j = 0; pos < len;) {
          const int64_t off = pos % BS, count = std::min(BS - off, len - pos);
          const int64_t next = pos + count;
          if (next < len) {
            const char* ahead = reinterpret_cast<const char*>(base + (bt[b * MAXB + next / BS] * BS * KH + kh) * D);
            const int64_t ahead_rows = std::min(BS, len - next);
            for (int64_t i = 0; i < ahead_rows; ++i)
              for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(ahead + i * stride * sizeof(cache_t) + byte);
          }
          body(j, count, base + ((bt[b * MAXB + pos / BS] * BS + off) * KH + kh) * D);
          pos = next;
          j += count;
        }
      };

      for_each_block(kp, [&](int64_t j0, int64_t count, const cache_t* rows) {
        for (int64_t g = 0; g < G; ++g)
          key_scores<scalar_t, cache_t, HEAD_DIM>(q_task + g * D, qf.data() + g * D, rows, stride, count, D, fscale,
                                         tile.data(), scores.data() + g * n + j0);
      });

      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        // A sink (gpt-oss) is one more logit in the softmax, with no value row.
        const float sink = sinks != nullptr ? sinks[kh * G + g] : -std::numeric_limits<float>::infinity();
        float mx = sink;
#pragma omp simd reduction(max : mx)
        for (int64_t j = 0; j < n; ++j) mx = sg[j] > mx ? sg[j] : mx;
        float sum = sinks != nullptr ? std::exp(sink - mx) : 0.f;
        // Vectorised exp (glibc's libmvec): a scalar exp per score would dominate the whole kernel.
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
          sg[j] = std::exp(sg[j] - mx);
          sum += sg[j];
        }
        denom[g] = sum;
      }

      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_block(vp, [&](int64_t j0, int64_t count, const cache_t* rows) {
        value_rows<cache_t, HEAD_DIM>(rows, stride, count, scores.data() + j0, n, G, D, tile.data(), acc.data());
      });
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / denom[g];
        for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= inv;
      }
      crane_mp::narrow(acc.data(), op + (b * H + kh * G) * D, G * D);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& ctx_lens, double scale,
                                  int64_t window, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && ctx_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  at::Tensor out = at::empty_like(q);
  const at::Tensor tables = block_tables.contiguous(), lens = ctx_lens.contiguous();
  at::Tensor sink_logits;
  if (sinks.has_value()) {
    sink_logits = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sink_logits.numel() == q.size(1), "one sink per query head");
  }
  const float* sink_ptr = sinks.has_value() ? sink_logits.data_ptr<float>() : nullptr;
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "keys and values must share one cache dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    crane_mp::dispatch_kv(k_cache.scalar_type(), [&](auto tag) {
      using cache_t = decltype(tag);
      switch (q.size(2)) {
        case 64: decode_attention_impl<scalar_t, cache_t, 64>(q, k_cache, v_cache, tables, lens, out, scale, window, sink_ptr); break;
        case 128: decode_attention_impl<scalar_t, cache_t, 128>(q, k_cache, v_cache, tables, lens, out, scale, window, sink_ptr); break;
        default: decode_attention_impl<scalar_t, cache_t, 0>(q, k_cache, v_cache, tables, lens, out, scale, window, sink_ptr);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(crane_mp, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor ctx_lens, "
        "float scale, int window, Tensor? sinks=None) -> Tensor", &paged_decode_attention);
}
