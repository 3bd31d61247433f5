#include "overlap/collective_matmul.h"

#include "common/gemm.h"
#include "common/process_group.h"

#include <algorithm>
#include <cstdlib>
#include <vector>

// ProcessGroup::_allgather_base/_reduce_scatter_base are the spelling every supported torch
// release has (>= 2.5); newer releases mark them deprecated in favour of *_single.
#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif

namespace tpx {
namespace {

using c10d::ProcessGroup;
using OptTensor = std::optional<at::Tensor>;

void check_chunks(std::optional<int64_t> chunks) {
  TORCH_CHECK_VALUE(!chunks.has_value() || *chunks >= 1,
                    "tpx: chunks must be >= 1 (or None for the default); got ", *chunks);
}

// The default pipeline depth gives every chunk's collective at least this many bytes: below
// it a collective costs mostly its fixed latency, and splitting it only adds latencies.
constexpr int64_t kMinDefaultChunkBytes = int64_t{1} << 20;

// The pipeline depth for a collective that moves `bytes` per rank in `extent` splittable units.
// Callers pass the size of a buffer whose shape every rank shares (never an uneven shard), so
// all ranks pick the same depth and issue matching collectives.
int64_t pick_chunks(std::optional<int64_t> chunks, int64_t extent, int64_t bytes) {
  int64_t c = chunks.has_value() ? *chunks : default_chunks();
  if (!chunks.has_value()) c = std::min(c, std::max<int64_t>(1, bytes / kMinDefaultChunkBytes));
  return std::max<int64_t>(1, std::min(c, extent));
}

// An explicit chunks=1 asks for the plain, non-overlapped computation. (A default depth of 1,
// picked for a small message, still overlaps that one collective with the weight gradient.)
bool serial_reference(std::optional<int64_t> chunks) { return chunks.has_value() && *chunks == 1; }

int64_t normalize_split_dim(const char* op, const char* name, int64_t dim, int64_t ndim) {
  const int64_t d = dim < 0 ? dim + ndim : dim;
  TORCH_CHECK_VALUE(d >= 0 && d < ndim - 1, "tpx.", op, ": ", name, "=", dim,
                    " is not valid for a ", ndim, "-D input: it must name a dimension other "
                    "than the last one (the contraction dimension k), i.e. lie in [", -ndim,
                    ", ", ndim - 2, "] and not be -1");
  return d;
}

void check_operands(const char* op, const at::Tensor& a, const at::Tensor& b,
                    const OptTensor& bias, int64_t min_a_dim) {
  TORCH_CHECK_VALUE(a.dim() >= min_a_dim, "tpx.", op, ": `a` must have at least ", min_a_dim,
                    " dimensions ([..., k]); got shape ", a.sizes());
  TORCH_CHECK_VALUE(b.dim() == 2, "tpx.", op, ": `b` must be 2-D [k, n] (for a Linear weight "
                    "of shape [n, k] pass weight.t()); got shape ", b.sizes());
  TORCH_CHECK_VALUE(a.size(-1) == b.size(0), "tpx.", op, ": a.size(-1) = ", a.size(-1),
                    " must equal b.size(0) = ", b.size(0), " (a is [..., k], b is [k, n])");
  TORCH_CHECK_VALUE(at::isFloatingType(a.scalar_type()), "tpx.", op,
                    ": `a` must be a floating-point tensor; got dtype ", a.scalar_type());
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type(), "tpx.", op, ": `a` (", a.scalar_type(),
                    ") and `b` (", b.scalar_type(), ") must have the same dtype; cast one");
  TORCH_CHECK_VALUE(a.device() == b.device(), "tpx.", op, ": `a` is on ", a.device(),
                    " but `b` is on ", b.device(), "; move them to the same device");
  if (bias.has_value()) {
    const at::Tensor& c = *bias;
    TORCH_CHECK_VALUE(c.dim() == 1 && c.size(0) == b.size(1), "tpx.", op,
                      ": `bias` must be 1-D of size n = b.size(1) = ", b.size(1),
                      "; got shape ", c.sizes());
    TORCH_CHECK_VALUE(c.scalar_type() == a.scalar_type(), "tpx.", op, ": `bias` (",
                      c.scalar_type(), ") must have the dtype of `a` (", a.scalar_type(), ")");
    TORCH_CHECK_VALUE(c.device() == a.device(), "tpx.", op, ": `bias` is on ", c.device(),
                      " but `a` is on ", a.device());
  }
}

// Rows of the dim-first layout per unit of the leading dimension.
int64_t inner_rows(const at::Tensor& t) {
  int64_t r = 1;
  for (int64_t d = 1; d < t.dim() - 1; ++d) r *= t.size(d);
  return r;
}

// Product of all but the last dimension: the rows of t viewed as a matrix (well defined
// even when the last dimension is empty, unlike reshape({-1, 0})).
int64_t lead_rows(const at::Tensor& t) {
  int64_t r = 1;
  for (int64_t d = 0; d < t.dim() - 1; ++d) r *= t.size(d);
  return r;
}

// The layout of a gathered buffer. The local rows ([extent * inner, f]) are split into
// pipeline chunks (spans of the leading dimension); chunk j of every rank is gathered by one
// all-gather into one contiguous block of the buffer, so the buffer is chunk-major: chunk 0 of
// rank 0, 1, ..., W-1, then chunk 1 of every rank, ... The rank-major order (rank 0's rows,
// then rank 1's, ...) is the order of the product's rows; with one chunk the two coincide.
struct GatherLayout {
  int64_t world, extent, inner;
  std::vector<Span> spans;
  GatherLayout(int64_t world_, int64_t extent_, int64_t inner_, int64_t chunks)
      : world(world_), extent(extent_), inner(inner_), spans(split_even(extent_, chunks)) {}
  int64_t rows(size_t j) const { return spans[j].len * inner; }
  // First row of rank r's chunk j in the chunk-major buffer, and in the rank-major order.
  int64_t staged_row(int64_t r, size_t j) const {
    return (world * spans[j].lo + r * spans[j].len) * inner;
  }
  int64_t rank_major_row(int64_t r, size_t j) const { return (r * extent + spans[j].lo) * inner; }
  bool same_as_rank_major() const { return spans.size() == 1 || world == 1; }
};

// All-gathers the local rows `a2` ([extent * inner, f]) into `staged` ([W * extent * inner,
// f], chunk-major: see GatherLayout) and hands every piece to `on_piece(row, piece)` as soon as
// it is available, `row` being the piece's first row in the rank-major order. One chunk: one
// collective, then one call over all rows (the reference). More: every chunk's all-gather is
// issued first (each a single flat collective into its contiguous block of `staged`, so the
// backend needs no temporary buffer and no copy); this rank's own rows are handed over
// straight from `a2` while they are in flight, then every chunk as it lands.
template <class OnPiece>
void gather_pipeline(ProcessGroup& pg, const at::Tensor& a2, const at::Tensor& staged,
                     const GatherLayout& layout, OnPiece&& on_piece) {
  const int64_t world = pg.getSize(), rank = pg.getRank();
  if (layout.spans.size() == 1) {
    all_gather_base(pg, staged, a2)->wait();
    on_piece(int64_t{0}, staged);
    return;
  }
  // Completed even when a product throws, so the ranks stay in step (see Pending).
  Pending pending;
  pending.group = pg.getGroupName();
  auto& works = pending.works;
  works.reserve(layout.spans.size());
  for (size_t j = 0; j < layout.spans.size(); ++j) {
    const int64_t rows = layout.rows(j);
    works.push_back(all_gather_base(pg, staged.narrow(0, layout.staged_row(0, j), world * rows),
                                    a2.narrow(0, layout.spans[j].lo * layout.inner, rows)));
  }
  on_piece(rank * layout.extent * layout.inner, a2);
  for (size_t j = 0; j < layout.spans.size(); ++j) {
    works[j]->wait();
    for (int64_t r = 0; r < world; ++r) {
      if (r == rank) continue;
      on_piece(layout.rank_major_row(r, j), staged.narrow(0, layout.staged_row(r, j), layout.rows(j)));
    }
  }
}

// The rank-major copy of a chunk-major gathered buffer (none when the layouts coincide).
at::Tensor to_rank_major(const at::Tensor& staged, const GatherLayout& layout) {
  if (layout.same_as_rank_major()) return staged;
  at::Tensor out = at::empty_like(staged);
  for (size_t j = 0; j < layout.spans.size(); ++j) {
    for (int64_t r = 0; r < layout.world; ++r) {
      out.narrow(0, layout.rank_major_row(r, j), layout.rows(j))
          .copy_(staged.narrow(0, layout.staged_row(r, j), layout.rows(j)));
    }
  }
  return out;
}

// Computes the rows of a [W * extent * inner, features] product (rank-major: block d goes to
// rank d) with `produce(dst, row)` and reduce-scatters it into `out2` ([extent * inner,
// features]). chunks == 1: the whole product, then one collective. chunks > 1: chunk j's
// pieces for every destination are computed into one contiguous staging block and its
// reduce-scatter is issued before chunk j+1 is computed. Returns the collectives in flight.
template <class Produce>
Pending scatter_pipeline(ProcessGroup& pg, const at::Tensor& out2, int64_t extent,
                         int64_t inner, int64_t chunks, Produce&& produce) {
  const int64_t world = pg.getSize();
  const int64_t block = extent * inner, features = out2.size(1);
  at::Tensor staging = at::empty({world * block, features}, out2.options());
  Pending pending;
  pending.group = pg.getGroupName();
  pending.keep_alive.push_back(staging);
  if (chunks == 1) {
    produce(staging, int64_t{0});
    pending.works.push_back(reduce_scatter_base(pg, out2, staging));
    return pending;
  }
  int64_t offset = 0;
  for (const auto& sp : split_even(extent, chunks)) {
    const int64_t rows = sp.len * inner;
    at::Tensor stage = staging.narrow(0, offset, world * rows);
    for (int64_t d = 0; d < world; ++d) {
      produce(stage.narrow(0, d * rows, rows), d * block + sp.lo * inner);
    }
    pending.works.push_back(reduce_scatter_base(pg, out2.narrow(0, sp.lo * inner, rows), stage));
    offset += world * rows;
  }
  return pending;
}

// Computes the rows of `out2` ([M, n]) with `produce(dst, row)` chunk by chunk and
// all-reduces every chunk in place while the next one is computed.
template <class Produce>
Pending allreduce_pipeline(ProcessGroup& pg, const at::Tensor& out2, int64_t chunks,
                           Produce&& produce) {
  Pending pending;
  pending.group = pg.getGroupName();
  for (const auto& sp : split_even(out2.size(0), chunks)) {
    at::Tensor dst = out2.narrow(0, sp.lo, sp.len);
    produce(dst, sp.lo);
    pending.works.push_back(all_reduce(pg, dst));
  }
  return pending;
}

}  // namespace

