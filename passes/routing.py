"""Read the routing semantics (a `RoutingSpec`) off the router part of a matched region.

    A  logits ─(float)─ softmax ─> p ─> topk ─> w0 ─[renormalise]─[* scale]─[cast]─> w
       with a selection bias (Ernie 4.5): p + sel_bias ─> topk ─> ids;  w0 = p.gather(1, ids)
       group-limited (DeepSeek-V2: group score its max, values used; Mistral4: the sum of its top 2, the other
       groups filled with 0, ids only): p ─[group mask]─> topk ─> ids;  w0 = p.gather(1, ids)
    B  logits ─(float)─ topk ─> w0 ─ softmax ─[* scale]─[cast]─> w
    C  logits ─(float)─ sigmoid ─> s ─(+ sel_bias)─[group mask: view(T,G,E/G).topk(2).sum ─ topk(kg) ─
       scatter ─ masked_fill(-inf)]─> topk ─> ids;  w0 = s.gather(1, ids) (or the top-k values where nothing
       biased the choice) ─[renormalise]─[* scale]─> w
    E  C with s = sqrt(softplus(logits)) (DeepSeek-V4; softplus with PyTorch's defaults, both ops in one dtype)
    D  logits ─ topk ─> top ─ sigmoid ─[renormalise]─[* scale]─[cast]─> w
       with a selection bias (Kolibri1): logits + sel_bias ─> topk ─> ids;  top = logits.gather(1, ids)
    D  dense: logits ─ topk ─> top, ids;  full_like(logits, -inf).scatter(1, ids, top) ─(float)─ sigmoid ─[cast]─> s
       [T, E] (Llama4: weight on the input; `s` scales a repeated input of every expert, see
       `experts.check_input_weight_application`; unchosen experts get sigmoid(-inf) = 0)

    F  the sparsemixer (PhiMoE at inference; its rounds matched in `sparsemixer.py`): weights = cat of the rounds'
       masked softmax at their picks ─[renormalise]─[* scale]─[cast]─> w

    given ids (hash routing, the ids an input of the block): logits ─(float)─ [softmax (A) | sigmoid (C) |
       sqrt(softplus) (E)] ─> s ─ gather(1, ids) ─> w0 ─[softmax (B) | sigmoid (D) of gathered logits]─
       [renormalise]─[* scale]─[cast]─> w; no selection bias, no groups

    renormalise: w0 / ([clamp(] sum(w0, -1, keepdim) [, min=m)] [+ eps]);  * scale: * c or / c (c a number),
    one or more

A cast to the dtype a value already has is skipped wherever it stands (LFM2-MoE's
``.type_as(logits)`` before its renormalisation). Anything else on these chains (a
bias used for the weights, a softmax in another dimension, a clamp with a maximum)
is reported, not guessed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from mok_compile.ops.spec import GROUPED_ROUTINGS, SCORE_ROUTINGS, RoutingSpec

from .dataflow import closure
from .op_names import (CAST_OPS, VIEW_OPS, arg, is_runtime_float, number, op_name,
                       runtime_float_reason, tensor_meta)
from .region import NoMatch, Region, getitem_users, past_exact_casts, router_weight, shape_kept, strip, topk_k
from .validate import traced_float


@dataclass(frozen=True)
class Flat:
    """An operand the graph holds in another shape with the same elements in order: the op gets
    ``source.reshape(shape)`` (Ernie 4.5 keeps its selection bias as a [1, E] parameter and adds ``bias.squeeze()``;
    Zaya's router logits are [B, S, E], the op's [T, E])."""
    source: fx.Node
    shape: tuple = (-1,)


@dataclass
class RouterMatch:
    spec: RoutingSpec
    weight: fx.Node                        # router weight [E, H]: an input, or an input rounded by casts in the block
    bias: fx.Node | None                   # router bias [E] (the same)
    selection_bias: fx.Node | Flat | None  # bias used only to choose experts
    weights: fx.Node                       # final routing weights [T, K] as the experts use them ([T, E] for D)
    expert_scale: fx.Node | None = None    # per-expert factor of the weights [E] (Gemma 4's per_expert_scale)
    runtime: dict = field(default_factory=dict)  # op arguments the graph reads at run time (SymFloat nodes):
                                                 # {"routed_scale" | "renorm_min": node}

    def input_nodes(self) -> set[fx.Node]:
        """The graph inputs the router reads (weight, biases, expert scale)."""
        sel = self.selection_bias.source if isinstance(self.selection_bias, Flat) else self.selection_bias
        return {strip(n, CAST_OPS) for n in (self.weight, self.bias, sel, self.expert_scale) if n is not None}

    def rounded_operands(self) -> list[fx.Node]:
        """The router's weight and bias where the block rounds them by casts (which then stay in the graph)."""
        return [n for n in (self.weight, self.bias) if n is not None and strip(n, CAST_OPS) is not n]


