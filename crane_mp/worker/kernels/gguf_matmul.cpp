// Matmuls on GGUF-quantized weights (CPU), dequantizing inside the kernel:
//
//   gguf_linear(x [M, K] float32|bf16, w [N, row_bytes] uint8, qtype, K) -> [M, N] in x's dtype
//   gguf_dequantize(w [N, row_bytes] uint8, qtype, K) -> [N, K] float32   (embedding rows, tests)
//
// `w` holds each output row's GGUF blocks unchanged (llama.cpp's block layouts, ggml-common.h).
// Small batches (decode) dequantize one weight row at a time into an L1 buffer and dot it with every
// activation row: the weights stream from memory once per step, which is what bounds decode. Larger
// batches dequantize a slab of rows (a few hundred KB, cache-resident) and hand it to the float GEMM,
// whose register blocking then amortises the dequantization over the batch. Neither path ever holds
// a dequantized copy of a whole layer. Arithmetic is float32 throughout.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "cpu_vec.h"

namespace {

// ggml's type ids (GGMLQuantizationType in the gguf package).
enum QType : int64_t { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13,
                       Q6_K = 14, BF16 = 30 };

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

struct Layout {
  int64_t block;  // elements per block
  int64_t bytes;  // bytes per block
};

Layout layout_of(int64_t qtype) {
  switch (qtype) {
    case F32: return {1, 4};
    case F16: return {1, 2};
    case BF16: return {1, 2};
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
  }
  TORCH_CHECK(false, "gguf_linear: unsupported GGML type ", qtype);
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K super-block.
inline void k_scale_min(const uint8_t* s, int j, float& scale, float& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Each dequantizer writes one block's elements to y. The inner loops are plain uint8 -> float
// arithmetic over 16 or 32 lanes, which the compiler vectorises for the tier it builds.
inline void dq_q4_0(const uint8_t* b, float* y) {
  const float d = half_to_float(b);
  const uint8_t* q = b + 2;
  for (int l = 0; l < 16; ++l) {
    y[l] = d * (static_cast<int>(q[l] & 0xF) - 8);
    y[l + 16] = d * (static_cast<int>(q[l] >> 4) - 8);
  }
}

inline void dq_q4_1(const uint8_t* b, float* y) {
  const float d = half_to_float(b), m = half_to_float(b + 2);
  const uint8_t* q = b + 4;
  for (int l = 0; l < 16; ++l) {
    y[l] = d * (q[l] & 0xF) + m;
    y[l + 16] = d * (q[l] >> 4) + m;
  }
}

inline void dq_q5(const uint8_t* qh_bytes, const uint8_t* q, float d, float offset, float* y) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int l = 0; l < 16; ++l) {
    const int lo = (q[l] & 0xF) | (((qh >> l) & 1) << 4);
    const int hi = (q[l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
    y[l] = d * lo + offset;
    y[l + 16] = d * hi + offset;
  }
}

inline void dq_q5_0(const uint8_t* b, float* y) {
  const float d = half_to_float(b);
  dq_q5(b + 2, b + 6, d, -16.0f * d, y);
}

inline void dq_q5_1(const uint8_t* b, float* y) {
  dq_q5(b + 4, b + 8, half_to_float(b), half_to_float(b + 2), y);
}

inline void dq_q8_0(const uint8_t* b, float* y) {
  const float d = half_to_float(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int l = 0; l < 32; ++l) y[l] = d * q[l];
}

inline void dq_q4_k(const uint8_t* b, float* y) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int c = 0; c < 4; ++c, q += 32, y += 64) {
    float s0, m0, s1, m1;
    k_scale_min(scales, 2 * c, s0, m0);
    k_scale_min(scales, 2 * c + 1, s1, m1);
    const float d0 = d * s0, o0 = dmin * m0, d1 = d * s1, o1 = dmin * m1;
    for (int l = 0; l < 32; ++l) {
      y[l] = d0 * (q[l] & 0xF) - o0;
      y[l + 32] = d1 * (q[l] >> 4) - o1;
    }
  }
}

inline void dq_q5_k(const uint8_t* b, float* y) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* q = b + 48;
  for (int c = 0; c < 4; ++c, q += 32, y += 64) {
    float s0, m0, s1, m1;
    k_scale_min(scales, 2 * c, s0, m0);
    k_scale_min(scales, 2 * c + 1, s1, m1);
    const float d0 = d * s0, o0 = dmin * m0, d1 = d * s1, o1 = dmin * m1;
    for (int l = 0; l < 32; ++l) {
      const int lo = (q[l] & 0xF) | (((qh[l] >> (2 * c)) & 1) << 4);
      const int hi = (q[l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
      y[l] = d0 * lo - o0;
      y[l + 32] = d1 * hi - o1;
    }
  }
}

inline void dq_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_to_float(b + 208);
  for (int h = 0; h < 2; ++h, ql += 64, qh += 32, sc += 8, y += 128) {
    for (int s = 0; s < 4; ++s) {
      const uint8_t* low = ql + 32 * (s & 1);
      const int shift = 4 * (s >> 1);
      const float d0 = d * sc[2 * s], d1 = d * sc[2 * s + 1];
      for (int l = 0; l < 16; ++l) {
        const int q0 = (((low[l] >> shift) & 0xF) | (((qh[l] >> (2 * s)) & 3) << 4)) - 32;
        const int q1 = (((low[l + 16] >> shift) & 0xF) | (((qh[l + 16] >> (2 * s)) & 3) << 4)) - 32;
        y[32 * s + l] = d0 * q0;
        y[32 * s + l + 16] = d1 * q1;
      }
    }
  }
}

template <void (*Block)(const uint8_t*, float*), int64_t kElems, int64_t kBytes>
void dq_blocks(const uint8_t* row, float* y, int64_t K) {
  for (int64_t i = 0; i < K / kElems; ++i) Block(row + i * kBytes, y + i * kElems);
}

void dequantize_row(int64_t qtype, const uint8_t* row, float* y, int64_t K) {
  switch (qtype) {
    case F32: std::memcpy(y, row, K * sizeof(float)); return;
    case F16: crane_mp::widen(reinterpret_cast<const c10::Half*>(row), y, K); return;
    case BF16: crane_mp::widen(reinterpret_cast<const c10::BFloat16*>(row), y, K); return;
    case Q4_0: return dq_blocks<dq_q4_0, 32, 18>(row, y, K);
    case Q4_1: return dq_blocks<dq_q4_1, 32, 20>(row, y, K);
    case Q5_0: return dq_blocks<dq_q5_0, 32, 22>(row, y, K);
    case Q5_1: return dq_blocks<dq_q5_1, 32, 24>(row, y, K);
    case Q8_0: return dq_blocks<dq_q8_0, 32, 34>(row, y, K);
    case Q4_K: return dq_blocks<dq_q4_k, 256, 144>(row, y, K);
    case Q5_K: return dq_blocks<dq_q5_k, 256, 176>(row, y, K);
    case Q6_K: return dq_blocks<dq_q6_k, 256, 210>(row, y, K);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

void check_weight(const at::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "gguf weights must be a contiguous CPU uint8 [N, row_bytes] tensor");
  const Layout lay = layout_of(qtype);
  TORCH_CHECK(K % lay.block == 0 && w.size(1) == K / lay.block * lay.bytes, "gguf weight rows of ", w.size(1),
              " bytes do not hold ", K, " elements of type ", qtype);
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

// Up to this many activation rows, one dequantized weight row is dotted with each of them;
// above it, the GEMM's blocking wins (measured in benchmarks/gguf_kernels.py).
constexpr int64_t kGemvMaxRows = 4;
// Rows per dequantized slab in the GEMM path: ~512 KB, so the slab stays in L2 while the GEMM reads it.
constexpr int64_t kSlabBytes = 512 * 1024;

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
    at::parallel_for(0, N, crane_mp::parallel_grain(K * M), [&](int64_t begin, int64_t end) {
      std::vector<float> row(K);
      for (int64_t n = begin; n < end; ++n) {
        dequantize_row(qtype, src + n * row_bytes, row.data(), K);
        for (int64_t m = 0; m < M; ++m) ys[m * N + n] = dot(row.data(), xs + m * K, K);
      }
    });
  } else {
    const int64_t slab_rows = std::max<int64_t>(16, kSlabBytes / (K * 4)) / 16 * 16;
    at::Tensor slab = at::empty({std::min(slab_rows, N), K}, x.options());
    for (int64_t n0 = 0; n0 < N; n0 += slab_rows) {
      const int64_t rows = std::min(slab_rows, N - n0);
      float* dst = slab.data_ptr<float>();
      at::parallel_for(0, rows, crane_mp::parallel_grain(K), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) dequantize_row(qtype, src + (n0 + r) * row_bytes, dst + r * K, K);
      });
      out.narrow(1, n0, rows).copy_(at::mm(x, slab.narrow(0, 0, rows).t()));
    }
  }
  return x_in.scalar_type() == at::kFloat ? out : out.to(x_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(crane_mp, m) {
  m.def("gguf_linear(Tensor x, Tensor w, int qtype, int K) -> Tensor", &gguf_linear);
  m.def("gguf_dequantize(Tensor w, int qtype, int K) -> Tensor", &gguf_dequantize);
}
