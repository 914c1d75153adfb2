"""Report expert GEMMs that reach the compiler without their router, which cannot be fused.

The op fuses a router with its experts, so both must be in one graph. When Dynamo breaks the graph
between them, the experts arrive alone::

    graph 1:  linear ─ softmax ─ topk ─> (weights, ids) ──> output     [graph break: e.g. .tolist()]
    graph 2:  rows, expert ids, weights (inputs) ─ grouped_mm ─ act ─ grouped_mm ─ ... ──> output

transformers' all-to-all expert parallelism does this (it reads the all-to-all's split sizes back to the
host), and so does any host read between a router and its experts. A graph with no routing top-k but with
`grouped_mm` expert GEMMs gets one report per experts module (form "experts_alone"), so `explain` and the
log say why nothing was fused instead of saying nothing. So do per-expert GEMMs
``linear(rows.split(counts)[e], W[e])`` over slices of a stacked weight (JetMoE's loop over its rows split by each
expert's count): there the break is the counts' `.tolist()`, which Dynamo keeps in the graph with
``torch._dynamo.config.capture_scalar_outputs = True``, and the reason says so.

Hash routing has no top-k either: DeepSeek-V4's first layers look their experts up in a table by token id,

    table [vocab, K] (int) ─ index by input_ids ─> ids ──> sort ─ grouped_mm ─ ...  (batched_mm: W[ids] ─ bmm)

Where the ids also pick the router's scores (``scores.gather(1, ids)``), the block is anchored there and fused
with the ids as the op's `expert_ids` (`region.block_anchors`, which takes any ids computed from integers alone);
experts fed by any other lookup are reported as form "hash_routing".
"""

from __future__ import annotations

import os
import re

import torch.fx as fx

from .op_names import module_path, op_name
from .region import is_split_expert_gemm, is_table_lookup, looked_up_ids

FORM = "experts_alone"
REASON = ("expert GEMMs (grouped_mm) without a router in this graph: a graph break between the routing and the "
          "experts (such as the host read of transformers' all-to-all expert parallelism, or PEFT's LoRA on the "
          "expert weights run by PEFT's own forward, which registers a parametrization on each call, where Dynamo "
          "breaks the graph: with MOK_TRACE_PEFT=0, or adapters in a state `mok_compile.peft_experts` leaves to "
          "PEFT) split the block, and the op fuses a router with its experts (for inference, merge PEFT's adapters "
          "first: `model.merge_and_unload()`; a parametrization registered once, with torch.nn.utils.parametrize, "
          "fuses)")
SLICES_REASON = ("per-expert GEMMs over slices W[e] of stacked expert weights without a router in this graph: a "
                 "host read of the experts' token counts (`.tolist()`, as JetMoE's split sizes) split the block; set "
                 "torch._dynamo.config.capture_scalar_outputs = True to keep it in one graph")
HASH_FORM = "hash_routing"
HASH_REASON = ("expert ids are looked up in a table by token id (hash routing, as in DeepSeek-V4's first layers), "
               "and no router's scores are gathered at them in this graph: the op takes given ids with the router "
               "that weights them")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _where(node: fx.Node) -> str:
    """`node`'s place in the user's code, "file.py:line", from the last frame of its stack trace, else its name
    (graphs resumed after a break can lack module paths: transformers' EP calls the experts' bound forward)."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return node.name
    path, line = frames[-1]
    return f"{os.path.basename(path)}:{line}"


def _hash_routed(gm: fx.GraphModule, anchored) -> set[fx.Node]:
    """The nodes of the MoE block of a table lookup of ids (`region.is_table_lookup`) that depend on it, but for the
    lookups that anchor a block (their ids in `anchored`: `fuse_moe` fused or reported it): the lookup's
    module's siblings (the router "...mlp.gate" looks up, the experts "...mlp.experts" use the ids), or the whole
    graph where the block is the compiled module. Everything after the block depends on it too, later layers'
    experts included: the module path keeps to the block. Without module paths nothing is classed hash routed."""
    reached = set()
    for lookup in (n for n in gm.graph.nodes if is_table_lookup(n)):
        path = module_path(lookup)
        if path is None or looked_up_ids(lookup) in anchored:
            continue
        block = path.rsplit(".", 1)[0] + "." if "." in path else ""  # "": the block is the compiled module
        todo = [lookup]
        while todo:
            n = todo.pop()
            if n not in reached:
                reached.add(n)
                todo.extend(u for u in n.users if (module_path(u) or "").startswith(block))
    return reached


def find_lone_experts(gm: fx.GraphModule, hash_routed_only: bool = False, anchored=frozenset()) -> list:
    """BlockReports for the `grouped_mm` nodes of `gm` (a graph with no block anchor, or with `hash_routed_only`
    those fed by a table lookup whose ids anchor no block (`anchored`: the ids of the graph's anchors), in a graph
    whose anchored blocks are reported already): one per module that holds them, named by its path, and one for
    those without a module path (named by where the first is)."""
    from .fuse_moe import BlockReport

    hashed = _hash_routed(gm, anchored)
    modules: dict = {}  # module path (or None) -> (report name, its reason)
    for n in gm.graph.nodes:
        op = op_name(n)
        # batched_mm's experts are bmm's of gathered weights: counted only where a table lookup feeds them
        if n in hashed and op in ("grouped_mm", "bmm") or op == "grouped_mm" and not hash_routed_only:
            path = module_path(n)
            name, reason = modules.get(path, (path or f"expert GEMM at {_where(n)}", HASH_REASON))
            modules[path] = (name, reason if n in hashed else REASON)
        elif not hash_routed_only and is_split_expert_gemm(n):
            path = module_path(n)
            modules.setdefault(path, (path or f"expert GEMM at {_where(n)}", SLICES_REASON))
    return [BlockReport(name=name, fused=False, form=HASH_FORM if reason is HASH_REASON else FORM, reason=reason)
            for name, reason in modules.values()]
