"""The GEMM-bound benchmark's problems (`benchmarks.gemm_bound`): the six expert GEMMs of a layer call, laid out as
the op's weights are, give the same results as one grouped GEMM and as one mm per expert, and both equal the
definitions; and its ratios."""

import pytest
import torch

from benchmarks.gemm_bound import GEMMS, ExpertGemms, bound_rows


@pytest.mark.parametrize("transposed", [False, True])
def test_both_libraries_compute_the_layers_gemms(transposed):
    g = torch.Generator().manual_seed(0)
    E, H, I = 4, 16, 8
    counts = torch.tensor([3, 0, 5, 2])  # expert 1 has no rows: a zero weight gradient
    w1 = torch.randn((E, H, 2 * I) if transposed else (E, 2 * I, H), generator=g)
    w2 = torch.randn((E, I, H) if transposed else (E, H, I), generator=g)
    w1.requires_grad_(), w2.requires_grad_()  # as the block's parameters are
    gemms = ExpertGemms(w1, w2, transposed, counts, generator=g)
    _, x, _ = gemms.problems["gate_up"]
    _, act, _ = gemms.problems["down"]
    _, grad, _ = gemms.problems["g2"]
    _, dh, _ = gemms.problems["dgrad"]
    e_of_row = torch.repeat_interleave(torch.arange(E), counts)

    def per_row(a, w):  # row r times W[e(r)] as the forward (x @ W) or backward (g @ W^T) reads it
        return torch.stack([a[r] @ w[e_of_row[r]] for r in range(a.shape[0])])

    def per_expert(p, q):
        return torch.stack([p[e_of_row == e].t() @ q[e_of_row == e] for e in range(E)])

    w1, w2 = w1.detach(), w2.detach()
    w1_fwd = w1 if transposed else w1.transpose(1, 2)  # [E, H, 2I]
    w2_fwd = w2 if transposed else w2.transpose(1, 2)  # [E, I, H]
    want = {"gate_up": per_row(x, w1_fwd), "down": per_row(act, w2_fwd), "g2": per_row(grad, w2_fwd.transpose(1, 2)),
            "dgrad": per_row(dh, w1_fwd.transpose(1, 2)),
            "dW2": per_expert(act, grad) if transposed else per_expert(grad, act),
            "dW1": per_expert(x, dh) if transposed else per_expert(dh, x)}
    assert want["dW2"].shape == w2.shape and want["dW1"].shape == w1.shape
    for name in GEMMS:
        torch.testing.assert_close(gemms.grouped(name), want[name], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gemms.per_expert(name), want[name], rtol=1e-5, atol=1e-5)
    assert gemms.flops["gate_up"] == 2 * 10 * H * 2 * I and gemms.flops["dW2"] == 2 * 10 * H * I


def test_the_bound_is_compiled_hfs_time_over_the_faster_librarys_gemms():
    row = {"shape": "qwen3", "T": 4096, "hf+comp_fwd_ms": 1.2, "hf+comp_fwd_bwd_ms": 3.6, "mok_fwd_ms": 0.8,
           "mok_fwd_bwd_ms": 3.0, "floor_fwd_ms": 0.4, "floor_fwd_bwd_ms": 1.2, "shared_fwd_ms": 0.0,
           "shared_fwd_bwd_ms": 0.1,
           "grouped_ms": dict(gate_up=0.4, down=0.2, g2=0.2, dgrad=0.4, dW2=0.3, dW1=0.5),
           "per_expert_ms": dict(gate_up=0.9, down=0.1, g2=0.9, dgrad=0.9, dW2=0.9, dW1=0.9)}
    fwd, fb = bound_rows(row)
    assert fwd["x_bound"] == pytest.approx(1.2 / 0.6) and fwd["x_mok"] == pytest.approx(1.5)
    assert fwd["x_at_floor"] == pytest.approx(3.0) and fwd["x_target"] == 2.0
    assert fb["grouped_gemms_ms"] == pytest.approx(2.1) and fb["x_bound"] == pytest.approx(3.6 / 2.1)
    assert fb["x_target"] == 1.8
