// CPU kernel of torch.ops.mok.fused_moe and mok.fused_moe_backward.
//
// The math is mok_compile/ops/reference.py, op for op wherever the rounding of
// reduced-precision dtypes depends on it (router, routing, activation, bias
// adds), so results match the reference (and through it Hugging Face). What
// differs is how the work is organised:
//
//   route          ATen ops on [T, E] logits, exactly as the reference
//   dispatch       counting sort of the T*K (token, slot) pairs by expert (stable)
//   experts        rows gathered into contiguous buffers; one at::mm_out per expert
//                  into its slice; experts run in parallel over balanced bins
//                  (BLAS single-threaded inside) when there are enough of them
//   combine        out[t] = sum_k w[t,k] * y[t,k], k in a fixed order
//
// weight_on_input (Llama4): each gathered row is scaled by its routing weight
// before the first GEMM, xs = (x[t] * w[t,k]) rounded to x's dtype, and the
// combine is unweighted, out[t] = sum_k y[t,k].
//
// Determinism: every output element is written by exactly one thread and every
// sum has a fixed order (dX is kept per (token, slot) and summed per token in
// expert order, the order of the reference's index_add_), so two calls give the
// same bits.
//
// Registered as mok_cpu::fused_moe / mok_cpu::fused_moe_backward (CPU key).
// mok_compile/ops/cpu.py builds this file on first use and routes the CPU
// dispatch key of mok::fused_moe here; the public schema lives in library.py.

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// The op's scalar arguments (RoutingSpec + ExpertSpec in mok_compile/ops/spec.py).
struct MoeOptions {
  int64_t top_k;
  std::string routing;
  bool router_is_logits;
  bool router_fp32;
  bool softmax_fp32;
  bool renormalize;
  double renorm_eps;
  double routed_scale;
  int64_t n_group;
  int64_t topk_group;
  bool weights_fp32;
  std::string activation;
  bool gated;
  bool interleaved;
  bool transposed;
  double alpha;
  double limit;
  bool weight_on_input;
  double renorm_min;
  int64_t group_top;
  int64_t identity_experts;  // router choices past the experts: their pairs pass the token through, weighted
  int64_t zero_experts;      // router choices past the experts whose pairs add nothing (Zaya's skip expert)
  double jitter_eps;         // the sparsemixer's mask threshold is 2 * jitter_eps
  bool round_weights;        // fp32 weights rounded through x's dtype (Ergo)
  std::optional<at::ScalarType> round_weights_to;  // ... through this 16-bit dtype instead
  std::string post_norm;     // "none", "rms" or "scaled_rms": a norm of each pair's expert output (spec.ExpertSpec)
  double post_norm_eps;
  double post_norm_offset;
};

Tensor sum_last(const Tensor& t) { return t.sum(at::IntArrayRef{-1}, /*keepdim=*/true); }

// fp32, or fp64 for fp64: where HF calls `.float()` to upcast bf16/fp16, an fp64
// run stays fp64 (the reference's _acc_dtype; fp64 gradcheck needs it).
at::ScalarType acc_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }
Tensor upcast(const Tensor& t) { return t.to(acc_dtype(t.scalar_type())); }

// ----------------------------------------------------------------------------- routing

// [T, E] logits, computed the way the HF router does (reference.router_logits).
Tensor router_logits(const Tensor& x, const Tensor& router, const OptTensor& router_bias, const MoeOptions& o) {
  if (o.router_is_logits) return router;
  if (o.router_fp32) {
    const at::ScalarType acc = acc_dtype(x.scalar_type());
    OptTensor bias = router_bias.has_value() ? OptTensor(router_bias->to(acc)) : std::nullopt;
    return at::linear(x.to(acc), router.to(acc), bias);
  }
  return at::linear(x, router, router_bias);
}

// Group-limited selection (group score: the sum of its `group_top` largest; DeepSeek-V3 2, V2 1): all but the best
// `topk_group` groups get -inf.
Tensor grouped_choice(const Tensor& choice, int64_t n_group, int64_t topk_group, int64_t group_top) {
  const int64_t T = choice.size(0), E = choice.size(1), per_group = E / n_group;
  Tensor group_scores =
      std::get<0>(choice.view({T, n_group, per_group}).topk(group_top, -1)).sum(at::IntArrayRef{-1});
  Tensor group_idx = std::get<1>(at::topk(group_scores, topk_group, -1, /*largest=*/true, /*sorted=*/false));
  Tensor group_mask = at::zeros_like(group_scores).scatter_(1, group_idx, 1);
  Tensor score_mask = group_mask.unsqueeze(-1).expand({T, n_group, per_group}).reshape({T, E});
  return choice.masked_fill(score_mask.to(at::kBool).logical_not(), -INFINITY);
}

// clamp(total, min=renorm_min) + renorm_eps for total = sum(w), each step only where set
// (reference._renorm_denominator).
Tensor renorm_denominator(const Tensor& total, const MoeOptions& o) {
  Tensor denom = total;
  if (o.renorm_min != 0.0) denom = denom.clamp_min(o.renorm_min);
  if (o.renorm_eps != 0.0) denom = denom + o.renorm_eps;
  return denom;
}

// w renormalised and scaled where the options say so (reference._renorm_and_scale).
Tensor renorm_and_scale(Tensor w, const MoeOptions& o) {
  if (o.renormalize) w = w / renorm_denominator(sum_last(w), o);
  if (o.routed_scale != 1.0) w = w * o.routed_scale;
  return w;
}

// expert_scale[ids] in `dtype` (reference._expert_scale_at).
Tensor expert_scale_at(const Tensor& expert_scale, const Tensor& ids, at::ScalarType dtype) {
  return expert_scale.to(dtype).index_select(0, ids.reshape({-1})).view(ids.sizes());
}

// The scores one sparsemixer round drops: (top - s) / max(|s|, top) > 2 * jitter_eps, each op in the scores' dtype
// (reference.sparsemixer_drop).
Tensor sparsemixer_drop(const Tensor& scores, const Tensor& top, double jitter_eps) {
  return ((top - scores) / scores.abs().clamp_min(top)).gt(2 * jitter_eps);
}

// PhiMoE's sparsemixer at inference, op for op (reference.sparsemixer): round r picks the largest score left, its
// weight is the softmax of the scores left that the round keeps, at the pick; the pick is then removed.
std::tuple<Tensor, Tensor> sparsemixer(const Tensor& scores, int64_t top_k, double jitter_eps) {
  Tensor left = scores;
  std::vector<Tensor> weights, ids;
  for (int64_t k = 0; k < top_k; ++k) {
    auto [top, idx] = left.max(-1, /*keepdim=*/true);
    Tensor gates = at::softmax(left.masked_fill(sparsemixer_drop(scores, top, jitter_eps), -INFINITY), -1);
    weights.push_back(gates.gather(-1, idx));
    ids.push_back(idx);
    left = left.scatter(-1, idx, -INFINITY);
  }
  return {at::cat(weights, -1), at::cat(ids, -1)};
}

