"""fuse_moe on Zaya's MoE block (transformers >= 5.25): an MLP router on a projection of the tokens (which a layer
past the first adds the previous layer's to) ranks the experts and a skip expert on detached probabilities plus a
selection bias; a token sent to the skip expert gets id 0 and weight 0, so it adds nothing (the op's
`zero_experts`). Its logits are [batch, seq, E + 1]: the op takes them as [T, E + 1] (`router_is_logits`).

    x ─ down_proj ─(+ prev * scale)─ router MLP ─> logits [B, S, E+1] ─ softmax ─> p
        p.detach().float() + bias ─ topk ─> ids;  w = p.gather(2, ids)
        skip = ids == E;  w.masked_fill(skip, 0), ids.masked_fill(skip, 0) ─> grouped_mm experts on x.view(T, H)

Near misses: probabilities of detached logits (the weights carry no router gradient), a detach on the weights
(elsewhere than what chooses), a skip pair that still runs expert 0 at its weight (neither identity nor zero
experts: the probe disproves both).
"""

import pytest
import torch

from mok_compile.diagnostics import describe_block
from mok_compile.hf_blocks import available, init_moe_weights_, make_config
from mok_compile.passes import fuse_moe
from mok_compile.passes.op_names import op_name, tensor_meta

from .helpers import capture, count_fused, run

TOL = {torch.bfloat16: dict(atol=0, rtol=0), torch.float32: dict(atol=1e-5, rtol=1e-5)}


def _modeling():
    if not available(["zaya"]):
        pytest.skip("Zaya is in transformers from 5.25 on")
    return pytest.importorskip("transformers.models.zaya.modeling_zaya")


def _block(layer_idx=1, dtype=torch.float32, block_cls=None, dynamic=False):
    """Zaya's block (8 experts and the skip expert, top-1) with random weights (the router's wide enough that
    tokens choose differently), a selection bias under which some tokens choose the skip expert, captured on a
    [2, 6, 64] input (and the previous layer's router states past the first layer), with symbolic sizes where
    `dynamic`: (gm, example_inputs, eager output, how many tokens chose the skip expert)."""
    modeling = _modeling()
    config = make_config("zaya")
    config._experts_implementation = "grouped_mm"
    block = init_moe_weights_((block_cls or modeling.ZayaSparseMoeBlock)(config, layer_idx), std=0.3).to(dtype).eval()
    with torch.no_grad():
        block.gate.balancing_biases.copy_(torch.linspace(-0.05, 0.05, 9))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 64, generator=gen).to(dtype)
    args = (x,) if layer_idx == 0 else (x, torch.randn(2, 6, 32, generator=gen).to(dtype))
    with torch.no_grad():
        _, probs, _, _ = block.gate(*args[:1], router_states=args[1] if len(args) > 1 else None)
    (graph,), eager = capture(block, *args, dynamic=dynamic)
    return (*graph, eager, int((probs == 0).sum()))


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["first_layer", "router_states"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_zaya_block_fused(dtype, layer_idx):
    """Fused as zero experts (the probe disproves identity experts first), the logits the op's router argument
    viewed as [T, E + 1]; the block's output (bitwise in bf16) and the router states it passes on as eager's."""
    gm, example, eager, skipped = _block(layer_idx, dtype)
    assert 0 < skipped < 12, skipped  # the test proves less unless some tokens choose the skip expert, some not
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True] and count_fused(gm) == 1, str(report)
    block = report.blocks[0]
    assert (block.num_experts, block.top_k) == (8, 1)
    routing = block.routing
    assert (routing.routing, routing.zero_experts, routing.identity_experts) == ("softmax_topk", 1, 0)
    assert routing.router_is_logits and not routing.renormalize
    assert "zero_experts=1" in describe_block(block)
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.mok.fused_moe.default]
    logits = op.args[1]
    assert op_name(logits) == "reshape" and tuple(tensor_meta(logits).shape) == (12, 9)
    assert tensor_meta(logits.args[0]).dim() == 3
    assert op.kwargs["zero_experts"] == 1 and op.args[3] is not None  # the balancing biases: the selection bias
    got = run(gm, example)
    for g, w in zip(got, eager):
        torch.testing.assert_close(g, w, **TOL[dtype])


def test_zaya_block_with_symbolic_sizes_fused():
    """Under dynamic=True the logits are [s0, s1, E + 1] and the experts' tokens s0 * s1: fused, the output eager's."""
    gm, example, eager, _ = _block(dynamic=True)
    assert any(isinstance(e, torch.SymInt) for e in example)
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True] and report.blocks[0].routing.zero_experts == 1, str(report)
    torch.testing.assert_close(run(gm, example)[0], eager[0], **TOL[torch.float32])


def _variant(router_forward):
    """ZayaSparseMoeBlock whose router runs `router_forward(gate, hidden_states, router_states)`."""
    modeling = _modeling()

    class Router(modeling.ZayaRouter):
        def forward(self, hidden_states, router_states=None):
            return router_forward(self, hidden_states, router_states)

    class Block(modeling.ZayaSparseMoeBlock):
        def __init__(self, config, layer_idx):
            super().__init__(config, layer_idx)
            self.gate = Router(config, layer_idx)

    return Block


def _zaya_router(detach_logits=False, detach_weights=False, mask_weights=True):
    """Zaya's router forward, changed: the softmax of detached logits, the final weights detached, or the skip pairs'
    weights left unmasked (their pairs then run expert 0 at that weight)."""

    def forward(gate, hidden_states, router_states):
        h = gate.down_proj(hidden_states)
        if gate.use_eda and router_states is not None:
            h = h + router_states * gate.router_states_scale
        logits = gate.router_mlp(h)
        probs = torch.softmax(logits.detach() if detach_logits else logits, dim=-1)
        chosen = probs.detach().to(torch.float32)
        _, ids = torch.topk(chosen + gate.balancing_biases, gate.top_k, dim=-1)
        w = torch.gather(probs, dim=2, index=ids)
        skip = ids == gate.config.num_experts
        if mask_weights:
            w = w.masked_fill(skip, 0)
        if detach_weights:
            w = w.detach()
        ids = ids.masked_fill(skip, 0)
        return logits.reshape(-1, gate.num_router_classes), w.reshape(-1, gate.top_k), ids.reshape(-1, gate.top_k), h

    return forward


def test_zaya_router_written_again_fused():
    """The near misses' router with Zaya's own steps: fused as the block is (they fail on their change)."""
    gm, example, eager, skipped = _block(block_cls=_variant(_zaya_router()))
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [True] and report.blocks[0].routing.zero_experts == 1, str(report)
    torch.testing.assert_close(run(gm, example)[0], eager[0], **TOL[torch.float32])


@pytest.mark.parametrize("change, reason", [
    (dict(detach_logits=True), "the routing weights are computed from a detached value"),
    (dict(detach_weights=True), "elsewhere than between the router's logits and its top-k"),
    (dict(mask_weights=False), "then as 1 zero experts (Zaya's skip expert), the probe disproves both"),
], ids=["logits_detached", "weights_detached", "skip_runs_expert_0"])
def test_zaya_near_misses_not_fused(change, reason):
    """Weights without the router's gradient (the op's weights carry it), or a skip pair that runs expert 0 at its
    weight: left as they are, with the reason."""
    gm, example, eager, _ = _block(block_cls=_variant(_zaya_router(**change)))
    report = fuse_moe(gm, example)
    assert [b.fused for b in report.blocks] == [False] and count_fused(gm) == 0, str(report)
    assert reason in report.blocks[0].reason, report.blocks[0].reason
    for g, w in zip(run(gm, example), eager):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
