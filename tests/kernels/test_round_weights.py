"""`round_weights` and `round_weights_to` (fp32 routing weights rounded to 16 bits: Ergo's through the input dtype,
autocast's bf16 ones on fp32 experts) in the Triton routing kernel: the weights are the unrounded kernel's rounded,
bit for bit, kept fp32; the output is the reference experts' on those weights; the backward is the unrounded one's.
Interpreted in fp16 and fp32 rounded to fp16 (the interpreter truncates bf16), on the GPU in bf16, fp16 and fp32
rounded to bf16."""

import pytest

from tests.kernels.interpreted import background, compare_argv, run_compare

pytest.importorskip("triton")

_CASE = r"""
import torch
from mok_compile.kernels import moe
from mok_compile.ops import reference
from tests.kernels.cases import make_case, rel_err


def compare(device, seed):
    res = {}
    # (the experts' dtype, the weights' rounding): through the input dtype (Ergo), or to 16 bits on fp32 experts
    # (bf16 under autocast; fp16 interpreted)
    if device == "cpu":
        dtypes = ((torch.float16, torch.float16), (torch.float32, torch.float16))
    else:
        dtypes = ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.bfloat16))
    for dtype, round_to in dtypes:
        for variant, T in (("deepseek_v3", 19), ("deepseek_v3", 70), ("qwen3", 19)):
            tensors, kw = make_case(variant, T, 64, 32, 8, 2, dtype, device=device, seed=seed + T)
            kw = dict(kw, weights_fp32=True)
            rounded = dict(kw, round_weights=True) if round_to == dtype else dict(kw, round_weights_to=round_to)
            out, w, ids = moe.fused_moe_forward(*tensors, **rounded)
            _, plain_w, plain_ids = moe.fused_moe_forward(*tensors, **kw)
            names = ("activation", "gated", "interleaved", "transposed", "alpha", "limit")
            x, _, _, _, w1, b1, w2, b2 = tensors
            r_out = reference.experts_reference(x, w, ids, w1, b1, w2, b2, **{k: kw[k] for k in names})
            go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
            grads = moe.fused_moe_backward(go, None, *tensors, w, ids, **rounded)
            plain = moe.fused_moe_backward(go, None, *tensors, w, ids, **kw)
            res[f"{variant}/T{T}/{str(dtype)[6:]}"] = dict(
                ids_equal=bool(torch.equal(ids, plain_ids)), w_dtype=str(w.dtype),
                rounded=bool(torch.equal(w, plain_w.to(round_to).float())), moved=bool(not torch.equal(w, plain_w)),
                out_err=rel_err(out, r_out),
                backward_equal=all(a is None and b is None or torch.equal(a, b) for a, b in zip(grads, plain)))
    return res
"""


def _check(results, n_cases):
    assert len(results) == n_cases
    for name, r in results.items():
        assert r["ids_equal"] and r["w_dtype"] == "torch.float32", (name, r)
        assert r["rounded"] and r["moved"] and r["backward_equal"], (name, r)
        assert r["out_err"] < 2e-3, (name, r)


@background(compare_argv(_CASE))
def test_round_weights_interpreted():
    _check(run_compare(_CASE, "cpu"), n_cases=6)


@pytest.mark.gpu
def test_round_weights_gpu():
    _check(run_compare(_CASE, "cuda"), n_cases=9)