std::vector<int64_t> with_last(at::IntArrayRef sizes, int64_t last) {
  auto v = sizes.vec();
  v.back() = last;
  return v;
}

std::vector<Span> split_even(int64_t n, int64_t parts) {
  std::vector<Span> spans;
  const int64_t base = n / parts, extra = n % parts;
  int64_t lo = 0;
  for (int64_t i = 0; i < parts; ++i) {
    const int64_t len = base + (i < extra ? 1 : 0);
    spans.push_back({lo, len});
    lo += len;
  }
  return spans;
}

int64_t pipeline_depth(std::optional<int64_t> chunks, int64_t extent, int64_t bytes) {
  check_chunks(chunks);
  return pick_chunks(chunks, extent, bytes);
}

int64_t default_chunks() {
  static const int64_t value = [] {
    const char* env = std::getenv("TPX_DEFAULT_CHUNKS");
    if (env == nullptr || *env == '\0') return int64_t{2};
    const long v = std::strtol(env, nullptr, 10);
    TORCH_CHECK_VALUE(v >= 1, "TPX_DEFAULT_CHUNKS must be an integer >= 1; got '", env, "'");
    return static_cast<int64_t>(v);
  }();
  return value;
}

std::tuple<at::Tensor, at::Tensor> all_gather_matmul(
    const at::Tensor& a, const at::Tensor& b, int64_t gather_dim,
    const std::string& group_name, std::optional<int64_t> chunks, const OptTensor& bias) {
  check_operands("all_gather_matmul", a, b, bias, 2);
  check_chunks(chunks);
  const int64_t gd = normalize_split_dim("all_gather_matmul", "gather_dim", gather_dim, a.dim());
  auto pg = resolve_group(group_name);
  const int64_t world = pg->getSize();

  at::Tensor am = a.movedim(gd, 0).contiguous();
  const int64_t extent = am.size(0), inner = inner_rows(am);
  const int64_t k = am.size(-1), n = b.size(1);
  auto gshape = am.sizes().vec();
  gshape[0] *= world;
  // At world size 1 the dim-first copy of `a`, when one was made, already is the result.
  const bool reuse = world == 1 && !am.is_alias_of(a);
  at::Tensor gathered = reuse ? am : world == 1 ? at::empty(gshape, a.options())
                                             : gather_buffer(gshape, a.options());
  at::Tensor out = at::empty(with_last(gshape, n), a.options());
  const int64_t rows = world * extent * inner;
  at::Tensor g2 = gathered.view({rows, k}), out2 = out.view({rows, n});
  at::Tensor a2 = am.view({extent * inner, k});

  if (world == 1) {
    if (!reuse) g2.copy_(a2);
    gemm_into(out2, a2, b, bias);
  } else {
    const GatherLayout layout(world, extent, inner, pick_chunks(chunks, extent, nbytes(a2)));
    gather_pipeline(*pg, a2, g2, layout, [&](int64_t row, const at::Tensor& piece) {
      gemm_into(out2.narrow(0, row, piece.size(0)), piece, b, bias);
    });
  }
  // `out` is handed to user code that may .view() it, so it is returned contiguous: one copy
  // when gather_dim is not the leading dimension (none for [seq, batch, ...] layouts).
  // `gathered` stays in the pipeline's chunk-major order (see all_gather_matmul.h).
  return {gathered.movedim(0, gd), out.movedim(0, gd).contiguous()};
}