// Round k's softmax [T, K, E] of the sparsemixer at the forward's picks, on `l` (the logits in the backward's
// dtype), over the experts the forward kept: the masks come from `scores` in the forward's dtype
// (reference.sparsemixer_gates).
Tensor sparsemixer_gates(const Tensor& scores, const Tensor& l, const Tensor& ids, double jitter_eps) {
  Tensor left = l;
  std::vector<Tensor> gates;
  for (int64_t k = 0; k < ids.size(1); ++k) {
    Tensor idx = ids.slice(1, k, k + 1);
    gates.push_back(at::softmax(left.masked_fill(sparsemixer_drop(scores, scores.gather(1, idx), jitter_eps),
                                                 -INFINITY), -1));
    left = left.scatter(1, idx, -INFINITY);
  }
  return at::stack(gates, 1);
}

// The steps every routing ends with: renormalise, scale, the per-expert scale, the cast
// (reference._finish_weights).
std::tuple<Tensor, Tensor> finish_weights(Tensor w, const Tensor& ids, const OptTensor& expert_scale,
                                          at::ScalarType x_dtype, const MoeOptions& o) {
  w = renorm_and_scale(w, o);
  if (expert_scale.has_value()) {
    w = w * expert_scale_at(*expert_scale, ids, at::promote_types(w.scalar_type(), expert_scale->scalar_type()));
  }
  if (o.round_weights_to) {
    w = w.to(*o.round_weights_to);
  } else if (o.round_weights) {
    w = w.to(x_dtype);
  }
  return {w.to(o.weights_fp32 ? acc_dtype(x_dtype) : x_dtype), ids};
}

// (topk_weights, topk_ids) with HF's precision behaviour (reference.route). `expert_ids`: the ids, given
// (hash routing); the weights are the scores there. `expert_scale`: each weight times its expert's value, last.
std::tuple<Tensor, Tensor> route(const Tensor& logits, const OptTensor& selection_bias, const OptTensor& expert_ids,
                                 const OptTensor& expert_scale, at::ScalarType x_dtype, const MoeOptions& o) {
  // The values the top-k ranks are `scores` plus the selection bias, which only chooses: the weights start
  // from the unbiased scores at the chosen experts.
  if (o.routing == "sparsemixer") {
    auto [w, picked] = sparsemixer(o.softmax_fp32 ? upcast(logits) : logits, o.top_k, o.jitter_eps);
    return finish_weights(w, picked, expert_scale, x_dtype, o);
  }
  Tensor scores;
  if (o.routing == "softmax_topk") {
    scores = at::softmax(logits, -1, o.softmax_fp32 ? acc_dtype(logits.scalar_type()) : logits.scalar_type());
  } else if (o.routing == "topk_softmax") {
    scores = o.softmax_fp32 ? upcast(logits) : logits;
  } else if (o.routing == "sigmoid_grouped_topk") {
    scores = (o.softmax_fp32 ? upcast(logits) : logits).sigmoid();
  } else if (o.routing == "topk_sigmoid") {
    scores = logits;
  } else if (o.routing == "sqrtsoftplus_topk") {
    scores = at::softplus(o.softmax_fp32 ? upcast(logits) : logits).sqrt();
  } else {
    TORCH_CHECK(false, "mok_cpu.fused_moe: unknown routing '", o.routing, "'");
  }
  Tensor choice = selection_bias.has_value() ? scores + *selection_bias : scores;
  if (o.n_group > 1) choice = grouped_choice(choice, o.n_group, o.topk_group, o.group_top);
  Tensor top, ids;
  if (expert_ids.has_value()) {
    ids = expert_ids->to(at::kLong, /*non_blocking=*/false, /*copy=*/true);  // an output never aliases an input
    const int64_t E = logits.size(1);
    TORCH_CHECK(ids.numel() == 0 || (ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < E),
                "mok_cpu.fused_moe: expert_ids holds ids outside [0, ", E, ")");
    top = scores.gather(1, ids);
  } else if (o.routing == "sigmoid_grouped_topk" || o.routing == "sqrtsoftplus_topk") {
    ids = std::get<1>(at::topk(choice, o.top_k, -1, /*largest=*/true, /*sorted=*/false));
    top = scores.gather(1, ids);
  } else {
    std::tie(top, ids) = at::topk(choice, o.top_k, -1);
    if (selection_bias.has_value()) top = scores.gather(1, ids);
  }
  Tensor w = top;
  if (o.routing == "topk_softmax") {
    w = at::softmax(top, -1, top.scalar_type());
  } else if (o.routing == "topk_sigmoid") {
    w = (o.softmax_fp32 ? upcast(top) : top).sigmoid();
  }
  return finish_weights(w, ids, expert_scale, x_dtype, o);
}

// d(loss)/d(logits) [T, E] from d(loss)/d(topk_weights) (reference.routing_backward); with `expert_scale`, also
// its gradient into `d_scale` (per expert, the sum of d(weights) * unscaled weight over its pairs in pair order).
Tensor routing_backward(const Tensor& logits, const Tensor& ids, Tensor grad_w, const MoeOptions& o,
                        const OptTensor& expert_scale, Tensor* d_scale) {
  Tensor l = logits.to(grad_w.scalar_type());
  Tensor base, w0;
  if (o.routing == "sparsemixer") {
    base = sparsemixer_gates(o.softmax_fp32 ? upcast(logits) : logits, l, ids, o.jitter_eps);
    w0 = base.gather(2, ids.unsqueeze(-1)).squeeze(-1);
  } else if (o.routing == "softmax_topk") {
    base = at::softmax(l, -1);
    w0 = base.gather(1, ids);
  } else if (o.routing == "topk_softmax") {
    w0 = at::softmax(l.gather(1, ids), -1);
  } else if (o.routing == "topk_sigmoid") {
    w0 = at::sigmoid(l.gather(1, ids));
  } else if (o.routing == "sqrtsoftplus_topk") {
    base = at::softplus(l).sqrt();
    w0 = base.gather(1, ids);
  } else {
    base = at::sigmoid(l);
    w0 = base.gather(1, ids);
  }
  if (expert_scale.has_value()) {
    const Tensor w = renorm_and_scale(w0, o);
    *d_scale = at::zeros({expert_scale->size(0)}, grad_w.options())
                   .index_add_(0, ids.reshape({-1}), (grad_w * w).reshape({-1}));
    grad_w = grad_w * expert_scale_at(*expert_scale, ids, grad_w.scalar_type());
  }
  Tensor d = grad_w * o.routed_scale;
  if (o.renormalize) {  // the sum's gradient stops where the clamp holds it at renorm_min
    Tensor total = sum_last(w0);
    Tensor denom = renorm_denominator(total, o);
    Tensor w1 = w0 / denom;
    d = (d - total.ge(o.renorm_min) * sum_last(d * w1)) / denom;
  }
  if (o.routing == "sparsemixer") {  // w0[k] = p_k[id_k]: d l = sum_k d_k w0_k (onehot(id_k) - p_k)
    Tensor dw = d * w0;
    return at::zeros_like(l).scatter_add_(1, ids, dw) - (dw.unsqueeze(-1) * base).sum(at::IntArrayRef{1});
  }
  // Scattered with adds: given ids may name an expert twice in a row, and both slots count.
  if (o.routing == "softmax_topk") {
    Tensor dp = at::zeros_like(l).scatter_add_(1, ids, d);
    return base * (dp - sum_last(base * dp));
  }
  if (o.routing == "topk_softmax") {
    Tensor dtop = w0 * (d - sum_last(w0 * d));
    return at::zeros_like(l).scatter_add_(1, ids, dtop);
  }
  if (o.routing == "topk_sigmoid") {  // d logits[t, ids] = d w0 * w0 * (1 - w0)
    return at::zeros_like(l).scatter_add_(1, ids, d * w0 * (1 - w0));
  }
  Tensor ds = at::zeros_like(l).scatter_add_(1, ids, d);
  if (o.routing == "sqrtsoftplus_topk") {  // d sqrt(softplus(l)) = sigmoid(l) / (2 s); 0 where s underflowed to 0
    return at::where(base > 0, ds * at::sigmoid(l) / (2 * base), at::zeros_like(l));
  }
  return ds * base * (1 - base);
}

