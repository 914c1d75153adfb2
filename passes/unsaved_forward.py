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

import operator

import torch
import torch.fx as fx

from .swap_call import count_swaps, swap_call

COMMON_OUTPUTS = 3  # out, topk_weights, topk_ids: the inference op's outputs, the training op's first three


def inference_where_unsaved(graph: fx.Graph) -> int:
    """Rewrite every `fused_moe_train` that only its first three outputs are read from; returns how many."""
    train = torch.ops.mok.fused_moe_train.default
    done = 0
    for node in list(graph.nodes):
        if node.target is train and _reads_common_outputs_only(node):
            val = node.meta.get("val")
            swap_call(graph, node, torch.ops.mok.fused_moe.default, node.args, node.kwargs,
                      val=None if val is None else tuple(val[:COMMON_OUTPUTS]))
            done += 1
    return count_swaps("unsaved_forward", done, "mok: %d compiled forward(s) skip the saved tensors no backward reads")


def _reads_common_outputs_only(node: fx.Node) -> bool:
    return all(user.target is operator.getitem and isinstance(user.args[1], int) and user.args[1] < COMMON_OUTPUTS
               for user in node.users)
