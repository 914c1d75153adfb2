"""GPU kernels of `mok::fused_moe` (Triton), registered for the CUDA dispatch key.

Importing this package only registers thin CUDA entry points; Triton and the
kernel modules are imported on the first CUDA call, so `import mok_compile`
stays free of Triton. Where Triton cannot be imported, the CUDA entry points
run the reference after one warning; fp64 inputs always run the reference
(a Triton fp64 path is not worth its code).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from ..ops import library, reference
from ..ops.spec import with_defaults


@functools.cache
def _kernels():
    """The Triton implementation module, or None (after one warning) if Triton is unusable."""
    try:
        from . import moe
    except Exception as err:  # ImportError, or a Triton that fails on this machine
        warnings.warn(f"mok_compile: Triton kernels unavailable ({err!r}); mok.fused_moe runs the slow "
                      "reference implementation on CUDA", RuntimeWarning, stacklevel=3)
        return None
    return moe


def _use_triton(x):
    return x.dtype != torch.float64 and _kernels() is not None


def fused_moe_cuda(*args, **kw):
    if not _use_triton(args[0]):
        return reference.fused_moe_reference(*args, **library.checked_kwargs(args, kw))
    return _kernels().fused_moe_forward(*args, **kw)  # checks its inputs (`moe._forward`)


def saves_gate_up(x, gate_up_proj, down_proj, kw) -> bool:
    """Whether autograd runs `mok::fused_moe_train` on CUDA (see `library._saves_gate_up`), which also
    returns h = x @ W1 per pair so that the backward reads h instead of recomputing the gate_up GEMM
    (a third of the forward's FLOPs and, at few tokens, a second read of all of W1): the Triton kernels."""
    return library.may_save_gate_up(x, kw) and _use_triton(x)


def fused_moe_train_cuda(*args, **kw):
    kw = with_defaults(kw)
    if not saves_gate_up(args[0], args[4], args[6], kw):
        raise RuntimeError("mok::fused_moe_train is for the autograd of mok::fused_moe where "
                           "mok_compile.kernels.saves_gate_up holds (Triton kernels, not weight-on-input)")
    return _kernels().fused_moe_forward(*args, save_gate_up=True, **kw)


def fused_moe_backward_cuda(grad_out, grad_topk_weights, hidden_states, *rest, **kw):
    kw = with_defaults(kw)
    if not _use_triton(hidden_states):
        return reference.fused_moe_backward_reference(grad_out, grad_topk_weights, hidden_states, *rest, **kw)
    return _kernels().fused_moe_backward(grad_out, grad_topk_weights, hidden_states, *rest, **kw)


def fused_moe_backward_consume_cuda(grad_out, grad_topk_weights, hidden_states, *rest, **kw):
    """The backward over a saved h that is dead afterwards: the kernels write dh over it (with
    `if_graph_freed`, only if this call's autograd graph task frees its graph; else they read it). Where they do,
    the spent weights (`spent_gate_up_proj`, `spent_down_proj`) that hold their memory alone are freed once read."""
    *rest, gate_up_out = rest
    kw = with_defaults(kw)
    spent = [kw.pop(name, None) for name in library.SPENT_KWARGS]  # gate_up_proj's, down_proj's
    overwrite = library.graph_is_freed() if kw.pop("if_graph_freed", False) else True
    if not _use_triton(hidden_states):
        return reference.fused_moe_backward_reference(grad_out, grad_topk_weights, hidden_states, *rest, **kw)
    weights = (rest[3], rest[5])
    if overwrite and spent != [None, None] and weights[0] is not weights[1] and frees_spent_weights():
        # (one tensor as both weights is kept)
        freed = tuple(name for name, t, w in zip(("gate_up_proj", "down_proj"), spent, weights)
                      if t is w and sole_owner(t))
        if freed:
            kw["spent_weights"] = freed
    return _kernels().fused_moe_backward(grad_out, grad_topk_weights, hidden_states, *rest, **kw,
                                         gate_up_out=gate_up_out, overwrite_gate_up_out=overwrite)


def frees_spent_weights() -> bool:
    """Whether spent weights are freed: on unless `MOK_SPENT_WEIGHTS=0` (checked on a GPU in v80); off, they are only
    read, as before v79."""
    return os.environ.get("MOK_SPENT_WEIGHTS", "1") != "0"


def sole_owner(t: torch.Tensor) -> bool:
    """Whether `t` alone holds its memory: no view of another tensor, and no other tensor on its storage (the count
    includes the storage object made to ask it)."""
    return t._base is None and torch._C._storage_Use_Count(t.untyped_storage()._cdata) == 2


library.impl_backend_kernels("CUDA", {
    "fused_moe": fused_moe_cuda, "fused_moe_backward": fused_moe_backward_cuda,
    "fused_moe_train": fused_moe_train_cuda, "fused_moe_backward_consume": fused_moe_backward_consume_cuda})
