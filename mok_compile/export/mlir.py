"""`export_mlir`: a model with its MoE blocks fused, as an MLIR module (torch-mlir).

    capture (Dynamo, torch-level graph)        torch._dynamo.export
      -> fuse MoE blocks                       mok_compile.passes.fuse_moe
      -> [decompose mok.fused_moe]             mok_compile.export.decompose
      -> torch.export.export                   the op stays one node (fake kernel)
      -> import + lower                        torch_mlir.fx (FX importer), torch-mlir pipelines

Two forms of the MoE blocks come out:

- kept whole (``decompose=False``): ``torch.operator "torch.mok.fused_moe"``,
  once per block, for compilers that bring their own MoE kernel. In the
  ``torch`` output type torch-mlir gets the op's shape/dtype functions
  (`abstract_interp`) and treats it as backend-legal, so it survives lowering
  as one operation.
- decomposed (``decompose=True``): standard aten ops with no data-dependent
  shapes, lowerable to ``linalg-on-tensors``, ``tosa`` or ``stablehlo`` by
  compilers that do not know the op.

torch-mlir is optional (``pip install 'mok-compile[mlir]'``); it is imported
only when `export_mlir` runs.

Limits of torch-mlir itself (wheel 20261001), not of the op: bf16/fp16 weights
need the ``ml_dtypes`` package to become MLIR literals; ``tosa`` and
``stablehlo`` lowerings need static shapes; and the linalg lowering of
``view([?, ?, H] -> [?, H])`` (any HF model with batch *and* sequence dynamic)
assumes the second dim is 1, so numerics are only right with one of them
dynamic. The ``raw`` and ``torch`` forms are correct with both.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import os
import tempfile
from typing import Any

import torch

from .abstract_interp import OP_NAME, abstract_interp_library
from .decompose import EXPERTS_FORMS, decompose_fused_moe, is_fused_moe

log = logging.getLogger("mok_compile.export")

# Output types in which the fused op can stay whole: the importer's raw form and torch's backend form.
# Lower ones (linalg-on-tensors, tosa, stablehlo) have no lowering for it.
_KEEPS_CUSTOM_OPS = ("raw", "torch")


@dataclasses.dataclass
class MlirExport:
    """What `export_mlir` produced.

    module: the `torch_mlir.ir.Module` (``str(export)`` is its text).
    program: the `torch.export.ExportedProgram` that was imported (after the
        MoE rewrite and, with ``decompose=True``, after decomposition): run it
        to check numerics against the eager model.
    fuse_report: the MoE pass's `FuseReport` (None with ``fuse=False``).
    output_type: the torch-mlir output type of `module`.
    """

    module: Any
    program: torch.export.ExportedProgram
    fuse_report: Any
    output_type: str

    def __str__(self) -> str:
        return str(self.module)

    @property
    def num_fused_ops(self) -> int:
        """How many `mok.fused_moe` calls the imported program still holds (0 after decomposition)."""
        return sum(1 for n in self.program.graph.nodes if is_fused_moe(n))


def _require_torch_mlir():
    try:
        import torch_mlir.fx  # noqa: F401
        from torch_mlir.compiler_utils import OutputType  # noqa: F401
    except ImportError as err:
        raise ImportError("mok_compile.export_mlir needs torch-mlir: pip install 'mok-compile[mlir]'") from err


def _output_type_name(output_type) -> str:
    from torch_mlir.compiler_utils import OutputType

    try:
        return OutputType.get(output_type).value
    except (ValueError, KeyError) as err:
        choices = ", ".join(repr(t.value) for t in OutputType)
        raise ValueError(f"output_type={output_type!r} is not a torch-mlir output type; use one of {choices}") from err


def export_mlir(model: torch.nn.Module, *example_inputs, output_type: str = "torch", dynamic_shapes=None,
                fuse: bool = True, decompose: bool | None = None, experts_form: str = "gather",
                strict: bool = False, func_name: str = "main") -> MlirExport:
    """Export `model` to MLIR with every provable MoE block as one `mok.fused_moe` (kept whole or decomposed).

    model, example_inputs: called as ``model(*example_inputs)`` (tensors; an HF
        model takes ``input_ids``; set ``config.use_cache=False`` so no cache
        object is returned).
    output_type: torch-mlir's ``"raw"`` (the importer's output),
        ``"torch"`` (torch backend form), ``"linalg-on-tensors"``, ``"tosa"``
        or ``"stablehlo"``.
    dynamic_shapes: as for `torch.export.export` (e.g. ``{"input_ids": {0:
        Dim("batch"), 1: Dim("seq")}}``); those dimensions are ``?`` in the
        MLIR function signature.
    fuse: run the MoE detection and rewrite (`mok_compile.passes.fuse_moe`).
        With ``False`` the model is exported as it is (a model that already
        calls `torch.ops.mok.fused_moe` keeps the call).
    decompose: spell `mok.fused_moe` in standard aten ops before import.
        ``None`` (default) decomposes only for output types that cannot carry
        the op (everything below ``"torch"``).
    experts_form: how the decomposition computes the experts, ``"gather"``
        (per-token gathered weights, like transformers' batched_mm; cheap for
        decode) or ``"dense"`` (every expert on every token, then pick; plain
        batched matmuls). See `mok_compile.export.decompose`.
    strict: raise if the MoE pass cannot fuse a block it found (instead of
        leaving it unfused and reporting why).
    func_name: name of the MLIR function.
    """
    _require_torch_mlir()
    from torch_mlir import fx as torch_mlir_fx
    from torch_mlir.extras.fx_decomp_util import get_decomposition_table

    output = _output_type_name(output_type)
    if experts_form not in EXPERTS_FORMS:
        raise ValueError(f"experts_form={experts_form!r} is not one of {EXPERTS_FORMS}")
    if decompose is None:
        decompose = output not in _KEEPS_CUSTOM_OPS
    if not callable(model):
        raise TypeError(f"model must be an nn.Module or a callable, got {type(model).__name__}")

    with torch.no_grad():  # an inference export: no autograd bookkeeping in the graphs
        gm, report = _capture_and_fuse(model, example_inputs, dynamic_shapes, fuse=fuse, strict=strict)
        if decompose:
            decompose_fused_moe(gm, experts_form)
        program = torch.export.export(gm, tuple(example_inputs), dynamic_shapes=dynamic_shapes)
        program = program.run_decompositions(get_decomposition_table())
    _sort_topk(program)
    fused = sum(1 for n in program.graph.nodes if is_fused_moe(n))
    if fused and output not in _KEEPS_CUSTOM_OPS:
        raise ValueError(f"output_type={output!r} cannot hold mok.fused_moe ({fused} call(s) in the program); "
                         "pass decompose=True (or None) to export it as standard aten ops")

    # Decompositions already ran above; an empty table keeps the importer from running its own again.
    module = torch_mlir_fx.export_and_import(_importable_copy(program), output_type="raw", decomposition_table={},
                                             func_name=func_name)
    if output != "raw":
        _lower(module, output)
    return MlirExport(module=module, program=program, fuse_report=report, output_type=output)


def _capture_and_fuse(model, example_inputs, dynamic_shapes, *, fuse: bool, strict: bool):
    """The model's torch-level graph from Dynamo, with its MoE blocks fused when `fuse`.

    Dynamo's graph is the one the MoE pass matches (torch.export's is already
    aten-level). Parameters stay attributes of the graph module, so the
    exported function takes only the user inputs and the weights become
    constants of the MLIR module.
    """
    gm, _guards = torch._dynamo.export(model, dynamic_shapes=dynamic_shapes)(*example_inputs)
    if not fuse:
        return gm, None
    from mok_compile.passes import fuse_moe

    report = fuse_moe(gm, torch.utils._pytree.tree_leaves(example_inputs), validate=True, strict=strict)
    for block in report.blocks:
        if not block.fused:
            log.info("mok export: MoE block %s left unfused: %s", block.name, block.reason)
    return gm, report


def _importable_copy(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A copy of `program` with its own graph but the same weight tensors, in the form torch-mlir imports.

    torch-mlir's frozen import rewrites the program's graph in place (weight
    placeholders become literals), which would leave `MlirExport.program`
    unrunnable; copying the weights too would double the memory of a large model.
    The import also looks every buffer up in the state dict, where torch.export
    keeps only persistent ones: a non-persistent buffer (a rotary embedding's
    ``inv_freq``, which Dynamo's export keeps non-persistent from torch 2.14 on)
    is in ``constants``, so the copy's state dict gets those too.
    """
    shared = itertools.chain(program.state_dict.values(), program.constants.values())
    copied = copy.deepcopy(program, memo={id(t): t for t in shared})
    for name in copied.graph_signature.non_persistent_buffers:
        copied.state_dict.setdefault(name, copied.constants[name])
    return copied


