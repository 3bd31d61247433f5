// Vocab-parallel embedding: rows of the table sharded over the group.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace tpx {

// weight: this rank's rows [vocab_start, vocab_start + V_local) of the table, [V_local, D];
// ids: global ids of any shape. Ids this rank does not hold give zero rows; the partial
// results are all-reduced (scatter_dim = None) or reduce-scattered along scatter_dim (a
// dimension of ids). Returns [*ids.shape, D] (scattered: that dim divided by the group size).
at::Tensor vocab_parallel_embedding(const at::Tensor& weight, const at::Tensor& ids,
                                    int64_t vocab_start, const std::string& group_name,
                                    std::optional<int64_t> scatter_dim, int64_t padding_idx);

// vocab_parallel_embedding without scatter_dim, with CPU ids first checked to lie in
// [0, num_embeddings) (a ValueError naming the offending id, raised before any collective;
// num_embeddings < 0 or ids on a GPU: no check here). For the layer's common call; the ids are
// replicated, so every rank raises alike.
at::Tensor vocab_parallel_lookup(const at::Tensor& weight, const at::Tensor& ids,
                                 int64_t vocab_start, int64_t num_embeddings,
                                 const std::string& group_name, int64_t padding_idx);

// Gradient of the local rows: the output gradient (all-gathered first when the forward
// scattered) scatter-added into the rows of the ids this rank holds; the row padding_idx
// (a local index, -1 for none) gets none.
at::Tensor vocab_parallel_embedding_backward(const at::Tensor& grad_out, const at::Tensor& ids,
                                             int64_t vocab_start, int64_t num_local,
                                             int64_t padding_idx, const std::string& group_name,
                                             std::optional<int64_t> scatter_dim);

}  // namespace tpx
