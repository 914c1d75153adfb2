"""What one fused MoE block computes, as plain data.

`RoutingSpec` and `ExpertSpec` are the Python face of the scalar arguments of
`torch.ops.mok.fused_moe`. The detection pass fills them from a matched graph,
tests fill them by hand, and `op_kwargs()` turns them into the op's keyword
arguments, so the op's schema is spelled in one place (`library.py`).

Routing families (see shared/moe-semantics.md):

- ``softmax_topk`` (A): ``softmax(logits)`` -> ``topk`` -> optional renormalise
  -> scale. Mixtral, Qwen2/3-MoE, OLMoE, Jamba, ...; Ernie 4.5 adds a selection
  bias to the probabilities and renormalises by ``clamp(sum, min)``; DeepSeek-V2's
  group-limited greedy keeps the best ``topk_group`` of ``n_group`` groups by
  their largest probability (``group_top=1``) before the ``topk``, Mistral4 by
  the sum of their top 2 (``group_top=2``).
- ``topk_softmax`` (B): ``topk(logits)`` -> ``softmax`` over the k. Granite-MoE,
  GPT-OSS, JetMoE, ...
- ``sigmoid_grouped_topk`` (C): ``sigmoid(logits)`` + selection bias (used only
  to choose) -> keep the best ``topk_group`` of ``n_group`` groups (group score =
  sum of its ``group_top`` = 2 largest) -> ``topk`` -> gather the unbiased scores
  -> renormalise -> scale. DeepSeek-V3, GLM4-MoE, Kimi, ...
- ``topk_sigmoid`` (D): ``topk(logits)`` -> ``sigmoid`` of the k chosen logits
  (fp32 when ``softmax_fp32``) -> optional renormalise -> scale. Llama4, whose
  dense weight-on-input MoE also sets ``weight_on_input``; Kolibri1 (with a
  selection bias on the logits).
- ``sqrtsoftplus_topk`` (E): C with ``sqrt(softplus(logits))`` scores in place of
  the sigmoid (softplus with PyTorch's threshold 20). DeepSeek-V4's learned
  routers.
- ``sparsemixer`` (F): PhiMoE's sparsemixer at inference, k rounds of: the
  largest remaining logit ``m`` picks the expert; the logits ``s`` with
  ``(m - s) / max(|s|, m) > 2 * jitter_eps`` and the experts already picked are
  masked out (-inf); the weight is the softmax of what is left at the pick.
  (Its training form samples the picks at random: no kernel can match it.)

A selection bias (the op's ``selection_bias`` argument) is added to the values
the top-k ranks (A: the probabilities, B and D: the logits, C: the sigmoid
scores, E: the sqrt-softplus scores) and only chooses: the weights are the
unbiased values at the chosen experts.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_grouped_topk", "topk_sigmoid", "sqrtsoftplus_topk", "sparsemixer")
# C and E: per-expert scores, an unsorted top-k of them (plus any selection bias), the scores gathered at its ids.
SCORE_ROUTINGS = ("sigmoid_grouped_topk", "sqrtsoftplus_topk")
# The routings that take group-limited selection (n_group > 1).
GROUPED_ROUTINGS = ("softmax_topk", *SCORE_ROUTINGS)
GATED_ACTIVATIONS = ("silu", "silu_fp32", "gelu_tanh", "clamped_silu", "clamped_swiglu", "softcapped_swiglu")
UNGATED_ACTIVATIONS = ("relu2", "relu", "silu", "gelu", "gelu_tanh")
# Activations computed in fp32 and rounded once for 16-bit experts (as their models write them); the others are
# computed op by op in the experts' dtype, as HF's default `act_fn(gate) * up` is.
FP32_ACTIVATIONS = ("silu_fp32", "softcapped_swiglu")
# A per-pair RMSNorm of each expert's output, before the routing weight (`ExpertSpec.post_norm`).
POST_NORMS = ("none", "rms", "scaled_rms")


@dataclass(frozen=True)
class RoutingSpec:
    """How router logits become (topk_weights, topk_ids), with HF's precision.

    router_is_logits: the op's ``router`` argument is ``[T, E]`` logits computed
        outside the op (the graph needs them, e.g. for an auxiliary loss) rather
        than the ``[E, H]`` router weight.
    router_fp32: logits are ``linear(x.float(), W.float())`` (DeepSeek-V3 keeps
        its router in fp32); otherwise they are computed in the input dtype.
    softmax_fp32: softmax (A, B) / sigmoid (C, D) / sqrt-softplus (E) / the whole
        sparsemixer (F) runs on fp32 logits; otherwise in the logits' dtype (GPT-OSS
        does its softmax in bf16, LFM2-MoE its sigmoid, DeepSeek-V4 its
        sqrt-softplus, PhiMoE its sparsemixer, each op rounded as PyTorch rounds it).
    weights_fp32: the routing weights stay fp32 (Mixtral, DeepSeek-V3), so the
        weighted sum over the k experts is done in fp32; otherwise they are cast
        to the input dtype first (Qwen, Granite, GPT-OSS).
    round_weights: with ``weights_fp32``, the weights are rounded to the input
        dtype and kept in fp32 (Ergo's ``w.to(x.dtype).float()``): the weighted
        sum is in fp32 over rounded weights. The rounding's gradient is the identity.
    round_weights_to: the same, to this 16-bit dtype (bf16, fp16; not with
        ``round_weights``): a Qwen-style ``w.to(logits.dtype)`` under bf16 autocast
        with fp32 experts, whose product widens the weights again, rounds to bf16.
    renorm_eps: added to the denominator of the renormalisation (DeepSeek: 1e-20).
    n_group, topk_group, group_top: group-limited selection (``softmax_topk``,
        ``sigmoid_grouped_topk`` and ``sqrtsoftplus_topk``): the experts form
        ``n_group`` equal groups, a group's score is the sum of its ``group_top``
        largest selection values, and only the ``topk_group`` best groups' experts
        can be chosen.
    renorm_min: the renormalisation's denominator is at least this, i.e.
        ``w / (clamp(sum(w), min=renorm_min) + renorm_eps)`` (Ernie 4.5: 1e-12).
    weight_on_input: the routing weight scales the expert's *input* instead of
        its output (Llama4): expert k of token t runs on
        ``(x[t] * w[t,k]).to(x.dtype)`` and the k outputs are summed unweighted.
    identity_experts: the router ranks ``E + identity_experts`` choices; a pair
        sent to one of the last ``identity_experts`` (ids ``E ..``) runs no expert
        and passes its token through, weighted (LongCat-Flash's zero-computation
        experts): ``out = experts_sum.to(x.dtype) + (x * s).to(x.dtype)`` with ``s``
        the sum of the token's identity weights, rounded as LongCat does it.
    zero_experts: the router ranks ``E + zero_experts`` choices; a pair sent to
        one of the last ``zero_experts`` (ids ``E ..``) runs no expert and adds
        nothing (Zaya's skip expert, MoE++'s zero experts): its weight counts in
        the routing (the softmax, a renormalisation) but has no gradient from
        the output. Not together with ``identity_experts``.

    "fp32" in these flags means "at least fp32": HF's ``.float()`` upcasts bf16
    and fp16, while fp64 inputs stay fp64 (so fp64 gradcheck sees no fp32 rounding).
    """

    top_k: int
    routing: str = "softmax_topk"
    router_is_logits: bool = False
    router_fp32: bool = False
    softmax_fp32: bool = True
    renormalize: bool = False
    renorm_eps: float = 0.0
    routed_scale: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    weights_fp32: bool = True
    weight_on_input: bool = False
    renorm_min: float = 0.0
    group_top: int = 2
    identity_experts: int = 0
    zero_experts: int = 0
    jitter_eps: float = 0.0
    round_weights: bool = False
    round_weights_to: torch.dtype | None = None

    def __post_init__(self):
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing={self.routing!r} is not one of {ROUTINGS}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(
                f"need 1 <= topk_group <= n_group, got n_group={self.n_group}, topk_group={self.topk_group}"
            )
        if self.group_top not in (1, 2):
            raise ValueError(f"group_top must be 1 (group max) or 2 (sum of the top 2), got {self.group_top}")
        if not 0.0 <= self.renorm_min < float("inf"):
            raise ValueError(f"renorm_min must be a finite number >= 0, got {self.renorm_min}")
        if self.identity_experts < 0:
            raise ValueError(f"identity_experts must be >= 0, got {self.identity_experts}")
        if self.zero_experts < 0:
            raise ValueError(f"zero_experts must be >= 0, got {self.zero_experts}")
        if self.zero_experts and self.identity_experts:
            raise ValueError("identity_experts and zero_experts cannot be combined (the op has one kind of choice "
                             "past the experts)")
        if not 0.0 <= self.jitter_eps < float("inf"):
            raise ValueError(f"jitter_eps must be a finite number >= 0, got {self.jitter_eps}")
        error = weights_rounding_error(self.round_weights, self.round_weights_to, self.weights_fp32)
        if error:
            raise ValueError(error)


def weights_rounding_error(round_weights: bool, round_weights_to, weights_fp32: bool) -> str | None:
    """What is wrong with the weights' rounding arguments, or None: checked by `RoutingSpec` and by the op."""
    if round_weights_to not in (None, torch.bfloat16, torch.float16):
        return (f"round_weights_to must be torch.bfloat16 or torch.float16 (the weights' rounding) or None, got "
                f"{round_weights_to}")
    if round_weights and round_weights_to is not None:
        return "round_weights (through the input dtype) and round_weights_to cannot be combined"
    if (round_weights or round_weights_to is not None) and not weights_fp32:
        return "round_weights and round_weights_to round fp32 weights: they need weights_fp32=True"
    return None


@dataclass(frozen=True)
class ExpertSpec:
    """The math of one expert MLP and the layout of its stacked weights.

    gated: ``gate_up_proj`` holds gate and up halves (``[E, 2I, H]``);
        otherwise it is a single up projection (``[E, I, H]``).
    interleaved: gate/up columns alternate (``gate = h[..., ::2]``, GPT-OSS)
        instead of being concatenated (``gate, up = h.chunk(2)``).
    transposed: weights are stored ``[E, H, 2I]`` / ``[E, I, H]`` and applied
        as ``x @ W`` (GPT-OSS) instead of ``F.linear`` layout ``[E, 2I, H]`` /
        ``[E, H, I]``.
    activation: for gated experts ``silu`` (SwiGLU), ``silu_fp32`` (SwiGLU in fp32,
        rounded once: Beam's ``(silu(g.float()) * u.float()).to(dt)``), ``gelu_tanh`` (GeGLU) or
        ``clamped_silu`` (GPT-OSS: ``(clamp(u,-limit,limit)+1) * g*sigmoid(alpha*g)``
        with ``g = min(g, limit)``) or ``clamped_swiglu`` (DeepSeek-V4:
        ``silu(min(g, limit)) * clamp(u, -limit, limit)``) or ``softcapped_swiglu``
        (Inkling2: ``cap(g, alpha) * sigmoid(g) * cap(u, limit)`` with ``cap(v, c) =
        tanh(v / c) * c``, in fp32 and rounded once); for ungated ones
        ``relu2``, ``relu``, ``silu``, ``gelu`` or ``gelu_tanh``.
    post_norm: an RMSNorm of each pair's expert output y (a row of H), before
        its routing weight; ``g = (post_norm_offset + weight).float()``, with
        ``weight`` the op's ``post_norm_weight`` ([H], or [E, H]: its expert's
        row), the sum taken in the weight's dtype, and ``rms(v) = v *
        rsqrt(mean(v^2) + post_norm_eps)`` in fp32 (the accumulation dtype):
        ``rms``: ``(rms(y.float()) * g).to(y.dtype)`` (Ergo's per-expert norm);
        ``scaled_rms``: ``rms((y.float() * g).to(y.dtype).float()).to(y.dtype)``
        (Muse Spark's input-scaled norm, offset 1).
    """

    activation: str = "silu"
    gated: bool = True
    interleaved: bool = False
    transposed: bool = False
    alpha: float = 1.702
    limit: float = 7.0
    post_norm: str = "none"
    post_norm_eps: float = 1e-6
    post_norm_offset: float = 0.0

    def __post_init__(self):
        if self.post_norm not in POST_NORMS:
            raise ValueError(f"post_norm={self.post_norm!r} is not one of {POST_NORMS}")
        if not 0.0 <= self.post_norm_eps < float("inf"):
            raise ValueError(f"post_norm_eps must be a finite number >= 0, got {self.post_norm_eps}")
        allowed = GATED_ACTIVATIONS if self.gated else UNGATED_ACTIVATIONS
        if self.activation not in allowed:
            kind = "gated" if self.gated else "ungated"
            raise ValueError(f"activation={self.activation!r} is not supported for {kind} experts; use one of {allowed}")
        if self.interleaved and not self.gated:
            raise ValueError("interleaved=True needs gated experts")


def op_kwargs(routing: RoutingSpec, experts: ExpertSpec) -> dict:
    """The keyword arguments of `torch.ops.mok.fused_moe` for these specs."""
    return {**dataclasses.asdict(routing), **dataclasses.asdict(experts)}


@functools.cache
def _scalar_defaults() -> tuple:
    return tuple((f.name, f.default) for cls in (RoutingSpec, ExpertSpec) for f in dataclasses.fields(cls)
                 if f.default is not dataclasses.MISSING)


def scalar_defaults() -> dict:
    """Defaults of the op's keyword arguments (the dispatcher omits arguments left at their default)."""
    return dict(_scalar_defaults())


def with_defaults(kwargs: dict) -> dict:
    """The op's full keyword arguments: `kwargs` completed with the schema defaults (per call: cached)."""
    return {**dict(_scalar_defaults()), **kwargs}


def specs_from_kwargs(kwargs: dict) -> tuple[RoutingSpec, ExpertSpec]:
    """Inverse of `op_kwargs` (used by kernels and reports reading a graph node)."""
    r_names = {f.name for f in dataclasses.fields(RoutingSpec)}
    e_names = {f.name for f in dataclasses.fields(ExpertSpec)}
    return (
        RoutingSpec(**{k: v for k, v in kwargs.items() if k in r_names}),
        ExpertSpec(**{k: v for k, v in kwargs.items() if k in e_names}),
    )
