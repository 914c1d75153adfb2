"""An RMSNorm of each expert's output row before its routing weight: the op's ``post_norm``.

    y [pairs, H]: the experts' output rows, in the experts' dtype dt
    rms (Ergo):         y ─float─> a ─ rms ─> u ─ * g ─ to(dt) ─> n
    scaled_rms (Muse):  y ─float─ * g ─ to(dt) ─ float─> a ─ rms ─> u ─ to(dt) ─> n
    n ─(views)─> n * w (the routing weights) ─> combine

    rms(a):  a * rsqrt(a.pow(2).mean(-1, keepdim=True) + eps)  |  rms_norm(a, (H,), None, eps)  (rms: g its weight)
    g:       v ([H], or v[ids]: a row of [E, H] per pair) [+ c, in v's dtype], upcast: post_norm_weight, offset c

The casts are checked by their dtypes: a and the products with g in fp32 (or wider), n and Muse Spark's scaled rows
rounded to dt once, where the op rounds them (in fp32 every such cast is a no-op); eps is read off the graph (the
probe cannot tell 1e-8 from 1e-6). Which row of v goes with which pair is for the probe to prove.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .dataflow import Dataflow
from .op_names import CAST_OPS, VIEW_OPS, arg, is_runtime_float, number, op_name, runtime_float_reason, tensor_meta
from .region import NORM_OPS, NoMatch, Region, same

_WIDE = (torch.float32, torch.float64)


@dataclass(frozen=True)
class PostNorm:
    kind: str                  # "rms" | "scaled_rms" (`ExpertSpec.post_norm`)
    eps: float
    offset: float
    weight: fx.Node            # v, a block input: the op's post_norm_weight
    rows: fx.Node              # y, the rows normalised
    out: fx.Node               # n, what the routing weights multiply


def find_post_norm(region: Region) -> PostNorm | None:
    """The block's post-norm; None where the block normalises nothing (no mean, rsqrt or rms_norm); NoMatch where what
    it has is not exactly the op's."""
    cores = [n for n in region.nodes if op_name(n) in NORM_OPS - {"mean"}]
    means = [n for n in region.nodes if op_name(n) == "mean"]
    if not cores and not means:
        return None
    if len(cores) != 1:
        raise NoMatch(f"the block has {len(cores)} rsqrt or rms_norm ops and {len(means)} means: not one RMSNorm of "
                      "each expert's output (the op's post_norm)")
    dt = tensor_meta(region.x).dtype
    core = cores[0]
    if op_name(core) == "rms_norm":
        a, u, eps, inner = _fused_rms(region, core, means)
    else:
        a, u, eps, inner = _written_rms(region, core, means)
    if tensor_meta(a).dtype not in _WIDE or tensor_meta(u).dtype not in _WIDE:
        raise NoMatch(f"the post-norm's RMSNorm runs in {tensor_meta(a).dtype}, the op's in fp32")
    src, dtypes = _casts_back(a)
    pre = _scaled(region, src)
    after = _single_user(u, region)
    post = _scaled(region, after) if after is not None and op_name(after) == "mul" else None
    scales = [s for s in (inner, pre, post) if s is not None]
    if len(scales) != 1:
        raise NoMatch(f"the post-norm's RMSNorm is scaled by {len(scales)} norm weights (the op's post_norm: one, "
                      "before the norm (scaled_rms) or after it (rms))")
    if pre is not None:  # scaled_rms: the scaled rows rounded to dt, then normalised
        _check_rounded(dtypes, dt, "the scaled rows the post-norm normalises")
        product, (weight, offset), y = pre
        y, y_dtypes = _casts_back(y)
        kind, last = "scaled_rms", u
    else:  # rms: the rows normalised, then scaled
        y, y_dtypes = src, dtypes
        (weight, offset), product = (inner, u) if inner is not None else (post[1], post[0])
        kind, last = "rms", product
    if tensor_meta(product).dtype not in _WIDE:
        raise NoMatch(f"the post-norm multiplies by its weight in {tensor_meta(product).dtype}, the op in fp32")
    _check_rounded(y_dtypes, dt, "the rows the post-norm reads (the experts' output)")
    out, out_dtypes = _casts_forward(last, region)
    _check_rounded(out_dtypes, dt, "the post-norm's output", last=True)
    meta, v = tensor_meta(y), tensor_meta(weight)
    if not same(v.shape[-1], meta.shape[-1]) or v.dim() == 2 and not same(v.shape[0], region.E):
        raise NoMatch(f"the post-norm's weight {weight.name} has shape {tuple(v.shape)}, not [H] or [E, H]")
    return PostNorm(kind=kind, eps=float(eps), offset=offset, weight=weight, rows=y, out=out)