std::tuple<OptTensor, OptTensor, OptTensor> all_gather_matmul_backward(
    const at::Tensor& grad_out, const OptTensor& grad_a_gathered, const at::Tensor& a_gathered,
    const at::Tensor& b, int64_t gather_dim, const std::string& group_name,
    std::optional<int64_t> chunks, bool need_a, bool need_b, bool bias_grad) {
  check_operands("all_gather_matmul_backward", a_gathered, b, std::nullopt, 2);
  check_chunks(chunks);
  const int64_t gd =
      normalize_split_dim("all_gather_matmul_backward", "gather_dim", gather_dim, a_gathered.dim());
  auto pg = resolve_group(group_name);
  const int64_t world = pg->getSize();

  at::Tensor gm = grad_out.movedim(gd, 0).contiguous();
  at::Tensor agm = a_gathered.movedim(gd, 0);
  const int64_t total = agm.size(0), inner = inner_rows(agm);
  const int64_t k = agm.size(-1), n = b.size(1);
  TORCH_CHECK_VALUE(total % world == 0, "tpx.all_gather_matmul_backward: gathered size ", total,
                    " along gather_dim does not divide by the group size ", world);
  const int64_t extent = total / world;
  // The forward's gather layout: the same depth it picked for a shard of this shape.
  const int64_t shard_bytes = extent * inner * k * static_cast<int64_t>(a_gathered.element_size());
  const GatherLayout layout(world, extent, inner,
                            world == 1 ? 1 : pick_chunks(chunks, extent, shard_bytes));
  at::Tensor g2 = gm.view({total * inner, n});

  OptTensor grad_a;
  Pending pending;
  if (need_a) {
    at::Tensor bt = b.t();
    OptTensor addend;
    if (grad_a_gathered.has_value()) {
      addend = to_rank_major(
          grad_a_gathered->movedim(gd, 0).contiguous().view({total * inner, k}), layout);
    }
    auto gshape = agm.sizes().vec();
    gshape[0] = extent;
    grad_a = at::empty(gshape, a_gathered.options());
    at::Tensor ga2 = grad_a->view({extent * inner, k});
    auto produce = [&](const at::Tensor& dst, int64_t row) {
      at::Tensor gp = g2.narrow(0, row, dst.size(0));
      if (addend.has_value()) {
        addmm_into(dst, addend->narrow(0, row, dst.size(0)), gp, bt);
      } else {
        mm_into(dst, gp, bt);
      }
    };
    if (world == 1) {
      produce(ga2, 0);
    } else {
      const int64_t c = pick_chunks(chunks, extent, nbytes(ga2));
      pending = scatter_pipeline(*pg, ga2, extent, inner, c, produce);
      if (serial_reference(chunks)) pending.wait();
    }
  }
  // The weight gradient runs while the reduce-scatter of the input gradient is in flight. The
  // gathered input is chunk-major: each rank's chunk meets its rows of the gradient.
  OptTensor grad_b;
  if (need_b) {
    at::Tensor ag2 = agm.contiguous().view({total * inner, k});
    at::Tensor grad_bt = at::empty({n, k}, a_gathered.options());  // [n, k]
    if (layout.same_as_rank_major()) {
      mm_into(grad_bt, g2.t(), ag2);
    } else {
      bool first = true;
      for (size_t j = 0; j < layout.spans.size(); ++j) {
        for (int64_t r = 0; r < world; ++r) {
          at::Tensor gp = g2.narrow(0, layout.rank_major_row(r, j), layout.rows(j));
          at::Tensor ap = ag2.narrow(0, layout.staged_row(r, j), layout.rows(j));
          if (first) {
            mm_into(grad_bt, gp.t(), ap);
            first = false;
          } else {
            mm_accumulate(grad_bt, gp.t(), ap);
          }
        }
      }
    }
    grad_b = grad_bt.t();
  }
  OptTensor grad_bias;
  if (bias_grad) grad_bias = g2.sum(0);
  pending.wait();
  if (grad_a.has_value()) grad_a = grad_a->movedim(0, gd);
  return {grad_a, grad_b, grad_bias};
}

