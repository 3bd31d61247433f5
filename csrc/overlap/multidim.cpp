// Multi-dimensional tensor parallelism in the overlap engine.
//
// Notation (Y = X A, A = W^T with W the nn.Linear weight [out, in]; B rows of X after the
// leading dimensions are flattened, k = in features, n = out features):
//
// 2-D (SUMMA, q x q ranks; Xu et al., "An Efficient 2D Method for Training Super-Large Deep
// Learning Models", arXiv:2104.05343; van de Geijn & Watts, SUMMA, 1997). Rank (i, j) has
// coordinate i along the mesh dimension "row" and j along "col". It holds
//   X_ij  = rows block i (B/q), feature block j (k/q) of X
//   A_ij  = in block i (k/q), out block j (n/q) of A, stored as W_ji = A_ij^T  [n/q, k/q]
//   Y_ij  = rows block i, out block j                                         [B/q, n/q]
// so "row" splits the batch and the contraction rows of A, "col" splits the features.
// The group `row_group` holds the ranks of one mesh column (varying i, fixed j), the group
// `col_group` those of one mesh row (varying j, fixed i); a rank's index in them is i, j.
//   forward   Y_ij  = sum_l X_il A_lj:  step l broadcasts X_il over col_group (root l) and
//             W_lj over row_group (root l), then one GEMM accumulates X_il W_lj^T.
//   backward  dX_il = sum_j dY_ij A_lj^T = sum_j dY_ij W_lj: step l broadcasts W_lj over
//             row_group (root l); rank (i, j) computes dY_ij W_lj and the partials are
//             reduced over col_group to root l, which is rank (i, l).
//             dA_lj = sum_i X_il^T dY_ij, i.e. dW_lj = sum_i dY_ij^T X_il: step l
//             broadcasts X_il over col_group (root l); the partials dY_ij^T X_il are reduced
//             over row_group to root l, which is rank (l, j).
//             dbias_j = sum over the rows of every dY_ij: all-reduced over row_group.
// Pipelining: the broadcasts of step l+1 are in flight while the GEMM(s) of step l run, and
// the reductions of step l while those of step l+1 run (two staging buffers per product).
//
// 2.5-D (d x q x q; Wang et al., "2.5-dimensional distributed model training",
// arXiv:2105.14500): each depth layer is a 2-D grid over its own rows of X (the batch is
// split over depth, then over row), the weight blocks are replicated over depth, so the
// forward and the input gradient are the 2-D ops and the weight and bias gradients are
// additionally all-reduced over `depth_group`.
//
// 3-D (q x q x q; Bian et al., "Maximizing Parallelism in Distributed Training for Huge
// Neural Networks", arXiv:2105.14450). The mesh dimensions are "input" (coordinate i) and two
// activation dimensions: `hidden` (coordinate h) splits the input features of this layer and
// `batch` (coordinate o) splits, with "input", the batch. Rank (i, o, h) holds
//   X_ioh = rows block (i, o) (B/q^2), feature block h (k/q)
//   W_(o,i),h = out block o*q + i (n/q^2), in block h (k/q)  [A_h,(o,i) in A's blocks]
//   Y_ioh = rows block (i, h) (B/q^2), out block o (n/q)
// forward: all-gather X over batch_group (-> X_ih: rows block i, in block h), all-gather W
// over input_group (-> W_oh: out block o, in block h), P = X_ih W_oh^T (partial over h),
// reduce-scatter P over hidden_group along the rows (rank h gets rows sub-block h).
// The output is split in features by the `batch` mesh dimension of this layer: the next
// 3-D layer takes the two activation dimensions swapped (the layers alternate).
// backward: all-gather dY over hidden_group (-> dY_io: rows block i, out block o);
// dX_ih = dY_io W_oh (partial over o) reduce-scattered over batch_group along the rows;
// dW_oh = dY_io^T X_ih (partial over i) reduce-scattered over input_group along its rows.
// Chunked: the gathers of row chunk c+1 are in flight during chunk c's GEMMs, and chunk c's
// reduce-scatter runs while chunk c+1 is computed.
#include "overlap/multidim.h"

