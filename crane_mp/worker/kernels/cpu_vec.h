// Helpers shared by the CPU kernels: widening and narrowing between a tensor's storage type and
// float (vectorised for bfloat16 and float16), the KV cache's dtypes, RMS-normalising a float row,
// SiLU times up, and parallel grain sizes.
//
// Every kernel is compiled once per instruction-set tier with explicit flags (loader.py): the
// __AVX512F__ / __AVX512BF16__ / __AVX2__ branches below are chosen at compile time, never by
// probing at run time, so a library only ever runs on a CPU of its tier or above.
//
// The kernels do their arithmetic on float buffers (plain loops the compiler vectorises) and touch
// the storage type only here: a loop over c10::BFloat16 values does not vectorise, and was the
// largest cost of the first versions of these kernels. Narrowing rounds to nearest even, as c10's
// casts do.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace crane_mp {

// Work items per parallel chunk so that a chunk holds at least ~32K elements: below that a second
// thread costs more (fork/join, and on a shared VM waiting for a descheduled core) than it saves.
inline int64_t parallel_grain(int64_t elements_per_item) {
  constexpr int64_t kMinElementsPerChunk = 32768;
  return elements_per_item >= kMinElementsPerChunk ? 1 : kMinElementsPerChunk / elements_per_item;
}

template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void widen<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

template <>
inline void widen<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
  }
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void widen<c10::Half>(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// c10's float -> bfloat16 rounding (to nearest even; NaN -> 0x7fc0), with the NaN test on the bits:
// the kernels build with -ffast-math, under which the compiler may drop float NaN comparisons (and
// c10's std::isnan), turning a NaN with a large payload into -0.
inline uint16_t bfloat16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

template <typename T>
inline void narrow(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

template <>
inline void narrow<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

template <>
inline void narrow<c10::BFloat16>(const float* src, c10::BFloat16* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  for (; i + 16 <= n; i += 16) {
    const __m256bh packed = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), reinterpret_cast<const __m256i&>(packed));
  }
#elif defined(__AVX2__)
  // bfloat16_bits, 8 at a time: add 0x7fff plus the lowest kept bit, keep the high half; NaN -> 0x7fc0.
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff), nan = _mm256_set1_epi32(0x7fc0);
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff), infinity = _mm256_set1_epi32(0x7f800000);
  for (; i + 8 <= n; i += 8) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(bias, lsb)), 16);
    const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, magnitude), infinity);
    rounded = _mm256_blendv_epi8(rounded, nan, is_nan);
    // packus works within 128-bit lanes: [r0-3, r0-3 | r4-7, r4-7] -> r0-7 in the low half.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(packed));
  }
#endif
  for (; i < n; ++i) dst[i] = c10::BFloat16(bfloat16_bits(src[i]), c10::BFloat16::from_bits());
}

// Rounds to nearest even, as c10's Half conversion does.
template <>
inline void narrow<c10::Half>(const float* src, c10::Half* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}

// Calls f(T{}) with T the C++ type of a KV cache dtype: float, c10::BFloat16 or c10::Half.
template <typename F>
inline void dispatch_kv(c10::ScalarType type, F&& f) {
  switch (type) {
    case c10::ScalarType::Float: f(float{}); return;
    case c10::ScalarType::BFloat16: f(c10::BFloat16{}); return;
    case c10::ScalarType::Half: f(c10::Half{}); return;
    default: TORCH_CHECK(false, "a KV cache of dtype ", type, " is not supported");
  }
}

// x = x / rms(x) * weight, in place, all float.
inline void rms_norm_row(float* x, const float* weight, int64_t dim, float eps) {
  float sumsq = 0.f;
#pragma omp simd reduction(+ : sumsq)
  for (int64_t d = 0; d < dim; ++d) sumsq += x[d] * x[d];
  const float scale = 1.f / std::sqrt(sumsq / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) x[d] = x[d] * scale * weight[d];
}

// gate = silu(gate) * up, in place, all float: one loop (its exp libmvec's vector one) for every kernel
// that applies it, so that they agree bit for bit.
inline void silu_mul(float* gate, const float* up, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

}  // namespace crane_mp
