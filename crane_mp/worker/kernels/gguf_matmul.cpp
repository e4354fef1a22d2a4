// Matmuls on GGUF-quantized weights (CPU), dequantizing inside the kernel:
//
//   gguf_linear(x [M, K] float32|bf16, w [N, row_bytes] uint8, qtype, K) -> [M, N] in x's dtype
//   gguf_dequantize(w [N, row_bytes] uint8, qtype, K) -> [N, K] float32   (embedding rows, tests)
//
// `w` holds each output row's GGUF blocks unchanged (llama.cpp's block layouts, ggml-common.h).
// Small batches (decode) decode each weight row in vector registers, once per 4 activation rows,
// and FMA it into their accumulators: the weights stream from memory once per step, which is what
// bounds decode. Larger batches dequantize a slab of rows (about 1 MB, cache-resident) per thread and hand
// it to a single-threaded float GEMM, whose register blocking amortises the dequantization over the
// batch. Neither path holds a dequantized copy of a whole layer. Arithmetic is float32 throughout.
// Every tier has AVX2; AVX-512 tiers use 16 lanes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if !defined(__AVX2__)
#error "gguf_matmul.cpp is built per tier, every tier has AVX2 (loader.py)"
#endif
#include <immintrin.h>

#include "cpu_vec.h"
#include "gguf_blocks.h"