// ----------------------------------------------------------------------------- activations

std::pair<Tensor, Tensor> split_gate_up(const Tensor& h, bool interleaved) {
  if (interleaved) return {h.slice(-1, 0, std::nullopt, 2), h.slice(-1, 1, std::nullopt, 2)};
  auto halves = h.chunk(2, -1);
  return {halves[0], halves[1]};
}

// Expert activation on the gate_up output, op by op as HF writes it (reference.activate).
// Runs once over the rows of all experts: elementwise, so grouping does not matter.
Tensor activate(const Tensor& h, const MoeOptions& o) {
  const std::string& act = o.activation;
  if (o.gated) {
    auto [gate, up] = split_gate_up(h, o.interleaved);
    if (act == "silu") return at::silu(gate) * up;
    if (act == "silu_fp32") {  // Beam: in fp32, rounded once
      const at::ScalarType acc = acc_dtype(h.scalar_type());
      return (at::silu(gate.to(acc)) * up.to(acc)).to(h.scalar_type());
    }
    if (act == "gelu_tanh") return at::gelu(gate, "tanh") * up;
    if (act == "clamped_silu") {
      gate = gate.clamp(std::nullopt, o.limit);
      up = up.clamp(-o.limit, o.limit);
      Tensor glu = gate * at::sigmoid(gate * o.alpha);
      return (up + 1) * glu;
    }
    if (act == "clamped_swiglu") return at::silu(gate.clamp(std::nullopt, o.limit)) * up.clamp(-o.limit, o.limit);
    if (act == "softcapped_swiglu") {  // Inkling2: cap(g, alpha) * sigmoid(g) * cap(u, limit), in fp32, rounded once
      const at::ScalarType acc = acc_dtype(h.scalar_type());
      Tensor g = gate.to(acc), u = up.to(acc);
      return (at::tanh(g / o.alpha) * o.alpha * at::sigmoid(g) * (at::tanh(u / o.limit) * o.limit))
          .to(h.scalar_type());
    }
  } else {
    if (act == "relu2") return at::square(at::relu(h));
    if (act == "relu") return at::relu(h);
    if (act == "silu") return at::silu(h);
    if (act == "gelu") return at::gelu(h);
    if (act == "gelu_tanh") return at::gelu(h, "tanh");
  }
  TORCH_CHECK(false, "mok_cpu.fused_moe: unknown activation '", act, "' (gated=", o.gated, ")");
}

Tensor gelu_tanh_grad(const Tensor& x) {
  const double c = std::sqrt(2.0 / M_PI);
  Tensor z = c * (x + 0.044715 * x.pow(3));
  Tensor t = at::tanh(z);
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x);
}

// d(loss)/d(h) given d(loss)/d(activation output) (reference.activation_backward).
Tensor activation_backward(const Tensor& h, const Tensor& da, const MoeOptions& o) {
  const std::string& act = o.activation;
  if (o.gated) {
    auto [g, u] = split_gate_up(h, o.interleaved);
    Tensor dg, du;
    if (act == "silu" || act == "silu_fp32") {
      Tensor sg = at::sigmoid(g);
      dg = da * u * sg * (1 + g * (1 - sg));
      du = da * g * sg;
    } else if (act == "gelu_tanh") {
      dg = da * u * gelu_tanh_grad(g);
      du = da * at::gelu(g, "tanh");
    } else if (act == "clamped_silu") {
      Tensor gc = g.clamp(std::nullopt, o.limit);
      Tensor uc = u.clamp(-o.limit, o.limit);
      Tensor s = at::sigmoid(o.alpha * gc);
      dg = (da * (uc + 1) * (s + o.alpha * gc * s * (1 - s))) * (g <= o.limit);
      du = (da * gc * s) * ((u >= -o.limit) & (u <= o.limit));
    } else if (act == "clamped_swiglu") {
      Tensor gc = g.clamp(std::nullopt, o.limit);
      Tensor uc = u.clamp(-o.limit, o.limit);
      Tensor s = at::sigmoid(gc);
      dg = (da * uc * s * (1 + gc * (1 - s))) * (g <= o.limit);
      du = (da * gc * s) * ((u >= -o.limit) & (u <= o.limit));
    } else if (act == "softcapped_swiglu") {  // d cap(v, c) / dv = 1 - tanh(v / c)^2
      Tensor tg = at::tanh(g / o.alpha), tu = at::tanh(u / o.limit);
      Tensor s = at::sigmoid(g);
      dg = da * (tu * o.limit) * ((1 - tg * tg) * s + tg * o.alpha * s * (1 - s));
      du = da * (tg * o.alpha) * s * (1 - tu * tu);
    } else {
      TORCH_CHECK(false, "mok_cpu.fused_moe_backward: unknown gated activation '", act, "'");
    }
    if (o.interleaved) return at::stack({dg, du}, -1).flatten(-2);
    return at::cat({dg, du}, -1);
  }
  if (act == "relu2") return da * 2 * at::relu(h);
  if (act == "relu") return da * (h > 0);
  if (act == "silu") {
    Tensor s = at::sigmoid(h);
    return da * s * (1 + h * (1 - s));
  }
  if (act == "gelu") {
    return da * (0.5 * (1 + at::erf(h / std::sqrt(2.0))) + h * at::exp(-0.5 * h * h) / std::sqrt(2 * M_PI));
  }
  if (act == "gelu_tanh") return da * gelu_tanh_grad(h);
  TORCH_CHECK(false, "mok_cpu.fused_moe_backward: unknown ungated activation '", act, "'");
}

