"""Find the nodes of one MoE block in a Dynamo graph, by structure.

    root ──view──> x [T, H] ─(cast)─ linear(W_r, b_r) ─> logits [T, E]
                                                         │  softmax | sigmoid | sqrt(softplus) (+sel. bias,
                                                         │  group mask) | -
                                                         v
                                                       topk ──> w0 [T, K], ids [T, K]
    experts (any form: grouped_mm, W[ids] + bmm, per-expert Linear loops, masks)  <── ids, x
        y_e ─[RMSNorm]─> w * y_e ──> combine (sum over k, index_add_, +=) ──> out [T, H] (or root's shape)

Where the experts compute on another activation than the router reads (Gemma 4, Muse Spark), or the logits are
scaled by a number (Muse Spark's ``linear(x) * c``, which the op does not compute), the logits are an input of the
block (the op's router argument) and its root is the activation whose rows the ids dispatch.

Llama4's dense form (every expert runs on the input scaled by a -inf-scattered sigmoid score, outputs summed
over the expert dimension) has the same anchor and region; `routing` and `experts` recognise it.

PhiMoE's sparsemixer has no top-k either: its k picks are maxima of the logits left, concatenated, and the
anchor is that cat (`sparsemixer.py`).

Hash routing (DeepSeek-V4's first layers) has no top-k: the ids are looked up by token id (or computed from
integers in any other way: a modulo hash, positions) and the router's scores gathered at them,

    table [vocab, K] ─ [input_ids] ─(long)─> ids ──────────────────┐ (an input of the block: the op's expert_ids)
    logits ─ sqrt(softplus) | softmax | sigmoid | - ─> gather(1, ids) ─> w0 ─> ... (as above)

and the anchor is that gather. So is the gather at a top-k's ids where the op cannot make the top-k's choice (AXK2
fills the groups it drops with 0 under a selection bias: `kept_selection_anchor`, which `fuse_moe` tries once the
top-k's block fails): the choice stays in the graph, and its ids are given as hash routing's are.

The anchor is a ``topk`` whose indices dispatch to experts: within the nodes
reading them (not walking through a later ``topk``) there is a grouped matmul,
an index of a 3-D tensor, a ``one_hot`` or an ``ids == e`` comparison. The
block's output is the latest node after the anchor that (1) has the shape of
``x`` or of ``root`` and ``x``'s dtype, (2) depends on activations only through
``root`` (weights and sizes may come from anywhere), (3) closes the region: no
intermediate expert value leaks out of it, nothing in it writes to its inputs,
and a computation that does not depend on the router (a shared expert) joins
the routed path only as a weight product ``w * y`` (a dense expert loop),
never as a sum (a shared expert added to the routed output stays outside,
viewed or not), (4) ends at the experts' sum: no op that never combines
(``pow``, an activation, ...) is applied after it.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

from .dataflow import Dataflow
from .op_names import (CAST_OPS, LAYOUT_OPS_NAMES as LAYOUT_OPS, MATMUL_OPS, TRANSPOSE_ATTRIBUTE_OPS, VIEW_OPS, arg,
                       is_runtime_float, meta_value, number, op_name, tensor_meta)


class NoMatch(Exception):
    """A candidate block that is not (provably) a fusable MoE; the message is the report's reason."""

    def __init__(self, reason: str, form: str | None = None):
        super().__init__(reason)
        self.form = form


# An RMSNorm's ops: in a block, of each expert's output before its weight (`post_norm.find_post_norm` places them).
NORM_OPS = frozenset({"mean", "rsqrt", "rms_norm"})
# Every op a fusable MoE block may contain; anything else in a candidate region rejects it.
KNOWN_OPS = frozenset({
    "linear", "matmul", "mm", "bmm", "grouped_mm", "einsum", "softmax", "sigmoid", "topk", "getitem", "float",
    "to", "type", "type_as", "view", "reshape", "flatten", "contiguous", "squeeze", "unsqueeze", "expand",
    "view_as", "reshape_as", "expand_as", "permute", "transpose", "t", "sum", "div", "add", "sub", "mul",
    "masked_fill", "scatter", "gather", "zeros", "zeros_like", "empty", "empty_like", "ones_like", "full",
    "new_zeros", "arange", "sort", "argsort", "histc", "cumsum", "bincount", "floordiv", "repeat_interleave",
    "chunk", "split", "silu", "gelu", "gelu_tanh", "relu", "square", "pow", "clamp", "clamp_min", "invert",
    "bool", "setitem", "index_add", "index_select", "one_hot", "where", "eq", "ne", "any", "size", "sym_size",
    "stack", "cat", "scatter_add", "index_put", "long", "int", "nonzero", "select", "narrow",
    "squeeze_", "getattr", "neg", "ge", "gt", "le", "lt",
    "full_like", "repeat",  # dense weight-on-input routing (Llama4): -inf scatter of the top-k, repeated input
    "softplus", "sqrt",  # DeepSeek-V4's router scores, sqrt(softplus(logits))
    "max",  # a group's largest score in group-limited routing (DeepSeek-V2); `routing.match_router` places it
    "tanh",  # Inkling2's softcapped SwiGLU (`experts.activation_between` places it)
    "abs",  # the sparsemixer's masks (`sparsemixer.match_sparsemixer` places it)
    "new_ones",  # Ergo's unit weights of its one-route rows
    "item",  # JetMoE's per-expert counts as split sizes (`_is_source`: computed in the block)
    "detach",  # only what chooses may be detached (Zaya's ranked probabilities; `routing.match_router` checks)
}) | NORM_OPS | TRANSPOSE_ATTRIBUTE_OPS

