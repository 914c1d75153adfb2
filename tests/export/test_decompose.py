"""The export-only decomposition of `mok.fused_moe` against the reference kernel (eager, no torch-mlir)."""

import pytest
import torch

pytest.importorskip("transformers")

from mok_compile import hf_blocks  # noqa: E402
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols  # noqa: E402

from mok_compile.export import EXPERTS_FORMS, decompose_fused_moe, fused_moe_decomposed  # noqa: E402
from mok_compile.export.decompose import is_fused_moe  # noqa: E402
from mok_compile.ops.reference import fused_moe_reference  # noqa: E402

from ..ops.moe_cases import CASES_BY_NAME, WEIGHT_ON_INPUT_CASES, make_args  # noqa: E402

SIZES = hf_blocks.BlockSizes(hidden=32, intermediate=16, experts=8, top_k=2)


def _args(family, dtype, tokens=13):
    block = hf_blocks.make_block(family, SIZES, dtype=dtype)
    tensors, kw = hf_blocks.op_arguments(family, block)
    x = torch.randn(tokens, SIZES.hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    return (x, *(None if t is None else t.detach() for t in tensors)), kw


@pytest.mark.parametrize("form", EXPERTS_FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", hf_blocks.ALL_FAMILIES)
def test_matches_reference(family, dtype, form):
    args, kw = _args(family, dtype)
    out, w, ids = fused_moe_decomposed(*args, experts_form=form, **kw)
    ref_out, ref_w, ref_ids = fused_moe_reference(*args, **kw)
    assert torch.equal(ids, ref_ids)  # same routing decisions ...
    assert torch.equal(w, ref_w)  # ... and weights: the routing code is the reference's
    assert out.dtype == ref_out.dtype and w.dtype == ref_w.dtype
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(out, ref_out, **tol)


@pytest.mark.parametrize("form", EXPERTS_FORMS)
def test_ungated_experts_and_omitted_defaults(form):
    """relu2 experts (NemotronH-style) with every keyword the dispatcher would omit left out."""
    E, H, I, T = 4, 16, 8, 5
    g = torch.Generator().manual_seed(0)
    x, router = torch.randn(T, H, generator=g), torch.randn(E, H, generator=g)
    up, down = torch.randn(E, I, H, generator=g), torch.randn(E, H, I, generator=g)
    kw = dict(top_k=2, gated=False, activation="relu2")
    out = fused_moe_decomposed(x, router, None, None, up, None, down, None, experts_form=form, **kw)
    ref = fused_moe_reference(x, router, None, None, up, None, down, None, **kw)
    torch.testing.assert_close(out[0], ref[0])


@pytest.mark.parametrize("form", EXPERTS_FORMS)
@pytest.mark.parametrize("case", WEIGHT_ON_INPUT_CASES + [CASES_BY_NAME[name] for name in (
    "topk_sigmoid_renorm_scale_wdtype", "sqrtsoftplus_deepseek_v4_bf16", "sqrtsoftplus_groups_renorm",
    "clamped_swiglu_bf16")], ids=str)
def test_case_forms_match_reference(case, form):
    """Every weight_on_input variant (biases, other routings, fp32 weights on bf16 input), topk_sigmoid and
    DeepSeek-V4's routing and experts (no HF family here: transformers >= 5.25), in the case's dtype and in fp64:
    same routing, and the output of the reference (bit for bit in fp64 up to summation order)."""
    for dtype in (case.dtype, torch.float64):
        args, kw = make_args(case, T=9, dtype=dtype if dtype == torch.float64 else None)
        out, w, ids = fused_moe_decomposed(*args, experts_form=form, **kw)
        ref_out, ref_w, ref_ids = fused_moe_reference(*args, **kw)
        assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w)
        assert out.dtype == ref_out.dtype == args[0].dtype
        tol = {torch.float64: dict(atol=1e-12, rtol=1e-12), torch.float32: dict(atol=1e-6, rtol=1e-5),
               torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}[dtype]
        torch.testing.assert_close(out, ref_out, **tol)


def test_shapes_do_not_depend_on_routing():
    """Exported with dynamic tokens, the decomposition has no data-dependent (unbacked) sizes."""
    args, kw = _args("deepseek_v3", torch.float32)  # grouped routing: the most ops

    class Block(torch.nn.Module):
        def forward(self, x):
            return torch.ops.mok.fused_moe(x, *args[1:], **kw)

    tokens = ({0: torch.export.Dim("tokens")},)
    gm, _ = torch._dynamo.export(Block(), dynamic_shapes=tokens)(args[0])
    assert decompose_fused_moe(gm, "gather") == 1
    program = torch.export.export(gm, (args[0],), dynamic_shapes=tokens)
    assert not any(is_fused_moe(n) for n in program.graph.nodes)
    unbacked = [s for n in program.graph.nodes for s in getattr(n.meta.get("val"), "shape", ())
                if isinstance(s, torch.SymInt) and free_unbacked_symbols(s)]
    assert not unbacked, f"data-dependent sizes: {unbacked}"
    x = torch.randn(9, SIZES.hidden)
    for got, want in zip(program.module()(x), Block()(x)):
        torch.testing.assert_close(got, want)


def test_unknown_experts_form_is_rejected():
    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    with pytest.raises(ValueError, match="experts_form"):
        decompose_fused_moe(gm, "sparse")