at::Tensor matmul_reduce_scatter(
    const at::Tensor& a, const at::Tensor& b, int64_t scatter_dim,
    const std::string& group_name, std::optional<int64_t> chunks, const OptTensor& bias) {
  check_operands("matmul_reduce_scatter", a, b, bias, 2);
  check_chunks(chunks);
  const int64_t sd =
      normalize_split_dim("matmul_reduce_scatter", "scatter_dim", scatter_dim, a.dim());
  auto pg = resolve_group(group_name);
  const int64_t world = pg->getSize(), rank = pg->getRank();
  TORCH_CHECK_VALUE(a.size(sd) % world == 0, "tpx.matmul_reduce_scatter: a.size(", scatter_dim,
                    ") = ", a.size(sd), " must divide by the group size ", world,
                    " to be scattered; pad that dimension to a multiple of ", world);

  at::Tensor am = a.movedim(sd, 0).contiguous();
  const int64_t total = am.size(0), inner = inner_rows(am), extent = total / world;
  const int64_t k = am.size(-1), n = b.size(1);
  auto oshape = with_last(am.sizes(), n);
  oshape[0] = extent;
  at::Tensor out = at::empty(oshape, a.options());
  at::Tensor out2 = out.view({extent * inner, n});
  at::Tensor a2 = am.view({total * inner, k});

  if (world == 1) {
    gemm_into(out2, a2, b, bias);
  } else {
    // The bias is added once, by rank 0, before the reduction: no extra pass over the output.
    const OptTensor bias_here = rank == 0 ? bias : std::nullopt;
    scatter_pipeline(*pg, out2, extent, inner, pick_chunks(chunks, extent, nbytes(out2)),
                     [&](const at::Tensor& dst, int64_t row) {
                       gemm_into(dst, a2.narrow(0, row, dst.size(0)), b, bias_here);
                     })
        .wait();
  }
  return out.movedim(0, sd).contiguous();  // contiguous for user code, as in all_gather_matmul
}

