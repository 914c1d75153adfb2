"""The compiled-blocks benchmark's set-up, on the CPU (the benchmark itself needs a GPU)."""

import pytest
import torch

from benchmarks.compiled_blocks import FAMILIES, main
from mok_compile import hf_blocks


def test_each_family_builds_at_its_sizes():
    """Each family's block (on the meta device, as the benchmark's config makes it) has its experts' count and
    intermediate size, Zaya's router projection the width the benchmark gives it (256, Zaya1's; the tests' configs use
    another), and AXK2's groups the benchmark's."""
    built = 0
    for family, (sizes, overrides) in FAMILIES.items():
        if hf_blocks.available([family]) != (family,):
            continue
        cfg = hf_blocks.make_config(family, sizes, **overrides)
        with torch.device("meta"):
            block = hf_blocks.new_block(family, cfg)
        down = block.experts.down_proj
        assert down.shape[0] == sizes.experts and sizes.intermediate in down.shape[1:], (family, down.shape)
        if family == "zaya":
            assert block.gate.down_proj.out_features == 256 and block.gate.num_router_classes == sizes.experts + 1
        if family == "axk2":  # its group-limited selection on, with real DeepSeek-V3's groups
            assert (block.gate.num_group, block.gate.topk_group) == (8, 4)
        built += 1
    if not built:
        pytest.skip("these blocks are in transformers from 5.25 on")


def test_unknown_family_is_named():
    with pytest.raises(SystemExit, match=r"unknown families \['mixtral'\]; known: muse_spark, ergo, zaya, granitemoe"):
        main(["--families", "zaya,mixtral"])


def test_lora_and_peft_lora_are_exclusive():
    with pytest.raises(SystemExit, match="--lora-rank and --peft-rank are two ways to add LoRA; give one"):
        main(["--families", "qwen3_moe", "--lora-rank", "4", "--peft-rank", "4"])


def test_peft_lora_baseline_runs_peft_as_shipped():
    """--peft-rank: only PEFT's LoRA factors train; the compiled baseline traces PEFT's own forward (its graph
    breaks), the traced one back after each call for the `backend="mok"` column."""
    from torch._dynamo.utils import counters

    from benchmarks.compiled_blocks import _with_peft_as_shipped, add_peft_expert_lora

    peft = pytest.importorskip("peft")
    block = add_peft_expert_lora(hf_blocks.make_block("qwen3_moe", hf_blocks.BlockSizes()), rank=4)
    trainable = [n for n, p in block.named_parameters() if p.requires_grad]
    assert len(trainable) == 4 and all(".lora_" in n for n in trainable), trainable
    wrapper = peft.tuners.lora.layer.ParamWrapper
    x = torch.randn(1, 5, hf_blocks.BlockSizes().hidden)
    torch._dynamo.reset()
    counters.clear()
    compiled = _with_peft_as_shipped(torch.compile(lambda x: block(x), backend="aot_eager"))
    torch.testing.assert_close(compiled(x), block(x))
    assert sum(counters["graph_break"].values()) > 0
    assert wrapper.forward.peft_forward is not None  # the traced forward is back