namespace {

using namespace crane_mp::gguf;

void dequantize_row_vec(int64_t qtype, const uint8_t* row, float* y, int64_t K);

void dequantize_row(int64_t qtype, const uint8_t* row, float* y, int64_t K) {
  switch (qtype) {
    case F32: std::memcpy(y, row, K * sizeof(float)); return;
    case F16: crane_mp::widen(reinterpret_cast<const c10::Half*>(row), y, K); return;
    case BF16: crane_mp::widen(reinterpret_cast<const c10::BFloat16*>(row), y, K); return;
  }
  dequantize_row_vec(qtype, row, y, K);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// Vector helpers for the decode GEMVs: int lanes widened from bytes, converted to float, FMA'd.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
using vf = __m512;
using vi = __m512i;
inline vi load_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vi load_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vi low_bits(vi v, int shift, int mask) {
  return _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(mask));
}
inline vi shift_or(vi lo, vi hi, int shift) { return _mm512_or_si512(lo, _mm512_sll_epi32(hi, _mm_cvtsi32_si128(shift))); }
inline vf to_float(vi v, float offset) { return _mm512_add_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(offset)); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf scale(vf a, float s) { return _mm512_mul_ps(a, _mm512_set1_ps(s)); }
inline vf loadf(const float* p) { return _mm512_loadu_ps(p); }
inline vf zero() { return _mm512_setzero_ps(); }
inline vf splat(float v) { return _mm512_set1_ps(v); }
// Lane i: bit (first + i) of `bits`.
inline vi lane_bits(uint32_t bits, int first) {
  const vi shifts = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                     _mm512_set1_epi32(first));
  return _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(bits)), shifts), _mm512_set1_epi32(1));
}
inline float hsum(vf v) { return _mm512_reduce_add_ps(v); }
#else
constexpr int kLanes = 8;
using vf = __m256;
using vi = __m256i;
inline vi load_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline vi load_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline vi low_bits(vi v, int shift, int mask) {
  return _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(mask));
}
inline vi shift_or(vi lo, vi hi, int shift) { return _mm256_or_si256(lo, _mm256_sll_epi32(hi, _mm_cvtsi32_si128(shift))); }
inline vf to_float(vi v, float offset) { return _mm256_add_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(offset)); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf scale(vf a, float s) { return _mm256_mul_ps(a, _mm256_set1_ps(s)); }
inline vf loadf(const float* p) { return _mm256_loadu_ps(p); }
inline vf zero() { return _mm256_setzero_ps(); }
inline vf splat(float v) { return _mm256_set1_ps(v); }
inline vi lane_bits(uint32_t bits, int first) {
  const vi shifts = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(first));
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(bits)), shifts), _mm256_set1_epi32(1));
}
inline float hsum(vf v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

// One weight row against MR activation rows (x: MR rows of stride K); out[m] = row . x[m].
// Scales multiply the converted weights once (shared by every activation row); Q4_K/Q5_K mins
// are applied afterwards through per-32-element sums of x (xsum: MR rows of K/32).
template <int MR>
void gemv_q8_0(const uint8_t* row, const float* x, const float*, int64_t K, float* out) {
  vf acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = zero();
  for (int64_t b = 0; b < K / 32; ++b, row += 34) {
    const float d = half_to_float(row);
    for (int j = 0; j < 32; j += kLanes) {
      const vf w = scale(to_float(load_i8(row + 2 + j), 0.0f), d);
      for (int m = 0; m < MR; ++m) acc[m] = fmadd(w, loadf(x + m * K + b * 32 + j), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = hsum(acc[m]);
}

// Q4_0, Q4_1, Q5_0, Q5_1: 32-element blocks, element l in the low nibble of byte l (l < 16) or the
// high nibble of byte l - 16, Q5's fifth bit l in a little-endian uint32. Weight = d * q + offset.
template <int64_t kType>
inline void decode_q32(const uint8_t* block, int j, vf& w_lo, vf& w_hi) {
  constexpr bool kMin = kType == Q4_1 || kType == Q5_1;
  constexpr bool kFive = kType == Q5_0 || kType == Q5_1;
  const float d = half_to_float(block);
  const float offset = kMin ? half_to_float(block + 2) : (kFive ? -16.0f : -8.0f) * d;
  const uint8_t* q = block + (kMin ? 4 : 2) + (kFive ? 4 : 0);
  const vi bytes = load_u8(q + j);
  vi lo = low_bits(bytes, 0, 0xF), hi = low_bits(bytes, 4, 0xF);
  if (kFive) {
    uint32_t qh;
    std::memcpy(&qh, block + (kMin ? 4 : 2), 4);
    lo = shift_or(lo, lane_bits(qh, j), 4);
    hi = shift_or(hi, lane_bits(qh, j + 16), 4);
  }
  w_lo = fmadd(to_float(lo, 0.0f), splat(d), splat(offset));
  w_hi = fmadd(to_float(hi, 0.0f), splat(d), splat(offset));
}

template <int MR, int64_t kType, int64_t kBytes>
void gemv_q32(const uint8_t* row, const float* x, const float*, int64_t K, float* out) {
  vf acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = zero();
  for (int64_t b = 0; b < K / 32; ++b, row += kBytes) {
    for (int j = 0; j < 16; j += kLanes) {
      vf lo, hi;
      decode_q32<kType>(row, j, lo, hi);
      for (int m = 0; m < MR; ++m) {
        acc[m] = fmadd(lo, loadf(x + m * K + b * 32 + j), acc[m]);
        acc[m] = fmadd(hi, loadf(x + m * K + b * 32 + 16 + j), acc[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = hsum(acc[m]);
}

// MXFP4: a block's 32 codes -> their integer values (kMxfp4Values), elements 0-15 in `lo`, 16-31 in `hi`.
inline void mxfp4_values(const uint8_t* block, __m128i& lo, __m128i& hi) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 1));
  const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Values));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  lo = _mm_shuffle_epi8(table, _mm_and_si128(raw, low4));
  hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(raw, 4), low4));
}

// Lanes j .. j + kLanes - 1 of 16 int8 values, as floats times d.
inline vf mxfp4_lanes(__m128i values, int j, float d) {
#if defined(__AVX512F__)
  (void)j;
  return scale(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(values)), d);
#else
  const __m128i part = j == 0 ? values : _mm_unpackhi_epi64(values, values);
  return scale(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part)), d);
#endif
}

