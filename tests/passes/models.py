"""From-scratch MoE modules (own class names, no transformers) and near-miss look-alikes for the pass tests."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SwiGLUExpert(nn.Module):
    def __init__(self, hidden: int, inter: int, act=F.silu):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)  # gate
        self.w3 = nn.Linear(hidden, inter, bias=False)  # up
        self.w2 = nn.Linear(inter, hidden, bias=False)  # down
        self.act = act

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class ReluExpert(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, inter)
        self.fc2 = nn.Linear(inter, hidden)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class IndexAddLoopMoE(nn.Module):
    """transformers 4.x Mixtral: one_hot mask, torch.where per expert, index_add_ combine."""

    def __init__(self, hidden=32, inter=16, experts=4, top_k=2, expert_cls=SwiGLUExpert, renormalize=True):
        super().__init__()
        self.top_k, self.num_experts, self.renormalize = top_k, experts, renormalize
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList([expert_cls(hidden, inter) for _ in range(experts)])

    def forward(self, hidden_states):
        B, S, H = hidden_states.shape
        x = hidden_states.view(-1, H)
        router_logits = self.gate(x)
        weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        weights, selected = torch.topk(weights, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros((B * S, H), dtype=x.dtype, device=x.device)
        mask = F.one_hot(selected, num_classes=self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            idx, top_x = torch.where(mask[e])
            current = x[None, top_x].reshape(-1, H)
            current = self.experts[e](current) * weights[top_x, idx, None]
            out.index_add_(0, top_x, current.to(x.dtype))
        return out.reshape(B, S, H), router_logits


def sparsemixer(compare=torch.gt, factor="clamp", second="scatter", order=(0, 1), times=2):
    """PhiMoE's inference sparsemixer written from scratch, with HF's signature `(scores, jitter_eps, training,
    top_k)` (so it can replace HF's), and with one thing changed for a near miss: the mask's `compare`, its `factor`
    ("clamp": |s| clamped below by the round's largest; "abs": |s| alone), what the `second` round runs on
    ("scatter": the scores without the first pick; "scores": all of them), the weights' `order` and the threshold,
    `times` * jitter_eps."""
    def replacement(scores, jitter_eps, training, top_k=2):
        def one_round(left):
            top, idx = left.max(dim=-1, keepdim=True)
            f = scores.abs().clamp(min=top) if factor == "clamp" else scores.abs()
            drop = compare((top - scores) / f, times * jitter_eps)
            return torch.softmax(left.masked_fill(drop, float("-inf")), dim=-1).gather(dim=-1, index=idx), idx

        w1, i1 = one_round(scores)
        w2, i2 = one_round(torch.scatter(scores, -1, i1, float("-inf")) if second == "scatter" else scores)
        weights = (w1, w2)
        return torch.cat((weights[order[0]], weights[order[1]]), dim=-1), torch.cat((i1, i2), dim=-1)

    return replacement


class SparsemixerLoopMoE(IndexAddLoopMoE):
    """PhiMoE's inference routing written from scratch (`sparsemixer`) in front of the 4.x expert loop."""

    def __init__(self, jitter_eps=0.2, **kw):
        super().__init__(top_k=2, **kw)
        self.jitter_eps = jitter_eps

    def forward(self, hidden_states):
        B, S, H = hidden_states.shape
        x = hidden_states.view(-1, H)
        weights, selected = sparsemixer()(self.gate(x), self.jitter_eps, training=False)
        out = torch.zeros((B * S, H), dtype=x.dtype, device=x.device)
        mask = F.one_hot(selected, num_classes=self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            idx, top_x = torch.where(mask[e])
            out.index_add_(0, top_x, self.experts[e](x[top_x]) * weights[top_x, idx, None])
        return out.reshape(B, S, H)


class DenseMaskMoE(nn.Module):
    """Research-code style: every expert runs on every token, weights picked with ids == e, summed."""

    def __init__(self, hidden=32, inter=16, experts=4, top_k=2, expert_cls=SwiGLUExpert):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts)
        self.experts = nn.ModuleList([expert_cls(hidden, inter) for _ in range(experts)])

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top, ids = self.router(x).topk(self.top_k, dim=-1)
        w = top.softmax(dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            w_e = (w * (ids == e)).sum(dim=-1)
            out = out + w_e[:, None] * expert(x)
        return out.reshape(shape)


class StackedGatherMoE(nn.Module):
    """Stacked expert weights, gathered per (token, slot) and applied with bmm; sigmoid routing with a bias."""

    def __init__(self, hidden=32, inter=16, experts=8, top_k=2, scale=1.5):
        super().__init__()
        self.top_k, self.scale = top_k, scale
        self.router = nn.Parameter(torch.randn(experts, hidden) / hidden**0.5)
        self.choice_bias = nn.Parameter(torch.randn(experts) * 0.1)
        self.w_in = nn.Parameter(torch.randn(experts, 2 * inter, hidden) / hidden**0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, inter) / inter**0.5)

    def route(self, x):
        """Sigmoid scores, experts chosen with a bias, renormalised and scaled weights; (weights [T, K], flat ids)."""
        scores = F.linear(x, self.router).float().sigmoid()
        ids = torch.topk(scores + self.choice_bias, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        return w / w.sum(dim=-1, keepdim=True) * self.scale, ids.reshape(-1)

    def experts(self, xs, flat):
        """SwiGLU of each (token, slot) row with its gathered expert weights: [T*K, H]."""
        h = torch.bmm(self.w_in[flat], xs.unsqueeze(-1)).squeeze(-1)
        gate, up = h.chunk(2, dim=-1)
        return torch.bmm(self.w_out[flat], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)

    def forward(self, x):
        T, H = x.shape
        w, flat = self.route(x)
        y = self.experts(x.repeat_interleave(self.top_k, dim=0), flat)
        y = y.view(T, self.top_k, H) * w.unsqueeze(-1).to(y.dtype)
        return y.sum(dim=1)


class ComputedWeightsMoE(StackedGatherMoE):
    """The expert weights computed in the forward: per-expert scales of the stored weights (a weight norm's
    ``g * v``) and a LoRA delta on the down projection, ``W + B @ A``. `scaled_by`: "parameters" (both computed from
    parameters alone), "buffer" (the scale a buffer, as a dequantising scale is) or "activation" (the gate_up weight
    also scaled by a statistic of the tokens: a near miss)."""

    def __init__(self, scaled_by="parameters", **kw):
        super().__init__(**kw)
        E, rows, _ = self.w_in.shape
        self.scaled_by = scaled_by
        scale = torch.rand(E, rows, 1) + 0.5
        if scaled_by == "buffer":
            self.register_buffer("in_scale", scale)
        else:
            self.in_scale = nn.Parameter(scale)
        self.lora_a = nn.Parameter(torch.randn(E, 2, self.w_out.shape[2]) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(E, self.w_out.shape[1], 2) * 0.1)

    def experts(self, xs, flat):
        w_in = self.w_in * self.in_scale
        if self.scaled_by == "activation":
            w_in = w_in * xs.abs().mean()
        w_out = self.w_out + self.lora_b @ self.lora_a
        h = torch.bmm(w_in[flat], xs.unsqueeze(-1)).squeeze(-1)
        gate, up = h.chunk(2, dim=-1)
        return torch.bmm(w_out[flat], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)


class Fp32SwiGLUMoE(StackedGatherMoE):
    """Beam's experts: the SwiGLU in fp32, rounded once, ``(silu(g.float()) * u.float()).to(h.dtype)`` (in `wide`;
    `silu_rounded_to`: a dtype the silu value is rounded to before the product)."""

    wide = torch.float32
    silu_rounded_to = None

    def experts(self, xs, flat):
        h = torch.bmm(self.w_in[flat], xs.unsqueeze(-1)).squeeze(-1)
        gate, up = h.chunk(2, dim=-1)
        s = F.silu(gate.to(self.wide))
        if self.silu_rounded_to is not None:
            s = s.to(self.silu_rounded_to).to(self.wide)
        a = (s * up.to(self.wide)).to(h.dtype)
        return torch.bmm(self.w_out[flat], a.unsqueeze(-1)).squeeze(-1)


class SoftcappedSwiGLUMoE(StackedGatherMoE):
    """Inkling2's softcapped SwiGLU, ``cap(g, 4) * sigmoid(g) * cap(u, 25)`` with ``cap(v, c) = tanh(v / c) * c``, in
    fp32 and rounded once (as Inkling2 writes it), or op by op in the experts' dtype (`in_fp32=False`)."""

    in_fp32 = True

    def experts(self, xs, flat):
        h = torch.bmm(self.w_in[flat], xs.unsqueeze(-1)).squeeze(-1)
        gate, up = h.chunk(2, dim=-1)
        g, u = (gate.float(), up.float()) if self.in_fp32 else (gate, up)
        a = ((torch.tanh(g / 4.0) * 4.0) * torch.sigmoid(g) * (torch.tanh(u / 25.0) * 25.0)).to(h.dtype)
        return torch.bmm(self.w_out[flat], a.unsqueeze(-1)).squeeze(-1)


class WeightOnInputMoE(StackedGatherMoE):
    """Routing weights scale the expert input (the op's weight_on_input) in a gathered form the pass does not
    detect (it knows Llama4's dense form): it must be reported and left untouched."""

    def forward(self, x):
        T, H = x.shape
        w, flat = self.route(x)
        y = self.experts(x.repeat_interleave(self.top_k, dim=0) * w.reshape(-1, 1), flat)
        return y.view(T, self.top_k, H).sum(dim=1)


class SquaredWeightsMoE(StackedGatherMoE):
    """Near miss: the routing weight is squared before it is applied."""

    def forward(self, x):
        T, H = x.shape
        w, flat = self.route(x)
        y = self.experts(x.repeat_interleave(self.top_k, dim=0), flat)
        y = y.view(T, self.top_k, H) * (w * w).unsqueeze(-1)
        return y.sum(dim=1)


class DividedWeightsMoE(StackedGatherMoE):
    """The OpenAI privacy filter's scales: the (already scaled) routing weights divided by a number, and the experts'
    sum multiplied by one after the block. 3 is no power of two, so w * (1 / 3) may round differently from w / 3."""

    def forward(self, x):
        T, H = x.shape
        w, flat = self.route(x)
        y = self.experts(x.repeat_interleave(self.top_k, dim=0), flat)
        y = y.view(T, self.top_k, H) * (w / 3.0).unsqueeze(-1).to(y.dtype)
        return y.sum(dim=1) * 2.0


class TensorDividedWeightsMoE(StackedGatherMoE):
    """Near miss: the routing weights divided by a parameter (a tensor that training changes), not by a number."""

    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(3.0))

    def forward(self, x):
        T, H = x.shape
        w, flat = self.route(x)
        y = self.experts(x.repeat_interleave(self.top_k, dim=0), flat)
        y = y.view(T, self.top_k, H) * (w / self.temperature).unsqueeze(-1).to(y.dtype)
        return y.sum(dim=1)


class BiasedSoftmaxMoE(StackedGatherMoE):
    """Ernie 4.5's routing: fp32 softmax, a selection bias kept as a [1, E] parameter and added squeezed, the unbiased
    probabilities of the chosen experts renormalised by clamp(sum, min). `norm_min` is large here, so that the clamp
    holds some tokens' sums (Ernie's is 1e-12)."""

    def __init__(self, norm_min=0.35, **kw):
        super().__init__(**kw)
        self.norm_min = norm_min
        self.choice_bias = nn.Parameter(torch.randn(1, self.router.shape[0]) * 0.1)

    def route(self, x):
        probs = F.softmax(F.linear(x.float(), self.router.float()), dim=1, dtype=torch.float)
        ids = torch.topk(probs + self.choice_bias.squeeze(), self.top_k, dim=-1)[1]
        w = probs.gather(1, ids)
        return self.renormalise(w).to(x.dtype), ids.reshape(-1)

    def renormalise(self, w):
        return w / torch.clamp(w.sum(dim=-1, keepdim=True), min=self.norm_min)


class ClampedMaxRenormMoE(BiasedSoftmaxMoE):
    """Near miss: the renormalisation's sum is clamped from above too (the op clamps it from below only)."""

    def renormalise(self, w):
        return w / torch.clamp(w.sum(dim=-1, keepdim=True), min=self.norm_min, max=0.6)


class BiasedWeightsMoE(BiasedSoftmaxMoE):
    """Near miss: the routing weights are taken from the biased scores (the bias then does more than choose)."""

    def route(self, x):
        probs = F.softmax(F.linear(x.float(), self.router.float()), dim=1, dtype=torch.float)
        choice = probs + self.choice_bias.squeeze()
        ids = torch.topk(choice, self.top_k, dim=-1)[1]
        w = choice.gather(1, ids)
        return self.renormalise(w).to(x.dtype), ids.reshape(-1)


class ViewedScoresMoE(StackedGatherMoE):
    """The scores viewed to their own shape before the selection bias is added (``scores.view(-1, E) + bias``, as
    LongCat-Flash's router and earlier DeepSeek-V3 code write it): the view changes nothing. `weights_from="choice"`:
    the weights are the choice values gathered (a near miss)."""

    def __init__(self, weights_from="scores", **kw):
        super().__init__(**kw)
        self.weights_from = weights_from

    def choice(self, scores):
        return scores.view(-1, self.router.shape[0]) + self.choice_bias

    def route(self, x):
        scores = F.linear(x, self.router).float().sigmoid()
        choice = self.choice(scores)
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        w = (scores if self.weights_from == "scores" else choice).gather(1, ids)
        return w / w.sum(dim=-1, keepdim=True) * self.scale, ids.reshape(-1)


class CastThenViewRouterMoE(StackedGatherMoE):
    """The router reads its input cast to fp32 and then reshaped to its own shape (Inkling2's
    ``F.linear(x.float().reshape(-1, H), W)``): the experts read the uncast x."""

    def route(self, x):
        scores = F.linear(x.float().reshape(-1, x.shape[-1]), self.router.float()).sigmoid()
        ids = torch.topk(scores + self.choice_bias, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        return (w / w.sum(dim=-1, keepdim=True) * self.scale).to(x.dtype), ids.reshape(-1)


class SeparateRouterInputMoE(StackedGatherMoE):
    """The router reads another tensor than the experts: an RMS-normalised copy of x (as Gemma 4 routes on one
    normalisation of the residual and computes its experts on another), or ``x.detach()`` (no gradient from the
    router into x). The logits are then the op's router argument, computed in the graph."""

    def __init__(self, router_input="normed", **kw):
        super().__init__(**kw)
        self.router_input = router_input

    def route(self, x):
        if self.router_input == "detached":
            return super().route(x.detach())
        return super().route(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class RouterInputThenTallLinearMoE(SeparateRouterInputMoE):
    """A router on a normalised copy of x, then a linear whose weight has as many rows as there are tokens (Gemma 4's
    global attention's query projection has 8192 rows, the tokens of a 2 x 4096 batch): a parameter of T rows that
    the expert ids reach, which is no activation of the experts."""

    def __init__(self, tokens, hidden=32, **kw):
        super().__init__(hidden=hidden, **kw)
        self.after = nn.Linear(hidden, tokens, bias=False)

    def forward(self, x):
        return self.after(super().forward(x))


class TwoActivationExpertsMoE(StackedGatherMoE):
    """Near miss: routed on one input (z), the experts compute on another (x), and each slot's output is also
    multiplied by z: the experts read two activations, which the op does not take."""

    def forward(self, x, z):
        T, H = x.shape
        w, flat = self.route(z)
        y = self.experts(x.repeat_interleave(self.top_k, dim=0), flat) * z.repeat_interleave(self.top_k, dim=0)
        y = y.view(T, self.top_k, H) * w.unsqueeze(-1).to(y.dtype)
        return y.sum(dim=1)


class ScrambledScoresMoE(ViewedScoresMoE):
    """Near miss: the scores transposed to [E, T] and reshaped back to [T, E] before the top-k, which mixes tokens'
    scores (a reshape to a new shape is not walked through)."""

    def choice(self, scores):
        return scores.t().reshape(-1, self.router.shape[0]) + self.choice_bias


class BiasedSigmoidTopKMoE(StackedGatherMoE):
    """Kolibri1's routing: fp32 logits, experts chosen on logits + bias, sigmoid of the unbiased chosen logits,
    renormalised."""

    def route(self, x):
        logits = F.linear(x.float(), self.router.float())
        ids = torch.topk(logits + self.choice_bias, self.top_k, dim=-1)[1]
        w = logits.gather(1, ids).sigmoid()
        return w / w.sum(dim=-1, keepdim=True), ids.reshape(-1)


class Fp32MmRouterMoE(BiasedSigmoidTopKMoE):
    """Kolibri1's router at inference on CUDA: fp32 logits from a 16-bit GEMM, ``torch.mm(x, W.t(),
    out_dtype=torch.float32)`` (that overload has no CPU kernel: trace it on meta tensors or run it on a GPU)."""

    def route(self, x):
        logits = torch.mm(x, self.router.t(), out_dtype=torch.float32)
        ids = torch.topk(logits + self.choice_bias, self.top_k, dim=-1)[1]
        w = logits.gather(1, ids).sigmoid()
        return w / w.sum(dim=-1, keepdim=True), ids.reshape(-1)


class Fp32MmRoundedRouterMoE(BiasedSigmoidTopKMoE):
    """Ergo's router at inference on CUDA: an fp32 router weight (HF keeps it in fp32) rounded to the input's 16 bits,
    then fp32 logits from the 16-bit GEMM, ``torch.mm(x, W.to(x.dtype).T, out_dtype=torch.float32)``; `.float()` the
    router after the module's cast to 16 bits. `transposed(W)` spells the transpose (``W.T`` by default)."""

    transposed = staticmethod(lambda w: w.T)

    def route(self, x):
        logits = torch.mm(x, self.transposed(self.router.to(x.dtype)), out_dtype=torch.float32)
        ids = torch.topk(logits + self.choice_bias, self.top_k, dim=-1)[1]
        w = logits.gather(1, ids).sigmoid()
        return w / w.sum(dim=-1, keepdim=True), ids.reshape(-1)


class SigmoidTopKMoE(StackedGatherMoE):
    """Sparse topk_sigmoid without a bias: the sigmoid of the top-k logits, scaled."""

    def route(self, x):
        top, ids = torch.topk(F.linear(x, self.router), self.top_k, dim=-1)
        return top.sigmoid() * self.scale, ids.reshape(-1)


class GroupLimitedMoE(StackedGatherMoE):
    """DeepSeek-V3's group-limited selection on sigmoid scores plus a selection bias: 4 groups, the best 2 by the
    sum of their top `group_top` choices; the others filled with `fill` before the top-k. `weights_from="choice"`:
    the weights are the biased choice values gathered, not the scores (a near miss)."""

    def __init__(self, fill=float("-inf"), group_top=2, experts=16, weights_from="scores", **kw):
        super().__init__(experts=experts, **kw)
        self.fill, self.group_top, self.weights_from = fill, group_top, weights_from

    def route(self, x):
        scores = F.linear(x, self.router).float().sigmoid()
        choice = scores + self.choice_bias
        E = choice.shape[-1]
        group = choice.view(-1, 4, E // 4).topk(self.group_top, dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(group).scatter(1, torch.topk(group, 2, dim=-1)[1], 1)
        keep = keep.unsqueeze(-1).expand(-1, 4, E // 4).reshape(-1, E)
        ids = torch.topk(choice.masked_fill(~keep.bool(), self.fill), self.top_k, dim=-1)[1]
        w = (scores if self.weights_from == "scores" else choice).gather(1, ids)
        return w / w.sum(dim=-1, keepdim=True) * self.scale, ids.reshape(-1)


class SoftmaxGroupLimitedMoE(StackedGatherMoE):
    """Mistral4's router (transformers' `Mistral4TopkRouter`): softmax probabilities in the router's dtype, the best
    2 of 4 groups by the sum of their top 2, the other groups filled with 0, only the ids of the top-k used, the
    probabilities gathered there, renormalised (+1e-20) and scaled."""

    def __init__(self, experts=16, gather_from="probs", **kw):
        super().__init__(experts=experts, **kw)
        self.gather_from = gather_from

    def route(self, x):
        logits = F.linear(x, self.router)
        probs = logits.softmax(-1)
        E = probs.shape[-1]
        group = probs.view(-1, 4, E // 4).topk(2, dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(group)
        keep.scatter_(1, torch.topk(group, k=2, dim=-1, sorted=False)[1], 1)
        keep = keep.unsqueeze(-1).expand(-1, 4, E // 4).reshape(-1, E)
        ids = torch.topk(probs.masked_fill(~keep.bool(), 0.0), k=self.top_k, dim=-1, sorted=False)[1]
        w = (probs if self.gather_from == "probs" else logits).gather(1, ids)
        w /= w.sum(dim=-1, keepdim=True) + 1e-20
        return w * self.scale, ids.reshape(-1)


class SqrtSoftplusMoE(StackedGatherMoE):
    """DeepSeek-V4's routed experts (transformers' `DeepseekV4TopKRouter` and `DeepseekV4Experts`): sqrt(softplus)
    scores, a selection bias, the unbiased scores gathered at the top-k's ids, renormalised (+1e-20) and scaled; the
    SwiGLU clamped at `limit` (gate from above, up on both sides). Near misses: `variant` "softplus" (no sqrt),
    "beta" (softplus with beta 2), "cast" (softplus in fp32, its sqrt in bf16), "swapped_clamps" (the gate clamped
    on both sides, the up from above only: the same ops)."""

    def __init__(self, limit=0.5, variant=None, **kw):
        super().__init__(**kw)
        self.limit, self.variant = limit, variant

    def route(self, x):
        logits = F.linear(x, self.router)
        if self.variant == "softplus":
            scores = F.softplus(logits)
        elif self.variant == "beta":
            scores = F.softplus(logits, beta=2.0).sqrt()
        elif self.variant == "cast":
            scores = F.softplus(logits.float()).to(torch.bfloat16).sqrt()
        else:
            scores = F.softplus(logits).sqrt()
        ids = torch.topk(scores + self.choice_bias, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scale, ids.reshape(-1)

    def experts(self, xs, flat):
        h = torch.bmm(self.w_in[flat], xs.unsqueeze(-1)).squeeze(-1)
        gate, up = h.chunk(2, dim=-1)
        if self.variant == "swapped_clamps":
            gate, up = gate.clamp(min=-self.limit, max=self.limit), up.clamp(max=self.limit)
        else:
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return torch.bmm(self.w_out[flat], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)


class HashRoutedMoE(StackedGatherMoE):
    """Hash routing written by hand: each token's experts looked up by its id in a fixed table (which names some
    expert twice in a row), weighted by the router's softmax probabilities there, renormalised and scaled. Near
    misses: `variant` "topk_weights" (the weights are the top-k probabilities, not those at the looked-up ids),
    "biased" (a bias added to the probabilities that are gathered: it would weight, not choose)."""

    def __init__(self, vocab=50, variant=None, **kw):
        super().__init__(**kw)
        self.variant = variant
        table = torch.randint(0, self.router.shape[0], (vocab, self.top_k), generator=torch.Generator().manual_seed(3))
        table[:4] = 5  # tokens 0-3 go to expert 5 in every slot
        self.register_buffer("table", table)

    def forward(self, x, token_ids):
        T, H = x.shape
        probs = F.linear(x, self.router).softmax(dim=-1)
        ids = self.table[token_ids]
        if self.variant == "topk_weights":
            w = probs.topk(self.top_k, dim=-1).values
        elif self.variant == "biased":
            w = (probs + self.choice_bias).gather(1, ids)
        else:
            w = probs.gather(1, ids)
        w = w / w.sum(dim=-1, keepdim=True) * self.scale
        y = self.experts(x.repeat_interleave(self.top_k, dim=0), ids.reshape(-1))
        return (y.view(T, self.top_k, H) * w.unsqueeze(-1)).sum(dim=1)


class ModuloHashMoE(StackedGatherMoE):
    """Hash routing by arithmetic on token ids, no table: slot k's expert is (a_k * token + b_k) % E, so two slots
    can name one expert; the router's sigmoid scores there weight them, scaled. Near miss: `variant` "activation"
    (the hash also adds each token's argmax hidden unit: the ids depend on activations, so nothing gives them)."""

    def __init__(self, variant=None, **kw):
        super().__init__(**kw)
        self.variant = variant

    def forward(self, x, token_ids):
        T, H = x.shape
        E = self.router.shape[0]
        keys = token_ids if self.variant is None else token_ids + x.argmax(dim=-1)
        ids = torch.stack([(keys * a + b) % E for a, b in ((7, 1), (3, 5))[:self.top_k]], dim=-1)
        w = torch.sigmoid(F.linear(x, self.router)).gather(1, ids) * self.scale
        y = self.experts(x.repeat_interleave(self.top_k, dim=0), ids.reshape(-1))
        return (y.view(T, self.top_k, H) * w.unsqueeze(-1)).sum(dim=1)


class SharedExpertMoE(nn.Module):
    """A routed MoE (stacked weights) plus a shared expert gated by sigmoid(Linear(H, 1)), Qwen2-MoE style."""

    def __init__(self, hidden=32, inter=16):
        super().__init__()
        self.routed = StackedGatherMoE(hidden, inter)
        self.shared = SwiGLUExpert(hidden, inter)
        self.shared_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x):
        return self.routed(x) + torch.sigmoid(self.shared_gate(x)) * self.shared(x)


class ViewedSharedExpertMoE(nn.Module):
    """AFMoE's order (transformers' `AfmoeSparseMoeBlock`): [B, S, H] in, the router first, then an ungated shared
    expert on the flattened tokens, both outputs viewed back to [B, S, H] and summed. The shared output reaches the
    sum through a view, which must not carry the shared expert into the routed region."""

    def __init__(self, hidden=32, inter=16):
        super().__init__()
        self.routed = StackedGatherMoE(hidden, inter)
        self.shared = SwiGLUExpert(hidden, inter)

    def forward(self, x):
        B, S, H = x.shape
        flat = x.view(-1, H)
        w, ids = self.routed.route(flat)
        shared = self.shared(flat).view(B, S, H)
        y = self.routed.experts(flat.repeat_interleave(self.routed.top_k, dim=0), ids)
        routed = (y.view(-1, self.routed.top_k, H) * w.unsqueeze(-1).to(y.dtype)).sum(dim=1)
        return shared + routed.view(B, S, H)


class SharedInEverySlotMoE(ViewedSharedExpertMoE):
    """Near miss: the shared expert's output, viewed to [T, 1, H], is added to each slot's expert output before the
    routing weights (out = sum_k w_k (y_k + s)): not an MoE the op computes, so it must be left untouched."""

    def forward(self, x):
        B, S, H = x.shape
        flat = x.view(-1, H)
        w, ids = self.routed.route(flat)
        shared = self.shared(flat).view(-1, 1, H)
        y = self.routed.experts(flat.repeat_interleave(self.routed.top_k, dim=0), ids)
        y = y.view(-1, self.routed.top_k, H) + shared
        return (y * w.unsqueeze(-1).to(y.dtype)).sum(dim=1).view(B, S, H)


class SquaredOutputMoE(nn.Module):
    """The block's output squared after it: the square is not part of the block (it stays in the graph)."""

    def __init__(self):
        super().__init__()
        self.moe = StackedGatherMoE()

    def forward(self, x):
        return self.moe(x).pow(2)


class PostNormMoE(nn.Module):
    """A post-norm layer (FlexOlmo's): HF's RMSNorm right after the block. In fp32 its ``.to(float32)`` is a no-op
    and its ``.pow(2)`` has the block output's shape and dtype, yet the block ends before them."""

    def __init__(self, hidden=32):
        super().__init__()
        self.moe = StackedGatherMoE(hidden)
        self.norm_weight = nn.Parameter(torch.randn(hidden))

    def forward(self, x):
        h = self.moe(x).to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x + self.norm_weight * h.to(x.dtype)


class DenseMLP(nn.Module):
    def __init__(self, hidden=32, inter=64):
        super().__init__()
        self.mlp = SwiGLUExpert(hidden, inter)

    def forward(self, x):
        return self.mlp(x)


class TopKSampler(nn.Module):
    """top-k over vocabulary logits for sampling: a topk that dispatches to nothing."""

    def __init__(self, hidden=32, vocab=100):
        super().__init__()
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x):
        values, ids = self.head(x).topk(5, dim=-1)
        return torch.softmax(values, dim=-1), ids


class TopKTokenPruning(nn.Module):
    """top-k keeps the most salient tokens, which an MLP then processes."""

    def __init__(self, hidden=32, keep=4):
        super().__init__()
        self.score = nn.Linear(hidden, 1)
        self.mlp = SwiGLUExpert(hidden, 2 * hidden)
        self.keep = keep

    def forward(self, x):  # x: [T, H]
        s = self.score(x).squeeze(-1)
        w, ids = s.topk(self.keep)
        kept = x[ids]
        return self.mlp(kept) * torch.sigmoid(w)[:, None]


class SentinelMaskMoE(nn.Module):
    """Sorted dispatch that drops "sentinel" slots (expert id >= `drop_from`), the way expert-parallel code marks
    tokens routed to another rank: a bool row mask, an in-place clamp of the sorted ids, an in-place zeroing of the
    gathered inputs, and a zeroing of each projection's output. With `drop_from = experts` (the default) no id from
    the top-k reaches it, so the block is an ordinary MoE.

    matmul="grouped": one grouped matmul per projection over offsets (the clamp is then never read again);
    matmul="gather": per-slot weights ``W[ids]`` and bmm (the clamped ids are read by the gathers).
    """

    def __init__(self, hidden=32, inter=16, experts=8, top_k=2, drop_from=None, matmul="gather"):
        super().__init__()
        self.top_k, self.experts, self.matmul = top_k, experts, matmul
        self.drop_from = experts if drop_from is None else drop_from
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, 2 * inter, hidden) / hidden**0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, inter) / inter**0.5)

    def dropped(self, slot_expert, slot_x):
        return (slot_expert >= self.drop_from).unsqueeze(-1)

    def project(self, w, rows, slot_expert, offsets):
        if self.matmul == "grouped":
            return torch._grouped_mm(rows, w.transpose(1, 2), offs=offsets)
        return torch.bmm(w[slot_expert], rows.unsqueeze(-1)).squeeze(-1)

    def forward(self, x):
        T, H = x.shape
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        top_w, top_e = probs.topk(self.top_k, dim=-1)
        top_w = (top_w / top_w.sum(dim=-1, keepdim=True)).to(x.dtype)
        slot_expert, slot_order = top_e.flatten().sort()
        slot_x = x[slot_order // self.top_k]
        slot_w = top_w.flatten()[slot_order]
        offsets = None
        if self.matmul == "grouped":
            counts = torch.histc(slot_expert.float(), bins=self.experts, min=0, max=self.experts - 1)
            offsets = counts.cumsum(0, dtype=torch.int32)
        drop = self.dropped(slot_expert, slot_x)
        slot_expert.clamp_(max=self.experts - 1)
        slot_x.masked_fill_(drop, 0.0)
        h = self.project(self.w_in, slot_x, slot_expert, offsets).masked_fill(drop, 0.0)
        g, u = h.chunk(2, dim=-1)
        y = self.project(self.w_out, F.silu(g) * u, slot_expert, offsets).masked_fill(drop, 0.0)
        y = y * slot_w.unsqueeze(-1)
        back = torch.empty_like(y)
        back[slot_order] = y
        return back.view(T, self.top_k, H).sum(dim=1)


class TopKAttentionThenMoE(nn.Module):
    """A sparse attention whose top-k picks each query's keys (as DeepSeek-V4's indexer does), its output then
    through a grouped-matmul MoE: the attention's indices reach the MoE's expert GEMMs only through activations, so
    only the MoE's top-k is a block."""

    def __init__(self, hidden=32, keys=4, pooled=False):
        super().__init__()
        self.keys, self.pooled = keys, pooled
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.moe = SentinelMaskMoE(hidden, matmul="grouped")

    def forward(self, x):  # x: [T, H]
        q, k, v = self.q(x), self.k(x), self.v(x)
        ids = (q @ k.t()).topk(self.keys, dim=-1).indices  # [T, keys]
        if self.pooled:  # the chosen pools' key positions read from a 3-D integer table (GLM-5-Next's indexer)
            ids = torch.arange(x.shape[0], device=x.device).view(-1, 1, 1)[ids].flatten(1)
        att = torch.softmax((k[ids] @ q.unsqueeze(-1)).squeeze(-1), dim=-1)
        h = x + self.o((att.unsqueeze(-1) * v[ids]).sum(dim=1))
        return h + self.moe(h)


class ActivationMaskMoE(SentinelMaskMoE):
    """Near miss: the rows are dropped by a threshold on the activations, not by their expert id."""

    def dropped(self, slot_expert, slot_x):
        return (slot_x > 2.5).any(dim=-1, keepdim=True)


class DenseScaledInputMoE(nn.Module):
    """Llama4-like dense routing written from scratch (own names, shared MLP on the side): the top-k logits are
    scattered into a -inf [T, E] matrix, its sigmoid scales the input repeated once per expert, every expert runs
    (bmm over stacked [E, H, 2I] / [E, I, H] weights) and the outputs are summed over the expert dimension.
    Equal to a sparse MoE with the weight applied on the input.

    Near-miss variants (`variant`):
    - "zero_fill": the scores are scattered into zeros, so sigmoid gives every unchosen expert weight 0.5;
    - "scores_after": the dense scores scale the experts' outputs, sigmoid(0) = 0.5 weighting of the unchosen
      experts included (zero fill), instead of their inputs;
    - "scores_twice": the scores scale the experts' inputs and again their outputs;
    - "expert_bias": the first projection has a bias, so an unchosen expert (zero input) still contributes.
    Computed weights (`variant`), both computed after the routing, as PEFT's LoRA on a Llama4's experts is traced:
    - "lora": a LoRA delta ``W + B @ A`` on both expert weights (fused: the op takes the computed weights);
    - "lora_by_tokens": the same, the gate_up weight also scaled by a statistic of the tokens (a near miss).
    """

    def __init__(self, hidden=32, inter=16, experts=4, top_k=2, variant=None):
        super().__init__()
        self.top_k, self.num_experts, self.variant = top_k, experts, variant
        self.proj_score = nn.Parameter(torch.randn(experts, hidden) * 0.5)
        self.w_in = nn.Parameter(torch.randn(experts, hidden, 2 * inter) / hidden ** 0.5)
        self.w_out = nn.Parameter(torch.randn(experts, inter, hidden) / inter ** 0.5)
        self.b_in = nn.Parameter(torch.randn(experts, 2 * inter)) if variant == "expert_bias" else None
        if variant in ("lora", "lora_by_tokens"):
            self.lora_in = nn.ParameterList([torch.randn(experts, hidden, 2) * 0.1, torch.randn(experts, 2, 2 * inter)])
            self.lora_out = nn.ParameterList([torch.randn(experts, inter, 2) * 0.1, torch.randn(experts, 2, hidden)])
        self.side = SwiGLUExpert(hidden, inter)

    def forward(self, hidden_states):
        B, S, H = hidden_states.shape
        x = hidden_states.reshape(-1, H)
        logits = F.linear(x, self.proj_score)
        top, idx = torch.topk(logits, self.top_k, dim=1)
        fill = 0.0 if self.variant in ("zero_fill", "scores_after") else float("-inf")
        scores = torch.full_like(logits, fill).scatter_(1, idx, top)
        scores = torch.sigmoid(scores.float()).to(x.dtype)
        if self.variant == "scores_after":
            xin = x.repeat(self.num_experts, 1).view(self.num_experts, -1, H)
        else:
            xin = (x.repeat(self.num_experts, 1) * scores.transpose(0, 1).reshape(-1, 1)).view(self.num_experts, -1, H)
        w_in, w_out = self.w_in, self.w_out
        if self.variant in ("lora", "lora_by_tokens"):
            w_in = w_in + self.lora_in[0] @ self.lora_in[1]
            w_out = w_out + self.lora_out[0] @ self.lora_out[1]
            if self.variant == "lora_by_tokens":
                w_in = w_in * x.abs().mean()
        h = torch.bmm(xin, w_in)
        if self.b_in is not None:
            h = h + self.b_in.unsqueeze(1)
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm(up * F.silu(gate), w_out)
        if self.variant in ("scores_after", "scores_twice"):
            y = y * scores.transpose(0, 1).unsqueeze(-1)
        out = self.side(x)
        out.add_(y.reshape(self.num_experts, -1, H).sum(dim=0))
        return out.view(B, S, H)
