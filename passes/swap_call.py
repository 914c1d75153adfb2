"""The post-grad passes' one edit: a call node replaced by another call with the same outputs, counted."""

from __future__ import annotations

import logging

import torch.fx as fx

log = logging.getLogger("mok_compile.passes")


def swap_call(graph: fx.Graph, node: fx.Node, target, args: tuple, kwargs: dict, val=None) -> fx.Node:
    """`target(*args, **kwargs)` in `node`'s place, its users and meta taken over (meta["val"] = `val` where the new
    call returns fewer outputs)."""
    with graph.inserting_before(node):
        new = graph.call_function(target, args, kwargs)
    new.meta.update(node.meta)
    if val is not None:
        new.meta["val"] = val
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


def count_swaps(counter: str, done: int, message: str) -> int:
    """Add `done` to `counters["mok"][counter]` and log `message % done` where any call was swapped."""
    if done:
        from torch._dynamo.utils import counters

        counters["mok"][counter] += done
        log.info(message, done)
    return done
