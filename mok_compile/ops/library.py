"""The `mok` op library: schema, input checks, fake kernels and autograd.

`torch.ops.mok.fused_moe` computes router + experts of one MoE block in one
call. Its output shapes depend only on input shapes (never on routing data), so
it needs no host synchronisation and traces under dynamic shapes.

    out, topk_weights, topk_ids = torch.ops.mok.fused_moe(
        hidden_states [T, H], router [E, H] (or logits [T, E]), router_bias [E]?,
        selection_bias [E]?, gate_up_proj [E, 2I, H], gate_up_bias [E, 2I]?,
        down_proj [E, H, I], down_bias [E, H]?, *, top_k, routing, ...)

Device kernels attach per dispatch key: the reference (`reference.py`) is the
CompositeExplicitAutograd kernel every device falls back to, `cpu.py` overrides
CPU with the C++ kernel and `mok_compile.kernels` overrides CUDA with Triton.
The backward is its own op, `mok::fused_moe_backward`, with the same structure; with the CUDA and
C++ kernels the autograd forward runs `mok::fused_moe_train`, the same op plus the h its backward
reads, and the backward autograd runs last (graph not retained) is `mok::fused_moe_backward_consume`,
which may write dh over that h and then free it.
New features (shared experts, dense weight-on-input routing, given expert ids, capacity limits)
are added as trailing keyword arguments with defaults, which keeps old graphs
and serialized programs valid (an argument's type is never changed: code that
spells out its old value would run against the new type). Inductor's cached
code spells out every argument, so its cache is keyed on `SCHEMAS`
(`passes.post_grad`).
"""

from __future__ import annotations

import functools
import operator
import os

import torch

from . import reference
from .spec import GROUPED_ROUTINGS, ROUTINGS, ExpertSpec, weights_rounding_error, with_defaults

_SCALARS = (
    "int top_k, str routing='softmax_topk', bool router_is_logits=False, bool router_fp32=False, "
    "bool softmax_fp32=True, bool renormalize=False, float renorm_eps=0.0, float routed_scale=1.0, "
    "int n_group=1, int topk_group=1, bool weights_fp32=True, str activation='silu', bool gated=True, "
    "bool interleaved=False, bool transposed=False, float alpha=1.702, float limit=7.0, bool weight_on_input=False, "
    "float renorm_min=0.0, int group_top=2, int identity_experts=0, int zero_experts=0, float jitter_eps=0.0, "
    "bool round_weights=False, str post_norm='none', float post_norm_eps=1e-06, float post_norm_offset=0.0, "
    "ScalarType? round_weights_to=None"
)
_WEIGHTS = (
    "Tensor router, Tensor? router_bias, Tensor? selection_bias, Tensor gate_up_proj, Tensor? gate_up_bias, "
    "Tensor down_proj, Tensor? down_bias"
)
# `expert_ids` [T, top_k] (forward only): the experts each token goes to, given (DeepSeek-V4's hash routing looks
# them up by token id) instead of chosen by the top-k; the weights are then the routing's values at these ids. Ids
# may repeat within a row (each slot is its own pair). The backward reads the forward's topk_ids, which equal them.
_GIVEN_IDS = "Tensor? expert_ids=None"
# `expert_scale` [E]: a learned per-expert factor of the routing weights (Gemma 4's `per_expert_scale`): each
# pair's weight, after the renormalisation and `routed_scale`, is multiplied by its expert's value (in the weights'
# accumulation dtype, before their cast). It has a gradient: the backward's `grad_expert_scale`.
_EXPERT_SCALE = "Tensor? expert_scale=None"
# `post_norm_weight` [H] or [E, H] (one row per expert): the weight of the post-expert norm (`post_norm`, see
# `ExpertSpec`), needed where it is not "none"; it has a gradient: the backward's `grad_post_norm_weight`.
_POST_NORM_WEIGHT = "Tensor? post_norm_weight=None"
_LEARNED_SCHEMA = f"{_EXPERT_SCALE}, {_POST_NORM_WEIGHT}"
LEARNED_KWARGS = ("expert_scale", "post_norm_weight")  # the keyword tensors with a gradient (autograd's inputs)
FUSED_MOE_SCHEMA = (
    f"fused_moe(Tensor hidden_states, {_WEIGHTS}, *, {_SCALARS}, {_GIVEN_IDS}, {_LEARNED_SCHEMA}) "
    "-> (Tensor out, Tensor topk_weights, Tensor topk_ids)"
)
# `gate_up_out`: h = x @ W1 per pair in expert-sorted order (before bias and activation), saved by
# `fused_moe_train`; when given, the CUDA and C++ backwards read it instead of recomputing that GEMM
# (the reference ignores it).
# `router_logits`, `routing_layout`: the logits and the expert-sorted dispatch layout, saved by `fused_moe_train`
# on CUDA; given, the CUDA backward skips the router GEMM and count, scan and scatter (others ignore them).
_SAVED_ROUTING = "Tensor? router_logits=None, Tensor? routing_layout=None"
# `post_norm_input`: with a post-expert norm, its input y per pair in expert-sorted order, saved by `fused_moe_train`
# on CUDA; given, the CUDA backward skips the down GEMM that recomputes it (others ignore it).
_SAVED_NORM_INPUT = "Tensor? post_norm_input=None"
_GRADS = (
    "(Tensor grad_hidden_states, Tensor grad_router, Tensor? grad_router_bias, Tensor grad_gate_up_proj, "
    "Tensor? grad_gate_up_bias, Tensor grad_down_proj, Tensor? grad_down_bias, Tensor? grad_expert_scale, "
    "Tensor? grad_post_norm_weight)"
)
FUSED_MOE_BACKWARD_SCHEMA = (
    f"fused_moe_backward(Tensor grad_out, Tensor? grad_topk_weights, Tensor hidden_states, {_WEIGHTS}, "
    f"Tensor topk_weights, Tensor topk_ids, *, {_SCALARS}, Tensor? gate_up_out=None, {_SAVED_ROUTING}, "
    f"{_LEARNED_SCHEMA}, {_SAVED_NORM_INPUT}) -> {_GRADS}"
)

