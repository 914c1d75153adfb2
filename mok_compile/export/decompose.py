"""`mok::fused_moe` written with standard aten ops and static shapes, for export.

Compilers that do not know the fused op (torch-mlir's linalg / TOSA / StableHLO
lowerings, IREE, ...) need it spelled in aten ops. The reference kernel cannot
serve: it groups tokens by expert (`argsort`, `bincount`, a Python loop over
the experts hit), so its shapes depend on the routing data. Here every shape
depends only on input shapes:

- routing: the reference's own `router_logits` + `route` (softmax / top-k /
  sigmoid-group selection are shape-static already; given `expert_ids`, a
  gather; an `expert_scale`, a gather and a product), so the routing
  decisions and weights are the reference's, op for op;
- experts, one of two formulations (`EXPERTS_FORMS`):

  ``gather`` (default)  like transformers' ``batched_mm``: gather each
      (token, slot)'s expert weights, ``W[topk_ids]`` -> ``[T, K, 2I, H]``, and run
      T*K small matmuls. Work and memory grow with T*K*I*H: right for decode
      and short prompts, heavy for long prefill.
  ``dense``   every expert on every token (``[E, T, 2I]``), then pick the K
      routed outputs per token. E/K times the FLOPs, but plain batched matmuls
      over the weights as stored (no weight copies), which static compilers
      tile well; memory grows with T*E*I.

- combine: ``sum_k w[t, k] * y[t, k]`` in the routing weights' dtype, then cast
  to the input dtype, exactly as the reference does (the picked outputs keep
  the reference's k order, so unrouted experts never enter the sum, not even as
  ``0 * inf``).

With ``weight_on_input`` (Llama4) the weight scales the expert's input instead,
``(x[t] * w[t, k]).to(x.dtype)``, and the combine is the plain ``sum_k y[t, k]``.
``gather`` scales each (token, slot)'s input row; ``dense`` runs expert e on
``x * w_dense[:, e]`` with ``w_dense`` the routing weights scattered into a zero
``[T, E]`` (what Llama4's own module does), then picks the K routed outputs as
usual, so unrouted experts (zero input, but possibly a bias) never enter the sum.

With ``identity_experts`` (LongCat-Flash) the router ranks E + Z choices; the experts run on the ids clamped
into the experts' range, an identity pair's output is then replaced by zero (a select, never a product), and the
identity term ``(x * identity_weight).to(x.dtype)`` is added to the combined output, as the reference does. With
``zero_experts`` (Zaya's skip expert) the same, without the identity term.

With a ``post_norm`` each pair's output row is normalised (the reference's `apply_post_norm`) before the combine,
with its expert's row of a per-expert weight (a gather) or the shared one.

Used only on the export path (`decompose_fused_moe` rewrites a graph's calls);
the fused op keeps its own kernels everywhere else.
"""

from __future__ import annotations

import torch

from ..ops.reference import activate, apply_post_norm, identity_weight, post_norm_scale, route, router_logits
from ..ops.spec import with_defaults

EXPERTS_FORMS = ("gather", "dense")


def _linear(x, weight, transposed):
    """x @ W^T for F.linear-layout weights ([..., out, in]); x @ W for the transposed layout ([..., in, out])."""
    return x @ (weight if transposed else weight.transpose(-1, -2))


def _experts_gather(x, ids, gate_up_proj, gate_up_bias, down_proj, down_bias, *, transposed, input_weights=None,
                    **act):
    """[T, K, H] outputs of the K routed experts of each token, from per-pair gathered weights.

    input_weights: [T, K] routing weights that scale each pair's input (weight_on_input), or None.
    """
    if input_weights is None:
        xs = x.unsqueeze(1).unsqueeze(2)  # [T, 1, 1, H], broadcast over the K slots
    else:
        xs = (x.unsqueeze(1) * input_weights.unsqueeze(-1)).to(x.dtype).unsqueeze(2)  # [T, K, 1, H]
    h = _linear(xs, gate_up_proj[ids], transposed).squeeze(2)  # [T, K, 2I]
    if gate_up_bias is not None:
        h = h + gate_up_bias[ids]
    a = activate(h, **act)
    y = _linear(a.unsqueeze(2), down_proj[ids], transposed).squeeze(2)  # [T, K, H]
    if down_bias is not None:
        y = y + down_bias[ids]
    return y


