"""The Hopper CUDA weight gradient (csrc/wgrad_sm90.cu, `wgrad_sm90.py`).

On an sm_90 GPU: out[e] = P[rows of e]^T @ Q[rows of e] close to an fp32 reference and bit for bit what PyTorch's
CUTLASS grouped GEMM gives on the gathered rows (both one fp32 sum in sorted row order), with either operand
gathered by token, zeros for experts without rows, the same on a second run, captured and replayed by a CUDA
graph, at the edge shapes (one token, P and Q not multiples of the 128 x 256 tile or of 64, rows per expert not
multiples of 64, all tokens on one expert, E = 256); and the op's backward with its weight gradients on this kernel
equals the CUTLASS one. Anywhere: which calls fit the kernel, and the shapes the op rejects.
"""

from unittest import mock

import pytest
import torch

from mok_compile.kernels import cutlass_gemm, wgrad_sm90
from tests.kernels.cases import generator
from tests.kernels.test_gate_up_sm90 import _experts_hit, _problem, needs_sm90

_KW = dict(gated=True, activation="silu", interleaved=False, transposed=False)


def test_only_calls_that_fit_the_kernel_are_eligible(monkeypatch):
    from mok_compile.kernels import cuda_sm90

    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w1, w2 = torch.zeros(8, 128, 64, dtype=torch.bfloat16), torch.zeros(8, 64, 64, dtype=torch.bfloat16)
    assert not wgrad_sm90.eligible(x, w1, w2, _KW)  # a CPU tensor
    monkeypatch.setattr(cuda_sm90, "on_sm90", lambda t: True)  # the rest checks the tensors alone: CPU ones here
    assert wgrad_sm90.eligible(x, w1, w2, _KW)
    assert wgrad_sm90.eligible(x, w1, w2, {**_KW, "transposed": True, "interleaved": True})
    assert not wgrad_sm90.eligible(x.half(), w1.half(), w2.half(), _KW)
    assert not wgrad_sm90.eligible(x, w1, w2, {**_KW, "weight_on_input": True})
    assert not wgrad_sm90.eligible(x[:, :60], w1[:, :, :60], w2[:, :60], _KW)  # rows not 16-byte aligned
    x_off = torch.zeros(4 * 64 + 4, dtype=torch.bfloat16)[4:].view(4, 64)
    assert not wgrad_sm90.eligible(x_off, w1, w2, _KW)  # x starts 8 bytes past a 16-byte boundary
    assert not wgrad_sm90.eligible(x, w1.transpose(1, 2), w2, _KW)  # not contiguous


def test_the_op_rejects_shapes_that_do_not_fit():
    p = torch.zeros(6, 16, dtype=torch.bfloat16, device="meta")
    q = torch.zeros(6, 24, dtype=torch.bfloat16, device="meta")
    pair = torch.zeros(6, dtype=torch.int32, device="meta")
    counts = torch.zeros(3, dtype=torch.int32, device="meta")
    out = torch.empty(3, 16, 24, dtype=torch.bfloat16, device="meta")
    torch.ops.mok_sm90.wgrad(p, q, pair, counts, counts, out, False, False, 2)  # fits: the meta kernel runs
    with pytest.raises(ValueError, match="do not fit"):
        wgrad_sm90._wgrad_cuda(p, q, pair, counts, counts, out[:2], False, False, 2)  # one expert short
    with pytest.raises(ValueError, match="do not fit"):
        wgrad_sm90._wgrad_cuda(p, q, pair, counts, counts, out, True, False, 2)  # gathered P has 3 token rows
    with pytest.raises(ValueError, match="contiguous"):
        wgrad_sm90._wgrad_cuda(p, q, pair, counts, counts, out[:, :8], False, False, 2)


def _operands(x, disp, P, side, seed):
    """(p, q, p_gather, q_gather) for one weight gradient: the gathered operand is x itself, the other one a
    random [T*K, P] in sorted order (dh or w * act)."""
    g = generator(seed, "cuda")
    rows = torch.randn(disp.num_pairs, P, device="cuda", generator=g).to(torch.bfloat16)
    return (rows, x, False, True) if side == "q" else (x, rows, True, False)


