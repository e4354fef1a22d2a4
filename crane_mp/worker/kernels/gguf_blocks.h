// GGUF block layouts shared by the CPU matmul kernels (gguf_matmul.cpp: float activations,
// gguf_int8.cpp: 8-bit activations): ggml's type ids, bytes and elements per block, the float16
// fields, the weight-tensor check. Layouts follow llama.cpp's ggml-common.h.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace crane_mp::gguf {

// ggml's type ids (GGMLQuantizationType in the gguf package).
enum QType : int64_t { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13,
                       Q6_K = 14, BF16 = 30, MXFP4 = 39 };

struct Layout {
  int64_t block;  // elements per block
  int64_t bytes;  // bytes per block
};

inline Layout layout_of(int64_t qtype) {
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
    case MXFP4: return {32, 17};
  }
  TORCH_CHECK(false, "gguf: unsupported GGML type ", qtype);
}

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// MXFP4 (gpt-oss's experts): a block is one E8M0 exponent byte e, then 16 bytes of 4-bit codes,
// element l in the low nibble of byte l (l < 16) or the high nibble of byte l - 16. Weight =
// kMxfp4Values[code] * 2^(e - 128): the e2m1 values doubled, so that they are integers.
alignas(16) inline constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 128) as a float, exactly (e < 2: a subnormal).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
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

inline void check_weight(const at::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "gguf weights must be a contiguous CPU uint8 [N, row_bytes] tensor");
  const Layout lay = layout_of(qtype);
  TORCH_CHECK(K > 0, "gguf weights need at least one column");
  TORCH_CHECK(K % lay.block == 0 && w.size(1) == K / lay.block * lay.bytes, "gguf weight rows of ", w.size(1),
              " bytes do not hold ", K, " elements of type ", qtype);
}

}  // namespace crane_mp::gguf
