"""Forward and backward of `mok::fused_moe` on the GPU: the stages launched in order.

Forward (6 Triton launches + the router GEMM, 4 where one routing program holds every token (at most 16-64,
by E); no host synchronisation):
    logits   = x @ Wr^T (+ b)                          cuBLAS, as the HF router computes it (an fp32 router's:
                                                        router_gemm.py, fp32-accurate on the tensor cores)
    route    -> topk_weights, topk_ids, chunk counts    routing.py (given `expert_ids`: read, not chosen)
    scan, scatter -> expert-sorted pairs                dispatch.py (in the route launch for one chunk)
    gate_up  act[r] = act(x[tok(r)] @ W1[e])            grouped_gemm.py (gather in A loads, act in epilogue)
    down     y[r] = act[r] @ W2[e] (+ b2)               grouped_gemm.py
    (rsqrt   r[r] = the norm's rsqrt of row y[r]        post_norm.py, with a post-expert norm only)
    combine  out[t] = sum_k w[t,k] * y[pos(t,k)]        dispatch.py (fixed slot order; with a post norm,
                                                        y[pos(t,k)] normalised as it is read)
The routing weight is applied in the combine, not in the down GEMM's epilogue: HF multiplies
the rounded expert output by the (often fp32) weight and sums in fp32, and doing it where the
rows are summed reproduces that at no extra memory traffic.

Backward (autograd saves the op inputs + topk_weights + topk_ids, K * (4 + 8) bytes per token, and from
`mok::fused_moe_train` h, K * 2I elements per token, the router logits, E elements per token, and the
dispatch layout, K * 8 bytes per token, and with a post-expert norm y, K * H elements per token; a direct call
without the logits and layout first recomputes the logits and runs count, scan and scatter):
    g2          g2[r] = go[tok(r)] @ W2[e]^T                (gathered GEMM)
    act bwd     from the saved h: dh, w * act(h), partial d(weights) per I-tile (activation_pass.py);
                without it (MOK_RECOMPUTE_GATE_UP=1, a direct call, weight on input) `_gate_up_bwd_kernel`
                recomputes h = x @ W1 with the same epilogue
    wgrad x2    dW2[e] = sum_r go[r]^T (w act)[r];  dW1[e] = sum_r dh[r]^T x[r]  (+ bias grads)
    dgrad       dxp[r] = dh[r] @ W1[e]
    route_bwd   d(logits) from d(weights)
    dWr = dl^T x, dx_router = dl @ Wr (cuBLAS, router dtype; an fp32 router's on the tensor cores, router_gemm.py),
    combine dx[t] = sum_k dxp[pos(t,k)] + dx_router[t]

Post-expert norm (`post_norm`, Ergo, Muse Spark): the training forward also returns y, the norm's input (K * H
elements per token; the combine normalised it as it read it), and the backward reads it; without it (a direct call,
MOK_RECOMPUTE_GATE_UP=1) the backward recomputes y (`_expert_rows`, the forward's stages; from the saved h where
there is one, else storing h as the training forward does). Then `post_norm.backward_rows` gives dy per sorted row
(w * go[t] through the norm's backward, written over y where y is recomputed or dead after this backward), each
pair's d(topk_weights) and the norm weight's gradient (per-expert sums in sorted order). The chain above then reads
dy as already weighted sorted rows: g2 = dy @ W2^T ungathered, the activation pass over h with unit weights, dW2
from dy's rows (every engine takes them: Triton's wgrad ungathered, CUTLASS's sorted rows as they are, the CUDA
kernel's without its gather).

GEMM engines (`configs.engine`, per stage, by mean rows per expert): the Triton kernels above, or
PyTorch's CUTLASS grouped GEMM (`cutlass_gemm.py`; bf16 on Hopper) where it is faster. A CUTLASS
gathered stage gathers the rows first and runs the activation (backward: its derivative) as a
separate Triton pass over the stored h; a CUTLASS down stage leaves the down bias to the combine.
With `save_gate_up` (`mok::fused_moe_train`, autograd on CUDA) the forward also returns h (from the
CUTLASS GEMM, or stored by the Triton gate_up epilogue: STORE_H) and the backward reads it (`gate_up_out`);
`mok::fused_moe_backward_consume` (autograd's last backward) lets the activation pass write dh over it
and releases that memory after the last GEMM that reads dh.

Weight on input (Llama4, `weight_on_input=True`): the same launches behind constexpr flags (Triton only).
    forward  gate_up loads A rows as (x[t] * w[t,k]).to(x.dtype) (A_SCALE); combine unweighted
    backward gate_up_bwd recomputes h from the scaled rows, dh = act'(h) * g2 (no w), stores act(h)
             unscaled and no partial d(weights); dW2 = go^T act, db2 = sum go; dW1 reads the
             scaled rows (Q_SCALE); dgrad's epilogue writes partial d w = <dxs, x> per H-tile
             (DW_DOT, summed in fixed order by route_bwd); combine dx[t] = sum_k w[t,k] dxs[pos(t,k)]
"""

from __future__ import annotations

import functools
import os

import torch

from ..ops import reference
from ..ops.library import check_inputs, routing_width
from ..ops.spec import with_defaults
from . import activation_pass, configs, cutlass_gemm, gate_up_sm90, graphs, plan, post_norm, router_gemm, wgrad_sm90
from .activation import activation_code
from .dispatch import Dispatch, combine, grid_rows, layout_size
from .grouped_gemm import _gate_up_bwd_kernel, _grouped_gemm_kernel, _wgrad_kernel
from .launch import cdiv, launcher
from .routing import route, route_backward, row_dots


def _precision(dtype: torch.dtype) -> str:
    """The fp32 GEMMs' `tl.dot` precision. tf32 only where the user allowed it for matmuls (torch's own setting);
    otherwise tf32x3 (each operand split into a high and a low tf32 part, three tensor-core products): about fp32's
    accuracy, where Triton's ieee dot runs on the FMA units at ~10 TFLOP/s on an H100, a fifth of cuBLAS's fp32 GEMMs
    (NOTES v74). MOK_FP32_DOT=ieee picks that dot."""
    if dtype != torch.float32:
        return "ieee"  # not read for 16-bit operands
    if torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return os.environ.get("MOK_FP32_DOT", "tf32x3")


def _sizes(gate_up_proj, down_proj, kw):
    E = gate_up_proj.shape[0]
    I = down_proj.shape[1] if kw["transposed"] else down_proj.shape[2]
    return E, I


def _gate_up_strides(w1, transposed):
    """(stride over H, stride over the 2I columns) of W1[e]."""
    return (w1.stride(1), w1.stride(2)) if transposed else (w1.stride(2), w1.stride(1))


def _down_strides(w2, transposed):
    """(stride over I, stride over H) of W2[e]."""
    return (w2.stride(1), w2.stride(2)) if transposed else (w2.stride(2), w2.stride(1))


