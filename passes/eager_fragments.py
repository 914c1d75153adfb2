"""Recognise the pieces of transformers' ``experts_implementation="eager"`` MoE, which cannot be fused.

The eager experts loop iterates over ``nonzero(expert_hit)``, a data-dependent
Python loop, so Dynamo breaks the graph there and the block arrives in pieces::

    graph 1 (router):   linear ─ softmax|sigmoid ─ topk ─> (weights, ids) ──> output   (ids dispatch nothing here)
    graph 2 (mask):     one_hot(ids, E + 1).permute(2, 1, 0) ─ sum ─ > 0 ──> output    (then: nonzero, break)
    graphs 3..:         one expert's activation, ...

No graph holds a whole block, so none can be rewritten. The expert mask
(graph 2) is the piece that identifies the form: it is reported (form
"eager_fragment") with the one-line fix, so the user learns why nothing was
fused instead of getting a silent no-op. The router piece is not reported: on
its own it looks exactly like top-k sampling over a vocabulary.
"""

from __future__ import annotations

import torch.fx as fx

from .op_names import module_path, op_name

FORM = "eager_fragment"
FIX = ('transformers\' eager experts loop breaks the graph at nonzero, so the MoE block reaches the compiler in '
       'pieces; fix: model.set_experts_implementation("grouped_mm") (or from_pretrained(..., '
       'experts_implementation="grouped_mm")) before torch.compile')


def _is_expert_mask(one_hot: fx.Node) -> bool:
    """one_hot(ids).permute(...) whose per-expert hit test (sum > 0, or nonzero) leaves the graph."""
    work, seen, names, leaves = [one_hot], set(), set(), False
    while work:
        n = work.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u.op == "output":
                leaves = True
            elif op_name(u) in ("permute", "sum", "gt", "greater", "nonzero", "view", "reshape"):
                names.add(op_name(u))
                work.append(u)
    return leaves and "permute" in names and bool(names & {"gt", "greater", "nonzero"})


def find_eager_fragments(gm: fx.GraphModule) -> list:
    """BlockReports for the expert masks of eager experts loops in `gm`."""
    from .fuse_moe import BlockReport

    reports = []
    for n in gm.graph.nodes:
        name = op_name(n)
        if name == "one_hot" and _is_expert_mask(n):
            reports.append(BlockReport(name=module_path(n) or n.name, fused=False, form=FORM,
                                       reason=f"expert mask {n.name} leaves the graph: {FIX}"))
    return reports
