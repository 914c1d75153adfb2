"""The Hopper CUDA gate_up (csrc/gate_up_sm90.cu, `gate_up_sm90.py`).

On an sm_90 GPU: bit for bit the Triton gate_up's output (both are one fp32 sum in K order over the same bf16
products, with the same activation rounding), close to an fp32 reference, the same on a second run, captured and
replayed by a CUDA graph, at the edge shapes (one token, T not a multiple of the tiles, H and I not multiples of
64, all tokens on one expert, most experts empty, E = 256, top-8); and `mok::fused_moe` with the forward gate_up
forced onto it equals the op with the Triton gate_up. Anywhere: which calls fit the kernel (its build:
test_cuda_sm90.py).
"""

from unittest import mock

import pytest
import torch

from mok_compile.kernels import gate_up_sm90
from tests.kernels.cases import generator

_KW = dict(gated=True, activation="silu", interleaved=False, transposed=False)

needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs an sm_90 GPU")


def test_only_calls_that_fit_the_kernel_are_eligible(monkeypatch):
    from mok_compile.kernels import cuda_sm90

    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w1 = torch.zeros(8, 128, 64, dtype=torch.bfloat16)
    assert not gate_up_sm90.eligible(x, w1, None, _KW)  # a CPU tensor
    monkeypatch.setattr(cuda_sm90, "on_sm90", lambda t: True)  # the rest checks the tensors alone: CPU ones here
    assert gate_up_sm90.eligible(x, w1, None, _KW)
    assert not gate_up_sm90.eligible(x.half(), w1.half(), None, _KW)
    assert not gate_up_sm90.eligible(x, w1, torch.zeros(8, 128), _KW)  # a bias
    for change in (dict(interleaved=True), dict(activation="gelu_tanh"), dict(transposed=True),
                   dict(weight_on_input=True), dict(gated=False)):
        assert not gate_up_sm90.eligible(x, w1, None, {**_KW, **change}), change
    assert not gate_up_sm90.eligible(x[:, :60], w1[:, :, :60], None, _KW)  # rows not 16-byte aligned
    x_off = torch.zeros(4 * 64 + 4, dtype=torch.bfloat16)[4:].view(4, 64)
    assert not gate_up_sm90.eligible(x_off, w1, None, _KW)  # x starts 8 bytes past a 16-byte boundary
    assert not gate_up_sm90.eligible(x, w1.transpose(1, 2), None, _KW)  # not contiguous
    assert not gate_up_sm90.eligible(x, torch.zeros(257, 128, 64, dtype=torch.bfloat16), None,
                                     _KW)  # more than 256 experts


def _problem(T, H, I, E, K, ids=None, seed=0):
    from mok_compile.kernels.dispatch import Dispatch

    g = generator(seed, "cuda")
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    w1 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    if ids is None:
        ids = torch.rand(T, E, device="cuda", generator=g).argsort(1)[:, :K]
    ids = ids.to(torch.int32).contiguous()
    return x, w1, Dispatch.from_ids(ids, E)


def _triton_gate_up(x, w1, disp, I, save_h):
    from mok_compile.kernels import configs, moe

    T, H = x.shape
    out = torch.empty(T * disp.top_k, I, device="cuda", dtype=x.dtype)
    h = torch.empty(T * disp.top_k, 2 * I, device="cuda", dtype=x.dtype) if save_h else None
    cfg = configs.config("gate_up", x.dtype, T * disp.top_k / disp.num_experts, x.device)
    moe._gemm(x, disp, w1, moe._gate_up_strides(w1, False), None, out, n=I, kd=H, gather=True, gated=True, act=1,
              col_mul=1, up_off=I, kw=dict(alpha=1.0, limit=0.0), cfg=cfg, precision="ieee", h_out=h)
    return out, h


