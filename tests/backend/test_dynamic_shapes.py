"""Varying batch and sequence length: `mok` recompiles no more often than its inner compiler alone."""

import pytest
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


def _set(attr: str, value: float):
    def setter(block):
        owner, _, name = attr.rpartition(".")
        setattr(block.get_submodule(owner), name, value)
    return setter


@pytest.mark.parametrize("family, change", [
    ("deepseek_v3", _set("gate.routed_scaling_factor", 4.0)),  # the routed scale
    ("gpt_oss", _set("experts.limit", 0.5)),                    # the clamped SwiGLU's limit (its alpha is read too)
    ("ernie4_5_moe", _set("gate.norm_min", 0.6)),               # the renormalisation's clamp minimum
    ("deepseek_v4", _set("experts.limit", 0.5)),                # transformers >= 5.25
    ("phimoe", _set("router.router_jitter_noise", 0.3)),        # the sparsemixer's threshold, 2 * jitter_eps
])
def test_float_attributes_read_at_run_time_under_dynamic_true(family, change):
    """torch.compile(dynamic=True) traces a module's float attributes as graph inputs (DeepSeek-V3's routed scale,
    GPT-OSS's and DeepSeek-V4's clamp limit and alpha, Ernie 4.5's clamp minimum, PhiMoE's jitter_eps, doubled for
    its sparsemixer's threshold): the block fuses with the op reading them (aot_autograd then has Dynamo specialise
    them behind guards). Outputs as eager's at two token counts, and after an attribute changes (a guard fails:
    recompiled, fused again)."""
    from mok_compile import hf_blocks

    if not hf_blocks.available([family]):
        pytest.skip(f"{family} needs a newer transformers")
    block = hf_blocks.make_block(family)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, backend="mok", options={"compiler": "aot_eager"}, dynamic=True)
    with torch.no_grad():
        for tokens in (5, 9):
            x = torch.randn(2, tokens, 64)
            assert_close_rel(_first(compiled(x)), _first(block(x)), 1e-6, f"output at {tokens} tokens")
        change(block)
        x = torch.randn(2, 7, 64)
        assert_close_rel(_first(compiled(x)), _first(block(x)), 1e-6, "output after the attribute changed")
    assert counters["mok"]["fused_moe"] >= 2 and counters["mok"]["rejected_moe"] == 0, dict(counters["mok"])


def _first(out):
    return out[0] if isinstance(out, tuple) else out