def _sort_topk(program: torch.export.ExportedProgram) -> None:
    """Make every ``topk(..., sorted=False)`` sorted, in place.

    torch-mlir lowers only sorted top-k to linalg; DeepSeek-style routing (and
    the reference) asks for an unsorted one. Unsorted means "any order", so a
    sorted result is a valid implementation of it.
    """
    changed = False
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.topk.default:
            if len(node.args) > 4 and node.args[4] is False:
                node.args = (*node.args[:4], True, *node.args[5:])
                changed = True
            elif node.kwargs.get("sorted") is False:
                node.kwargs = {**node.kwargs, "sorted": True}
                changed = True
    if changed:
        program.graph_module.recompile()


def _lower(module, output: str):
    """torch-mlir's lowering of an imported FX module (as `torch_mlir.fx` does it), knowing `mok.fused_moe`."""
    from torch_mlir.compiler_utils import OutputType, lower_mlir_module, run_pipeline_with_repro_report

    fd, library_path = tempfile.mkstemp(prefix="mok_fused_moe_", suffix=".mlir")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(abstract_interp_library())
        options = f"backend-legal-ops={OP_NAME} extra-library={library_path}"
        run_pipeline_with_repro_report(
            module,
            "builtin.module(func.func(torch-match-quantized-custom-ops), "
            f"torchdynamo-export-to-torch-backend-pipeline{{{options}}})",
            "Lowering TorchFX IR -> Torch Backend IR",
        )
    finally:
        os.unlink(library_path)
    lower_mlir_module(False, OutputType.get(output), module)
