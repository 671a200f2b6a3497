// paddle_hybrid: CPU kernels for the MoE routing ops ERNIE-4.5-MoE (PaddleFormers 1.2, `nn/moe/`)
// calls through `paddle._C_ops`, which Paddle 3.3 registers for GPU and XPU only:
//
//   expand_modality_expert_id, moe_gate_dispatch_partial_nosoftmaxtopk (+ _grad),
//   build_src_rank_and_local_expert_id, moe_combine (+ moe_combine_grad),
//   cal_aux_loss (+ _grad), int_bincount.
//
// Each is integer routing and sums over the tokens: the CPU kernel computes what the GPU kernel
// computes (read from its source), with one fixed order where the GPU leaves one to its threads:
// tokens of an expert in ascending token order, floating-point sums in index order.
//
// How they reach Paddle: each op already exists in Paddle's C++ (its Python wrapper, its eager
// function, its InferMeta and its autograd node are in the CPU wheel); only the kernel factory has
// no CPU entry for its name ("The kernel `expand_modality_expert_id` is not registered").
// `ph_moe_register_cpu_kernels()` puts a CPU entry for each (name, data type) into
// `phi::KernelFactory` as `PD_REGISTER_KERNEL` would, only where none exists, and
// `ph_moe_unregister_cpu_kernels()` removes exactly the entries it put there
// (`paddle_hybrid.dygraph.expert_parallel.moe_kernels` calls both, from the registry).
//
// The eager functions call a kernel through its variadic entry with the argument types of the
// op's definition (read from the CPU wheel's exported `paddle::experimental::<op>` signatures):
// each function below takes exactly those types in that order.  The kernel's data type (the key)
// is chosen by Paddle from an input; the functions read every tensor by its own dtype, so one
// function is registered under each data type a caller may select it by.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "paddle/phi/backends/cpu/cpu_context.h"
#include "paddle/phi/common/data_type.h"
#include "paddle/phi/core/dense_tensor.h"
#include "paddle/phi/core/enforce.h"
#include "paddle/phi/core/kernel_factory.h"
#include "paddle/phi/core/kernel_registry.h"
#include "paddle/phi/core/kernel_utils.h"
#include "paddle/utils/optional.h"

namespace {

using phi::CPUContext;
using phi::DataType;
using phi::DenseTensor;

// -- helpers -------------------------------------------------------------------------------

#define PH_MOE_CHECK(cond, ...) \
  PADDLE_ENFORCE_EQ(static_cast<bool>(cond), true, common::errors::InvalidArgument(__VA_ARGS__))

// Reads element i of an integer tensor of either integer width.
int64_t ReadInt(const DenseTensor& t, int64_t i) {
  switch (t.dtype()) {
    case DataType::INT32:
      return t.data<int32_t>()[i];
    case DataType::INT64:
      return t.data<int64_t>()[i];
    default:
      PH_MOE_CHECK(false, "paddle_hybrid (CPU MoE kernel): an index tensor must be int32 or int64, got %s.",
                   phi::DataTypeToString(t.dtype()).c_str());
  }
  return 0;
}

template <typename Fn>
void DispatchFloat(DataType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case DataType::FLOAT32:
      fn(float{});
      break;
    case DataType::FLOAT64:
      fn(double{});
      break;
    default:
      PH_MOE_CHECK(false, "paddle_hybrid: the CPU kernel of %s takes float32 or float64 values, got %s "
                   "(Paddle's CPU build has no half-precision kernels for the experts either).",
                   op, phi::DataTypeToString(dtype).c_str());
  }
}

void ExpectDtype(const DenseTensor& t, DataType dtype, const char* op, const char* what) {
  PH_MOE_CHECK(t.dtype() == dtype, "paddle_hybrid: %s: %s must be %s (as the GPU kernel reads it), got %s.", op,
               what, phi::DataTypeToString(dtype).c_str(), phi::DataTypeToString(t.dtype()).c_str());
}

// -- expand_modality_expert_id ------------------------------------------------------------------
// out[s, i] = e' with e = expert_id[s, i] (+ i * group_size for grouped experts); with
// num_expert_per_modality n > 0 the id moves into the layout of two modalities per rank:
// (e / n) * 2n + e % n + modality_offset * n.

