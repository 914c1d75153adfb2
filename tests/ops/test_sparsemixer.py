"""The op's sparsemixer routing (PhiMoE at inference) at logits where it is easy to get wrong, and its bad input.

The random cases of `moe_cases.py` cover it against the dense oracle, gradcheck and the C++ kernel; here the C++
kernel (the CPU key) and the reference are checked bit for bit against PhiMoE's own `sparsemixer` on
`moe_cases.sparsemixer_logits`: equal logits, zeros, a negative largest logit, a logit kept and one dropped, one
exactly at the threshold, and random rows.
"""

import pytest
import torch

from mok_compile.ops import reference

from .moe_cases import CASES_BY_NAME, make_args, sparsemixer_logits


def _phimoe_sparsemixer(logits, jitter_eps):
    modeling = pytest.importorskip("transformers.models.phimoe.modeling_phimoe")
    return modeling.sparsemixer(logits, jitter_eps=jitter_eps, training=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_op_routes_as_phimoe_at_edge_logits(dtype):
    """The op's weights and ids (C++ kernel) and the reference's are PhiMoE's, bitwise."""
    logits = sparsemixer_logits(dtype)
    case = CASES_BY_NAME["sparsemixer_phimoe_bf16"]
    args, kw = make_args(case, T=logits.shape[0], dtype=dtype)
    kw = {**kw, "router_is_logits": True, "jitter_eps": 0.1}
    want_w, want_ids = _phimoe_sparsemixer(logits, 0.1)
    _, w, ids = torch.ops.mok.fused_moe(args[0], logits, None, *args[3:], **kw)
    ref_w, ref_ids = reference.sparsemixer(logits, 2, 0.1)
    assert torch.equal(ids, want_ids) and torch.equal(ref_ids, want_ids)
    assert torch.equal(w, want_w) and torch.equal(ref_w, want_w)
    assert ids[:3].tolist() == [[0, 1], [0, 1], [0, 2]]
    assert w[0].tolist() == [torch.tensor(1 / 6, dtype=dtype).item(), torch.tensor(1 / 5, dtype=dtype).item()]
    assert 0.0 < w[4, 0].item() < 1.0  # 2.0 kept beside 2.4 in the first round
    assert w[5, 0] == torch.softmax(torch.tensor([5.0, 4.0], dtype=dtype), dim=0)[0]  # 4.0 kept, 3.9 dropped


@pytest.mark.parametrize("change, message", [
    (dict(selection_bias=True), "selection_bias and expert_ids must not be set"),
    (dict(jitter_eps=-0.1), "jitter_eps must be a finite number >= 0"),
    (dict(jitter_eps=float("inf")), "jitter_eps must be a finite number >= 0"),
])
def test_bad_input_is_named(change, message):
    args, kw = make_args(CASES_BY_NAME["sparsemixer"], T=4)
    args = list(args)
    if change.pop("selection_bias", False):
        args[3] = torch.zeros(args[4].shape[0])
    with pytest.raises(ValueError, match=message):
        torch.ops.mok.fused_moe(*args, **{**kw, **change})


def test_given_ids_are_refused():
    args, kw = make_args(CASES_BY_NAME["sparsemixer"], T=4)
    with pytest.raises(ValueError, match="selection_bias and expert_ids must not be set"):
        torch.ops.mok.fused_moe(*args, **kw, expert_ids=torch.zeros(4, 2, dtype=torch.int64))