// ----------------------------------------------------------------------------- dispatch (grouping by expert)

// The T*K (token, slot) pairs sorted by expert, stable (the order of reference.group_by_expert). Pairs sent to
// identity experts (ids E .. E+Z-1) sort after every expert's: rows from `computed_rows` on, which no expert runs.
struct ExpertGroups {
  int64_t top_k = 1;
  int64_t num_experts = 0;            // E: the experts that compute
  int64_t computed_rows = 0;          // offsets[E]: the rows of those experts' pairs
  Tensor order;                       // [T*K] int64: pair index (t*K + k) of each sorted row
  std::vector<int64_t> offsets;       // [E+Z+1]: rows of expert e are offsets[e] .. offsets[e+1]
  std::vector<int64_t> row_of_pair;   // inverse of order
  std::vector<int64_t> token_of_row;  // order // K

  int64_t start(int64_t e) const { return offsets[e]; }
  int64_t count(int64_t e) const { return offsets[e + 1] - offsets[e]; }
};

// `past_experts`: the router's choices past the experts (identity or zero experts), whose pairs sort last.
ExpertGroups group_by_expert(const Tensor& topk_ids, int64_t num_experts, int64_t past_experts) {
  ExpertGroups g;
  Tensor ids = topk_ids.to(at::kLong).contiguous();
  const int64_t n = ids.numel();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  const int64_t choices = num_experts + past_experts;
  g.top_k = ids.size(1);
  g.num_experts = num_experts;
  g.offsets.assign(choices + 1, 0);
  for (int64_t p = 0; p < n; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < choices, "mok_cpu.fused_moe: topk_ids holds expert ", id[p],
                ", outside [0, ", choices, ")");
    ++g.offsets[id[p] + 1];
  }
  for (int64_t e = 0; e < choices; ++e) g.offsets[e + 1] += g.offsets[e];
  g.computed_rows = g.offsets[num_experts];
  g.order = at::empty({n}, ids.options());
  int64_t* order = g.order.data_ptr<int64_t>();
  g.row_of_pair.resize(n);
  g.token_of_row.resize(n);
  std::vector<int64_t> next(g.offsets.begin(), g.offsets.end() - 1);
  for (int64_t p = 0; p < n; ++p) {
    const int64_t r = next[id[p]]++;
    order[r] = p;
    g.row_of_pair[p] = r;
    g.token_of_row[r] = p / g.top_k;
  }
  return g;
}

// The rows begin..end of the sorted order, gathered from src [T, H] into a new contiguous [end - begin, H].
Tensor gather_rows(const Tensor& src, const ExpertGroups& g, int64_t begin, int64_t end) {
  Tensor dst = at::empty({end - begin, src.size(1)}, src.options());
  const size_t row_bytes = static_cast<size_t>(src.size(1)) * src.element_size();
  const char* s = static_cast<const char*>(src.const_data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  for (int64_t r = begin; r < end; ++r) {
    std::memcpy(d + (r - begin) * row_bytes, s + g.token_of_row[r] * row_bytes, row_bytes);
  }
  return dst;
}

// Below this many multiply-adds per pass over the experts, one thread does it all:
// opening a parallel region costs more than the work (and on a busy machine a
// worker that is not scheduled stalls the region for a time slice).
constexpr int64_t kMinParallelMacs = int64_t(1) << 22;

// Calls fn(e) once for every expert with rows; `macs_per_row` sizes the work. With
// enough work and at least two experts per thread, experts run in parallel, split
// into one bin per thread of about equal rows (largest expert first into the
// lightest bin); each GEMM is then single-threaded, which beats splitting small
// GEMMs across cores. Otherwise experts run one after another and BLAS decides
// its own threading.
template <typename F>
void for_each_expert(const ExpertGroups& g, int64_t macs_per_row, const F& fn) {
  std::vector<int64_t> active;
  for (int64_t e = 0; e < g.num_experts; ++e) {
    if (g.count(e) > 0) active.push_back(e);
  }
  const int64_t threads = at::get_num_threads();
  const int64_t rows = g.order.numel();
  if (threads < 2 || static_cast<int64_t>(active.size()) < 2 * threads || rows * macs_per_row < kMinParallelMacs ||
      at::in_parallel_region()) {
    for (int64_t e : active) fn(e);
    return;
  }
  std::stable_sort(active.begin(), active.end(), [&](int64_t a, int64_t b) { return g.count(a) > g.count(b); });
  std::vector<std::vector<int64_t>> bins(threads);
  std::vector<int64_t> load(threads, 0);
  for (int64_t e : active) {
    const int64_t b = std::min_element(load.begin(), load.end()) - load.begin();
    bins[b].push_back(e);
    load[b] += g.count(e);
  }
  // OpenMP workers start with default thread-local state (grad mode on, no inference mode,
  // autograd keys not excluded): give them the caller's, so ATen calls dispatch as on it.
  const at::ThreadLocalState caller_state;
  at::parallel_for(0, threads, 1, [&](int64_t b0, int64_t b1) {
    at::ThreadLocalStateGuard state_guard(caller_state);
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t e : bins[b]) fn(e);
    }
  });
}

// The matrix W' with y = x @ W' for a stacked expert weight: W (transposed layout) or W^T (F.linear layout).
Tensor as_right_factor(const Tensor& w, bool transposed) { return transposed ? w : w.t(); }

// Large fresh outputs (weight gradients [E, 2I, H], per-row buffers [T*K, H]) are written exactly
// once. With 4 KiB pages the kernel's first-touch page faults cost about as much as the GEMMs that
// fill them (weight-gradient GEMMs at H=1024, I=512, E=32: 45 vs 24 thread-ms per GEMM of the same
// FLOPs into warm memory); transparent huge pages cut that several-fold. Advisory only: a no-op
// where THP is off, and what PyTorch itself does for every allocation under THP_MEM_ALLOC_ENABLE=1.
void advise_huge_pages(const Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t(2) << 20;
  const uintptr_t start = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t begin = (start + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (start + t.nbytes()) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)t;
#endif
}

// ----------------------------------------------------------------------------- combine