template <typename T, typename Context>
void ExpandModalityExpertIdKernel(const Context& dev_ctx, const DenseTensor& expert_id,
                                  int64_t num_expert_per_modality, int64_t group_size, int64_t modality_offset,
                                  bool is_group_expert, DenseTensor* expert_id_out) {
  const int64_t numel = expert_id.numel();
  const int64_t k = expert_id.dims().size() >= 2 ? expert_id.dims()[1] : 1;
  expert_id_out->Resize(expert_id.dims());
  auto emit = [&](auto zero) {
    using I = decltype(zero);
    const I* in = expert_id.data<I>();
    I* out = dev_ctx.template Alloc<I>(expert_id_out);
    for (int64_t idx = 0; idx < numel; ++idx) {
      I e = in[idx];
      if (is_group_expert) e += static_cast<I>(idx % k * group_size);
      if (num_expert_per_modality <= 0) {
        out[idx] = e;
        continue;
      }
      const I n = static_cast<I>(num_expert_per_modality);
      out[idx] = static_cast<I>((e / n) * (n * 2) + e % n + static_cast<I>(modality_offset) * n);
    }
  };
  if (expert_id.dtype() == DataType::INT32) {
    emit(int32_t{});
  } else {
    ExpectDtype(expert_id, DataType::INT64, "expand_modality_expert_id", "expert_id");
    emit(int64_t{});
  }
}

// -- moe_gate_dispatch_partial_nosoftmaxtopk ------------------------------------------------------
// x [S, H]; combine_weights [S, k] float32; expert_id [S, k] int32 (the top-k already taken).
// Only experts [start, end) are this rank's.  The (token, slot) pairs routed to them are ordered
// by (expert, slot, token); an expert keeps its first `capacity` pairs in that order (with
// `reverse_token_drop` and no padding: its last `capacity`); kept pairs are ordered by token
// within their expert.  Outputs:
//   y                  [(end-start) * capacity, H] with padding rows of zeros (use_pad), or
//                      [kept, H] (no padding; [1, H] of zeros when nothing is kept)
//   combine_weights_out the input with 0 for every pair not kept here (other ranks' experts,
//                      dropped by capacity)
//   scatter_index      [k, S] int32: row of y holding pair (token s, slot i), 0 where not kept
//   scatter_index_rev  token of each row of y (S for a padding row); 0-d when nothing is kept
//                      without padding
//   expert_offset      [E] int64: pairs per expert over all experts, before capacity
//   expert_nums_local  [E] int64: pairs per local expert (after capacity without padding,
//                      before it with padding, as the GPU kernel counts them)