def _fp32_h(x, w1, disp):
    tokens = (disp.sorted_pair // disp.top_k).long()
    experts = torch.repeat_interleave(torch.arange(disp.num_experts, device="cuda"), disp.expert_count.long())
    return torch.einsum("rh,rnh->rn", x[tokens].float(), w1[experts].float())


def _experts_hit(T, E, K, mode):
    """Routing for the edge cases: every token on experts 0..K-1, or on K of the first K + 1 experts."""
    if mode == "one_expert":  # all tokens on the same K experts: expert 0 gets every token
        return torch.arange(K, device="cuda").repeat(T, 1)
    rows = torch.stack([torch.randperm(K + 1, device="cuda")[:K] for _ in range(T)])
    return rows  # E - K - 1 experts get nothing


CASES = [  # (T, H, I, E, K, routing)
    (1, 64, 128, 8, 2, None),
    (37, 200, 264, 5, 3, None),  # H, I not multiples of 64; T not a multiple of anything
    (300, 2048, 768, 128, 8, None),
    (513, 512, 384, 8, 2, "one_expert"),
    (200, 256, 256, 64, 4, "few_experts"),
    (96, 128, 136, 256, 8, None),
]


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("T,H,I,E,K,routing", CASES)
def test_bitwise_equal_to_the_triton_gate_up(T, H, I, E, K, routing):
    ids = _experts_hit(T, E, K, routing) if routing else None
    x, w1, disp = _problem(T, H, I, E, K, ids)
    want, want_h = _triton_gate_up(x, w1, disp, I, save_h=True)
    got = torch.full_like(want, float("nan"))
    got_h = torch.full_like(want_h, float("nan"))
    gate_up_sm90.gate_up(x, disp, w1, got, got_h)
    again = torch.empty_like(want)
    gate_up_sm90.gate_up(x, disp, w1, again)
    torch.cuda.synchronize()
    assert torch.equal(got, want) and torch.equal(got_h, want_h)
    assert torch.equal(again, got)  # deterministic, and the same with or without h
    h32 = _fp32_h(x, w1, disp)
    assert (got_h.float() - h32).abs().max() <= 1e-2 * h32.abs().max()
    gate, up = h32[:, :I].bfloat16().float(), h32[:, I:].bfloat16().float()
    act32 = (gate * torch.sigmoid(gate)).bfloat16().float() * up
    assert (got.float() - act32).abs().max() <= 2e-2 * act32.abs().max()


@needs_sm90
@pytest.mark.gpu
def test_cuda_graph_replay_and_no_tokens():
    x, w1, disp = _problem(300, 256, 128, 16, 4)
    out = torch.empty(300 * 4, 128, device="cuda", dtype=torch.bfloat16)
    gate_up_sm90.gate_up(x, disp, w1, out)  # builds and sets up outside the capture
    want = out.clone()
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gate_up_sm90.gate_up(x, disp, w1, out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    x0, w10, disp0 = _problem(0, 256, 128, 16, 4)
    empty = torch.empty(0, 128, device="cuda", dtype=torch.bfloat16)
    gate_up_sm90.gate_up(x0, disp0, w10, empty)  # nothing to do, nothing launched


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("training", [False, True])
def test_fused_op_with_the_cuda_gate_up_equals_the_triton_one(monkeypatch, training):
    """The whole op, forward gate_up forced onto each kernel: same outputs (and saved h), bit for bit."""
    from mok_compile.kernels import moe, plan
    from tests.kernels.cases import make_case

    monkeypatch.setattr(plan, "enabled", False)  # each call runs the engine it names, none replays a recording
    calls = mock.Mock(wraps=gate_up_sm90.gate_up)  # proof that the CUDA kernel ran, not the engine it falls back to
    monkeypatch.setattr(gate_up_sm90, "gate_up", calls)
    tensors, kw = make_case("qwen3", T=700, H=256, I=192, E=16, K=4, dtype=torch.bfloat16, device="cuda")
    results = {}
    for engine in ("sm90", "triton"):
        monkeypatch.setenv("MOK_GEMM_ENGINE", f"gate_up={engine}")
        results[engine] = moe.fused_moe_forward(*tensors, save_gate_up=training, **kw)
    assert calls.call_count == 1  # the gate_up ran on the CUDA kernel under sm90 (no fallback to Triton) only
    for got, want in zip(results["sm90"], results["triton"]):
        assert torch.equal(got, want)


@needs_sm90
@pytest.mark.gpu
def test_a_launch_plan_replays_the_cuda_gate_up(monkeypatch):
    """A launch plan records the kernel's op (`torch.ops.mok_sm90.gate_up`) like any other and replays it: the
    third call of a signature (a replay) gives what plans off give, training forward included."""
    from mok_compile.kernels import moe, plan
    from tests.kernels.cases import make_case

    monkeypatch.setenv("MOK_GEMM_ENGINE", "gate_up=sm90")
    monkeypatch.setattr(plan, "enabled", True)
    monkeypatch.setattr(moe, "_FORWARD_PLANS", plan.PlanCache())

    def step(seed):
        tensors, kw = make_case("qwen3", T=300, H=256, I=128, E=16, K=4, dtype=torch.bfloat16, device="cuda",
                                seed=seed)
        return [*moe.fused_moe_forward(*tensors, **kw), *moe.fused_moe_forward(*tensors, save_gate_up=True, **kw)]

    for seed in (1, 2):  # seen once, then recorded
        step(seed)
    assert len(moe._FORWARD_PLANS._plans) == 2
    replayed = step(3)
    monkeypatch.setattr(plan, "enabled", False)
    normal = step(3)
    for r, n in zip(replayed, normal, strict=True):
        assert torch.equal(r, n)
