"""MLIR export of modules that call `torch.ops.mok.fused_moe` directly (no MoE detection involved).

Form 1 keeps the op whole (raw and torch-backend IR); form 2 decomposes it to
aten ops that lower to linalg-on-tensors and run on torch-mlir's RefBackend.
"""

import contextlib
import dataclasses
import os
import re
import tempfile

import pytest
import torch

pytest.importorskip("torch_mlir.fx")
pytest.importorskip("transformers")

from torch_mlir.compiler_utils import run_pipeline_with_repro_report  # noqa: E402
from torch_mlir.ir import Context, Module  # noqa: E402

from mok_compile import hf_blocks  # noqa: E402
from mok_compile.export import abstract_interp_library, export_mlir  # noqa: E402

from mok_compile.ops.spec import ExpertSpec  # noqa: E402

from ..ops.moe_cases import CASES_BY_NAME, make_args  # noqa: E402
from .filecheck import count_matches, filecheck  # noqa: E402
from .refbackend import RefBackendFunction  # noqa: E402

SIZES = hf_blocks.BlockSizes(hidden=32, intermediate=16, experts=8, top_k=2)
FUSED = 'torch.operator "torch.mok.fused_moe"'


class FusedMoE(torch.nn.Module):
    """One HF block's routed experts as a direct `mok.fused_moe` call; returns all three outputs."""

    def __init__(self, family, dtype=torch.float32):
        super().__init__()
        if family == "deepseek_v4":  # no HF block before transformers 5.25: the op's arguments drawn as tests/ops does
            tensors, self.kw = _deepseek_v4_arguments(dtype)
        else:
            block = hf_blocks.make_block(family, SIZES, dtype=dtype)
            tensors, self.kw = hf_blocks.op_arguments(family, block)
        names = ("router", "router_bias", "selection_bias", "gate_up_proj", "gate_up_bias", "down_proj", "down_bias")
        self.names = names
        for name, t in zip(names, tensors):
            if t is None:
                setattr(self, name, None)
            else:
                self.register_buffer(name, t.detach().clone())

    def forward(self, x):
        return torch.ops.mok.fused_moe(x, *(getattr(self, n) for n in self.names), **self.kw)


def _deepseek_v4_arguments(dtype):
    """DeepSeek-V4's routing (sqrt(softplus) scores, a selection bias, renormalised, scaled) and clamped SwiGLU at
    SIZES, without x."""
    case = dataclasses.replace(CASES_BY_NAME["sqrtsoftplus_deepseek_v4_bf16"], num_experts=SIZES.experts,
                               experts=ExpertSpec(activation="clamped_swiglu", limit=0.75))
    args, kw = make_args(case, T=1, H=SIZES.hidden, I=SIZES.intermediate, dtype=dtype)
    return args[1:], kw


def _tokens():
    return {0: torch.export.Dim("tokens", min=1, max=4096)}