template <typename T, typename Context>
void MoeGateDispatchPartialNoSoftmaxTopkKernel(const Context& dev_ctx, const DenseTensor& x,
                                               const DenseTensor& combine_weights, const DenseTensor& expert_id,
                                               int64_t k, int64_t capacity, int64_t num_experts, bool use_pad,
                                               int64_t expert_start_index, int64_t expert_end_index,
                                               bool reverse_token_drop, DenseTensor* y,
                                               DenseTensor* combine_weights_out, DenseTensor* scatter_index,
                                               DenseTensor* scatter_index_rev, DenseTensor* expert_offset,
                                               DenseTensor* expert_nums_local) {
  const char* op = "moe_gate_dispatch_partial_nosoftmaxtopk";
  ExpectDtype(combine_weights, DataType::FLOAT32, op, "combine_weights");
  ExpectDtype(expert_id, DataType::INT32, op, "expert_id");
  PH_MOE_CHECK(x.dims().size() == 2, "paddle_hybrid: %s: x must be [tokens, hidden].", op);
  const int64_t S = x.dims()[0];
  const int64_t H = x.dims()[1];
  const int64_t K = k;
  const int64_t E = num_experts;
  PH_MOE_CHECK(combine_weights.numel() == S * K && expert_id.numel() == S * K,
               "paddle_hybrid: %s: combine_weights and expert_id must be [%ld, %ld].", op, S, K);
  PH_MOE_CHECK(0 <= expert_start_index && expert_start_index <= expert_end_index && expert_end_index <= E,
               "paddle_hybrid: %s: expert range [%ld, %ld) outside [0, %ld).", op, expert_start_index,
               expert_end_index, E);
  PH_MOE_CHECK(capacity >= 0, "paddle_hybrid: %s: negative capacity.", op);
  const int* eid = expert_id.data<int>();
  const float* cw_in = combine_weights.data<float>();
  const int64_t n_pairs = S * K;

  // pairs per expert, all experts, before capacity (the GPU's "#ids <= e" differences)
  expert_offset->Resize({E});
  int64_t* global_counts = dev_ctx.template Alloc<int64_t>(expert_offset);
  {
    std::vector<int64_t> leq(E, 0);
    for (int64_t i = 0; i < n_pairs; ++i) {
      const int64_t e = eid[i];
      if (e < E) ++leq[std::max<int64_t>(e, 0)];
    }
    for (int64_t e = 1; e < E; ++e) leq[e] += leq[e - 1];
    for (int64_t e = 0; e < E; ++e) global_counts[e] = leq[e] - (e ? leq[e - 1] : 0);
  }

  // local pairs in (expert, slot, token) order; `src` numbers a pair slot-major: i * S + s
  std::vector<int64_t> pair_expert;
  std::vector<int64_t> pair_src;
  pair_expert.reserve(n_pairs);
  pair_src.reserve(n_pairs);
  {
    // bucket by (expert - start, slot), tokens ascending inside each bucket
    const int64_t n_local = expert_end_index - expert_start_index;
    std::vector<std::vector<int64_t>> buckets(n_local * K);
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t i = 0; i < K; ++i) {
        const int64_t e = eid[s * K + i];
        if (e >= expert_start_index && e < expert_end_index) {
          buckets[(e - expert_start_index) * K + i].push_back(i * S + s);
        }
      }
    }
    for (int64_t b = 0; b < n_local * K; ++b) {
      for (int64_t src : buckets[b]) {
        pair_expert.push_back(expert_start_index + b / K);
        pair_src.push_back(src);
      }
    }
  }
  expert_nums_local->Resize({E});
  int64_t* local_counts = dev_ctx.template Alloc<int64_t>(expert_nums_local);
  std::fill(local_counts, local_counts + E, 0);
  for (int64_t e : pair_expert) ++local_counts[e];

  // capacity without padding: each expert keeps its first (reverse: last) `capacity` pairs
  if (!use_pad) {
    std::vector<int64_t> kept_expert;
    std::vector<int64_t> kept_src;
    size_t begin = 0;
    while (begin < pair_expert.size()) {
      size_t end = begin;
      while (end < pair_expert.size() && pair_expert[end] == pair_expert[begin]) ++end;
      const int64_t n = static_cast<int64_t>(end - begin);
      const int64_t drop = std::max<int64_t>(n - capacity, 0);
      const size_t from = reverse_token_drop ? begin + drop : begin;
      const size_t to = reverse_token_drop ? end : end - drop;
      for (size_t j = from; j < to; ++j) {
        kept_expert.push_back(pair_expert[j]);
        kept_src.push_back(pair_src[j]);
      }
      begin = end;
    }
    pair_expert.swap(kept_expert);
    pair_src.swap(kept_src);
    std::fill(local_counts, local_counts + E, 0);
    for (int64_t e : pair_expert) ++local_counts[e];
  }

  // combine weights: zero for every pair not kept on this rank
  combine_weights_out->Resize(combine_weights.dims());
  float* cw_out = dev_ctx.template Alloc<float>(combine_weights_out);
  std::fill(cw_out, cw_out + n_pairs, 0.f);

  // rows of y: per local expert, its kept pairs ordered by token
  const int64_t n_rows_pad = (expert_end_index - expert_start_index) * capacity;
  std::vector<int64_t> row_token;  // token of each row (S: padding)
  std::vector<int64_t> row_src;    // pair of each row (-1: padding)
  {
    size_t begin = 0;
    if (use_pad) {
      row_token.assign(n_rows_pad, S);
      row_src.assign(n_rows_pad, -1);
    }
    while (begin < pair_expert.size()) {
      size_t end = begin;
      while (end < pair_expert.size() && pair_expert[end] == pair_expert[begin]) ++end;
      const int64_t e = pair_expert[begin];
      const size_t keep = use_pad ? std::min<size_t>(end - begin, static_cast<size_t>(capacity)) : end - begin;
      std::vector<std::pair<int64_t, int64_t>> rows;  // (token, pair)
      for (size_t j = begin; j < begin + keep; ++j) rows.emplace_back(pair_src[j] % S, pair_src[j]);
      std::stable_sort(rows.begin(), rows.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
      for (size_t r = 0; r < rows.size(); ++r) {
        if (use_pad) {
          row_token[(e - expert_start_index) * capacity + r] = rows[r].first;
          row_src[(e - expert_start_index) * capacity + r] = rows[r].second;
        } else {
          row_token.push_back(rows[r].first);
          row_src.push_back(rows[r].second);
        }
      }
      begin = end;
    }
  }
  const int64_t n_rows = static_cast<int64_t>(row_token.size());

  scatter_index->Resize({K, S});
  int* scatter = dev_ctx.template Alloc<int>(scatter_index);
  std::fill(scatter, scatter + n_pairs, 0);
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t src = row_src[r];
    if (src < 0) continue;
    scatter[src] = static_cast<int>(r);
    const int64_t s = src % S;
    const int64_t i = src / S;
    cw_out[s * K + i] = cw_in[s * K + i];
  }

  const bool nothing_kept = !use_pad && n_rows == 0;
  if (nothing_kept) {
    scatter_index_rev->Resize(common::make_ddim({}));
  } else {
    scatter_index_rev->Resize({n_rows});
  }
  int* rev = dev_ctx.template Alloc<int>(scatter_index_rev);
  if (nothing_kept) {
    rev[0] = 0;
  } else {
    for (int64_t r = 0; r < n_rows; ++r) rev[r] = static_cast<int>(row_token[r]);
  }

  y->Resize({nothing_kept ? 1 : n_rows, H});
  DispatchFloat(x.dtype(), op, [&](auto zero) {
    using V = decltype(zero);
    const V* xs = x.data<V>();
    V* ys = dev_ctx.template Alloc<V>(y);
    std::fill(ys, ys + y->numel(), V(0));
    for (int64_t r = 0; r < n_rows; ++r) {
      if (row_src[r] < 0) continue;
      std::memcpy(ys + r * H, xs + row_token[r] * H, sizeof(V) * H);
    }
  });
}

