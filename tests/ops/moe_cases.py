"""Shared by the op tests: the variants of `mok::fused_moe`, their random inputs, and a dense oracle.

`CASES` spans every routing family, router form, activation, layout and optional
tensor the schema allows; each test file picks from it. `dense_oracle` is an
independent restatement of the op's maths, token by token and straight from the
definitions in shared/moe-semantics.md (no shared code with `reference.py`), so
comparing the op with it in fp64 checks the semantics and not just consistency.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from mok_compile.ops import reference
from mok_compile.ops.library import LEARNED_KWARGS
from mok_compile.ops.spec import ExpertSpec, RoutingSpec, op_kwargs, with_defaults


@dataclass(frozen=True)
class Case:
    """One variant of the op: the specs plus which optional tensors are passed.

    dtype is the precision the variant is meant for (opcheck and determinism run
    in it); router_dtype differs from it for an fp32 router in a bf16 model.
    """

    name: str
    routing: RoutingSpec
    experts: ExpertSpec = ExpertSpec()
    router_bias: bool = False
    selection_bias: bool = False
    expert_bias: bool = False
    num_experts: int = 4
    dtype: torch.dtype = torch.float32
    router_dtype: torch.dtype | None = None

    def __str__(self):
        return self.name


def _r(**kw):
    return RoutingSpec(**{"top_k": 2, **kw})


# A small clamp limit so that both sides of GPT-OSS's clamps are hit by unit-scale activations.
_CLAMPED = dict(activation="clamped_silu", limit=0.75)

ROUTING_CASES = [
    Case("softmax_topk", _r()),
    Case("softmax_topk_renorm_scale_wdtype", _r(renormalize=True, routed_scale=2.5, weights_fp32=False)),
    # DeepSeek's eps (1e-20) is invisible in any test; a large one checks where it enters, forward and backward.
    Case("softmax_topk_renorm_visible_eps", _r(renormalize=True, renorm_eps=0.25)),
    Case("softmax_topk_bf16_softmax", _r(softmax_fp32=False, weights_fp32=False), dtype=torch.bfloat16),
    Case("softmax_topk_router_fp32", _r(router_fp32=True, renormalize=True), dtype=torch.bfloat16,
         router_dtype=torch.float32),
    Case("softmax_topk_logits", _r(router_is_logits=True, renormalize=True)),
    Case("topk_softmax", _r(routing="topk_softmax", weights_fp32=False)),
    Case("topk_softmax_router_bias_bf16", _r(routing="topk_softmax", softmax_fp32=False, weights_fp32=False),
         router_bias=True, dtype=torch.bfloat16),
    Case("topk_softmax_logits", _r(routing="topk_softmax", router_is_logits=True)),
    # Ernie 4.5: a selection bias on the probabilities; renormalised by clamp(sum, min). A large renorm_min holds
    # the sum at the clamp for some tokens (the sum of 2 of 4 experts' probabilities is often below 0.7), so both
    # sides of the clamp are checked, forward and backward.
    Case("softmax_topk_selection_bias_clamp_min", _r(renormalize=True, renorm_min=0.7), selection_bias=True),
    Case("softmax_topk_ernie_bf16", _r(router_fp32=True, renormalize=True, renorm_min=1e-12, weights_fp32=False),
         selection_bias=True, dtype=torch.bfloat16, router_dtype=torch.float32),
    Case("topk_softmax_selection_bias", _r(routing="topk_softmax", renormalize=True), selection_bias=True),
    # DeepSeek-V2's group-limited greedy: softmax, the best topk_group of n_group groups by their largest
    # probability, scaled; and with the group score of DeepSeek-V3 (its top-2 sum) and a selection bias.
    Case("softmax_topk_group_max", _r(top_k=3, n_group=4, topk_group=2, group_top=1, routed_scale=2.5),
         num_experts=8),
    Case("softmax_topk_groups_bias_bf16", _r(n_group=2, topk_group=1, router_fp32=True, renormalize=True),
         selection_bias=True, dtype=torch.bfloat16, router_dtype=torch.float32),
    # Mistral4: the softmax in the router's 16-bit dtype, the group score of DeepSeek-V3 without a bias,
    # renormalised (+1e-20) and scaled, weights in that dtype.
    Case("softmax_topk_groups_mistral4_bf16",
         _r(top_k=3, n_group=4, topk_group=2, softmax_fp32=False, renormalize=True, renorm_eps=1e-20,
            routed_scale=2.5, weights_fp32=False), num_experts=8, dtype=torch.bfloat16),
    Case("sigmoid", _r(routing="sigmoid_grouped_topk")),
    Case("sigmoid_renorm_no_eps_wdtype", _r(routing="sigmoid_grouped_topk", renormalize=True, weights_fp32=False)),
    Case("sigmoid_deepseek_v3",
         _r(routing="sigmoid_grouped_topk", router_fp32=True, renormalize=True, renorm_eps=1e-20, routed_scale=2.5,
            n_group=2, topk_group=1), selection_bias=True, dtype=torch.bfloat16, router_dtype=torch.float32),
    Case("sigmoid_4_groups_keep_2",
         _r(routing="sigmoid_grouped_topk", top_k=3, n_group=4, topk_group=2, routed_scale=1.5),
         selection_bias=True, num_experts=8),
    # LFM2-MoE: the sigmoid in the router's 16-bit dtype, a selection bias of that dtype (the biased scores are
    # rounded to it), renormalised.
    Case("sigmoid_bf16_sigmoid_bias", _r(routing="sigmoid_grouped_topk", softmax_fp32=False, renormalize=True,
                                         renorm_eps=1e-6, weights_fp32=False), selection_bias=True,
         dtype=torch.bfloat16),
    Case("sigmoid_logits_groups", _r(routing="sigmoid_grouped_topk", router_is_logits=True, n_group=2, renormalize=True),
         selection_bias=True),
    # topk_sigmoid (Llama4's router): sigmoid of the k chosen logits.
    Case("topk_sigmoid", _r(routing="topk_sigmoid")),
    Case("topk_sigmoid_renorm_scale_wdtype", _r(routing="topk_sigmoid", renormalize=True, routed_scale=1.5,
                                                weights_fp32=False)),
    Case("topk_sigmoid_bf16_sigmoid_logits", _r(routing="topk_sigmoid", router_is_logits=True, softmax_fp32=False,
                                                weights_fp32=False), dtype=torch.bfloat16),
    # Kolibri1: a selection bias on the logits, sigmoid of the unbiased chosen logits, renormalised.
    Case("topk_sigmoid_selection_bias", _r(routing="topk_sigmoid", router_fp32=True, renormalize=True),
         selection_bias=True, dtype=torch.bfloat16, router_dtype=torch.float32),
    Case("topk_sigmoid_selection_bias_clamp_min", _r(routing="topk_sigmoid", renormalize=True, renorm_min=1.3),
         selection_bias=True),
    # sqrtsoftplus_topk (DeepSeek-V4's router): sqrt(softplus(logits)) in the logits' dtype, a selection bias,
    # the unbiased scores at the chosen experts renormalised (+1e-20) and scaled, weights in the input dtype; in fp32
    # and with groups (the op allows them, HF's V4 has none).
    Case("sqrtsoftplus_deepseek_v4_bf16", _r(routing="sqrtsoftplus_topk", softmax_fp32=False, renormalize=True,
                                             renorm_eps=1e-20, routed_scale=1.5, weights_fp32=False),
         selection_bias=True, dtype=torch.bfloat16),
    Case("sqrtsoftplus", _r(routing="sqrtsoftplus_topk")),
    Case("sqrtsoftplus_groups_renorm", _r(routing="sqrtsoftplus_topk", top_k=3, n_group=4, topk_group=2,
                                          renormalize=True, routed_scale=2.5), selection_bias=True, num_experts=8),
    # sparsemixer (PhiMoE at inference): a threshold that keeps some of the other experts in the masked softmax and
    # drops others (PhiMoE's 2 * 0.01 keeps near ties only); in bf16 as PhiMoE runs it, each op in the logits' dtype.
    Case("sparsemixer", _r(routing="sparsemixer", jitter_eps=0.2), num_experts=6),
    Case("sparsemixer_phimoe_bf16", _r(routing="sparsemixer", softmax_fp32=False, weights_fp32=False, jitter_eps=0.2),
         num_experts=6, dtype=torch.bfloat16),
    Case("sparsemixer_3_renorm_scale_logits", _r(routing="sparsemixer", top_k=3, router_is_logits=True,
                                                 renormalize=True, routed_scale=1.5, jitter_eps=0.3), num_experts=6),
]

# weight_on_input: the routing weight scales each expert's input, the k outputs are summed unweighted.
WEIGHT_ON_INPUT_CASES = [
    Case("llama4_weight_on_input", _r(routing="topk_sigmoid", weights_fp32=False, weight_on_input=True),
         ExpertSpec(transposed=True)),
    Case("llama4_weight_on_input_bf16", _r(routing="topk_sigmoid", weights_fp32=False, weight_on_input=True),
         ExpertSpec(transposed=True), dtype=torch.bfloat16),
    # fp32 weights on bf16 input: the product is fp32, rounded to bf16 before the expert.
    Case("weight_on_input_renorm_wfp32_bf16", _r(routing="topk_sigmoid", renormalize=True, weight_on_input=True),
         dtype=torch.bfloat16),
    Case("weight_on_input_renorm_scale_logits", _r(routing="topk_sigmoid", router_is_logits=True, renormalize=True,
                                                   routed_scale=2.5, weight_on_input=True), ExpertSpec(transposed=True)),
    # Other families and expert kinds with weight_on_input; biases make the expert non-homogeneous in its input.
    Case("weight_on_input_softmax_topk_bias", _r(renormalize=True, weight_on_input=True), expert_bias=True),
    Case("weight_on_input_gpt_oss_experts", _r(routing="topk_softmax", weight_on_input=True),
         ExpertSpec(**_CLAMPED, interleaved=True, transposed=True), router_bias=True, expert_bias=True),
    Case("weight_on_input_sigmoid_groups_relu2",
         _r(routing="sigmoid_grouped_topk", n_group=2, renormalize=True, weight_on_input=True),
         ExpertSpec(activation="relu2", gated=False), selection_bias=True),
]

EXPERT_CASES = [
    Case("silu_bias", _r(), ExpertSpec(), expert_bias=True),
    Case("silu_transposed", _r(), ExpertSpec(transposed=True)),
    Case("silu_interleaved", _r(), ExpertSpec(interleaved=True)),
    Case("gelu_tanh", _r(), ExpertSpec(activation="gelu_tanh")),
    Case("gelu_tanh_transposed_bias", _r(), ExpertSpec(activation="gelu_tanh", transposed=True), expert_bias=True),
    Case("clamped_silu_concatenated", _r(), ExpertSpec(**_CLAMPED)),
    Case("clamped_silu_gpt_oss", _r(routing="topk_softmax", softmax_fp32=False, weights_fp32=False),
         ExpertSpec(**_CLAMPED, interleaved=True, transposed=True), router_bias=True, expert_bias=True),
    # DeepSeek-V4's: silu(min(g, limit)) * clamp(u, -limit, limit).
    Case("clamped_swiglu", _r(), ExpertSpec(activation="clamped_swiglu", limit=0.75)),
    Case("clamped_swiglu_bf16", _r(), ExpertSpec(activation="clamped_swiglu", limit=0.75), dtype=torch.bfloat16),
    # Beam's SwiGLU in fp32, rounded once.
    Case("silu_fp32", _r(), ExpertSpec(activation="silu_fp32")),
    Case("silu_fp32_bf16", _r(), ExpertSpec(activation="silu_fp32"), dtype=torch.bfloat16),
    # Inkling2's: tanh(g / alpha) * alpha * sigmoid(g) * tanh(u / limit) * limit, with caps unit-scale activations
    # feel (Inkling2's are 4 and 25).
    Case("softcapped_swiglu", _r(), ExpertSpec(activation="softcapped_swiglu", alpha=0.8, limit=1.5)),
    Case("softcapped_swiglu_bf16", _r(routing="sigmoid_grouped_topk", router_fp32=True, renormalize=True,
                                      renorm_eps=1e-20, routed_scale=2.5),
         ExpertSpec(activation="softcapped_swiglu", alpha=0.8, limit=1.5), selection_bias=True, dtype=torch.bfloat16,
         router_dtype=torch.float32),
    Case("relu2", _r(), ExpertSpec(activation="relu2", gated=False)),
    Case("relu2_transposed_bias", _r(), ExpertSpec(activation="relu2", gated=False, transposed=True),
         expert_bias=True),
    Case("ungated_relu", _r(), ExpertSpec(activation="relu", gated=False)),
    Case("ungated_silu", _r(), ExpertSpec(activation="silu", gated=False)),
    Case("ungated_gelu", _r(), ExpertSpec(activation="gelu", gated=False)),
    Case("ungated_gelu_tanh", _r(), ExpertSpec(activation="gelu_tanh", gated=False)),
]

CASES = ROUTING_CASES + WEIGHT_ON_INPUT_CASES + EXPERT_CASES
CASES_BY_NAME = {c.name: c for c in CASES}


def make_args(case: Case, T: int = 6, H: int = 12, I: int = 4, *, dtype: torch.dtype | None = None, seed: int = 0,
              requires_grad: bool = False):
    """(positional tensors, keyword scalars) for `torch.ops.mok.fused_moe` in `case`.

    H != 2I and H != I so that a wrong layout cannot pass by accident. Scales give
    well separated router scores (no ties) and unit-scale expert activations.
    dtype overrides the case's dtype for every tensor (router included). The router ranks the experts and any
    identity or zero experts (`RoutingSpec.identity_experts`, `zero_experts`).
    """
    E = case.num_experts
    R = E + case.routing.identity_experts + case.routing.zero_experts
    x_dtype = dtype or case.dtype
    r_dtype = dtype or case.router_dtype or x_dtype
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, dt=x_dtype):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dt)

    up = 2 * I if case.experts.gated else I
    x = rand(T, H)
    router = rand(T, R, scale=1.5, dt=r_dtype) if case.routing.router_is_logits else rand(R, H, scale=0.5, dt=r_dtype)
    router_bias = rand(R, scale=0.5, dt=r_dtype) if case.router_bias else None
    # Comparable with the spread of what the top-k ranks (scores in (0, 1), or logits), so that it changes choices.
    bias_scale = 1.0 if case.routing.routing in ("topk_softmax", "topk_sigmoid") else 0.1
    selection_bias = (rand(R, scale=bias_scale, dt=torch.float32 if dtype is None else dtype) if case.selection_bias
                      else None)
    if case.experts.transposed:
        gate_up, down = rand(E, H, up, scale=H**-0.5), rand(E, I, H, scale=I**-0.5)
    else:
        gate_up, down = rand(E, up, H, scale=H**-0.5), rand(E, H, I, scale=I**-0.5)
    gate_up_bias = rand(E, up, scale=0.3) if case.expert_bias else None
    down_bias = rand(E, H, scale=0.3) if case.expert_bias else None
    args = [x, router, router_bias, selection_bias, gate_up, gate_up_bias, down, down_bias]
    if requires_grad:
        for i in DIFFERENTIABLE:
            if args[i] is not None:
                args[i].requires_grad_()
    return tuple(args), op_kwargs(case.routing, case.experts)


# Positions of the op's tensor arguments that get a gradient (selection_bias only chooses experts).
DIFFERENTIABLE = (0, 1, 2, 4, 5, 6, 7)
ARG_NAMES = ("hidden_states", "router", "router_bias", "selection_bias", "gate_up_proj", "gate_up_bias", "down_proj",
             "down_bias")


# ----------------------------------------------------------------------------- dense oracle


def _largest(values: torch.Tensor, k: int, allowed=None) -> list[int]:
    """Indices of the k largest entries (among `allowed`), by plain Python sorting."""
    idx = range(values.shape[0]) if allowed is None else allowed
    values = values.detach()
    return sorted(idx, key=lambda i: -float(values[i]))[:k]


def _sigmoid(v):
    return 1 / (1 + torch.exp(-v))


def _activation(h, spec: ExpertSpec, I: int):
    if spec.gated:
        g, u = (h[0::2], h[1::2]) if spec.interleaved else (h[:I], h[I:])
        if spec.activation in ("silu", "silu_fp32"):  # one math: the oracle runs in fp64
            return g * _sigmoid(g) * u
        if spec.activation == "gelu_tanh":
            return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u
        if spec.activation == "clamped_silu":
            g = torch.clamp(g, max=spec.limit)
            u = torch.clamp(u, min=-spec.limit, max=spec.limit)
            return (u + 1) * g * _sigmoid(spec.alpha * g)
        if spec.activation == "clamped_swiglu":
            g = torch.clamp(g, max=spec.limit)
            u = torch.clamp(u, min=-spec.limit, max=spec.limit)
            return g * _sigmoid(g) * u
        if spec.activation == "softcapped_swiglu":
            return torch.tanh(g / spec.alpha) * spec.alpha * _sigmoid(g) * torch.tanh(u / spec.limit) * spec.limit
    else:
        relu = torch.where(h > 0, h, torch.zeros_like(h))
        if spec.activation == "relu2":
            return relu * relu
        if spec.activation == "relu":
            return relu
        if spec.activation == "silu":
            return h * _sigmoid(h)
        if spec.activation == "gelu":
            return 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
        if spec.activation == "gelu_tanh":
            return 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    raise AssertionError(f"oracle lacks {spec}")


def _allowed(choice, kw) -> list[int]:
    """The experts a token may choose under group-limited selection: those of the `topk_group` groups whose
    `group_top` largest values sum the largest (every expert without groups)."""
    E = choice.shape[0]
    if kw["n_group"] == 1:
        return list(range(E))
    size = E // kw["n_group"]
    group_score = torch.stack([choice[g * size:(g + 1) * size].sort(descending=True)[0][:kw["group_top"]].sum()
                               for g in range(kw["n_group"])])
    kept = _largest(group_score, kw["topk_group"])
    return [e for e in range(E) if e // size in kept]


def _sparsemixer(s, k: int, threshold: float):
    """(chosen, weights [k]) of PhiMoE's sparsemixer for one token's logits `s`: each round, the largest logit m
    left (the first of equals) is chosen, and its weight is its softmax among the logits left within the relative
    distance `threshold` of it (``(m - s_e) / max(|s_e|, m) <= threshold``)."""
    chosen, weights = [], []
    for _ in range(k):
        left = [e for e in range(s.shape[0]) if e not in chosen]
        best = max(left, key=lambda e: (float(s[e].detach()), -e))
        m = float(s[best].detach())
        near = [e for e in left if not (m - float(s[e].detach())) / max(abs(float(s[e].detach())), m) > threshold]
        z = torch.exp(s[near] - s[best])
        weights.append(z[near.index(best)] / z.sum())
        chosen.append(best)
    return chosen, torch.stack(weights)


# Router logits where a sparsemixer is easy to get wrong, one row each.
SPARSEMIXER_EDGE_LOGITS = [
    [1.0] * 6,                                    # all equal: picks 0 then 1, all kept
    [0.0] * 6,                                    # 0 / 0 ratios: kept
    [0.0, -1.0, 0.0, -3.0, -0.5, -2.0],           # largest 0, tied
    [-1.0, -1.1, -1.3, -2.0, -1.05, -5.0],        # all negative: max(|s|, m) is |s|
    [2.0, 1.6, 1.5, 2.4, -2.0, 0.0],              # (2.4 - 2.0) / max(2.0, 2.4) = 1/6: 2.0 kept, 1.6 (1/3) not
    [5.0, 4.0, 3.9, -1.0, 0.0, 2.0],              # (5 - 4) / 5: the threshold 2 * 0.1 in every dtype: kept (not >)
]


def sparsemixer_logits(dtype, rows=200, seed=0, device="cpu"):
    """[6 + rows, 6] logits: `SPARSEMIXER_EDGE_LOGITS`, then random rows of random spread (in 16 bits their ratios
    round onto the rounded threshold now and then)."""
    gen = torch.Generator().manual_seed(seed)
    rand = torch.randn(rows, 6, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    return torch.cat([torch.tensor(SPARSEMIXER_EDGE_LOGITS), rand]).to(device=device, dtype=dtype)


def dense_oracle(args, kwargs):
    """(out [T, H], weights {(t, expert): w}) of the MoE, token by token; differentiable.

    Weights are keyed by expert id, so comparisons do not depend on the order in
    which a kernel returns the k choices. With `expert_ids` in `kwargs` (given ids, which may repeat an expert
    in a row: then the key holds the last slot's weight) those are the chosen experts, in their order. With
    `expert_scale`, each weight is multiplied last by its expert's value. A choice past the experts (an identity
    expert's) adds the token itself, weighted; a zero expert's, nothing. With a `post_norm`, each expert's output is
    normalised before its
    weight.
    """
    kw = with_defaults(kwargs)
    spec = ExpertSpec(**{f.name: kw[f.name] for f in dataclasses.fields(ExpertSpec)})
    x, router, router_bias, selection_bias, gate_up, gate_up_bias, down, down_bias = args
    T, H = x.shape
    I = down.shape[1] if spec.transposed else down.shape[2]
    K = kw["top_k"]
    given = kw.get("expert_ids")
    outs, weights = [], {}

    def _choose(t, values, allowed=None):
        return [int(e) for e in given[t]] if given is not None else _largest(values, K, allowed)

    for t in range(T):
        if kw["router_is_logits"]:
            logits = router[t]
        else:
            logits = router @ x[t] + (0 if router_bias is None else router_bias)
        # A selection bias is added to the values the top-k ranks and only chooses.
        bias = 0 if selection_bias is None else selection_bias
        if kw["routing"] == "softmax_topk":
            p = torch.exp(logits - logits.max())
            p = p / p.sum()
            chosen = _choose(t, p + bias, _allowed(p + bias, kw))
            w = p[chosen]
        elif kw["routing"] == "topk_softmax":
            chosen = _choose(t, logits + bias)
            z = torch.exp(logits[chosen] - logits[chosen].max())
            w = z / z.sum()
        elif kw["routing"] == "topk_sigmoid":
            chosen = _choose(t, logits + bias)
            w = _sigmoid(logits[chosen])
        elif kw["routing"] == "sparsemixer":
            chosen, w = _sparsemixer(logits, K, 2 * kw["jitter_eps"])
        elif kw["routing"] == "sqrtsoftplus_topk":
            s = torch.sqrt(torch.log(1 + torch.exp(logits)))
            c = s if selection_bias is None else s + selection_bias
            chosen = _choose(t, c, _allowed(c, kw))
            w = s[chosen]
        else:
            s = _sigmoid(logits)
            c = s if selection_bias is None else s + selection_bias
            chosen = _choose(t, c, _allowed(c, kw))
            w = s[chosen]
        if kw["renormalize"]:
            w = w / (torch.clamp(w.sum(), min=kw["renorm_min"]) + kw["renorm_eps"])
        w = w * kw["routed_scale"]
        if kw.get("expert_scale") is not None:  # Gemma 4's per-expert weight scale
            w = w * kw["expert_scale"][chosen]
        y = torch.zeros_like(x[t])
        for k, e in enumerate(chosen):
            weights[(t, e)] = w[k]
            if e >= gate_up.shape[0]:  # an identity expert (a zero expert adds nothing)
                if kw["identity_experts"]:
                    y = y + w[k] * x[t]
                continue
            xin = x[t] * w[k] if kw["weight_on_input"] else x[t]  # Llama4: the weight scales the input
            h = xin @ gate_up[e] if spec.transposed else gate_up[e] @ xin
            if gate_up_bias is not None:
                h = h + gate_up_bias[e]
            a = _activation(h, spec, I)
            o = a @ down[e] if spec.transposed else down[e] @ a
            if down_bias is not None:
                o = o + down_bias[e]
            if kw["post_norm"] != "none":
                o = _post_norm(o, e, kw)
            y = y + (o if kw["weight_on_input"] else w[k] * o)
        outs.append(y)
    out = torch.stack(outs) if outs else x.new_zeros(0, H)
    return out, weights


def _post_norm(o, e, kw):
    """The post-expert norm of expert e's output o, from its definition: g = offset + weight (its expert's row of
    a per-expert weight); "rms" normalises o, then scales it by g; "scaled_rms" scales first."""
    weight = kw["post_norm_weight"]
    g = (weight[e] if weight.dim() == 2 else weight) + kw["post_norm_offset"]
    v = o if kw["post_norm"] == "rms" else o * g
    v = v / torch.sqrt((v * v).mean() + kw["post_norm_eps"])
    return v * g if kw["post_norm"] == "rms" else v


def gradcheck_op(args, kw) -> bool:
    """torch.autograd.gradcheck of `mok::fused_moe`'s output and routing weights in its differentiable tensors."""
    present = [i for i in DIFFERENTIABLE if args[i] is not None]

    def f(*diff):
        full = list(args)
        for i, t in zip(present, diff):
            full[i] = t
        out, w, _ = torch.ops.mok.fused_moe(*full, **kw)
        return out, w

    return torch.autograd.gradcheck(f, [args[i] for i in present])


