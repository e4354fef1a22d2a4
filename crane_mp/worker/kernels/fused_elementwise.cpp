// Fused elementwise ops for the CPU forward pass: each reads and writes its tensors once, in float.
//
//   rms_norm(x [..., D], weight [D], eps) -> out
//   add_rms_norm_(x, residual, weight, eps): residual += x; x = rms_norm(residual) * weight  (in place)
//   silu_and_mul(gate_up [T, 2I]) -> out [T, I] = silu(gate) * up (one rounding, at the end)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "cpu_vec.h"

namespace {

using crane_mp::narrow;
using crane_mp::widen;

// out = rms_norm(in) * weight, row by row. With `residual`: the row is residual + in, rounded to the
// storage type and written back to the residual before it is normalised, as the unfused ops would.
// `out` may alias `in` (each row is read before it is written).
template <typename scalar_t>
void norm_rows(const scalar_t* in, scalar_t* out, const scalar_t* weight, int64_t rows, int64_t dim, double eps,
               scalar_t* residual) {
  std::vector<float> w(dim);
  widen(weight, w.data(), dim);
  at::parallel_for(0, rows, crane_mp::parallel_grain(dim), [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim), other(dim);
    for (int64_t r = begin; r < end; ++r) {
      widen(in + r * dim, row.data(), dim);
      if (residual != nullptr) {
        widen(residual + r * dim, other.data(), dim);
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) row[d] += other[d];
        narrow(row.data(), residual + r * dim, dim);
        widen(residual + r * dim, row.data(), dim);
      }
      crane_mp::rms_norm_row(row.data(), w.data(), dim, static_cast<float>(eps));
      narrow(row.data(), out + r * dim, dim);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.scalar_type() == weight.scalar_type());
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  TORCH_CHECK(weight.numel() == dim, "norm weight size");
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), rows, dim, eps,
                        nullptr);
  });
  return out;
}

void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes());
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type());
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  TORCH_CHECK(weight.numel() == dim, "norm weight size");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), rows, dim, eps,
                        residual.data_ptr<scalar_t>());
  });
}

template <typename scalar_t>
void silu_rows(const scalar_t* in, scalar_t* out, int64_t rows, int64_t inter) {
  // Rows are split into column chunks too, so a handful of decode rows still uses every thread.
  constexpr int64_t kChunk = 512;
  const int64_t chunks = (inter + kChunk - 1) / kChunk;
  at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    float g[kChunk], u[kChunk];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / chunks, lo = (task % chunks) * kChunk;
      const int64_t n = std::min(kChunk, inter - lo);
      widen(in + r * 2 * inter + lo, g, n);
      widen(in + r * 2 * inter + inter + lo, u, n);
      crane_mp::silu_mul(g, u, n);
      narrow(g, out + r * inter + lo, n);
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0);
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, inter);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(crane_mp, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()", &add_rms_norm_);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", &silu_and_mul);
}