#include "common/gemm.h"
#include "common/process_group.h"
#include "overlap/collective_matmul.h"

#include <algorithm>
#include <array>
#include <vector>

namespace tpx {
namespace {

using c10d::ProcessGroup;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using OptTensor = std::optional<at::Tensor>;

// Waits for every work, even after one failed (then rethrows the first failure): the ranks
// stay in step. A two-rank exchange dropped unwaited by an exception completes itself (see
// common/process_group.cpp); gloo's other collectives run to the end on its worker thread.
void wait_all(std::vector<WorkPtr>& works) {
  Pending pending;
  pending.works = std::move(works);
  works.clear();
  pending.wait();
}

int64_t lead_rows(const at::Tensor& t) {
  int64_t r = 1;
  for (int64_t d = 0; d < t.dim() - 1; ++d) r *= t.size(d);
  return r;
}

void check_linear(const char* op, const at::Tensor& x, const at::Tensor& w,
                  const OptTensor& bias) {
  TORCH_CHECK_VALUE(x.dim() >= 2, "tpx.", op, ": `x` must have at least 2 dimensions "
                    "([batch, ..., features]); got shape ", x.sizes());
  TORCH_CHECK_VALUE(w.dim() == 2, "tpx.", op, ": `weight` must be the 2-D block [out_local, "
                    "in_local] of an nn.Linear weight; got shape ", w.sizes());
  TORCH_CHECK_VALUE(x.size(-1) == w.size(1), "tpx.", op, ": x.size(-1) = ", x.size(-1),
                    " must equal weight.size(1) = ", w.size(1), " (this rank's input features)");
  TORCH_CHECK_VALUE(at::isFloatingType(x.scalar_type()) && x.scalar_type() == w.scalar_type(),
                    "tpx.", op, ": `x` (", x.scalar_type(), ") and `weight` (", w.scalar_type(),
                    ") must be floating point of the same dtype");
  TORCH_CHECK_VALUE(x.device() == w.device(), "tpx.", op, ": `x` is on ", x.device(),
                    " but `weight` is on ", w.device());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->scalar_type() == x.scalar_type() &&
                          bias->device() == x.device(),
                      "tpx.", op, ": `bias` must be 1-D with the dtype and device of `x`; got "
                      "shape ", bias->sizes(), " dtype ", bias->scalar_type());
  }
}

// Two buffers a pipelined step alternates between, and the collectives that still use each.
struct DoubleBuffer {
  std::array<at::Tensor, 2> buf;
  std::array<std::vector<WorkPtr>, 2> busy;
  // The buffer for step `l`, once the collectives of step l-2 that used it are complete.
  at::Tensor take(int64_t l) {
    wait_all(busy[l % 2]);
    return buf[l % 2];
  }
};

}  // namespace

