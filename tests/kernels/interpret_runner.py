"""Runs the Triton kernels under TRITON_INTERPRET=1 on the CPU and prints one JSON line per check.

Started in a subprocess by test_triton_interpret.py, so that the variable is set before Triton
and the kernel modules are first imported (pytest may have imported Triton already).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from mok_compile.kernels import configs, cutlass_gemm, dispatch, grouped_gemm, moe  # noqa: E402
from mok_compile.ops import reference  # noqa: E402
from mok_compile.ops.spec import with_defaults  # noqa: E402
from tests.kernels.cases import (CUTLASS_INTERPRET_CASES, HALF_TAIL_BLOCK_M, HALF_TAIL_INTERPRET_CASES,  # noqa: E402
                                 HALF_TAIL_TMA_INTERPRET_CASES, INTERPRET_CASES, TMA_INTERPRET_CASES, make_case,
                                 rel_err, tied_tokens)

def _tie_at_top_k(tensors, kw):
    """Whether some token's pick has an exact tie (`tied_tokens`): either pick is then right and the outputs differ by
    design."""
    return bool(tied_tokens(tensors, kw).any())


# The fp16 forward rounds x @ W1 before adding the bias (HF's order), which moves a pre-activation near zero by up
# to half an ulp of |x @ W1| (about |bias| <= 0.5 there: 2.4e-4); the saved h then can sit across ReLU's kink from
# the reference's fp32 recomputation (~1% of random fp16 inputs), and the gradient of that element differs by design.
RELU_KINK_MARGIN = 5e-4


def _near_relu_kink(tensors, kw):
    """Whether some routed pair's ReLU pre-activation (fp32) lies within RELU_KINK_MARGIN of zero."""
    kw = with_defaults(kw)
    if kw["activation"] != "relu":
        return False
    _, w, ids = reference.fused_moe_reference(*tensors, **kw)
    x, w1, b1 = (None if t is None else t.float() for t in (tensors[0], tensors[4], tensors[5]))
    x_in = x.unsqueeze(1) * (w.float().unsqueeze(-1) if kw["weight_on_input"] else 1.0)  # [T, 1 or K, H]
    w1 = w1[ids] if kw["transposed"] else w1[ids].transpose(-1, -2)  # [T, K, H, I]
    h = (x_in.unsqueeze(-2) @ w1).squeeze(-2) + (0 if b1 is None else b1[ids])
    return bool((h.abs() < RELU_KINK_MARGIN).any())


@contextlib.contextmanager
def _recomputes():
    """Counts the backward's routing recomputations inside the block: the router logits (`moe._logits`) and the
    dispatch's count (`dispatch.count_chunks`, called by `Dispatch.from_ids`; scan and scatter follow it)."""
    calls = collections.Counter()
    real_logits, real_count = moe._logits, dispatch.count_chunks

    def logits(*a, **k):
        calls["logits"] += 1
        return real_logits(*a, **k)

    def count(*a, **k):
        calls["count"] += 1
        return real_count(*a, **k)

    moe._logits, dispatch.count_chunks = logits, count
    try:
        yield calls
    finally:
        moe._logits, dispatch.count_chunks = real_logits, real_count