def gradcheck_learned(args, kw, name) -> bool:
    """`gradcheck_op` with the learned keyword tensor `kw[name]` (expert_scale, post_norm_weight) differentiated too."""
    present = [i for i in DIFFERENTIABLE if args[i] is not None]
    scalars = {k: v for k, v in kw.items() if k != name}

    def f(*diff):
        full = list(args)
        for i, t in zip(present, diff):
            full[i] = t
        out, w, _ = torch.ops.mok.fused_moe(*full, **scalars, **{name: diff[-1]})
        return out, w

    return torch.autograd.gradcheck(f, [*(args[i] for i in present), kw[name]])


def check_learned_against_the_dense_oracle(args, kw, name):
    """fp64: the op's output, weights (by expert) and every gradient, the learned keyword tensor `kw[name]`'s
    included (and not zero), equal `dense_oracle`'s."""
    out, w, ids = torch.ops.mok.fused_moe(*args, **kw)
    ref_out, ref_weights = dense_oracle(args, kw)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    got_weights = weights_by_expert(w, ids)
    assert got_weights.keys() == ref_weights.keys()
    probe = torch.randn_like(out)
    w_probe = routing_probe(out.shape[0], args[4].shape[0] + with_defaults(kw)["identity_experts"]
                            + with_defaults(kw)["zero_experts"])
    loss = (out * probe).sum() + sum(v * w_probe[t, e] for (t, e), v in got_weights.items())
    ref_loss = (ref_out * probe).sum() + sum(v * w_probe[t, e] for (t, e), v in ref_weights.items())
    present = [args[i] for i in DIFFERENTIABLE if args[i] is not None] + [kw[name]]
    grads = torch.autograd.grad(loss, present)
    ref_grads = torch.autograd.grad(ref_loss, present)
    assert grads[-1].abs().sum() > 0
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


