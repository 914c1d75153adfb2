"""Expert-parallel sentinel masks on the expert path (transformers 5.17's grouped_mm experts build one always).

    mask = (sorted_ids >= E)[:, None];  sorted_ids.clamp_(max=E - 1);  x_g.masked_fill_(mask, 0)
    h = mm(x_g, W1).masked_fill(mask, 0);  ...;  y = mm(a, W2).masked_fill(mask, 0)

The mask is a no-op for ids a top-k over E experts produces, so the block is fused; a mask that does drop
chosen experts (ids >= E - 1) changes the result and the probe rejects it; a mask on activation values is
rejected by structure. Built from scratch (`models.SentinelMaskMoE`), so CI guards the form on any transformers.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from mok_compile.passes import fuse_moe

from . import models
from .helpers import capture, count_fused, ops_in, run

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
MATMULS = [("gather", torch.float32), ("gather", torch.bfloat16), ("grouped", torch.bfloat16)]


def _capture(module, dtype, tokens=12):
    torch.manual_seed(0)
    module = module.to(dtype).eval()
    (graph,), eager = capture(module, torch.randn(tokens, 32, dtype=dtype))
    return graph, eager


def _has_sentinel_ops(gm):
    ops = ops_in(gm)
    return any("ge" in op for op in ops) and "clamp_" in ops and "masked_fill_" in ops and "masked_fill" in ops


@pytest.mark.parametrize("matmul,dtype", MATMULS, ids=[f"{m}-{d}".replace("torch.", "") for m, d in MATMULS])
def test_sentinel_mask_block_fused(matmul, dtype):
    torch.manual_seed(0)
    (gm, example), eager = _capture(models.SentinelMaskMoE(matmul=matmul), dtype)
    assert _has_sentinel_ops(gm), gm.code  # the form under test really reached the pass
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True], str(report)
    assert counters["mok"]["fused_moe"] == 1 and counters["mok"]["rejected_moe"] == 0
    assert count_fused(gm) == 1
    # The whole block went, the in-place clamp and fills included.
    assert not any(op in ("clamp_", "masked_fill_", "masked_fill", "sort") or "ge" == op.split(".")[-1]
                   for op in ops_in(gm)), gm.code
    assert report.blocks[0].form == ("grouped_mm" if matmul == "grouped" else "batched_mm")
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL[dtype])


@pytest.mark.parametrize("matmul,dtype", MATMULS, ids=[f"{m}-{d}".replace("torch.", "") for m, d in MATMULS])
def test_sentinel_mask_that_drops_an_expert_not_fused(matmul, dtype):
    torch.manual_seed(0)
    module = models.SentinelMaskMoE(matmul=matmul, drop_from=7)  # 8 experts: expert 7's slots are zeroed
    (gm, example), eager = _capture(module, dtype)
    before = gm.code
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [False], str(report)
    assert report.rejected[0].reason.startswith("probe: outputs differ"), report.rejected[0].reason
    assert gm.code == before and count_fused(gm) == 0
    assert torch.equal(run(gm, example)[0], eager)


def test_mask_on_activation_values_not_fused():
    torch.manual_seed(0)
    (gm, example), eager = _capture(models.ActivationMaskMoE(), torch.float32)
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [False], str(report)
    assert "is not a mask over expert ids" in report.rejected[0].reason
    assert torch.equal(run(gm, example)[0], eager)
