"""Tiny whole HF CausalLMs and the comparisons the backend tests share."""

from __future__ import annotations

import torch

from mok_compile.demo import make_causal_lm
from mok_compile.hf_blocks import FAMILIES

VOCAB = 128
# MoE layers in every tiny model (make_config's num_layers; DeepSeek-V3 has first_k_dense_replace=0).
NUM_LAYERS = 2
# bf16 gradients against eager's, relative to the largest: the op's backward computes in fp32 and rounds once, eager
# autograd rounds every bf16 intermediate, so they differ by a few bf16 ulps of the largest gradient.
BF16_GRAD_TOL = 3e-2


def tiny_model(family: str, dtype=torch.float32, **overrides):
    return make_causal_lm(family, num_layers=NUM_LAYERS, dtype=dtype, **overrides)


def tiny_llama4(dtype=torch.float32):
    """Llama4 text model, every layer MoE: dense routing (sigmoid score on the input, every expert runs; the op's
    weight_on_input form), plus a shared expert outside the op."""
    import transformers

    cfg = transformers.Llama4TextConfig(
        hidden_size=64, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
        num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=1, moe_layers=list(range(NUM_LAYERS)),
        no_rope_layers=[1] * NUM_LAYERS, attention_chunk_size=64)
    torch.manual_seed(0)
    return transformers.Llama4ForCausalLM(cfg).to(dtype).eval()


def token_ids(batch=2, seq=16, seed=1):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def forward(model, ids, backend=None, train=False, options=None, aux_loss=False):
    """Logits (and, when training, the loss and every parameter's gradient) of one step, eager or compiled."""
    model.zero_grad(set_to_none=True)
    model.train(train)
    fn = model if backend is None else torch.compile(model, backend=backend, options=options)
    with torch.set_grad_enabled(train):
        out = fn(ids, labels=ids if train else None)
        if not train:
            return out.logits.detach(), None, {}
        if aux_loss:
            assert out.aux_loss is not None, "the model returned no router aux loss"
        loss = out.loss + (out.aux_loss if aux_loss else 0)
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"no gradient reached {missing}"
    return out.logits.detach(), loss.detach(), grads


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| over max |expected|: one number per tensor, scale-free."""
    scale = expected.float().abs().max().clamp_min(1e-12)
    return ((actual.float() - expected.float()).abs().max() / scale).item()


def assert_close_rel(actual, expected, tol, what=""):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative max error {err:.3g} > {tol:g}"


__all__ = ["FAMILIES", "NUM_LAYERS", "tiny_model", "tiny_llama4", "token_ids", "forward", "rel_err", "assert_close_rel"]