// The gradient: x_grad[s] = sum over slots i (in order) with combine_weights_out[s, i] > 0 and
// scatter_index[i, s] < rows of y_grad of y_grad[scatter_index[i, s]]; combine_weights_grad is the
// output gradient where the pair was kept, 0 elsewhere.

template <typename T, typename Context>
void MoeGateDispatchPartialNoSoftmaxTopkGradKernel(
    const Context& dev_ctx, const DenseTensor& combine_weights_out, const DenseTensor& scatter_index,
    const DenseTensor& scatter_index_rev, const DenseTensor& expert_offset, const DenseTensor& expert_offset_local,
    const DenseTensor& y_grad, const DenseTensor& combine_weights_out_grad, int64_t k, int64_t capacity, bool use_pad,
    int64_t expert_start_index, int64_t expert_end_index, DenseTensor* x_grad, DenseTensor* combine_weights_grad) {
  const char* op = "moe_gate_dispatch_partial_nosoftmaxtopk_grad";
  ExpectDtype(combine_weights_out, DataType::FLOAT32, op, "combine_weights_out");
  ExpectDtype(scatter_index, DataType::INT32, op, "scatter_index");
  const int64_t S = combine_weights_out.dims()[0];
  const int64_t K = combine_weights_out.dims()[1];
  const int64_t H = y_grad.dims()[1];
  const int64_t n_rows = y_grad.dims()[0];
  const float* cw = combine_weights_out.data<float>();
  const int* scatter = scatter_index.data<int>();  // [K, S]

  combine_weights_grad->Resize(combine_weights_out.dims());
  float* cw_grad = dev_ctx.template Alloc<float>(combine_weights_grad);
  const float* cw_out_grad = combine_weights_out_grad.data<float>();
  for (int64_t j = 0; j < S * K; ++j) cw_grad[j] = cw[j] > 0.f ? cw_out_grad[j] : 0.f;

  x_grad->Resize({S, H});
  DispatchFloat(y_grad.dtype(), op, [&](auto zero) {
    using V = decltype(zero);
    const V* gy = y_grad.data<V>();
    V* gx = dev_ctx.template Alloc<V>(x_grad);
    std::fill(gx, gx + S * H, V(0));
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t i = 0; i < K; ++i) {
        const int64_t row = scatter[i * S + s];
        if (row >= n_rows || !(cw[s * K + i] > 0.f)) continue;
        PH_MOE_CHECK(row >= 0, "paddle_hybrid: %s: negative scatter index %ld.", op, row);
        for (int64_t h = 0; h < H; ++h) gx[s * H + h] += gy[row * H + h];
      }
    }
  });
}