def _kn(w, transposed, backward=False):
    """W[e] as the [k, n] operand of PyTorch's grouped GEMM: forward x @ W, backward (transposed) g @ W^T."""
    return w if transposed != backward else w.transpose(1, 2)


def _engines(x, gate_up_proj, down_proj, I, rows_per_expert, kw):
    """Engine of each GEMM stage (`configs.engine`); Triton wherever CUTLASS is not eligible. Weight on
    input (Llama4) keeps the forward and dgrad on Triton (the scale sits in their loads and epilogues);
    its weight gradients may take CUTLASS over pre-scaled rows."""
    if not cutlass_gemm.eligible(x, gate_up_proj, down_proj, I):
        return dict.fromkeys(configs.STAGES, "triton")
    eng = {stage: configs.engine(stage, rows_per_expert, kw["transposed"], x.shape[1] * I) for stage in configs.STAGES}
    if kw.get("weight_on_input", False):
        eng.update(gathered="triton", down="triton", dgrad="triton")
    if eng["wgrad"] == "sm90" and not (wgrad_sm90.eligible(x, gate_up_proj, down_proj, kw) and wgrad_sm90.available()):
        eng["wgrad"] = "cutlass"
    return eng


def _gate_up_engine(x, gate_up_proj, gate_up_bias, down_proj, I, kw, gathered):
    """Engine of the forward gate_up (`configs.gate_up_engine`): 'sm90' only where the call fits the Hopper CUDA
    kernel and it builds, 'cutlass' only where the gathered stage may take it; else the gathered stage's engine."""
    choice = configs.gate_up_engine(gathered)
    if choice == "sm90" and not (gate_up_sm90.eligible(x, gate_up_proj, gate_up_bias, kw) and gate_up_sm90.available()):
        return gathered
    if choice == "cutlass" and (kw.get("weight_on_input", False)
                                or not cutlass_gemm.eligible(x, gate_up_proj, down_proj, I)):
        return gathered
    return choice


def _gate_up_columns(I, kw):
    """(col_mul, up_off): gate column of n is n * col_mul, up column is n * col_mul + up_off."""
    if not kw["gated"]:
        return 1, 0
    return (2, 1) if kw["interleaved"] else (1, I)


def _gemm(a, disp, w, strides_kn, bias, out, *, n, kd, gather, gated, act, col_mul, up_off, kw, cfg, precision,
          a_scale=None, dw_dot=None, dw_parts=None, h_out=None):
    """One grouped GEMM launch. `a_scale` [T*K]: scale each (gathered) A row by its pair's weight;
    `dw_dot` [T, n] with `dw_parts` [cdiv(n, BLOCK_N), T*K] fp32: write the rows' partial dot products
    with dw_dot[token] per N-tile (both weight on input only; the default path passes neither);
    `h_out` [T*K, 2I or I]: also store the gate_up product before bias and activation (STORE_H)."""
    cfg = dict(cfg)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    grid = (grid_rows(disp.num_pairs, disp.num_experts, bm) * cdiv(n, bn),)
    extra = {}
    if a_scale is not None:
        extra.update(scale_ptr=a_scale, A_SCALE=True)
    if dw_dot is not None:
        extra.update(dot_ptr=dw_dot, dw_part_ptr=dw_parts, stride_dot=dw_dot.stride(0), TK=disp.num_pairs,
                     DW_DOT=True)
    if h_out is not None:
        extra.update(h_ptr=h_out, stride_hm=h_out.stride(0), STORE_H=True)
    if _blocked_b(gated, col_mul, strides_kn):
        extra["B_BLOCKED"] = True
    if configs.half_tail(bm):
        extra["HALF_TAIL"] = True
    # B through TMA: where the tuned config says so (or MOK_TMA=1); for interleaved gate/up columns
    # (GPT-OSS) unless MOK_TMA=0 (measured faster there, and the tuning shapes have the other layout).
    tma = cfg.pop("TMA", None)
    if gated and col_mul == 2:
        tma = tma is not False
    if tma and a_scale is None:
        gate_up_box = up_off if gated and col_mul == 1 else None
        desc = _weight_descriptor(w, strides_kn, 2 * bn if gated else bn, cfg["BLOCK_K"], gate_up_box)
        if desc is not None:
            extra.update(b_desc=desc, B_KN=strides_kn[1] == 1, B_BLOCKED=gate_up_box is not None)
    launcher(_grouped_gemm_kernel)[grid](
        a, disp.sorted_pair, w, bias if bias is not None else w, out, disp.block_table(bm), n, kd, disp.num_experts,
        a.stride(0), w.stride(0), strides_kn[0], strides_kn[1],
        bias.stride(0) if bias is not None else 0, out.stride(0), col_mul, up_off,
        float(kw["alpha"]), float(kw["limit"]),
        TOPK=disp.top_k, A_GATHER=gather, GATED=gated, INTERLEAVED=gated and col_mul == 2, ACT=act,
        HAS_BIAS=bias is not None, PRECISION=precision,
        **cfg, **extra,
    )


def _blocked_b(gated, col_mul, strides_kn) -> bool:
    """Gate and up as column blocks of a weight contiguous along its columns (`_mainloop`'s B_BLOCKED)."""
    return gated and col_mul == 1 and strides_kn[1] == 1


