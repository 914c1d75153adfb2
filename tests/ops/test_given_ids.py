"""`mok::fused_moe` with given expert ids (`expert_ids`, DeepSeek-V4's hash routing) on the CPU kernels.

The ids replace the top-k's choice; the weights are the routing's values at them. A row may name one expert twice,
and each slot is then its own pair, as in HF's experts. Checked in fp64 against the dense oracle of moe_cases.py
(forward, routing weights, every gradient), with gradcheck, in bf16 against the reference, through torch.compile with
dynamic tokens, and in the export decomposition; bad ids fail with an error that names them.
"""

import dataclasses

import pytest
import torch

from mok_compile.export.decompose import EXPERTS_FORMS, fused_moe_decomposed
from mok_compile.ops import reference

from .moe_cases import CASES_BY_NAME, DIFFERENTIABLE, dense_oracle, gradcheck_op, make_args

fused_moe = torch.ops.mok.fused_moe.default

# One case per routing family (the selection bias and groups dropped: given ids leave nothing to choose), and sigmoid
# scores of logits the op takes (router_is_logits: a top-k the op cannot compute kept in the graph, as AXK2's).
GIVEN_CASES = [CASES_BY_NAME[n] for n in ("softmax_topk_renorm_scale_wdtype", "topk_softmax", "sigmoid_deepseek_v3",
                                          "topk_sigmoid_renorm_scale_wdtype", "sqrtsoftplus_deepseek_v4_bf16",
                                          "clamped_silu_gpt_oss", "sigmoid_logits_groups")]


def _given(case, T=6, E=None, dtype=torch.float64, seed=0, requires_grad=False):
    """The case's arguments without anything that chooses, and given ids [T, K] with repeats in some rows."""
    routing = dataclasses.replace(case.routing, n_group=1, topk_group=1)
    case = dataclasses.replace(case, routing=routing, selection_bias=False)
    args, kw = make_args(case, T=T, dtype=dtype, seed=seed, requires_grad=requires_grad)
    E, K = case.num_experts, kw["top_k"]
    ids = torch.randint(0, E, (T, K), generator=torch.Generator().manual_seed(seed + 1))
    if T:
        ids[0] = 1  # one expert in every slot
    return args, {**kw, "expert_ids": ids}


@pytest.mark.parametrize("case", GIVEN_CASES, ids=str)
def test_given_ids_match_the_dense_oracle(case):
    """fp64: the output, the weights (slot by slot) and every gradient equal the oracle's with the same ids."""
    args, kw = _given(case, requires_grad=True)
    out, w, ids = fused_moe(*args, **kw)
    assert torch.equal(ids, kw["expert_ids"])
    assert ids.data_ptr() != kw["expert_ids"].data_ptr()  # a copy: an op's output never aliases its input
    ref_out, _ = dense_oracle(args, kw)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    _, ref_w, _ = reference.fused_moe_reference(*args, **kw)
    torch.testing.assert_close(w, ref_w, rtol=1e-12, atol=1e-14)
    probe = torch.randn_like(out)
    present = [args[i] for i in DIFFERENTIABLE if args[i] is not None]
    grads = torch.autograd.grad((out * probe).sum(), present)
    ref_grads = torch.autograd.grad((ref_out * probe).sum(), present)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("case", GIVEN_CASES[::2], ids=str)
def test_given_ids_gradcheck(case):
    assert gradcheck_op(*_given(case, T=4, requires_grad=True))


def test_given_ids_bf16_match_the_reference():
    """bf16 on the C++ kernel: within one rounding of the reference, repeated ids included."""
    args, kw = _given(CASES_BY_NAME["sqrtsoftplus_deepseek_v4_bf16"], T=9, dtype=torch.bfloat16)
    out, w, _ = fused_moe(*args, **kw)
    ref_out, ref_w, _ = reference.fused_moe_reference(*args, **kw)
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w, ref_w)