def check_post_norm_placement(flow: Dataflow, region: Region, norm: PostNorm, down: fx.Node, weights: fx.Node):
    """The post-norm reads the experts' output (downstream of the down projection `down`), and its output reaches the
    routing weights' product through views alone (`region` has no norm past the weights)."""
    if norm.rows not in flow.forward_slice([down], within=region.nodes):
        raise NoMatch("the block's RMSNorm does not read the experts' output (a post-norm normalises each expert's "
                      "output row)")
    weighted = flow.forward_slice([weights], within=region.nodes)
    users, work = [], [norm.out]
    while work:
        for u in (u for u in work.pop().users if u in region.nodes):
            (work if op_name(u) in VIEW_OPS else users).append(u)
    if not users or any(op_name(u) != "mul" or not any(a in weighted for a in u.all_input_nodes) for u in users):
        raise NoMatch("the post-norm's output is not multiplied by the routing weights (through views alone)")


def _fused_rms(region: Region, core: fx.Node, means: list) -> tuple:
    """(a, u, eps, scale) of ``rms_norm(a, (H,), g, eps)``: eps None is the machine epsilon of a's dtype, as in
    torch; scale: (weight, offset) of g, or None."""
    a, shape = core.args[0], arg(core, 1, "normalized_shape")
    if means:
        raise NoMatch("the block has an rms_norm and a mean: not one RMSNorm of each expert's output")
    if not isinstance(shape, (list, tuple)) or len(shape) != 1 or not same(shape[0], tensor_meta(a).shape[-1]):
        raise NoMatch(f"the post-norm's rms_norm normalises over {shape}, not the last dimension")
    eps = arg(core, 3, "eps")
    eps = torch.finfo(tensor_meta(a).dtype).eps if eps is None else _eps(eps)
    g = arg(core, 2, "weight")
    scale = None if g is None else _weight_of(g, region)
    if g is not None and scale is None:
        raise NoMatch("the post-norm's rms_norm weight is not a norm weight of the block")
    return a, core, eps, scale


def _written_rms(region: Region, rsqrt: fx.Node, means: list) -> tuple:
    """(a, u, eps, None) of ``u = a * rsqrt(a.pow(2).mean(-1, keepdim=True) + eps)``."""
    added = rsqrt.args[0]
    terms = added.args if op_name(added) == "add" else ()
    eps = [v for v in terms if number(v) is not None or is_runtime_float(v)]
    mean = [v for v in terms if v not in eps]
    if len(eps) != 1 or len(mean) != 1:
        raise NoMatch("the post-norm's rsqrt does not read the mean of squares plus an eps")
    mean = mean[0]
    if op_name(mean) != "mean" or means != [mean]:
        raise NoMatch("the post-norm's rsqrt does not read the one mean of the block")
    dim, keepdim = arg(mean, 1, "dim"), arg(mean, 2, "keepdim", False)
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    square = mean.args[0]
    if dim not in (-1, tensor_meta(square).dim() - 1) or keepdim is not True or "dtype" in mean.kwargs:
        raise NoMatch(f"the post-norm's mean is over dim {dim!r} (keepdim={keepdim}), not the last dimension kept")
    a = square.args[0]
    if not (op_name(square) == "pow" and tuple(square.args[1:]) == (2,) or op_name(square) == "square"
            or op_name(square) == "mul" and tuple(square.args) == (a, a)):
        raise NoMatch("the post-norm's mean is not of the squares of what it normalises")
    u = _single_user(rsqrt, region)
    if u is None or op_name(u) != "mul" or set(u.args) != {a, rsqrt}:
        raise NoMatch("the post-norm does not multiply what it normalises by the rsqrt of its mean square")
    return a, u, _eps(eps[0]), None