def _weight_descriptor(w, strides_kn, width, block_k, gate_up_box=None):
    """TMA descriptor over all experts' weights `w` [E, d1, d2] as stored (d2 contiguous: n for [E, k, n],
    k for [E, n, k]) with [1, block_k, width] / [1, width, block_k] boxes; None where TMA cannot read
    them: not Hopper or newer, a 32-bit dtype, or strides and base not 16-byte aligned.
    `gate_up_box` = I (gated, gate columns [0, I) and up columns [I, 2I)): the n dimension split in two,
    [E, k, 2, I] / [E, 2, I, k] with [1, block_k, 2, width/2] / [1, 2, width/2, block_k] boxes
    (`_mainloop_tma`'s GATE_UP_BOX)."""
    if not (_tma_3d(w) and 1 in strides_kn):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    shape, strides = list(w.shape), list(w.stride())
    if gate_up_box is None:
        box = [1, block_k, width] if strides_kn[1] == 1 else [1, width, block_k]
        return TensorDescriptor(w, shape, strides, box)
    I, n_stride = gate_up_box, strides_kn[1]
    if (I * n_stride) % 8:  # the up half's offset must be 16-byte aligned too
        return None
    if n_stride == 1:  # [E, k, 2I] -> [E, k, 2, I]
        return TensorDescriptor(w, [shape[0], shape[1], 2, I], [strides[0], strides[1], I, 1],
                                [1, block_k, 2, width // 2])
    return TensorDescriptor(w, [shape[0], 2, I, shape[2]], [strides[0], I * strides[1], strides[1], 1],
                            [1, 2, width // 2, block_k])


def _tma_3d(t) -> bool:
    """Whether TMA can address the 3-d 16-bit tensor `t` as stored: Hopper or newer, last dimension contiguous,
    base and the other strides 16-byte aligned."""
    return (_tma_device(t.device) and t.dim() == 3 and t.element_size() == 2 and t.stride(2) == 1
            and t.data_ptr() % 16 == 0 and t.stride(0) % 8 == 0 and t.stride(1) % 8 == 0)


def _tma_device(device) -> bool:
    if device.type != "cuda":
        return os.environ.get("TRITON_INTERPRET") == "1"
    return configs.capability(device)[0] >= 9


def _wgrad(p, q, disp, scale, out, dbias, *, P, Q, p_gather, q_gather, strides_pq, cfg, precision, q_scale=None):
    """`scale`: per-pair weights on the bias sum (BIAS_SCALE); `q_scale`: per-pair weights on the Q rows.
    Config keys beside the tile: `TMA` stores the gradient tiles through a TMA descriptor where `out` allows it
    (`_output_descriptor`); `PROGRAMS_PER_SM` and `MAX_TILES_PER_PROGRAM` choose a persistent grid
    (`_wgrad_programs`)."""
    cfg = dict(cfg)
    tma = cfg.pop("TMA", False)
    per_sm, max_tiles = cfg.pop("PROGRAMS_PER_SM", None), cfg.pop("MAX_TILES_PER_PROGRAM", None)
    extra = {}
    if q_scale is not None:
        assert scale is None  # one scale pointer
        scale = q_scale
        extra["Q_SCALE"] = True
    if tma:
        desc = _output_descriptor(out, P, Q, strides_pq, cfg["BLOCK_P"], cfg["BLOCK_Q"])
        if desc is not None:
            extra["c_desc"] = desc
    tiles = disp.num_experts * cdiv(P, cfg["BLOCK_P"]) * cdiv(Q, cfg["BLOCK_Q"])
    programs = _wgrad_programs(tiles, per_sm, max_tiles, out.device)
    if programs < tiles:
        extra["PERSISTENT"] = True
    launcher(_wgrad_kernel)[(programs,)](
        p, q, disp.sorted_pair, scale if scale is not None else p, out, dbias if dbias is not None else out,
        disp.expert_count, disp.expert_start, P, Q, disp.num_experts, programs, p.stride(0), q.stride(0),
        out.stride(0), strides_pq[0], strides_pq[1], dbias.stride(0) if dbias is not None else 0,
        TOPK=disp.top_k, P_GATHER=p_gather, Q_GATHER=q_gather, BIAS_SCALE=scale is not None and q_scale is None,
        HAS_BIAS=dbias is not None, PRECISION=precision, **cfg, **extra,
    )


def _wgrad_programs(tiles, per_sm, max_tiles, device):
    """The weight gradient's grid: one program per output tile, or with `per_sm` a persistent grid of that many
    programs per SM (no more than fit on one SM at once, or the surplus programs run their share after the
    others), but only while each program runs at most `max_tiles` tiles where that is given. The table's bound is a
    guard, not a law: it keeps layers of DeepSeek-V3's size (600-1200 tiles a program) on one tile per program,
    where the persistent grid lost 17-21% on the benchmark's skewed routing though it won on even routing (NOTES
    v37, v38)."""
    if per_sm is None:
        return tiles
    resident = per_sm * configs.sm_count(device)
    if max_tiles is not None and tiles > max_tiles * resident:
        return tiles
    return max(1, min(tiles, resident))


def _output_descriptor(out, P, Q, strides_pq, block_p, block_q):
    """TMA descriptor of a weight gradient `out` [E, P, Q] with [1, block_p, block_q] boxes; None where TMA cannot
    write it: not Hopper or newer, a 32-bit dtype, out not laid out [E, P, Q] with Q contiguous (transposed
    weights), or strides and base not 16-byte aligned."""
    if not (_tma_3d(out) and tuple(out.shape[1:]) == (P, Q) and tuple(strides_pq) == (out.stride(1), 1)):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(out, list(out.shape), list(out.stride()), [1, block_p, block_q])


def _logits(x, router, router_bias, kw):
    if kw["router_fp32"] and not kw["router_is_logits"] and router_gemm.enabled(x, router):
        return router_gemm.matmul(x, router.t(), router_bias)  # x.float() @ W^T without cuBLAS's SIMT path
    return reference.router_logits(x, router, router_bias, router_is_logits=kw["router_is_logits"],
                                   router_fp32=kw["router_fp32"])


def _saved_logits(router_logits, T, E, kw):
    """The forward's logits for the backward, or None where it recomputes them (none given, or the router
    argument is the logits); a wrong shape is the caller's error, not something to recompute around."""
    if router_logits is None or kw["router_is_logits"]:
        return None
    if router_logits.dim() != 2 or tuple(router_logits.shape) != (T, E) or not router_logits.is_floating_point():
        raise ValueError(f"mok.fused_moe_backward: router_logits must be the forward's [{T}, {E}] logits, got "
                         f"{router_logits.dtype} of shape {tuple(router_logits.shape)}")
    return router_logits


def _saved_norm_input(post_norm_input, gate_up_out, TK, x, kw):
    """The forward's post-norm input rows y for the backward ([T*K, H] in sorted order, x's dtype; with the forward's
    h beside them), or None where it recomputes them (none given); anything else is the caller's error."""
    if post_norm_input is None:
        return None
    if gate_up_out is None:
        raise ValueError("mok.fused_moe_backward: post_norm_input is read with the training forward's gate_up_out, "
                         "which was not given")
    shape = (TK, x.shape[1])
    if (kw["post_norm"] == "none" or tuple(post_norm_input.shape) != shape or post_norm_input.dtype != x.dtype
            or post_norm_input.stride(-1) != 1):
        raise ValueError(f"mok.fused_moe_backward: post_norm_input must be the training forward's {list(shape)} "
                         f"{x.dtype} rows of a post-expert norm's input (post_norm={kw['post_norm']!r}), got "
                         f"{post_norm_input.dtype} of shape {tuple(post_norm_input.shape)} and strides "
                         f"{post_norm_input.stride()}")
    return post_norm_input


def _kept_logits(logits, router, E, kw):
    """The logits `save_gate_up` keeps for the backward: [0, E] where the router argument is the logits (an
    output is never an input's alias)."""
    return router.new_empty((0, E)) if kw["router_is_logits"] else logits


_FORWARD_PLANS = plan.PlanCache()
FORWARD_GRAPHS = graphs.GraphCache(copied=(0, 8))  # x and the given expert ids: per-call tensors


def fused_moe_forward(hidden_states, router, router_bias, selection_bias, gate_up_proj, gate_up_bias, down_proj,
                      down_bias, save_gate_up=False, **kw):
    """(out, topk_weights, topk_ids) with the semantics of `reference.fused_moe_reference`; with
    `save_gate_up` (`mok::fused_moe_train`) also what the backward reads instead of recomputing: h = x @ W1
    per pair in sorted order (before bias and activation, in the input dtype), the router logits ([0, E]
    where the router argument is the logits), the `Dispatch.layout` and with a post-expert norm its input y per
    pair in sorted order ([0, H] without one). Replayed from a launch plan
    (`plan.py`) where this call's signature has one; at few tokens, from a CUDA graph (`graphs.py`)."""
    kw = with_defaults(kw)
    tensors = (hidden_states, router, router_bias, selection_bias, gate_up_proj, gate_up_bias, down_proj, down_bias,
               kw.pop("expert_ids", None), kw.pop("expert_scale", None), kw.pop("post_norm_weight", None))
    options = (save_gate_up, tuple(kw.items()))

    def planned(*tensors):
        return _FORWARD_PLANS.call(lambda: _forward(*tensors, save_gate_up=save_gate_up, **kw), tensors, options)

    # An inference forward's graph keeps copies of x and the output only: past few tokens too where its work is small
    # (`graphs.max_inference_macs`).
    macs = None if save_gate_up else _expert_macs(hidden_states, gate_up_proj, down_proj, kw)
    return FORWARD_GRAPHS.call(planned, tensors, options, also_copied=(1,) if kw["router_is_logits"] else (),
                               macs=macs)


def _expert_macs(x, gate_up_proj, down_proj, kw) -> int | None:
    """T * K * H * I: the multiply-adds of each I-wide expert GEMM of a call (x [T, H]); None for inputs of other ranks,
    which the normal path rejects with its own message."""
    if x.dim() != 2 or down_proj.dim() != 3:
        return None
    _, I = _sizes(gate_up_proj, down_proj, kw)
    return x.shape[0] * kw["top_k"] * x.shape[-1] * I


def _forward(hidden_states, router, router_bias, selection_bias, gate_up_proj, gate_up_bias, down_proj, down_bias,
             expert_ids, expert_scale, post_norm_weight, save_gate_up, **kw):
    # Checked here, on the normal path only: a plan's signature fixes everything the check reads.
    check_inputs(hidden_states, router, router_bias, selection_bias, gate_up_proj, gate_up_bias, down_proj,
                 down_bias, expert_ids=expert_ids, expert_scale=expert_scale, post_norm_weight=post_norm_weight, **kw)
    x = hidden_states.contiguous()
    T, H = x.shape
    E, I = _sizes(gate_up_proj, down_proj, kw)
    R = routing_width(gate_up_proj, kw)  # the router's choices: the experts, then any identity or zero experts
    K = kw["top_k"]
    weights_dtype = torch.float32 if kw["weights_fp32"] else x.dtype
    logits = _logits(x, router, router_bias, kw)
    disp = Dispatch.unsorted(E, K, T * K, x.device, num_buckets=R) if T > 0 else None
    w, ids, _, _ = route(
        logits, selection_bias, top_k=K, routing=kw["routing"],
        softmax_fp32=kw["softmax_fp32"], renormalize=kw["renormalize"], renorm_eps=kw["renorm_eps"],
        routed_scale=kw["routed_scale"], n_group=kw["n_group"], topk_group=kw["topk_group"],
        weights_dtype=weights_dtype, dispatch=disp, renorm_min=kw["renorm_min"], group_top=kw["group_top"],
        expert_ids=None if expert_ids is None else expert_ids.contiguous(),
        expert_scale=None if expert_scale is None else expert_scale.contiguous(), jitter_eps=kw["jitter_eps"],
        round_to=reference.weights_rounding(x.dtype, kw["round_weights"], kw["round_weights_to"]))
    if T == 0:
        gate_up_cols = gate_up_proj.shape[2] if kw["transposed"] else gate_up_proj.shape[1]
        out = (x.new_empty((0, H)), w, ids)
        if not save_gate_up:
            return out
        layout = torch.zeros(layout_size(R, 0), dtype=torch.int32, device=x.device)
        norm_input = x.new_empty((0, H))
        return out + (x.new_empty((0, gate_up_cols)), _kept_logits(logits, router, R, kw), layout, norm_input)
    rows_per_expert = T * K / R  # at even routing over the router's choices (identity and zero experts run no rows)
    eng = _engines(x, gate_up_proj, down_proj, I, rows_per_expert, kw)
    y, h = _expert_rows(x, disp, ids, w, gate_up_proj, gate_up_bias, down_proj, down_bias, I, kw, eng,
                        rows_per_expert, save_h=save_gate_up)
    norm = None
    if kw["post_norm"] != "none":  # the combine normalises y's rows as it reads them; y stays the norm's input
        g = post_norm.scale(kw, post_norm_weight)
        norm = (post_norm.row_rsqrt(y, disp, ids, g, kw), g, kw["post_norm"] == "scaled_rms")
    # A CUTLASS down stage leaves the down bias to the combine (never with weight on input: `_engines`).
    out = combine(y, disp.pair_pos, None if kw.get("weight_on_input", False) else w, None, T, K, x.dtype,
                  bias=down_bias if eng["down"] == "cutlass" else None, topk_ids=ids,
                  identity=_identity(x, w, E, kw, rounded=True), norm=norm)
    if not save_gate_up:
        return out, w, ids
    return (out, w, ids, h, _kept_logits(logits, router, R, kw), disp.layout,
            y if norm is not None else x.new_empty((0, H)))


def _expert_rows(x, disp, ids, w, gate_up_proj, gate_up_bias, down_proj, down_bias, I, kw, eng, rows_per_expert, *,
                 save_h=False, h=None):
    """(y, h): each pair's expert output y [T*K, H] in sorted rows (without the down bias on a CUTLASS down stage)
    by the gate_up and down stages, and with `save_h` h = x @ W1 per pair (before bias and activation). Given `h`
    (the backward's saved one), the activation is a pass over it and only the down GEMM runs. The forward's, and
    the post-norm backward's recompute of y."""
    H = x.shape[1]
    precision = _precision(x.dtype)
    col_mul, up_off = _gate_up_columns(I, kw)
    act_code = activation_code(kw["activation"], kw["gated"])
    gate_up_eng = "given" if h is not None else _gate_up_engine(x, gate_up_proj, gate_up_bias, down_proj, I, kw,
                                                               eng["gathered"])
    if gate_up_eng == "sm90":
        h = torch.empty((disp.num_pairs, 2 * I), dtype=x.dtype, device=x.device) if save_h else None
        act = torch.empty((disp.num_pairs, I), dtype=x.dtype, device=x.device)
        gate_up_sm90.gate_up(x, disp, gate_up_proj, act, h)
    elif gate_up_eng in ("cutlass", "given"):
        if h is None:
            h = cutlass_gemm.grouped_mm(cutlass_gemm.gather_rows(x, disp), _kn(gate_up_proj, kw["transposed"]), disp)
        act = activation_pass.activation_rows(h, disp, _bias_ids(ids, disp.num_experts, gate_up_bias, kw),
                                              gate_up_bias, I, gated=kw["gated"], interleaved=kw["interleaved"],
                                              act=act_code, col_mul=col_mul, up_off=up_off, alpha=kw["alpha"],
                                              limit=kw["limit"])
    else:
        if save_h:
            h = torch.empty((disp.num_pairs, (2 if kw["gated"] else 1) * I), dtype=x.dtype, device=x.device)
        act = torch.empty((disp.num_pairs, I), dtype=x.dtype, device=x.device)
        _gemm(x, disp, gate_up_proj, _gate_up_strides(gate_up_proj, kw["transposed"]), gate_up_bias, act, n=I,
              kd=H, gather=True, gated=kw["gated"], act=act_code, col_mul=col_mul, up_off=up_off, kw=kw,
              cfg=configs.config("gate_up", x.dtype, rows_per_expert, x.device), precision=precision,
              a_scale=w if kw.get("weight_on_input", False) else None, h_out=h)
    if eng["down"] == "cutlass":
        return cutlass_gemm.grouped_mm(act, _kn(down_proj, kw["transposed"]), disp), h
    y = torch.empty((disp.num_pairs, H), dtype=x.dtype, device=x.device)
    _gemm(act, disp, down_proj, _down_strides(down_proj, kw["transposed"]), down_bias, y, n=H, kd=I, gather=False,
          gated=False, act=0, col_mul=1, up_off=0, kw=kw,
          cfg=configs.config("down", x.dtype, rows_per_expert, x.device), precision=precision)
    return y, h


def _identity(source, weights, E, kw, *, rounded):
    """`combine`'s identity argument where the router has choices past the experts, else None: identity experts
    add `source` weighted; zero experts' pairs are only skipped (no source, no weights)."""
    if kw["identity_experts"]:
        return (source, weights, E, rounded)
    return (None, None, E, False) if kw["zero_experts"] else None


def _past_experts(kw) -> bool:
    """Whether the router has choices past the experts (identity or zero experts), whose pairs run no expert."""
    return bool(kw["identity_experts"] or kw["zero_experts"])


def _bias_ids(ids, E, bias, kw):
    """The ids a pass over every sorted row reads an expert bias at: an identity (or zero) pair's row (garbage,
    never read afterwards) reads expert E - 1's rather than past the bias."""
    return ids.clamp(max=E - 1) if _past_experts(kw) and bias is not None else ids


_BACKWARD_PLANS = plan.PlanCache()
# The per-call tensors of a backward (grad_out, grad_topk_weights, hidden_states, topk_weights, topk_ids, h, logits,
# layout, and last the saved norm input), copied into a graph's buffers; the weights (and the expert scale and
# post-norm weight) key it by address.
BACKWARD_GRAPHS = graphs.GraphCache(copied=(0, 1, 2, 10, 11, 12, 13, 14, 17))
_WEIGHTS = (6, 7, 8, 9)  # gate_up_proj, gate_up_bias, down_proj, down_bias among those tensors


def fused_moe_backward(grad_out, grad_topk_weights, hidden_states, router, router_bias, selection_bias, gate_up_proj,
                       gate_up_bias, down_proj, down_bias, topk_weights, topk_ids, **kw):
    """Gradients with the semantics of `reference.fused_moe_backward_reference`. `gate_up_out`, `router_logits`,
    `routing_layout`, `post_norm_input`: h, the logits, the dispatch layout and a post norm's y returned by
    `fused_moe_forward(save_gate_up=True)`; the backward then skips recomputing them (the gate_up GEMM; the router
    GEMM; count, scan and scatter; the down GEMM).
    Replayed from a launch plan (`plan.py`) where this call's signature has one; at few tokens, all but the weight
    gradients from a CUDA graph (`graphs.py`), which cannot write the new full-size tensors those are: they are
    launched after each replay, from the graph's dh and w * act(h) and this call's weights."""
    kw = with_defaults(kw)
    tensors = (grad_out, grad_topk_weights, hidden_states, router, router_bias, selection_bias, gate_up_proj,
               gate_up_bias, down_proj, down_bias, topk_weights, topk_ids, kw.pop("gate_up_out", None),
               kw.pop("router_logits", None), kw.pop("routing_layout", None), kw.pop("expert_scale", None),
               kw.pop("post_norm_weight", None), kw.pop("post_norm_input", None))
    options = tuple(kw.items())

    def planned(*tensors):
        return _BACKWARD_PLANS.call(lambda: _backward(*tensors, **kw), tensors, options)

    def capture(*tensors):  # h is the graph's copy: dh need not go over it, nor its memory be freed
        return _backward(*tensors, defer_weight_gradients=True, **{**kw, "overwrite_gate_up_out": False})

    d_x, d_router, d_router_bias, d_scale, d_post_norm, *weight_grads = BACKWARD_GRAPHS.call(
        planned, tensors, options, capture=capture, also_copied=(3,) if kw["router_is_logits"] else ())
    return d_x, d_router, d_router_bias, *weight_grads, d_scale, d_post_norm


def _bias_grads(go, dh, disp, d_down_bias, d_gu_bias, scale):
    """The bias gradients next to a CUTLASS or CUDA weight gradient: per-expert sums of the (scaled) grad_out rows
    and of the dh rows (the Triton weight gradient sums them in its own loop)."""
    if d_down_bias is not None:
        cutlass_gemm.segment_sum(go, disp, d_down_bias, gather=True, scale=scale)
    if d_gu_bias is not None:
        cutlass_gemm.segment_sum(dh, disp, d_gu_bias, gather=False)


def _free_storage(t):
    t.untyped_storage().resize_(0)


_free_storage.cpp = ("free_storage",)  # the C++ replay's native form of this effect (plan_cpp)


def _backward(grad_out, grad_topk_weights, hidden_states, router, router_bias, selection_bias, gate_up_proj,
              gate_up_bias, down_proj, down_bias, topk_weights, topk_ids, gate_up_out, router_logits, routing_layout,
              expert_scale, post_norm_weight, post_norm_input, defer_weight_gradients=False, **kw):
    """The backward's launches: (d_x, d_router, d_router_bias, d_expert_scale, d_post_norm_weight, d_gu, d_gu_bias,
    d_down, d_down_bias), the weight gradients last. `defer_weight_gradients` (a graph's capture, T > 0): return
    ((d_x, d_router, d_router_bias, d_expert_scale, d_post_norm_weight), (fn, held, _WEIGHTS)), the weight gradients
    left to `fn(*held, *weights)`, the weights being the call's tensors at positions `_WEIGHTS` (gate_up_proj,
    gate_up_bias, down_proj, down_bias)."""
    overwrite_h = kw.pop("overwrite_gate_up_out", False)  # `mok::fused_moe_backward_consume`: h is dead after
    spent = kw.pop("spent_weights", ())  # its weights ("gate_up_proj", "down_proj") dead after too: freed once read
    x = hidden_states.contiguous()
    T, H = x.shape
    E, I = _sizes(gate_up_proj, down_proj, kw)
    R = routing_width(gate_up_proj, kw)  # the router's choices: the experts, then any identity or zero experts
    K = topk_ids.shape[1]
    transposed, gated, woi = kw["transposed"], kw["gated"], kw.get("weight_on_input", False)
    zeros_like = torch.zeros_like
    if T == 0:
        d_router = zeros_like(router)
        return (zeros_like(x), d_router, None if router_bias is None else zeros_like(router_bias),
                None if expert_scale is None else zeros_like(expert_scale),
                None if post_norm_weight is None else zeros_like(post_norm_weight),
                zeros_like(gate_up_proj), None if gate_up_bias is None else zeros_like(gate_up_bias),
                zeros_like(down_proj), None if down_bias is None else zeros_like(down_bias))

    topk_ids = topk_ids.contiguous()
    saved_logits = _saved_logits(router_logits, T, R, kw)  # checked here, before any launch
    post_norm_input = _saved_norm_input(post_norm_input, gate_up_out, T * K, x, kw)
    if routing_layout is not None:
        disp = Dispatch.from_layout(routing_layout, E, K, T * K, num_buckets=R)
    else:
        disp = Dispatch.from_ids(topk_ids, E, num_buckets=R)
    rows_per_expert = T * K / R  # at even routing over the router's choices (identity and zero experts run no rows)
    precision = _precision(x.dtype)
    go = grad_out.to(x.dtype).contiguous()
    w_flat = topk_weights.reshape(-1).contiguous()
    col_mul, up_off = _gate_up_columns(I, kw)
    up_out = 2 if gated else 1
    TK = T * K

    eng = _engines(x, gate_up_proj, down_proj, I, rows_per_expert, kw)
    act_code = activation_code(kw["activation"], gated)
    w1_k, w1_n = _gate_up_strides(gate_up_proj, transposed)
    w2_i, w2_h = _down_strides(down_proj, transposed)

    def act_bwd(h, g2, weights):  # (dh, weights * act(h), partial d(topk_weights)) from a stored h
        return activation_pass.activation_bwd_rows(
            h, g2, weights, disp, _bias_ids(topk_ids, E, gate_up_bias, kw), gate_up_bias, I, gated=gated,
            interleaved=kw["interleaved"], act=act_code, col_mul=col_mul, up_off=up_off, alpha=kw["alpha"],
            limit=kw["limit"], h_is_saved=gate_up_out is not None and not overwrite_h)

    gos = xs = d_post_norm = None
    wgrad_go = go  # the down weight's gradient reads grad_out per token, or with a post norm dy in sorted rows
    if kw["post_norm"] != "none":
        # What reaches y is the norm's backward of w * go[t]: y as the training forward saved it (else recomputed,
        # from the saved h where there is one), then dy per sorted row, which the chain reads as already weighted
        # rows (unit weights; g2 ungathered). dy goes over y where y is recomputed, or saved and dead after this.
        if post_norm_input is not None:
            y, h, dy = post_norm_input, gate_up_out, post_norm_input if overwrite_h else None
        else:
            y, h = _expert_rows(x, disp, topk_ids, None, gate_up_proj, gate_up_bias, down_proj, down_bias, I, kw,
                                eng, rows_per_expert, save_h=gate_up_out is None, h=gate_up_out)
            dy = y
        wgrad_go, dw_parts, d_post_norm = post_norm.backward_rows(y, post_norm.scale(kw, post_norm_weight), go,
                                                                  w_flat, disp, topk_ids, post_norm_weight, kw, dy=dy)
        del y, dy
        if eng["gathered"] == "cutlass":
            g2 = cutlass_gemm.grouped_mm(wgrad_go, _kn(down_proj, transposed, backward=True), disp)
        else:
            g2 = _g2_triton(wgrad_go, disp, down_proj, (w2_h, w2_i), I, kw, rows_per_expert, precision, gather=False)
        dh, act_w, _ = act_bwd(h, g2, None)  # unit weights: g2 is weighted, and d(topk_weights) is the norm's
        del h, g2
    elif eng["gathered"] == "cutlass" or gate_up_out is not None:
        # Sorted copies of go and x rows for the CUTLASS stages that read them ([T*K, H] each), made just
        # before their first use and dropped after their last (peak memory: with the saved h, only one of
        # them is alive at a time).
        # g2 = go[t] @ W2[e]^T per pair; then h (saved or recomputed) with dh, act(h), partial d(topk_weights).
        if eng["gathered"] == "cutlass":
            gos = cutlass_gemm.gather_rows(go, disp)
            if gate_up_out is None:
                xs = cutlass_gemm.gather_rows(x, disp)
            g2 = cutlass_gemm.grouped_mm(gos, _kn(down_proj, transposed, backward=True), disp)
        else:
            g2 = _g2_triton(go, disp, down_proj, (w2_h, w2_i), I, kw, rows_per_expert, precision)
        h = gate_up_out
        if h is None:
            h = cutlass_gemm.grouped_mm(xs, _kn(gate_up_proj, transposed), disp)
        dh, act_w, dw_parts = act_bwd(h, g2, w_flat)
        del h, g2
    else:
        dh, act_w, dw_parts = _gate_up_backward_triton(x, go, disp, w_flat, gate_up_proj, gate_up_bias, down_proj,
                                                       I, kw, rows_per_expert, precision, (w1_k, w1_n),
                                                       (w2_h, w2_i), col_mul, up_off, act_code)

    # A spent W1 is read last by dgrad. Where dgrad's output is the smaller of the two, dgrad goes first, so that W1's
    # memory is free for the weight gradients; else W1 is freed after dgrad. (A graph's replay runs dgrad, and the
    # weight gradients follow each replay: they free every spent weight.)
    w1_freed_here = "gate_up_proj" in spent and not defer_weight_gradients
    dgrad_first = w1_freed_here and TK * H < gate_up_proj.numel()
    w1_after_dgrad = w1_freed_here and not dgrad_first
    freed_by_gradients = tuple(n for n in spent if n != "gate_up_proj") if w1_after_dgrad else spent
    # Weight gradients: each expert's rows reduced in sorted order. Deferred (a graph's capture): launched after
    # each replay of the rest, into new tensors (`graphs.GraphCache`'s finish).
    weight_gradients = functools.partial(_weight_gradients, eng=eng, kw=kw, top_k=K, rows_per_expert=rows_per_expert,
                                         precision=precision, spent=freed_by_gradients)
    work = [disp.layout, wgrad_go, x, w_flat, act_w, dh, gos, xs, gate_up_proj, gate_up_bias, down_proj, down_bias]
    del act_w, gos, xs, wgrad_go  # (held by `work` alone: the weight gradients free them after their last read)

    def dgrad(dh):  # d(input) of each pair, summed per token by the final combine
        nonlocal dw_parts
        if eng["dgrad"] == "cutlass":
            return cutlass_gemm.grouped_mm(dh, _kn(gate_up_proj, transposed, backward=True), disp)
        dxp = torch.empty((TK, H), dtype=x.dtype, device=x.device)
        dcfg = configs.config("dgrad", x.dtype, rows_per_expert, x.device)
        if woi:  # d w[t,k] = <dxs, x[t]>: partial sums per H-tile from the fp32 accumulator
            dw_parts = torch.empty((cdiv(H, dcfg["BLOCK_N"]), TK), dtype=torch.float32, device=x.device)
        _gemm(dh, disp, gate_up_proj, (w1_n, w1_k), None, dxp, n=H, kd=up_out * I, gather=False, gated=False, act=0,
              col_mul=1, up_off=0, kw=kw, cfg=dcfg, precision=precision, dw_dot=x if woi else None,
              dw_parts=dw_parts if woi else None)
        return dxp

    if dgrad_first:
        dxp = dgrad(dh)
    if defer_weight_gradients:  # the weights from each call, as `_WEIGHTS` of its tensors (`graphs.GraphCache.call`)
        deferred = (lambda *args: weight_gradients(list(args)), work[:-len(_WEIGHTS)], _WEIGHTS)
    else:
        d_gu, d_gu_bias, d_down, d_down_bias = weight_gradients(work, disp=disp)
    del work
    if not dgrad_first:
        dxp = dgrad(dh)
    if w1_after_dgrad:
        plan.effect(_free_storage, gate_up_proj)
    del dh
    if overwrite_h and gate_up_out._base is None:
        # dh lived in h's memory and h is dead: release it now rather than when autograd drops its saved
        # tensors after this op returns (the router and combine below would otherwise stack on top of it).
        plan.effect(_free_storage, gate_up_out)  # no aten op: a plan's recording must be told

    # Router.
    dw_extra = None
    if grad_topk_weights is not None:
        dw_extra = grad_topk_weights.float()
    if down_bias is not None and not woi:  # <go[t], b2[e]> part of d(topk_weights): one small GEMM, then a gather
        bias_term = (go.float() @ down_bias.float().t()).gather(1, _bias_ids(topk_ids, E, down_bias, kw))
        if _past_experts(kw):
            bias_term = bias_term.masked_fill(topk_ids >= E, 0.0)
        dw_extra = bias_term if dw_extra is None else dw_extra + bias_term
    # An identity pair added w * x[t]: its d(w) is <grad_out[t], x[t]> (route_backward adds it); a zero pair's is 0.
    identity_dot = row_dots(grad_out.contiguous(), x) if kw["identity_experts"] else None
    logits = saved_logits if saved_logits is not None else _logits(x, router, router_bias, kw)
    # d(logits) feeds the router's gradients in the router's own dtype (bf16 for most models, as HF's autograd
    # does it), so route_bwd stores it in that dtype, unless an fp32 sum (the router bias's gradient) or an fp32
    # router's GEMMs on the tensor cores (DeepSeek's; cuBLAS would run its SIMT fp32 path: router_gemm.py) read it.
    fp32_router_gemm = not kw["router_is_logits"] and router_gemm.enabled(x, router)
    dl_dtype = torch.float32 if router_bias is not None or fp32_router_gemm else router.dtype
    dl = route_backward(logits, topk_ids, disp.pair_pos, dw_parts,
                        None if dw_extra is None else dw_extra.contiguous(), routing=kw["routing"],
                        renormalize=kw["renormalize"], renorm_eps=kw["renorm_eps"], routed_scale=kw["routed_scale"],
                        out_dtype=dl_dtype, renorm_min=kw["renorm_min"],
                        expert_scale=None if expert_scale is None else expert_scale.contiguous(), num_experts=E,
                        identity_dot=identity_dot, softmax_fp32=kw["softmax_fp32"], jitter_eps=kw["jitter_eps"])
    d_scale = None
    if expert_scale is not None:  # each expert's pairs summed in sorted order: deterministic
        dl, dscale_sorted = dl
        d_scale = torch.empty((E, 1), dtype=expert_scale.dtype, device=x.device)
        cutlass_gemm.segment_sum(dscale_sorted.view(TK, 1), disp, d_scale, gather=False)
        d_scale = d_scale.view(E)
    if kw["router_is_logits"]:
        d_router, d_router_bias, dx_router = dl.to(router.dtype), None, None
    else:
        d_router_bias = None if router_bias is None else dl.sum(dim=0).to(router_bias.dtype)
        if fp32_router_gemm:  # its GEMMs on the tensor cores, fp32-accurate
            d_router = router_gemm.matmul(dl.t(), x)
            dx_router = router_gemm.matmul(dl, router)
        else:
            rdt = router.dtype
            dl_r = dl.to(rdt)  # one cast for both GEMMs (none where route_bwd stored it in rdt)
            d_router = dl_r.t() @ x.to(rdt)
            dx_router = dl_r @ router
    # Weight on input: dx[t] = sum_k w[t,k] * dxs[pos(t,k)] in fp32 (the product not rounded).
    d_x = combine(dxp, disp.pair_pos, topk_weights.contiguous() if woi else None, dx_router, T, K, x.dtype,
                  round_product=False if woi else None, topk_ids=topk_ids,
                  identity=_identity(go, topk_weights.contiguous(), E, kw, rounded=False))
    if defer_weight_gradients:
        return (d_x, d_router, d_router_bias, d_scale, d_post_norm), deferred
    return d_x, d_router, d_router_bias, d_scale, d_post_norm, d_gu, d_gu_bias, d_down, d_down_bias


def _weight_gradients(work, *, eng, kw, top_k, rows_per_expert, precision, disp=None, spent=()):
    """(d_gu, d_gu_bias, d_down, d_down_bias), each expert's rows reduced in sorted order, from `work` =
    [layout, go, x, w_flat, act_w, dh, gos, xs, gate_up_proj, gate_up_bias, down_proj, down_bias] (`gos`, `xs`: the
    sorted go and x rows where the backward made them, else None; with a post norm, go is dy in sorted rows, already
    weighted, and act_w the unweighted act(h)). act_w, gos and xs are taken out of the list, so
    that where the caller keeps no other reference each is freed after its last read, before the next gradient is
    allocated (peak memory; NOTES v39). The weights named in `spent` are read by now (the gradients take only their
    shapes): their memory is freed first."""
    layout, go, x, w_flat, _, dh, _, _, gate_up_proj, gate_up_bias, down_proj, down_bias = work
    for name, weight in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if name in spent:
            plan.effect(_free_storage, weight)
    act_w, gos, xs = work[4], work[6], work[7]
    work[4] = work[6] = work[7] = None
    E, I = _sizes(gate_up_proj, down_proj, kw)
    if disp is None:
        disp = Dispatch.from_layout(layout, E, top_k, w_flat.shape[0], num_buckets=routing_width(gate_up_proj, kw))
    H = x.shape[1]
    transposed, woi = kw["transposed"], kw.get("weight_on_input", False)
    go_rows = kw["post_norm"] != "none"  # go: sorted rows, read as they are (no down bias: `check_inputs`)
    up_out = 2 if kw["gated"] else 1
    d_down_bias = None if down_bias is None else torch.empty_like(down_bias)
    d_gu_bias = None if gate_up_bias is None else torch.empty_like(gate_up_bias)
    wgrad_eng = eng["wgrad"]
    if wgrad_eng == "sm90" and go.data_ptr() % 16:  # the CUDA kernel reads grad_out rows in 16-byte chunks
        wgrad_eng = "cutlass"
    if wgrad_eng == "sm90":  # rows gathered in-kernel
        del gos, xs
        d_down = torch.empty_like(down_proj)
        if transposed:
            wgrad_sm90.wgrad(act_w, go, disp, d_down, q_gather=not go_rows)
        else:
            wgrad_sm90.wgrad(go, act_w, disp, d_down, p_gather=not go_rows)
        del act_w  # its last read: freed before d_gu is made, as on the other engines
        d_gu = torch.empty_like(gate_up_proj)
        if transposed:
            wgrad_sm90.wgrad(x, dh, disp, d_gu, p_gather=True)
        else:
            wgrad_sm90.wgrad(dh, x, disp, d_gu, q_gather=True)
        _bias_grads(go, dh, disp, d_down_bias, d_gu_bias, None if woi else w_flat)
    elif wgrad_eng == "cutlass":
        if gos is None:
            gos = go if go_rows else cutlass_gemm.gather_rows(go, disp)
        d_down = cutlass_gemm.wgrad(act_w, gos, disp) if transposed else cutlass_gemm.wgrad(gos, act_w, disp)
        del gos, act_w
        if xs is None:
            xs = cutlass_gemm.gather_rows(x, disp, scale=w_flat if woi else None)
        d_gu = cutlass_gemm.wgrad(xs, dh, disp) if transposed else cutlass_gemm.wgrad(dh, xs, disp)
        del xs
        _bias_grads(go, dh, disp, d_down_bias, d_gu_bias, None if woi else w_flat)
    else:
        del gos, xs
        wcfg = configs.config("wgrad", x.dtype, rows_per_expert, x.device)
        d_down = torch.empty_like(down_proj)
        _wgrad(go, act_w, disp, None if woi or go_rows else w_flat, d_down, d_down_bias, P=H, Q=I,
               p_gather=not go_rows, q_gather=False, strides_pq=_down_strides(d_down, transposed)[::-1], cfg=wcfg,
               precision=precision)
        del act_w  # its last read: freed before d_gu is made (peak memory; NOTES v39)
        d_gu = torch.empty_like(gate_up_proj)
        _wgrad(dh, x, disp, None, d_gu, d_gu_bias, P=up_out * I, Q=H, p_gather=False, q_gather=True,
               strides_pq=_gate_up_strides(d_gu, transposed)[::-1], cfg=wcfg, precision=precision,
               q_scale=w_flat if woi else None)

    return d_gu, d_gu_bias, d_down, d_down_bias


def _g2_triton(go, disp, down_proj, w2_kn_strides, I, kw, rows_per_expert, precision, gather=True):
    """g2 = go[token] @ W2[e]^T per pair (gathered Triton GEMM); not `gather`: go holds sorted rows (a post norm's
    dy)."""
    g2 = torch.empty((disp.num_pairs, I), dtype=go.dtype, device=go.device)
    _gemm(go, disp, down_proj, w2_kn_strides, None, g2, n=I, kd=go.shape[1], gather=gather, gated=False, act=0,
          col_mul=1, up_off=0, kw=kw, cfg=configs.config("bwd_g2", go.dtype, rows_per_expert, go.device),
          precision=precision)
    return g2


def _gate_up_backward_triton(x, go, disp, w_flat, gate_up_proj, gate_up_bias, down_proj, I, kw, rows_per_expert,
                             precision, w1_kn_strides, w2_kn_strides, col_mul, up_off, act_code):
    """(dh, w * act(h), dw_parts) by the Triton g2 GEMM + `_gate_up_bwd_kernel` (h recomputed, never stored)."""
    TK, E = disp.num_pairs, disp.num_experts
    gated, woi = kw["gated"], kw.get("weight_on_input", False)
    g2 = _g2_triton(go, disp, down_proj, w2_kn_strides, I, kw, rows_per_expert, precision)
    cfg = configs.config("bwd_gate_up", x.dtype, rows_per_expert, x.device)
    n_parts = cdiv(I, cfg["BLOCK_N"])
    # Weight on input: d(topk_weights) comes from dgrad's epilogue instead; nothing is written here.
    dw_parts = torch.empty((1, 1) if woi else (n_parts, TK), dtype=torch.float32, device=x.device)
    dh = torch.empty((TK, (2 if gated else 1) * I), dtype=x.dtype, device=x.device)
    act_w = torch.empty((TK, I), dtype=x.dtype, device=x.device)  # w * act(h), per pair row
    grid = (grid_rows(TK, E, cfg["BLOCK_M"]) * n_parts,)
    launcher(_gate_up_bwd_kernel)[grid](
        x, disp.sorted_pair, w_flat, gate_up_proj, gate_up_bias if gate_up_bias is not None else x, g2, dh, act_w,
        dw_parts, disp.block_table(cfg["BLOCK_M"]), I, x.shape[1], E, TK, x.stride(0), gate_up_proj.stride(0),
        *w1_kn_strides, gate_up_bias.stride(0) if gate_up_bias is not None else 0, g2.stride(0), dh.stride(0),
        act_w.stride(0), col_mul, up_off, float(kw["alpha"]), float(kw["limit"]),
        TOPK=disp.top_k, GATED=gated, INTERLEAVED=gated and kw["interleaved"], ACT=act_code,
        HAS_BIAS=gate_up_bias is not None,
        PRECISION=precision, **cfg, **({"WOI": True} if woi else {}),
        **({"B_BLOCKED": True} if _blocked_b(gated, col_mul, w1_kn_strides) else {}),
        **({"HALF_TAIL": True} if configs.half_tail(cfg["BLOCK_M"]) else {}),
    )
    return dh, act_w, dw_parts