def _x(n, dtype=torch.float32, seed=0):
    return torch.randn(n, SIZES.hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture(scope="module")
def mixtral():
    return FusedMoE("mixtral")


def test_raw_keeps_the_op_whole_with_dynamic_tokens(mixtral):
    text = str(export_mlir(mixtral, _x(5), output_type="raw", dynamic_shapes=(_tokens(),), fuse=False))
    filecheck(text, f"""
        CHECK-LABEL: func.func @main(%arg0: !torch.vtensor<[?,32],f32>)
        CHECK: {FUSED}(%arg0,{{{{.*}}}} -> (!torch.vtensor<[?,32],f32>, !torch.vtensor<[?,2],f32>, !torch.vtensor<[?,2],si64>)
    """)
    assert count_matches(text, FUSED) == 1


def test_torch_backend_form_keeps_exactly_one_op(mixtral):
    exported = export_mlir(mixtral, _x(5), output_type="torch", dynamic_shapes=(_tokens(),), fuse=False)
    text = str(exported)
    assert exported.output_type == "torch" and exported.num_fused_ops == 1
    filecheck(text, f"""
        CHECK-LABEL: func.func @main(%arg0: !torch.vtensor<[?,32],f32>) -> (!torch.vtensor<[?,32],f32>, !torch.vtensor<[?,2],f32>, !torch.vtensor<[?,2],si64>)
        CHECK: {FUSED}
        CHECK-NOT: torch.aten.topk
        CHECK: return
    """)
    assert count_matches(text, FUSED) == 1
    assert count_matches(text, "torch.aten.") == 0, "the block must not be decomposed in form 1"


def test_static_shapes_stay_static(mixtral):
    text = str(export_mlir(mixtral, _x(5), output_type="torch", fuse=False))
    filecheck(text, "CHECK-LABEL: func.func @main(%arg0: !torch.vtensor<[5,32],f32>)")


@pytest.mark.parametrize("family, dtype, weights_fp32, weights_type, round_weights_to", [
    ("qwen3_moe", torch.float32, True, "f32", None),
    ("qwen3_moe", torch.bfloat16, False, "bf16", None),
    ("qwen3_moe", torch.bfloat16, True, "f32", None),
    ("qwen3_moe", torch.float64, True, "f64", None),
    ("llama4", torch.bfloat16, False, "bf16", None),  # routing='topk_sigmoid', weight_on_input=True
    ("qwen3_moe", torch.float32, True, "f32", torch.bfloat16),  # a dtype argument (ScalarType?)
])
def test_abstract_interp_library_refines_erased_result_types(family, dtype, weights_fp32, weights_type,
                                                             round_weights_to):
    """Erase the op's result types; torch-mlir must infer them from our shape/dtype functions alone."""
    moe = FusedMoE(family, dtype=dtype)
    kw = {**moe.kw, "weights_fp32": weights_fp32, "round_weights_to": round_weights_to}

    def fused_moe(x, router, gate_up_proj, down_proj):
        # Weights as inputs, not literals: a bf16 literal would need the ml_dtypes package.
        return torch.ops.mok.fused_moe(x, router, None, None, gate_up_proj, None, down_proj, None, **kw)

    args = (_x(3, dtype), moe.router, moe.gate_up_proj, moe.down_proj)
    assert fused_moe(*args)[1].dtype == {"f32": torch.float32, "bf16": torch.bfloat16, "f64": torch.float64}[weights_type]
    text = str(export_mlir(_Call(fused_moe), *args, output_type="raw", fuse=False,
                           dynamic_shapes=(_tokens(), None, None, None)))
    # The three result types appear as one list on the op, in the function's signature and on `return`.
    result_types = re.search(r'torch\.operator "torch\.mok\.fused_moe".* -> \((.*)\)', text).group(1)
    erased = text.replace(result_types, ", ".join(["!torch.vtensor"] * 3))
    assert count_matches(erased, "!torch.vtensor<[?,2]") == 0
    module = _parse(erased)
    with _library_file() as path:
        run_pipeline_with_repro_report(
            module, "builtin.module(torch-function-to-torch-backend-pipeline{"
                    f"backend-legal-ops=torch.mok.fused_moe extra-library={path}}})", "refine mok.fused_moe types")
    x_type = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float64: "f64"}[dtype]
    filecheck(str(module), f"CHECK: {FUSED}{{{{.*}}}} -> (!torch.vtensor<[?,32],{x_type}>, "
                        f"!torch.vtensor<[?,2],{weights_type}>, !torch.vtensor<[?,2],si64>)")


class _Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, router, gate_up_proj, down_proj):
        return self.fn(x, router, gate_up_proj, down_proj)


def _parse(text):
    import torch_mlir.dialects.torch as torch_d

    ctx = Context()
    torch_d.register_dialect(ctx)
    return Module.parse(text, ctx)


@contextlib.contextmanager
def _library_file():
    fd, path = tempfile.mkstemp(suffix=".mlir")
    with os.fdopen(fd, "w") as f:
        f.write(abstract_interp_library())
    try:
        yield path
    finally:
        os.unlink(path)


