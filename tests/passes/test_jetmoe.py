"""fuse_moe on JetMoE's MoE block: a grouped GEMM written as a loop over the experts' parts of the expert-sorted
rows, split by each expert's token count, which the block reads back to the host (`.tolist()`). With
``torch._dynamo.config.capture_scalar_outputs = True`` Dynamo keeps the block in one graph (the counts become
data-dependent sizes) and the pass fuses it; without it the experts reach the compiler alone and are reported.

    logits = linear(x, Wr).float() ─ topk ─> vals, ids;  w = softmax(vals).type_as(x)
    counts = zeros.scatter(1, ids, 1).long().sum(0).tolist();  perm = ids.flatten().sort()[1];  rows = perm // K
    h = cat([linear(x[rows].split(counts)[e], W1[e]) for e]);  a = silu(h1) * h2
    y = cat([linear(a.split(counts)[e], W2[e]) for e]) * w.flatten()[perm][:, None]
    out = zeros(T, H).index_add(0, rows, y)  (+ bias, after the block)

Near miss: a loop whose expert e's rows meet another expert's weight (the probe disproves it).
"""

import pytest
import torch

from mok_compile.hf_blocks import init_moe_weights_
from mok_compile.passes import fuse_moe

from .helpers import capture, count_fused, run

TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float32: dict(atol=1e-5, rtol=1e-5)}


def _modeling():
    return pytest.importorskip("transformers.models.jetmoe.modeling_jetmoe")


def _block(dtype=torch.float32, capture_scalars=True, block_cls=None):
    """JetMoE's MoE block (8 experts, top-2) with random weights, captured on a [2, 5, 64] input: (gm,
    example_inputs, eager output)."""
    modeling = _modeling()
    config = modeling.JetMoeConfig(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                   kv_channels=16, num_attention_heads=4)
    block = init_moe_weights_((block_cls or modeling.JetMoeMoE)(config), std=0.1).to(dtype).eval()
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch._dynamo.config.patch(capture_scalar_outputs=capture_scalars):
        graphs, eager = capture(block, x, fullgraph=capture_scalars)
    return graphs, eager


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_jetmoe_block_fused(dtype):
    """One graph: fused (top-k on fp32 logits, the softmax of the k in fp32 cast back, gated SiLU experts), the
    per-expert counts and their size checks gone with the block, the output bias left after the op."""
    (graph,), eager = _block(dtype)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    block = report.blocks[0]
    assert (block.num_experts, block.top_k, block.intermediate, block.form) == (8, 2, 32, "split_loop")
    assert (block.routing.routing, block.routing.weights_fp32) == ("topk_softmax", dtype == torch.float32)
    assert block.experts.activation == "silu" and block.experts.gated
    ops = [str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert not any(op in ("item", "split", "topk") or "assert_scalar" in op for op in ops), gm.code
    assert any(n.op == "placeholder" and n.name.endswith("parameters_bias_") and n.users for n in gm.graph.nodes)
    torch.testing.assert_close(run(gm, example)[0], eager, **TOL[dtype])


def test_jetmoe_block_needs_the_probe():
    """validate=False (structure only) leaves the block as it is: which part of the split rows meets which expert's
    weights only the probe proves (the near miss below has the structure of the block)."""
    (graph,), eager = _block()
    gm, example = graph
    report = fuse_moe(gm, example, validate=False)
    assert [b.fused for b in report.blocks] == [False] and "only the probe proves" in report.blocks[0].reason
    torch.testing.assert_close(run(gm, example)[0], eager, atol=0, rtol=0)


def test_jetmoe_split_across_graphs_is_reported():
    """Without capture_scalar_outputs the counts' `.tolist()` breaks the graph: the experts' loop arrives alone and
    is reported (form experts_alone) with the setting that keeps the block whole."""
    graphs, eager = _block(capture_scalars=False)
    reports = [b for gm, example in graphs for b in fuse_moe(gm, example).blocks]
    assert reports and not any(b.fused for b in reports)
    alone = [b for b in reports if b.form == "experts_alone"]
    assert alone and all("capture_scalar_outputs = True" in b.reason for b in alone), [b.reason for b in reports]


def test_jetmoe_experts_meeting_another_experts_weight_not_fused():
    """Near miss: expert e's rows go through expert (e + 1) % E's first weight. Left as it is, the probe's reason."""
    modeling = _modeling()

    class Shifted(modeling.JetMoeParallelExperts):
        def forward(self, inputs, expert_size):
            parts = inputs.split(expert_size, dim=0)
            return torch.cat([torch.nn.functional.linear(parts[i], self.weight[(i + 1) % self.num_experts])
                              for i in range(self.num_experts)], dim=0)

    class Block(modeling.JetMoeMoE):
        def __init__(self, config):
            super().__init__(config)
            self.input_linear = Shifted(config.num_local_experts, self.input_size, self.hidden_size * 2)

    (graph,), eager = _block(block_cls=Block)
    gm, example = graph
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [False] and count_fused(gm) == 0, str(report)
    assert "probe" in report.blocks[0].reason, report.blocks[0].reason
    torch.testing.assert_close(run(gm, example)[0], eager, atol=0, rtol=0)