def _is_last_dim(dim, ndim: int) -> bool:
    return dim in (-1, ndim - 1)


def _softmax_dim(node: fx.Node):
    return arg(node, 1, "dim")


def _pre_anchor_chain(region: Region) -> list[fx.Node]:
    """Nodes between the logits and the anchor's input (the top-k's, or the given ids' gather's; that input first)."""
    chain, n = [], region.anchor.args[0]
    while n is not region.logits:
        chain.append(n)
        n = n.args[0]
    return chain


def _group_limit(region: Region, masked: fx.Node, E: int, nonnegative: bool) -> tuple[int, int, int]:
    """(n_group, topk_group, group_top) of DeepSeek-style group-limited selection feeding `masked` (a masked_fill of
    the choice values): group score = the sum of each group's top 2 (V3: ``view(T, G, E/G).topk(2)[0].sum(-1)``)
    or its max (V2: ``.max(dim=-1)[0]``); the best groups by a 2-D topk. The others are filled with -inf, or with 0
    where every choice value is >= 0 (V2's and Mistral4's probabilities), which then never outranks a kept expert
    (the op fills with -inf: a 0 could only tie with a kept expert whose probability underflowed to 0, where HF's
    own choice is torch.topk's unspecified pick among equal values)."""
    fill = arg(masked, 2, "value")
    if not (fill == -math.inf or (fill == 0.0 and nonnegative)):
        raise NoMatch(f"group-limited routing fills the other groups with {fill!r} (not -inf, nor 0 below "
                      "non-negative scores)")
    group_topks = [n for n in region.nodes if op_name(n) == "topk" and n is not region.topk]
    per_group = [n for n in region.nodes if op_name(n) in ("topk", "max") and n is not region.topk
                 and (m := tensor_meta(n.args[0])) is not None and m.dim() == 3]
    choose = [n for n in group_topks if (m := tensor_meta(n.args[0])) is not None and m.dim() == 2]
    if len(per_group) != 1 or len(choose) != 1:
        raise NoMatch("group-limited routing has an unexpected structure")
    reduce = per_group[0]
    grouped = tensor_meta(reduce.args[0])
    n_group = int(grouped.shape[1])
    if n_group * int(grouped.shape[2]) != E or strip(reduce.args[0], VIEW_OPS) is not masked.args[0]:
        raise NoMatch("group scores are not taken over equal groups of the experts' choice values")
    if not _is_last_dim(arg(reduce, 1, "dim") if op_name(reduce) == "max" else arg(reduce, 2, "dim", -1), 3):
        raise NoMatch("group scores are not taken within each group")
    values = getitem_users(reduce, 0)
    if op_name(reduce) == "max":  # V2: the group's largest value
        group_top, score = 1, values[0] if len(values) == 1 else None
    else:  # V3: the sum of the group's top 2
        sums = [u for v in values for u in v.users if op_name(u) == "sum" and _is_last_dim(arg(u, 1, "dim"), 3)]
        group_top, score = topk_k(reduce), sums[0] if len(values) == 1 and len(sums) == 1 else None
    if group_top not in (1, 2) or score is None or strip(choose[0].args[0], CAST_OPS) is not score:
        raise NoMatch("group score is neither each group's largest value nor the sum of its top 2")
    return n_group, topk_k(choose[0]), group_top