std::tuple<OptTensor, OptTensor, OptTensor> matmul_reduce_scatter_backward(
    const at::Tensor& grad_out, const at::Tensor& a, const at::Tensor& b, int64_t scatter_dim,
    const std::string& group_name, std::optional<int64_t> chunks, bool need_a, bool need_b,
    bool bias_grad) {
  check_operands("matmul_reduce_scatter_backward", a, b, std::nullopt, 2);
  check_chunks(chunks);
  const int64_t sd =
      normalize_split_dim("matmul_reduce_scatter_backward", "scatter_dim", scatter_dim, a.dim());
  auto pg = resolve_group(group_name);
  const int64_t world = pg->getSize();

  const int64_t total = a.size(sd), extent = total / world;
  const int64_t k = a.size(-1), n = b.size(1);
  at::Tensor gm = grad_out.movedim(sd, 0).contiguous();
  TORCH_CHECK_VALUE(gm.size(0) == extent, "tpx.matmul_reduce_scatter_backward: grad_out has ",
                    gm.size(0), " entries along scatter_dim, expected ", extent);
  const int64_t inner = inner_rows(gm);
  at::Tensor g2 = gm.view({extent * inner, n});
  if (!need_a && !need_b) {
    // Only the (replicated) bias needs a gradient: the sum over every rank's rows, one small
    // all-reduce instead of gathering the whole gradient.
    OptTensor grad_bias;
    if (bias_grad) {
      grad_bias = g2.sum(0);
      if (world > 1) all_reduce(*pg, *grad_bias)->wait();
    }
    return {std::nullopt, std::nullopt, grad_bias};
  }

  at::Tensor am = a.movedim(sd, 0).contiguous();
  at::Tensor a2 = am.view({total * inner, k});
  at::Tensor bt = b.t();
  OptTensor grad_a, grad_bt;
  at::Tensor ga2;
  if (need_a) {
    grad_a = at::empty(am.sizes(), a.options());
    ga2 = grad_a->view({total * inner, k});
  }
  if (need_b) grad_bt = at::empty({n, k}, a.options());
  bool first = true;
  // Every piece of the gathered gradient feeds both products as soon as it lands.
  auto on_piece = [&](int64_t row, const at::Tensor& gp) {
    const int64_t rows = gp.size(0);
    if (need_a) {
      at::Tensor dst = ga2.narrow(0, row, rows);
      mm_into(dst, gp, bt);
    }
    if (need_b) {
      at::Tensor ap = a2.narrow(0, row, rows);
      if (first) {
        mm_into(*grad_bt, gp.t(), ap);
        first = false;
      } else {
        mm_accumulate(*grad_bt, gp.t(), ap);
      }
    }
  };
  at::Tensor gathered = g2;
  if (world == 1) {
    on_piece(0, g2);
  } else {
    gathered = at::empty({total * inner, n}, g2.options());
    const GatherLayout layout(world, extent, inner, pick_chunks(chunks, extent, nbytes(g2)));
    gather_pipeline(*pg, g2, gathered, layout, on_piece);
  }
  OptTensor grad_bias;
  if (bias_grad) grad_bias = gathered.sum(0);  // a sum over all rows: any row order will do
  if (grad_a.has_value()) grad_a = grad_a->movedim(0, sd);
  OptTensor grad_b;
  if (grad_bt.has_value()) grad_b = grad_bt->t();
  return {grad_a, grad_b, grad_bias};
}

