"""What an FX node computes, as one canonical name, whatever spelling Dynamo used.

Dynamo writes the same operation many ways: ``torch.topk`` / ``x.topk``,
``operator.mul`` / ``torch.mul``, ``F.linear`` / ``torch._C._nn.linear``,
``x /= s`` (``operator.itruediv``) / ``x.div_(s)``, ``torch._grouped_mm`` /
``F.grouped_mm`` / ``torch.ops.transformers.grouped_mm_fallback``. The
detection pass reasons about canonical names (``"topk"``, ``"mul"``,
``"linear"``, ``"div"``, ``"grouped_mm"``) and asks separately whether a node
mutates its first argument, so every matcher handles every spelling.
"""

from __future__ import annotations

import functools
import operator
import re

import torch
import torch.fx as fx

# Spellings that differ from the canonical name.
_ALIASES = {
    "truediv": "div", "floordiv": "floordiv", "true_divide": "div", "divide": "div", "multiply": "mul",
    "subtract": "sub", "_grouped_mm": "grouped_mm", "grouped_mm_fallback": "grouped_mm",
    "neg": "neg", "invert": "invert", "bitwise_not": "invert", "matmul": "matmul", "pow": "pow",
    "clip": "clamp", "clamp_max": "clamp", "clamp_min": "clamp_min", "swapaxes": "transpose",
    "index_select": "index_select", "eq": "eq", "ne": "ne", "greater_equal": "ge", "greater": "gt",
    "less_equal": "le", "less": "lt", "not_equal": "ne", "concat": "cat", "concatenate": "cat",
}
_INPLACE_OPERATORS = {
    operator.iadd: "add", operator.isub: "sub", operator.imul: "mul", operator.itruediv: "div",
    operator.ipow: "pow", operator.setitem: "setitem",
}
# `W.T` and `W.mT`: Dynamo writes them as `getattr(W, "T")` up to torch 2.13 and as `aten.numpy_T` / `aten.mT`
# from torch 2.14 on.
TRANSPOSE_ATTRIBUTE_OPS = frozenset({"numpy_T", "mT"})
VIEW_OPS = frozenset({"view", "reshape", "flatten", "contiguous", "squeeze", "unsqueeze", "expand", "view_as",
                      "reshape_as", "expand_as", "permute", "transpose", "t"}) | TRANSPOSE_ATTRIBUTE_OPS
CAST_OPS = frozenset({"float", "to", "type", "type_as", "bfloat16", "half", "double"})
# Ops that only move, select or re-type data.
LAYOUT_OPS_NAMES = VIEW_OPS | CAST_OPS | {"getitem", "size", "sym_size", "getattr", "index_select"}
MATMUL_OPS = frozenset({"linear", "matmul", "mm", "bmm", "grouped_mm", "einsum", "addmm", "baddbmm"})


# Reflected operator methods whose operands commute (a.__rmul__(b) is b * a); the others stay unknown names.
_COMMUTING_REFLECTED = {"__radd__": "add", "__rmul__": "mul"}


def _method_name(name: str) -> str:
    """A tensor method's name as an op: Dynamo (torch 2.11) writes `ids == e` as the method `__eq__`, where torch
    2.13 writes the function `operator.eq`. Reflected methods other than commuting ones (`__rsub__`: b - a) and
    in-place ones (`__iadd__`) keep a name no pattern knows."""
    if name in _COMMUTING_REFLECTED:
        return _COMMUTING_REFLECTED[name]
    if name.startswith("__") and name.endswith("__") and name[2:-2] not in _REFLECTED_OR_INPLACE:
        return name[2:-2]
    return name


_BINARY = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift",
           "rshift")
_REFLECTED_OR_INPLACE = frozenset({f"{p}{op}" for op in _BINARY for p in ("r", "i")})


def _raw_name(node: fx.Node) -> str | None:
    if node.op not in ("call_function", "call_method"):
        return None
    try:
        return _name_of(node.op, node.target)
    except TypeError:  # an unhashable target: not cached
        return _name_of.__wrapped__(node.op, node.target)


@functools.lru_cache(maxsize=4096)  # the pass asks for every node's name once per block
def _name_of(op: str, target) -> str | None:
    if op == "call_method":
        return _method_name(target)
    if op != "call_function":
        return None
    qualified = getattr(target, "_qualified_op_name", None)  # OpOverloadPacket
    if qualified is None and isinstance(target, torch._ops.OpOverload):
        qualified = target._schema.name
    if qualified is not None:
        return qualified.split("::")[-1]
    return getattr(target, "__name__", None)