# The forward autograd runs when gradients are needed (`_saves_gate_up`: CUDA and CPU kernels): also
# returns h, so that the backward does not recompute the gate_up GEMM, and (`keeps_routing`: CUDA) the
# router logits ([0, E] where the router argument is the logits), the dispatch layout and with a post-expert
# norm its input y ([0, H] without one: `saves_norm_input`); the C++ kernel, whose backward recomputes its own,
# returns the last three empty.
FUSED_MOE_TRAIN_SCHEMA = (
    f"fused_moe_train(Tensor hidden_states, {_WEIGHTS}, *, {_SCALARS}, {_GIVEN_IDS}, {_LEARNED_SCHEMA}) "
    "-> (Tensor out, Tensor topk_weights, Tensor topk_ids, Tensor gate_up_out, Tensor router_logits, "
    "Tensor routing_layout, Tensor post_norm_input)"
)

# The backward that consumes the saved h: it may write dh over it (same shape), so that it needs no second [T*K, 2I]
# buffer, and release its memory once dh is read (the CUDA kernels resize its storage to 0; gate_up_out must not be
# used afterwards); a saved post-norm input likewise takes dy. Autograd's eager backward calls it when the graph is
# freed after this backward (h is dead). `if_graph_freed`: decide that at run time instead, from the autograd graph
# task running the call (the compiled backward, `passes.backward_consume`): without one, or under retain_graph, h is
# only read.
# `spent_gate_up_proj`, `spent_down_proj`: the call's own `gate_up_proj` / `down_proj` again, given where that weight is
# a tensor the graph computed for this block alone (a LoRA delta added, experts stacked) and saved for this backward
# only: with h, the CUDA kernels then free its memory once read, before the weight gradients are made (the compiled
# backward otherwise holds both weights and both their gradients at once), unless `MOK_SPENT_WEIGHTS=0`
# (`kernels.frees_spent_weights`). Ignored elsewhere, as h's overwrite is.
FUSED_MOE_BACKWARD_CONSUME_SCHEMA = (
    f"fused_moe_backward_consume(Tensor grad_out, Tensor? grad_topk_weights, Tensor hidden_states, {_WEIGHTS}, "
    f"Tensor topk_weights, Tensor topk_ids, Tensor(a!) gate_up_out, *, {_SCALARS}, bool if_graph_freed=False, "
    f"{_SAVED_ROUTING}, {_LEARNED_SCHEMA}, Tensor(b!)? post_norm_input=None, Tensor(c!)? spent_gate_up_proj=None, "
    f"Tensor(d!)? spent_down_proj=None) -> {_GRADS}"
)
SPENT_KWARGS = ("spent_gate_up_proj", "spent_down_proj")  # weights that a consuming backward may free

# Inductor writes every argument of a call into the code it caches, so `passes.post_grad` keys that cache on these.
SCHEMAS = (FUSED_MOE_SCHEMA, FUSED_MOE_BACKWARD_SCHEMA, FUSED_MOE_TRAIN_SCHEMA, FUSED_MOE_BACKWARD_CONSUME_SCHEMA)

lib = torch.library.Library("mok", "DEF")
for _schema in SCHEMAS:
    lib.define(_schema)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _fail(msg: str):
    raise ValueError(f"mok.fused_moe: {msg}")


def _check(cond, msg: str):
    """torch._check keeps symbolic shapes symbolic; the message names the argument."""
    torch._check(cond, lambda: f"mok.fused_moe: {msg}")