// -- build_src_rank_and_local_expert_id ---------------------------------------------------------
// For the rows of the gathered expert inputs (expert-major, counts from the tensor): the rank
// that owns each row's expert (expert / num_local_experts) and its local index (expert %
// num_local_experts), int32, one per row.

template <typename T, typename Context>
void BuildSrcRankAndLocalExpertIdKernel(const Context& dev_ctx, const DenseTensor& expert_num_global_tensor,
                                        const std::vector<int64_t>& expert_num_global, int64_t num_local_experts,
                                        DenseTensor* src_rank, DenseTensor* local_expert_id) {
  const char* op = "build_src_rank_and_local_expert_id";
  PH_MOE_CHECK(num_local_experts > 0, "paddle_hybrid: %s: num_local_experts must be positive.", op);
  const int64_t n_experts = static_cast<int64_t>(expert_num_global.size());
  PH_MOE_CHECK(expert_num_global_tensor.numel() >= n_experts,
               "paddle_hybrid: %s: the count tensor has %ld entries for %ld experts.", op,
               expert_num_global_tensor.numel(), n_experts);
  const int64_t total = std::accumulate(expert_num_global.begin(), expert_num_global.end(), int64_t{0});
  src_rank->Resize({total});
  local_expert_id->Resize({total});
  int* rank = dev_ctx.template Alloc<int>(src_rank);
  int* local = dev_ctx.template Alloc<int>(local_expert_id);
  int64_t row = 0;
  for (int64_t e = 0; e < n_experts; ++e) {
    const int64_t n = ReadInt(expert_num_global_tensor, e);
    PH_MOE_CHECK(n >= 0 && row + n <= total,
                 "paddle_hybrid: %s: the count tensor (expert %ld: %ld) disagrees with the list (total %ld).", op,
                 e, n, total);
    for (int64_t j = 0; j < n; ++j, ++row) {
      rank[row] = static_cast<int>(e / num_local_experts);
      local[row] = static_cast<int>(e % num_local_experts);
    }
  }
  PH_MOE_CHECK(row == total, "paddle_hybrid: %s: the count tensor sums to %ld, the list to %ld.", op, row, total);
}

// -- moe_combine ---------------------------------------------------------------------------------
// y[s] = sum over slots i (in order, from 0) of combine_weights[s, i] * x[scatter_index[s, i]].

template <typename T, typename Context>
void MoeCombineKernel(const Context& dev_ctx, const DenseTensor& x, const DenseTensor& combine_weights,
                      const DenseTensor& scatter_index, DenseTensor* y) {
  const char* op = "moe_combine";
  ExpectDtype(scatter_index, DataType::INT32, op, "scatter_index");
  PH_MOE_CHECK(combine_weights.dtype() == x.dtype(), "paddle_hybrid: %s: combine_weights must have x's dtype.", op);
  const int64_t S = combine_weights.dims()[0];
  const int64_t K = combine_weights.dims()[1];
  const int64_t rows = x.dims()[0];
  const int64_t H = x.dims()[1];
  const int* index = scatter_index.data<int>();
  y->Resize({S, H});
  DispatchFloat(x.dtype(), op, [&](auto zero) {
    using V = decltype(zero);
    const V* xs = x.data<V>();
    const V* w = combine_weights.data<V>();
    V* ys = dev_ctx.template Alloc<V>(y);
    std::fill(ys, ys + S * H, V(0));
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t i = 0; i < K; ++i) {
        const int64_t r = index[s * K + i];
        PH_MOE_CHECK(r >= 0 && r < rows, "paddle_hybrid: %s: scatter index %ld outside [0, %ld).", op, r, rows);
        const V wi = w[s * K + i];
        for (int64_t h = 0; h < H; ++h) ys[s * H + h] += wi * xs[r * H + h];
      }
    }
  });
}

// The gradient: grad_x[scatter_index[s, i]] gets grad_y[s] * combine_weights[s, i] for each
// nonzero weight (the GPU kernel writes it, each row of x being one pair's; here it is added,
// which is the same for such rows and the true gradient if a row were shared);
// grad_combine_weights_helper[s, i, :] = grad_y[s] * x[scatter_index[s, i]] (summed over the
// hidden size by the caller).

