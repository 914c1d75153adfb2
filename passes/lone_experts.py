"""Report expert GEMMs that reach the compiler without their router, which cannot be fused.

The op fuses a router with its experts, so both must be in one graph. When Dynamo breaks the graph
between them, the experts arrive alone::

    graph 1:  linear ─ softmax ─ topk ─> (weights, ids) ──> output     [graph break: e.g. .tolist()]
    graph 2:  rows, expert ids, weights (inputs) ─ grouped_mm ─ act ─ grouped_mm ─ ... ──> output

transformers' all-to-all expert parallelism does this (it reads the all-to-all's split sizes back to the
host), and so does any host read between a router and its experts. A graph with no routing top-k but with
`grouped_mm` expert GEMMs gets one report per experts module (form "experts_alone"), so `explain` and the
log say why nothing was fused instead of saying nothing.
"""

from __future__ import annotations

import os
import re

import torch.fx as fx

from .op_names import module_path, op_name

FORM = "experts_alone"
REASON = ("expert GEMMs (grouped_mm) without a router in this graph: a graph break between the routing and the "
          "experts (such as the host read of transformers' all-to-all expert parallelism) split the block, and "
          "the op fuses a router with its experts")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _where(node: fx.Node) -> str:
    """`node`'s place in the user's code, "file.py:line", from the last frame of its stack trace, else its name
    (graphs resumed after a break can lack module paths: transformers' EP calls the experts' bound forward)."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return node.name
    path, line = frames[-1]
    return f"{os.path.basename(path)}:{line}"


def find_lone_experts(gm: fx.GraphModule) -> list:
    """BlockReports for the `grouped_mm` nodes of `gm` (a graph with no routing top-k): one per module that
    holds them, named by its path, and one for those without a module path (named by where the first is)."""
    from .fuse_moe import BlockReport

    names: dict = {}  # module path (or None) -> report name
    for n in gm.graph.nodes:
        if op_name(n) == "grouped_mm":
            path = module_path(n)
            names.setdefault(path, path or f"expert GEMM at {_where(n)}")
    return [BlockReport(name=name, fused=False, form=FORM, reason=REASON) for name in names.values()]