at::Tensor matmul_all_reduce(const at::Tensor& a, const at::Tensor& b,
                             const std::string& group_name, std::optional<int64_t> chunks,
                             const OptTensor& bias) {
  check_operands("matmul_all_reduce", a, b, bias, 1);
  check_chunks(chunks);
  auto pg = resolve_group(group_name);
  const int64_t world = pg->getSize(), rank = pg->getRank();
  const int64_t k = a.size(-1), n = b.size(1);
  at::Tensor a2 = a.reshape({lead_rows(a), k});
  at::Tensor out = at::empty(with_last(a.sizes(), n), a.options());
  at::Tensor out2 = out.view({a2.size(0), n});
  if (world == 1) {
    gemm_into(out2, a2, b, bias);
    return out;
  }
  const OptTensor bias_here = rank == 0 ? bias : std::nullopt;
  allreduce_pipeline(*pg, out2, pick_chunks(chunks, a2.size(0), nbytes(out2)),
                     [&](const at::Tensor& dst, int64_t row) {
                       gemm_into(dst, a2.narrow(0, row, dst.size(0)), b, bias_here);
                     })
      .wait();
  return out;
}

std::tuple<OptTensor, OptTensor, OptTensor> matmul_all_reduce_backward(
    const at::Tensor& grad_out, const at::Tensor& a, const at::Tensor& b, bool need_a,
    bool need_b, bool bias_grad) {
  check_operands("matmul_all_reduce_backward", a, b, std::nullopt, 1);
  const int64_t k = a.size(-1), n = b.size(1);
  TORCH_CHECK_VALUE(grad_out.dim() >= 1 && grad_out.size(-1) == n &&
                        lead_rows(grad_out) == lead_rows(a),
                    "tpx.matmul_all_reduce_backward: grad_out ", grad_out.sizes(),
                    " must have the output's shape [..., ", n, "] with the rows of a ",
                    a.sizes());
  at::Tensor g2 = grad_out.reshape({lead_rows(grad_out), n});
  OptTensor grad_a, grad_b, grad_bias;
  if (need_a) {
    grad_a = at::empty(a.sizes(), a.options());
    mm_into(grad_a->view({g2.size(0), k}), g2, b.t());
  }
  if (need_b) grad_b = gemm(g2.t(), a.reshape({lead_rows(a), k})).t();
  if (bias_grad) grad_bias = g2.sum(0);
  return {grad_a, grad_b, grad_bias};
}