template <typename T, typename Context>
void MoeCombineGradKernel(const Context& dev_ctx, const DenseTensor& x, const DenseTensor& combine_weights,
                          const DenseTensor& scatter_index, const DenseTensor& grad_y, DenseTensor* grad_x,
                          DenseTensor* grad_combine_weights_helper) {
  const char* op = "moe_combine_grad";
  ExpectDtype(scatter_index, DataType::INT32, op, "scatter_index");
  const int64_t S = combine_weights.dims()[0];
  const int64_t K = combine_weights.dims()[1];
  const int64_t rows = x.dims()[0];
  const int64_t H = x.dims()[1];
  const int* index = scatter_index.data<int>();
  grad_x->Resize(x.dims());
  if (grad_combine_weights_helper->numel() != S * K * H) grad_combine_weights_helper->Resize({S, K, H});
  DispatchFloat(x.dtype(), op, [&](auto zero) {
    using V = decltype(zero);
    const V* xs = x.data<V>();
    const V* w = combine_weights.data<V>();
    const V* gy = grad_y.data<V>();
    V* gx = dev_ctx.template Alloc<V>(grad_x);
    V* gw = dev_ctx.template Alloc<V>(grad_combine_weights_helper);
    std::fill(gx, gx + rows * H, V(0));
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t i = 0; i < K; ++i) {
        const int64_t r = index[s * K + i];
        PH_MOE_CHECK(r >= 0 && r < rows, "paddle_hybrid: %s: scatter index %ld outside [0, %ld).", op, r, rows);
        const V wi = w[s * K + i];
        V* gw_row = gw + (s * K + i) * H;
        for (int64_t h = 0; h < H; ++h) {
          if (wi != V(0)) gx[r * H + h] += gy[s * H + h] * wi;
          gw_row[h] = gy[s * H + h] * xs[r * H + h];
        }
      }
    }
  });
}

// -- cal_aux_loss --------------------------------------------------------------------------------
// The load-balancing loss of the gate (float accumulation, as the GPU kernel):
//   seqlen = #dispatch_tokens_mask | sum(tokens_mask) | rows / num_experts * experts, at least clip_min
//   ce[e]  = tokens dispatched to e (dispatch_mask: [e] counts, or [rows, e] summed) / seqlen
//   me[e]  = sum over rows of gate_prob[:, e] / seqlen
//   l_aux  = sum_e ce[e] * me[e] * num_experts (/ moe_k with use_group), times
//            seqlen / max(sum(tokens_mask), clip_min) when tokens_mask is given.
// Its gradient (the scale left out, as on GPU): gate_prob_grad[r, e] = ce[e] * g * num_experts
// (/ moe_k) / seqlen.

