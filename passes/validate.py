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

Drawing the weights means a copy of them (a DeepSeek-V3 layer's are 22 GB),
which a GPU holding the model may not have free. Where the draw runs out of
memory, the probe runs again on the model's own weights (the graph's live
parameters) and fresh hidden states, scaled up round by round
(`OWN_WEIGHTS_SCALES`) so that small weights still reach clamps and
thresholds, until an output overflows or the router saturates (its choice
then ties): no copy, the same checks, and any step of the block that would
write a weight stops the probe instead.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator

import sympy
import torch
import torch.fx as fx

from mok_compile.ops import reference

from .autocast import running_under
from .op_names import meta_value

log = logging.getLogger("mok_compile.passes")

# Relative error allowed between the graph's own computation and the op's reference.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
MAX_ROUNDS = 8


def concrete(v, subs=None):
    """A size for the probe: the hint of a symbolic size (the size it was traced with), or its value with the
    symbols in `subs` ({sympy symbol: int}) set to other sizes."""
    if isinstance(v, (int, float)):
        return v
    if isinstance(v, (list, tuple)):
        return type(v)(concrete(x, subs) for x in v) if not isinstance(v, torch.Size) else torch.Size(
            [concrete(x, subs) for x in v])
    if isinstance(v, torch.SymFloat) and not subs and v.node.hint is not None:
        return float(v.node.hint)  # the shape env's hint of a float symbol may be rounded to an integer
    if isinstance(v, (torch.SymInt, torch.SymBool, torch.SymFloat)):
        expr = v.node.expr
        if subs:
            expr = expr.xreplace({k: sympy.Integer(x) for k, x in subs.items()})
        hint = expr if expr.is_number else _hint(v.node.shape_env, expr)
        if hint is None:
            raise TypeError(f"cannot make {v!r} concrete (no hint: a data-dependent size)")
        return {torch.SymInt: int, torch.SymBool: bool, torch.SymFloat: float}[type(v)](hint)
    raise TypeError(f"cannot make {v!r} concrete")


def traced_float(node) -> float:
    """The value Dynamo traced for a float the graph reads at run time (a module's float attribute under
    dynamic=True): what the probe runs the op with, where the op itself reads the node."""
    return concrete(meta_value(node))


def _hint(shape_env, expr):
    """The traced value of a size expression, or None for a data-dependent one (torch >= 2.11 spellings)."""
    get = getattr(shape_env, "guarding_hint_or_throw", None)  # newer torch; size_hint is deprecated there
    try:
        value = get(expr) if get is not None else shape_env.size_hint(expr, allow_none=True)
    except Exception:
        return None
    if value is None or (isinstance(value, sympy.Basic) and not value.is_number):
        return None
    return value


def _random(meta: torch.Tensor, std: float, gen: torch.Generator, subs=None) -> torch.Tensor:
    shape = [concrete(s, subs) for s in meta.shape]
    # Drawn in the block's dtype and scaled in place: one copy of a weight at a time (a DeepSeek-V3 layer's
    # gate_up weight is 15 GB in bf16; a float32 draw took 30 GB more, which a loaded GPU may not have).
    return torch.randn(shape, generator=gen, dtype=meta.dtype, device=gen.device).mul_(std)


def run_nodes(gm: fx.GraphModule, nodes: list[fx.Node], env: dict, protect=(), autocast: dict | None = None) -> dict:
    """Evaluate `nodes` (in graph order) with `env` holding the values of everything they read, each under its
    autocast where `autocast` gives one (node -> `passes.autocast.node_states` value). A node that would write a
    tensor sharing storage with one in `protect` raises `WritesProtected` before it runs."""
    load = lambda a: env[a]  # noqa: E731
    storages = {t.untyped_storage().data_ptr() for t in protect} - {0}  # (0: an empty storage, no memory to write)
    for n in nodes:
        args = fx.node.map_arg(n.args, load)
        kwargs = fx.node.map_arg(n.kwargs, load)
        if storages and _writes(n):
            written = kwargs.get("out", args[0] if args else None)
            for t in written if isinstance(written, (list, tuple)) else (written,):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in storages:
                    raise WritesProtected(f"node {n.name} ({n.target}) writes one of the model's weights")
        with running_under(autocast[n]) if autocast and n in autocast else contextlib.nullcontext():
            env[n] = _run_node(gm, n, args, kwargs)
    return env