template <int MR>
void gemv_mxfp4(const uint8_t* row, const float* x, const float*, int64_t K, float* out) {
  vf acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = zero();
  for (int64_t b = 0; b < K / 32; ++b, row += 17) {
    __m128i lo_values, hi_values;
    mxfp4_values(row, lo_values, hi_values);
    const float d = e8m0_half(row[0]);
    for (int j = 0; j < 16; j += kLanes) {
      const vf lo = mxfp4_lanes(lo_values, j, d), hi = mxfp4_lanes(hi_values, j, d);
      for (int m = 0; m < MR; ++m) {
        acc[m] = fmadd(lo, loadf(x + m * K + b * 32 + j), acc[m]);
        acc[m] = fmadd(hi, loadf(x + m * K + b * 32 + 16 + j), acc[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = hsum(acc[m]);
}

template <int MR, bool kFive>
void gemv_qk(const uint8_t* row, const float* x, const float* xsum, int64_t K, float* out) {
  vf acc[MR];
  float mins[MR] = {};
  for (int m = 0; m < MR; ++m) acc[m] = zero();
  const int64_t block_bytes = kFive ? 176 : 144;
  for (int64_t b = 0; b < K / 256; ++b, row += block_bytes) {
    const float d = half_to_float(row), dmin = half_to_float(row + 2);
    const uint8_t* scales = row + 4;
    const uint8_t* qh = row + 16;
    const uint8_t* q = row + (kFive ? 48 : 16);
    for (int c = 0; c < 4; ++c, q += 32) {
      float s0, m0, s1, m1;
      k_scale_min(scales, 2 * c, s0, m0);
      k_scale_min(scales, 2 * c + 1, s1, m1);
      const float d0 = d * s0, d1 = d * s1;
      const int64_t base = b * 256 + 64 * c;
      for (int m = 0; m < MR; ++m) {
        mins[m] += dmin * (m0 * xsum[m * (K / 32) + base / 32] + m1 * xsum[m * (K / 32) + base / 32 + 1]);
      }
      for (int j = 0; j < 32; j += kLanes) {
        const vi bytes = load_u8(q + j);
        vi lo = low_bits(bytes, 0, 0xF), hi = low_bits(bytes, 4, 0xF);
        if (kFive) {
          const vi high = load_u8(qh + j);
          lo = shift_or(lo, low_bits(high, 2 * c, 1), 4);
          hi = shift_or(hi, low_bits(high, 2 * c + 1, 1), 4);
        }
        const vf wl = scale(to_float(lo, 0.0f), d0), wh = scale(to_float(hi, 0.0f), d1);
        for (int m = 0; m < MR; ++m) {
          acc[m] = fmadd(wl, loadf(x + m * K + base + j), acc[m]);
          acc[m] = fmadd(wh, loadf(x + m * K + base + 32 + j), acc[m]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = hsum(acc[m]) - mins[m];
}

template <int MR>
void gemv_q6_k(const uint8_t* row, const float* x, const float*, int64_t K, float* out) {
  vf acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = zero();
  for (int64_t b = 0; b < K / 256; ++b, row += 210) {
    const float d = half_to_float(row + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(row + 192);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = row + 64 * h;
      const uint8_t* qh = row + 128 + 32 * h;
      for (int s = 0; s < 4; ++s) {
        const uint8_t* low = ql + 32 * (s & 1);
        for (int j = 0; j < 32; j += kLanes) {
          const vi q = shift_or(low_bits(load_u8(low + j), 4 * (s >> 1), 0xF), low_bits(load_u8(qh + j), 2 * s, 3), 4);
          const vf w = scale(to_float(q, -32.0f), d * sc[8 * h + 2 * s + j / 16]);
          const int64_t at = b * 256 + 128 * h + 32 * s + j;
          for (int m = 0; m < MR; ++m) acc[m] = fmadd(w, loadf(x + m * K + at), acc[m]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = hsum(acc[m]);
}

// Vector dequantizers of whole rows (into the GEMM path's slab), same decoding as the GEMVs.
inline void storef(float* p, vf v) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(p, v);
#else
  _mm256_storeu_ps(p, v);
#endif
}

void dequant_vec_q8_0(const uint8_t* row, float* y, int64_t K) {
  for (int64_t b = 0; b < K / 32; ++b, row += 34, y += 32) {
    const float d = half_to_float(row);
    for (int j = 0; j < 32; j += kLanes) storef(y + j, scale(to_float(load_i8(row + 2 + j), 0.0f), d));
  }
}

template <bool kFive>
void dequant_vec_qk(const uint8_t* row, float* y, int64_t K) {
  for (int64_t b = 0; b < K / 256; ++b, row += kFive ? 176 : 144) {
    const float d = half_to_float(row), dmin = half_to_float(row + 2);
    const uint8_t* qh = row + 16;
    const uint8_t* q = row + (kFive ? 48 : 16);
    for (int c = 0; c < 4; ++c, q += 32, y += 64) {
      float s0, m0, s1, m1;
      k_scale_min(row + 4, 2 * c, s0, m0);
      k_scale_min(row + 4, 2 * c + 1, s1, m1);
      for (int j = 0; j < 32; j += kLanes) {
        const vi bytes = load_u8(q + j);
        vi lo = low_bits(bytes, 0, 0xF), hi = low_bits(bytes, 4, 0xF);
        if (kFive) {
          const vi high = load_u8(qh + j);
          lo = shift_or(lo, low_bits(high, 2 * c, 1), 4);
          hi = shift_or(hi, low_bits(high, 2 * c + 1, 1), 4);
        }
        storef(y + j, fmadd(to_float(lo, 0.0f), splat(d * s0), splat(-dmin * m0)));
        storef(y + 32 + j, fmadd(to_float(hi, 0.0f), splat(d * s1), splat(-dmin * m1)));
      }
    }
  }
}

void dequant_vec_q6_k(const uint8_t* row, float* y, int64_t K) {
  for (int64_t b = 0; b < K / 256; ++b, row += 210) {
    const float d = half_to_float(row + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(row + 192);
    for (int h = 0; h < 2; ++h) {
      for (int s = 0; s < 4; ++s, y += 32) {
        const uint8_t* low = row + 64 * h + 32 * (s & 1);
        const uint8_t* qh = row + 128 + 32 * h;
        for (int j = 0; j < 32; j += kLanes) {
          const vi q = shift_or(low_bits(load_u8(low + j), 4 * (s >> 1), 0xF), low_bits(load_u8(qh + j), 2 * s, 3), 4);
          storef(y + j, scale(to_float(q, -32.0f), d * sc[8 * h + 2 * s + j / 16]));
        }
      }
    }
  }
}

void dequant_vec_mxfp4(const uint8_t* row, float* y, int64_t K) {
  for (int64_t b = 0; b < K / 32; ++b, row += 17, y += 32) {
    __m128i lo, hi;
    mxfp4_values(row, lo, hi);
    const float d = e8m0_half(row[0]);
    for (int j = 0; j < 16; j += kLanes) {
      storef(y + j, mxfp4_lanes(lo, j, d));
      storef(y + 16 + j, mxfp4_lanes(hi, j, d));
    }
  }
}

template <int64_t kType, int64_t kBytes>
void dequant_vec_q32(const uint8_t* row, float* y, int64_t K) {
  for (int64_t b = 0; b < K / 32; ++b, row += kBytes, y += 32) {
    for (int j = 0; j < 16; j += kLanes) {
      vf lo, hi;
      decode_q32<kType>(row, j, lo, hi);
      storef(y + j, lo);
      storef(y + 16 + j, hi);
    }
  }
}

void dequantize_row_vec(int64_t qtype, const uint8_t* row, float* y, int64_t K) {
  switch (qtype) {
    case Q8_0: dequant_vec_q8_0(row, y, K); return;
    case Q4_0: dequant_vec_q32<Q4_0, 18>(row, y, K); return;
    case Q4_1: dequant_vec_q32<Q4_1, 20>(row, y, K); return;
    case Q5_0: dequant_vec_q32<Q5_0, 22>(row, y, K); return;
    case Q5_1: dequant_vec_q32<Q5_1, 24>(row, y, K); return;
    case Q4_K: dequant_vec_qk<false>(row, y, K); return;
    case Q5_K: dequant_vec_qk<true>(row, y, K); return;
    case Q6_K: dequant_vec_q6_k(row, y, K); return;
    case MXFP4: dequant_vec_mxfp4(row, y, K); return;
  }
}

using GemvFn = void (*)(const uint8_t*, const float*, const float*, int64_t, float*);

template <int MR>
GemvFn vector_gemv(int64_t qtype) {
  switch (qtype) {
    case Q8_0: return gemv_q8_0<MR>;
    case Q4_0: return gemv_q32<MR, Q4_0, 18>;
    case Q4_1: return gemv_q32<MR, Q4_1, 20>;
    case Q5_0: return gemv_q32<MR, Q5_0, 22>;
    case Q5_1: return gemv_q32<MR, Q5_1, 24>;
    case Q4_K: return gemv_qk<MR, false>;
    case Q5_K: return gemv_qk<MR, true>;
    case Q6_K: return gemv_q6_k<MR>;
    case MXFP4: return gemv_mxfp4<MR>;
  }
  return nullptr;
}

GemvFn vector_gemv_for(int64_t qtype, int64_t rows) {
  switch (rows) {
    case 1: return vector_gemv<1>(qtype);
    case 2: return vector_gemv<2>(qtype);
    case 3: return vector_gemv<3>(qtype);
    case 4: return vector_gemv<4>(qtype);
  }
  return nullptr;
}

at::Tensor gguf_dequantize(const at::Tensor& w, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  const int64_t N = w.size(0), row_bytes = w.size(1);
  at::Tensor out = at::empty({N, K}, w.options().dtype(at::kFloat));
  const uint8_t* src = w.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, N, crane_mp::parallel_grain(K), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) dequantize_row(qtype, src + n * row_bytes, dst + n * K, K);
  });
  return out;
}

// Up to this many activation rows, each weight row is decoded once per group of 4 rows and FMA'd into
// their accumulators; above it, the GEMM's blocking wins (measured in benchmarks/gguf_kernels.py).
constexpr int64_t kGemvMaxRows = 8;
// Rows per dequantized slab in the GEMM path: ~256 KB, so a slab stays in L2 while the GEMM reads it.
constexpr int64_t kSlabBytes = 1024 * 1024;

at::Tensor gguf_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "gguf_linear: x must be [M, ", K, "]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "gguf_linear: x must be float32 or bfloat16");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), N = w.size(0), row_bytes = w.size(1);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out.to(x_in.scalar_type());
  const uint8_t* src = w.data_ptr<uint8_t>();
  const float* xs = x.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  if (M <= kGemvMaxRows) {
    // Per-32-element sums of each activation row, for the Q4_K/Q5_K mins (cheap: K adds per row).
    std::vector<float> xsum(M * (K / 32));
    for (int64_t i = 0; (qtype == Q4_K || qtype == Q5_K) && i < M * (K / 32); ++i) {
      float sum = 0.0f;
      for (int l = 0; l < 32; ++l) sum += xs[i * 32 + l];
      xsum[i] = sum;
    }
    at::parallel_for(0, N, crane_mp::parallel_grain(K * M), [&](int64_t begin, int64_t end) {
      std::vector<float> row;
      float dots[kGemvMaxRows];
      for (int64_t n = begin; n < end; ++n) {
        const uint8_t* w = src + n * row_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          const int64_t rows = std::min<int64_t>(4, M - m0);
          const GemvFn fn = vector_gemv_for(qtype, rows);
          if (fn != nullptr) {
            fn(w, xs + m0 * K, xsum.data() + m0 * (K / 32), K, dots + m0);
            continue;
          }
          if (row.empty()) row.resize(K);
          if (m0 == 0) dequantize_row(qtype, w, row.data(), K);
          for (int64_t m = m0; m < m0 + rows; ++m) dots[m] = dot(row.data(), xs + m * K, K);
        }
        for (int64_t m = 0; m < M; ++m) ys[m * N + n] = dots[m];
      }
    });
  } else {
    // Each thread dequantizes its own slabs and multiplies them with a single-threaded GEMM (MKL
    // runs sequentially inside a parallel region): no serial phases, slabs stay in that core's cache.
    // At most ~1 MB per slab, and small enough that every thread gets a slab of a small matrix.
    const int64_t per_thread = (N + at::get_num_threads() - 1) / at::get_num_threads();
    const int64_t slab_rows = std::max<int64_t>(16, std::min(kSlabBytes / (K * 4), per_thread + 15) / 16 * 16);
    const int64_t slabs = (N + slab_rows - 1) / slab_rows;
    at::parallel_for(0, slabs, 1, [&](int64_t begin, int64_t end) {
      // Kept per thread across calls: a fresh buffer of this size would be page-faulted in every time.
      thread_local std::vector<float> buffer;
      buffer.resize(std::max<size_t>(buffer.size(), slab_rows * K));
      float* dst = buffer.data();
      const at::Tensor slab = at::from_blob(dst, {slab_rows, K}, x.options());
      for (int64_t s = begin; s < end; ++s) {
        const int64_t n0 = s * slab_rows, rows = std::min(slab_rows, N - n0);
        for (int64_t r = 0; r < rows; ++r) dequantize_row(qtype, src + (n0 + r) * row_bytes, dst + r * K, K);
        // Raw copy: worker threads do not inherit InferenceMode, so no in-place tensor op on `out` here.
        const at::Tensor part = at::mm(x, slab.narrow(0, 0, rows).t()).contiguous();
        const float* p = part.data_ptr<float>();
        for (int64_t m = 0; m < M; ++m) std::memcpy(ys + m * N + n0, p + m * rows, rows * sizeof(float));
      }
    });
  }
  return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(crane_mp, m) {
  m.def("gguf_linear(Tensor x, Tensor w, int qtype, int K) -> Tensor", &gguf_linear);
  m.def("gguf_dequantize(Tensor w, int qtype, int K) -> Tensor", &gguf_dequantize);
}
