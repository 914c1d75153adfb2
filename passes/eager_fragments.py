"""Recognise the pieces of transformers' ``experts_implementation="eager"`` MoE, which cannot be fused.

The eager experts loop iterates over ``nonzero(expert_hit)``, a data-dependent
Python loop, so Dynamo breaks the graph there and the block arrives in pieces::

    graph 1 (router):   linear ─ softmax|sigmoid ─ topk ─> (weights, ids) ──> output   (ids dispatch nothing here)
    graph 2 (mask):     one_hot(ids, E + 1).permute(2, 1, 0) ─ sum ─ > 0 ──> output    (then: nonzero, break)
    graphs 3..:         one expert's activation, ...

No graph holds a whole block, so none can be rewritten; each piece is reported
(form "eager_fragment") with the one-line fix, so the user learns why nothing
was fused instead of getting a silent no-op.
"""

from __future__ import annotations

import torch.fx as fx

from .op_names import CAST_OPS, op_name
from .region import getitem_users

FIX = ('transformers\' eager experts loop breaks the graph at nonzero, so the MoE block reaches the compiler in '
       'pieces; fix: model.set_experts_implementation("grouped_mm") (or from_pretrained(..., '
       'experts_implementation="grouped_mm")) before torch.compile')


def _reaches_output(node: fx.Node, through=("permute", "sum", "gt", "greater", "view", "reshape")) -> bool:
    work, seen = [node], set()
    while work:
        n = work.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u.op == "output" or op_name(u) == "nonzero":
                return True
            if op_name(u) in through:
                work.append(u)
    return False


def _router_topk_leaving_graph(topk: fx.Node) -> bool:
    """A router top-k (over softmax/sigmoid/linear scores) whose expert ids are graph outputs."""
    n = topk.args[0]
    while isinstance(n, fx.Node) and op_name(n) in CAST_OPS | {"softmax", "sigmoid", "add", "masked_fill"}:
        n = n.args[0]
    if not (isinstance(n, fx.Node) and op_name(n) == "linear"):
        return False
    ids = getitem_users(topk, 1)
    return len(ids) == 1 and _reaches_output(ids[0], through=("view", "reshape"))


def find_eager_fragments(gm: fx.GraphModule, seen_topks=()) -> list:
    """BlockReports for pieces of an eager experts loop in `gm` (expert masks; router top-ks whose ids leave).

    `seen_topks`: top-ks already reported as candidate blocks (not reported twice)."""
    from .fuse_moe import BlockReport, _module_path

    reports = []
    for n in gm.graph.nodes:
        name = op_name(n)
        if name == "one_hot" and _reaches_output(n):
            reports.append(BlockReport(name=_module_path(n) or n.name, fused=False, form="eager_fragment",
                                       reason=f"expert mask {n.name} leaves the graph: {FIX}"))
        elif name == "topk" and n not in seen_topks and _router_topk_leaving_graph(n):
            reports.append(BlockReport(name=_module_path(n) or n.name, fused=False, form="eager_fragment",
                                       reason=f"router top-k {n.name} hands its expert ids to another graph: {FIX}"))
    return reports
