// Fused elementwise ops for the CPU forward pass: each reads and writes its tensors once, in float.
//
//   rms_norm(x [rows, D] or [T, N, D], weight [D] or [N, D], eps) -> out
//   add_rms_norm_(x, residual, weight, eps): residual += x; x = rms_norm(residual) * weight  (in place)
//   silu_and_mul(gate_up [T, 2I]) -> out [T, I] = silu(gate) * up (one rounding, at the end)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

// weight_rows > 1: row r uses weight row (r % weight_rows) (per-head norms over [T, N, D]).
template <typename scalar_t>
void norm_rows(const scalar_t* in, scalar_t* out, const scalar_t* weight, int64_t rows, int64_t dim,
               int64_t weight_rows, double eps, scalar_t* residual_out, const scalar_t* add) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = in + r * dim;
      float sumsq = 0.f;
      if (add != nullptr) {
        // residual (xr) += add, rounded to the storage type first, as the unfused ops would.
        scalar_t* rr = residual_out + r * dim;
        const scalar_t* ar = add + r * dim;
        for (int64_t d = 0; d < dim; ++d) {
          const scalar_t v = static_cast<scalar_t>(static_cast<float>(rr[d]) + static_cast<float>(ar[d]));
          rr[d] = v;
          const float f = static_cast<float>(v);
          sumsq += f * f;
        }
        xr = rr;
      } else {
#pragma omp simd reduction(+ : sumsq)
        for (int64_t d = 0; d < dim; ++d) {
          const float f = static_cast<float>(xr[d]);
          sumsq += f * f;
        }
      }
      const float scale = 1.f / std::sqrt(sumsq / static_cast<float>(dim) + static_cast<float>(eps));
      const scalar_t* wr = weight + (weight_rows > 1 ? (r % weight_rows) * dim : 0);
      scalar_t* orow = out + r * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d)
        orow[d] = static_cast<scalar_t>(static_cast<float>(xr[d]) * scale * static_cast<float>(wr[d]));
    }
  });
}

int64_t weight_rows_of(const at::Tensor& weight) { return weight.dim() == 2 ? weight.size(0) : 1; }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.scalar_type() == weight.scalar_type());
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), rows, dim,
                        weight_rows_of(weight), eps, nullptr, nullptr);
  });
  return out;
}

void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes());
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_", [&] {
    norm_rows<scalar_t>(residual.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), rows,
                        dim, weight_rows_of(weight), eps, residual.data_ptr<scalar_t>(), x.data_ptr<scalar_t>());
  });
}

template <typename scalar_t>
void silu_rows(const scalar_t* in, scalar_t* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> g(inter), u(inter);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gr = in + r * 2 * inter;
      const scalar_t* ur = gr + inter;
      // Widen first, then run the exp over plain float arrays so it vectorises (libmvec).
      for (int64_t i = 0; i < inter; ++i) g[i] = static_cast<float>(gr[i]);
      for (int64_t i = 0; i < inter; ++i) u[i] = static_cast<float>(ur[i]);
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
      scalar_t* orow = out + r * inter;
      for (int64_t i = 0; i < inter; ++i) orow[i] = static_cast<scalar_t>(g[i]);
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