// out[t] = sum_k w[t,k] * ys[row_of_pair[t*K+k]]: products rounded to prod_t (the
// promoted dtype of y and w, as in the reference's `y * w`), summed over k in
// order in its op-math type, rounded to prod_t, then to scalar_t.
// Unweighted (weight_on_input): out[t] = sum_k ys[...], summed in scalar_t's op-math
// type and rounded once (the reference's `y.sum(dim=1)`). Identity pairs' rows (past
// computed_rows) add nothing: their term is added by the caller.
template <typename scalar_t, typename prod_t, bool weighted = true>
void combine_rows(const Tensor& ys, const Tensor& w, const ExpertGroups& g, Tensor& out) {
  using acc_t = at::opmath_type<prod_t>;
  const int64_t T = out.size(0), H = out.size(1), K = g.top_k;
  const scalar_t* y = ys.const_data_ptr<scalar_t>();
  const prod_t* wp = w.const_data_ptr<prod_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(H * K, 1)), [&](int64_t t0, int64_t t1) {
    std::vector<acc_t> acc(H);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), acc_t(0));
      for (int64_t k = 0; k < K; ++k) {
        const int64_t row = g.row_of_pair[t * K + k];
        if (row >= g.computed_rows) continue;
        const scalar_t* yr = y + row * H;
        if constexpr (weighted) {
          const acc_t wk = static_cast<acc_t>(wp[t * K + k]);
          for (int64_t j = 0; j < H; ++j) {
            acc[j] += static_cast<acc_t>(static_cast<prod_t>(static_cast<acc_t>(yr[j]) * wk));
          }
        } else {
          for (int64_t j = 0; j < H; ++j) acc[j] += static_cast<acc_t>(yr[j]);
        }
      }
      for (int64_t j = 0; j < H; ++j) o[t * H + j] = static_cast<scalar_t>(static_cast<prod_t>(acc[j]));
    }
  });
}

Tensor combine(const Tensor& ys, const Tensor& topk_weights, const ExpertGroups& g, int64_t T, int64_t H,
               bool weighted) {
  const at::ScalarType x_dtype = ys.scalar_type();
  if (!weighted) {
    Tensor out = at::empty({T, H}, ys.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x_dtype, "mok_cpu_combine_unweighted", [&] {
      combine_rows<scalar_t, scalar_t, false>(ys, ys, g, out);
    });
    return out;
  }
  const at::ScalarType prod_dtype = at::promote_types(x_dtype, topk_weights.scalar_type());
  TORCH_CHECK(prod_dtype == x_dtype || prod_dtype == at::kFloat, "mok_cpu.fused_moe: routing weights of dtype ",
              topk_weights.scalar_type(), " cannot be combined with ", x_dtype, " expert outputs");
  Tensor w = topk_weights.to(prod_dtype).contiguous();
  Tensor out = at::empty({T, H}, ys.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x_dtype, "mok_cpu_combine", [&] {
    if (prod_dtype == x_dtype) {
      combine_rows<scalar_t, scalar_t>(ys, w, g, out);
    } else {
      combine_rows<scalar_t, float>(ys, w, g, out);
    }
  });
  return out;
}

// d_x[t] = sum of dx_rows over the token's rows, in row order (= expert order, the
// order in which the reference's index_add_ adds them); d_x starts at zero. Identity pairs' rows are skipped.
template <typename acc_t>
void sum_rows_per_token(const Tensor& dx_rows, const ExpertGroups& g, Tensor& d_x) {
  const int64_t T = d_x.size(0), H = d_x.size(1), K = g.top_k;
  const acc_t* src = dx_rows.const_data_ptr<acc_t>();
  acc_t* dst = d_x.data_ptr<acc_t>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(H * K, 1)), [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> rows(K);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t k = 0; k < K; ++k) rows[k] = g.row_of_pair[t * K + k];
      std::sort(rows.begin(), rows.end());
      acc_t* d = dst + t * H;
      for (int64_t r : rows) {
        if (r >= g.computed_rows) break;
        const acc_t* s = src + r * H;
        for (int64_t j = 0; j < H; ++j) d[j] += s[j];
      }
    }
  });
}

// [T, 1]: each token's weights on identity experts (ids from num_experts on) summed, in the weights' dtype
// (reference.identity_weight).
Tensor identity_weight(const Tensor& topk_weights, const Tensor& topk_ids, int64_t num_experts) {
  return topk_weights.masked_fill(topk_ids < num_experts, 0.0).sum(at::IntArrayRef{-1}, /*keepdim=*/true);
}

// ----------------------------------------------------------------------------- forward

// ----------------------------------------------------------------------------- post-expert norm

// g of expert e's rows: (offset + weight).float(), the sum in the weight's dtype (reference.post_norm_scale); the
// weight is [H] (shared) or [E, H] (per expert).
Tensor post_norm_scale(const Tensor& weight, int64_t e, const MoeOptions& o) {
  const Tensor w = weight.dim() == 2 ? weight.select(0, e) : weight;
  return upcast(o.post_norm_offset != 0.0 ? w + o.post_norm_offset : w);
}

Tensor rms(const Tensor& v, double eps) { return v * at::rsqrt(v.pow(2).mean(at::IntArrayRef{-1}, true) + eps); }

// The post-expert norm of rows y in y's dtype (reference.apply_post_norm): "rms" normalises then scales (Ergo),
// "scaled_rms" scales, rounds to y's dtype, then normalises (Muse Spark).
Tensor apply_post_norm(const Tensor& y, const Tensor& g, const MoeOptions& o) {
  if (o.post_norm == "rms") {
    return (at::rms_norm(upcast(y), {y.size(-1)}, std::nullopt, o.post_norm_eps) * g).to(y.scalar_type());
  }
  return rms(upcast((upcast(y) * g).to(y.scalar_type())), o.post_norm_eps).to(y.scalar_type());
}

// (dy, dg) of `apply_post_norm` in y's (accumulation) dtype from dn = d(its output) (reference.post_norm_backward);
// dg has dn's shape: the caller sums it over the rows.
std::pair<Tensor, Tensor> post_norm_backward(const Tensor& y, const Tensor& g, const Tensor& dn, const MoeOptions& o) {
  const double eps = o.post_norm_eps;
  if (o.post_norm == "rms") {
    const Tensor r = at::rsqrt(y.pow(2).mean(at::IntArrayRef{-1}, true) + eps);
    const Tensor u = y * r;
    const Tensor du = dn * g;
    return {r * (du - u * (du * u).mean(at::IntArrayRef{-1}, true)), dn * u};
  }
  const Tensor b = y * g;
  const Tensor r = at::rsqrt(b.pow(2).mean(at::IntArrayRef{-1}, true) + eps);
  const Tensor u = b * r;
  const Tensor db = r * (dn - u * (dn * u).mean(at::IntArrayRef{-1}, true));
  return {db * g, db * y};
}