def op_name(node: fx.Node) -> str | None:
    """Canonical name of what `node` computes (in-place spellings map to the out-of-place name)."""
    if node.op == "call_function" and node.target in _INPLACE_OPERATORS:
        return _INPLACE_OPERATORS[node.target]
    name = _raw_name(node)
    if name is None:
        return None
    if name.endswith("_") and not name.startswith("_") and name not in ("sort_", "index_add_"):
        name = name[:-1]  # add_ -> add, scatter_ -> scatter, ...
    if name == "index_add_":
        name = "index_add"
    if name == "gelu" and node.kwargs.get("approximate", "none") == "tanh":
        return "gelu_tanh"
    return _ALIASES.get(name, name)


def mutated_input(node: fx.Node) -> fx.Node | None:
    """The node whose tensor `node` writes in place (its first argument), or None for pure ops."""
    if node.op == "call_function" and node.target in _INPLACE_OPERATORS:
        first = node.args[0]
    else:
        name = _raw_name(node)
        if name is None or not name.endswith("_") or name.startswith("_"):
            if node.kwargs.get("inplace") is True:
                first = node.args[0] if node.args else None
            elif "out" in node.kwargs:
                first = node.kwargs["out"]
            else:
                return None
        else:
            first = node.args[0] if node.args else None
    return first if isinstance(first, fx.Node) else None


def tensor_meta(node) -> torch.Tensor | None:
    """The fake tensor Dynamo/FakeTensorProp recorded for `node` (None for non-tensors)."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val", node.meta.get("example_value"))
    return val if isinstance(val, torch.Tensor) else None


def meta_value(node):
    """Recorded value of `node` (tensor, SymInt, tuple, ...), or None."""
    return node.meta.get("val", node.meta.get("example_value"))


def number(value) -> float | None:
    """`value` as a float where it is a Python number (an op's constant argument; a bool is not one), else None."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


_FOLDED = {"neg": operator.neg, "add": operator.add, "sub": operator.sub, "mul": operator.mul,
           "div": operator.truediv}


def folded_number(value) -> float | None:
    """`value` as a float where it is a number or a node of arithmetic on numbers alone, folded (after Dynamo or
    aot_autograd has specialised a traced float, what the model computed from it stays a node of constants:
    GPT-OSS's `-limit` as `neg(7.0)`, PhiMoE's `2 * jitter_eps` as `mul(2, 0.01)`), in Python's float arithmetic as
    the graph computes it; else None."""
    if number(value) is not None:
        return number(value)
    if not isinstance(value, fx.Node) or value.op != "call_function" or value.kwargs:
        return None
    fold = _FOLDED.get(op_name(value))
    operands = [folded_number(a) for a in value.args]
    if fold is None or None in operands or len(operands) != (1 if fold is operator.neg else 2):
        return None
    try:
        return float(fold(*operands))
    except ZeroDivisionError:
        return None


def is_runtime_float(value) -> bool:
    """Whether `value` is a float the graph reads at run time: a node whose value is a SymFloat (Dynamo traces a
    module's float attribute as a graph input where it does not specialise floats, as under dynamic=True)."""
    return isinstance(value, fx.Node) and isinstance(meta_value(value), torch.SymFloat)


def runtime_float_reason(what: str) -> str:
    """The report's reason where `what`, a constant of the op, is a runtime value in the graph."""
    return (f"{what} is a runtime value (Dynamo traced the float attribute as a graph input, e.g. under "
            "dynamic=True); the op needs it as a constant: set torch._dynamo.config.specialize_float = True")


def arg(node: fx.Node, index: int, name: str, default=None):
    """Argument `index` (positional) or `name` (keyword) of a call node."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def module_path(node: fx.Node) -> str | None:
    """The path of the module whose forward made `node` (Dynamo's nn_module_stack), e.g. "model.layers.0.mlp.gate"."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['[^']+'\]\.?", "", path)      # Dynamo's name for the compiled module (its self argument)
    path = re.sub(r"\[(\d+)\]", r".\1", path)          # layers[0] -> layers.0
    # ._modules['mlp'] -> .mlp; __dict__['_modules']['base_model'] (a module reached through its __dict__, as PEFT's
    # wrappers are) -> base_model
    path = re.sub(r"(?:\.|^)(?:__dict__\['_modules'\]|_modules)\['([^']+)'\]", r".\1", path)
    return path.lstrip(".")
