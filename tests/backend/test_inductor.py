"""The suite's inductor compiles (15-40 s each on 2 cores): no-MoE identity, one MoE model end to end, checkpointed or
not."""

import pytest
import torch
from torch._dynamo.utils import counters

from .helpers import NUM_LAYERS, assert_close_rel, forward, tiny_model, token_ids


class DenseBlock(torch.nn.Module):
    """Attention-free transformer-ish block: norm, gated MLP, softmax mixing. Nothing MoE-like in it."""

    def __init__(self, hidden=64):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 2 * hidden)
        self.down = torch.nn.Linear(hidden, hidden)
        self.mix = torch.nn.Linear(hidden, 8)

    def forward(self, x):
        h = self.norm(x)
        gate, up = self.up(h).chunk(2, dim=-1)
        h = self.down(torch.nn.functional.silu(gate) * up)
        weights = torch.softmax(self.mix(h), dim=-1)
        return x + h * weights.sum(-1, keepdim=True) + weights.topk(2, dim=-1).values.sum(-1, keepdim=True)


@pytest.mark.slow
def test_without_moe_mok_is_exactly_inductor():
    torch.manual_seed(0)
    model = DenseBlock().eval()
    x = torch.randn(4, 16, 64)
    with torch.no_grad():
        want = torch.compile(model, backend="inductor")(x)
        torch._dynamo.reset()
        got = torch.compile(model, backend="mok")(x)
    assert counters["mok"]["fused_moe"] == 0 and counters["mok"]["rejected_moe"] == 0
    assert torch.equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_moe_model_end_to_end_with_inductor(checkpointed):
    """Qwen3-MoE, training step: inductor compiles the graph holding mok.fused_moe and its backward, in which
    each layer's backward reads the saved h through `fused_moe_backward_consume` (passes.backward_consume).
    Checkpointed (every decoder layer), the forward keeps nothing of the op for the backward, so it runs the inference
    op (passes.unsaved_forward), and the backward runs the training op again, whose h is not a saved tensor."""
    from mok_compile.ops.cpu import extension_loaded

    from mok_compile.hf_blocks import checkpoint_layers

    model = tiny_model("qwen3_moe")
    if checkpointed:
        checkpoint_layers(model)
    ids = token_ids()
    want_logits, want_loss, want_grads = forward(model, ids, train=True)
    # inductor's caches off: a cached graph would skip the post-grad passes that the counters below count
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        got_logits, got_loss, got_grads = forward(model, ids, backend="mok", train=True)
    assert counters["mok"]["fused_moe"] == NUM_LAYERS
    # fp32 on the CPU: the C++ kernel saves h for the backward where it is built (CI builds it)
    saved = NUM_LAYERS if extension_loaded() else 0
    assert counters["mok"]["backward_consume"] == (0 if checkpointed else saved)
    assert counters["mok"]["unsaved_forward"] == (saved if checkpointed else 0)
    assert_close_rel(got_logits, want_logits, 1e-4, "logits")
    assert_close_rel(got_loss, want_loss, 1e-5, "loss")
    for name, want in want_grads.items():
        assert_close_rel(got_grads[name], want, 1e-3, f"grad of {name}")