@pytest.mark.parametrize("family, form", [
    ("mixtral", "gather"),
    ("mixtral", "dense"),
    ("deepseek_v3", "gather"),  # sigmoid + selection bias + group-limited top-k, fp32 router
    ("gpt_oss", "dense"),  # transposed + interleaved weights, biases, clamped SwiGLU, top-k -> softmax
    ("qwen2_moe", "gather"),  # weights cast to the input dtype
    ("ernie4_5_moe", "gather"),  # softmax + selection bias, w / clamp(sum, min)
    ("llama4", "gather"),  # top-k -> sigmoid, weight on the expert's input, unweighted sum, transposed weights
    ("llama4", "dense"),
    ("deepseek_v4", "gather"),  # sqrt(softplus) scores + selection bias, clamped SwiGLU without GPT-OSS's "+ 1"
    ("longcat_flash", "gather"),  # identity experts (transformers >= 5.25)
    ("inkling2", "dense"),  # softcapped SwiGLU, fp32 sigmoid router (transformers >= 5.25)
    ("phimoe", "gather"),  # the sparsemixer: maxima, masks by relative distance, masked softmax, scatter of -inf
])
def test_decomposed_runs_on_refbackend_and_matches_eager(family, form):
    """Form 2: no torch.operator left, linalg-on-tensors with a dynamic token dim, same numbers as the op."""
    if family in ("longcat_flash", "inkling2") and not hf_blocks.available([family]):
        pytest.skip(f"{family}'s block in the op's form needs transformers >= 5.25")
    moe = FusedMoE(family)
    exported = export_mlir(moe, _x(5), output_type="linalg-on-tensors", dynamic_shapes=(_tokens(),), fuse=False,
                           experts_form=form)
    text = str(exported)
    assert exported.num_fused_ops == 0
    assert count_matches(text, "torch.operator") == 0
    assert count_matches(text, "= torch.") == 0, "every torch-dialect op must be lowered"
    filecheck(text, """
        CHECK-LABEL: func.func @main(%arg0: tensor<?x32xf32>) -> (tensor<?x32xf32>, tensor<?x2xf32>, tensor<?x2xi64>)
        CHECK: linalg.
        CHECK: return
    """)
    run = RefBackendFunction(exported.module)
    for tokens in (1, 5, 37):  # other token counts than the example's: the dim really is dynamic
        x = _x(tokens, seed=tokens)
        out, weights, ids = run(x)
        ref_out, ref_weights, ref_ids = moe(x)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-4)


class _GivenIds(torch.nn.Module):
    """Mixtral's routed experts with the expert ids given (hash routing), a second input."""

    def __init__(self):
        super().__init__()
        self.moe = FusedMoE("mixtral")

    def forward(self, x, ids):
        m = self.moe
        return torch.ops.mok.fused_moe(x, *(getattr(m, n) for n in m.names), **m.kw, expert_ids=ids)


def _ids(n, seed=0):
    ids = torch.randint(0, SIZES.experts, (n, SIZES.top_k), generator=torch.Generator().manual_seed(seed))
    ids[0] = 3  # one expert in both slots
    return ids


def test_given_ids_keep_the_op_whole_and_decompose_on_refbackend():
    """`expert_ids` through both forms: the torch-backend form keeps one op taking the ids (the shape and dtype
    functions have the argument); the decomposed linalg form runs on RefBackend with the op's numbers, repeated ids
    included, at token counts other than the example's."""
    moe = _GivenIds()
    dynamic = (_tokens(), _tokens())
    kept = export_mlir(moe, _x(5), _ids(5), output_type="torch", dynamic_shapes=dynamic, fuse=False)
    assert kept.num_fused_ops == 1
    filecheck(str(kept), f"""
        CHECK-LABEL: func.func @main(%arg0: !torch.vtensor<[?,32],f32>, %arg1: !torch.vtensor<[?,2],si64>)
        CHECK: {FUSED}(%arg0,{{{{.*}}}}%arg1
    """)
    lowered = export_mlir(moe, _x(5), _ids(5), output_type="linalg-on-tensors", dynamic_shapes=dynamic, fuse=False)
    assert lowered.num_fused_ops == 0
    run = RefBackendFunction(lowered.module)
    for tokens in (1, 6, 37):
        x, ids = _x(tokens, seed=tokens), _ids(tokens, seed=tokens)
        out, weights, got_ids = run(x, ids)
        ref_out, ref_weights, ref_ids = moe(x, ids)
        assert torch.equal(got_ids, ref_ids)
        torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-4)


class _ScaledExperts(torch.nn.Module):
    """Mixtral's routed experts with a learned per-expert weight scale (Gemma 4's `per_expert_scale`)."""

    def __init__(self):
        super().__init__()
        self.moe = FusedMoE("mixtral")
        self.register_buffer("scale", torch.rand(SIZES.experts, generator=torch.Generator().manual_seed(1)) + 0.5)

    def forward(self, x):
        m = self.moe
        return torch.ops.mok.fused_moe(x, *(getattr(m, n) for n in m.names), **m.kw, expert_scale=self.scale)