# Ordering comparisons are accepted only as masks over expert ids (an integer tensor against a number), e.g.
# transformers 5.17's expert-parallel sentinel mask ``expert_ids >= num_experts``; never as thresholds on
# activations or weights, which a random probe could miss.
ID_COMPARISONS = frozenset({"ge", "gt", "le", "lt", "eq", "ne"})


def is_id_comparison(node: fx.Node) -> bool:
    """``ids <op> c`` (or ``c <op> ids``) with `ids` an integer tensor and `c` a Python number."""
    if op_name(node) not in ID_COMPARISONS or len(node.args) != 2 or node.kwargs:
        return False
    a, b = node.args
    tensor, other = (a, b) if isinstance(a, fx.Node) else (b, a)
    meta = tensor_meta(tensor)
    return (meta is not None and not meta.is_floating_point() and not meta.is_complex() and meta.dtype != torch.bool
            and isinstance(other, (int, float)) and not isinstance(other, bool))


def is_id_mask_fill(node: fx.Node) -> bool:
    """``t.masked_fill(mask, 0)`` with `mask` a view of an expert-id comparison (an expert-parallel sentinel mask:
    a no-op for ids below the number of experts, which is all a top-k over the experts gives)."""
    if op_name(node) != "masked_fill":
        return False
    mask, value = arg(node, 1, "mask"), arg(node, 2, "value")
    return (isinstance(mask, fx.Node) and is_id_comparison(strip(mask, VIEW_OPS)) and isinstance(value, (int, float))
            and not isinstance(value, bool) and value == 0)


# Ops that make a fresh tensor whose values do not depend on their input (only its shape/dtype).
_FACTORIES = frozenset({"zeros", "zeros_like", "empty", "empty_like", "ones_like", "full", "new_zeros", "new_ones",
                        "arange"})


@dataclass
class Region:
    anchor: fx.Node                  # the selection topk, or with `given_ids` the gather of router scores at the ids
    ids: fx.Node                     # topk indices [T, K], or the given ids (an input of the block)
    logits: fx.Node                  # router logits [T, E]
    router_linear: fx.Node | None    # the linear producing the logits; None: the logits are an input of the block
    x: fx.Node                       # hidden states [T, H] the experts compute on (router input minus casts)
    root: fx.Node                    # x minus views: the block's activation input
    out: fx.Node                     # combined routed output [T, H] (or root's shape)
    nodes: set[fx.Node]              # everything computed inside the block (prep views included)
    inputs: list[fx.Node]            # tensors and sizes fed from outside (weights, biases, SymInts)
    depends_on_router: set[fx.Node] = field(default_factory=set)
    T: object = None
    H: int = 0
    E: int = 0
    K: int = 0
    given_ids: bool = False          # ids computed from integers alone (hash routing), not chosen by a top-k
    sparsemixer: object = None       # the `SparsemixerMatch` whose picks the anchor (a cat) concatenates

    @property
    def topk(self) -> fx.Node | None:
        return None if self.given_ids or self.sparsemixer is not None else self.anchor