def _single_user(node: fx.Node, region: Region) -> fx.Node | None:
    users = [u for u in node.users if u in region.nodes]
    return users[0] if len(users) == 1 else None


def match_router(region: Region) -> RouterMatch:
    router = _match_router(region)
    _check_detached(region, router.weights)
    return router


def _match_router(region: Region) -> RouterMatch:
    x_dtype = tensor_meta(region.x).dtype
    lin = region.router_linear
    if lin is None:  # the logits are an input of the block: the op's router argument (router_is_logits)
        weight, bias = region.logits, None
    else:
        weight = router_weight(lin)
        bias = arg(lin, 2, "bias") if op_name(lin) == "linear" else None
        bias = past_exact_casts(bias) if isinstance(bias, fx.Node) else None
    for name, t in (("router weight", weight), ("router bias", bias)):  # or block inputs rounded (casts kept)
        if t is not None and strip(t, CAST_OPS) not in region.inputs:
            raise NoMatch(f"{name} ({t.name}) is computed inside the block")
    router_fp32 = (lin is not None and tensor_meta(region.logits).dtype == torch.float32
                   and x_dtype != torch.float32)
    E, K = int(region.E), region.K
    if region.given_ids:
        return _match_given_ids(region, weight, bias, router_fp32)
    if region.sparsemixer is not None:
        return _match_sparsemixer(region, weight, bias, router_fp32)
    t_dim = tensor_meta(region.topk.args[0]).dim()
    if not _is_last_dim(arg(region.topk, 2, "dim", -1), t_dim) or arg(region.topk, 3, "largest", True) is not True:
        raise NoMatch("top-k is not over the experts dimension (largest values)")

    routing, softmax_fp32, selection_bias, scores, masked = _score_chain(region)
    n_group, topk_group, group_top = 1, 1, 2
    if masked is not None:
        if routing not in GROUPED_ROUTINGS:
            raise NoMatch("group-limited selection is only supported over softmax, sigmoid or sqrt-softplus scores")
        n_group, topk_group, group_top = _group_limit(region, masked, E, nonnegative=selection_bias is None)

    if routing is None and selection_bias is None and masked is None:
        dense = _dense_sigmoid_scores(region)
        if dense is not None:
            w, softmax_fp32 = dense
            # weights_fp32: the dense scores stay in an upcast dtype (otherwise cast back to the input dtype).
            weights_fp32 = tensor_meta(w).dtype != x_dtype and tensor_meta(w).dtype in (torch.float32, torch.float64)
            spec = RoutingSpec(top_k=K, routing="topk_sigmoid", router_fp32=router_fp32, softmax_fp32=softmax_fp32,
                               weights_fp32=weights_fp32, weight_on_input=True)
            return RouterMatch(spec=spec, weight=weight, bias=bias, selection_bias=None, weights=w)

    # The unnormalised top-k weights: the top-k values; where a selection bias chose, or the values are unused (as in
    # DeepSeek-V3's and Mistral4's routers), the unbiased scores gathered at the choice. Without a bias those are the
    # values the top-k ranked: a group mask (-inf, or 0 below non-negative scores, `_group_limit`) only removes
    # experts, and the op's top-k over the kept ones picks the same experts with the same values.
    values = getitem_users(region.topk, 0)
    if selection_bias is None and len(values) == 1 and any(u in region.nodes for u in values[0].users):
        w = values[0]
    else:
        w = _gathered_scores(region, scores, routing)
    spec, w, scale, runtime = _weight_chain(region, w, routing, softmax_fp32, router_fp32, n_group=n_group,
                                            topk_group=topk_group, group_top=group_top)
    return RouterMatch(spec=spec, weight=weight, bias=bias, selection_bias=selection_bias, weights=w,
                       expert_scale=scale, runtime=runtime)


