"""Shape and dtype functions of `mok::fused_moe` for torch-mlir, as MLIR text.

torch-mlir's lowering to its backend form refines every op's result shapes and
dtypes from a library of "abstract interpretation" functions. It has none for
our op, so `torch.operator "torch.mok.fused_moe"` would fail there; its
`extra-library` option splices in functions named

    __torch_mlir_shape_fn.torch.mok.fused_moe      (shapes as !torch.list<int>)
    __torch_mlir_dtype_fn.torch.mok.fused_moe      (tensors as (rank, dtype) tuples)
    __torch_mlir_has_value_semantics_fn.torch.mok.fused_moe

and `backend-legal-ops=torch.mok.fused_moe` keeps the op whole instead of asking
for a decomposition. Both are keyed by the `name` of the `torch.operator`, which
the FX importer spells with a `torch.` prefix (`torch.operator
"torch.mok.fused_moe"`); the value-semantics function is what lets the op
through `torch-reduce-op-variants`. The wheel has no TorchScript-based generator of these functions
(upstream writes them in Python and scripts them), so they are written here in
the torch dialect. The argument lists are generated from the op's registered
schema, so a trailing keyword argument added to the op needs no change here;
the bodies depend only on `hidden_states`, `top_k` and `weights_fp32`.

The results mirror the fake kernel in `mok_compile.ops.library`:
`out` is shaped and typed like `hidden_states`, `topk_weights` is `[T, top_k]`
fp32 when `weights_fp32` (fp64 stays fp64) and the input dtype otherwise,
`topk_ids` is `[T, top_k]` int64. The dtype choice is written as nested
`prim.If`s on the arguments because torch-mlir folds an `If` on a constant but
not `aten.__and__.bool`, and an unfolded choice leaves the dtype unknown.
"""

from __future__ import annotations

import torch

# The `name` of the `torch.operator` that torch-mlir's FX importer emits for the op.
OP_NAME = "torch.mok.fused_moe"

# c10::ScalarType codes, which is how torch-mlir's dtype functions spell dtypes.
_SCALAR_TYPE_INT64 = 4
_SCALAR_TYPE_FLOAT32 = 6
_SCALAR_TYPE_FLOAT64 = 7

_SCALAR_TYPES = {"int": "!torch.int", "float": "!torch.float", "bool": "!torch.bool", "str": "!torch.str",
                 "Optional[int]": "!torch.optional<int>"}  # ScalarType? (round_weights): a dtype code or None


def _arg_type(arg: torch.Argument, tensor_type: str) -> str:
    """The MLIR type of one schema argument in a shape (`list<int>`) or dtype (`tuple<int, int>`) function."""
    ty = arg.type
    if isinstance(ty, torch.TensorType):
        return f"!torch.{tensor_type}"
    if isinstance(ty, torch.OptionalType) and isinstance(ty.getElementType(), torch.TensorType):
        return f"!torch.optional<{tensor_type}>"
    name = str(ty)
    if name not in _SCALAR_TYPES:
        raise NotImplementedError(f"mok.fused_moe argument {arg.name!r} has type {name}, which the MLIR "
                                  "shape/dtype library generator does not handle; extend _SCALAR_TYPES")
    return _SCALAR_TYPES[name]


def _signature(schema: torch.FunctionSchema, tensor_type: str) -> str:
    return ", ".join(f"%{a.name}: {_arg_type(a, tensor_type)}" for a in schema.arguments)


def abstract_interp_library(schema: torch.FunctionSchema | None = None) -> str:
    """The MLIR module text to pass to torch-mlir as `extra-library` for `mok.fused_moe`."""
    schema = schema or torch.ops.mok.fused_moe.default._schema
    names = {a.name for a in schema.arguments}
    missing = {"hidden_states", "top_k", "weights_fp32"} - names
    if missing:
        raise NotImplementedError(f"mok.fused_moe schema lost arguments {sorted(missing)}; update abstract_interp.py")
    shape_sig = _signature(schema, "list<int>")
    dtype_sig = _signature(schema, "tuple<int, int>")
    return f"""\
module {{
  func.func @"__torch_mlir_shape_fn.{OP_NAME}"({shape_sig}) -> !torch.tuple<list<int>, list<int>, list<int>> {{
    %int0 = torch.constant.int 0
    %tokens = torch.aten.__getitem__.t %hidden_states, %int0 : !torch.list<int>, !torch.int -> !torch.int
    %routed = torch.prim.ListConstruct %tokens, %top_k : (!torch.int, !torch.int) -> !torch.list<int>
    %result = torch.prim.TupleConstruct %hidden_states, %routed, %routed : !torch.list<int>, !torch.list<int>, !torch.list<int> -> !torch.tuple<list<int>, list<int>, list<int>>
    return %result : !torch.tuple<list<int>, list<int>, list<int>>
  }}
  func.func @"__torch_mlir_dtype_fn.{OP_NAME}"({dtype_sig}) -> !torch.tuple<int, int, int> {{
    %int64 = torch.constant.int {_SCALAR_TYPE_INT64}
    %float32 = torch.constant.int {_SCALAR_TYPE_FLOAT32}
    %float64 = torch.constant.int {_SCALAR_TYPE_FLOAT64}
    %x:2 = torch.prim.TupleUnpack %hidden_states : !torch.tuple<int, int> -> !torch.int, !torch.int
    %weights = torch.prim.If %weights_fp32 -> (!torch.int) {{
      %is_fp64 = torch.aten.eq.int %x#1, %float64 : !torch.int, !torch.int -> !torch.bool
      %upcast = torch.prim.If %is_fp64 -> (!torch.int) {{
        torch.prim.If.yield %x#1 : !torch.int
      }} else {{
        torch.prim.If.yield %float32 : !torch.int
      }}
      torch.prim.If.yield %upcast : !torch.int
    }} else {{
      torch.prim.If.yield %x#1 : !torch.int
    }}
    %result = torch.prim.TupleConstruct %x#1, %weights, %int64 : !torch.int, !torch.int, !torch.int -> !torch.tuple<int, int, int>
    return %result : !torch.tuple<int, int, int>
  }}
  func.func @"__torch_mlir_has_value_semantics_fn.{OP_NAME}"() {{
    return
  }}
}}
"""
