// The Gated DeltaNet decode step (worker/models/gated_deltanet.py) for a batch of sequences, in place on
// their recurrent states in the state pool:
//
//   gated_delta_step_(q [B, H, K], k [B, H, K], v [B, H, V], g [B, H], beta [B, H], state [slots, H, K, V],
//                     slots [B]) -> out [B, H, V]
//
// with q and k L2-normalised (q also scaled), all float32 but the state (float32, bf16 or f16). Per
// sequence and head, S = state[slots[b], h]:
//
//   S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  out = S^T q
//
// in two passes over S: the first reads it for S^T k, the second writes the new S and sums S^T q from
// it. A head's S (64 KiB at K = V = 128 in float32) stays in L2 between the two, so each step streams
// the state from memory once each way; the torch ops it replaces pass over it about seven times.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "cpu_vec.h"

namespace {

using crane_mp::narrow;
using crane_mp::widen;

template <typename state_t>
void step_head(const float* q, const float* k, const float* v, float g, float beta, state_t* S, int64_t K, int64_t V,
               float* out, float* row, float* delta) {
  const float decay = std::exp(g);
  for (int64_t j = 0; j < V; ++j) delta[j] = 0.f;
  for (int64_t i = 0; i < K; ++i) {  // delta <- S^T k
    widen(S + i * V, row, V);
    const float ki = k[i];
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) delta[j] += row[j] * ki;
  }
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) {
    delta[j] = (v[j] - decay * delta[j]) * beta;
    out[j] = 0.f;
  }
  for (int64_t i = 0; i < K; ++i) {  // S <- decay S + k delta^T; out += S^T q
    widen(S + i * V, row, V);
    const float ki = k[i], qi = q[i];
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) {
      const float s = decay * row[j] + ki * delta[j];
      row[j] = s;
      out[j] += s * qi;
    }
    narrow(row, S + i * V, V);
  }
}

at::Tensor gated_delta_step_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                             const at::Tensor& beta, at::Tensor& state, const at::Tensor& slots) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0) &&
                  v.size(1) == q.size(1), "gated_delta_step_: q, k [B, H, K] and v [B, H, V]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  g.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat,
              "gated_delta_step_: q, k, v, g and beta are float32");
  const int64_t B = q.size(0), H = q.size(1), K = q.size(2), V = v.size(2);
  TORCH_CHECK(state.dim() == 4 && state.size(1) == H && state.size(2) == K && state.size(3) == V &&
                  state.is_contiguous(), "gated_delta_step_: state [slots, H, K, V], contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == B, "gated_delta_step_: slots [B] int64");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor gc = g.contiguous(), bc = beta.contiguous(), sc = slots.contiguous();
  at::Tensor out = at::empty({B, H, V}, q.options());
  const int64_t* slot = sc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < state.size(0), "gated_delta_step_: slot ", slot[b], " out of range");
  const float *qp = qc.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  const float *gp = gc.data_ptr<float>(), *bp = bc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  crane_mp::dispatch_kv(state.scalar_type(), [&](auto type_tag) {
    using state_t = decltype(type_tag);
    state_t* base = state.data_ptr<state_t>();
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> row(V), delta(V);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / H, h = item % H;
        step_head(qp + item * K, kp + item * K, vp + item * V, gp[item], bp[item],
                  base + (slot[b] * H + h) * K * V, K, V, op + item * V, row.data(), delta.data());
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(crane_mp, m) {
  m.def("gated_delta_step_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, Tensor slots) "
        "-> Tensor", &gated_delta_step_);
}