def _check_detached(region: Region, weights: fx.Node) -> None:
    """A `detach` in the block may only cut what chooses: one between the logits and the top-k, whose output the
    weights are not computed from (Zaya ranks detached probabilities and gathers the others). NoMatch otherwise,
    since the op's weights and outputs carry every gradient."""
    detached = {n for n in region.nodes if op_name(n) == "detach"}
    if not detached:
        return
    chain = set(_pre_anchor_chain(region)) if op_name(region.anchor) == "topk" else set()
    if detached - chain:
        n = min(detached - chain, key=lambda d: d.name)
        raise NoMatch(f"the block detaches {n.name} elsewhere than between the router's logits and its top-k: the op "
                      "would give it a gradient")
    # Not through the ids (integers: no gradient); through the top-k's values.
    feeding = closure([weights], lambda n: (a for a in n.all_input_nodes if a in region.nodes and a is not region.ids))
    if feeding & detached:
        n = min(feeding & detached, key=lambda d: d.name)
        raise NoMatch(f"the routing weights are computed from a detached value ({n.name}): they carry no gradient to "
                      "the router, the op's do")


def _match_given_ids(region: Region, weight: fx.Node, bias: fx.Node | None, router_fp32: bool) -> RouterMatch:
    """The routing of a block whose ids are given (hash routing): scores (softmax, sigmoid or sqrt-softplus of the
    logits, or the logits themselves) gathered at the ids, then the weight chain of the top-k forms (a softmax or
    sigmoid of gathered logits, renormalisation, scale, cast). Nothing may choose: no selection bias, no groups."""
    routing, softmax_fp32, selection_bias, scores, masked = _score_chain(region)
    if selection_bias is not None or masked is not None:
        raise NoMatch("the router adds a selection bias or masks groups, but the expert ids are given")
    w = _gathered_scores(region, scores, routing)
    spec, w, scale, runtime = _weight_chain(region, w, routing, softmax_fp32, router_fp32)
    return RouterMatch(spec=spec, weight=weight, bias=bias, selection_bias=None, weights=w, expert_scale=scale,
                       runtime=runtime)


def _match_sparsemixer(region: Region, weight: fx.Node, bias: fx.Node | None, router_fp32: bool) -> RouterMatch:
    """The routing of a sparsemixer block (`sparsemixer.py` matched its rounds): its weights, then the weight chain
    of every routing (renormalisation, scale, cast). The op reads a threshold the graph reads at run time."""
    mixer = region.sparsemixer
    if strip(mixer.scores, CAST_OPS) is not region.logits:
        raise NoMatch("the sparsemixer runs on something other than the router's logits")
    spec, w, scale, runtime = _weight_chain(region, mixer.weights, "sparsemixer", mixer.softmax_fp32, router_fp32)
    if mixer.jitter_node is not None:
        runtime["jitter_eps"] = mixer.jitter_node
    return RouterMatch(spec=replace(spec, jitter_eps=mixer.jitter_eps), weight=weight, bias=bias,
                       selection_bias=None, weights=w, expert_scale=scale, runtime=runtime)