// Each expert's rows go through gather -> GEMM (+ bias) -> activation -> GEMM (+ bias) in one
// pass, so its intermediate [n, 2I] activations stay in cache; the activation runs the
// reference's ATen ops on the same per-expert blocks (same bits in bf16).
// `h_saved` (training): also returns the gate_up GEMM's output before the bias, [T*K, 2I] in
// expert-sorted rows, which the backward reads instead of recomputing that GEMM.
Tensor experts_forward(const Tensor& x, const Tensor& topk_weights, const Tensor& topk_ids, const Tensor& gate_up,
                       const OptTensor& gate_up_bias, const Tensor& down, const OptTensor& down_bias,
                       const MoeOptions& o, const OptTensor& post_norm_weight, Tensor* h_saved = nullptr) {
  const int64_t T = x.size(0), H = x.size(1), E = gate_up.size(0);
  const int64_t up_out = o.transposed ? gate_up.size(2) : gate_up.size(1);
  const int64_t inter = o.transposed ? down.size(1) : down.size(2);
  const ExpertGroups g = group_by_expert(topk_ids, E, o.identity_experts + o.zero_experts);
  Tensor ys = at::empty({g.order.numel(), H}, x.options());
  advise_huge_pages(ys);
  if (h_saved != nullptr) *h_saved = at::empty({g.order.numel(), up_out}, x.options());
  // weight_on_input: the routing weight of each sorted row, to scale its gathered input.
  const Tensor ws = o.weight_on_input ? topk_weights.reshape({-1}).index_select(0, g.order) : Tensor();
  for_each_expert(g, H * up_out + inter * H, [&](int64_t e) {
    const int64_t s = g.start(e), n = g.count(e);
    Tensor x_e = gather_rows(x, g, s, s + n);
    // Product in the promoted dtype of x and w (as the reference's `x * w`), rounded to x's dtype.
    if (o.weight_on_input) x_e = at::mul(x_e, ws.narrow(0, s, n).unsqueeze(-1)).to(x.scalar_type());
    Tensor h_e = at::mm(x_e, as_right_factor(gate_up.select(0, e), o.transposed));
    if (h_saved != nullptr) h_saved->narrow(0, s, n).copy_(h_e);
    if (gate_up_bias.has_value()) h_e.add_(gate_up_bias->select(0, e));  // after the GEMM's rounding, like HF
    Tensor y_e = ys.narrow(0, s, n);
    at::mm_out(y_e, activate(h_e, o), as_right_factor(down.select(0, e), o.transposed));
    if (down_bias.has_value()) y_e.add_(down_bias->select(0, e));
    if (o.post_norm != "none") y_e.copy_(apply_post_norm(y_e, post_norm_scale(*post_norm_weight, e, o), o));
  });
  return combine(ys, topk_weights, g, T, H, /*weighted=*/!o.weight_on_input);
}

#define MOK_CPU_FORWARD_ARGS                                                                                     \
  const Tensor &hidden_states, const Tensor &router, const OptTensor &router_bias,                              \
      const OptTensor &selection_bias, const Tensor &gate_up_proj, const OptTensor &gate_up_bias,                \
      const Tensor &down_proj, const OptTensor &down_bias, int64_t top_k, c10::string_view routing,              \
      bool router_is_logits, bool router_fp32, bool softmax_fp32, bool renormalize, double renorm_eps,           \
      double routed_scale, int64_t n_group, int64_t topk_group, bool weights_fp32, c10::string_view activation,  \
      bool gated, bool interleaved, bool transposed, double alpha, double limit, bool weight_on_input,           \
      double renorm_min, int64_t group_top, int64_t identity_experts, int64_t zero_experts, double jitter_eps,  \
      bool round_weights, std::optional<at::ScalarType> round_weights_to,                                        \
      c10::string_view post_norm, double post_norm_eps, double post_norm_offset, const OptTensor &expert_ids,    \
      const OptTensor &expert_scale, const OptTensor &post_norm_weight
#define MOK_CPU_FORWARD_VALUES                                                                                   \
  hidden_states, router, router_bias, selection_bias, gate_up_proj, gate_up_bias, down_proj, down_bias, top_k,   \
      routing, router_is_logits, router_fp32, softmax_fp32, renormalize, renorm_eps, routed_scale, n_group,      \
      topk_group, weights_fp32, activation, gated, interleaved, transposed, alpha, limit, weight_on_input,       \
      renorm_min, group_top, identity_experts, zero_experts, jitter_eps, round_weights, round_weights_to,        \
      post_norm,                                                                                                 \
      post_norm_eps,                                                                                             \
      post_norm_offset,                                                                                          \
      expert_ids, expert_scale, post_norm_weight

// (out, topk_weights, topk_ids, h before bias in sorted rows if `save_h`, else undefined).
std::tuple<Tensor, Tensor, Tensor, Tensor> forward_impl(MOK_CPU_FORWARD_ARGS, bool save_h) {
  const MoeOptions o{top_k, std::string(routing), router_is_logits, router_fp32, softmax_fp32, renormalize,
                     renorm_eps, routed_scale, n_group, topk_group, weights_fp32, std::string(activation),
                     gated, interleaved, transposed, alpha, limit, weight_on_input, renorm_min, group_top,
                     identity_experts, zero_experts, jitter_eps, round_weights, round_weights_to,
                     std::string(post_norm), post_norm_eps,
                     post_norm_offset};
  TORCH_CHECK(hidden_states.dim() == 2, "mok_cpu.fused_moe: hidden_states must be 2-D [T, H]");
  Tensor x = hidden_states.contiguous();
  Tensor logits = router_logits(x, router, router_bias, o);
  auto [w, ids] = route(logits, selection_bias, expert_ids, expert_scale, x.scalar_type(), o);
  Tensor h;
  Tensor out = experts_forward(x, w, ids, gate_up_proj.contiguous(), gate_up_bias, down_proj.contiguous(),
                               down_bias, o, post_norm_weight, save_h ? &h : nullptr);
  // Identity experts' pairs: + (x * the token's identity weight), each term rounded to x's dtype (LongCat-Flash).
  if (o.identity_experts > 0) out.add_((x * identity_weight(w, ids, gate_up_proj.size(0))).to(x.scalar_type()));
  return {out, w, ids, h};
}