at::Tensor linear_2d(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                     const std::string& row_group, const std::string& col_group,
                     const std::optional<std::string>& depth_group) {
  (void)depth_group;  // the forward is per depth layer; the name is kept for the backward
  check_linear("linear_2d", x, weight, bias);
  auto rowpg = resolve_group(row_group), colpg = resolve_group(col_group);
  const int64_t q = colpg->getSize();
  TORCH_CHECK_VALUE(rowpg->getSize() == q, "tpx.linear_2d: the mesh must be square: the row "
                    "group has ", rowpg->getSize(), " ranks and the col group ", q);
  const int64_t i = rowpg->getRank(), j = colpg->getRank();
  const int64_t m = lead_rows(x), k = x.size(-1), n = weight.size(0);
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->size(0) == n, "tpx.linear_2d: `bias` must hold this rank's ", n,
                      " output features; got ", bias->size(0));
  }
  at::Tensor x2 = x.reshape({m, k}).contiguous();
  at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty(with_last(x.sizes(), n), x.options());
  at::Tensor out2 = out.view({m, n});
  if (q == 1) {
    gemm_into(out2, x2, w.t(), bias);
    return out;
  }
  DoubleBuffer xb{{at::empty_like(x2), at::empty_like(x2)}, {}};
  DoubleBuffer wb{{at::empty_like(w), at::empty_like(w)}, {}};
  struct Step {
    at::Tensor xl, wl;
    std::vector<WorkPtr> works;
  };
  // Step l: X_il arrives over the mesh row (root: the rank of column l), W_lj over the mesh
  // column (root: the rank of row l). The root sends its own block; the others receive into a
  // buffer last read by the GEMM of step l-2, which has completed.
  auto issue = [&](int64_t l) {
    Step s;
    s.xl = j == l ? x2 : xb.take(l);
    s.wl = i == l ? w : wb.take(l);
    s.works.push_back(broadcast(*colpg, s.xl, l));
    s.works.push_back(broadcast(*rowpg, s.wl, l));
    return s;
  };
  Step cur = issue(0);
  for (int64_t l = 0; l < q; ++l) {
    Step next;
    if (l + 1 < q) next = issue(l + 1);
    wait_all(cur.works);
    if (l == 0) {
      gemm_into(out2, cur.xl, cur.wl.t(), bias);
    } else {
      mm_accumulate(out2, cur.xl, cur.wl.t());
    }
    cur = std::move(next);
  }
  return out;
}

std::tuple<OptTensor, OptTensor, OptTensor> linear_2d_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
    const std::string& row_group, const std::string& col_group,
    const std::optional<std::string>& depth_group, bool need_x, bool need_weight,
    bool need_bias) {
  check_linear("linear_2d_backward", x, weight, std::nullopt);
  auto rowpg = resolve_group(row_group), colpg = resolve_group(col_group);
  c10::intrusive_ptr<ProcessGroup> depthpg;
  if (depth_group.has_value()) depthpg = resolve_group(*depth_group);
  const int64_t q = colpg->getSize();
  TORCH_CHECK_VALUE(rowpg->getSize() == q, "tpx.linear_2d_backward: the mesh must be square: "
                    "the row group has ", rowpg->getSize(), " ranks and the col group ", q);
  const int64_t i = rowpg->getRank(), j = colpg->getRank();
  const int64_t m = lead_rows(x), k = x.size(-1), n = weight.size(0);
  TORCH_CHECK_VALUE(grad_out.size(-1) == n && lead_rows(grad_out) == m,
                    "tpx.linear_2d_backward: grad_out of shape ", grad_out.sizes(),
                    " does not match x ", x.sizes(), " and weight ", weight.sizes());
  at::Tensor g2 = grad_out.reshape({m, n}).contiguous();
  at::Tensor x2 = x.reshape({m, k}).contiguous();
  at::Tensor w = weight.contiguous();
  const bool depth = depthpg && depthpg->getSize() > 1;

  OptTensor grad_x, grad_w, grad_b;
  std::vector<WorkPtr> bias_works, tail;
  if (need_bias) {
    grad_b = g2.sum(0);
    if (q > 1) bias_works.push_back(all_reduce(*rowpg, *grad_b));
  }
  at::Tensor gx2, gw;
  if (need_x) {
    grad_x = at::empty(x.sizes(), x.options());
    gx2 = grad_x->view({m, k});
  }
  if (need_weight) {
    grad_w = at::empty({n, k}, x.options());
    gw = *grad_w;
  }
  if (q == 1) {
    if (need_x) mm_into(gx2, g2, w);
    if (need_weight) mm_into(gw, g2.t(), x2);
  } else if (need_x || need_weight) {
    // Staging only for the products that are computed.
    auto pair = [](bool need, const at::Tensor& like) {
      return need ? DoubleBuffer{{at::empty_like(like), at::empty_like(like)}, {}}
                  : DoubleBuffer{};
    };
    DoubleBuffer wb = pair(need_x, w), px = pair(need_x, x2);
    DoubleBuffer xb = pair(need_weight, x2), pw = pair(need_weight, w);
    struct Step {
      at::Tensor wl, xl;
      std::vector<WorkPtr> works;
    };
    // Step l broadcasts W_lj over the mesh column (for dX) and X_il over the mesh row (for dW).
    auto issue = [&](int64_t l) {
      Step s;
      if (need_x) {
        s.wl = i == l ? w : wb.take(l);
        s.works.push_back(broadcast(*rowpg, s.wl, l));
      }
      if (need_weight) {
        s.xl = j == l ? x2 : xb.take(l);
        s.works.push_back(broadcast(*colpg, s.xl, l));
      }
      return s;
    };
    Step cur = issue(0);
    for (int64_t l = 0; l < q; ++l) {
      Step next;
      if (l + 1 < q) next = issue(l + 1);
      wait_all(cur.works);
      if (need_x) {
        // dY_ij W_lj, summed over j at rank (i, l): written straight into dX there.
        at::Tensor dst = j == l ? gx2 : px.take(l);
        mm_into(dst, g2, cur.wl);
        WorkPtr r = reduce_to(*colpg, dst, l);
        (j == l ? tail : px.busy[l % 2]).push_back(r);
      }
      if (need_weight) {
        // dY_ij^T X_il, summed over i at rank (l, j).
        at::Tensor dst = i == l ? gw : pw.take(l);
        mm_into(dst, g2.t(), cur.xl);
        WorkPtr r = reduce_to(*rowpg, dst, l);
        (i == l ? tail : pw.busy[l % 2]).push_back(r);
      }
      cur = std::move(next);
    }
    wait_all(px.busy[0]);
    wait_all(px.busy[1]);
    wait_all(pw.busy[0]);
    wait_all(pw.busy[1]);
  }
  wait_all(tail);
  if (depth && need_weight) tail.push_back(all_reduce(*depthpg, gw));
  wait_all(bias_works);
  if (depth && need_bias) tail.push_back(all_reduce(*depthpg, *grad_b));
  wait_all(tail);
  return {grad_x, grad_w, grad_b};
}

