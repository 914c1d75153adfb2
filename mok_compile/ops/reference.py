"""Plain-PyTorch reference of `mok::fused_moe`: the oracle for every kernel.

The forward follows Hugging Face transformers 5.x op by op, in the same dtypes
(router math in fp32 where HF does it, expert math in the input dtype, the
weighted sum over the k experts in the routing weights' dtype), so that on a
tiny HF model it reproduces the module's output. The backward
(`fused_moe_backward_reference`) is written out by hand rather than traced, and
computes in fp32 (fp64 for fp64 inputs); kernels are checked against both.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .spec import SCORE_ROUTINGS


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs: HF's `.float()` upcasts, but must not round an fp64 run to fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """HF's `t.float()` where it upcasts low precision; fp64 stays fp64 (fp64 gradcheck needs it)."""
    return t.to(_acc_dtype(t.dtype))


# ----------------------------------------------------------------------------- routing


def logits_dtype(x_dtype: torch.dtype, router_fp32: bool) -> torch.dtype:
    """The dtype of `router_logits` computed from a router weight."""
    return _acc_dtype(x_dtype) if router_fp32 else x_dtype


def router_logits(x, router, router_bias, *, router_is_logits, router_fp32):
    """[T, E] logits, computed the way the HF router does."""
    if router_is_logits:
        return router
    if router_fp32:
        acc = _acc_dtype(x.dtype)
        bias = None if router_bias is None else router_bias.to(acc)
        return F.linear(x.to(acc), router.to(acc), bias)
    return F.linear(x, router, router_bias)


_logits_of = router_logits  # for the backward, whose `router_logits` argument (a kernel's saved logits) hides the name


def _renorm_denominator(total, *, renorm_eps, renorm_min):
    """clamp(total, min=renorm_min) + renorm_eps for `total` = sum(w, -1, keepdim), with each step only where set
    (as HF writes it)."""
    denom = total
    if renorm_min:
        denom = denom.clamp(min=renorm_min)
    if renorm_eps:
        denom = denom + renorm_eps
    return denom


def _renorm_and_scale(w, *, renormalize, renorm_eps, renorm_min, routed_scale):
    if renormalize:
        w = w / _renorm_denominator(w.sum(dim=-1, keepdim=True), renorm_eps=renorm_eps, renorm_min=renorm_min)
    if routed_scale != 1.0:
        w = w * routed_scale
    return w


def _expert_scale_at(expert_scale, ids, dtype):
    """expert_scale[ids] in `dtype` (the weights' accumulation dtype: Gemma 4 multiplies its fp32 weights by the
    bf16 parameter, which PyTorch upcasts)."""
    return expert_scale.to(dtype)[ids]