def _score_chain(region: Region):
    """(routing, softmax_fp32, selection bias, scores, group mask) read off the ops between the logits and the
    anchor: the score function (None where the anchor reads the logits), a selection bias added, a masked_fill of
    group-limited selection."""
    routing, softmax_fp32, selection_bias, scores = None, True, None, region.logits
    masked = None
    for n in _pre_anchor_chain(region):
        name = op_name(n)
        if name == "softmax":
            if routing is not None or not _is_last_dim(_softmax_dim(n), tensor_meta(n).dim()):
                raise NoMatch("router applies softmax in an unsupported way")
            routing, softmax_fp32 = "softmax_topk", tensor_meta(n).dtype in (torch.float32, torch.float64)
            scores = n
        elif name == "sigmoid":
            if routing is not None:
                raise NoMatch("router combines sigmoid with another score function")
            routing, scores = "sigmoid_grouped_topk", n
            softmax_fp32 = tensor_meta(n).dtype in (torch.float32, torch.float64)
        elif name == "sqrt":
            if routing is not None:
                raise NoMatch("router combines sqrt with another score function")
            routing, scores, softmax_fp32 = "sqrtsoftplus_topk", n, _sqrt_softplus_fp32(n)
        elif name == "softplus":
            if routing != "sqrtsoftplus_topk" or strip(scores.args[0], CAST_OPS) is not n:
                raise NoMatch("router scores are softplus without its square root (only sqrt(softplus) is supported)")
        elif name == "add":
            if selection_bias is not None:
                raise NoMatch("router adds two things before the top-k")
            selection_bias = _selection_bias(region, n.args[1])
        elif name == "masked_fill":
            masked = n
        elif name == "detach":  # the choice needs no gradient; `_check_detached` keeps the weights off it
            pass
        elif name not in CAST_OPS and not shape_kept(n):
            raise NoMatch(f"router op {name!r} is not supported")
    return routing, softmax_fp32, selection_bias, scores, masked


def _weight_chain(region: Region, w: fx.Node, routing, softmax_fp32, router_fp32, **groups):
    """(RoutingSpec, final weights node, expert scale node or None, runtime): the weight chain from the unnormalised
    weights `w` walked, [softmax (B) | sigmoid (D)] -> [renormalise] -> [scale] -> [per-expert scale] -> [cast], in
    this order. `groups`: n_group, topk_group, group_top.

    The scale may be one product with a float the graph reads at run time (a module's float attribute that Dynamo
    traced as an input, as under dynamic=True), and so may the renormalisation's clamp minimum: the spec then holds
    the traced value (for the probe) and the op reads the node (`runtime`: {op argument: node}). aot_autograd
    cannot turn a float argument of the op into a tensor, so it has Dynamo specialise the float (with a guard) and
    trace again, and the pass then sees a constant."""
    stage, renormalize, eps, renorm_min, scale, expert_scale, runtime = 0, False, 0.0, 0.0, 1.0, None, {}
    narrowest = None  # the dtype a cast rounded the weights to
    rounded_to = None  # the 16-bit dtype they were rounded to, then widened again (Ergo: the input dtype)
    while True:
        users = [u for u in w.users if u in region.nodes]
        sums = [u for u in users if op_name(u) == "sum"]
        if sums and len(users) == 2 and stage <= 1:
            w, eps, renorm_min, min_node = _renormalised(region, w, sums[0])
            if min_node is not None:
                runtime["renorm_min"] = min_node
            renormalize, stage = True, 2
            continue
        u = _single_user(w, region)
        if u is None:
            break
        name = op_name(u)
        if name == "softmax" and stage == 0 and routing is None:
            if not _is_last_dim(_softmax_dim(u), tensor_meta(u).dim()):
                raise NoMatch("softmax over the top-k weights is not over the last dimension")
            routing, softmax_fp32, stage = "topk_softmax", tensor_meta(u).dtype in (torch.float32, torch.float64), 1
        elif name == "sigmoid" and stage == 0 and routing is None:
            routing, softmax_fp32, stage = "topk_sigmoid", tensor_meta(u).dtype in (torch.float32, torch.float64), 1
        elif (name == "mul" and u.args[0] is w and number(u.args[1]) is not None and stage <= 3
              and "routed_scale" not in runtime):
            scale, stage = scale * number(u.args[1]), 3
        elif (name == "div" and u.args[0] is w and number(u.args[1]) not in (None, 0.0) and stage <= 3
              and "routed_scale" not in runtime):
            # w / c as w * (1 / c): exact for a power of two (OpenAI privacy filter's / top_k), else within an ulp
            # of the weights (as two scales folded into one are), which the probe bounds like any rounding difference
            scale, stage = scale / number(u.args[1]), 3
        elif name in CAST_OPS and u.args[0] is w:
            before, after = tensor_meta(w).dtype, tensor_meta(u).dtype
            if after.itemsize > before.itemsize and narrowest is not None:
                if after != torch.float32 or narrowest not in (torch.bfloat16, torch.float16):
                    raise NoMatch(f"the routing weights are rounded to {narrowest} and widened again to {after}: "
                                  "the op rounds weights only to 16 bits, to keep them in fp32 (round_weights)")
                rounded_to = narrowest
            if after != before:  # a cast to the same dtype changes nothing
                if after.itemsize < before.itemsize and rounded_to not in (None, after):
                    raise NoMatch(f"the routing weights are rounded to {rounded_to}, then to {after}: the op "
                                  "rounds them once (round_weights)")
                narrowest = after if after.itemsize < before.itemsize else narrowest
                stage = 4
        elif name == "mul" and stage <= 3 and _per_expert(region, _other(u, w)):
            expert_scale, stage = _expert_scale(region, _other(u, w)), 4  # only casts may follow
        elif name == "mul" and stage <= 2 and scale == 1.0 and is_runtime_float(_other(u, w)):
            runtime["routed_scale"], stage = _other(u, w), 3
            scale = traced_float(runtime["routed_scale"])
        elif name in ("mul", "div") and stage <= 3 and is_runtime_float(_other(u, w)):
            raise NoMatch(runtime_float_reason(f"the routing weights' scale ({_other(u, w).name}, with another scale)"))
        else:
            break
        w = u
    if routing is None:
        raise NoMatch("found no softmax or sigmoid in the router")
    final = tensor_meta(w).dtype
    weights_fp32 = final == torch.float32
    if rounded_to is not None and not weights_fp32:
        raise NoMatch(f"the routing weights are rounded to {rounded_to}, widened, then cast to {final}: the op "
                      "keeps rounded weights in fp32 (round_weights)")
    if final in (torch.bfloat16, torch.float16) and tensor_meta(region.x).dtype == torch.float32:
        # 16-bit weights on fp32 experts (Qwen's `w.to(logits.dtype)` under bf16 autocast): their product with the
        # experts' fp32 rows widens them again, so the op keeps them fp32, rounded (the probe proves the products)
        weights_fp32, rounded_to = True, final
    # Through the input dtype: Ergo's `round_weights` (as before v74); through another one: `round_weights_to`
    x_rounded = rounded_to == tensor_meta(region.x).dtype
    round_weights, round_weights_to = x_rounded, None if x_rounded else rounded_to
    spec = RoutingSpec(top_k=region.K, routing=routing, router_fp32=router_fp32, softmax_fp32=softmax_fp32,
                       renormalize=renormalize, renorm_eps=eps, renorm_min=renorm_min, routed_scale=scale,
                       weights_fp32=weights_fp32, round_weights=round_weights, round_weights_to=round_weights_to,
                       **groups)
    return spec, w, expert_scale, runtime


