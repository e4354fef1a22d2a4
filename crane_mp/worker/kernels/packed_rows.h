// The front of an embedding lookup from a packed LM-head weight (AMX's layout or ours): every token id
// checked against the vocabulary, and the output [..., width] allocated in the ids' shape.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace crane_mp {

struct RowLookup {
  at::Tensor ids;  // flat, contiguous int64
  at::Tensor out;  // ids' shape + [width]
};

inline RowLookup packed_row_lookup(const at::Tensor& ids, int64_t vocab, int64_t width,
                                   const at::TensorOptions& options) {
  TORCH_CHECK(ids.scalar_type() == at::kLong, "token ids must be int64");
  at::Tensor flat = ids.reshape({-1}).contiguous();
  const int64_t* idp = flat.data_ptr<int64_t>();
  for (int64_t t = 0; t < flat.numel(); ++t)
    TORCH_CHECK(idp[t] >= 0 && idp[t] < vocab, "token id ", idp[t], " is out of range for a vocabulary of ", vocab);
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(width);
  return {flat, at::empty(shape, options)};
}

}  // namespace crane_mp