std::tuple<Tensor, Tensor, Tensor> fused_moe_forward(MOK_CPU_FORWARD_ARGS) {
  auto [out, w, ids, h] = forward_impl(MOK_CPU_FORWARD_VALUES, /*save_h=*/false);
  return {out, w, ids};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> fused_moe_train(MOK_CPU_FORWARD_ARGS) {
  return forward_impl(MOK_CPU_FORWARD_VALUES, /*save_h=*/true);
}

// ----------------------------------------------------------------------------- backward


using BackwardResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

BackwardResult fused_moe_backward(
    const Tensor& grad_out, const OptTensor& grad_topk_weights, const Tensor& hidden_states, const Tensor& router,
    const OptTensor& router_bias, const OptTensor& /*selection_bias: only chooses, no gradient*/,
    const Tensor& gate_up_proj,
    const OptTensor& gate_up_bias, const Tensor& down_proj, const OptTensor& down_bias, const Tensor& topk_weights,
    const Tensor& topk_ids, int64_t top_k, c10::string_view routing, bool router_is_logits, bool router_fp32,
    bool softmax_fp32, bool renormalize, double renorm_eps, double routed_scale, int64_t n_group,
    int64_t topk_group, bool weights_fp32, c10::string_view activation, bool gated, bool interleaved,
    bool transposed, double alpha, double limit, bool weight_on_input, double renorm_min, int64_t group_top,
    int64_t identity_experts, int64_t zero_experts, double jitter_eps, bool round_weights,
    std::optional<at::ScalarType> round_weights_to, c10::string_view post_norm,
    double post_norm_eps,
    double post_norm_offset, const OptTensor& gate_up_out, const OptTensor& expert_scale,
    const OptTensor& post_norm_weight) {
  const MoeOptions o{top_k, std::string(routing), router_is_logits, router_fp32, softmax_fp32, renormalize,
                     renorm_eps, routed_scale, n_group, topk_group, weights_fp32, std::string(activation),
                     gated, interleaved, transposed, alpha, limit, weight_on_input, renorm_min, group_top,
                     identity_experts, zero_experts, jitter_eps, round_weights, round_weights_to,
                     std::string(post_norm), post_norm_eps,
                     post_norm_offset};
  const Tensor& x = hidden_states;
  TORCH_CHECK(x.dim() == 2, "mok_cpu.fused_moe_backward: hidden_states must be 2-D [T, H]");
  const int64_t T = x.size(0), H = x.size(1), E = gate_up_proj.size(0);
  TORCH_CHECK(grad_out.sizes() == x.sizes(), "mok_cpu.fused_moe_backward: grad_out has shape ", grad_out.sizes(),
              ", expected ", x.sizes());
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T, "mok_cpu.fused_moe_backward: topk_ids has shape ",
              topk_ids.sizes(), ", expected [", T, ", top_k]");
  const int64_t K = topk_ids.size(1);
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), "mok_cpu.fused_moe_backward: topk_weights has shape ",
              topk_weights.sizes(), ", expected ", topk_ids.sizes());
  // fp32 accumulation for fp32/bf16/fp16, fp64 for fp64 (as the reference).
  const at::ScalarType acc = acc_dtype(x.scalar_type());
  const auto acc_opts = x.options().dtype(acc);
  Tensor xa = x.to(acc).contiguous();
  Tensor go = grad_out.to(acc).contiguous();
  Tensor wts = topk_weights.to(acc).contiguous().view({-1});
  const Tensor gate_up = gate_up_proj.contiguous(), down = down_proj.contiguous();
  auto expert_weight = [&](const Tensor& stacked, int64_t e) { return stacked.select(0, e).to(acc); };

  const ExpertGroups g = group_by_expert(topk_ids, E, o.identity_experts + o.zero_experts);
  const int64_t N = g.order.numel();
  const int64_t up_out = o.transposed ? gate_up.size(2) : gate_up.size(1);
  const int64_t inter = o.transposed ? down.size(1) : down.size(2);
  TORCH_CHECK(!gate_up_out.has_value() || gate_up_out->sizes() == at::IntArrayRef({N, up_out}),
              "mok_cpu.fused_moe_backward: gate_up_out has shape ", gate_up_out.has_value() ? gate_up_out->sizes()
              : at::IntArrayRef{}, ", expected [", N, ", ", up_out, "]");
  Tensor ws = wts.index_select(0, g.order);  // routing weight of each sorted row
  Tensor dx_rows = at::empty({N, H}, acc_opts);
  advise_huge_pages(dx_rows);
  Tensor dw_rows = at::empty({N}, acc_opts);
  // Weight gradients: experts with rows write theirs whole below; only the others are zeroed
  // (a full memset of [E, 2I, H] costs as much as a GEMM at real sizes).
  Tensor d_w1 = at::empty(gate_up.sizes(), acc_opts);
  Tensor d_w2 = at::empty(down.sizes(), acc_opts);
  advise_huge_pages(d_w1);
  advise_huge_pages(d_w2);
  Tensor d_b1 = gate_up_bias.has_value() ? at::empty(gate_up_bias->sizes(), acc_opts) : Tensor();
  Tensor d_b2 = down_bias.has_value() ? at::empty(down_bias->sizes(), acc_opts) : Tensor();
  const bool normed = o.post_norm != "none";
  Tensor d_pn = normed ? at::empty({E, H}, acc_opts) : Tensor();  // each expert's part of d(post_norm_weight)
  for (int64_t e = 0; e < E; ++e) {
    if (g.count(e) > 0) continue;
    for (Tensor* t : {&d_w1, &d_w2, &d_b1, &d_b2, &d_pn}) {
      if (t->defined()) t->select(0, e).zero_();
    }
  }

  // One pass per expert (its [n, 2I] intermediates stay in cache), with W1', W2' such that
  // h = x @ W1' + b1, y = act(h) @ W2' + b2, out += w * y:
  //   h (read from gate_up_out when the training forward saved it, else recomputed) and a = act(h);
  //   g2 = go @ W2'^T; d(routing weight) = <go, y> = <g2, a> + <go, b2> (no second forward GEMM);
  //   da = w * g2, dy = w * go, dW2 and db2 from dy; dh = act'(h) da; dW1, db1, dx from dh.
  // post_norm: out += w * n(y), so y = a @ W2' is recomputed: d(routing weight) = <go, n(y)>, and dy, dg from
  //   the norm's backward of w * go; then da = dy @ W2'^T.
  // weight_on_input: h = (w x) @ W1' + b1 and out += y, so dy = go, da = g2, dW1 from w x, and
  //   with dxs = dh @ W1'^T: d(routing weight) = <dxs, x>, dx = w * dxs.
  for_each_expert(g, 3 * H * up_out + 2 * inter * H, [&](int64_t e) {
    const int64_t s = g.start(e), n = g.count(e);
    const Tensor w1 = as_right_factor(expert_weight(gate_up, e), o.transposed);
    const Tensor w2 = as_right_factor(expert_weight(down, e), o.transposed);
    const Tensor xs_e = gather_rows(xa, g, s, s + n);
    Tensor go_e = gather_rows(go, g, s, s + n);
    const Tensor w_e = ws.narrow(0, s, n).unsqueeze(-1);
    const Tensor x_in = o.weight_on_input ? xs_e * w_e : xs_e;  // the expert's input

    Tensor h_e;
    if (gate_up_out.has_value()) {  // never written in place: autograd's saved tensor
      h_e = gate_up_out->narrow(0, s, n).to(acc);
      if (gate_up_bias.has_value()) h_e = h_e + gate_up_bias->select(0, e).to(acc);
    } else {
      h_e = at::mm(x_in, w1);
      if (gate_up_bias.has_value()) h_e.add_(gate_up_bias->select(0, e).to(acc));
    }
    const Tensor a_e = activate(h_e, o);

    Tensor dw_e = dw_rows.narrow(0, s, n);
    Tensor da_e;
    if (normed) {
      const Tensor y_e = at::mm(a_e, w2);
      const Tensor g_e = post_norm_scale(*post_norm_weight, e, o).to(acc);
      at::sum_out(dw_e, go_e * apply_post_norm(y_e, g_e, o), at::IntArrayRef{-1});
      auto [dy, dg] = post_norm_backward(y_e, g_e, go_e * w_e, o);
      Tensor d_pn_e = d_pn.select(0, e);
      at::sum_out(d_pn_e, dg, at::IntArrayRef{0});
      go_e = dy;
      da_e = at::mm(go_e, w2.t());
    } else {
      da_e = at::mm(go_e, w2.t());
    }
    if (!o.weight_on_input && !normed) {
      at::sum_out(dw_e, da_e * a_e, at::IntArrayRef{-1});
      if (down_bias.has_value()) dw_e.add_(at::mv(go_e, down_bias->select(0, e).to(acc)));
      da_e.mul_(w_e);
      go_e.mul_(w_e);
    }
    const Tensor& dy_e = go_e;
    Tensor d_w2_e = d_w2.select(0, e);
    if (o.transposed) {
      at::mm_out(d_w2_e, a_e.t(), dy_e);
    } else {
      at::mm_out(d_w2_e, dy_e.t(), a_e);
    }
    if (d_b2.defined()) {
      Tensor d_b2_e = d_b2.select(0, e);
      at::sum_out(d_b2_e, dy_e, at::IntArrayRef{0});
    }

    const Tensor dh_e = activation_backward(h_e, da_e, o);
    Tensor d_w1_e = d_w1.select(0, e);
    if (o.transposed) {
      at::mm_out(d_w1_e, x_in.t(), dh_e);
    } else {
      at::mm_out(d_w1_e, dh_e.t(), x_in);
    }
    Tensor dx_e = dx_rows.narrow(0, s, n);
    at::mm_out(dx_e, dh_e, w1.t());
    if (o.weight_on_input) {  // dx_e holds the gradient of the expert input w * x
      at::sum_out(dw_e, dx_e * xs_e, at::IntArrayRef{-1});
      dx_e.mul_(w_e);
    }
    if (d_b1.defined()) {
      Tensor d_b1_e = d_b1.select(0, e);
      at::sum_out(d_b1_e, dh_e, at::IntArrayRef{0});
    }
  });
  Tensor d_x = at::zeros({T, H}, acc_opts);
  AT_DISPATCH_FLOATING_TYPES(acc, "mok_cpu_sum_rows", [&] { sum_rows_per_token<scalar_t>(dx_rows, g, d_x); });

  Tensor d_wts = at::empty({N}, acc_opts).index_copy_(0, g.order, dw_rows).view({T, K});
  if (o.identity_experts > 0) {  // an identity pair added w * x: d w = <go, x>, d x += w * go
    d_wts = at::where(topk_ids >= E, (go * xa).sum(at::IntArrayRef{-1}, /*keepdim=*/true), d_wts);
    d_x.add_(go * identity_weight(wts.view({T, K}), topk_ids, E));
  }
  if (o.zero_experts > 0) d_wts = d_wts.masked_fill(topk_ids >= E, 0.0);  // a zero pair added nothing: d w = 0
  if (grad_topk_weights.has_value()) d_wts = d_wts + grad_topk_weights->to(acc);
  Tensor logits = router_logits(x, router, router_bias, o);
  Tensor d_scale;
  Tensor d_logits = routing_backward(logits, topk_ids, d_wts, o, expert_scale, &d_scale);
  Tensor d_router, d_router_bias;
  if (o.router_is_logits) {
    d_router = d_logits.to(router.scalar_type());
  } else {
    d_router = at::mm(d_logits.t(), xa).to(router.scalar_type());
    d_x.add_(at::mm(d_logits, router.to(acc)));
    if (router_bias.has_value()) d_router_bias = d_logits.sum(at::IntArrayRef{0}).to(router_bias->scalar_type());
  }
  return {
      d_x.to(x.scalar_type()),
      d_router,
      d_router_bias,
      d_w1.to(gate_up_proj.scalar_type()),
      d_b1.defined() ? d_b1.to(gate_up_bias->scalar_type()) : Tensor(),
      d_w2.to(down_proj.scalar_type()),
      d_b2.defined() ? d_b2.to(down_bias->scalar_type()) : Tensor(),
      d_scale.defined() ? d_scale.to(expert_scale->scalar_type()) : Tensor(),
      // a shared weight's gradient: the experts' parts summed in expert order (deterministic)
      normed ? (post_norm_weight->dim() == 2 ? d_pn : d_pn.sum(at::IntArrayRef{0})).to(post_norm_weight->scalar_type())
             : Tensor(),
  };
}

}  // namespace

