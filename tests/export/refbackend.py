"""Run a linalg-on-tensors module on the CPU with torch-mlir's reference-backend passes.

The torch-mlir wheel ships the RefBackend's compiler passes (`refback-*`, in
`torch-mlir-opt` and the Python pass manager) and MLIR's `ExecutionEngine`, but
not the Python driver that ties them together (`torch_mlir_e2e_test`, which
only exists in a source build). This is that driver, cut down to what the
export tests need: bufferize, make the entry function callable through the C
interface (`refback-munge-calling-conventions` turns results into a callback),
lower to LLVM, JIT, call with numpy arrays.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

_LOWERING = (
    "builtin.module("
    "func.func(refback-generalize-tensor-pad, refback-generalize-tensor-concat, linalg-generalize-named-ops, "
    "linalg-fuse-elementwise-ops),"
    "convert-shape-to-std,"
    "func.func(tm-tensor-bufferize),"
    "one-shot-bufferize{copy-before-write bufferize-function-boundaries "
    "function-boundary-type-conversion=identity-layout-map},"
    "refback-mlprogram-bufferize,"
    "func.func(buffer-deallocation-pipeline),"
    "inline,"
    "refback-munge-calling-conventions,"
    "func.func(tm-tensor-to-loops, refback-munge-memref-copy, convert-linalg-to-loops, lower-affine),"
    "convert-scf-to-cf,"
    "func.func(refback-expand-ops-for-llvm, arith-expand, convert-math-to-llvm),"
    "convert-math-to-libm,"
    "expand-strided-metadata,"
    "finalize-memref-to-llvm,"
    "lower-affine,"
    "convert-bufferization-to-memref,"
    "finalize-memref-to-llvm,"
    "func.func(convert-arith-to-llvm),"
    "convert-vector-to-llvm,"
    "convert-func-to-llvm,"
    "convert-cf-to-llvm,"
    "convert-complex-to-llvm,"
    "reconcile-unrealized-casts)"
)

_RETURN_PREFIX = "refbackend_consume_func_return_"
_MEMREF_DTYPES = {"mrf32": np.float32, "mrf64": np.float64, "mrf16": np.float16, "mri1": np.bool_,
                  "mri8": np.int8, "mri32": np.int32, "mri64": np.int64}


class RefBackendFunction:
    """A JIT-compiled function of a linalg-on-tensors module, callable with torch tensors."""

    def __init__(self, module, func_name: str = "main"):
        from torch_mlir.compiler_utils import run_pipeline_with_repro_report
        from torch_mlir.execution_engine import ExecutionEngine
        from torch_mlir.runtime import UnrankedMemRefDescriptor, unranked_memref_to_numpy

        run_pipeline_with_repro_report(module, _LOWERING, "Lowering linalg-on-tensors to LLVM (RefBackend)")
        self._func_name = func_name
        # opt_level=0: LLVM's optimiser takes ~10 s of JIT time on a tiny 2-layer model, running takes ms.
        self._engine = ExecutionEngine(module, opt_level=0)
        self._result = None
        self._callbacks = []  # the ctypes callbacks must outlive the engine
        for name in self._return_functions(module):
            kinds = name[len(_RETURN_PREFIX):].split("_")
            unknown = [k for k in kinds if k not in _MEMREF_DTYPES]
            if unknown:
                raise NotImplementedError(f"RefBackend driver: unsupported result type(s) {unknown} in {name}")
            prototype = ctypes.CFUNCTYPE(None, *[ctypes.POINTER(UnrankedMemRefDescriptor)] * len(kinds))

            def consume(*memrefs, kinds=kinds):
                self._result = tuple(unranked_memref_to_numpy(m, _MEMREF_DTYPES[k]) for m, k in zip(memrefs, kinds))

            callback = prototype(consume)
            self._callbacks.append(callback)
            self._engine.register_runtime(name, callback)

    @staticmethod
    def _return_functions(module):
        with module.context:
            names = [str(op.attributes["sym_name"]).strip('"') for op in module.body.operations
                     if "sym_name" in op.attributes]
        return [n for n in names if n.startswith(_RETURN_PREFIX)]

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from torch_mlir.runtime import get_unranked_memref_descriptor

        arrays = [np.ascontiguousarray(t.detach().cpu().numpy()) for t in inputs]
        args = [ctypes.pointer(ctypes.pointer(get_unranked_memref_descriptor(a))) for a in arrays]
        self._result = None
        self._engine.invoke(self._func_name, *args)
        if self._result is None:
            raise RuntimeError(f"{self._func_name} returned no result")
        result, self._result = self._result, None
        # Copy out: the arrays view buffers the compiled code allocated.
        return tuple(torch.from_numpy(np.array(r, copy=True)) for r in result)