def _other(mul: fx.Node, w: fx.Node):
    """The operand of a binary `mul` that is not `w`."""
    return mul.args[1] if mul.args[0] is w else mul.args[0]


def _per_expert(region: Region, t) -> bool:
    """``v[ids]``: a 1-D tensor indexed by the block's expert ids."""
    t = strip(t, CAST_OPS)
    if not isinstance(t, fx.Node) or op_name(t) != "getitem" or not isinstance(t.args[0], fx.Node):
        return False
    base = tensor_meta(t.args[0])
    return base is not None and base.dim() == 1 and strip(t.args[1], CAST_OPS) is region.ids


def _expert_scale(region: Region, gathered) -> fx.Node:
    """The op's `expert_scale` of weights multiplied by ``v[ids]`` (`_per_expert`): v, a block input of E floats
    (anything computed from parameters alone is one), read through casts in the block only where they keep its
    values (the op multiplies in fp32: a rounding cast would be lost)."""

    def exact_casts(n):
        while op_name(n) in CAST_OPS and isinstance(n.args[0], fx.Node):
            src, out = tensor_meta(n.args[0]), tensor_meta(n)
            if src is None or out is None or not (out.dtype == src.dtype or out.element_size() > src.element_size()):
                raise NoMatch("the routing weights are multiplied by a per-expert scale rounded to "
                              f"{out.dtype if out is not None else 'another dtype'} in the block; the op would not "
                              "round it")
            n = n.args[0]
        return n

    v = exact_casts(exact_casts(gathered).args[0])
    meta = tensor_meta(v)
    if v not in region.inputs or meta is None or not meta.is_floating_point() or tuple(meta.shape) != (region.E,):
        raise NoMatch("the routing weights are multiplied by a per-expert tensor gathered at the expert ids that is "
                      "not a block input of one float per expert")
    return v


