"""Tiny Hugging Face models (2 layers) through `export_mlir`: MoE detection, both MLIR forms, numerics.

Form 1 (op kept whole) must hold `mok.fused_moe` exactly once per MoE layer;
form 2 (decomposed) must hold no `torch.operator` and, lowered to
linalg-on-tensors and run on torch-mlir's RefBackend, give the eager logits.
"""

import pytest
import torch

pytest.importorskip("torch_mlir.fx")
tf = pytest.importorskip("transformers")

from mok_compile import export_mlir, hf_blocks  # noqa: E402

from .filecheck import count_matches, filecheck  # noqa: E402
from .refbackend import RefBackendFunction  # noqa: E402

SIZES = hf_blocks.BlockSizes(hidden=32, intermediate=16, experts=4, top_k=2)
LAYERS = 2
VOCAB = 128
FUSED = 'torch.operator "torch.mok.fused_moe"'


def _model(family):
    if family == "llama":  # the non-MoE control
        cfg = tf.LlamaConfig(hidden_size=SIZES.hidden, intermediate_size=2 * SIZES.hidden, num_hidden_layers=LAYERS,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
    else:
        # DeepSeek's attention (MLA) with grouped KV heads fails Dynamo's shape check; MoE is what is tested here.
        overrides = {"num_key_value_heads": 4} if family == "deepseek_v3" else {}
        cfg = hf_blocks.make_config(family, SIZES, num_layers=LAYERS, **overrides)
    cfg.use_cache = False  # no cache object among the outputs
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    return hf_blocks.init_moe_weights_(model, std=0.1)


def _ids(batch, seq, seed=0):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _dims(batch=True, seq=True):
    dims = {}
    if batch:
        dims[0] = torch.export.Dim("batch", min=1, max=64)
    if seq:
        dims[1] = torch.export.Dim("seq", min=1, max=256)
    return {"input_ids": dims}


MOE_FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v3"]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_fused_op_kept_whole_once_per_layer(family):
    model = _model(family)
    exported = export_mlir(model, _ids(2, 7), output_type="torch", dynamic_shapes=_dims())
    assert len(exported.fuse_report.fused) == LAYERS, str(exported.fuse_report)
    text = str(exported)
    filecheck(text, f"""
        CHECK-LABEL: func.func @main(%arg0: !torch.vtensor<[?,?],si64>) -> !torch.vtensor<[?,?,{VOCAB}],f32>
        CHECK: {FUSED}
        CHECK: {FUSED}
        CHECK: return
    """)
    assert count_matches(text, FUSED) == LAYERS
    assert count_matches(text, "torch.operator") == LAYERS  # nothing else left opaque
    # The experts' grouped GEMMs and sorting are gone: the op replaced the whole block.
    assert count_matches(text, "torch.aten.sort") == 0 and count_matches(text, "histc") == 0
    # `program` is what was imported, and still runs (torch-mlir's frozen import edits a copy).
    ids = _ids(3, 4, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(exported.program.module()(ids).logits, model(ids).logits)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_decomposed_lowers_to_linalg_and_matches_eager(family):
    """Form 2 on the RefBackend. Batch is static here: with both dims dynamic, this torch-mlir wheel lowers
    `view([?, ?, H] -> [?, H])` as if the second dim were 1 (any model, MoE or not), so only one is dynamic."""
    model = _model(family)
    exported = export_mlir(model, _ids(2, 7), output_type="linalg-on-tensors", dynamic_shapes=_dims(batch=False))
    assert len(exported.fuse_report.fused) == LAYERS, str(exported.fuse_report)
    text = str(exported)
    assert count_matches(text, "torch.operator") == 0 and count_matches(text, "= torch.") == 0
    filecheck(text, f"CHECK-LABEL: func.func @main(%arg0: tensor<2x?xi64>) -> tensor<2x?x{VOCAB}xf32>")
    run = RefBackendFunction(exported.module)
    for seq in (7, 3, 12):
        ids = _ids(2, seq, seed=seq)
        with torch.no_grad():
            want = model(ids).logits
        (got,) = run(ids)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_non_moe_model_is_exported_unchanged():
    model = _model("llama")
    exported = export_mlir(model, _ids(2, 7), output_type="linalg-on-tensors", dynamic_shapes=_dims(batch=False))
    assert exported.fuse_report.blocks == []
    text = str(exported)
    assert count_matches(text, "torch.operator") == 0 and count_matches(text, "mok") == 0
    filecheck(text, f"CHECK-LABEL: func.func @main(%arg0: tensor<2x?xi64>) -> tensor<2x?x{VOCAB}xf32>")
    ids = _ids(2, 5, seed=5)
    with torch.no_grad():
        want = model(ids).logits
    torch.testing.assert_close(RefBackendFunction(exported.module)(ids)[0], want, atol=1e-5, rtol=1e-4)


def test_non_persistent_buffers_are_imported():
    """torch.export keeps a non-persistent buffer (a rotary embedding's ``inv_freq``) in ``constants``, not in the
    state dict where torch-mlir's import looks for every buffer. From torch 2.14 on, Dynamo's export keeps them
    non-persistent too, so every HF model with rotary embeddings has one."""
    from torch_mlir import fx as torch_mlir_fx

    from mok_compile.export.mlir import _importable_copy

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.rand(4, generator=torch.Generator().manual_seed(0)), persistent=False)

        def forward(self, x):
            return x * self.scale

    program = torch.export.export(Scaled(), (torch.randn(3, 4),))
    assert list(program.graph_signature.non_persistent_buffers) == ["scale"] and "scale" not in program.state_dict
    module = torch_mlir_fx.export_and_import(_importable_copy(program), output_type="raw", decomposition_table={})
    assert count_matches(str(module), "torch.vtensor.literal") == 1
    assert "scale" not in program.state_dict  # the caller's program is left as it was