def check_inputs(hidden_states, router, router_bias, selection_bias, gate_up_proj, gate_up_bias, down_proj,
                 down_bias, **kw):
    """Validate shapes, dtypes and layouts; return (T, H, E, I). Shared by every kernel and the fake."""
    kw = with_defaults(kw)
    top_k, routing, router_is_logits, router_fp32 = kw["top_k"], kw["routing"], kw["router_is_logits"], kw["router_fp32"]
    n_group, topk_group, gated, transposed = kw["n_group"], kw["topk_group"], kw["gated"], kw["transposed"]
    activation = kw["activation"]
    x = hidden_states
    if x.dim() != 2:
        _fail(f"hidden_states must be 2-D [T, H], got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        _fail(f"hidden_states has unsupported dtype {x.dtype}; use float32, bfloat16, float16 or float64")
    T, H = x.shape
    for name, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if w.dim() != 3:
            _fail(f"{name} must be 3-D [E, ., .], got shape {tuple(w.shape)}")
        if w.dtype != x.dtype:
            _fail(f"{name} dtype {w.dtype} differs from hidden_states dtype {x.dtype}")
    E = gate_up_proj.shape[0]
    for name in ("identity_experts", "zero_experts"):
        if kw[name] < 0:
            _fail(f"{name} must be >= 0, got {kw[name]}")
    if kw["identity_experts"] and kw["zero_experts"]:
        _fail("identity_experts and zero_experts cannot be combined: the op has one kind of choice past the experts")
    Z = kw["identity_experts"] + kw["zero_experts"]
    R = E + Z  # the router's choices: the experts, then the identity (or zero) experts
    if down_proj.shape[0] != E:
        _fail(f"down_proj has {down_proj.shape[0]} experts but gate_up_proj has {E}")
    up_out = 2 if gated else 1
    if transposed:  # [E, H, 2I] and [E, I, H]
        gu_in, gu_out = gate_up_proj.shape[1], gate_up_proj.shape[2]
        I = down_proj.shape[1]
        down_shape_ok = down_proj.shape[2] == H
        layout = "transposed layout [E, H, 2I] / [E, I, H]"
    else:  # [E, 2I, H] and [E, H, I]
        gu_out, gu_in = gate_up_proj.shape[1], gate_up_proj.shape[2]
        I = down_proj.shape[2]
        down_shape_ok = down_proj.shape[1] == H
        layout = "F.linear layout [E, 2I, H] / [E, H, I]"
    expected_gu = f"[{E}, {up_out}*{I}, {H}]" if not transposed else f"[{E}, {H}, {up_out}*{I}]"
    if gu_in != H or gu_out != up_out * I:
        _fail(f"gate_up_proj has shape {tuple(gate_up_proj.shape)}, expected {expected_gu} ({layout}, "
              f"gated={gated}); is the weight layout (transposed={transposed}) right?")
    if not down_shape_ok:
        _fail(f"down_proj has shape {tuple(down_proj.shape)}, which does not match hidden size {H} in the "
              f"{layout}; is the weight layout (transposed={transposed}) right?")
    if gate_up_bias is not None and tuple(gate_up_bias.shape) != (E, up_out * I):
        _fail(f"gate_up_bias must have shape [{E}, {up_out * I}], got {tuple(gate_up_bias.shape)}")
    if down_bias is not None and tuple(down_bias.shape) != (E, H):
        _fail(f"down_bias must have shape [{E}, {H}], got {tuple(down_bias.shape)}")
    if router_is_logits:
        if router.dim() != 2 or router.shape[1] != R:
            _fail(f"router (logits) must be [T, {R}]{_choices(E, kw)}, got shape {tuple(router.shape)}")
        _check(router.shape[0] == T, f"router logits have {router.shape[0]} rows but hidden_states has {T}")
        if router_bias is not None:
            _fail("router_bias must be None when router_is_logits=True")
    else:
        if router.dim() != 2 or tuple(router.shape) != (R, H):
            _fail(f"router weight must be [{R}, {H}]{_choices(E, kw)}, got shape {tuple(router.shape)}")
        if not router_fp32 and router.dtype != x.dtype:
            _fail(f"router dtype {router.dtype} differs from hidden_states dtype {x.dtype}; "
                  "pass router_fp32=True for an fp32 router")
        if router_bias is not None and tuple(router_bias.shape) != (R,):
            _fail(f"router_bias must have shape [{R}], got {tuple(router_bias.shape)}")
    if router.dtype not in _FLOAT_DTYPES:
        _fail(f"router has unsupported dtype {router.dtype}")
    if router_bias is not None and router_bias.dtype != router.dtype:
        _fail(f"router_bias dtype {router_bias.dtype} differs from router dtype {router.dtype}")
    for name, b, w in (("gate_up_bias", gate_up_bias, "gate_up_proj"), ("down_bias", down_bias, "down_proj")):
        if b is not None and b.dtype != x.dtype:
            _fail(f"{name} dtype {b.dtype} differs from {w} dtype {x.dtype}")
    if selection_bias is not None:
        if tuple(selection_bias.shape) != (R,):
            _fail(f"selection_bias must have shape [{R}], got {tuple(selection_bias.shape)}")
        if selection_bias.dtype not in _FLOAT_DTYPES:
            _fail(f"selection_bias has unsupported dtype {selection_bias.dtype}")
    if not 0.0 <= kw["renorm_min"] < float("inf"):
        _fail(f"renorm_min must be a finite number >= 0, got {kw['renorm_min']}")
    if n_group != 1 and routing not in GROUPED_ROUTINGS:
        _fail(f"n_group={n_group} (group-limited routing) is only supported with routing in {GROUPED_ROUTINGS}")
    if not 0.0 <= kw["jitter_eps"] < float("inf"):
        _fail(f"jitter_eps must be a finite number >= 0, got {kw['jitter_eps']}")
    if routing == "sparsemixer" and (selection_bias is not None or kw.get("expert_ids") is not None):
        _fail("routing='sparsemixer' chooses by its own masks: selection_bias and expert_ids must not be set")
    rounding_error = weights_rounding_error(kw["round_weights"], kw["round_weights_to"], kw["weights_fp32"])
    if rounding_error:
        _fail(rounding_error)
    if kw["group_top"] not in (1, 2):
        _fail(f"group_top must be 1 (group max) or 2 (sum of the top 2), got {kw['group_top']}")
    for name, t in (("router", router), ("router_bias", router_bias), ("selection_bias", selection_bias),
                    ("gate_up_proj", gate_up_proj), ("gate_up_bias", gate_up_bias), ("down_proj", down_proj),
                    ("down_bias", down_bias)):
        if t is not None and t.device != x.device:
            _fail(f"{name} is on {t.device} but hidden_states is on {x.device}")
    if not 1 <= top_k <= R:
        _fail(f"top_k={top_k} must be between 1 and the number of experts E={R}{_choices(E, kw)}")
    if kw.get("expert_ids") is not None:
        _check_expert_ids(kw["expert_ids"], x, top_k, selection_bias, n_group)
    if kw.get("expert_scale") is not None:
        _check_expert_scale(kw["expert_scale"], x, E, kw["weight_on_input"])
        if Z:
            _fail(f"expert_scale is not supported with {_past_name(kw)}")
    if kw["post_norm"] != "none" or kw.get("post_norm_weight") is not None:
        _check_post_norm(kw.get("post_norm_weight"), x, E, down_bias, kw)
    if Z and kw["weight_on_input"]:
        _fail(f"{_past_name(kw)} is not supported with weight_on_input=True")
    if routing not in ROUTINGS:
        _fail(f"routing={routing!r} is not supported; use one of {ROUTINGS}")
    if n_group > 1:
        if R % n_group != 0 or R // n_group < kw["group_top"]:
            _fail(f"n_group={n_group} must divide E={R} into groups of at least {kw['group_top']} experts "
                  f"(group_top={kw['group_top']})")
        if not 1 <= topk_group <= n_group or top_k > topk_group * (R // n_group):
            _fail(f"topk_group={topk_group} (n_group={n_group}) leaves fewer than top_k={top_k} experts")
    try:
        ExpertSpec(activation=activation, gated=gated, interleaved=kw["interleaved"], post_norm=kw["post_norm"],
                   post_norm_eps=kw["post_norm_eps"])
    except ValueError as err:
        _fail(str(err))
    if activation == "softcapped_swiglu" and gated and not (kw["alpha"] > 0 and kw["limit"] > 0):
        _fail(f"softcapped_swiglu divides by its caps: alpha (the gate's) and limit (up's) must be > 0, got "
              f"{kw['alpha']} and {kw['limit']}")
    return T, H, E, I


def _past_name(kw) -> str:
    """The argument naming the router's choices past the experts (error messages)."""
    return "zero_experts" if kw["zero_experts"] else "identity_experts"


def _choices(E, kw) -> str:
    """How a router width is made up, where identity or zero experts add to it (error messages)."""
    Z = kw["identity_experts"] + kw["zero_experts"]
    return f" ({E} experts + {Z} {_past_name(kw).replace('_', ' ')})" if Z else ""


def routing_width(gate_up_proj, kw) -> int:
    """The router's choices: the experts, then `identity_experts` or `zero_experts` more (the logits' width)."""
    return gate_up_proj.shape[0] + kw["identity_experts"] + kw["zero_experts"]


def _check_expert_ids(ids, x, top_k, selection_bias, n_group):
    """Given expert ids: [T, top_k] integers on x's device, and nothing else that chooses. Their values (each in
    [0, E)) are checked by the CPU kernels; on CUDA that would need a host sync, so there an id out of range is the
    caller's error (the routing kernel clamps it; HF's own gather would stop on a device-side assert)."""
    if ids.dim() != 2 or ids.shape[1] != top_k:
        _fail(f"expert_ids must be [T, top_k={top_k}], got shape {tuple(ids.shape)}")
    _check(ids.shape[0] == x.shape[0], f"expert_ids has {ids.shape[0]} rows but hidden_states has {x.shape[0]}")
    if ids.dtype not in (torch.int64, torch.int32):
        _fail(f"expert_ids must be int64 or int32, got {ids.dtype}")
    if ids.device != x.device:
        _fail(f"expert_ids is on {ids.device} but hidden_states is on {x.device}")
    if selection_bias is not None or n_group != 1:
        _fail("expert_ids gives the experts: selection_bias and n_group > 1, which choose them, must not be set")


def _check_float_on_x_device(name, t, x):
    if t.dtype not in _FLOAT_DTYPES:
        _fail(f"{name} has unsupported dtype {t.dtype}")
    if t.device != x.device:
        _fail(f"{name} is on {t.device} but hidden_states is on {x.device}")


def _check_expert_scale(scale, x, num_experts, weight_on_input):
    """A per-expert weight scale: [E] floating point on x's device, on weights that scale the experts' outputs."""
    if scale.dim() != 1 or scale.shape[0] != num_experts:
        _fail(f"expert_scale must be [E={num_experts}], got shape {tuple(scale.shape)}")
    _check_float_on_x_device("expert_scale", scale, x)
    if weight_on_input:
        _fail("expert_scale is not supported with weight_on_input=True")


def _check_post_norm(weight, x, num_experts, down_bias, kw):
    """A post-expert norm: its kind and its weight ([H] or [E, H] floating point on x's device) together, on
    experts whose outputs the routing weights scale, without a down bias or identity experts (no model has them
    with the norm, and the kernels do not take them together)."""
    kind, H = kw["post_norm"], x.shape[1]
    if weight is None or kind == "none":
        _fail(f"post_norm={kind!r} with post_norm_weight={'None' if weight is None else 'a tensor'}: a post-expert "
              "norm needs both its kind and its weight")
    if tuple(weight.shape) not in ((H,), (num_experts, H)):
        _fail(f"post_norm_weight must be [H={H}] or [E={num_experts}, H={H}], got shape {tuple(weight.shape)}")
    _check_float_on_x_device("post_norm_weight", weight, x)
    if not abs(kw["post_norm_offset"]) < float("inf"):
        _fail(f"post_norm_offset must be finite, got {kw['post_norm_offset']}")
    for name, unsupported in (("weight_on_input=True", kw["weight_on_input"]), ("down_bias", down_bias is not None),
                              ("identity_experts", kw["identity_experts"]), ("zero_experts", kw["zero_experts"])):
        if unsupported:
            _fail(f"post_norm is not supported with {name}")


def checked_kwargs(tensors, kw) -> dict:
    """`kw` completed with the schema defaults, after `check_inputs(*tensors, **kw)` on the op's eight tensor
    arguments: how every forward kernel entry starts."""
    kw = with_defaults(kw)
    check_inputs(*tensors, **kw)
    return kw


@torch.library.register_fake("mok::fused_moe")
def _fused_moe_fake(hidden_states, router, router_bias, selection_bias, gate_up_proj, gate_up_bias, down_proj,
                    down_bias, **kw):
    T, H, E, _ = check_inputs(hidden_states, router, router_bias, selection_bias, gate_up_proj, gate_up_bias,
                              down_proj, down_bias, **kw)
    kw = with_defaults(kw)
    K = kw["top_k"]
    out = hidden_states.new_empty((T, H))
    weights = hidden_states.new_empty((T, K), dtype=reference.routing_weights_dtype(hidden_states.dtype,
                                                                                    kw["weights_fp32"]))
    ids = hidden_states.new_empty((T, K), dtype=torch.int64)
    return out, weights, ids


@torch.library.register_fake("mok::fused_moe_train")
def _fused_moe_train_fake(hidden_states, router, router_bias, selection_bias, gate_up_proj, gate_up_bias, down_proj,
                          down_bias, **kw):
    out, weights, ids = _fused_moe_fake(hidden_states, router, router_bias, selection_bias, gate_up_proj,
                                        gate_up_bias, down_proj, down_bias, **kw)
    kw = with_defaults(kw)
    gate_up_cols = gate_up_proj.shape[2] if kw["transposed"] else gate_up_proj.shape[1]
    h = hidden_states.new_empty((ids.numel(), gate_up_cols))
    norm_input = hidden_states.new_empty((ids.numel() if saves_norm_input(hidden_states, kw) else 0, out.shape[1]))
    return (out, weights, ids, h, *saved_routing_like(hidden_states, router, routing_width(gate_up_proj, kw), kw,
                                                      kept=keeps_routing(hidden_states)), norm_input)


def keeps_routing(hidden_states) -> bool:
    """Whether `fused_moe_train` returns the router logits and dispatch layout for its backward: the CUDA kernels;
    the C++ kernel's backward recomputes its own, so it returns them empty."""
    return hidden_states.device.type == "cuda"


def saves_norm_input(hidden_states, kw) -> bool:
    """Whether `fused_moe_train` returns a post-expert norm's input y for its backward ([T*K, H]): the CUDA kernels,
    which then skip the down GEMM that would recompute it; the C++ kernel's backward recomputes it."""
    return keeps_routing(hidden_states) and kw.get("post_norm", "none") != "none"


def saved_routing_like(hidden_states, router, num_experts, kw, *, kept: bool):
    """Uninitialised (router_logits, routing_layout) of `fused_moe_train`'s shapes: [T, E] logits ([0, E] where the
    router argument is the logits) and the layout's int32 vector where `kept`, else both empty."""
    T, E = hidden_states.shape[0], num_experts
    if kw["router_is_logits"]:
        logits = router.new_empty((0, E))
    else:
        logits = hidden_states.new_empty((T if kept else 0, E),
                                         dtype=reference.logits_dtype(hidden_states.dtype, kw["router_fp32"]))
    layout_len = 0
    if kept:  # CUDA: Triton is there (the module imports it)
        from ..kernels.dispatch import layout_size

        layout_len = layout_size(E, T * kw["top_k"])
    return logits, hidden_states.new_empty((layout_len,), dtype=torch.int32)


@torch.library.register_fake("mok::fused_moe_backward")
def _fused_moe_backward_fake(grad_out, grad_topk_weights, hidden_states, router, router_bias, selection_bias,
                             gate_up_proj, gate_up_bias, down_proj, down_bias, topk_weights, topk_ids, **kw):
    return (
        torch.empty_like(hidden_states),
        torch.empty_like(router),
        None if router_bias is None else torch.empty_like(router_bias),
        torch.empty_like(gate_up_proj),
        None if gate_up_bias is None else torch.empty_like(gate_up_bias),
        torch.empty_like(down_proj),
        None if down_bias is None else torch.empty_like(down_bias),
        None if kw.get("expert_scale") is None else torch.empty_like(kw["expert_scale"]),
        None if kw.get("post_norm_weight") is None else torch.empty_like(kw["post_norm_weight"]),
    )


@torch.library.register_fake("mok::fused_moe_backward_consume")
def _fused_moe_backward_consume_fake(grad_out, grad_topk_weights, hidden_states, router, router_bias, selection_bias,
                                     gate_up_proj, gate_up_bias, down_proj, down_bias, topk_weights, topk_ids,
                                     gate_up_out, **kw):
    return _fused_moe_backward_fake(grad_out, grad_topk_weights, hidden_states, router, router_bias, selection_bias,
                                    gate_up_proj, gate_up_bias, down_proj, down_bias, topk_weights, topk_ids,
                                    **{k: kw.get(k) for k in LEARNED_KWARGS})


def graph_is_freed() -> bool:
    """Whether the autograd graph task running this call frees its graph afterwards (no retain_graph), so
    that a saved tensor read only by this backward is dead after it. False outside a graph task."""
    return not torch._C._autograd._get_current_graph_task_keep_graph()


def _backward_keeping_gate_up_out(*args, **kw):
    """`fused_moe_backward_consume` where no kernel overwrites h (reference, C++): the plain backward."""
    *args, gate_up_out = args
    for name in ("if_graph_freed", *SPENT_KWARGS):
        kw.pop(name, None)
    return torch.ops.mok.fused_moe_backward(*args, **kw, gate_up_out=gate_up_out)


def _reference_forward(hidden_states, router, router_bias, selection_bias, gate_up_proj, gate_up_bias, down_proj,
                       down_bias, **kw):
    check_inputs(hidden_states, router, router_bias, selection_bias, gate_up_proj, gate_up_bias, down_proj,
                 down_bias, **kw)
    return reference.fused_moe_reference(hidden_states, router, router_bias, selection_bias, gate_up_proj,
                                         gate_up_bias, down_proj, down_bias, **kw)


lib.impl("fused_moe", _reference_forward, "CompositeExplicitAutograd")
lib.impl("fused_moe_backward", reference.fused_moe_backward_reference, "CompositeExplicitAutograd")
lib.impl("fused_moe_backward_consume", _backward_keeping_gate_up_out, "CompositeExplicitAutograd")
# Functionalized, the consuming backward is the plain one (h's contents afterwards are unspecified, so leaving
# them is a valid result). Inductor lowers a mutating custom op that `passes.backward_consume` inserts only if
# it is auto-functionalizable, which optional returns rule out, or has this kernel.
lib.impl("fused_moe_backward_consume", _backward_keeping_gate_up_out, "Functionalize")

# ----------------------------------------------------------------------------- autograd
# Registered directly on the Autograd key (what `torch.library.register_autograd` does internally)
# because that helper re-fills the schema's defaults on every call, reading `schema.arguments` once
# per argument: with this op's 27 arguments that cost ~140 us of host time per forward, more than a
# small MoE layer's GPU time. aot_autograd traces through this kernel the same way.

_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_BACKEND_KERNELS = {}  # (op, raw keyset below autograd) -> the Python kernel the dispatcher would call
_FALLTHROUGH = torch._C.DispatchKeySet(torch._C.DispatchKey.BackendSelect) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.ADInplaceOrView)  # keys no mok op has a kernel for: the dispatcher passes them by
_AUTOCAST_KEYS = ("AutocastCPU", "AutocastCUDA")  # excluded around the op's kernels (see autocast, below)
_AUTOCAST = functools.reduce(operator.or_, (torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
                                            for key in _AUTOCAST_KEYS))


def register_backend_kernel(op, key: str, kernel):
    """`kernel`, registered for `op` on dispatch key `key`, is what the dispatcher calls when nothing but
    `key` is left below autograd (plain tensors, no modes): the autograd kernel and Function call it
    directly then (`_backend_kernel`), skipping two conversions of the op's 20-odd arguments through
    the dispatcher (~50-100 us of host time per call, which bounds small MoE layers)."""
    keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    _BACKEND_KERNELS[op, keyset.raw_repr()] = kernel


def impl_backend_kernels(key: str, kernels: dict):
    """Register each `mok::<name>` kernel of `kernels` on dispatch key `key` (CPU, CUDA), and as the kernel the
    autograd kernel may call directly (`register_backend_kernel`)."""
    for name, kernel in kernels.items():
        lib.impl(name, kernel, key)
        register_backend_kernel(getattr(torch.ops.mok, name).default, key, kernel)


def _backend_kernel(op, keyset):
    """The kernel registered by `register_backend_kernel` for `op` if `keyset` (a call's dispatch keys, None
    if unknown) leaves that backend alone below autograd, else None."""
    if keyset is None:
        return None
    return _BACKEND_KERNELS.get((op, (keyset & _AFTER_AUTOGRAD).raw_repr()))


def _call_below_autograd(op, keyset, args, kwargs):
    """`op` on `args` below autograd: its registered backend kernel directly where `keyset` (the call's, as
    the dispatcher computes it) leaves that backend alone below autograd, else through the dispatcher."""
    kernel = _backend_kernel(op, keyset)
    with torch._C._AutoDispatchBelowAutograd():
        if kernel is not None:
            return kernel(*args, **kwargs)
        return op.redispatch(keyset & _AFTER_AUTOGRAD, *args, **kwargs)


def _keyset_of(tensors):
    """The dispatch keys of a call on `tensors` as the dispatcher computes them (the tensors' keys and the
    thread's included keys, less its excluded ones and the fall-through keys), or None where the call
    could take a path before the dispatcher (a torch function mode, a tensor subclass)."""
    if torch._C._is_torch_function_mode_enabled():
        return None
    keyset = torch._C._dispatch_tls_local_include_set()
    for t in tensors:
        if t is not None:
            if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
                return None
            keyset = keyset | torch._C._dispatch_keys(t)
    return keyset - torch._C._dispatch_tls_local_exclude_set() - _FALLTHROUGH


def may_save_gate_up(x, kw) -> bool:
    """The device-independent part of the choice to save h for the backward: not weight on the input (its
    backward keeps the recompute), not opted out with MOK_RECOMPUTE_GATE_UP=1 (which trades the time for
    the memory of h, K * 2I elements per token). Never a function of T: eager, static and dynamic-shape
    compiles must take the same path (a saved bf16 h and a recomputed fp32 one differ in the last bits)."""
    return not kw["weight_on_input"] and os.environ.get("MOK_RECOMPUTE_GATE_UP", "0") != "1"


def _saves_gate_up(args, kwargs) -> bool:
    """Whether the forward should also return h for the backward: decided from shapes, dtypes and the
    device alone, so fake tensors under torch.compile decide the same way. Per device: CUDA with the
    Triton kernels (`mok_compile.kernels.saves_gate_up`), CPU with the C++ kernel (`cpu.saves_gate_up`)."""
    x, kw = args[0], with_defaults(kwargs)
    if x.device.type == "cuda":
        from ..kernels import saves_gate_up

        return saves_gate_up(x, args[4], args[6], kw)
    if x.device.type == "cpu":
        from .cpu import saves_gate_up

        return saves_gate_up(x, kw)
    return False


class _FusedMoeFunction(torch.autograd.Function):
    """Autograd of `mok::fused_moe`: saves the inputs and the routing (K * (4 + 8) bytes per token), and
    with the CUDA or C++ kernels also h = x @ W1 per pair (K * 2I elements per token), which saves the
    backward a third of the forward's FLOPs (and a second read of W1 at few tokens). With the CUDA kernels
    also the router logits (E elements per token) and the dispatch layout (K * 8 bytes per token): the
    backward skips the router GEMM and 3 launches. `args`: the op's 8 tensor arguments, then those of its
    `LEARNED_KWARGS` that are given, named by `learned` (arguments here, so that they get gradients)."""

    @staticmethod
    def forward(ctx, keyset, kwargs, learned, *args):
        extra = args[8:]
        args = args[:8]
        kwargs = {**kwargs, **dict(zip(learned, extra))}
        if _saves_gate_up(args, kwargs):
            out, weights, ids, *saved = _call(torch.ops.mok.fused_moe_train.default, keyset, args, kwargs)
            out = (out, weights, ids)
            ctx.save_for_backward(*args, weights, ids, *extra, *saved)  # h, router logits, layout, norm input
        else:
            out = _call_below_autograd(torch.ops.mok.fused_moe.default, keyset, args, kwargs)
            ctx.save_for_backward(*args, out[1], out[2], *extra)
        # The backward reads topk_ids, not the given ids; the learned tensors come back from the saved ones.
        ctx.kwargs = {k: v for k, v in kwargs.items() if k != "expert_ids" and k not in LEARNED_KWARGS}
        ctx.learned = learned
        ctx.mark_non_differentiable(out[2])
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not as zeros to add
        return out

    @staticmethod
    def backward(ctx, grad_out, grad_topk_weights, _grad_ids):
        # The engine calls this under the autocast of the backward's caller, not through the op's autocast kernels
        # (below): the same exclusion, so that the backward too computes in its operands' dtypes.
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST):
            return _FusedMoeFunction._backward(ctx, grad_out, grad_topk_weights)

    @staticmethod
    def _backward(ctx, grad_out, grad_topk_weights):
        saved = ctx.saved_tensors
        tensors, topk_weights, topk_ids = saved[:8], saved[8], saved[9]
        n = len(ctx.learned)
        extra, rest = saved[10:10 + n], saved[10 + n:]
        kwargs = {**ctx.kwargs, **dict(zip(ctx.learned, extra))}
        if grad_out is None:
            grad_out = torch.zeros_like(tensors[0])
        args = (grad_out, grad_topk_weights, *tensors, topk_weights, topk_ids)
        keyset = _keyset_of((*args, *rest, *extra))
        if not rest:
            grads = _call(torch.ops.mok.fused_moe_backward.default, keyset, args, kwargs)
        else:
            h, logits, layout, norm_input = rest
            if keeps_routing(tensors[0]):  # what the training forward returned for x's device
                kwargs = {**kwargs, "router_logits": logits, "routing_layout": layout}
            if saves_norm_input(tensors[0], kwargs):
                kwargs["post_norm_input"] = norm_input
            if _gate_up_out_is_dead(h):
                grads = _call(torch.ops.mok.fused_moe_backward_consume.default, keyset, (*args, h), kwargs)
            else:
                grads = _call(torch.ops.mok.fused_moe_backward.default, keyset, args, {**kwargs, "gate_up_out": h})
        d_x, d_router, d_router_bias, d_gu, d_gu_bias, d_down, d_down_bias, *learned_grads = grads
        learned_grads = dict(zip(LEARNED_KWARGS, learned_grads))
        # selection_bias only chooses experts: it has no gradient (as in HF, where it is a buffer).
        return (None, None, None, d_x, d_router, d_router_bias, None, d_gu, d_gu_bias, d_down, d_down_bias,
                *(learned_grads[k] for k in ctx.learned))