def _sqrt_softplus_fp32(sqrt: fx.Node) -> bool:
    """Whether ``sqrt(softplus(l))`` runs in fp32 (the op's softmax_fp32), for a sqrt of a softplus with PyTorch's
    defaults (beta 1, threshold 20) in the same dtype: a cast between them would round where the op does not."""
    sp = strip(sqrt.args[0], CAST_OPS)
    if not isinstance(sp, fx.Node) or op_name(sp) != "softplus":
        raise NoMatch("router scores are a sqrt of something other than a softplus")
    if number(arg(sp, 1, "beta", 1.0)) != 1.0 or number(arg(sp, 2, "threshold", 20.0)) != 20.0:
        raise NoMatch("router softplus has a beta or threshold other than PyTorch's defaults (1, 20)")
    dtype = tensor_meta(sqrt).dtype
    if tensor_meta(sp).dtype != dtype:
        raise NoMatch("router softplus and its sqrt run in different dtypes")
    return dtype in (torch.float32, torch.float64)


def _selection_bias(region: Region, added) -> fx.Node | Flat:
    """The selection bias added before the top-k: a graph input of E values, through casts (as the op adds it in
    fp32) and views that keep their order (a [1, E] parameter squeezed)."""
    n = strip(added, CAST_OPS) if isinstance(added, fx.Node) else added
    if isinstance(n, fx.Node) and n in region.inputs:
        return n
    source = strip(n, CAST_OPS | VIEW_OPS) if isinstance(n, fx.Node) else None
    meta, smeta = tensor_meta(n), tensor_meta(source)
    E = region.E
    if (source in region.inputs and meta is not None and smeta is not None and smeta.numel() == E
            and tuple(meta.shape) in ((E,), (1, E))):
        return Flat(source)
    raise NoMatch("router adds something other than a selection bias (a graph input of one value per expert) before "
                  "the top-k")


def _gathered_scores(region: Region, scores: fx.Node, routing: str | None) -> fx.Node:
    """The one ``scores.gather(-1, ids)`` in the region: the unbiased scores of the chosen experts (the sigmoid
    scores through casts for C; exactly the probabilities (A) or the logits (B, D) otherwise, since a cast between
    would round what the op takes unrounded)."""
    gathers = [u for u in region.ids.users if op_name(u) == "gather" and u in region.nodes]
    source = None
    if len(gathers) == 1:
        g = gathers[0]
        source = strip(g.args[0], CAST_OPS) if routing in SCORE_ROUTINGS else g.args[0]
        if not _is_last_dim(arg(g, 1, "dim"), tensor_meta(g).dim()) or arg(g, 2, "index") is not region.ids:
            source = None
    if source is not scores:
        what = {"sigmoid_grouped_topk": "sigmoid scores", "softmax_topk": "softmax probabilities",
                "sqrtsoftplus_topk": "sqrt-softplus scores"}
        what = what.get(routing, "logits")
        raise NoMatch(f"routing weights are not the unbiased {what} gathered at the chosen experts")
    return gathers[0]


