"""The kernel benchmarks' problems (`moe_layer.kernel_problem`): routed as the layer benchmark's block routes, or as
the tuner's random router does."""

import pytest
import torch

from benchmarks.moe_layer import SHAPES, build_block, kernel_problem, layer_routing


def test_kernel_problem_names_an_unknown_routing():
    with pytest.raises(ValueError, match="routing must be one of layer, random, got 'tuner'"):
        kernel_problem("qwen3", 4, "tuner")


def test_problem_rejects_a_routing_of_other_shapes():
    """Checked before anything is allocated (so on any machine): x, weights and ids must be [T, H], [T, K], [T, K]."""
    from mok_compile.kernels.tune import _Problem

    x, w, ids = torch.zeros(5, 16), torch.zeros(5, 2), torch.zeros(5, 2, dtype=torch.int64)
    short_ids = torch.zeros(5, 1, dtype=torch.int64)
    for bad in ((torch.zeros(4, 16), w, ids), (x, torch.zeros(5, 3), ids), (x, w, short_ids)):
        with pytest.raises(ValueError, match=r"routing x, weights, ids of shapes .* do not fit T=5, H=16, K=2"):
            _Problem(16, 8, 4, 2, 5, routing=bad)


@pytest.mark.gpu
def test_kernel_problem_runs_the_layers_routing():
    """The problem's tokens, routing and sorted layout are the layer block's (the same seed gives the same ids, also
    with the block passed in, as benchmarks.gemm_bound does); the tuner's random router routes them otherwise."""
    T, E = 300, 128
    x, _, ids = layer_routing("qwen3", T)
    family, sizes, overrides, _ = SHAPES["qwen3"]
    x_given, _, ids_given = layer_routing("qwen3", T, block=build_block(family, sizes, overrides))
    assert torch.equal(x_given, x) and torch.equal(ids_given, ids)  # the block passed in routes as the one built
    problem, note = kernel_problem("qwen3", T)
    assert torch.equal(problem.x, x) and torch.equal(problem.ids, ids)
    counts = torch.bincount(ids.flatten(), minlength=E)
    assert torch.equal(problem.disp.expert_count.long(), counts)
    assert note == (f"layer routing: {int((counts > 0).sum())} of {E} experts hit, "
                    f"{int(counts.min())}-{int(counts.max())} rows")
    tuner, tuner_note = kernel_problem("qwen3", T, "random")
    assert tuner_note.startswith("random routing: ")
    assert not torch.equal(tuner.ids, ids)
    assert torch.equal(tuner.disp.expert_count.long(), torch.bincount(tuner.ids.flatten(), minlength=E))