def check(variant, T, H, I, E, K, dtype, prefix="", accept=None, ab_env=None):
    """`accept(tensors, kw)`: a condition on the inputs; `ab_env` (name, value): also rerun the kernels with
    that environment variable and record their relative differences to the first run (`ab_err`), and the
    programs that `TILES` counted in each run (`tiles`, `ab_tiles`)."""
    while True:  # fresh inputs each run (the seed is printed to reproduce a failure), without exact ties or kinks
        seed = int.from_bytes(os.urandom(2), "little")
        tensors, kw = make_case(variant, T, H, I, E, K, dtype, seed=seed)
        if not _tie_at_top_k(tensors, kw) and not _near_relu_kink(tensors, kw) and (accept is None
                                                                                    or accept(tensors, kw)):
            break
    out, w, ids = moe.fused_moe_forward(*tensors, **kw)
    r_out, r_w, r_ids = reference.fused_moe_reference(*tensors, **kw)
    res = {"case": f"{prefix}{variant}/T{T}/{str(dtype)[6:]}", "seed": seed}
    res["ids_equal"] = bool(torch.equal(ids.sort(1)[0], r_ids.sort(1)[0]))
    res["w_err"] = rel_err(w.gather(1, ids.sort(1)[1]), r_w.gather(1, r_ids.sort(1)[1]))
    res["out_err"] = rel_err(out, r_out)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    gw = torch.randn(w.shape, generator=torch.Generator().manual_seed(2)).to(w.dtype)
    grads = moe.fused_moe_backward(go, gw, *tensors, w, ids, **kw)
    r_grads = reference.fused_moe_backward_reference(go, gw, *tensors, w, ids, **kw)
    names = ("dx", "drouter", "drouter_bias", "dw1", "db1", "dw2", "db2")
    res["grad_err"] = {n: rel_err(a, b) for n, a, b in zip(names, grads, r_grads) if b is not None}
    res["grad_missing"] = [n for n, a, b in zip(names, grads, r_grads) if (a is None) != (b is None)]
    if not kw.get("weight_on_input"):  # the training forward's saved h, read by the backward instead of recomputed
        *fwd, h, logits, layout, _ = moe.fused_moe_forward(*tensors, save_gate_up=True, **kw)
        res["saved_out_equal"] = bool(torch.equal(fwd[0], out))
        saved = moe.fused_moe_backward(go, gw, *tensors, w, ids, gate_up_out=h, **kw)
        res["grad_err_saved"] = {n: rel_err(a, b) for n, a, b in zip(names, saved, r_grads) if b is not None}
        res["h_unchanged"] = bool(torch.equal(h, moe.fused_moe_forward(*tensors, save_gate_up=True, **kw)[3]))
        # The backward as autograd calls it: consuming (`mok::fused_moe_backward_consume`: dh written over h) and
        # reading the saved logits and dispatch layout. Nothing of the routing recomputed, the same bits. Its weights
        # spent (as the compiled backward's, where the graph computed them for the op alone): freed once read.
        spent = list(tensors)
        spent[4], spent[6] = tensors[4].clone(), tensors[6].clone()
        with _recomputes() as res["saved_routing_recomputed"]:
            consumed = moe.fused_moe_backward(go, gw, *spent, w, ids, gate_up_out=h.clone(),
                                              overwrite_gate_up_out=True, router_logits=logits, routing_layout=layout,
                                              spent_weights=("gate_up_proj", "down_proj"), **kw)
        res["consume_equal"] = all(a is None or torch.equal(a, b) for a, b in zip(consumed, saved))
        res["spent_freed"] = all(spent[i].untyped_storage().nbytes() == 0 for i in (4, 6))
        # The backward as a CUDA graph captures it (`graphs.py`): the weight gradients left to a function run after
        # the rest, on what the rest kept. The same bits.
        call = (go, gw, *tensors, w, ids, h, logits, layout, None, None, None)  # no expert scale, no post norm
        rest, (weight_gradients, held, reads) = moe._backward(*call, defer_weight_gradients=True,
                                                              **with_defaults(kw))
        res["deferred_holds_no_weight"] = not any(t is not None and t.untyped_storage().data_ptr() ==
                                                  wt.untyped_storage().data_ptr()
                                                  for t in held for wt in tensors[4:] if wt is not None)
        # The public order has the weight gradients before d_scale and d_post_norm.
        d_x, d_router, d_router_bias, d_scale, d_post_norm = rest
        deferred = (d_x, d_router, d_router_bias, *weight_gradients(*held, *[call[i] for i in reads]), d_scale,
                    d_post_norm)
        res["deferred_equal"] = all((a is None and b is None) or torch.equal(a, b) for a, b in zip(deferred, saved))
    if ab_env is not None:
        res["tiles"] = dict(TILES)
        TILES.clear()
        old = os.environ.get(ab_env[0])
        os.environ[ab_env[0]] = ab_env[1]
        try:
            res["ab_err"] = {"out": rel_err(moe.fused_moe_forward(*tensors, **kw)[0], out)}
            b_grads = moe.fused_moe_backward(go, gw, *tensors, w, ids, **kw)
            res["ab_err"].update({n: rel_err(a, b) for n, a, b in zip(names, b_grads, grads) if b is not None})
            if not kw.get("weight_on_input"):
                res["ab_err"]["h"] = rel_err(moe.fused_moe_forward(*tensors, save_gate_up=True, **kw)[3], h)
        finally:
            if old is None:
                del os.environ[ab_env[0]]
            else:
                os.environ[ab_env[0]] = old
        res["ab_tiles"] = dict(TILES)
    return res


