"""Prove a match numerically before the graph is changed.

The matched nodes are run as they are (interpreted node by node, on the
graph's device) on fresh random inputs, and so is the op's reference
(`mok_compile.ops.reference`, the op's definition, never a device kernel).
Weights are drawn so that routing is far from degenerate: router logits with a
standard deviation of about 2, gate/up activations large enough to reach a
clamp at 7, a selection bias strong enough to change choices. The probe is
repeated with new draws until every expert has been chosen at least once.

It passes when the chosen experts are identical for every token and the
outputs agree to a relative error (max |diff| / max |reference|) below
`TOLERANCE[dtype]`: a few units of rounding of the dtype. Wrong semantics
are far outside it: dropping the renormalisation, the scale or the selection
bias, or a wrong activation, changes the output by more than 5%.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from mok_compile.ops import reference

from .op_names import meta_value, tensor_meta

# Relative error allowed between the graph's own computation and the op's reference.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
MAX_ROUNDS = 8


def concrete(v):
    """A size for the probe: the hint of a symbolic size (the size it was traced with)."""
    if isinstance(v, (int, float)):
        return v
    if isinstance(v, (list, tuple)):
        return type(v)(concrete(x) for x in v) if not isinstance(v, torch.Size) else torch.Size(
            [concrete(x) for x in v])
    if isinstance(v, (torch.SymInt, torch.SymBool, torch.SymFloat)):
        hint = v.node.shape_env.size_hint(v.node.expr)
        return {torch.SymInt: int, torch.SymBool: bool, torch.SymFloat: float}[type(v)](hint)
    raise TypeError(f"cannot make {v!r} concrete")


def _random(meta: torch.Tensor, std: float, gen: torch.Generator) -> torch.Tensor:
    shape = [concrete(s) for s in meta.shape]
    t = torch.randn(shape, generator=gen, dtype=torch.float64) * std
    return t.to(dtype=meta.dtype, device=meta.device)


def run_nodes(gm: fx.GraphModule, nodes: list[fx.Node], env: dict) -> dict:
    """Evaluate `nodes` (in graph order) with `env` holding the values of everything they read."""
    load = lambda a: env[a]  # noqa: E731
    for n in nodes:
        args = fx.node.map_arg(n.args, load)
        kwargs = fx.node.map_arg(n.kwargs, load)
        if n.op == "call_function":
            env[n] = n.target(*args, **kwargs)
        elif n.op == "call_method":
            env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
        elif n.op == "call_module":
            env[n] = gm.get_submodule(n.target)(*args, **kwargs)
        else:
            raise RuntimeError(f"cannot run {n.op} node {n.name}")
    return env


def materialize(operand, value_of, stack=torch.stack, cat=torch.cat):
    """Value (or graph node) of an op operand: a node, None, or a `Stack` recipe of per-expert tensors."""
    from .experts import Stack

    if operand is None:
        return None
    if isinstance(operand, Stack):
        parts = [stack([value_of(n) for n in group], 0) for group in operand.groups]
        return parts[0] if len(parts) == 1 else cat(parts, 1)
    return value_of(operand)


def probe(gm: fx.GraphModule, flow, region, roles: dict, operands: list, kwargs: dict, exports: dict,
          seed: int = 0) -> str | None:
    """None when the region and the op agree on random inputs; otherwise why not.

    roles: input node -> "router" | "router_bias" | "selection_bias" | "gate_up" | "gate_up_bias" | "down" |
    "down_bias" | "hidden"; operands: the op's 8 tensor operands; exports: {"weights": node, "ids": node} the rest
    of the graph reads and the op's outputs replace.
    """
    H = concrete(region.H)
    inter = max(1, kwargs.get("_intermediate", H))
    std = {"hidden": 1.0, "router": 2.0 / math.sqrt(H), "router_bias": 0.5, "selection_bias": 0.2,
           "gate_up": 3.0 / math.sqrt(H), "gate_up_bias": 0.1, "down": 1.0 / math.sqrt(inter), "down_bias": 0.1}
    op_kw = {k: v for k, v in kwargs.items() if not k.startswith("_")}
    nodes = flow.sorted(region.nodes)
    E = concrete(region.E)
    seen = torch.zeros(E, dtype=torch.bool)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for round_ in range(MAX_ROUNDS):
            env = {}
            for n in [region.root, *region.inputs]:
                meta = meta_value(n)
                if isinstance(meta, torch.Tensor):
                    if not meta.is_floating_point():
                        return f"block input {n.name} is not a float tensor"
                    env[n] = _random(meta, std[roles.get(n, "hidden")], gen)
                else:
                    env[n] = concrete(meta)
            try:
                run_nodes(gm, nodes, env)
                args = [materialize(o, env.__getitem__) for o in operands]
                out, w, ids = reference.fused_moe_reference(*args, **op_kw)
            except Exception as err:  # a region that cannot even run on fresh inputs is not proven
                return f"probe failed to run: {type(err).__name__}: {err}"
            got = env[region.out]
            got_ids = env[region.ids]
            if not torch.equal(got_ids.sort(-1).values, ids.sort(-1).values):
                return "probe: the op selects different experts than the graph"
            if "ids" in exports and not torch.equal(env[exports["ids"]], ids):
                return "probe: the op returns expert ids in a different order than the graph"
            if "weights" in exports:
                gw = env[exports["weights"]]
                if gw.dtype != w.dtype or gw.shape != w.shape or _rel_err(gw, w) > TOLERANCE[out.dtype]:
                    return "probe: the op's routing weights differ from the graph's"
            err = _rel_err(got, out.reshape(got.shape))
            if got.dtype != out.dtype or err > TOLERANCE[out.dtype]:
                return f"probe: outputs differ (relative error {err:.2e} > {TOLERANCE[out.dtype]:.0e})"
            seen[ids.reshape(-1).cpu()] = True
            if bool(seen.all()) and round_ >= 1:
                break
    return None


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / max(scale, 1e-300)