def _run_node(gm: fx.GraphModule, n: fx.Node, args, kwargs):
    if n.op == "call_function":
        return n.target(*args, **kwargs)
    if n.op == "call_method":
        return getattr(args[0], n.target)(*args[1:], **kwargs)
    if n.op == "call_module":
        return gm.get_submodule(n.target)(*args, **kwargs)
    raise RuntimeError(f"cannot run {n.op} node {n.name}")


class WritesProtected(RuntimeError):
    """A step of the block writes a tensor the probe must not change (the model's own weights)."""


_IN_PLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                       operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                       operator.ilshift, operator.irshift, operator.imatmul}


def _writes(n: fx.Node) -> bool:
    """Whether a node may write its first argument (or its `out=`): an in-place method or function, an assignment
    into a tensor, an aten overload with a mutable schema."""
    if "out" in n.kwargs:
        return True
    if n.op == "call_method":
        return n.target.endswith("_") and not n.target.startswith("__")
    if n.op != "call_function":
        return False
    if n.target in _IN_PLACE_OPERATORS:
        return True
    schema = getattr(n.target, "_schema", None)
    if schema is not None:
        return schema.is_mutable
    name = getattr(n.target, "__name__", "")
    return name.endswith("_") and not name.startswith("__")


def materialize(operand, value_of, stack=torch.stack, cat=torch.cat, flat=torch.reshape):
    """Value (or graph node) of an op operand: a node, None, a `Stack` recipe of per-expert tensors or a `Flat`
    view of one."""
    from .experts import Stack
    from .routing import Flat

    if operand is None:
        return None
    if isinstance(operand, Stack):
        parts = [stack([value_of(n) for n in group], 0) for group in operand.groups]
        return parts[0] if len(parts) == 1 else cat(parts, 1)
    if isinstance(operand, Flat):
        return flat(value_of(operand.source), operand.shape)
    return value_of(operand)


# Tokens the probe runs with when the graph's token count is symbolic (dynamic shapes): a smaller member of the
# family of sizes the graph is valid for, still large enough that every expert is chosen within a few rounds.
PROBE_TOKENS = 64