def _experts_dense(x, ids, gate_up_proj, gate_up_bias, down_proj, down_bias, *, transposed, input_weights=None,
                   **act):
    """[T, K, H] outputs of the K routed experts of each token, picked from all E experts' outputs.

    input_weights: [T, K] routing weights that scale each pair's input (weight_on_input), or None.
    """
    if input_weights is None:
        xs = x.unsqueeze(0)  # [1, T, H], broadcast over the experts
    else:  # expert e runs on x * w[t, e], w scattered into a zero [T, E] (unrouted pairs: zero input, not picked)
        dense_w = torch.zeros(x.shape[0], gate_up_proj.shape[0], dtype=input_weights.dtype, device=x.device)
        dense_w = dense_w.scatter(1, ids, input_weights)
        xs = (x.unsqueeze(0) * dense_w.t().unsqueeze(-1)).to(x.dtype)  # [E, T, H]
    h = _linear(xs, gate_up_proj, transposed)  # [E, T, 2I]
    if gate_up_bias is not None:
        h = h + gate_up_bias.unsqueeze(1)
    a = activate(h, **act)
    y = _linear(a, down_proj, transposed)  # [E, T, H]
    if down_bias is not None:
        y = y + down_bias.unsqueeze(1)
    y = y.transpose(0, 1)  # [T, E, H]
    return y.gather(1, ids.unsqueeze(-1).expand(-1, -1, y.shape[-1]))


_EXPERTS = {"gather": _experts_gather, "dense": _experts_dense}


def fused_moe_decomposed(hidden_states, router, router_bias, selection_bias, gate_up_proj, gate_up_bias, down_proj,
                         down_bias, *, experts_form: str = "gather", **kw):
    """Same results as `torch.ops.mok.fused_moe` (same signature), in aten ops with data-independent shapes."""
    if experts_form not in _EXPERTS:
        raise ValueError(f"experts_form={experts_form!r} is not one of {EXPERTS_FORMS}")
    kw = with_defaults(kw)
    x = hidden_states
    logits = router_logits(x, router, router_bias, router_is_logits=kw["router_is_logits"],
                           router_fp32=kw["router_fp32"])
    w, ids = route(logits, selection_bias, x_dtype=x.dtype, top_k=kw["top_k"], routing=kw["routing"],
                   softmax_fp32=kw["softmax_fp32"], renormalize=kw["renormalize"], renorm_eps=kw["renorm_eps"],
                   routed_scale=kw["routed_scale"], n_group=kw["n_group"], topk_group=kw["topk_group"],
                   weights_fp32=kw["weights_fp32"], renorm_min=kw["renorm_min"], group_top=kw["group_top"],
                   expert_ids=kw.get("expert_ids"), expert_scale=kw.get("expert_scale"), jitter_eps=kw["jitter_eps"],
                   round_weights=kw["round_weights"], round_weights_to=kw["round_weights_to"])
    weight_on_input = kw["weight_on_input"]
    E = gate_up_proj.shape[0]
    past = kw["identity_experts"] + kw["zero_experts"] > 0  # router choices past the experts
    y = _EXPERTS[experts_form](x, ids.clamp(max=E - 1) if past else ids, gate_up_proj, gate_up_bias, down_proj,
                               down_bias, transposed=kw["transposed"], input_weights=w if weight_on_input else None,
                               activation=kw["activation"], gated=kw["gated"], interleaved=kw["interleaved"],
                               alpha=kw["alpha"], limit=kw["limit"])
    if past:  # an identity or zero pair runs no expert
        y = torch.where((ids < E).unsqueeze(-1), y, 0.0)
    if kw["post_norm"] != "none":  # each pair's row with its expert's g (a [E, H] weight) or the shared one
        g = post_norm_scale(kw["post_norm_weight"], kw["post_norm_offset"])
        y = apply_post_norm(y, g[ids] if g.dim() == 2 else g, kind=kw["post_norm"], eps=kw["post_norm_eps"])
    if weight_on_input:
        out = y.sum(dim=1).to(x.dtype)
    else:
        out = (y * w.unsqueeze(-1)).sum(dim=1).to(x.dtype)
    if kw["identity_experts"]:
        out = out + (x * identity_weight(w, ids, E)).to(x.dtype)
    return out, w, ids


def is_fused_moe(node: torch.fx.Node) -> bool:
    """Whether `node` calls `mok.fused_moe` (Dynamo graphs may hold the overload packet, export graphs the overload)."""
    return node.op == "call_function" and node.target in (torch.ops.mok.fused_moe, torch.ops.mok.fused_moe.default)


def decompose_fused_moe(gm: torch.fx.GraphModule, experts_form: str = "gather") -> int:
    """Replace every `mok.fused_moe` call in `gm` by `fused_moe_decomposed`, in place; return how many.

    Done on the graph before `torch.export` rather than as an
    `ExportedProgram.run_decompositions` entry: export functionalizes the
    traced Python, whereas a decomposition-table entry must already be
    functional, and the reference routing this reuses builds a mask in place.
    """
    if experts_form not in _EXPERTS:
        raise ValueError(f"experts_form={experts_form!r} is not one of {EXPERTS_FORMS}")
    count = 0
    for node in gm.graph.nodes:
        if is_fused_moe(node):
            node.target = fused_moe_decomposed
            node.kwargs = {**node.kwargs, "experts_form": experts_form}
            count += 1
    if count:
        gm.recompile()
    return count