def check_learned_reference_backward(args, kw, name):
    """The reference's hand-written backward (the oracle of the kernels) against autograd through its forward, the
    learned keyword tensor `kw[name]`'s gradient included."""
    out, w, ids = reference.fused_moe_reference(*args, **kw)
    go, gw = torch.randn_like(out), torch.randn_like(w)
    present = [args[i] for i in DIFFERENTIABLE if args[i] is not None] + [kw[name]]
    auto = torch.autograd.grad((out * go).sum() + (w * gw).sum(), present)
    plain = [None if t is None else t.detach() for t in args]
    grads = reference.fused_moe_backward_reference(go, gw, *plain, w.detach(), ids, **{**kw, name: kw[name].detach()})
    learned = grads[7 + LEARNED_KWARGS.index(name)]
    written = [grads[j] for j, i in enumerate(DIFFERENTIABLE) if args[i] is not None] + [learned]
    for g, r in zip(written, auto, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def check_learned_compiles_with_dynamic_tokens(args, kw, name):
    """The fake kernels take the learned keyword tensor `kw[name]`: the op compiled (aot_eager, dynamic token
    count) gives eager's output, and gradients for x and that tensor, at two token counts."""
    kw = dict(kw)
    learned = kw.pop(name)

    def f(x, learned, *weights):
        return torch.ops.mok.fused_moe(x, *weights, **kw, **{name: learned})[0]

    compiled = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    for T in (args[0].shape[0], 3):
        x = args[0][:T].detach().requires_grad_()
        got, want = compiled(x, learned, *args[1:]), f(x, learned, *args[1:])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        for a, b in zip(torch.autograd.grad(got.sum(), (x, learned)), torch.autograd.grad(want.sum(), (x, learned))):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def weights_by_expert(topk_weights, topk_ids) -> dict:
    """The op's routing as {(t, expert): weight}, comparable with `dense_oracle`'s."""
    return {(t, int(e)): topk_weights[t, k] for t in range(topk_ids.shape[0])
            for k, e in enumerate(topk_ids[t].tolist())}


def routing_probe(T: int, E: int, dtype=torch.float64, seed: int = 1):
    """A [T, E] weighting for a loss on the routing weights that does not depend on the k order."""
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed), dtype=dtype)