// The row chunks of linear_3d's pipeline, from values every rank shares (the op's `chunks`,
// the local batch rows m, the input features k, the element size): the forward and its
// backward derive the same spans, so the backward can read the chunk-major x_gathered
// (chunk c's block at rows [q * lo, q * (lo + len)), rank r's rows at q * lo + r * len).
static std::vector<Span> chunk_spans_3d(std::optional<int64_t> chunks, int64_t m, int64_t k,
                                        int64_t element_size) {
  const int64_t depth = pipeline_depth(chunks, m, m * k * element_size);
  if (m == 0) return {};  // no rows: no chunk and no collective
  return split_even(m, depth);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_3d(
    const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
    const std::string& input_group, const std::string& batch_group,
    const std::string& hidden_group, std::optional<int64_t> chunks) {
  check_linear("linear_3d", x, weight, bias);
  auto inpg = resolve_group(input_group), batchpg = resolve_group(batch_group),
       hidpg = resolve_group(hidden_group);
  const int64_t q = inpg->getSize();
  TORCH_CHECK_VALUE(batchpg->getSize() == q && hidpg->getSize() == q,
                    "tpx.linear_3d: the mesh must be a cube: group sizes ", q, ", ",
                    batchpg->getSize(), ", ", hidpg->getSize());
  const int64_t m = lead_rows(x), k = x.size(-1), nl = weight.size(0), nq = q * nl;
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->size(0) == nq, "tpx.linear_3d: `bias` must hold the ", nq,
                      " output features of this rank's block column; got ", bias->size(0));
  }
  at::Tensor x2 = x.reshape({m, k}).contiguous();
  at::Tensor w = weight.contiguous();
  auto xg_shape = x.sizes().vec();
  xg_shape[0] *= q;
  at::Tensor xg = gather_buffer(xg_shape, x.options());
  at::Tensor xg2 = xg.view({q * m, k});
  at::Tensor wg = gather_buffer({nq, k}, x.options());
  at::Tensor out = at::empty(with_last(x.sizes(), nq), x.options());
  at::Tensor out2 = out.view({m, nq});
  if (q == 1) {
    xg2.copy_(x2);
    wg.copy_(w);
    gemm_into(out2, x2, w.t(), bias);
    return {out, xg, wg};
  }
  // The bias is added once, before the reduction, by the rank of hidden coordinate 0.
  const OptTensor bias_here = hidpg->getRank() == 0 ? bias : std::nullopt;
  auto gemm = [&](const at::Tensor& dst, const at::Tensor& a) {
    gemm_into(dst, a, wg.t(), bias_here);
  };
  std::vector<WorkPtr> wgather{all_gather_base(*inpg, wg, w)};
  // The gathered input is chunk-major (see chunk_spans_3d): chunk c's block holds every
  // rank's rows [lo, lo + len) in rank order, so each chunk is one flat all-gather (no
  // list-of-views collective: no temporary, no copies on NCCL) and one GEMM whose output
  // block is exactly what the chunk's reduce-scatter sends to each destination.
  const auto spans = chunk_spans_3d(chunks, m, k, x.element_size());
  std::vector<WorkPtr> gathers;
  for (const auto& sp : spans) {
    gathers.push_back(all_gather_base(*batchpg, xg2.narrow(0, q * sp.lo, q * sp.len),
                                         x2.narrow(0, sp.lo, sp.len)));
  }
  wait_all(wgather);
  at::Tensor staging = at::empty({q * m, nq}, x.options());
  std::vector<WorkPtr> scatters;
  for (size_t c = 0; c < spans.size(); ++c) {
    const auto& sp = spans[c];
    gathers[c]->wait();
    at::Tensor stage = staging.narrow(0, q * sp.lo, q * sp.len);
    gemm(stage, xg2.narrow(0, q * sp.lo, q * sp.len));
    scatters.push_back(reduce_scatter_base(*hidpg, out2.narrow(0, sp.lo, sp.len), stage));
  }
  wait_all(scatters);
  return {out, xg, wg};
}

