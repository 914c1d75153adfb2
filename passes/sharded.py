"""Say why a MoE block sharded across ranks (tensor or expert parallelism) was left unfused.

transformers' tensor-parallel (``tp_plan``) and expert-parallel (``ep_plan``) experts hold a shard of the
weights on each rank (DTensor parameters, read through ``to_local``) and finish the block with a collective::

    router (whole, on every rank) ─ topk ─ [remap ids to this rank's experts, zero the others' weights]
        ─ experts(x, W.to_local()) ─ all_reduce ─> out

The op computes a whole block on one rank, so such a block is not fused; the region check then fails on
whichever sharding op it meets first (``to_local``, the autograd wrapper of a collective, the id remap),
which names the symptom, not the cause. This module finds the cause, a computation on the routed tokens
that reads a ``to_local`` shard inside the block's module, so the report can say it.
"""

from __future__ import annotations

import torch.fx as fx

from .dataflow import Dataflow
from .op_names import LAYOUT_OPS_NAMES, module_path, op_name

# How Dynamo writes DTensor.to_local: a method call (torch 2.13), or the traceable prim (torch 2.11).
_TO_LOCAL = ("to_local", "prim_to_local")
REASON = ("its experts are sharded across ranks (tensor or expert parallelism): mok fuses a block only when "
          "every expert's whole weights are on this rank, so it is compiled unfused")


def _shard_read(node: fx.Node) -> fx.Node | None:
    """The ``to_local`` whose value `node` reads, directly or through views and casts, or None."""
    work, seen = list(node.all_input_nodes), set()
    while work:
        n = work.pop()
        if n in seen:
            continue
        seen.add(n)
        name = op_name(n)
        if name in _TO_LOCAL:
            return n
        if name in LAYOUT_OPS_NAMES:
            work.extend(n.all_input_nodes)
    return None


def _within(path: str | None, block: str) -> bool:
    return path is not None and (not block or path == block or path.startswith(block + "."))


def sharding_evidence(gm: fx.GraphModule, anchor: fx.Node, ids: fx.Node) -> str | None:
    """"DTensor.to_local (node) in module" for the first node downstream of the block's `ids` (its anchor's: a
    top-k's, or given ids) that reads a DTensor shard, inside the module that holds the router's module (``mlp``
    for a router ``mlp.gate``; the router's own module where that is a top-level one), or None. Bounding by module
    keeps a later layer's shards, or the user's, out of this block's report."""
    router_path = module_path(anchor)
    if not router_path:
        return None
    block = router_path.rpartition(".")[0] or router_path
    in_block_shard = lambda m: _within(module_path(m), block) and _shard_read(m) is not None  # noqa: E731
    n, _ = Dataflow(gm.graph).first_reached(ids, in_block_shard)
    if n is None:
        return None
    shard = _shard_read(n)
    return f"DTensor.to_local ({shard.name}) in {module_path(shard) or module_path(n)}"


def sharded_reason(evidence: str, reason: str) -> str:
    """The report's reason for a sharded block: the cause, its evidence, then the check that failed."""
    return f"{REASON} ({evidence}; the check that failed: {reason})"