def probe_sizes(region) -> dict:
    """{symbol: size} that sets a symbolic token count T to at most max(PROBE_TOKENS, 4 * ceil(E / K)) (every
    symbol of T stays >= 2, as Dynamo assumes); {} (probe at the traced sizes) for a static T, a small one, or
    one that cannot be lowered. A static T is baked into the graph's constants, so it is never changed."""
    T = region.T
    if not isinstance(T, torch.SymInt):
        return {}
    E, K = concrete(region.E), max(1, region.K)
    cap = max(PROBE_TOKENS, 4 * -(-E // K))
    shape_env, expr = T.node.shape_env, T.node.expr
    symbols = sorted(expr.free_symbols, key=str)
    hints = {}
    for sym in symbols:
        hint = _hint(shape_env, sym)
        if hint is None:
            return {}  # an unbacked size: no hint to start from
        hints[sym] = int(hint)

    def tokens(values):
        v = expr.xreplace({k: sympy.Integer(x) for k, x in values.items()})
        return int(v) if v.is_number else None

    if tokens(hints) is None or tokens(hints) <= cap:
        return {}
    values = dict(hints)
    for sym in symbols:
        lo, hi = 2, values[sym]
        if lo > hi:
            continue
        values[sym] = lo
        if tokens(values) > cap:
            continue  # this symbol alone cannot bring T under the cap: keep it at 2, lower the next
        while lo < hi:  # the largest size of `sym` that keeps T under the cap
            mid = (lo + hi + 1) // 2
            values[sym] = mid
            lo, hi = (mid, hi) if tokens(values) <= cap else (lo, mid - 1)
        values[sym] = lo
        break
    t = tokens(values)
    if t is None or t > cap or t * K < 2 * E:
        return {}
    return {sym: v for sym, v in values.items() if v != hints[sym]}


def probe_key(flow, region, roles: dict, operands: list, kwargs: dict, exports: dict):
    """Everything `probe` depends on, with node names replaced by positions: two blocks with the same key get the
    same verdict (same op sequence, targets, constants, shapes, dtypes, devices, roles of the inputs, operands,
    op keywords). None when the region holds something the key cannot capture (a call_module, an unknown
    constant): such a block is always probed.

    Under dynamic shapes a size Dynamo specialised is a SymInt of constant value, in one layer a graph node (`size()`
    of the layer's input) and in the next a plain int; each layer's float attribute (a routed scale) is a symbol of its
    own. So sizes of constant value count as those constants (their nodes left out), and symbols are named by the
    order in which the key meets them: identical layers share a key, and blocks whose sizes relate differently (one
    symbol where the other has two) do not."""
    keyer = _Keyer()
    freeze, index = keyer.freeze, keyer.index
    try:
        # the region's inputs in an order of their own (the graph interleaves a layer's scale and sizes differently in
        # its first layer), ties in graph order
        rest = sorted((n for n in region.inputs if not _constant_size(n)), key=lambda n: (
            roles.get(n, "hidden"), n.op, repr(_Keyer(anonymous=True).meta(meta_value(n)))))
        inputs = [region.root, *rest]
        nodes = [n for n in flow.sorted(region.nodes) if not _constant_size(n)]
        index.update((n, i) for i, n in enumerate(inputs + nodes))
        key = (
            tuple((n.op, roles.get(n, "hidden"), keyer.meta(meta_value(n))) for n in inputs),
            tuple((n.op, _target_key(n), freeze(n.args), freeze(n.kwargs), keyer.meta(meta_value(n))) for n in nodes),
            tuple(_operand_key(o, keyer) for o in operands),
            tuple(sorted((k, freeze(v)) for k, v in exports.items())),
            tuple(sorted((k, freeze(v)) for k, v in kwargs.items())),
            index[region.out], index[region.ids], index[region.x], freeze(region.T), freeze(region.H),
            freeze(region.E), region.K,
        )
        hash(key)
    except (_NoKey, TypeError, KeyError):
        return None
    return key


class _NoKey(Exception):
    pass


_PLAIN = (bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout)
_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _constant_size(node) -> bool:
    """A node whose value is a symbolic scalar Dynamo specialised to a constant."""
    v = meta_value(node)
    return isinstance(v, _SYM) and v.node.expr.is_number


class _Keyer:
    """Freezes graph values into hashable keys: nodes by `index`, symbols by the order they are met."""

    def __init__(self, anonymous: bool = False):
        self.index: dict = {}
        self.symbols: dict = {}
        self.anonymous = anonymous  # every symbol named alike (only its value counts): for ordering, not for keys

    def freeze(self, v):
        if isinstance(v, fx.Node):
            return self.freeze(meta_value(v)) if _constant_size(v) else ("node", self.index[v])
        if v is None or v is Ellipsis:
            return (repr(v),)
        if isinstance(v, _PLAIN):
            return (type(v).__name__, v)
        if isinstance(v, _SYM):
            expr = v.node.expr
            if expr.is_number:
                return self.freeze(concrete(v))
            names = {s: "c" if self.anonymous else self.symbols.setdefault(str(s), f"c{len(self.symbols)}")
                     for s in sorted(expr.free_symbols, key=str)}
            renamed = expr.xreplace({s: type(s)(name, **s.assumptions0) for s, name in names.items()})
            return ("sym", type(v).__name__, str(renamed), concrete(v))
        if isinstance(v, slice):
            return ("slice", self.freeze(v.start), self.freeze(v.stop), self.freeze(v.step))
        if isinstance(v, (list, tuple)):  # torch.Size too
            return (type(v).__name__, tuple(self.freeze(x) for x in v))
        if isinstance(v, dict):
            return ("dict", tuple(sorted((str(k), self.freeze(x)) for k, x in v.items())))
        raise _NoKey(type(v).__name__)

    def meta(self, meta):
        if isinstance(meta, torch.Tensor):
            return ("tensor", self.freeze(tuple(meta.shape)), meta.dtype, meta.device)
        if isinstance(meta, (list, tuple)):
            return ("seq", tuple(self.meta(m) for m in meta))
        if meta is None or isinstance(meta, (_PLAIN, *_SYM)):
            return self.freeze(meta)
        return ("other", type(meta).__name__)


def _target_key(n: fx.Node):
    if n.op == "call_method":
        return n.target
    if n.op == "call_function":
        return n.target  # the callable itself (hashable), not its name: two different functions never share
    raise _NoKey(n.op)  # call_module runs a module whose own parameters the probe does not draw


def _operand_key(operand, keyer: _Keyer):
    from .experts import Stack

    if isinstance(operand, Stack):
        return ("stack", tuple(tuple(keyer.index[n] for n in g) for g in operand.groups))
    return keyer.freeze(operand)


def probe(gm: fx.GraphModule, flow, region, roles: dict, operands: list, kwargs: dict, exports: dict,
          seed: int = 0, cache: dict | None = None, live: dict | None = None,
          proof: dict | None = None, autocast: dict | None = None) -> str | None:
    """None when the region and the op agree on random inputs; otherwise why not.

    roles: input node -> "router" | "router_bias" | "selection_bias" | "gate_up" | "gate_up_bias" | "down" |
    "down_bias" | "expert_scale" | "post_norm_weight" | "expert_ids" (given ids: random ones are drawn) | "hidden";
    operands: the op's 8 tensor operands;
    exports: {"weights": node, "ids": node} the rest of the graph reads and the op's outputs replace. `cache` (one
    per `fuse_moe` call) maps `probe_key`s to verdicts, so structurally identical layers are probed once. `live`
    maps placeholders to the graph's live inputs (`live_inputs`): the weights the probe falls back on where drawing
    a copy of them runs out of memory; `proof["own_weights"]` then tells whether the verdict was taken on them.

    A symbolic token count is lowered for the probe (`probe_sizes`); if the region does not run or does not
    agree at the lowered size, the verdict is taken at the traced size. Each region node runs under its autocast
    (`autocast`: node -> (device, dtype) pairs, `passes.autocast.node_states`; none where not given), the op's
    reference without any: the op is not autocast-aware.
    """
    from torch._dynamo.utils import counters

    key = probe_key(flow, region, roles, operands, kwargs, exports) if cache is not None else None
    autocast = autocast or {}
    key = None if key is None else (key, tuple(autocast.get(n, ()) for n in flow.sorted(region.nodes)))
    if key is not None and key in cache:
        counters["mok"]["probe_cached"] += 1
        why, own = cache[key]
    else:
        subs = probe_sizes(region)
        why, own = _probe_at(gm, flow, region, roles, operands, kwargs, exports, seed, subs, live or {}, autocast)
        if why is not None and subs:
            why, own = _probe_at(gm, flow, region, roles, operands, kwargs, exports, seed, {}, live or {}, autocast)
        if key is not None:
            cache[key] = why, own
    if proof is not None:
        proof["own_weights"] = own
    return why


def live_inputs(gm: fx.GraphModule, example_inputs) -> dict:
    """{placeholder: its example input} for the inputs that are real tensors (Dynamo hands the backend the live
    parameters); fake, meta and subclass tensors are left out."""
    from torch._subclasses.fake_tensor import FakeTensor

    if example_inputs is None:
        return {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return {}
    return {n: t for n, t in zip(placeholders, example_inputs)
            if type(t) in (torch.Tensor, torch.nn.Parameter) and not isinstance(t, FakeTensor) and not t.is_meta}


def _own_weights(inputs, roles: dict, live: dict, subs) -> dict:
    """{input: the model's own tensor} for the block's weights that are live graph inputs of the traced shape,
    dtype and device (hidden states, logits and expert ids are always drawn)."""
    own = {}
    for n in inputs:
        role, t, meta = roles.get(n, "hidden"), live.get(n), meta_value(n)
        if role in ("hidden", "router_logits", "expert_ids") or t is None or not isinstance(meta, torch.Tensor):
            continue
        try:
            shape = [concrete(d, subs) for d in meta.shape]
        except TypeError:
            continue
        if list(t.shape) == shape and t.dtype == meta.dtype and t.device == meta.device:
            own[n] = t.detach()
    return own


def _probe_at(gm, flow, region, roles, operands, kwargs, exports, seed, subs, live,
              autocast: dict) -> tuple[str | None, bool]:
    """(why the probe fails or None, whether it ran on the model's own weights)."""
    from torch._dynamo.utils import counters

    counters["mok"]["probe_runs"] += 1
    H = concrete(region.H)
    inter = max(1, kwargs.get("_intermediate", H))
    std = {"hidden": 1.0, "router": 2.0 / math.sqrt(H), "router_logits": 2.0, "router_bias": 0.5, "selection_bias": 0.2,
           "gate_up": 3.0 / math.sqrt(H), "gate_up_bias": 0.1, "down": 1.0 / math.sqrt(inter), "down_bias": 0.1,
           "expert_scale": 1.0, "post_norm_weight": 0.5}
    op_kw = {k: v for k, v in kwargs.items() if not k.startswith("_")}
    nodes = flow.sorted(region.nodes)
    E = concrete(region.E)
    seen = torch.zeros(E, dtype=torch.bool)
    gens = {}

    def generator(device):  # draws on the block's own device (no multi-GB host-to-device copies)
        if device not in gens:
            gens[device] = torch.Generator(device=device).manual_seed(seed)
        return gens[device]

    inputs = [region.root, *region.inputs]

    def one_round(round_, own):
        """(why the probe fails or None, the op's expert ids) on one draw of the inputs, the tensors in `own` taken
        as they are. Everything the round made dies when it returns, so the next round's draws never meet its copy
        of the weights."""
        env = {}
        scale = OWN_WEIGHTS_SCALES[min(round_, len(OWN_WEIGHTS_SCALES) - 1)] if own else 1.0  # of the hidden states
        try:
            for n in inputs:
                meta = meta_value(n)
                if n in own:
                    env[n] = own[n]
                elif roles.get(n) == "expert_ids":
                    env[n] = _random_ids(meta, E, round_, generator(meta.device), subs)
                elif isinstance(meta, torch.Tensor):
                    if not meta.is_floating_point():
                        return f"block input {n.name} is not a float tensor", None
                    role = roles.get(n, "hidden")
                    env[n] = _random(meta, std[role] * (scale if role == "hidden" else 1.0), generator(meta.device),
                                     subs)
                else:
                    env[n] = concrete(meta, subs)
            run_nodes(gm, nodes, env, protect=own.values(), autocast=autocast)
            args = [materialize(o, env.__getitem__) for o in operands]
            given = {k: env[v] for k, v in op_kw.items() if isinstance(v, fx.Node)}  # tensors, runtime floats
            with running_under(()):
                out, w, ids = reference.fused_moe_reference(*args, **{**op_kw, **given})
        except torch.OutOfMemoryError:
            return _OUT_OF_MEMORY, None
        except Exception as err:  # a region that cannot even run on fresh inputs is not proven
            return f"probe failed to run: {type(err).__name__}: {err}", None
        got = env[region.out]
        if not (bool(torch.isfinite(got).all()) and bool(torch.isfinite(out).all())):
            return _NOT_FINITE, None
        if own and round_ > 0 and _tied(w):
            return _TIED, None
        got_ids = env[region.ids]
        if got_ids.numel() != ids.numel():
            return f"probe: the graph chooses {tuple(got_ids.shape)} expert ids, the op {tuple(ids.shape)}", None
        got_ids = got_ids.reshape(ids.shape)  # [B, S, K] where the logits are [B, S, E] (Zaya's)
        if not torch.equal(got_ids.sort(-1).values, ids.sort(-1).values):
            return "probe: the op selects different experts than the graph", None
        if "ids" in exports and not torch.equal(env[exports["ids"]], ids):
            return "probe: the op returns expert ids in a different order than the graph", None
        if "weights" in exports:
            gw = env[exports["weights"]]
            if gw.dtype != w.dtype or gw.shape != w.shape or _rel_err(gw, w) > TOLERANCE[out.dtype]:
                return "probe: the op's routing weights differ from the graph's", None
        err = _rel_err(got, out.reshape(got.shape))
        if got.dtype != out.dtype or err > TOLERANCE[out.dtype]:
            return f"probe: outputs differ (relative error {err:.2e} > {TOLERANCE[out.dtype]:.0e})", None
        return None, ids

    def rounds(own):
        seen.zero_()
        last_scale = len(OWN_WEIGHTS_SCALES) - 1 if own else 1  # the first round after which the probe may stop
        for round_ in range(MAX_ROUNDS):
            why, ids = one_round(round_, own)
            if why is _TIED or (why is _NOT_FINITE and own and round_ > 0):
                break  # the block overflows, or its routing ties, at this scale: the rounds before it are the verdict
            if why is _NOT_FINITE:
                return "probe: the outputs are not finite (an overflow) on the probe's inputs"
            if why is not None:
                return why
            seen[ids.reshape(-1).cpu()] = True
            if bool(seen.all()) and round_ >= last_scale:
                break
        return None

    with torch.no_grad():
        why = rounds({})
        if why is not _OUT_OF_MEMORY:
            return why, False
        own = _own_weights(inputs, roles, live, subs)
        if own:
            _release_cached_memory()  # (the round's tensors are gone)
            counters["mok"]["probe_own_weights"] += 1
            log.info("mok: no memory for the probe's copy of the weights of %s: probing on the model's own ones",
                     region.out.name)
            why = rounds(own)
            if why is None:
                return None, True
            if why is not _OUT_OF_MEMORY:
                return f"probe on the model's own weights (no memory for a copy of them): {why}", True
        return _out_of_memory(inputs, subs, own), bool(own)


_OUT_OF_MEMORY = "out of memory"  # one_round's verdict, turned into the reason by `_out_of_memory`
_NOT_FINITE = "not finite"  # one_round's verdict where the graph's or the reference's output overflows
_TIED = "tied"  # one_round's verdict where grown inputs saturate the routing (its choice is then no longer defined)
# The hidden states' standard deviation, round by round, where the probe runs on the model's own weights: they may
# be small (a fresh model's std is 0.02), so larger inputs reach what the drawn weights are chosen to reach (a clamp
# at 7, a mask's threshold); the rounds stop growing them where an output overflows or the routing saturates.
OWN_WEIGHTS_SCALES = (1.0, 8.0, 64.0, 512.0)


def _release_cached_memory():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # what the probe's draws held goes back to the device


def _out_of_memory(inputs, subs, own) -> str:
    """Why a probe that ran out of memory proves nothing: it draws a copy of every block input, weights included (a
    DeepSeek-V3 layer's are 22 GB), on the block's device, which a GPU holding a model may not have free; `own`:
    the weights it then ran on as they are, and still ran out of memory."""
    _release_cached_memory()
    metas = [m for m in (meta_value(n) for n in inputs) if isinstance(m, torch.Tensor)]
    size = 0
    for m in metas:
        try:
            size += math.prod(concrete(d, subs) for d in m.shape) * m.element_size()
        except TypeError:  # a data-dependent size: no bytes to count for it
            pass
    devices = ", ".join(sorted({str(m.device) for m in metas}))
    amount = f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.2f} MB"
    then = (", and again on the model's own weights (no copy)" if own else
            " (its weights are no live graph inputs, so it could not run on them instead)")
    return (f"probe: out of memory on {devices} drawing the block's inputs ({amount}, a copy of its weights) and "
            f"running it{then}; free that much before compiling, or compile with options={{'validate': False}} "
            "to fuse on the structural match alone")


def _tied(weights: torch.Tensor) -> bool:
    """Whether a routing's chosen weights [T, K] show a saturated router: a weight of 0 (a softmax that underflows)
    or two equal weights in a row (sigmoids at 1), where which experts tie for the last places is arbitrary."""
    if not weights.is_floating_point() or weights.numel() == 0:
        return False
    w = weights.reshape(weights.shape[0], -1).sort(-1).values
    return bool((w == 0).any()) or bool((w[:, 1:] == w[:, :-1]).any())


def _random_ids(meta: torch.Tensor, num_experts: int, round_: int, gen: torch.Generator, subs) -> torch.Tensor:
    """Given expert ids [T, K] for the probe: distinct in each row on even rounds (as a top-k's), drawn with
    repeats on odd ones (a hash table may name an expert twice, and the op then runs both pairs)."""
    T, K = (concrete(s, subs) for s in meta.shape)
    if round_ % 2 == 0 and K <= num_experts:
        ids = torch.rand(T, num_experts, generator=gen, device=gen.device).argsort(dim=-1)[:, :K]
    else:
        ids = torch.randint(0, num_experts, (T, K), generator=gen, device=gen.device)
    return ids.to(meta.dtype)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / max(scale, 1e-300)