def group_scores(choice, n_group, group_top):
    """[T, n_group]: each group's score for group-limited selection, the sum of its `group_top` largest choices
    (DeepSeek-V3: 2; V2: 1, its max)."""
    T, E = choice.shape
    return choice.view(T, n_group, E // n_group).topk(group_top, dim=-1)[0].sum(dim=-1)


def _grouped_choice(choice, n_group, topk_group, group_top):
    """Group-limited selection (`group_scores`): mask all but the best groups with -inf."""
    T, E = choice.shape
    scores = group_scores(choice, n_group, group_top)
    group_idx = torch.topk(scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(scores).scatter(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    return choice.masked_fill(~score_mask.bool(), float("-inf"))


def weights_rounding(x_dtype: torch.dtype, round_weights: bool = False, round_weights_to=None):
    """The 16-bit dtype fp32 routing weights are rounded through, or None: `round_weights_to`, else the input
    dtype where `round_weights` is set (Ergo's; a no-op for fp32 and fp64 inputs)."""
    if round_weights_to is not None:
        return round_weights_to
    return x_dtype if round_weights and x_dtype in (torch.bfloat16, torch.float16) else None


def routing_weights_dtype(x_dtype: torch.dtype, weights_fp32: bool) -> torch.dtype:
    """dtype of `topk_weights`: fp32 (fp64 for fp64 inputs) when `weights_fp32`, else the input dtype."""
    return _acc_dtype(x_dtype) if weights_fp32 else x_dtype


def selection_scores(logits, selection_bias, *, routing, softmax_fp32, n_group, topk_group, group_top=2):
    """(choice, scores): per expert, the value whose top-k picks the experts (`choice`; between exactly
    equal values either pick is right, as torch.topk promises no order) and the one the routing
    weights are taken from."""
    if routing == "softmax_topk":
        scores = F.softmax(logits, dim=-1, dtype=_acc_dtype(logits.dtype) if softmax_fp32 else logits.dtype)
    elif routing == "topk_softmax":
        scores = _upcast(logits) if softmax_fp32 else logits
    elif routing == "sigmoid_grouped_topk":
        scores = (_upcast(logits) if softmax_fp32 else logits).sigmoid()
    elif routing == "topk_sigmoid":
        scores = logits
    elif routing == "sqrtsoftplus_topk":
        scores = F.softplus(_upcast(logits) if softmax_fp32 else logits).sqrt()
    else:
        raise ValueError(f"unknown routing {routing!r}")
    choice = scores if selection_bias is None else scores + selection_bias
    if n_group > 1:
        choice = _grouped_choice(choice, n_group, topk_group, group_top)
    return choice, scores


def sparsemixer_drop(scores, top, jitter_eps):
    """PhiMoE's mask of one sparsemixer round: the scores too far below the round's largest `top` [T, 1],
    ``(top - s) / max(|s|, top) > 2 * jitter_eps``, each op in the scores' dtype (as HF writes it)."""
    return ((top - scores) / scores.abs().clamp(min=top)) > (2 * jitter_eps)


def _without(left, idx):
    """`left` with each row's pick `idx` [T, 1] set to -inf: HF's ``scatter(left, -1, idx, -inf)`` as a masked_fill
    (the same values; torch-mlir's lowering of that scatter runs out of memory)."""
    return left.masked_fill(torch.arange(left.shape[-1], device=left.device) == idx, float("-inf"))


def sparsemixer(scores, top_k, jitter_eps):
    """(w [T, K] in the scores' dtype, ids [T, K]): PhiMoE's sparsemixer at inference, op for op. Round r picks
    the largest score left (the lowest index among equals, as torch.max promises); its weight is the softmax,
    at the pick, of the scores left that `sparsemixer_drop` keeps; the pick is then removed (-inf)."""
    left, weights, ids = scores, [], []
    for _ in range(top_k):
        top, idx = left.max(dim=-1, keepdim=True)
        gates = torch.softmax(left.masked_fill(sparsemixer_drop(scores, top, jitter_eps), float("-inf")), dim=-1)
        weights.append(gates.gather(dim=-1, index=idx))
        ids.append(idx)
        left = _without(left, idx)
    return torch.cat(weights, dim=-1), torch.cat(ids, dim=-1)


def route(logits, selection_bias, *, x_dtype, top_k, routing, softmax_fp32, renormalize,
          renorm_eps, routed_scale, n_group, topk_group, weights_fp32, renorm_min=0.0, group_top=2, expert_ids=None,
          expert_scale=None, jitter_eps=0.0, round_weights=False, round_weights_to=None):
    """(topk_weights, topk_ids) from logits, with HF's precision behaviour. `expert_ids`: the ids, given; the
    weights are the routing's values there (DeepSeek-V4's hash routing: `scores.gather(1, tid2eid[input_ids])`).
    `expert_scale` [E]: each weight times its expert's value, last (Gemma 4's `per_expert_scale`)."""
    if routing == "sparsemixer":
        w, ids = sparsemixer(_upcast(logits) if softmax_fp32 else logits, top_k, jitter_eps)
        return _finish_weights(w, ids, x_dtype=x_dtype, renormalize=renormalize, renorm_eps=renorm_eps,
                               renorm_min=renorm_min, routed_scale=routed_scale, expert_scale=expert_scale,
                               weights_fp32=weights_fp32,
                               rounding=weights_rounding(x_dtype, round_weights, round_weights_to))
    choice, scores = selection_scores(logits, selection_bias, routing=routing, softmax_fp32=softmax_fp32,
                                      n_group=n_group, topk_group=topk_group, group_top=group_top)
    if expert_ids is not None:
        ids = expert_ids.to(torch.int64, copy=True)  # an op's output never aliases its input
        top = scores.gather(1, ids)
    elif routing in SCORE_ROUTINGS:
        ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
        top = scores.gather(1, ids)
    else:
        top, ids = torch.topk(choice, top_k, dim=-1)
        if selection_bias is not None:  # the bias only chose: the weights start from the unbiased values
            top = scores.gather(1, ids)
    if routing == "topk_softmax":
        w = F.softmax(top, dim=-1, dtype=top.dtype)
    elif routing == "topk_sigmoid":
        w = (_upcast(top) if softmax_fp32 else top).sigmoid()
    else:
        w = top
    return _finish_weights(w, ids, x_dtype=x_dtype, renormalize=renormalize, renorm_eps=renorm_eps,
                           renorm_min=renorm_min, routed_scale=routed_scale, expert_scale=expert_scale,
                           weights_fp32=weights_fp32,
                           rounding=weights_rounding(x_dtype, round_weights, round_weights_to))


def _finish_weights(w, ids, *, x_dtype, renormalize, renorm_eps, renorm_min, routed_scale, expert_scale,
                    weights_fp32, rounding=None):
    """The steps every routing ends with: renormalise, scale, the per-expert scale, the cast (through
    `rounding`, a 16-bit dtype, where `weights_rounding` gives one)."""
    w = _renorm_and_scale(w, renormalize=renormalize, renorm_eps=renorm_eps, renorm_min=renorm_min,
                          routed_scale=routed_scale)
    if expert_scale is not None:
        w = w * _expert_scale_at(expert_scale, ids, torch.promote_types(w.dtype, expert_scale.dtype))
    if rounding is not None:
        w = w.to(rounding)
    w = w.to(routing_weights_dtype(x_dtype, weights_fp32))
    return w, ids


# ----------------------------------------------------------------------------- experts


def _split_gate_up(h, interleaved):
    if interleaved:
        return h[..., ::2], h[..., 1::2]
    return h.chunk(2, dim=-1)


def activate(h, *, activation, gated, interleaved, alpha, limit):
    """Expert activation on the gate_up projection output, op by op as HF writes it."""
    if gated:
        gate, up = _split_gate_up(h, interleaved)
        if activation == "silu":
            return F.silu(gate) * up
        if activation == "silu_fp32":  # Beam: in fp32, rounded once
            return (F.silu(_upcast(gate)) * _upcast(up)).to(h.dtype)
        if activation == "gelu_tanh":
            return F.gelu(gate, approximate="tanh") * up
        if activation == "clamped_silu":
            gate = gate.clamp(min=None, max=limit)
            up = up.clamp(min=-limit, max=limit)
            glu = gate * torch.sigmoid(gate * alpha)
            return (up + 1) * glu
        if activation == "clamped_swiglu":
            return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
        if activation == "softcapped_swiglu":  # Inkling2: in fp32, rounded once
            g, u = _upcast(gate), _upcast(up)
            return (_softcap(g, alpha) * torch.sigmoid(g) * _softcap(u, limit)).to(h.dtype)
    else:
        if activation == "relu2":
            return torch.square(F.relu(h))
        if activation == "relu":
            return F.relu(h)
        if activation == "silu":
            return F.silu(h)
        if activation == "gelu":
            return F.gelu(h)
        if activation == "gelu_tanh":
            return F.gelu(h, approximate="tanh")
    raise ValueError(f"unknown activation {activation!r} (gated={gated})")


def _softcap(v, cap):
    """tanh(v / cap) * cap, as Inkling2 writes it."""
    return torch.tanh(v / cap) * cap


def _project(x, weight, bias, transposed):
    """x @ W (transposed layout) or F.linear layout; bias added after the product like HF's grouped path."""
    out = x @ weight if transposed else x @ weight.t()
    return out if bias is None else out + bias


def post_norm_scale(weight, offset):
    """g = (offset + weight).float(): the sum in the weight's dtype, as HF's `(1.0 + self.weight).float()`."""
    return _upcast(weight + offset if offset else weight)


def _rms(v, eps):
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)


def apply_post_norm(y, g, *, kind, eps):
    """A post-expert norm (`ExpertSpec.post_norm`) of rows y ([n, H], in the experts' dtype) with g ([H] or [n, H],
    from `post_norm_scale`)."""
    if kind == "rms":  # Ergo: F.rms_norm(y.float()) * w[e]
        return (F.rms_norm(_upcast(y), (y.shape[-1],), eps=eps) * g).to(y.dtype)
    # Muse Spark: scaled, rounded to y's dtype, then normalised
    return _rms(_upcast((_upcast(y) * g).to(y.dtype)), eps).to(y.dtype)


def post_norm_backward(y, g, dn, *, kind, eps):
    """(dy, dg) of `apply_post_norm` in the accumulation dtype (its roundings read as the identity): dn is d(output) of
    rows y, dg has dn's shape (summed over the rows by the caller where g is shared)."""
    a = _upcast(y)
    if kind == "rms":
        r = torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps)
        u = a * r
        dg = dn * u
        du = dn * g
        return r * (du - u * (du * u).mean(-1, keepdim=True)), dg
    b = a * g
    r = torch.rsqrt(b.pow(2).mean(-1, keepdim=True) + eps)
    u = b * r
    db = r * (dn - u * (dn * u).mean(-1, keepdim=True))
    return db * g, db * a


def expert_post_norm_scale(weight, e, offset):
    """g for expert e's rows: its row of a per-expert weight ([E, H]), else the shared one ([H])."""
    return post_norm_scale(weight[e] if weight.dim() == 2 else weight, offset)


def group_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """Stable order of the T*K (token, slot) pairs by expert, and per-expert counts."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


def experts_reference(x, topk_weights, topk_ids, gate_up_proj, gate_up_bias, down_proj, down_bias, *,
                      activation, gated, interleaved, transposed, alpha, limit, weight_on_input=False,
                      post_norm="none", post_norm_eps=1e-6, post_norm_offset=0.0, post_norm_weight=None):
    """sum_k w[t,k] * expert_{ids[t,k]}(x[t]) computed only for routed pairs; a pair whose id is past the experts
    (an identity or zero expert's) adds nothing here. With a `post_norm`, each pair's expert output is normalised
    (`apply_post_norm`) before its weight.

    weight_on_input: sum_k expert_{ids[t,k]}((x[t] * w[t,k]).to(x.dtype)) instead (Llama4); the product is
    taken in the promoted dtype of x and w, as PyTorch's `x * w` would.
    """
    T, H = x.shape
    K = topk_ids.shape[1]
    E = gate_up_proj.shape[0]
    order, counts = group_by_expert(topk_ids, E)
    xs = x[order // K]
    if weight_on_input:
        xs = (xs * topk_weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)
    ys = x.new_zeros(T * K, H)  # the identity pairs' rows stay 0
    start = 0
    for e, n in enumerate(counts[:E].tolist()):
        if n == 0:
            continue
        rows = slice(start, start + n)
        h = _project(xs[rows], gate_up_proj[e], None if gate_up_bias is None else gate_up_bias[e], transposed)
        a = activate(h, activation=activation, gated=gated, interleaved=interleaved, alpha=alpha, limit=limit)
        y = _project(a, down_proj[e], None if down_bias is None else down_bias[e], transposed)
        if post_norm != "none":
            y = apply_post_norm(y, expert_post_norm_scale(post_norm_weight, e, post_norm_offset), kind=post_norm,
                                eps=post_norm_eps)
        ys[rows] = y
        start += n
    y = torch.empty_like(ys)
    y[order] = ys
    if weight_on_input:
        return y.view(T, K, H).sum(dim=1).to(x.dtype)
    out = (y.view(T, K, H) * topk_weights.unsqueeze(-1)).sum(dim=1)
    return out.to(x.dtype)


def identity_weight(topk_weights, topk_ids, num_experts):
    """[T, 1]: the sum of each token's weights on identity experts (ids past the `num_experts` experts), in the
    weights' dtype, as LongCat-Flash writes it (`w.masked_fill(~mask, 0).sum(-1, keepdim=True)`)."""
    return topk_weights.masked_fill(topk_ids < num_experts, 0.0).sum(dim=-1, keepdim=True)


def fused_moe_reference(hidden_states, router, router_bias, selection_bias, gate_up_proj, gate_up_bias,
                        down_proj, down_bias, *, top_k, routing="softmax_topk", router_is_logits=False,
                        router_fp32=False, softmax_fp32=True, renormalize=False, renorm_eps=0.0,
                        routed_scale=1.0, n_group=1, topk_group=1, weights_fp32=True, activation="silu",
                        gated=True, interleaved=False, transposed=False, alpha=1.702, limit=7.0,
                        weight_on_input=False, renorm_min=0.0, group_top=2, identity_experts=0, zero_experts=0,
                        jitter_eps=0.0, round_weights=False, post_norm="none", post_norm_eps=1e-6,
                        post_norm_offset=0.0, round_weights_to=None, expert_ids=None, expert_scale=None,
                        post_norm_weight=None):
    """Reference forward of `torch.ops.mok.fused_moe` -> (out, topk_weights, topk_ids)."""
    x = hidden_states
    logits = router_logits(x, router, router_bias, router_is_logits=router_is_logits, router_fp32=router_fp32)
    w, ids = route(logits, selection_bias, x_dtype=x.dtype, top_k=top_k, routing=routing,
                   softmax_fp32=softmax_fp32, renormalize=renormalize, renorm_eps=renorm_eps,
                   routed_scale=routed_scale, n_group=n_group, topk_group=topk_group, weights_fp32=weights_fp32,
                   renorm_min=renorm_min, group_top=group_top, expert_ids=expert_ids, expert_scale=expert_scale,
                   jitter_eps=jitter_eps, round_weights=round_weights, round_weights_to=round_weights_to)
    out = experts_reference(x, w, ids, gate_up_proj, gate_up_bias, down_proj, down_bias, activation=activation,
                            gated=gated, interleaved=interleaved, transposed=transposed, alpha=alpha, limit=limit,
                            weight_on_input=weight_on_input, post_norm=post_norm, post_norm_eps=post_norm_eps,
                            post_norm_offset=post_norm_offset, post_norm_weight=post_norm_weight)
    if identity_experts:  # each rounded to x's dtype, then added (LongCat-Flash)
        out = out + (x * identity_weight(w, ids, gate_up_proj.shape[0])).to(x.dtype)
    return out, w, ids


# ----------------------------------------------------------------------------- backward


def activation_backward(h, da, *, activation, gated, interleaved, alpha, limit):
    """d(loss)/d(h) for the activation, given d(loss)/d(activation output). Explicit derivatives."""
    if gated:
        g, u = _split_gate_up(h, interleaved)
        if activation in ("silu", "silu_fp32"):
            sg = torch.sigmoid(g)
            dg = da * u * sg * (1 + g * (1 - sg))
            du = da * g * sg
        elif activation == "gelu_tanh":
            dg = da * u * _gelu_tanh_grad(g)
            du = da * F.gelu(g, approximate="tanh")
        elif activation == "clamped_silu":
            gc = g.clamp(max=limit)
            uc = u.clamp(min=-limit, max=limit)
            s = torch.sigmoid(alpha * gc)
            dg = (da * (uc + 1) * (s + alpha * gc * s * (1 - s))) * (g <= limit)
            du = (da * gc * s) * ((u >= -limit) & (u <= limit))
        elif activation == "clamped_swiglu":
            gc = g.clamp(max=limit)
            uc = u.clamp(min=-limit, max=limit)
            s = torch.sigmoid(gc)
            dg = (da * uc * s * (1 + gc * (1 - s))) * (g <= limit)
            du = (da * gc * s) * ((u >= -limit) & (u <= limit))
        elif activation == "softcapped_swiglu":  # d cap(v, c) / dv = 1 - tanh(v / c)^2
            tg, tu = torch.tanh(g / alpha), torch.tanh(u / limit)
            s = torch.sigmoid(g)
            dg = da * (tu * limit) * ((1 - tg * tg) * s + tg * alpha * s * (1 - s))
            du = da * (tg * alpha) * s * (1 - tu * tu)
        else:
            raise ValueError(f"unknown gated activation {activation!r}")
        if interleaved:
            return torch.stack((dg, du), dim=-1).flatten(-2)
        return torch.cat((dg, du), dim=-1)
    if activation == "relu2":
        return da * 2 * F.relu(h)
    if activation == "relu":
        return da * (h > 0)
    if activation == "silu":
        s = torch.sigmoid(h)
        return da * s * (1 + h * (1 - s))
    if activation == "gelu":
        return da * (0.5 * (1 + torch.erf(h / math.sqrt(2))) + h * torch.exp(-0.5 * h * h) / math.sqrt(2 * math.pi))
    if activation == "gelu_tanh":
        return da * _gelu_tanh_grad(h)
    raise ValueError(f"unknown ungated activation {activation!r}")


def _gelu_tanh_grad(x):
    c = math.sqrt(2.0 / math.pi)
    z = c * (x + 0.044715 * x**3)
    t = torch.tanh(z)
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)


def routing_backward(logits, topk_weights, topk_ids, grad_w, *, routing, renormalize, renorm_eps, routed_scale,
                     renorm_min=0.0, expert_scale=None, softmax_fp32=True, jitter_eps=0.0):
    """(d(loss)/d(logits) [T, E], d(loss)/d(expert_scale) [E] or None) from d(loss)/d(topk_weights), all in the
    accumulation dtype. With `expert_scale`, the weights are w * s[ids] for the w this recomputes: d(s[e]) sums
    d(weights) * w over the pairs of expert e (in pair order), and w's gradient is d(weights) * s[ids].
    `softmax_fp32`, `jitter_eps`: the sparsemixer's, whose masks are recomputed as the forward rounded them."""
    acc = grad_w.dtype
    l = logits.to(acc)
    base = None
    if routing == "sparsemixer":
        base = sparsemixer_gates(_upcast(logits) if softmax_fp32 else logits, l, topk_ids, jitter_eps)
        w0 = base.gather(2, topk_ids.unsqueeze(-1)).squeeze(-1)
    elif routing == "softmax_topk":
        base = torch.softmax(l, dim=-1)
        w0 = base.gather(1, topk_ids)
    elif routing == "topk_softmax":
        w0 = torch.softmax(l.gather(1, topk_ids), dim=-1)
    elif routing == "topk_sigmoid":
        w0 = torch.sigmoid(l.gather(1, topk_ids))
    elif routing == "sqrtsoftplus_topk":
        base = F.softplus(l).sqrt()
        w0 = base.gather(1, topk_ids)
    else:
        base = torch.sigmoid(l)
        w0 = base.gather(1, topk_ids)
    d_scale = None
    if expert_scale is not None:
        w = _renorm_and_scale(w0, renormalize=renormalize, renorm_eps=renorm_eps, renorm_min=renorm_min,
                              routed_scale=routed_scale)
        d_scale = torch.zeros(expert_scale.shape, dtype=acc, device=l.device).index_add_(
            0, topk_ids.reshape(-1), (grad_w * w).reshape(-1))
        grad_w = grad_w * _expert_scale_at(expert_scale, topk_ids, acc)
    d = grad_w * routed_scale
    if renormalize:
        # The sum's gradient stops where the clamp holds it at renorm_min (torch.clamp passes it at equality).
        total = w0.sum(dim=-1, keepdim=True)
        denom = _renorm_denominator(total, renorm_eps=renorm_eps, renorm_min=renorm_min)
        w1 = w0 / denom
        d = (d - (total >= renorm_min) * (d * w1).sum(dim=-1, keepdim=True)) / denom
    return _logits_grad(l, base, w0, topk_ids, d, routing), d_scale


def sparsemixer_gates(scores, l, topk_ids, jitter_eps):
    """[T, K, E]: round k's softmax of the sparsemixer (`sparsemixer`) at the forward's picks, computed on `l` (the
    logits in the backward's dtype) over the experts the forward kept: its masks are recomputed from `scores`, in
    the dtype the forward ran in, so that they are the forward's (a mask is a choice: it has no gradient)."""
    left, gates = l, []
    for k in range(topk_ids.shape[1]):
        idx = topk_ids[:, k:k + 1]
        drop = sparsemixer_drop(scores, scores.gather(1, idx), jitter_eps)
        gates.append(torch.softmax(left.masked_fill(drop, float("-inf")), dim=-1))
        left = _without(left, idx)
    return torch.stack(gates, dim=1)


def _logits_grad(l, base, w0, topk_ids, d, routing):
    """d(logits) from d(w0), the gradient of the pre-renormalisation weights w0 (`base`: the per-expert scores
    they were gathered from, where there are any; the sparsemixer's per-round softmax [T, K, E])."""
    if routing == "sparsemixer":  # w0[k] = p_k[id_k]: d l = sum_k d_k w0_k (onehot(id_k) - p_k)
        dw = d * w0
        return torch.zeros_like(l).scatter_add_(1, topk_ids, dw) - (dw.unsqueeze(-1) * base).sum(dim=1)
    # Scattered with adds: given ids (`expert_ids`) may name an expert twice in a row, and both slots count.
    if routing == "softmax_topk":
        dp = torch.zeros_like(l).scatter_add_(1, topk_ids, d)
        return base * (dp - (base * dp).sum(dim=-1, keepdim=True))
    if routing == "topk_softmax":
        dtop = w0 * (d - (w0 * d).sum(dim=-1, keepdim=True))
        return torch.zeros_like(l).scatter_add_(1, topk_ids, dtop)
    if routing == "topk_sigmoid":  # d logits[t, ids] = d w0 * w0 * (1 - w0)
        return torch.zeros_like(l).scatter_add_(1, topk_ids, d * w0 * (1 - w0))
    ds = torch.zeros_like(l).scatter_add_(1, topk_ids, d)
    if routing == "sqrtsoftplus_topk":  # d sqrt(softplus(l)) = sigmoid(l) / (2 s); 0 where s underflowed to 0
        return torch.where(base > 0, ds * torch.sigmoid(l) / (2 * base), 0.0)
    return ds * base * (1 - base)


def _weighted_input(x, w):
    """The expert input x * w of a weight-on-input block, in the backward's accumulation dtype (tests replace it
    to model the kernels' rounding of it to the inputs' dtype)."""
    return x * w


def fused_moe_backward_reference(grad_out, grad_topk_weights, hidden_states, router, router_bias, selection_bias,
                                 gate_up_proj, gate_up_bias, down_proj, down_bias, topk_weights, topk_ids, *,
                                 top_k, routing="softmax_topk", router_is_logits=False, router_fp32=False,
                                 softmax_fp32=True, renormalize=False, renorm_eps=0.0, routed_scale=1.0, n_group=1,
                                 topk_group=1, weights_fp32=True, activation="silu", gated=True, interleaved=False,
                                 transposed=False, alpha=1.702, limit=7.0, weight_on_input=False,
                                 renorm_min=0.0, group_top=2, identity_experts=0, zero_experts=0,
                                 jitter_eps=0.0, round_weights=False, post_norm="none", post_norm_eps=1e-6,
                                 post_norm_offset=0.0, round_weights_to=None, gate_up_out=None, router_logits=None,
                                 routing_layout=None, expert_scale=None, post_norm_weight=None, post_norm_input=None):
    """Reference backward of `mok::fused_moe`: recomputes expert activations, fixed summation order
    (`gate_up_out`, `router_logits`, `routing_layout`, `post_norm_input`, what the CUDA kernels' forward saved,
    are not read).

    weight_on_input: the expert input is xs = x * w (recomputed in the accumulation dtype); with dxs its
    gradient, d x += dxs * w and d w = <dxs, x>; the combine is unweighted, so it adds no weight gradient.
    identity_experts: an identity pair adds w * x to the output: d w = <go, x> and d x += w * go.
    zero_experts: a zero pair adds nothing (its row is skipped): d w = 0 there.
    post_norm: a pair adds w * n(y): d w = <go, n(y)>, and d y, d g from `post_norm_backward` of w * go.
    round_weights, round_weights_to: the weights' rounding reads as the identity.

    Returns (grad_hidden_states, grad_router, grad_router_bias, grad_gate_up_proj, grad_gate_up_bias,
    grad_down_proj, grad_down_bias, grad_expert_scale, grad_post_norm_weight); gradients are None where their
    input is None.
    """
    x = hidden_states
    T, H = x.shape
    K = topk_ids.shape[1]
    E = gate_up_proj.shape[0]
    acc = _acc_dtype(x.dtype)
    xa, go = x.to(acc), grad_out.to(acc)
    w1s, w2s = gate_up_proj.to(acc), down_proj.to(acc)
    b1s = None if gate_up_bias is None else gate_up_bias.to(acc)
    b2s = None if down_bias is None else down_bias.to(acc)
    wts = topk_weights.to(acc)

    d_x = torch.zeros_like(xa)
    d_w1 = torch.zeros_like(w1s)
    d_w2 = torch.zeros_like(w2s)
    d_b1 = None if b1s is None else torch.zeros_like(b1s)
    d_b2 = None if b2s is None else torch.zeros_like(b2s)
    d_wts = torch.zeros(T * K, dtype=acc, device=x.device)
    d_pn = None if post_norm_weight is None else torch.zeros_like(post_norm_weight, dtype=acc)

    order, counts = group_by_expert(topk_ids, E)
    tok = order // K
    start = 0
    for e, n in enumerate(counts[:E].tolist()):
        if n == 0:
            continue
        pairs = order[start:start + n]
        t = tok[start:start + n]
        start += n
        xe = xa[t]
        if weight_on_input:
            w_pair = wts.view(-1)[pairs].unsqueeze(-1)
            x_in = _weighted_input(xe, w_pair)
        else:
            x_in = xe
        h = _project(x_in, w1s[e], None if b1s is None else b1s[e], transposed)
        a = activate(h, activation=activation, gated=gated, interleaved=interleaved, alpha=alpha, limit=limit)
        if weight_on_input:  # unweighted combine: out += y
            dy = go[t]
        else:
            y = _project(a, w2s[e], None if b2s is None else b2s[e], transposed)
            dy = go[t] * wts.view(-1)[pairs].unsqueeze(-1)
            if post_norm != "none":
                g = expert_post_norm_scale(post_norm_weight, e, post_norm_offset).to(acc)
                d_wts[pairs] = (go[t] * apply_post_norm(y, g, kind=post_norm, eps=post_norm_eps)).sum(dim=-1)
                dy, dg = post_norm_backward(y, g, dy, kind=post_norm, eps=post_norm_eps)
                d_pn[e if d_pn.dim() == 2 else slice(None)] += dg.sum(dim=0)
            else:
                d_wts[pairs] = (go[t] * y).sum(dim=-1)
        if transposed:  # y = a @ W2, W2: [I, H]
            d_w2[e] = a.t() @ dy
            da = dy @ w2s[e].t()
        else:  # y = a @ W2^T, W2: [H, I]
            d_w2[e] = dy.t() @ a
            da = dy @ w2s[e]
        dh = activation_backward(h, da, activation=activation, gated=gated, interleaved=interleaved,
                                 alpha=alpha, limit=limit)
        if transposed:
            d_w1[e] = x_in.t() @ dh
            dxe = dh @ w1s[e].t()
        else:
            d_w1[e] = dh.t() @ x_in
            dxe = dh @ w1s[e]
        if weight_on_input:  # dxe is the gradient of the expert input x * w
            d_wts[pairs] = (dxe * xe).sum(dim=-1)
            dxe = dxe * w_pair
        if d_b1 is not None:
            d_b1[e] = dh.sum(dim=0)
        if d_b2 is not None:
            d_b2[e] = dy.sum(dim=0)
        d_x.index_add_(0, t, dxe)

    d_wts = d_wts.view(T, K)
    if identity_experts:
        passed = topk_ids >= E
        d_wts = torch.where(passed, (go * xa).sum(dim=-1, keepdim=True), d_wts)
        d_x += go * identity_weight(wts.view(T, K), topk_ids, E)
    if grad_topk_weights is not None:
        d_wts = d_wts + grad_topk_weights.to(acc)
    logits = _logits_of(x, router, router_bias, router_is_logits=router_is_logits, router_fp32=router_fp32)
    d_logits, d_scale = routing_backward(logits, topk_weights, topk_ids, d_wts, routing=routing,
                                         renormalize=renormalize, renorm_eps=renorm_eps, routed_scale=routed_scale,
                                         renorm_min=renorm_min, expert_scale=expert_scale,
                                         softmax_fp32=softmax_fp32, jitter_eps=jitter_eps)
    if router_is_logits:
        d_router, d_router_bias = d_logits.to(router.dtype), None
    else:
        d_router = (d_logits.t() @ xa).to(router.dtype)
        d_x += d_logits @ router.to(acc)
        d_router_bias = None if router_bias is None else d_logits.sum(dim=0).to(router_bias.dtype)
    return (
        d_x.to(x.dtype),
        d_router,
        d_router_bias,
        d_w1.to(gate_up_proj.dtype),
        None if d_b1 is None else d_b1.to(gate_up_bias.dtype),
        d_w2.to(down_proj.dtype),
        None if d_b2 is None else d_b2.to(down_bias.dtype),
        None if d_scale is None else d_scale.to(expert_scale.dtype),
        None if d_pn is None else d_pn.to(post_norm_weight.dtype),
    )
