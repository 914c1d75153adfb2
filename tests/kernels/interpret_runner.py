"""Runs the Triton kernels under TRITON_INTERPRET=1 on the CPU and prints one JSON line per check.

Started in a subprocess by test_triton_interpret.py, so that the variable is set before Triton
and the kernel modules are first imported (pytest may have imported Triton already).
"""

from __future__ import annotations

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from mok_compile.kernels import cutlass_gemm, moe  # noqa: E402
from mok_compile.ops import reference  # noqa: E402
from mok_compile.ops.spec import with_defaults  # noqa: E402
from tests.kernels.cases import (CUTLASS_INTERPRET_CASES, INTERPRET_CASES, TMA_INTERPRET_CASES, make_case,  # noqa: E402
                                 rel_err)

def _tie_at_top_k(tensors, kw):
    """Whether some token's K-th and (K+1)-th selection scores are exactly equal (16-bit logits make
    that likely enough to matter): either pick is then right and the outputs differ by design."""
    kw = with_defaults(kw)
    x, router, router_bias, selection_bias = tensors[:4]
    K, E = kw["top_k"], tensors[4].shape[0]
    if K >= E:
        return False
    logits = reference.router_logits(x, router, router_bias, router_is_logits=kw["router_is_logits"],
                                     router_fp32=kw["router_fp32"])
    choice, _ = reference.selection_scores(logits, selection_bias, routing=kw["routing"],
                                           softmax_fp32=kw["softmax_fp32"], n_group=kw["n_group"],
                                           topk_group=kw["topk_group"])
    ranked = choice.sort(dim=-1, descending=True).values
    return bool((ranked[:, K - 1] == ranked[:, K]).any())


def check(variant, T, H, I, E, K, dtype, prefix=""):
    while True:  # fresh inputs each run (the seed is printed to reproduce a failure), without exact ties
        seed = int.from_bytes(os.urandom(2), "little")
        tensors, kw = make_case(variant, T, H, I, E, K, dtype, seed=seed)
        if not _tie_at_top_k(tensors, kw):
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
        *fwd, h = moe.fused_moe_forward(*tensors, save_gate_up=True, **kw)
        res["saved_out_equal"] = bool(torch.equal(fwd[0], out))
        saved = moe.fused_moe_backward(go, gw, *tensors, w, ids, gate_up_out=h, **kw)
        res["grad_err_saved"] = {n: rel_err(a, b) for n, a, b in zip(names, saved, r_grads) if b is not None}
        res["h_unchanged"] = bool(torch.equal(h, moe.fused_moe_forward(*tensors, save_gate_up=True, **kw)[3]))
    return res


def check_tma(case):
    """`check` with the Triton GEMMs' B through TMA; counts the descriptors made, so that a silent
    fallback to per-thread loads fails the test."""
    made = []
    make = moe._weight_descriptor

    def counting(*args, **kw):
        desc = make(*args, **kw)
        made.append(desc is not None)
        return desc

    moe._weight_descriptor = counting
    os.environ["MOK_TMA"] = "1"
    try:
        res = check(*case, prefix="tma/")
    finally:
        moe._weight_descriptor = make
        del os.environ["MOK_TMA"]
    res["tma_descriptors"] = sum(made)
    return res


if __name__ == "__main__":
    for case in INTERPRET_CASES:
        print(json.dumps(check(*case)), flush=True)
    for case in TMA_INTERPRET_CASES:
        print(json.dumps(check_tma(case)), flush=True)
    # The CUTLASS engine's glue (gathers, activation passes, bias sums, layouts) with PyTorch's CPU
    # grouped_mm standing in for CUTLASS: eligibility is patched to ignore the device and dtype.
    cutlass_gemm.eligible = lambda x, w1, w2, I, **_: x.shape[1] % 8 == 0 and I % 8 == 0
    os.environ["MOK_GEMM_ENGINE"] = "cutlass"
    for case in CUTLASS_INTERPRET_CASES:
        print(json.dumps(check(*case, prefix="cutlass/")), flush=True)
    sys.exit(0)