def same(a, b) -> bool:
    """Size equality that never adds a guard (symbolic T stays symbolic)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def same_shape(a, b) -> bool:
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def strip(node, ops) -> fx.Node:
    """Follow single-input ops in `ops` back to their source."""
    while isinstance(node, fx.Node) and op_name(node) in ops and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def getitem_users(node: fx.Node, index: int) -> list[fx.Node]:
    return [u for u in node.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == index]


def _is_size(value) -> bool:
    if isinstance(value, (list, tuple)):  # torch.Size too
        return len(value) > 0 and all(_is_size(v) for v in value)
    return isinstance(value, (int, torch.SymInt, torch.SymBool, torch.SymFloat)) and not isinstance(value, bool)


def _is_source(n: fx.Node) -> bool:
    """Values a region takes from outside as they are: weights, and sizes (the probe uses their hints). A size read
    off data (`.item()`, `.tolist()`: JetMoE's per-expert counts) has no hint: it is computed in the region."""
    if n.op in ("placeholder", "get_attr"):
        return True
    value = meta_value(n)
    return n.op != "output" and _is_size(value) and not _data_dependent(value)


def _data_dependent(value) -> bool:
    """A size with an unbacked symbol (one Dynamo made for a value read off a tensor's data)."""
    if isinstance(value, (list, tuple)):
        return any(_data_dependent(v) for v in value)
    return isinstance(value, (torch.SymInt, torch.SymBool, torch.SymFloat)) and bool(free_unbacked_symbols(value))


def topk_k(node: fx.Node) -> int | None:
    k = arg(node, 1, "k")
    return k if isinstance(k, int) else None


# ----------------------------------------------------------------------------- anchors


def dispatch_evidence(flow: Dataflow, ids: fx.Node) -> bool:
    """Do the indices select experts (rather than, e.g., sample tokens)? Stops at the next topk, and past a matmul:
    experts are found at the first matmul the ids reach (its weights chosen by them, or its rows grouped by them),
    and what a matmul computes from them is no longer the choice (a sparse attention's top-k, as DeepSeek-V4's
    indexer, picks keys whose attention output reaches the next layer's experts)."""
    seen, work = set(), [ids]
    computed = _ComputedWeights(flow, ids, set())  # weights computed from module state (a LoRA delta) past the ids
    while work:
        n = work.pop()
        if n in seen or len(seen) > 5000:
            continue
        seen.add(n)
        name = op_name(n)
        if n is not ids and name == "topk":
            continue
        if name in MATMUL_OPS and any((m := tensor_meta(a)) is not None and m.dim() == 3
                                      and (_is_source(a) or a in computed) for a in n.all_input_nodes):
            return True  # a batched matmul over stacked expert weights
        if is_split_expert_gemm(n, same_expert=False):
            return True  # rows grouped by the ids, one expert's part through its weight (JetMoE's split loop)
        if n is not ids and _is_size(meta_value(n)):
            continue  # a size of a value derived from the ids (e.g. Dynamo's check of bincount's length), not ids
        if name in ("grouped_mm", "one_hot", "eq"):
            if name != "eq" or (tensor_meta(n) is not None and any(isinstance(a, int) for a in n.args)):
                return True
        if name in ("getitem", "index_select") and isinstance(n.args[0], fx.Node) and n.args[0] not in seen:
            base = tensor_meta(n.args[0])
            if base is not None and base.dim() == 3 and base.is_floating_point():
                return True  # stacked expert weights (not integer tables: GLM-5-Next's indexer picks pools' indices)
        if name in MATMUL_OPS:
            continue
        work.extend(flow.readers(n))
    return False


def _expert_slice(n) -> int | None:
    """e for ``W[e]``: one expert's 2-D weight of a stacked 3-D float graph input, at a constant index; else None."""
    if not isinstance(n, fx.Node) or op_name(n) not in ("getitem", "select") or not isinstance(n.args[0], fx.Node):
        return None
    base = tensor_meta(n.args[0])
    index = n.args[1] if op_name(n) == "getitem" else (n.args[2] if n.args[1] == 0 else None)
    ok = (_is_source(n.args[0]) and base is not None and base.dim() == 3 and base.is_floating_point()
          and isinstance(index, int) and not isinstance(index, bool))
    return index if ok else None


def is_split_expert_gemm(n: fx.Node, same_expert: bool = True) -> bool:
    """``linear(rows.split(sizes)[e], W[e])``: expert e's GEMM on the e-th part of rows split by the experts' token
    counts (JetMoE's grouped GEMM written as a loop). Not `same_expert`: a part through any one expert's weight
    (which part meets which weight is then for the probe to prove)."""
    if op_name(n) != "linear" or len(n.args) < 2:
        return False
    e, part = _expert_slice(n.args[1]), n.args[0]
    return (e is not None and op_name(part) == "getitem" and (part.args[1] == e or not same_expert)
            and op_name(part.args[0]) == "split")


def is_table_lookup(node: fx.Node) -> bool:
    """``table[idx]``: a 2-D integer tensor indexed by an integer tensor (token ids)."""
    if op_name(node) != "getitem" or not isinstance(node.args[1], fx.Node):
        return False
    table, idx = tensor_meta(node.args[0]), tensor_meta(node.args[1])
    return (table is not None and idx is not None and table.dim() == 2 and not table.is_floating_point()
            and not idx.is_floating_point())


_ID_CASTS = frozenset({"long", "int", "to"})


def looked_up_ids(lookup: fx.Node) -> fx.Node:
    """The ids of a table lookup (`is_table_lookup`): the lookup past the integer casts that alone read it."""
    ids = lookup
    while (len(ids.users) == 1 and op_name(nxt := next(iter(ids.users))) in _ID_CASTS
           and (m := tensor_meta(nxt)) is not None and not m.is_floating_point()):
        ids = nxt
    return ids


def _has_float_value(n: fx.Node) -> bool:
    """Whether `n` gives a floating-point tensor (alone or among its results)."""
    value = meta_value(n)
    return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
               for v in (value if isinstance(value, (list, tuple)) else (value,)))


def _integer_only(flow: Dataflow, node: fx.Node) -> bool:
    """Whether `node` is computed from integer tensors (token ids, integer tables), sizes and constants alone: no
    floating-point value (an activation, a weight, router scores) in its ancestry (whose walk stops at those)."""
    return not any(_has_float_value(n) for n in flow.backward_slice([node], _has_float_value))


def _scores_gathered_at(ids: fx.Node) -> fx.Node | None:
    """The one ``gather`` along the experts that reads [T, K] integer `ids` as its index (router scores at them), or
    None where there is no such gather or more than one."""
    ids_meta = tensor_meta(ids)
    if (ids_meta is None or ids_meta.dim() != 2 or ids_meta.is_floating_point() or ids_meta.dtype == torch.bool
            or not isinstance(ids_meta.shape[1], int)):
        return None
    gathers = [u for u in ids.users if op_name(u) == "gather"]
    if len(gathers) != 1:
        return None
    gather, meta = gathers[0], tensor_meta(gathers[0])
    if arg(gather, 2, "index") is not ids or arg(gather, 1, "dim") not in (1, -1) or meta is None or meta.dim() != 2:
        return None
    return gather