def _renormalised(region: Region, w: fx.Node, total: fx.Node) -> tuple[fx.Node, float, float, fx.Node | None]:
    """(w / denominator node, eps, min, min node) for ``w / ([clamp(]sum(w)[, min=m)] [+ eps])``, `total` the sum
    node; the min node where m is a float the graph reads at run time (its traced value is min), else None."""
    if not _is_last_dim(arg(total, 1, "dim"), tensor_meta(total).dim()) or not arg(total, 2, "keepdim", False):
        raise NoMatch("routing weights are normalised over an unexpected dimension")
    denom, eps, renorm_min, min_node = total, 0.0, 0.0, None
    nxt = _single_user(denom, region)
    if nxt is not None and op_name(nxt) in ("clamp", "clamp_min") and nxt.args[0] is denom:
        low = number(arg(nxt, 1, "min"))
        if is_runtime_float(arg(nxt, 1, "min")):
            min_node = arg(nxt, 1, "min")
            low = traced_float(min_node)
        if op_name(nxt) == "clamp" and arg(nxt, 2, "max") is not None or low is None or not 0.0 <= low < math.inf:
            raise NoMatch("routing weights are renormalised by a clamped sum other than clamp(sum, min=m), m >= 0")
        renorm_min, denom = low, nxt
        nxt = _single_user(denom, region)
    if nxt is not None and op_name(nxt) == "add" and is_runtime_float(nxt.args[1]):
        raise NoMatch(runtime_float_reason("the renormalisation's eps"))
    if nxt is not None and op_name(nxt) == "add" and number(nxt.args[1]) is not None:
        eps, denom = number(nxt.args[1]), nxt
    div = _single_user(denom, region)
    if div is None or op_name(div) != "div" or div.args[0] is not w or div.args[1] is not denom:
        raise NoMatch("routing weights are renormalised in an unsupported way (only w / (clamp(sum, min) + eps))")
    return div, eps, renorm_min, min_node


def _dense_sigmoid_scores(region: Region) -> tuple[fx.Node, bool] | None:
    """(scores [T, E], sigmoid in fp32) for D: ``sigmoid(full_like(logits, -inf).scatter(1, ids, top))`` with
    only casts around the sigmoid; None when the top-k values do not go into such a scatter (not form D).
    NoMatch when they do but the dense matrix is not exactly that (e.g. a fill other than -inf: then the
    unchosen experts would get a nonzero weight)."""
    values = getitem_users(region.topk, 0)
    if len(values) != 1:
        return None
    scatter = _single_user(values[0], region)
    if scatter is None or op_name(scatter) != "scatter":
        return None
    base, dim, index, src = (arg(scatter, 0, "self"), arg(scatter, 1, "dim"), arg(scatter, 2, "index"),
                             arg(scatter, 3, "src"))
    if len(scatter.args) > 4 or set(scatter.kwargs) - {"dim", "index", "src"}:
        raise NoMatch("dense routing scatters the top-k scores with a reduction")
    if index is not region.ids or src is not values[0] or dim not in (1, -1):
        raise NoMatch("dense routing does not scatter the top-k values at the top-k ids of each token")
    fill = arg(base, 1, "fill_value") if isinstance(base, fx.Node) else None
    if (not isinstance(base, fx.Node) or op_name(base) != "full_like" or base.args[0] is not region.logits
            or not isinstance(fill, float) or fill != float("-inf") or set(base.kwargs) - {"fill_value"}
            or len(base.users) != 1):
        raise NoMatch("dense routing: the unchosen experts' scores are not -inf before the sigmoid (so they would "
                      "get a nonzero weight)")
    n = scatter
    while (u := _single_user(n, region)) is not None and op_name(u) in CAST_OPS and u.args[0] is n:
        n = u
    sig = _single_user(n, region)
    if sig is None or op_name(sig) != "sigmoid" or sig.args[0] is not n:
        raise NoMatch("dense routing scores are not the sigmoid of the scattered top-k logits")
    sigmoid_fp32 = tensor_meta(sig).dtype in (torch.float32, torch.float64)
    w = sig
    while (u := _single_user(w, region)) is not None and op_name(u) in CAST_OPS and u.args[0] is w:
        w = u
    return w, sigmoid_fp32