def _gate_up_out_is_dead(h) -> bool:
    """Whether the saved h may be overwritten by this backward: eager (a plain tensor, not traced by
    aot_autograd, whose graphs stay functional) and the graph freed after this backward (no retain_graph).
    Overwriting it with dh keeps the backward's peak memory at HF's: one [T*K, 2I] buffer, not two."""
    return type(h) is torch.Tensor and graph_is_freed()


def _call(op, keyset, args, kwargs):
    """`op(*args, **kwargs)` from inside `_FusedMoeFunction` (no gradients recorded there), for a call whose
    dispatch keys are `keyset` (None: unknown): its backend kernel directly where `register_backend_kernel`
    allows."""
    kernel = _backend_kernel(op, keyset)
    if kernel is None:
        return op(*args, **kwargs)
    with torch._C._AutoDispatchBelowAutograd():
        return kernel(*args, **kwargs)


def _fused_moe_autograd(keyset, *args, **kwargs):
    learned = tuple(k for k in LEARNED_KWARGS if kwargs.get(k) is not None)
    extra = tuple(kwargs[k] for k in learned)
    if torch.is_grad_enabled() and torch._C._any_requires_grad(*args, *extra):
        kwargs = {k: v for k, v in kwargs.items() if k not in learned}
        return _FusedMoeFunction.apply(keyset, kwargs, learned, *args, *extra)
    return _call_below_autograd(torch.ops.mok.fused_moe.default, keyset, args, kwargs)


lib.impl("fused_moe", _fused_moe_autograd, "Autograd", with_keyset=True)

# ----------------------------------------------------------------------------- autocast
# The op computes in its operands' dtypes. A custom op has no autocast kernel of its own, so autocast falls through
# to its kernels, whose inner torch calls (the C++ kernel's matmuls, the reference's linear) it then cast: an fp32
# op under bf16 autocast computed partly in bf16, or failed on a dtype. Its autocast kernels run it with autocast
# excluded, as `torch.library.register_autocast` does after casting the inputs, which this op must not do: the pass
# fuses a block under autocast on operands in the dtypes autocast gave them in the graph.


def _outside_autocast(op):
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST):
            return op(*args, **kwargs)

    return kernel


def _register_autocast_kernels():
    for name in ("fused_moe", "fused_moe_train", "fused_moe_backward", "fused_moe_backward_consume"):
        kernel = _outside_autocast(getattr(torch.ops.mok, name).default)
        for key in _AUTOCAST_KEYS:
            lib.impl(name, kernel, key)


_register_autocast_kernels()