def _eps(value) -> float:
    """The post-norm's eps: a number >= 0 (a float the graph reads at run time is not one, as for the op's other
    constants)."""
    if is_runtime_float(value):
        raise NoMatch(runtime_float_reason("the post-norm's eps"))
    if number(value) is None or number(value) < 0:
        raise NoMatch(f"the post-norm's eps {value!r} is not a number >= 0")
    return number(value)


def _scaled(region: Region, product) -> tuple | None:
    """(product, (weight, offset), the other factor) where `product` multiplies a tensor by a norm weight, else None."""
    if not isinstance(product, fx.Node) or op_name(product) != "mul" or len(product.args) != 2:
        return None
    for g, other in (product.args, product.args[::-1]):
        found = _weight_of(g, region) if isinstance(g, fx.Node) and isinstance(other, fx.Node) else None
        if found is not None:
            return product, found, other
    return None


def _weight_of(g: fx.Node, region: Region) -> tuple[fx.Node, float] | None:
    """(v, c) of a norm weight ``c + v[ids] | v[ids] | c + v | v`` through casts that widen, v a block input ([E, H]
    indexed by integers, or [H]), the sum in v's dtype (the op's); None where `g` is something else."""
    n, offset, added, indexed = g, 0.0, False, False
    while True:
        src, dtypes = _casts_back(n)
        if src in region.inputs:
            meta = tensor_meta(src)
            if meta is None or meta.dim() != (2 if indexed else 1):
                return None
            if any(d not in _WIDE and d != dtypes[0] for d in dtypes):
                raise NoMatch("the post-norm's weight is rounded before its product; the op upcasts it")
            return src, offset
        tensors = [v for v in src.args if isinstance(v, fx.Node)]
        numbers = [number(v) for v in src.args if number(v) is not None]
        if op_name(src) == "add" and not added and len(tensors) == 1 and len(numbers) == 1:
            if tensor_meta(_casts_back(tensors[0])[0]).dtype != tensor_meta(src).dtype:
                raise NoMatch("the post-norm adds its offset to its weight in another dtype than the weight's (the op "
                              "adds it in the weight's dtype)")
            n, offset, added = tensors[0], numbers[0], True
        elif (op_name(src) == "getitem" and not indexed and len(tensors) == 2 and src.args[0] is tensors[0]
              and not tensor_meta(tensors[1]).is_floating_point()):
            n, indexed = tensors[0], True
        else:
            return None


def _casts_back(n: fx.Node) -> tuple[fx.Node, list]:
    """(source, dtypes from the source to `n`) of a chain of casts ending at `n`."""
    dtypes = [tensor_meta(n).dtype]
    while op_name(n) in CAST_OPS and isinstance(n.args[0], fx.Node):
        n = n.args[0]
        dtypes.insert(0, tensor_meta(n).dtype)
    return n, dtypes


def _casts_forward(n: fx.Node, region: Region) -> tuple[fx.Node, list]:
    """(last, dtypes from `n` to it) along the casts that alone read `n`, one after another."""
    dtypes = [tensor_meta(n).dtype]
    while (u := _single_user(n, region)) is not None and op_name(u) in CAST_OPS and u.args[0] is n:
        n = u
        dtypes.append(tensor_meta(n).dtype)
    return n, dtypes


def _check_rounded(dtypes: list, dt: torch.dtype, what: str, last: bool = False):
    """A chain of casts that rounds to `dt` once, as the op does: every dtype `dt` or wider, `dt` among them (the
    `last` one where `what` stays in dt)."""
    if any(d != dt and d not in _WIDE for d in dtypes) or dt not in (dtypes[-1:] if last else dtypes):
        raise NoMatch(f"{what} are not rounded to the experts' dtype {dt} (their casts: "
                      f"{', '.join(str(d).replace('torch.', '') for d in dtypes)}), as the op rounds them")


def _single_user(n: fx.Node, region: Region) -> fx.Node | None:
    users = [u for u in n.users if u in region.nodes]
    return users[0] if len(users) == 1 else None

