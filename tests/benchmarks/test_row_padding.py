"""The padding benchmark's routings and block count (`benchmarks.row_padding`) on the CPU. The timing needs a GPU."""

import pytest
import torch

from benchmarks.row_padding import even_ids, padded_blocks


@pytest.mark.parametrize("T, K, E", [(4096, 8, 128), (4096, 2, 8), (4096, 8, 256), (4096, 4, 32), (7, 3, 5)])
def test_even_routing_gives_each_token_distinct_experts_and_each_expert_its_share(T, K, E):
    ids = even_ids(T, K, E)
    assert ids.shape == (T, K) and ids.dtype == torch.int32
    assert all(len(set(row)) == K for row in ids.tolist())
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    assert counts.sum() == T * K
    assert counts.max() - counts.min() <= 1
    if T * K % E == 0:
        assert (counts == T * K // E).all()


def test_even_routing_needs_as_many_experts_as_slots():
    with pytest.raises(ValueError, match="top-8 routing needs at least 8 experts"):
        even_ids(16, 8, 4)


def test_a_partial_block_counts_whole_and_an_empty_expert_takes_none():
    assert padded_blocks([1024] * 8) == 64
    # counts like Mixtral's layer routing at T=4096 (NOTES v42 (1)): 69 blocks where 64 would hold the rows
    assert padded_blocks([1041, 986, 1030, 1025, 1019, 1008, 1047, 1036]) == 69
    assert padded_blocks([0, 1, 128, 129]) == 0 + 1 + 1 + 2
    assert padded_blocks([100], block=64) == 2