// Same arguments as mok::fused_moe (library.py), all passed explicitly (no defaults:
// the Python wrapper completes them with spec.with_defaults) but the tensors given only where used (expert_ids,
// expert_scale).
#define MOK_CPU_SCALARS                                                                                          \
  "int top_k, str routing, bool router_is_logits, bool router_fp32, bool softmax_fp32, bool renormalize, "       \
  "float renorm_eps, float routed_scale, int n_group, int topk_group, bool weights_fp32, str activation, "       \
  "bool gated, bool interleaved, bool transposed, float alpha, float limit, bool weight_on_input, "             \
  "float renorm_min, int group_top, int identity_experts, int zero_experts, float jitter_eps, "                    \
  "bool round_weights, ScalarType? round_weights_to, "                                                            \
  "str post_norm, float post_norm_eps, float post_norm_offset"
#define MOK_CPU_WEIGHTS                                                                                          \
  "Tensor router, Tensor? router_bias, Tensor? selection_bias, Tensor gate_up_proj, Tensor? gate_up_bias, "      \
  "Tensor down_proj, Tensor? down_bias"

#define MOK_CPU_LEARNED "Tensor? expert_scale=None, Tensor? post_norm_weight=None"

TORCH_LIBRARY(mok_cpu, m) {
  m.def("fused_moe(Tensor hidden_states, " MOK_CPU_WEIGHTS ", *, " MOK_CPU_SCALARS
        ", Tensor? expert_ids=None, " MOK_CPU_LEARNED ") -> (Tensor, Tensor, Tensor)");
  m.def("fused_moe_train(Tensor hidden_states, " MOK_CPU_WEIGHTS ", *, " MOK_CPU_SCALARS
        ", Tensor? expert_ids=None, " MOK_CPU_LEARNED ") -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("fused_moe_backward(Tensor grad_out, Tensor? grad_topk_weights, Tensor hidden_states, " MOK_CPU_WEIGHTS
        ", Tensor topk_weights, Tensor topk_ids, *, " MOK_CPU_SCALARS
        ", Tensor? gate_up_out, " MOK_CPU_LEARNED ") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
        "Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mok_cpu, CPU, m) {
  m.impl("fused_moe", &fused_moe_forward);
  m.impl("fused_moe_train", &fused_moe_train);
  m.impl("fused_moe_backward", &fused_moe_backward);
}
