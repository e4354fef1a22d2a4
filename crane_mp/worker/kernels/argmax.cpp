// Row-wise argmax over float logits (CPU): argmax_rows(x [N, V] float32) -> [N] int64.
//
// torch's CPU argmax walks a row one element at a time (~0.4 ms for 32 x 8192 here); this one
// keeps a vector of running maxima and their indices (16 lanes with AVX-512, 8 with AVX2). Ties go
// to the lowest index, as torch's do. NaN entries are not chosen (torch would pick the first NaN):
// NaN logits give some token, not a crash.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Folds per-lane maxima and their indices into (best, best_index); ties go to the lowest index.
template <int kLanes>
inline void fold_lanes(const float* values, const int32_t* indices, float& best, int64_t& best_index) {
  for (int lane = 0; lane < kLanes; ++lane) {
    if (values[lane] > best || (values[lane] == best && indices[lane] < best_index)) {
      best = values[lane];
      best_index = indices[lane];
    }
  }
}

int64_t argmax_row(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_index = 0, i = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 vbest = _mm512_set1_ps(best);
    __m512i vindex = _mm512_setzero_si512();
    __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);
      vbest = _mm512_mask_mov_ps(vbest, greater, v);
      vindex = _mm512_mask_mov_epi32(vindex, greater, lanes);
      lanes = _mm512_add_epi32(lanes, step);
    }
    alignas(64) float values[16];
    alignas(64) int32_t indices[16];
    _mm512_store_ps(values, vbest);
    _mm512_store_si512(indices, vindex);
    fold_lanes<16>(values, indices, best, best_index);
  }
#elif defined(__AVX2__)
  if (n >= 8) {
    __m256 vbest = _mm256_set1_ps(best);
    __m256i vindex = _mm256_setzero_si256();
    __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 greater = _mm256_cmp_ps(v, vbest, _CMP_GT_OQ);
      vbest = _mm256_blendv_ps(vbest, v, greater);
      vindex = _mm256_blendv_epi8(vindex, lanes, _mm256_castps_si256(greater));
      lanes = _mm256_add_epi32(lanes, step);
    }
    alignas(32) float values[8];
    alignas(32) int32_t indices[8];
    _mm256_store_ps(values, vbest);
    _mm256_store_si256(reinterpret_cast<__m256i*>(indices), vindex);
    fold_lanes<8>(values, indices, best, best_index);
  }
#endif
  for (; i < n; ++i) {
    if (x[i] > best) {
      best = x[i];
      best_index = i;
    }
  }
  return best_index;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "argmax_rows wants [N, V] float32");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) < std::numeric_limits<int32_t>::max(), "row length out of range");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(crane_mp, m) {
  m.def("argmax_rows(Tensor x) -> Tensor", &argmax_rows);
}