std::tuple<OptTensor, OptTensor, OptTensor> linear_3d_backward(
    const at::Tensor& grad_out, const at::Tensor& x_gathered, const at::Tensor& weight_gathered,
    const std::string& input_group, const std::string& batch_group,
    const std::string& hidden_group, std::optional<int64_t> chunks, bool need_x,
    bool need_weight, bool need_bias) {
  check_linear("linear_3d_backward", x_gathered, weight_gathered, std::nullopt);
  auto inpg = resolve_group(input_group), batchpg = resolve_group(batch_group),
       hidpg = resolve_group(hidden_group);
  const int64_t q = inpg->getSize();
  TORCH_CHECK_VALUE(batchpg->getSize() == q && hidpg->getSize() == q,
                    "tpx.linear_3d_backward: the mesh must be a cube: group sizes ", q, ", ",
                    batchpg->getSize(), ", ", hidpg->getSize());
  const int64_t mq = lead_rows(x_gathered), m = mq / q, k = x_gathered.size(-1);
  const int64_t nq = weight_gathered.size(0), nl = nq / q;
  TORCH_CHECK_VALUE(mq % q == 0 && nq % q == 0 && lead_rows(grad_out) == m &&
                        grad_out.size(-1) == nq,
                    "tpx.linear_3d_backward: grad_out of shape ", grad_out.sizes(),
                    " does not match x_gathered ", x_gathered.sizes(), " and weight_gathered ",
                    weight_gathered.sizes(), " for a group size of ", q);
  OptTensor grad_x, grad_w, grad_b;
  if (!need_x && !need_weight && !need_bias) return {grad_x, grad_w, grad_b};
  at::Tensor g2 = grad_out.reshape({m, nq}).contiguous();
  at::Tensor xg2 = x_gathered.reshape({mq, k});
  at::Tensor wg = weight_gathered.contiguous();
  auto gx_shape = x_gathered.sizes().vec();
  gx_shape[0] /= q;
  at::Tensor gx2, gw_full;
  if (need_x) {
    grad_x = at::empty(gx_shape, x_gathered.options());
    gx2 = grad_x->view({m, k});
  }
  if (need_weight) gw_full = at::zeros({nq, k}, x_gathered.options());
  if (need_bias) grad_b = at::zeros({nq}, x_gathered.options());

  if (q == 1) {
    if (need_x) mm_into(gx2, g2, wg);
    if (need_weight) mm_into(gw_full, g2.t(), xg2);
    if (need_bias) grad_b->copy_(g2.sum(0));
    if (need_weight) grad_w = gw_full;
    return {grad_x, grad_w, grad_b};
  }
  // The forward's chunks (the same spans, from the same shapes): the gathered gradient is
  // staged chunk-major like x_gathered, so chunk c's rows of both line up block for block.
  at::Tensor gg = at::empty({mq, nq}, x_gathered.options());
  const auto spans = chunk_spans_3d(chunks, m, k, x_gathered.element_size());
  std::vector<WorkPtr> gathers, scatters;
  for (const auto& sp : spans) {
    gathers.push_back(all_gather_base(*hidpg, gg.narrow(0, q * sp.lo, q * sp.len),
                                         g2.narrow(0, sp.lo, sp.len)));
  }
  at::Tensor staging;
  if (need_x) staging = at::empty({mq, k}, x_gathered.options());
  for (size_t c = 0; c < spans.size(); ++c) {
    const auto& sp = spans[c];
    gathers[c]->wait();
    at::Tensor gp = gg.narrow(0, q * sp.lo, q * sp.len);
    if (need_x) {
      at::Tensor stage = staging.narrow(0, q * sp.lo, q * sp.len);
      mm_into(stage, gp, wg);
      scatters.push_back(reduce_scatter_base(*batchpg, gx2.narrow(0, sp.lo, sp.len), stage));
    }
    if (need_weight) mm_accumulate(gw_full, gp.t(), xg2.narrow(0, q * sp.lo, q * sp.len));
    if (need_bias) grad_b->add_(gp.sum(0));
  }
  if (need_weight) {
    grad_w = at::empty({nl, k}, x_gathered.options());
    scatters.push_back(reduce_scatter_base(*inpg, *grad_w, gw_full));
  }
  if (need_bias) scatters.push_back(all_reduce(*inpg, *grad_b));
  wait_all(scatters);
  return {grad_x, grad_w, grad_b};
}

at::Tensor mesh_all_reduce(const at::Tensor& x, const std::string& group) {
  auto pg = resolve_group(group);
  at::Tensor out = x.contiguous().clone();
  if (pg->getSize() > 1) {
    std::vector<WorkPtr> works{all_reduce(*pg, out)};
    wait_all(works);  // a failure is raised as a collective's (DistBackendError)
  }
  return out;
}

at::Tensor mesh_all_gather(const at::Tensor& x, const std::string& group) {
  auto pg = resolve_group(group);
  at::Tensor in = x.contiguous();
  auto shape = x.sizes().vec();
  shape.insert(shape.begin(), pg->getSize());
  at::Tensor out = gather_buffer(shape, x.options());
  if (pg->getSize() == 1) {
    out[0].copy_(in);
  } else {
    std::vector<WorkPtr> works{all_gather_base(*pg, out.view({-1}), in.view({-1}))};
    wait_all(works);
  }
  return out;
}

}  // namespace tpx
