"""transformers' experts_implementation="eager" reaches the compiler in pieces: reported with the fix, never fused."""

import pytest
import torch
from torch._dynamo.utils import counters

from mok_compile.hf_blocks import make_block
from mok_compile.passes import fuse_moe

from .helpers import capture


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_eager_experts_fragments_reported_with_fix(family):
    block = make_block(family, dtype=torch.float32, experts_implementation="eager")
    x = torch.randn(2, 5, 64)
    graphs, eager = capture(block, x, fullgraph=False)
    assert len(graphs) > 2  # Dynamo broke the block at nonzero
    reports = []
    for gm, example in graphs:
        before = gm.code
        reports += fuse_moe(gm, example).blocks
        assert gm.code == before  # nothing rewritten
    fragments = [b for b in reports if b.form == "eager_fragment"]
    assert not any(b.fused for b in reports)
    assert len(fragments) == 1  # the expert mask (the router's piece alone looks like top-k sampling)
    assert all('model.set_experts_implementation("grouped_mm")' in b.reason for b in fragments)
    assert counters["mok"]["rejected_moe"] == 1 and counters["mok"]["fused_moe"] == 0


def test_fix_named_in_the_reason_exists():
    from transformers import PreTrainedModel

    assert callable(getattr(PreTrainedModel, "set_experts_implementation", None))