template <typename T, typename Context>
void CalAuxLossKernel(const Context& dev_ctx, const DenseTensor& gate_prob, const DenseTensor& dispatch_mask,
                      const paddle::optional<DenseTensor>& tokens_mask,
                      const paddle::optional<DenseTensor>& dispatch_tokens_mask, int64_t num_experts,
                      bool use_group, int64_t moe_k, float clip_min, DenseTensor* l_aux_loss,
                      DenseTensor* seqlen_float, DenseTensor* ce) {
  const char* op = "cal_aux_loss";
  const int64_t R = gate_prob.dims()[0];
  const int64_t C = gate_prob.dims()[1];
  DispatchFloat(gate_prob.dtype(), op, [&](auto zero) {
    using V = decltype(zero);
    const V* gp = gate_prob.data<V>();
    float seqlen = 0.f;
    if (dispatch_tokens_mask) {
      const DenseTensor& m = *dispatch_tokens_mask.get_ptr();
      ExpectDtype(m, DataType::BOOL, op, "dispatch_tokens_mask");
      const bool* md = m.data<bool>();
      for (int64_t j = 0; j < m.dims()[0]; ++j) seqlen += static_cast<float>(md[j]);
    } else if (tokens_mask) {
      const V* tm = tokens_mask.get_ptr()->data<V>();
      for (int64_t r = 0; r < R; ++r) seqlen += static_cast<float>(tm[r]);
    } else {
      seqlen = static_cast<float>(R) / static_cast<float>(num_experts) * static_cast<float>(C);
    }
    seqlen = std::max(seqlen, clip_min);

    std::vector<int64_t> dispatched(C, 0);
    const auto& md = dispatch_mask.dims();
    if (md.size() > 1 && md[1] > 1) {
      PH_MOE_CHECK(md[1] == C, "paddle_hybrid: %s: dispatch_mask has %ld experts, gate_prob %ld.", op, md[1], C);
      for (int64_t r = 0; r < md[0]; ++r) {
        for (int64_t e = 0; e < C; ++e) dispatched[e] += ReadInt(dispatch_mask, r * md[1] + e);
      }
    } else {
      PH_MOE_CHECK(dispatch_mask.numel() >= C, "paddle_hybrid: %s: dispatch_mask has %ld entries for %ld experts.",
                   op, dispatch_mask.numel(), C);
      for (int64_t e = 0; e < C; ++e) dispatched[e] = ReadInt(dispatch_mask, e);
    }

    float scale = 1.f;
    if (tokens_mask) {
      const V* tm = tokens_mask.get_ptr()->data<V>();
      float sum = 0.f;
      for (int64_t r = 0; r < R; ++r) sum += static_cast<float>(tm[r]);
      scale = seqlen / std::max(sum, clip_min);
    }

    ce->Resize({C});
    V* ce_out = dev_ctx.template Alloc<V>(ce);
    float l_aux = 0.f;
    for (int64_t e = 0; e < C; ++e) {
      float sum = 0.f;
      for (int64_t r = 0; r < R; ++r) sum += static_cast<float>(gp[r * C + e]);
      const float ce_val = static_cast<float>(dispatched[e]) / seqlen;
      const float me_val = sum / seqlen;
      l_aux += ce_val * me_val * static_cast<float>(num_experts);
      ce_out[e] = static_cast<V>(ce_val);
    }
    if (use_group) l_aux /= static_cast<float>(moe_k);
    l_aux *= scale;
    V* loss = dev_ctx.template Alloc<V>(l_aux_loss);
    loss[0] = static_cast<V>(l_aux);
    V* sl = dev_ctx.template Alloc<V>(seqlen_float);
    sl[0] = static_cast<V>(seqlen);
  });
}

template <typename T, typename Context>
void CalAuxLossGradKernel(const Context& dev_ctx, const DenseTensor& gate_prob, const DenseTensor& seqlen_float,
                          const DenseTensor& ce, const DenseTensor& l_aux_loss_grad, int64_t num_experts,
                          bool use_group, int64_t moe_k, DenseTensor* gate_prob_grad) {
  const int64_t R = gate_prob.dims()[0];
  const int64_t C = gate_prob.dims()[1];
  gate_prob_grad->Resize(gate_prob.dims());
  DispatchFloat(gate_prob.dtype(), "cal_aux_loss_grad", [&](auto zero) {
    using V = decltype(zero);
    const V* ce_in = ce.data<V>();
    V g = l_aux_loss_grad.data<V>()[0];
    if (use_group) g = g / static_cast<V>(moe_k);
    g *= static_cast<V>(num_experts);
    const V seqlen = seqlen_float.data<V>()[0];
    V* out = dev_ctx.template Alloc<V>(gate_prob_grad);
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t e = 0; e < C; ++e) out[r * C + e] = (ce_in[e] * g) / seqlen;
    }
  });
}

// -- int_bincount --------------------------------------------------------------------------------
// out[v - low] = #{j: x[j] == v} for low <= v < high (values outside are not counted), of the
// integer type `dtype` names (int32 or int64).

template <typename T, typename Context>
void IntBincountKernel(const Context& dev_ctx, const DenseTensor& x, int64_t low, int64_t high, int64_t dtype,
                       DenseTensor* out) {
  const char* op = "int_bincount";
  PH_MOE_CHECK(low < high, "paddle_hybrid: %s: low (%ld) must be below high (%ld).", op, low, high);
  const int64_t bins = high - low;
  std::vector<int64_t> counts(bins, 0);
  for (int64_t j = 0; j < x.numel(); ++j) {
    const int64_t v = ReadInt(x, j);
    if (v >= low && v < high) ++counts[v - low];
  }
  // `dtype` as the Python wrapper passes it: a phi DataType under PIR (INT32 7, INT64 9), a legacy
  // VarType otherwise (INT32 2, INT64 3); the GPU kernel reads it the same two ways.
  const bool int32_out = dtype == static_cast<int64_t>(DataType::INT32) || dtype == 2;
  PH_MOE_CHECK(int32_out || dtype == static_cast<int64_t>(DataType::INT64) || dtype == 3,
               "paddle_hybrid: %s: output dtype (attribute %ld) must be int32 or int64.", op, dtype);
  out->Resize({bins});
  if (int32_out) {
    int32_t* o = static_cast<int32_t*>(dev_ctx.Alloc(out, DataType::INT32));
    for (int64_t b = 0; b < bins; ++b) o[b] = static_cast<int32_t>(counts[b]);
  } else {
    int64_t* o = static_cast<int64_t*>(dev_ctx.Alloc(out, DataType::INT64));
    for (int64_t b = 0; b < bins; ++b) o[b] = counts[b];
  }
}