def _keeps_the_op_whole_and_decomposes_on_refbackend(moe):
    """`moe` (a feature on `moe.moe`'s op) through both forms: the torch-backend form keeps one op taking the
    feature's tensor; the decomposed linalg form runs on RefBackend with the op's numbers at token counts other than
    the example's, and those differ from the op's without the feature."""
    kept = export_mlir(moe, _x(5), output_type="torch", dynamic_shapes=(_tokens(),), fuse=False)
    assert kept.num_fused_ops == 1
    lowered = export_mlir(moe, _x(5), output_type="linalg-on-tensors", dynamic_shapes=(_tokens(),), fuse=False)
    assert lowered.num_fused_ops == 0
    run = RefBackendFunction(lowered.module)
    for tokens in (1, 6, 37):
        x = _x(tokens, seed=tokens)
        out, weights, ids = run(x)
        with torch.no_grad():
            ref_out, ref_weights, ref_ids = moe(x)
            plain_out, plain_weights, _ = moe.moe(x)
        assert torch.equal(ids, ref_ids)
        assert not (torch.allclose(ref_out, plain_out) and torch.allclose(ref_weights, plain_weights))
        torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-4)


def test_expert_scale_keeps_the_op_whole_and_decomposes_on_refbackend():
    _keeps_the_op_whole_and_decomposes_on_refbackend(_ScaledExperts())


class _NormedExperts(torch.nn.Module):
    """Mixtral's routed experts with a post-expert norm: Ergo's per-expert one or Muse Spark's input-scaled one."""

    def __init__(self, kind):
        super().__init__()
        self.moe = FusedMoE("mixtral")
        shape = (SIZES.experts, SIZES.hidden) if kind == "rms" else (SIZES.hidden,)
        self.register_buffer("norm", torch.rand(shape, generator=torch.Generator().manual_seed(2)) + 0.5)
        self.kind = kind

    def forward(self, x):
        m = self.moe
        norm = dict(post_norm=self.kind, post_norm_eps=1e-5, post_norm_offset=1.0 if self.kind == "scaled_rms" else 0.0)
        return torch.ops.mok.fused_moe(x, *(getattr(m, n) for n in m.names), **{**m.kw, **norm},
                                       post_norm_weight=self.norm)


@pytest.mark.parametrize("kind", ["rms", "scaled_rms"])
def test_post_norm_keeps_the_op_whole_and_decomposes_on_refbackend(kind):
    """Each pair's row normalised with its expert's weight row (rms) or the shared one (scaled_rms)."""
    _keeps_the_op_whole_and_decomposes_on_refbackend(_NormedExperts(kind))


def test_abstract_interp_library_follows_the_schema():
    """The shape/dtype functions take every argument of the registered schema, the trailing ones included."""
    schema = torch.ops.mok.fused_moe.default._schema
    assert [a.name for a in schema.arguments[-3:]] == ["expert_ids", "expert_scale", "post_norm_weight"]
    text = abstract_interp_library()
    for fn in ("shape_fn", "dtype_fn"):
        sig = re.search(rf'__torch_mlir_{fn}\.torch\.mok\.fused_moe"\((.*?)\) ->', text).group(1)
        assert re.findall(r"%(\w+):", sig) == [a.name for a in schema.arguments]


def test_decompose_false_with_a_linalg_output_is_an_error(mixtral):
    with pytest.raises(ValueError, match="decompose=True"):
        export_mlir(mixtral, _x(3), output_type="linalg-on-tensors", decompose=False, fuse=False)


def test_bad_arguments_are_named(mixtral):
    with pytest.raises(ValueError, match="output_type='mhlo'"):
        export_mlir(mixtral, _x(3), output_type="mhlo", fuse=False)
    with pytest.raises(ValueError, match="experts_form='sparse'"):
        export_mlir(mixtral, _x(3), experts_form="sparse", fuse=False)


def test_without_torch_mlir_the_error_names_the_extra(monkeypatch, mixtral):
    import sys

    monkeypatch.setitem(sys.modules, "torch_mlir", None)  # makes `import torch_mlir...` raise ImportError
    monkeypatch.delitem(sys.modules, "torch_mlir.fx", raising=False)
    with pytest.raises(ImportError, match=r"mok-compile\[mlir\]"):
        export_mlir(mixtral, _x(3), fuse=False)


def test_importing_the_package_does_not_import_torch_mlir():
    import subprocess
    import sys

    code = "import sys, mok_compile, mok_compile.export; assert 'torch_mlir' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
