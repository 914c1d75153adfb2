"""A compiled forward's training op whose saved tensors nobody reads runs as the inference op (post-grad, inductor).

    before:  fused_moe_train(x, ...) ──> out, topk_weights, topk_ids (read)    h, logits, layout, y (unread)
    after:   fused_moe(x, ...)       ──> out, topk_weights, topk_ids

Under activation checkpointing, aot_autograd's forward graph runs the checkpointed region, the fused op's training
forward in it, and keeps only the region's inputs for the backward, which runs the region again. The training
forward would still write h ([T*K, 2I]) and the router logits and routing layout for its backward: the GEMM that
writes h runs 15-30% longer (NOTES v43 (1)), and nothing reads them. Both ops take the same arguments and compute
their common outputs with the same kernels, so the rewrite changes no bits.
Counted in `counters["mok"]["unsaved_forward"]`.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

log = logging.getLogger("mok_compile.passes")

COMMON_OUTPUTS = 3  # out, topk_weights, topk_ids: the inference op's outputs, the training op's first three


def inference_where_unsaved(graph: fx.Graph) -> int:
    """Rewrite every `fused_moe_train` that only its first three outputs are read from; returns how many."""
    train = torch.ops.mok.fused_moe_train.default
    done = 0
    for node in list(graph.nodes):
        if node.target is not train or not _reads_common_outputs_only(node):
            continue
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.mok.fused_moe.default, node.args, node.kwargs)
        new.meta.update(node.meta)
        if "val" in node.meta:
            new.meta["val"] = tuple(node.meta["val"][:COMMON_OUTPUTS])
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        done += 1
    if done:
        from torch._dynamo.utils import counters

        counters["mok"]["unsaved_forward"] += done
        log.info("mok: %d compiled forward(s) skip the saved tensors no backward reads", done)
    return done


def _reads_common_outputs_only(node: fx.Node) -> bool:
    return all(user.target is operator.getitem and isinstance(user.args[1], int) and user.args[1] < COMMON_OUTPUTS
               for user in node.users)
