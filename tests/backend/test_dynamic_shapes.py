"""Varying batch and sequence length: `mok` recompiles no more often than its inner compiler alone."""

import torch
from torch._dynamo.utils import counters

from .helpers import NUM_LAYERS, assert_close_rel, tiny_model, token_ids

# static first, then batch and sequence both change (one dynamic graph), then more sizes and batch 1 (decode)
SHAPES = [(2, 16), (3, 24), (5, 40), (1, 7)]


def compiles_and_fusions(model, backend, options=None):
    """Graphs compiled over SHAPES and MoE blocks fused; every output checked against eager."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=backend, options=options)
    with torch.no_grad():
        for batch, seq in SHAPES:
            ids = token_ids(batch, seq)
            got, want = compiled(ids).logits, model(ids).logits
            assert_close_rel(got, want, 1e-5, f"logits at {batch}x{seq}")
    return counters["stats"]["unique_graphs"], counters["mok"]["fused_moe"]


def test_no_extra_recompiles():
    model = tiny_model("qwen3_moe")
    plain_graphs, _ = compiles_and_fusions(model, "aot_eager")
    mok_graphs, fused = compiles_and_fusions(model, "mok", {"compiler": "aot_eager"})
    assert mok_graphs == plain_graphs, (mok_graphs, plain_graphs)
    # every graph Dynamo produced had its MoE layers fused, the dynamic-shape ones included
    assert fused == NUM_LAYERS * mok_graphs


def test_routed_scale_read_at_run_time_under_dynamic_true():
    """torch.compile(dynamic=True) traces DeepSeek-V3's float `routed_scaling_factor` as a graph input: the block
    fuses with the op reading it (aot_autograd then has Dynamo specialise it behind a guard). Outputs as eager's at
    two token counts, and after the attribute changes (a guard fails: recompiled, fused again)."""
    from mok_compile.hf_blocks import make_block

    block = make_block("deepseek_v3")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, backend="mok", options={"compiler": "aot_eager"}, dynamic=True)
    with torch.no_grad():
        for tokens in (5, 9):
            x = torch.randn(2, tokens, 64)
            assert_close_rel(compiled(x), block(x), 1e-6, f"output at {tokens} tokens")
        block.gate.routed_scaling_factor = 4.0
        x = torch.randn(2, 7, 64)
        assert_close_rel(compiled(x), block(x), 1e-6, "output after the scale changed")
    assert counters["mok"]["fused_moe"] >= 2 and counters["mok"]["rejected_moe"] == 0, dict(counters["mok"])
