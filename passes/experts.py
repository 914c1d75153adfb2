"""Read the expert math (an `ExpertSpec`) and the expert weights off a matched region.

Stacked weights (transformers 5.x ``*Experts``: grouped_mm, batched_mm, eager-with-capture)::

    W1 [E, 2I, H] (or [E, H, 2I])   W2 [E, H, I] (or [E, I, H])   b1 [E, 2I]?   b2 [E, H]?
    h  = M1(x routed to e, W1[e]) (+ b1[e])        M1, M2: grouped_mm | bmm(W[ids], .) | matmul | linear
    a  = act(split(h))                             split: chunk(2) | [..., ::2], [..., 1::2] | none
    y  = M2(a, W2[e]) (+ b2[e])
   [y  = post_norm(y)]                             an RMSNorm of each row (`post_norm.py`)
    out = combine(w * y)                           w: routing weights, reshaped/indexed only

Per-expert weights (an ``nn.ModuleList`` of MLPs traced through a loop)::

    for e in experts hit:   y_e = down_e(act(gate_e(x_e)) * up_e(x_e))   (or down_e(act(up_e(x_e))))

are handled in `loop_experts.py`, which returns the same `ExpertsMatch` with
weights stacked in the graph.

The activation is recognised from the multiset of ops between the two
projections; a form with another op there (e.g. ``tanh``) is not fused.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from mok_compile.ops.spec import FP32_ACTIVATIONS, ExpertSpec

from .dataflow import Dataflow
from .op_names import (CAST_OPS, LAYOUT_OPS_NAMES, MATMUL_OPS, arg, folded_number, is_runtime_float, number,
                       op_name, runtime_float_reason, tensor_meta)
from .post_norm import PostNorm, check_post_norm_placement, find_post_norm
from .region import ID_COMPARISONS, NoMatch, Region, is_id_mask_fill, rounding_cast, same, strip
from .routing import RouterMatch
from .validate import traced_float


@dataclass(frozen=True)
class Stack:
    """An expert weight built in the graph: ``cat([stack(g) for g in groups], dim=1)`` (one group: a stack)."""

    groups: tuple[tuple[fx.Node, ...], ...]


@dataclass
class ExpertsMatch:
    form: str
    gate_up: fx.Node | Stack
    gate_up_bias: fx.Node | Stack | None
    down: fx.Node | Stack
    down_bias: fx.Node | Stack | None
    intermediate: int
    specs: list[ExpertSpec] = field(default_factory=list)  # candidates; validation keeps the first that matches
    past_experts: int = 0  # router outputs past the experts' count: identity (LongCat-Flash) or zero (Zaya) experts
    runtime: dict = field(default_factory=dict)  # op arguments the graph reads at run time: {"alpha" | "limit": node}
    post_norm: PostNorm | None = None  # an RMSNorm of each expert's output row (its weight: the op's post_norm_weight)


def _is_interleave_slice(node: fx.Node) -> bool:
    if op_name(node) != "getitem":
        return False
    idx = node.args[1]
    idx = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(s, slice) and s.step == 2 for s in idx)


def _const(node: fx.Node):
    return next((number(a) for a in node.args[1:] if number(a) is not None), None)


def _clamp_limit(between) -> tuple[float, fx.Node | None]:
    """(L, None) of a clamped SwiGLU's two clamps, ``g.clamp(max=L)`` and ``u.clamp(min=-L, max=L)``, or (its traced
    value, L) where L is a float the graph reads at run time (a module attribute under dynamic=True; the op then
    reads the node, as `routing._weight_chain` does the routed scale). Which clamp bounds which is checked by the
    probe for GPT-OSS's (its limit 7 is within the probe's activations), by structure for DeepSeek-V4's
    (`_check_clamped_swiglu`)."""
    clamps = [n for n in between if op_name(n) == "clamp"]
    bounds = [_float_or_node(arg(c, i, name)) for c in clamps for i, name in ((1, "min"), (2, "max"))]
    if any(isinstance(a, fx.Node) for a in bounds):
        maxes = {arg(c, 2, "max") for c in clamps}
        neg = {arg(c, 1, "min") for c in clamps} - {None}
        limit = next(iter(maxes)) if len(maxes) == 1 else None
        if not (is_runtime_float(limit) and len(neg) == 1 and op_name(next(iter(neg))) == "neg"
                and next(iter(neg)).args[0] is limit):
            raise NoMatch(runtime_float_reason("the clamp limit of the clamped SwiGLU"))
        return traced_float(limit), limit
    maxes = {_float_or_node(arg(c, 2, "max")) for c in clamps}
    mins = {_float_or_node(arg(c, 1, "min")) for c in clamps}
    if len(maxes) != 1 or mins != {None, -next(iter(maxes))}:
        raise NoMatch("clamped SwiGLU has unexpected clamp limits")
    return float(next(iter(maxes))), None


def _float_or_node(a):
    """A clamp bound as a number where it folds to one (`folded_number`: after Dynamo has specialised a traced
    float, `-limit` stays a node `neg(7.0)`); else `a` itself (None, or a node)."""
    value = folded_number(a)
    return a if value is None else value


def _softcaps(between) -> tuple[float, float]:
    """(gate cap, up cap) of Inkling2's softcapped SwiGLU, ``tanh(g / a) * a * sigmoid(g) * tanh(u / b) * b``: each
    ``tanh`` reads a division by a constant and is multiplied by the same constant; the gate's is the one whose
    value the sigmoid also reads. Which product joins which is for the probe to prove."""
    caps = {}
    for tanh in (n for n in between if op_name(n) == "tanh"):
        div, users = tanh.args[0], list(tanh.users)
        c = _const(div) if isinstance(div, fx.Node) and op_name(div) == "div" else None
        if c is None or div.args[1] != c or len(users) != 1 or op_name(users[0]) != "mul" or _const(users[0]) != c:
            raise NoMatch("the softcapped SwiGLU's tanh is not tanh(v / c) * c with one constant c")
        caps[strip(div.args[0], CAST_OPS)] = float(c)
    if len(caps) != 2:
        raise NoMatch("the softcapped SwiGLU does not cap two values (its gate and up)")
    sigmoid = next(n for n in between if op_name(n) == "sigmoid")
    gate = strip(sigmoid.args[0], CAST_OPS)
    if gate not in caps:
        raise NoMatch("the softcapped SwiGLU's sigmoid does not read its capped gate")
    (up,) = set(caps) - {gate}
    return caps[gate], caps[up]


def _check_clamped_swiglu(between):
    """The product is ``silu(g.clamp(max=L)) * u.clamp(-L, L)``: which value each clamp bounds, and that the product
    comes last, checked here, since the probe's activations seldom reach a limit such as DeepSeek-V4's 10."""
    mul = next(n for n in between if op_name(n) == "mul")
    factors = {op_name(f): f for f in (strip(a, LAYOUT_OPS_NAMES) for a in mul.args) if isinstance(f, fx.Node)}
    silu, up = factors.get("silu"), factors.get("clamp")
    gate = strip(silu.args[0], LAYOUT_OPS_NAMES) if silu is not None else None
    if (up is None or gate is None or op_name(gate) != "clamp" or arg(gate, 1, "min") is not None
            or arg(up, 1, "min") is None):
        raise NoMatch("clamped SwiGLU is not silu(gate.clamp(max=L)) * up.clamp(-L, L)")


def activation_between(flow: Dataflow, region_nodes, first: list[fx.Node], last: fx.Node, bias_side: set[fx.Node]):
    """(gated, interleaved, activation, alpha, limit, the ops between, runtime) of the ops between the up and down
    projections; `runtime`: {"alpha" | "limit": node} for those the graph reads at run time (their traced values
    are in alpha, limit)."""
    fwd = flow.forward_slice(first, within=region_nodes)
    bias_side = bias_side - fwd  # the indexed bias itself, not what the projection makes of it
    bwd = flow.backward_slice([last], stop=lambda n: n not in region_nodes or n in first)
    between = (fwd & bwd) - set(first) - {last}
    kinds = Counter()
    interleaved = chunked = False
    for n in between:
        name = op_name(n)
        if _is_interleave_slice(n):
            interleaved = True
        elif name == "chunk":
            if arg(n, 1, "chunks") != 2:
                raise NoMatch("gate/up projection is split in more than two parts")
            chunked = True
        elif name == "add" and any(a in bias_side for a in n.all_input_nodes):
            continue  # bias of the gate/up projection
        elif name in LAYOUT_OPS_NAMES or _row_regrouping(n):
            continue
        elif is_id_mask_fill(n):
            continue  # expert-parallel sentinel mask (transformers 5.17); the probe checks it changes nothing
        else:
            kinds[name] += 1
    gated = interleaved or chunked or len(first) == 2
    alpha, limit, runtime = 1.702, 7.0, {}
    kinds = +kinds
    if gated:
        if kinds == Counter(silu=1, mul=1):
            act = "silu"
        elif kinds == Counter(gelu_tanh=1, mul=1):
            act = "gelu_tanh"
        elif kinds == Counter(clamp=2, mul=3, sigmoid=1, add=1):
            act = "clamped_silu"
            limit, runtime["limit"] = _clamp_limit(between)
            muls = [n for n in between if op_name(n) == "mul"]
            scales = [_const(n) for n in muls if _const(n) is not None]
            read = [a for n in muls for a in n.args if is_runtime_float(a)]  # alpha, read at run time
            adds = [_const(n) for n in between if op_name(n) == "add" and _const(n) is not None]
            if len(scales) + len(read) != 1 or adds != [1.0]:
                raise NoMatch("clamped SwiGLU has unexpected constants")
            alpha = scales[0] if scales else traced_float(read[0])
            runtime["alpha"] = read[0] if read else None
        elif kinds == Counter(clamp=2, silu=1, mul=1):  # DeepSeek-V4: silu(g.clamp(max=L)) * u.clamp(-L, L)
            act = "clamped_swiglu"
            limit, runtime["limit"] = _clamp_limit(between)
            _check_clamped_swiglu(between)
        elif kinds == Counter(div=2, tanh=2, mul=4, sigmoid=1):  # Inkling2: cap(g) * sigmoid(g) * cap(u)
            act = "softcapped_swiglu"
            alpha, limit = _softcaps(between)
        else:
            raise NoMatch(f"gated expert activation {dict(kinds)} is not supported")
    else:
        table = {("relu", "square"): "relu2", ("pow", "relu"): "relu2", ("relu",): "relu", ("silu",): "silu",
                 ("gelu",): "gelu", ("gelu_tanh",): "gelu_tanh"}
        key = tuple(sorted(kinds.elements()))
        if key not in table:
            raise NoMatch(f"expert activation {dict(kinds)} is not supported")
        act = table[key]
    act = _with_precision(act, between, tensor_meta(first[0]))
    return gated, interleaved, act, alpha, limit, between, {k: v for k, v in runtime.items() if v is not None}


SPLIT_LOOP = "split_loop"  # the form of experts looped over split rows (JetMoE's); `fuse_moe` needs the probe for it


def _row_regrouping(n: fx.Node) -> bool:
    """A `cat` or `split` of rows (dim 0): JetMoE's experts run on the expert-sorted rows split by each expert's
    count, their outputs concatenated again, activated, and split the same way for the down projection (the probe
    checks that the rows meet their own expert's weights)."""
    name = op_name(n)
    if name not in ("cat", "split"):
        return False
    dim = arg(n, 1 if name == "cat" else 2, "dim", 0)
    rows = tensor_meta(n if name == "cat" else n.args[0])
    return rows is not None and rows.dim() == 2 and dim in (0, -2)


def _with_precision(act: str, between, h_meta) -> str:
    """`act` as the op names it at the precision the graph computes it in. 16-bit experts: a SwiGLU whose silu reaches
    its product unrounded, in fp32, is `silu_fp32` (Beam's ``(silu(g.float()) * u.float()).to(dt)``), else `silu`
    (HF's default, op by op); any other activation computes in fp32 (rounded once) exactly where the op's does
    (`FP32_ACTIVATIONS`), and op by op in the experts' dtype elsewhere."""
    if h_meta is None or not h_meta.is_floating_point() or h_meta.element_size() >= 4:
        return act
    if act == "silu" and any(op_name(n) == "mul" for n in between):  # gated
        if _silu_rounded(between, h_meta):
            return "silu"
        dtype = tensor_meta(next(n for n in between if op_name(n) == "silu")).dtype
        if dtype != torch.float32:
            raise NoMatch(f"the SwiGLU is computed in {dtype} and rounded once; the op's silu_fp32 computes it in fp32")
        return "silu_fp32"
    wide = any(op_name(n) not in LAYOUT_OPS_NAMES and (m := tensor_meta(n)) is not None and m.is_floating_point()
               and m.element_size() > h_meta.element_size() for n in between)
    if wide and act not in FP32_ACTIVATIONS:
        raise NoMatch(f"the {act} activation is computed in a wider dtype than the experts' {h_meta.dtype} and "
                      f"rounded once; the op computes it op by op in {h_meta.dtype}")
    if not wide and act in FP32_ACTIVATIONS:
        raise NoMatch(f"the {act} activation is computed op by op in the experts' {h_meta.dtype}; the op computes "
                      "it in fp32 and rounds once")
    return act


def _silu_rounded(between, h_meta) -> bool:
    """Whether a SwiGLU's silu value is rounded to the experts' 16-bit dtype (or computed in it) before its product
    with up, walking back from the product's factors through layout ops and casts."""
    silu = next(n for n in between if op_name(n) == "silu")
    if tensor_meta(silu).element_size() <= h_meta.element_size():
        return True
    mul = next(n for n in between if op_name(n) == "mul")
    for n in mul.all_input_nodes:
        rounded = False
        while n is not silu and op_name(n) in LAYOUT_OPS_NAMES and n.args and isinstance(n.args[0], fx.Node):
            if rounding_cast(n):
                if tensor_meta(n).dtype != h_meta.dtype:
                    raise NoMatch(f"the SwiGLU's silu is rounded to {tensor_meta(n).dtype}, not to the experts' "
                                  f"{h_meta.dtype}")
                rounded = True
            n = n.args[0]
        if n is silu:
            return rounded
    return True


def check_weight_application(flow: Dataflow, region: Region, weights: fx.Node, expert_path: set[fx.Node],
                             down_matmuls: list[fx.Node], selection_ops=frozenset(), identity=False):
    """Routing weights must only be reshaped/indexed (or, in loops, selected with `selection_ops`), then
    multiply the down projection's output. With `identity` (router outputs past the experts: identity or zero
    experts), the weights of those pairs may be zeroed for the experts by an expert-id mask, and the token times its
    masked weights' sum (`identity_term`) may be added to the experts' output."""
    wf = flow.forward_slice([weights], within=region.nodes) - {weights}
    if wf & expert_path:
        raise NoMatch("routing weights are applied before the down projection (e.g. to the expert input); "
                      "the fused op applies them to the expert output")
    after_down = flow.forward_slice(down_matmuls, within=region.nodes)
    joins = [n for n in wf if n in after_down and any(a in after_down for a in n.all_input_nodes)
             and any(a in wf or a is weights for a in n.all_input_nodes if a not in after_down)]
    if identity:
        joins = [j for j in joins if not (op_name(j) == "add" and any(
            identity_term(flow, region, weights, a) for a in j.all_input_nodes if a not in after_down))]
    if not joins or any(op_name(j) not in ("mul",) for j in joins):
        raise NoMatch("routing weights are not multiplied with the expert output")
    for j in joins:
        w_side = flow.backward_slice([a for a in j.all_input_nodes if a not in after_down],
                                     stop=lambda n: n is weights or n not in region.nodes)
        for n in w_side & wf:
            if op_name(n) in LAYOUT_OPS_NAMES or op_name(n) in selection_ops or (identity and is_id_mask_fill(n)):
                continue
            raise NoMatch(f"routing weights go through {op_name(n)!r} ({n.name}) before they are applied")


# What may lie between the routing weights and an identity term's sum: masks over expert ids, layout ops.
_IDENTITY_WEIGHT_OPS = frozenset({"masked_fill", "where", "invert", "sum", *ID_COMPARISONS}) | LAYOUT_OPS_NAMES


def identity_term(flow: Dataflow, region: Region, weights: fx.Node, node: fx.Node) -> bool:
    """Whether `node` is the identity experts' term (LongCat-Flash)::

        x ──(layout)──────────────────────────────────────────┐
        w ── masked_fill(~(ids >= E), 0) ── sum(-1, keepdim) ─┴─ mul ─(cast)─> node

    the token times a sum of its routing weights masked by expert ids (which ids, and that the sum is over the
    identity pairs, is for the probe to prove)."""
    mul = strip(node, LAYOUT_OPS_NAMES)
    if op_name(mul) != "mul" or len(mul.all_input_nodes) != 2:
        return False
    a, b = mul.all_input_nodes
    for tokens, weighting in ((a, b), (b, a)):
        if strip(tokens, LAYOUT_OPS_NAMES) is not region.root:
            continue
        behind = flow.backward_slice([weighting], stop=lambda n: n in (weights, region.ids) or n not in region.nodes)
        inside = behind & region.nodes - {weights, region.ids}
        if weights in behind and all(op_name(n) in _IDENTITY_WEIGHT_OPS for n in inside):
            return any(op_name(n) == "sum" for n in inside)
    return False


def check_input_weight_application(flow: Dataflow, region: Region, scores: fx.Node, m1: fx.Node, m2: fx.Node):
    """Dense weight-on-input experts (Llama4)::

        scores [T, E] ─(layout)─┐
        x ─ repeat(E, 1) ───────┴─ mul ─(layout)─> bmm/matmul(W1) ... bmm/matmul(W2) ─(layout)─ sum(dim=0) ─> out

    The scores (zero for unchosen experts) meet the activations once, as a product with the input repeated once
    per expert, before the first projection; after the second projection there is only a sum over the expert
    dimension. Which score goes with which row (the transpose/reshape) is for the probe to prove."""
    inside = region.nodes
    wf = flow.forward_slice([scores], within=inside) - {scores}
    activations = flow.forward_slice([region.root], within=inside)  # root and what depends on it
    joins = [n for n in wf if any(a not in wf and a is not scores and a in activations for a in n.all_input_nodes)]
    if len(joins) != 1 or op_name(joins[0]) != "mul":
        raise NoMatch("dense routing scores are not applied as one product with the expert input", form="dense_bmm")
    join = joins[0]
    w_side = flow.backward_slice([a for a in join.all_input_nodes if a in wf or a is scores],
                                 stop=lambda n: n is scores or n not in inside) & inside - {scores}
    if any(op_name(n) not in LAYOUT_OPS_NAMES for n in w_side):
        raise NoMatch("dense routing scores go through more than layout ops before they scale the expert input",
                      form="dense_bmm")
    others = [a for a in join.all_input_nodes if a not in wf and a is not scores and a in activations]
    rep = strip(others[0], LAYOUT_OPS_NAMES) if len(others) == 1 else None
    E = region.E
    if (rep is None or op_name(rep) != "repeat" or strip(rep.args[0], LAYOUT_OPS_NAMES) is not region.root
            or len(rep.args) != 3 or not same(rep.args[1], E) or rep.args[2] != 1):
        raise NoMatch("dense routing scores do not scale the hidden states repeated once per expert",
                      form="dense_bmm")
    after_join = flow.forward_slice([join], within=inside)
    if m1 not in after_join:
        raise NoMatch("dense routing scores are not applied to the expert input", form="dense_bmm")
    if wf - after_join - w_side:
        raise NoMatch("dense routing scores are used elsewhere in the block", form="dense_bmm")
    to_m1 = (after_join & flow.backward_slice([m1], stop=lambda n: n not in inside)) - {join, m1}
    if any(op_name(n) not in LAYOUT_OPS_NAMES for n in to_m1):
        raise NoMatch("the score-weighted input goes through more than layout ops before the first projection",
                      form="dense_bmm")
    tail = flow.forward_slice([m2], within=inside) - {m2}
    sums = [n for n in tail if op_name(n) == "sum"]
    if len(sums) != 1 or any(op_name(n) not in LAYOUT_OPS_NAMES for n in tail - set(sums)):
        raise NoMatch("the experts' outputs are not just summed over the expert dimension", form="dense_bmm")
    s = sums[0]
    src = tensor_meta(s.args[0])
    dim = arg(s, 1, "dim")
    if (src is None or src.dim() != 3 or not same(src.shape[0], E) or dim not in (0, -3, (0,), (-3,), [0], [-3])
            or arg(s, 2, "keepdim", False) or "dtype" in s.kwargs or region.out not in tail | {s}):
        raise NoMatch("the experts' outputs are not summed over the expert dimension", form="dense_bmm")


def region_form(region: Region) -> str:
    """Name of the experts form, for reports: grouped_mm, grouped_mm_fallback, batched_mm, index_add, module_loop."""
    matmuls = [n for n in region.nodes if op_name(n) in MATMUL_OPS and n is not region.router_linear]
    weights3d = [n for n in region.inputs if (m := tensor_meta(n)) is not None and m.dim() == 3]
    if matmuls and not weights3d:
        return "module_loop"
    if any(op_name(n) == "index_add" for n in region.nodes) and weights3d:
        return "index_add"
    return _form(matmuls) if matmuls else "unknown"


def _form(matmuls: list[fx.Node]) -> str:
    names = {op_name(m) for m in matmuls}
    if "grouped_mm" in names:
        fallback = any(getattr(m.target, "_qualified_op_name", "").startswith("transformers::")
                       or str(m.target).startswith("transformers.") for m in matmuls)
        return "grouped_mm_fallback" if fallback else "grouped_mm"
    if "bmm" in names:
        return "batched_mm"
    return "stacked_" + sorted(names)[0]


def match_stacked_experts(flow: Dataflow, region: Region, router: RouterMatch, weights3d, biases2d,
                          norm: PostNorm | None = None) -> ExpertsMatch:
    x_meta = tensor_meta(region.x)
    H, E = region.H, region.E
    matmuls = [n for n in region.nodes if op_name(n) in MATMUL_OPS and n is not region.router_linear]

    def first_matmul(w):
        used = flow.forward_slice([w], within=region.nodes)
        found = [m for m in matmuls if m in used]
        if not found:
            raise NoMatch(f"expert weight {w.name} is not used by a matmul")
        return min(found, key=flow.order.__getitem__)

    (m1, gate_up), (m2, down) = sorted(((first_matmul(w), w) for w in weights3d), key=lambda p: flow.order[p[0]])
    if m1 is m2:
        raise NoMatch("both expert weights feed the same matmul")
    past = _past_experts(gate_up, down, E, router)
    for w in (gate_up, down):
        meta = tensor_meta(w)
        if meta.dtype != x_meta.dtype:
            raise NoMatch(f"expert weight {w.name} has dtype {meta.dtype}, hidden states {x_meta.dtype}")
    bias_role = {}
    for b in biases2d:
        used = flow.forward_slice([b], within=region.nodes)
        adds = [n for n in used if op_name(n) == "add"]
        if not adds:
            raise NoMatch(f"expert bias {b.name} is not added")
        first = min(adds, key=flow.order.__getitem__)
        bias_role["down" if flow.order[first] > flow.order[m2] else "gate_up"] = b
    if len(bias_role) != len(biases2d):
        raise NoMatch("two expert biases play the same role")
    bias_side = flow.forward_slice([bias_role["gate_up"]], within=region.nodes) if "gate_up" in bias_role else set()
    gated, interleaved, act, alpha, limit, between, runtime = activation_between(flow, region.nodes, [m1], m2,
                                                                                bias_side)

    A, B = tensor_meta(gate_up).shape[1:]
    C, D = tensor_meta(down).shape[1:]
    up_out = 2 if gated else 1
    layouts = []
    for transposed in (False, True):
        gu_in, gu_out, inter, dn_out = (A, B, C, D) if transposed else (B, A, D, C)
        if same(gu_in, H) and same(dn_out, H) and same(gu_out, up_out * inter):
            layouts.append((transposed, int(inter)))
    if not layouts:
        raise NoMatch(f"expert weight shapes {tuple(tensor_meta(gate_up).shape)} / {tuple(tensor_meta(down).shape)} "
                      f"do not fit hidden size {H}")
    expert_path = between | {m1, m2}
    # Rows regrouped between the projections: a loop over the experts' parts of the sorted rows (JetMoE's), whose
    # pairing of parts and weights only the probe proves.
    form = SPLIT_LOOP if any(_row_regrouping(n) for n in between) else region_form(region)
    if router.spec.weight_on_input:
        if bias_role:
            raise NoMatch("dense weight-on-input experts have a bias: an unchosen expert (zero input) would still "
                          "contribute", form="dense_bmm")
        check_input_weight_application(flow, region, router.weights, m1, m2)
        form = "dense_bmm"
    else:
        check_weight_application(flow, region, router.weights, expert_path, [m2], identity=past > 0)
    normed = {}
    if norm is not None:
        check_post_norm_placement(flow, region, norm, m2, router.weights)
        normed = dict(post_norm=norm.kind, post_norm_eps=norm.eps, post_norm_offset=norm.offset)
    specs = [ExpertSpec(activation=act, gated=gated, interleaved=interleaved, transposed=t, alpha=alpha, limit=limit,
                        **normed) for t, _ in layouts]
    return ExpertsMatch(form=form, gate_up=gate_up, gate_up_bias=bias_role.get("gate_up"), down=down,
                        down_bias=bias_role.get("down"), intermediate=layouts[0][1], specs=specs,
                        past_experts=past, runtime=runtime, post_norm=norm)


def _past_experts(gate_up: fx.Node, down: fx.Node, E, router: RouterMatch) -> int:
    """How many of the router's E outputs lie past the experts' count: 0 where the weights have E experts. More
    router outputs than experts are taken as identity experts (LongCat-Flash's zero-computation experts pass the
    token through, weighted) or zero experts (Zaya's skip expert adds nothing), which the probe then tells apart or
    refutes; NoMatch where the counts disagree otherwise, or the router has what the op does not combine with them."""
    counts = [tensor_meta(w).shape[0] for w in (gate_up, down)]
    for w, n in zip((gate_up, down), counts):
        if not same(n, E) and not (isinstance(n, int) and isinstance(E, int) and E > n):
            raise NoMatch(f"expert weight {w.name} has {n} experts, the router {E}")
    if same(counts[0], E) and same(counts[1], E):
        return 0
    if not same(counts[0], counts[1]):
        raise NoMatch(f"expert weights {gate_up.name} and {down.name} have {counts[0]} and {counts[1]} experts")
    what = (f"router outputs past the experts (expert weight {gate_up.name} has {counts[0]} experts, the router "
            f"{E}), taken as identity or zero experts")
    if router.spec.weight_on_input:
        raise NoMatch(f"{what}, with routing weights on the experts' input: the op has no such form")
    if router.expert_scale is not None:
        raise NoMatch(f"{what}, with a per-expert weight scale: the op has no such form")
    return E - counts[0]


def match_experts(flow: Dataflow, region: Region, router: RouterMatch) -> ExpertsMatch:
    """Experts of the region: stacked 3-D weights, or per-expert weights of a module loop."""
    norm = find_post_norm(region)
    known = router.input_nodes() | ({region.ids} if region.given_ids else set()) | ({norm.weight} if norm else set())
    tensors = [n for n in region.inputs if n not in known and tensor_meta(n) is not None]
    weights3d = [n for n in tensors if tensor_meta(n).dim() == 3]
    if weights3d:
        biases2d = [n for n in tensors if tensor_meta(n).dim() == 2]
        other = [n for n in tensors if n not in weights3d and n not in biases2d]
        if len(weights3d) != 2 or len(biases2d) > 2 or other:
            raise NoMatch(f"unexpected expert inputs {[n.name for n in tensors]} (expected two 3-D weights)")
        return match_stacked_experts(flow, region, router, weights3d, biases2d, norm)
    if norm is not None:
        raise NoMatch("an RMSNorm of each expert's output in a loop over expert modules (the op's post_norm is matched "
                      "for stacked expert weights)")
    from .loop_experts import match_loop_experts

    return match_loop_experts(flow, region, router, tensors)