at::Tensor local_matmul(const at::Tensor& a, const at::Tensor& b, const OptTensor& bias) {
  check_operands("local_matmul", a, b, bias, 1);
  const int64_t k = a.size(-1), n = b.size(1);
  at::Tensor a2 = a.reshape({lead_rows(a), k});
  at::Tensor out = at::empty(with_last(a.sizes(), n), a.options());
  gemm_into(out.view({a2.size(0), n}), a2, b, bias);
  return out;
}

at::Tensor replicated_matmul(const at::Tensor& a, const at::Tensor& b,
                             const std::string& group_name, std::optional<int64_t> chunks,
                             const OptTensor& bias) {
  check_operands("replicated_matmul", a, b, bias, 1);
  check_chunks(chunks);
  (void)resolve_group(group_name);  // validates the group; the forward needs no communication
  (void)chunks;
  const int64_t k = a.size(-1), n = b.size(1);
  at::Tensor a2 = a.reshape({lead_rows(a), k});
  at::Tensor out = at::empty(with_last(a.sizes(), n), a.options());
  gemm_into(out.view({a2.size(0), n}), a2, b, bias);
  return out;
}

std::tuple<OptTensor, OptTensor, OptTensor> replicated_matmul_backward(
    const at::Tensor& grad_out, const at::Tensor& a, const at::Tensor& b,
    const std::string& group_name, std::optional<int64_t> chunks, bool need_a, bool need_b,
    bool bias_grad) {
  check_operands("replicated_matmul_backward", a, b, std::nullopt, 1);
  check_chunks(chunks);
  auto pg = resolve_group(group_name);
  const int64_t world = pg->getSize();
  const int64_t k = a.size(-1), n = b.size(1);
  at::Tensor g2 = grad_out.reshape({lead_rows(grad_out), n});
  OptTensor grad_a;
  Pending pending;
  if (need_a) {
    at::Tensor bt = b.t();
    grad_a = at::empty(a.sizes(), a.options());
    at::Tensor ga2 = grad_a->view({g2.size(0), k});
    auto produce = [&](const at::Tensor& dst, int64_t row) {
      mm_into(dst, g2.narrow(0, row, dst.size(0)), bt);
    };
    if (world == 1) {
      produce(ga2, 0);
    } else {
      const int64_t c = pick_chunks(chunks, ga2.size(0), nbytes(ga2));
      // The input-gradient all-reduce is issued before the weight-gradient GEMM and waited
      // after it (an explicit chunks=1, the serial reference, waits at once).
      pending = allreduce_pipeline(*pg, ga2, c, produce);
      if (serial_reference(chunks)) pending.wait();
    }
  }
  OptTensor grad_b;
  if (need_b) grad_b = gemm(g2.t(), a.reshape({lead_rows(a), k})).t();
  OptTensor grad_bias;
  if (bias_grad) grad_bias = g2.sum(0);
  pending.wait();
  return {grad_a, grad_b, grad_bias};
}

}  // namespace tpx
