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
