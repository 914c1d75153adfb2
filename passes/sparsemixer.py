"""Read PhiMoE's sparsemixer (its inference form) off a graph: the anchor of its blocks and its routing.

    s = logits ─[upcast]─                                   (the scores; their dtype is the one it runs in)
    round r = 0 .. K-1, on left_0 = s, left_r = scatter(left_{r-1}, -1, id_{r-1}, -inf):
        top_r, id_r = left_r.max(dim=-1, keepdim=True)
        drop_r = (top_r - s) / s.abs().clamp(min=top_r) > c          c = 2 * jitter_eps, a number
        w_r = softmax(left_r.masked_fill(drop_r, -inf), dim=-1).gather(-1, id_r)
    ids = cat([id_0, .., id_{K-1}], -1)        the anchor: its ids dispatch to the experts
    weights = cat([w_0, .., w_{K-1}], -1) ─> the weight chain of every routing (scale, cast)

Its training form samples each pick at random (a Gumbel max of `exponential_` noise) and replaces the weights'
gradient with an estimator (an autograd.Function): no kernel can match that, so a block in training mode is found
(its picks are still a cat of maxima) and left unfused with the reason.

The masks are thresholds on router scores, which the region's rule otherwise refuses (a random probe could miss
one): here the whole chain is matched op for op, and only its `drop_r` comparisons are let through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from .op_names import (CAST_OPS, VIEW_OPS, arg, folded_number, is_runtime_float, number, op_name,
                       runtime_float_reason, tensor_meta)
from .region import NoMatch, getitem_users, strip
from .validate import traced_float


@dataclass(frozen=True)
class SparsemixerMatch:
    scores: fx.Node            # s: the logits, or their upcast
    weights: fx.Node           # cat of the K rounds' weights [T, K]
    jitter_eps: float          # c / 2 (the traced value where the graph reads it at run time)
    jitter_node: fx.Node | None  # the float node the graph reads jitter_eps from at run time (dynamic=True)
    softmax_fp32: bool         # it runs in fp32 (or fp64), not in the logits' 16-bit dtype
    masks: frozenset           # the K `drop_r` comparisons


def _pick(part) -> fx.Node | None:
    """The max node whose indices `part` is, through views (``.max(dim=-1)[1].unsqueeze(-1)``), else None."""
    src = strip(part, VIEW_OPS)
    if not isinstance(src, fx.Node) or op_name(src) != "getitem" or src.args[1] != 1:
        return None
    mx = src.args[0]
    return mx if isinstance(mx, fx.Node) and op_name(mx) == "max" and arg(mx, 1, "dim") is not None else None


def is_anchor(node: fx.Node) -> bool:
    """A cat along the last dimension of two or more [T, 1] integer parts, each the indices of a max over a
    dimension: the picks of a sparsemixer (its inference or its training form), or something to tell apart."""
    if op_name(node) != "cat" or not isinstance(node.args[0], (list, tuple)) or len(node.args[0]) < 2:
        return False
    meta = tensor_meta(node)
    if meta is None or meta.dim() != 2 or meta.is_floating_point() or arg(node, 1, "dim", 0) not in (1, -1):
        return False
    return all(isinstance(p, fx.Node) and _pick(p) is not None for p in node.args[0])


def _last_dim(value) -> bool:
    return value in (-1, 1)


def _is_minus_inf(value) -> bool:
    return number(value) == -math.inf


def _lower_clamp(n, top) -> bool:
    """``v.clamp(min=top)`` or ``v.clamp_min(top)`` (not ``clamp_max``, which the op names share)."""
    raw = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    if op_name(n) == "clamp_min":
        return arg(n, 1, "min") is top
    return (op_name(n) == "clamp" and "max" not in raw and arg(n, 1, "min") is top
            and arg(n, 2, "max") is None)


def _drop_mask(mask, s: fx.Node, top: fx.Node):
    """The threshold `c` (read by `_half`) of ``(top - s) / s.abs().clamp(min=top) > c``,
    else NoMatch."""
    bad = NoMatch("a sparsemixer mask is not (top - scores) / scores.abs().clamp(min=top) > threshold")
    if not isinstance(mask, fx.Node) or op_name(mask) != "gt" or len(mask.args) != 2 or mask.kwargs:
        raise bad
    ratio, c = mask.args
    if not isinstance(ratio, fx.Node) or op_name(ratio) != "div" or len(ratio.args) != 2:
        raise bad
    diff, factor = ratio.args
    if not (isinstance(diff, fx.Node) and op_name(diff) == "sub" and diff.args[:2] == (top, s)
            and isinstance(factor, fx.Node) and _lower_clamp(factor, top)):
        raise bad
    absolute = factor.args[0]
    if not (isinstance(absolute, fx.Node) and op_name(absolute) == "abs" and absolute.args[0] is s):
        raise bad
    return c


def _check_pick(part: fx.Node, r: int) -> None:
    """NoMatch unless pick r is the indices of a ``max(dim=-1, keepdim=True)`` as they are (no view between)."""
    mx = _pick(part)
    if strip(part, VIEW_OPS) is not part or not _last_dim(arg(mx, 1, "dim")) or arg(mx, 2, "keepdim") is not True:
        raise NoMatch(f"pick {r} of the cat of maxima is not the largest score left (max(dim=-1, keepdim=True) "
                      "of the scores without the earlier picks): PhiMoE's training form samples its picks at random")


def _round(left: fx.Node, s: fx.Node, part: fx.Node, r: int):
    """(weight node w_r, mask node, threshold) of round r, whose pick `part` is left_r's max, else NoMatch."""
    mx = _pick(part)
    if mx.args[0] is not left:
        raise NoMatch(f"pick {r} is not the largest of the scores without the earlier picks")
    tops = getitem_users(mx, 0)
    fills = [u for u in left.users if op_name(u) == "masked_fill" and u.args[0] is left]
    if len(tops) != 1 or len(fills) != 1:
        raise NoMatch(f"round {r} of the sparsemixer does not mask the scores left once by their distance to the "
                      "largest")
    fill = fills[0]
    mask = arg(fill, 1, "mask")
    c = _drop_mask(mask, s, tops[0])
    if not _is_minus_inf(arg(fill, 2, "value")):
        raise NoMatch("a sparsemixer mask fills with something other than -inf")
    soft = [u for u in fill.users if op_name(u) == "softmax"]
    if len(soft) != 1 or not _last_dim(arg(soft[0], 1, "dim")) or tensor_meta(soft[0]).dtype != tensor_meta(s).dtype:
        raise NoMatch(f"round {r} of the sparsemixer does not take the softmax of the masked scores over the experts, "
                      "in their dtype")
    gathers = [u for u in soft[0].users if op_name(u) == "gather"]
    if (len(gathers) != 1 or not _last_dim(arg(gathers[0], 1, "dim")) or arg(gathers[0], 2, "index") is not part
            or len(soft[0].users) != 1):
        raise NoMatch(f"round {r}'s weight is not its softmax gathered at its pick")
    return gathers[0], mask, c