// -- registration ---------------------------------------------------------------------------------

struct Added {
  std::string name;
  phi::KernelKey key;
};

std::vector<Added>& AddedKernels() {
  static std::vector<Added> added;
  return added;
}

template <typename Fn, Fn fn>
void Register(const char* name, DataType dtype) {
  phi::KernelKey key(phi::Backend::CPU, phi::DataLayout::ALL_LAYOUT, dtype);
  auto& names = phi::KernelFactory::Instance().kernels();
  auto found = names.find(name);
  if (found != names.end() && found->second.find(key) != found->second.end()) return;  // Paddle's or ours already
  phi::Kernel kernel(&phi::KernelImpl<Fn, fn>::Compute,
                     reinterpret_cast<void*>(&phi::KernelImpl<Fn, fn>::VariadicCompute));
  phi::KernelArgsParseFunctor<Fn>::Parse(key, kernel.mutable_args_def());
  names[name][key] = kernel;
  AddedKernels().push_back({name, key});
}

#define PH_REGISTER(NAME, FN, T) \
  Register<decltype(&FN<T, CPUContext>), &FN<T, CPUContext>>(NAME, phi::CppTypeToDataType<T>::Type())

#define PH_REGISTER_INDEX(NAME, FN) \
  PH_REGISTER(NAME, FN, int32_t);   \
  PH_REGISTER(NAME, FN, int64_t)

#define PH_REGISTER_VALUE(NAME, FN) \
  PH_REGISTER(NAME, FN, float);     \
  PH_REGISTER(NAME, FN, double)

}  // namespace

extern "C" {

// Puts a CPU kernel for every (op, data type) that has none into Paddle's kernel factory; returns
// how many it added (0 when called again).
int ph_moe_register_cpu_kernels() {
  const size_t before = AddedKernels().size();
  PH_REGISTER_INDEX("expand_modality_expert_id", ExpandModalityExpertIdKernel);
  PH_REGISTER_VALUE("moe_gate_dispatch_partial_nosoftmaxtopk", MoeGateDispatchPartialNoSoftmaxTopkKernel);
  PH_REGISTER_VALUE("moe_gate_dispatch_partial_nosoftmaxtopk_grad", MoeGateDispatchPartialNoSoftmaxTopkGradKernel);
  PH_REGISTER_INDEX("build_src_rank_and_local_expert_id", BuildSrcRankAndLocalExpertIdKernel);
  PH_REGISTER_VALUE("moe_combine", MoeCombineKernel);
  PH_REGISTER_VALUE("moe_combine_grad", MoeCombineGradKernel);
  PH_REGISTER_VALUE("cal_aux_loss", CalAuxLossKernel);
  PH_REGISTER_VALUE("cal_aux_loss_grad", CalAuxLossGradKernel);
  PH_REGISTER_INDEX("int_bincount", IntBincountKernel);
  return static_cast<int>(AddedKernels().size() - before);
}

// Removes exactly the entries ph_moe_register_cpu_kernels added (an op left with no kernel loses
// its name too, so Paddle's "not registered" message is as before); returns how many.
int ph_moe_unregister_cpu_kernels() {
  auto& names = phi::KernelFactory::Instance().kernels();
  int removed = 0;
  for (const auto& added : AddedKernels()) {
    auto found = names.find(added.name);
    if (found == names.end()) continue;
    removed += static_cast<int>(found->second.erase(added.key));
    if (found->second.empty()) names.erase(found);
  }
  AddedKernels().clear();
  return removed;
}

// How many entries of this library are in the factory now.
int ph_moe_cpu_kernels_registered() { return static_cast<int>(AddedKernels().size()); }

}  // extern "C"
