"""The layer benchmark's runners on a hash-routed DeepSeek-V4 block (transformers >= 5.25), on the CPU at a tiny
size: the block gets its token ids, the op the ids its router looks up, and both give the same output."""

import pytest
import torch

from benchmarks.moe_layer import MAX_HASH_TOKENS, _given_ids, make_runners
from mok_compile import hf_blocks


def test_hash_block_runners_agree():
    pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    cfg = hf_blocks.make_config("deepseek_v4", mlp_layer_types=["hash_moe", "hash_moe"])
    block = hf_blocks.init_moe_weights_(hf_blocks.new_block("deepseek_v4", cfg)).eval()
    assert block.is_hash
    with torch.no_grad():
        block.gate.tid2eid.copy_(torch.rand(128, 8).argsort(dim=-1)[:, :2])
    runners = make_runners("deepseek_v4", block)
    x = torch.randn(1, 9, 64)
    with torch.no_grad():
        want = runners["hf"](x)
        got, ids = runners["mok"](x, with_ids=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(ids, _given_ids(block, 9)["expert_ids"])
    assert _given_ids(block, MAX_HASH_TOKENS)["expert_ids"].shape == (MAX_HASH_TOKENS, 2)
    plain = hf_blocks.make_block("deepseek_v4")  # a learned-router block takes no ids
    assert not plain.is_hash and _given_ids(plain, 9) == {}