def _next_left(left: fx.Node, part: fx.Node) -> fx.Node:
    """left_{r+1}: ``scatter(left_r, -1, id_r, -inf)``, the one such user of left_r, else NoMatch."""
    found = [u for u in left.users if op_name(u) == "scatter" and u.args[0] is left and len(u.args) == 4
             and _last_dim(u.args[1]) and u.args[2] is part and _is_minus_inf(u.args[3])]
    if len(found) != 1:
        raise NoMatch("a later sparsemixer round does not run on the scores without the earlier picks "
                      "(scatter(scores, -1, pick, -inf))")
    return found[0]


def match_sparsemixer(anchor: fx.Node) -> SparsemixerMatch:
    """The sparsemixer whose picks `anchor` (an `is_anchor` cat) concatenates, or NoMatch with the reason."""
    parts = list(anchor.args[0])
    for r, part in enumerate(parts):
        _check_pick(part, r)
    s = _pick(parts[0]).args[0]
    lefts = [s]
    for part in parts[:-1]:
        lefts.append(_next_left(lefts[-1], part))
    weights, masks, thresholds = [], set(), set()
    for r, (left, part) in enumerate(zip(lefts, parts)):
        w, mask, c = _round(left, s, part, r)
        weights.append(w)
        masks.add(mask)
        thresholds.add(c)
    if len(thresholds) != 1:
        raise NoMatch("the sparsemixer's rounds compare with different thresholds")
    cats = [u for u in weights[0].users if op_name(u) == "cat" and list(u.args[0]) == weights
            and _last_dim(arg(u, 1, "dim", 0))]
    if len(cats) != 1:
        raise NoMatch("the sparsemixer's weights are not its rounds' weights concatenated in the order of its picks")
    s_meta = tensor_meta(s)
    src = strip(s, CAST_OPS)
    if src is not s and tensor_meta(src).element_size() > s_meta.element_size():
        raise NoMatch("the sparsemixer runs on the router's logits rounded to a narrower dtype")
    eps, jitter_node = _half(thresholds.pop())
    if not 0.0 <= eps < math.inf:
        raise NoMatch(f"the sparsemixer's threshold is 2 * {eps}, not 2 * a finite number >= 0")
    return SparsemixerMatch(scores=s, weights=cats[0], jitter_eps=eps, jitter_node=jitter_node,
                            softmax_fp32=s_meta.dtype in (torch.float32, torch.float64), masks=frozenset(masks))


def _half(c) -> tuple[float, fx.Node | None]:
    """(jitter_eps, the float node the op reads it from at run time or None) of a threshold `c` = 2 * jitter_eps:
    a number, or a node ``2 * e`` where the graph reads e at run time (PhiMoE's `2 * jitter_eps` where Dynamo
    traced the module's float attribute as an input; after aot_autograd has it specialised, `folded_number`)."""
    value = folded_number(c)
    if value is not None:
        return value / 2, None
    if op_name(c) == "mul" and len(c.args) == 2:
        for a, b in (c.args, c.args[::-1]):
            if number(a) == 2.0 and is_runtime_float(b):
                return traced_float(b), b
    raise NoMatch(runtime_float_reason(f"the sparsemixer's threshold ({c.name}, not 2 * a float)"))