def check_tma(case, prefix="tma/", **check_kw):
    """`check` with the Triton GEMMs' B through TMA; counts the descriptors made, so that a silent
    fallback to per-thread loads fails the test."""
    made, gate_up_boxes = [], []
    make = moe._weight_descriptor

    def counting(*args, **kw):
        desc = make(*args, **kw)
        made.append(desc is not None)
        gate_up_boxes.append(desc is not None and len(desc.shape) == 4)
        return desc

    moe._weight_descriptor = counting
    os.environ["MOK_TMA"] = "1"
    try:
        res = check(*case, prefix=prefix, **check_kw)
    finally:
        moe._weight_descriptor = make
        del os.environ["MOK_TMA"]
    res["tma_descriptors"] = sum(made)
    res["tma_gate_up_boxes"] = sum(gate_up_boxes)  # 4-d: gate and up as column blocks in one box
    return res


# Programs of the grouped GEMMs by tile height (HALF_TAIL checks): `_gemm_tile` and `_gate_up_bwd_tile` are
# looked up in the module's globals when the interpreter runs a kernel, so wrappers there see every call.
TILES = collections.Counter()


def _counting(tile):
    height = tile.arg_names.index("BM")

    def counted(*args, **kw):
        TILES[str(getattr(args[height], "value", args[height]))] += 1
        return tile(*args, **kw)

    return counted


def _tails(tensors, kw):
    """(rows per expert, rows in the last row block of each expert with rows) at BLOCK_M = HALF_TAIL_BLOCK_M."""
    counts = torch.bincount(reference.fused_moe_reference(*tensors, **kw)[2].flatten(), minlength=tensors[4].shape[0])
    return counts.tolist(), [(c - 1) % HALF_TAIL_BLOCK_M + 1 for c in counts.tolist() if c > 0]


def _mixed_tails(tensors, kw):
    """Some expert ends in a block of at most half height, another in a taller one; one expert has several."""
    counts, tails = _tails(tensors, kw)
    return min(tails) <= HALF_TAIL_BLOCK_M // 2 < max(tails) and max(counts) > HALF_TAIL_BLOCK_M


def check_half_tail(case, tma=False, ab=False):
    """`check` (`check_tma`) with the GEMM configs at BLOCK_M = HALF_TAIL_BLOCK_M and MOK_HALF_TAIL=1, on inputs
    whose experts end in row blocks of both heights; records the programs run at each height (`tiles`) and
    with `ab` also reruns with MOK_HALF_TAIL=0 (`ab_err`, `ab_tiles`)."""
    saved_cfg, saved_tiles = configs._INTERPRET, (grouped_gemm._gemm_tile, grouped_gemm._gate_up_bwd_tile)
    configs._INTERPRET = {k: {**c, "BLOCK_M": HALF_TAIL_BLOCK_M} if "BLOCK_M" in c else c for k, c in saved_cfg.items()}
    grouped_gemm._gemm_tile, grouped_gemm._gate_up_bwd_tile = map(_counting, saved_tiles)
    os.environ["MOK_HALF_TAIL"] = "1"
    TILES.clear()
    try:
        kw = dict(accept=_mixed_tails, ab_env=("MOK_HALF_TAIL", "0") if ab else None)
        res = check_tma(case, prefix="half/tma/", **kw) if tma else check(*case, prefix="half/", **kw)
    finally:
        configs._INTERPRET = saved_cfg
        grouped_gemm._gemm_tile, grouped_gemm._gate_up_bwd_tile = saved_tiles
        del os.environ["MOK_HALF_TAIL"]
    res.setdefault("tiles", dict(TILES))
    tensors, kw = make_case(*case, seed=res["seed"])
    res["expert_rows"], res["tails"] = _tails(tensors, kw)
    return res


if __name__ == "__main__":
    for case in INTERPRET_CASES:
        print(json.dumps(check(*case)), flush=True)
    for case in TMA_INTERPRET_CASES:
        print(json.dumps(check_tma(case)), flush=True)
    for i, case in enumerate(HALF_TAIL_INTERPRET_CASES):
        print(json.dumps(check_half_tail(case, ab=i == 0)), flush=True)
    for case in HALF_TAIL_TMA_INTERPRET_CASES:
        print(json.dumps(check_half_tail(case, tma=True)), flush=True)
    # The CUTLASS engine's glue (gathers, activation passes, bias sums, layouts) with PyTorch's CPU
    # grouped_mm standing in for CUTLASS: eligibility is patched to ignore the device and dtype.
    cutlass_gemm.eligible = lambda x, w1, w2, I, **_: x.shape[1] % 8 == 0 and I % 8 == 0
    os.environ["MOK_GEMM_ENGINE"] = "cutlass"
    for case in CUTLASS_INTERPRET_CASES:
        print(json.dumps(check(*case, prefix="cutlass/")), flush=True)
    sys.exit(0)