def _fp32_wgrad(p, q, disp, p_gather, q_gather):
    tokens = (disp.sorted_pair // disp.top_k).long()
    out = []
    for e in range(disp.num_experts):
        lo, n = int(disp.expert_start[e]), int(disp.expert_count[e])
        r = torch.arange(lo, lo + n, device="cuda")
        pr = p[tokens[r]] if p_gather else p[r]
        qr = q[tokens[r]] if q_gather else q[r]
        out.append(pr.float().t() @ qr.float())
    return torch.stack(out)


def _cutlass_wgrad(p, q, disp, p_gather, q_gather):
    ps = cutlass_gemm.gather_rows(p, disp) if p_gather else p
    qs = cutlass_gemm.gather_rows(q, disp) if q_gather else q
    return cutlass_gemm.wgrad(ps, qs, disp)


CASES = [  # (T, H, P, E, K, routing, gathered side)
    (1, 64, 128, 8, 2, None, "q"),
    (37, 200, 264, 5, 3, None, "q"),  # H, P not multiples of 64; T not a multiple of anything
    (37, 200, 264, 5, 3, None, "p"),
    (300, 2048, 1536, 128, 8, None, "q"),  # Qwen3's dW1 at a few rows per expert
    (300, 2048, 768, 128, 8, None, "p"),  # and its dW2
    (513, 512, 384, 8, 2, "one_expert", "q"),  # 513 rows on expert 0: 9 K steps, the last one row
    (200, 256, 256, 64, 4, "few_experts", "p"),  # 59 of 64 experts without rows
    (96, 128, 136, 256, 8, None, "q"),
]


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("T,H,P,E,K,routing,side", CASES)
def test_close_to_fp32_and_bitwise_equal_to_cutlass(T, H, P, E, K, routing, side):
    ids = _experts_hit(T, E, K, routing) if routing else None
    x, _, disp = _problem(T, H, 8, E, K, ids)
    p, q, p_gather, q_gather = _operands(x, disp, P, side, seed=T)
    out = torch.full((E, p.shape[1], q.shape[1]), float("nan"), device="cuda", dtype=torch.bfloat16)
    wgrad_sm90.wgrad(p, q, disp, out, p_gather=p_gather, q_gather=q_gather)
    again = wgrad_sm90.wgrad(p, q, disp, torch.empty_like(out), p_gather=p_gather, q_gather=q_gather)
    want = _fp32_wgrad(p, q, disp, p_gather, q_gather)
    torch.cuda.synchronize()
    assert torch.equal(out, again)  # deterministic
    empty = disp.expert_count == 0
    assert (out[empty] == 0).all()  # zeros where an expert has no rows, whatever the buffer held
    assert (out.float() - want).abs().max() <= 1e-2 * want.abs().max()
    assert torch.equal(out, _cutlass_wgrad(p, q, disp, p_gather, q_gather))


@needs_sm90
@pytest.mark.gpu
def test_cuda_graph_replay():
    x, _, disp = _problem(300, 256, 8, 16, 4)
    p, q, p_gather, q_gather = _operands(x, disp, 192, "q", seed=0)
    out = torch.empty(16, 192, 256, device="cuda", dtype=torch.bfloat16)
    wgrad_sm90.wgrad(p, q, disp, out, p_gather=p_gather, q_gather=q_gather)  # builds outside the capture
    want = out.clone()
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wgrad_sm90.wgrad(p, q, disp, out, p_gather=p_gather, q_gather=q_gather)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["qwen3", "gpt_oss", "relu2"])
def test_backward_with_the_cuda_weight_gradients_equals_the_cutlass_one(monkeypatch, variant):
    """The op's backward, weight gradients forced onto each engine: every gradient the same, bit for bit (gpt_oss:
    transposed, interleaved weights with biases; relu2: not gated)."""
    from mok_compile.kernels import moe, plan
    from tests.kernels.cases import make_case

    monkeypatch.setattr(plan, "enabled", False)  # a plan recorded under one engine would replay it under the other
    calls = mock.Mock(wraps=wgrad_sm90.wgrad)  # proof that the CUDA kernel ran, not the engine it falls back to
    monkeypatch.setattr(wgrad_sm90, "wgrad", calls)
    tensors, kw = make_case(variant, T=700, H=256, I=192, E=16, K=4, dtype=torch.bfloat16, device="cuda")
    results = {}
    for engine in ("sm90", "cutlass"):
        monkeypatch.setenv("MOK_GEMM_ENGINE", f"wgrad={engine}")
        out, w, ids = moe.fused_moe_forward(*tensors, **kw)
        go = torch.randn(out.shape, device="cuda", generator=generator(1, "cuda")).to(out.dtype)
        results[engine] = [t for t in moe.fused_moe_backward(go, None, *tensors, w, ids, **kw) if t is not None]
    assert calls.call_count == 2  # dW1 and dW2 ran on the CUDA kernel under sm90 (no fallback to CUTLASS), none else
    for got, want in zip(results["sm90"], results["cutlass"], strict=True):
        assert torch.equal(got, want)


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["qwen3", "gpt_oss"])
def test_the_down_weight_gradients_rows_are_freed_before_the_gate_up_one(monkeypatch, variant):
    """dW2 (grad_out, act(h) * w) runs first and act(h) * w, [T*K, I], is dead before dW1's gradient is made, as on
    the other engines (alive, it would add T*K*I elements to the backward's peak; NOTES v39 (5), v40 (1))."""
    import weakref

    from mok_compile.kernels import moe, plan
    from tests.kernels.cases import make_case

    monkeypatch.setattr(plan, "enabled", False)
    monkeypatch.setenv("MOK_GEMM_ENGINE", "wgrad=sm90")
    calls, real = [], wgrad_sm90.wgrad

    def watched(p, q, disp, out, **kwargs):
        calls.append({"rows": weakref.ref(q if kwargs.get("p_gather") else p),  # the sorted operand
                      "earlier_rows_alive": [c["rows"]() is not None for c in calls]})
        return real(p, q, disp, out, **kwargs)

    monkeypatch.setattr(wgrad_sm90, "wgrad", watched)
    tensors, kw = make_case(variant, T=300, H=256, I=192, E=16, K=4, dtype=torch.bfloat16, device="cuda")
    out, w, ids = moe.fused_moe_forward(*tensors, **kw)
    go = torch.randn(out.shape, device="cuda", generator=generator(1, "cuda")).to(out.dtype)
    moe.fused_moe_backward(go, None, *tensors, w, ids, **kw)
    assert [c["earlier_rows_alive"] for c in calls] == [[], [False]]
