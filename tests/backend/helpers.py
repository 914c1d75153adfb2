"""Tiny whole HF CausalLMs and the comparisons the backend tests share."""

from __future__ import annotations

import torch

from mok_compile.demo import make_causal_lm
from mok_compile.hf_blocks import FAMILIES

VOCAB = 128
# MoE layers in every tiny model (make_config's num_layers; DeepSeek-V3 has first_k_dense_replace=0).
NUM_LAYERS = 2


def tiny_model(family: str, dtype=torch.float32, **overrides):
    return make_causal_lm(family, num_layers=NUM_LAYERS, dtype=dtype, **overrides)


def tiny_jetmoe(dtype=torch.float32):
    """JetMoE: experts in the MLP *and* the attention (MoA); `expert_size.tolist()` breaks Dynamo's graph."""
    import transformers

    cfg = transformers.JetMoeConfig(hidden_size=64, num_hidden_layers=NUM_LAYERS, num_key_value_heads=2, kv_channels=16,
                                    intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, vocab_size=VOCAB,
                                    max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    return model.to(dtype).eval()


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


__all__ = ["FAMILIES", "NUM_LAYERS", "tiny_model", "tiny_jetmoe", "token_ids", "forward", "rel_err", "assert_close_rel"]