def test_given_ids_may_be_int32_and_a_row_may_repeat_an_expert():
    """int32 ids give the int64 ids' results; a row naming one expert K times runs it K times, weighted each time."""
    case = CASES_BY_NAME["topk_softmax"]
    args, kw = _given(case)
    out64 = fused_moe(*args, **kw)[0]
    out32, _, ids32 = fused_moe(*args, **{**kw, "expert_ids": kw["expert_ids"].int()})
    assert ids32.dtype == torch.int64 and torch.equal(out32, out64)
    # Row 0 names expert 1 in both slots: topk_softmax gives each slot weight 1/2, the sum is expert 1's output.
    one = dict(kw, expert_ids=torch.ones(1, 2, dtype=torch.int64))
    x = args[0][:1]
    out = fused_moe(x, *args[1:], **one)[0]
    single = fused_moe(x, *args[1:], **{**one, "top_k": 1, "expert_ids": torch.ones(1, 1, dtype=torch.int64)})[0]
    torch.testing.assert_close(out, single, rtol=1e-12, atol=1e-14)


def test_given_ids_compile_with_dynamic_tokens():
    """The fake kernel takes the ids: compiled (aot_eager, dynamic token count), forward and backward as eager."""
    args, kw = _given(GIVEN_CASES[0], T=7, requires_grad=True)
    ids = kw.pop("expert_ids")

    def f(x, ids, *weights):
        return fused_moe(x, *weights, **kw, expert_ids=ids)[0]

    compiled = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    for T in (7, 3):
        x = args[0][:T].detach().requires_grad_()
        got, want = compiled(x, ids[:T], *args[1:]), f(x, ids[:T], *args[1:])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0],
                                   rtol=1e-12, atol=1e-14)


def test_given_ids_at_zero_tokens():
    args, kw = _given(GIVEN_CASES[0], T=0, requires_grad=True)
    out, w, ids = fused_moe(*args, **kw)
    assert out.shape == (0, 12) and w.shape == ids.shape == (0, 2)
    grads = torch.autograd.grad(out.sum(), [args[i] for i in DIFFERENTIABLE if args[i] is not None])
    assert all(not g.any() for g in grads)


@pytest.mark.parametrize("form", EXPERTS_FORMS)
def test_given_ids_in_the_export_decomposition(form):
    args, kw = _given(CASES_BY_NAME["sqrtsoftplus_deepseek_v4_bf16"], dtype=torch.float64)
    out, w, ids = fused_moe(*args, **kw)
    d_out, d_w, d_ids = fused_moe_decomposed(*args, experts_form=form, **kw)
    assert torch.equal(d_ids, ids)
    torch.testing.assert_close(d_w, w, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(d_out, out, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("ids, kw, match", [
    (torch.zeros(6, 3, dtype=torch.int64), {}, r"expert_ids must be \[T, top_k=2\]"),
    (torch.zeros(6, 2), {}, "expert_ids must be int64 or int32"),
    (torch.zeros(5, 2, dtype=torch.int64), {}, "expert_ids has 5 rows but hidden_states has 6"),
    (torch.zeros(6, 2, dtype=torch.int64), {"n_group": 2, "topk_group": 1, "routing": "sigmoid_grouped_topk"},
     "selection_bias and n_group > 1"),
])
def test_bad_given_ids_are_named(ids, kw, match):
    args, base = _given(GIVEN_CASES[0])
    with pytest.raises((ValueError, RuntimeError), match=match):  # RuntimeError: torch._check of a (symbolic) size
        fused_moe(*args, **{**base, **kw, "expert_ids": ids})


@pytest.mark.parametrize("bad", [4, -1])
def test_given_ids_out_of_range_fail_on_the_cpu(bad):
    args, kw = _given(GIVEN_CASES[0])
    kw["expert_ids"][2, 1] = bad
    with pytest.raises(RuntimeError, match=r"expert_ids holds ids outside \[0, 4\)"):
        fused_moe(*args, **kw)