def _given_ids_anchor(flow: Dataflow, gather: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(gather, ids) for given ids: a ``gather`` along the experts at [T, K] integer ids computed from integer inputs
    alone (`_integer_only`: a table lookup by token id as in DeepSeek-V4's hash routing, a modulo hash, positions),
    the only gather that reads them, which dispatch to experts; None otherwise. The gather is the router's scores at
    the given ids (the routing weights; `routing` checks that)."""
    ids = arg(gather, 2, "index")
    if not isinstance(ids, fx.Node) or _scores_gathered_at(ids) is not gather or not _integer_only(flow, ids):
        return None
    return (gather, ids) if dispatch_evidence(flow, ids) else None


def kept_selection_anchor(topk: fx.Node, ids: fx.Node) -> fx.Node | None:
    """For a top-k whose choice the op cannot make (AXK2 fills the groups it drops with 0 where a selection bias can
    make kept scores negative, so dropped experts can outrank kept ones and tie among themselves), the gather of
    router scores at its ids: fused with it as the anchor, the block takes the ids as given (the op's
    `expert_ids`), and the selection stays in the graph, as the graph computes it. None where the weights are not
    scores gathered at the ids (the top-k's own values, say)."""
    return _scores_gathered_at(ids) if op_name(topk) == "topk" else None


def block_anchors(gm: fx.GraphModule, flow: Dataflow) -> list[tuple[fx.Node, fx.Node]]:
    """(anchor, ids) of each candidate block, in graph order: a topk whose indices dispatch to experts, with them;
    given ids (computed from integer inputs alone: hash routing) that dispatch, with the gather of router scores
    at them; or a sparsemixer's cat of picks that dispatch, as both."""
    from . import sparsemixer  # it reads this module's helpers

    found = []
    for n in gm.graph.nodes:
        if op_name(n) == "topk":
            ids = getitem_users(n, 1)
            if len(ids) == 1 and dispatch_evidence(flow, ids[0]):
                found.append((n, ids[0]))
        elif op_name(n) == "gather" and (given := _given_ids_anchor(flow, n)) is not None:
            found.append(given)
        elif sparsemixer.is_anchor(n) and dispatch_evidence(flow, n):
            found.append((n, n))
    return sorted(found, key=lambda pair: flow.order[pair[0]])


# ----------------------------------------------------------------------------- router

# "detach": Zaya ranks detached probabilities (`routing._check_detached` keeps the weights off it).
_ROUTER_CHAIN_OPS = {"softmax", "sigmoid", "softplus", "sqrt", "add", "masked_fill", "detach"} | CAST_OPS


def _matrix_transpose(n) -> bool:
    """``W.t()``, ``W.T``, ``W.mT`` or ``W.transpose(0, 1)`` of a 2-D W."""
    if not isinstance(n, fx.Node) or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    src = tensor_meta(n.args[0])
    if src is None or src.dim() != 2:
        return False
    name = op_name(n)
    if name == "getattr":
        return n.args[1:] in (("T",), ("mT",))
    if name in TRANSPOSE_ATTRIBUTE_OPS:
        return len(n.args) == 1
    if name == "transpose":
        dims = n.args[1:]
        return len(dims) == 2 and all(isinstance(d, int) for d in dims) and sorted(d % 2 for d in dims) == [0, 1]
    return name == "t"


def _fp32_router_mm(n: fx.Node) -> bool:
    """``torch.mm(x, W.t(), out_dtype=torch.float32)`` (or ``W.T``): fp32 logits from a 16-bit GEMM (Kolibri1's and
    Ergo's routers at inference on CUDA), the same products as ``linear(x.float(), W.float())`` summed in fp32."""
    return (op_name(n) == "mm" and n.kwargs.get("out_dtype") == torch.float32 and len(n.args) == 2
            and _matrix_transpose(n.args[1]))


def rounding_cast(n) -> bool:
    """A cast to a dtype that does not hold every value of its input's (fp32 -> bf16, bf16 <-> fp16)."""
    if not isinstance(n, fx.Node) or op_name(n) not in CAST_OPS or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    src, out = tensor_meta(n.args[0]), tensor_meta(n)
    return (src is not None and out is not None and out.dtype != src.dtype
            and out.element_size() <= src.element_size())


def past_exact_casts(n):
    """`n` past the casts that keep every value (widening ones), up to a cast that rounds: the tensor whose values
    reach `n` unchanged (a block input, or a weight rounded in the block, whose cast then stays outside the op)."""
    while isinstance(n, fx.Node) and op_name(n) in CAST_OPS and n.args and isinstance(n.args[0], fx.Node):
        if rounding_cast(n):
            return n
        n = n.args[0]
    return n


def router_weight(router_linear: fx.Node):
    """The [E, H] router weight the linear (or fp32-out mm) reads, past the casts that keep its values: an fp32
    weight rounded to 16 bits before an fp32 GEMM (Ergo's, kept in fp32) is the rounded one."""
    w = router_linear.args[1]
    if _fp32_router_mm(router_linear):
        w = w.args[0]
    return past_exact_casts(w)


def shape_kept(n: fx.Node) -> bool:
    """A view or reshape whose output has its input's shape (``scores.view(-1, E)`` of [T, E] scores)."""
    if op_name(n) not in ("view", "reshape"):
        return False
    out, src = tensor_meta(n), tensor_meta(n.args[0])
    return out is not None and src is not None and same_shape(out.shape, src.shape)


def _router_input(node: fx.Node) -> fx.Node:
    """The router's input past casts and the views that keep its shape between them (Inkling2 routes on
    ``x.float().reshape(-1, H)`` of its [T, H] x): the tokens the experts read too."""
    while True:
        node = strip(node, CAST_OPS)
        if not shape_kept(node):
            return node
        node = node.args[0]


def _scaled_logits(n: fx.Node) -> fx.Node | None:
    """The logits `l` of ``l * c``, ``c * l`` or ``l / c`` with c a number (or a float the graph reads at run time),
    else None."""
    if op_name(n) not in ("mul", "div") or len(n.args) != 2 or n.kwargs:
        return None
    a, b = n.args
    scalar = lambda v: number(v) is not None or is_runtime_float(v)  # noqa: E731
    if isinstance(a, fx.Node) and scalar(b):
        return a
    return b if op_name(n) == "mul" and isinstance(b, fx.Node) and scalar(a) else None


def find_router(anchor: fx.Node, scores: fx.Node | None = None) -> tuple[fx.Node, fx.Node]:
    """(router linear, logits) behind a topk (or a gather of scores at given ids, or a sparsemixer's `scores`): walk
    back through score ops to a linear (or an fp32-out mm). Logits scaled by numbers (Muse Spark's
    ``output_multiplier``) are the scaled ones: the op takes them as computed (router_is_logits), since it has no
    such scale."""
    n = anchor.args[0] if scores is None else scores
    scaled = None
    while isinstance(n, fx.Node):
        name = op_name(n)
        if name == "linear" or _fp32_router_mm(n):
            return n, scaled or n
        if (unscaled := _scaled_logits(n)) is not None:
            scaled, n = scaled or n, unscaled
            continue
        if isinstance(n.args[0], fx.Node) and (name in CAST_OPS or shape_kept(n)
                                               or scaled is None and name in _ROUTER_CHAIN_OPS):
            n = n.args[0]
            continue
        break
    where = {"topk": "the top-k", "gather": "the gather at the given ids"}.get(op_name(anchor), "the sparsemixer")
    raise NoMatch(f"router logits do not come from a linear layer in this graph (found {n!s} before {where})")


# ----------------------------------------------------------------------------- region


class _EveryInput:
    """A property a node has where each of its inputs has it (`_trivial` decides the nodes it need not walk past):
    memoised, and walked depth first without recursion, since a chain may be thousands of nodes long. A node is
    decided once each of its inputs is, and lacks the property from its first input that lacks it on."""

    def __init__(self, flow: Dataflow):
        self.flow = flow
        self.known: dict[fx.Node, bool] = {}

    def _trivial(self, n: fx.Node) -> bool | None:
        raise NotImplementedError

    def holds(self, n: fx.Node) -> bool:
        verdict = self._trivial(n)
        if verdict is not None:
            return verdict
        stack = [(n, iter(self.flow.inputs(n)))]
        while stack:
            node, pending = stack[-1]
            for i in pending:
                verdict = self._trivial(i)
                if verdict is None:
                    stack.append((i, iter(self.flow.inputs(i))))
                    break
                if not verdict:  # so is every node waiting on it
                    for waiting, _ in stack:
                        self.known[waiting] = False
                    stack.clear()
                    break
            else:
                self.known[node] = True
                stack.pop()
        return self.known[n]


class _ActivationClean(_EveryInput):
    """Nodes whose values depend on activations only through `roots` (weights and sizes may come from anywhere): a
    source, a root, or a node after the first root whose inputs are all clean. A membership test walks back from the
    node asked about (memoised) and stops at the first root's position, so a block costs what its neighbourhood
    holds; a scan of the whole graph per block made the pass's time grow with the square of the model's depth."""

    def __init__(self, flow: Dataflow, roots: set[fx.Node]):
        super().__init__(flow)
        self.roots = roots
        self.start = min(flow.order[r] for r in roots)

    def _trivial(self, n: fx.Node) -> bool | None:
        if n in self.known:
            return self.known[n]
        if _is_source(n) or n in self.roots:
            return True
        pos = self.flow.order.get(n)  # None: not in the graph (an earlier block's anchor, erased with it)
        if pos is None or pos <= self.start:
            return False
        return None

    def __contains__(self, n: fx.Node) -> bool:
        return self.holds(n)


def _candidate_outputs(flow, ids, clean, x_meta, root_meta):
    """Clean [T, H] nodes of the activation's dtype that the ids reach through clean nodes (an output computed
    without the ids, or through a value that is not clean, is none of this block's), latest first."""
    reach = flow.forward_slice([ids], within=clean)
    out = []
    for n in reach:
        v = tensor_meta(n)
        if n not in clean or v is None or v.dtype != x_meta.dtype:
            continue
        if same_shape(v.shape, x_meta.shape) or same_shape(v.shape, root_meta.shape):
            out.append(n)
    return sorted(out, key=flow.order.__getitem__, reverse=True)


def _check_region(flow: Dataflow, out: fx.Node, nodes: set[fx.Node], inputs: set[fx.Node], logits: fx.Node,
                  ids: fx.Node, root: fx.Node, thresholds=frozenset()):
    """Raise NoMatch unless `nodes` is a closed MoE region producing `out`. `thresholds`: comparisons matched as
    part of the routing (the sparsemixer's masks), which may compare scores."""
    for n in nodes:
        name = op_name(n)
        if name not in KNOWN_OPS:
            raise NoMatch(f"op {name or n.op!r} ({n.name}) is not part of any supported MoE form")
        if name in ID_COMPARISONS - {"eq", "ne"} and not is_id_comparison(n) and n not in thresholds:
            raise NoMatch(f"comparison {name!r} ({n.name}) is not a mask over expert ids")
    out_pos = flow.order[out]
    for target in list(nodes) + list(inputs):
        for w in flow.writers.get(target, ()):
            if target in inputs and w in nodes:
                raise NoMatch(f"{w.name} writes in place to the block input {target.name}")
            if target in nodes and w not in nodes and flow.order[w] < out_pos:
                raise NoMatch(f"{w.name} outside the block writes in place to {target.name}")
    if any(flow.order[w] > out_pos for w in flow.writers.get(out, ())):
        raise NoMatch(f"the block output {out.name} is written in place later")
    routed = flow.forward_slice([logits], within=nodes)
    # An RMSNorm in a block normalises each expert's output before its weight (`post_norm`): one of what the
    # routing weights' values reach (past the ids, which only dispatch) lies after the weighting, or past the block.
    weighted = flow.forward_slice([logits], within=nodes - {ids})
    for n in nodes & weighted:
        if op_name(n) in NORM_OPS:
            raise NoMatch(f"op {op_name(n)!r} ({n.name}) normalises values the routing weights reach (a norm after "
                          "the weighting, or of the block's output); the op's post_norm comes before the weights")
    expert_side = nodes - routed
    # A value computed from activations without the router (a shared expert, a dense expert of a mask loop)
    # may join the routed path only through a product with routing weights. Views, casts and row copies (Ergo's
    # tokens repeated once per route) pass, unless what they view is such a value (AFMoE's shared expert output,
    # `.view(B, S, H)` before the sum).
    for n in routed:
        if op_name(n) == "mul":
            continue
        for a in n.all_input_nodes:
            if a not in expert_side or a is root or op_name(a) in _FACTORIES or _is_weight_prep(a, root, nodes):
                continue
            if op_name(a) in LAYOUT_OPS | {"repeat_interleave"} and not _computes_on_activations(flow, a, root, nodes):
                continue
            raise NoMatch(f"{a.name}, computed without the router, joins the routed output through "
                          f"{op_name(n)!r} ({n.name}); a shared expert stays outside the fused op")
    return routed


def _computes_on_activations(flow: Dataflow, n: fx.Node, root: fx.Node, nodes) -> bool:
    """Whether `n` comes from a matmul of activations (an expert's output), not from the tokens moved or re-typed."""
    behind = flow.backward_slice([n], lambda m: m is root or m not in nodes) & nodes
    return any(op_name(m) in MATMUL_OPS and not _is_weight_prep(m, root, nodes) for m in behind)


# Ops that may transform a combined output but never combine one: a candidate that ends in one (past views and
# casts), e.g. ``moe(x).pow(2)`` or a projection of it (Muse Spark's post_expert_proj, at the experts' width), lies
# past the block, and a candidate before it is the block's output.
_AFTER_THE_COMBINE = frozenset({"pow", "square", "clamp", "clamp_min", "neg", "relu", "silu", "gelu", "gelu_tanh",
                                "sigmoid", "softmax", "div", "sub", "linear"})


def _check_closed(flow: Dataflow, out: fx.Node, nodes: set[fx.Node], inputs: set[fx.Node], routing_side: set,
                  root: fx.Node):
    """Raise NoMatch if `out` is not where the block ends: it applies an op after the experts' sum, adds the block's
    input to it (a residual, ``h + moe(h)``), or a value the experts computed, other than `out`, is read outside the
    region; an earlier candidate is then the output. (In an fp32 post-norm model the norm's no-op
    ``out.to(float32)`` and its ``.pow(2)`` pass every other test.) Routing values (the logits, weights and ids:
    `routing_side`, what the top-k reads) may be read outside; shape queries of expert values too."""
    tail = strip(out, LAYOUT_OPS)
    last = op_name(tail)
    if last in _AFTER_THE_COMBINE:
        raise NoMatch(f"the candidate output {out.name} applies {last!r} after the experts' sum")
    if last == "add" and any(strip(a, LAYOUT_OPS) is root for a in tail.args):
        raise NoMatch(f"the candidate output {out.name} adds the block's input to the experts' sum (a residual)")
    if last == "mul" and any(number(a) is not None for a in tail.args):
        # a product with a number never combines (the combine multiplies two tensors): OpenAI privacy filter's
        # `experts(x) * top_k` lies past the block
        raise NoMatch(f"the candidate output {out.name} scales the experts' sum by a constant")
    if last in ("add", "mul") and any(_vector_input(a, inputs) for a in tail.args):
        # nor does a vector the block takes as it is (Zaya's `(moe(x) + bias) * scale` of [H] parameters)
        raise NoMatch(f"the candidate output {out.name} applies {last!r} of a vector input to the experts' sum")
    expert_weights = [n for n in inputs if n not in routing_side]
    for n in flow.sorted(flow.forward_slice(expert_weights, within=nodes)):
        if n is out or not isinstance(meta_value(n), torch.Tensor):  # sizes may be shared with later code
            continue
        if any(u not in nodes and (u.op == "output" or isinstance(meta_value(u), torch.Tensor))
               for u in flow.readers(n)):
            raise NoMatch(f"expert intermediate {n.name} is used outside the block")


def _vector_input(a, inputs) -> bool:
    """A 1-D tensor among the block's inputs, past views and casts."""
    if not isinstance(a, fx.Node):
        return False
    a = strip(a, LAYOUT_OPS)
    return a in inputs and (meta := tensor_meta(a)) is not None and meta.dim() == 1


def _is_weight_prep(n: fx.Node, root: fx.Node, nodes) -> bool:
    """A node computed from weights/sizes only (e.g. a transpose or stack of expert weights)."""
    seen, work = set(), [n]
    while work:
        m = work.pop()
        if m in seen:
            continue
        seen.add(m)
        if m is root:
            return False
        work.extend(i for i in m.all_input_nodes if i in nodes or i is root)
    return True


def _close_over_writes(flow: Dataflow, sliced: set[fx.Node], out: fx.Node, stop,
                       clean: _ActivationClean) -> set[fx.Node]:
    """Add the in-place writes to block values that nothing reads afterwards (e.g. 5.17's
    ``expert_ids_g.clamp_(max=E - 1)`` when there is no expert bias to gather), with what they read: they belong
    to the block and go with it. Writes to the block's inputs are not added (`_check_region` rejects those)."""
    out_pos = flow.order[out]
    changed = True
    while changed:
        changed = False
        for target in list(sliced):
            if stop(target):
                continue
            for w in flow.writers.get(target, ()):
                if w not in sliced and w in clean and flow.order[w] < out_pos:
                    sliced |= flow.backward_slice([w], stop)
                    changed = True
    return sliced


def find_region(gm: fx.GraphModule, flow: Dataflow, anchor: fx.Node, ids: fx.Node, anchors=None) -> Region:
    """The MoE block around one anchor (`block_anchors`), or NoMatch with the reason. Given ids (the anchor a
    gather) are an input of the block, as its weights are: what looks them up stays outside.

    `anchors`: the graph's anchors, computed when not given. A block ends before the next block's router: nothing
    downstream of another anchor is a candidate output, so a block whose output feeds another block directly (no
    residual in between) is not swallowed into one region with it.
    """
    from .sparsemixer import match_sparsemixer  # it reads this module's helpers

    given = op_name(anchor) == "gather"
    mixer = match_sparsemixer(anchor) if op_name(anchor) == "cat" else None
    router_linear, logits = find_router(anchor, None if mixer is None else mixer.scores)
    lmeta = tensor_meta(logits)
    x = _router_input(router_linear.args[0])
    x_meta = tensor_meta(x)
    if lmeta is None or x_meta is None:
        raise NoMatch("graph has no shape metadata (pass example_inputs or trace with Dynamo)")
    # Logits of tokens in more dimensions ([B, S, E]: Zaya routes before it flattens the tokens) are the op's router
    # argument as [T, E] (router_is_logits), with the experts on their [T, H] activation.
    nd_logits = lmeta.dim() > 2 and x_meta.dim() == lmeta.dim() and not given and mixer is None
    if (x_meta.dim() != 2 or lmeta.dim() != 2) and not nd_logits:
        raise NoMatch(f"router input has shape {tuple(x_meta.shape)}; expected a 2-D [tokens, hidden] input")
    if anchors is None:
        anchors = block_anchors(gm, flow)
    search = _RegionSearch(gm, flow, anchor, ids, anchors, logits, given, mixer)
    if logits is router_linear and not nd_logits:
        region = search.around(x, router_linear)
        if region is not None:
            return region
    # The experts may compute on another tensor than the router reads (Gemma 4 normalises the residual twice, Muse
    # Spark projects and normalises it, a router may read a detached copy), or the op cannot compute the logits (they
    # are scaled): the logits are then an input of the block, as the op's router argument (router_is_logits), and
    # what computes them stays in the graph.
    first = search.reasons
    activation = _experts_activation(flow, ids, math.prod(lmeta.shape[:-1]))
    if activation is None or (logits is router_linear and not nd_logits
                              and strip(activation, VIEW_OPS) is strip(x, VIEW_OPS)):
        raise NoMatch(first[-1] if first else "found no combined [tokens, hidden] output of the experts")
    search.reasons = []
    region = search.around(activation, None)
    if region is not None:
        return region
    # Where the block did close around the router's input but failed a check, that reason stays the report's.
    raise NoMatch(first[-1] if first else search.reasons[-1] if search.reasons else
                  f"found no combined [tokens, hidden] output of the experts computing on {activation}")


class _ComputedWeights(_EveryInput):
    """Expert (or router) weights the graph computes, after the block's activation input, from module state alone:
    parameters and buffers (a parametrization with `torch.nn.utils.parametrize`, a LoRA delta ``W + B @ A``, a
    weight norm, a dequantising scale). They stay in the graph as inputs of the block, as the weights they replace
    would be; the op reads what they give, and its weight gradients reach the parameters through them. A node is one
    where it computes (no view, cast or factory: the matchers read those as the layout of a block's weights), gives a
    floating-point tensor of 2 or more dimensions, and reads, through nodes placed after the activation input, only
    module state (`_is_module_state`) and sizes, one tensor at least, none of `excluded` (the logits or given ids a
    block takes). Bounded by the activation input's position, so a block costs what its neighbourhood holds."""

    def __init__(self, flow: Dataflow, root: fx.Node, excluded: set[fx.Node]):
        super().__init__(flow)
        self.start, self.excluded = flow.order[root], excluded | {root}

    def _trivial(self, n: fx.Node) -> bool | None:
        if n in self.known:
            return self.known[n]
        if n in self.excluded:
            return False
        if n.op in ("placeholder", "get_attr"):
            return n.op == "get_attr" or _is_module_state(n)
        if _computed_size(n):  # any computation may read one
            return True
        if self.flow.order.get(n, -1) <= self.start or all(_computed_size(i) for i in self.flow.inputs(n)):
            return False  # before the activation input, or made from sizes alone (a factory's)
        return None

    def __contains__(self, n: fx.Node) -> bool:
        if n.op not in ("call_function", "call_method") or op_name(n) in _NOT_COMPUTED_WEIGHTS:
            return False
        meta = tensor_meta(n)
        return meta is not None and meta.is_floating_point() and meta.dim() >= 2 and self.holds(n)


def _computed_size(n: fx.Node) -> bool:
    """A size the graph computes (a graph input is module state or not, `_is_module_state`)."""
    return _is_source(n) and n.op not in ("placeholder", "get_attr")


# What `_ComputedWeights` never takes as a computed weight: views and casts, which the matchers read as the layout of
# a block's weights, and factories.
_NOT_COMPUTED_WEIGHTS = LAYOUT_OPS | _FACTORIES


class _RegionSearch:
    """The candidate outputs of one anchor's block tried, latest first, for a given activation input."""

    def __init__(self, gm, flow, anchor, ids, anchors, logits, given, mixer=None):
        self.gm, self.flow, self.anchor, self.ids, self.anchors = gm, flow, anchor, ids, anchors
        self.logits, self.given, self.reasons = logits, given, []
        self.mixer = mixer

    def around(self, x: fx.Node, router_linear: fx.Node | None) -> Region | None:
        """The region whose activation input is `x` (its views stripped: the root): the router's input with the
        router linear inside, or (`router_linear` None) the experts' input with the logits outside."""
        flow, anchor, ids, logits, given = self.flow, self.anchor, self.ids, self.logits, self.given
        x_meta, lmeta = tensor_meta(x), tensor_meta(logits)
        root = strip(x, VIEW_OPS)
        root_meta = tensor_meta(root)
        outside = {logits} if router_linear is None else set()
        clean = _ActivationClean(flow, {root} | outside)
        candidates = _candidate_outputs(flow, ids, clean, x_meta, root_meta)
        # Another block's router upstream of a candidate: only an anchor placed before the latest candidate can be.
        latest = flow.order[candidates[0]] if candidates else -1
        others = [a for a, _ in self.anchors if a is not anchor and flow.order.get(a, latest) < latest and a in clean]
        later_blocks = flow.forward_slice(others, within=clean)
        candidates = [c for c in candidates if c not in later_blocks]
        computed = _ComputedWeights(flow, root, outside | ({ids} if given else set()))
        is_input = lambda n: _is_source(n) or (given and n is ids) or n in outside or n in computed  # noqa: E731
        stop = lambda n: is_input(n) or n is root  # noqa: E731
        routing_side = flow.backward_slice([anchor], stop)
        for out in candidates[:64]:
            sliced = _close_over_writes(flow, flow.backward_slice([out], stop), out, stop, clean)
            inputs = {n for n in sliced if is_input(n)} - {root}
            nodes = sliced - inputs - {root}
            if anchor not in nodes or (router_linear is not None and router_linear not in nodes):
                continue
            if router_linear is None and logits not in inputs:
                continue
            try:
                routed = _check_region(flow, out, nodes, inputs | {root}, logits, ids, root,
                                       self.mixer.masks if self.mixer is not None else frozenset())
                _check_closed(flow, out, nodes, inputs, routing_side, root)
            except NoMatch as err:
                self.reasons.append(str(err))
                continue
            k = tensor_meta(ids).shape[1] if given or self.mixer is not None else topk_k(anchor)
            if k is None:
                raise NoMatch("top-k size is not a constant")
            return Region(anchor=anchor, ids=ids, logits=logits, router_linear=router_linear, x=x, root=root,
                          out=out, nodes=nodes, inputs=flow.sorted(inputs), depends_on_router=routed,
                          T=x_meta.shape[0], H=x_meta.shape[1], E=lmeta.shape[-1], K=k, given_ids=given,
                          sparsemixer=self.mixer)
        return None


def _experts_activation(flow: Dataflow, ids: fx.Node, T) -> fx.Node | None:
    """The [T, H] activation whose rows the ids dispatch to the experts: the activation operand of the first matmul
    the ids reach, walked back through what reads the ids (a row gather by ``perm // K``, its casts) and through the
    row copies of batched experts (``repeat_interleave``, views, none of them T rows of 2-D) to the first tensor
    that is neither; None where that is a weight or not [T, *]."""
    gemm, reach = flow.first_reached(ids, lambda n: op_name(n) in MATMUL_OPS)
    if gemm is None:
        return None
    for n in gemm.args[:2]:
        while isinstance(n, fx.Node) and n.args and isinstance(n.args[0], fx.Node) and (
                n in reach or op_name(n) in VIEW_OPS | {"repeat_interleave"} and not _token_rows(n, T)):
            n = n.args[0]
        if isinstance(n, fx.Node) and n not in reach and _token_rows(n, T) and (
                not _is_source(n) or n.op == "placeholder" and not _is_parameter(n)):
            return n
    return None


def _is_parameter(n: fx.Node) -> bool:
    """A graph input that Dynamo took from an `nn.Parameter` (its example value is one): a weight, never an
    activation (a module compiled alone takes its activation as a placeholder, as it takes its weights)."""
    return isinstance(n.meta.get("example_value", n.meta.get("val")), torch.nn.Parameter)


def _is_module_state(n: fx.Node) -> bool:
    """A graph input that Dynamo took from a module's parameters or buffers (it marks those as static inputs), never
    an activation; in a graph from elsewhere, parameters only."""
    return _is_parameter(n) or bool(n.meta.get("tensor_dict", {}).get("_dynamo_static_input_type"))


def _token_rows(n: fx.Node, T) -> bool:
    """A 2-D float tensor of T rows."""
    meta = tensor_meta(n)
    return meta is not None and meta.is_floating_point() and meta.dim() == 2 and same(meta.shape[0], T)
