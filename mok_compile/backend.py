"""The `mok` torch.compile backend: fuse MoE blocks, then hand the graph on.

    torch.compile(model, backend="mok", options={"compiler": "inductor", "validate": True, "strict": False})

Dynamo calls `mok_backend(gm, example_inputs, options=..., mode=...)` with a
torch-level FX graph. The MoE rewrite (`mok_compile.passes.fuse_moe`) runs on
that graph, *before* AOT autograd, so AOT autograd sees one
`mok.fused_moe` node and training runs the op's own fused backward. The
rewritten graph then goes to the inner compiler exactly as `backend="inductor"`
(or `"aot_eager"`) would receive it, so a graph without MoE compiles to the
same code as plain inductor.

Registered by name through the `torch_dynamo_backends` entry point in
pyproject.toml (`mok = "mok_compile.backend:mok_backend"`); from a checkout
that is not installed, `import mok_compile` registers the name.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Callable, Sequence

import torch
from torch._dynamo.utils import counters

from . import ddp, diagnostics, peft_experts
from .config import BackendOptions, parse_options

log = logging.getLogger("mok_compile.backend")
diagnostics.configure_logging()


def mok_backend(gm: torch.fx.GraphModule, example_inputs: Sequence, *, options: dict | None = None,
                mode: str | None = None) -> Callable:
    """Dynamo backend: rewrite every provable MoE block of `gm`, then compile with the inner compiler."""
    opts = parse_options(options, mode)
    peft_experts.install()  # (for the compiles after this one, where PEFT was imported after this module)
    report = fuse_graph(gm, example_inputs, opts)
    diagnostics.warn_untraced_checkpoints()
    if ddp.cut_by_dynamo(gm):
        diagnostics.warn_ddp_cuts(ddp.cut_blocks(gm, report))
    bucket_cap = ddp.bucket_cap_to_apply() if opts.ddp_buckets else None
    if bucket_cap is not None:
        compiled, pieces = ddp.compile_in_buckets(gm, example_inputs, bucket_cap,
                                                  lambda piece, inputs: compile_inner(piece, inputs, opts))
        counters["mok"]["ddp_pieces"] += pieces
        log.info("mok: graph %s cut into %d piece(s) at DDP's %d-byte buckets", _graph_name(gm), pieces, bucket_cap)
        return compiled
    return compile_inner(gm, example_inputs, opts)


def fuse_graph(gm: torch.fx.GraphModule, example_inputs: Sequence, opts: BackendOptions = BackendOptions()):
    """Run the MoE pass on `gm` in place; return its FuseReport (None if the pass itself failed).

    The pass never raises for a block it cannot prove (it reports it). An
    exception from it is a bug in the pass: unless `strict`, the graph is put
    back as it was and compiled without fusion, so a user's compile never
    fails because of us.
    """
    from mok_compile.passes import fuse_moe

    saved = []  # the graph before the pass's first change: a graph it leaves alone (no MoE) is never copied

    def before_rewrite():
        if not opts.strict and not saved:
            saved.append(snapshot_graph(gm.graph))

    try:
        with _unseen_by_saved_tensor_hooks():
            report = fuse_moe(gm, example_inputs, validate=opts.validate, strict=opts.strict,
                              before_rewrite=before_rewrite)
    except Exception as err:
        if opts.strict:
            raise
        log.warning("mok: the MoE pass failed on graph %s (%s: %s); compiling it unfused. "
                    "MOK_LOG_LEVEL=DEBUG shows the traceback.", _graph_name(gm), type(err).__name__, err)
        log.debug("mok: MoE pass traceback", exc_info=True)
        if saved:  # otherwise the pass failed before changing anything
            gm.graph = saved[0]
            gm.recompile()
        return None
    if report.blocks:
        log.info("mok: graph %s: fused %d of %d MoE block(s)", _graph_name(gm), len(report.fused), len(report.blocks))
    diagnostics.warn_eager_fragments(report)
    return report


def _unseen_by_saved_tensor_hooks():
    """Keep the pass's own autograd work (the fake op calls that set a new node's `meta["val"]`) from the caller's
    saved-tensor hooks.

    A model compiled per layer and checkpointed around the compiled call (transformers < 5.25 checkpoints each
    layer's `__call__`) compiles inside the checkpoint's first forward. Its hooks count every tensor autograd saves;
    the fake tensors the pass saved there made the count differ from the recomputation's, and the backward failed
    with `CheckpointError`. Identity hooks pushed on top shadow the caller's for the pass's duration. Where saved-
    tensor hooks are disabled (inside a torch.func transform), none are active and none can be pushed.
    """
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


def _same(tensor):
    return tensor


def snapshot_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of `graph` that can replace it later, Dynamo's node attributes included.

    `copy.deepcopy` copies node meta but not attributes Dynamo sets on nodes
    (a placeholder's `_dynamo_source`, which AOT autograd reads), so those are
    carried over by hand.
    """
    snapshot = copy.deepcopy(graph)
    originals = {node.name: node for node in graph.nodes}  # graph_copy keeps node names
    for new in snapshot.nodes:
        for key, value in vars(originals[new.name]).items():
            vars(new).setdefault(key, value)
    return snapshot


def compile_inner(gm: torch.fx.GraphModule, example_inputs: Sequence, opts: BackendOptions) -> Callable:
    """Hand `gm` to the inner compiler, the way `torch.compile(backend=opts.compiler)` would."""
    if opts.compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx

        patches = opts.inductor_patches()
        cudagraphs = bool(patches.get("triton.cudagraphs"))
        if cudagraphs:
            _state["used_cudagraphs"] = True
        if _has_fused_moe(gm):  # `passes.post_grad`: a compiled backward writes dh over the saved h (as eager
            # does; not under CUDA graphs), a forward whose saved tensors nobody reads skips them
            from torch._inductor import config as inductor_config

            from mok_compile.passes.post_grad import MokPostGradPass

            user_pass = patches.get("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass)
            patches["post_grad_custom_post_pass"] = MokPostGradPass(consume=not cudagraphs, then=user_pass)
        return compile_fx(gm, example_inputs, config_patches=patches)
    if opts.compiler == "aot_eager":
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)
    return gm.forward


def _has_fused_moe(gm: torch.fx.GraphModule) -> bool:
    """Whether `gm` calls mok.fused_moe, itself or in a body it runs (an activation-checkpointed region): put
    there by the rewrite (the overload) or by the user (Dynamo records the packet, `torch.ops.mok.fused_moe`)."""
    op = torch.ops.mok.fused_moe
    return any(node.target is op or node.target is op.default
               for module in gm.modules() if isinstance(module, torch.fx.GraphModule) for node in module.graph.nodes)


_state = {"used_cudagraphs": False}


def _reset():
    """Called by `torch._dynamo.reset()`: drop the cudagraph trees a `reduce-overhead` compile made (as inductor does)."""
    if _state["used_cudagraphs"]:
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        reset_cudagraph_trees()
        _state["used_cudagraphs"] = False


mok_backend.reset = _reset


def _graph_name(gm: torch.fx.GraphModule) -> str:
    return getattr(gm, "_mok_name", None) or type(gm).__name__
