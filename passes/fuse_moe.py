"""The detection + rewrite pass: every provable MoE block becomes one `torch.ops.mok.fused_moe`.

For each top-k that dispatches to experts, and each set of given expert ids (computed from integers
alone, as hash routing's lookup by token id) that the router's scores are gathered at (`region.block_anchors`):
find the block's nodes (`region`), read its routing (`routing`) and expert
math (`experts`, `loop_experts`), decide which values survive (`rewrite.plan_rewrite`),
prove the op computes the same thing on random inputs (`validate`), then
rewrite (`rewrite.emit`). A top-k block that fails a step, whose ids the router's scores are gathered at, is tried
once more with the top-k kept in the graph and its ids given (a choice the op cannot make, as AXK2's). A block that
fails is left untouched and reported with the reason; `strict=True` turns that into an error.
Graph fragments left by transformers' ``experts_implementation="eager"``
(Dynamo breaks the graph at ``nonzero``) are reported by `eager_fragments`,
expert GEMMs whose router is in another graph by `lone_experts`; a block whose
experts are sharded across ranks gets its reason from `sharded`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from mok_compile.ops.reference import logits_dtype
from mok_compile.ops.spec import ExpertSpec, RoutingSpec, op_kwargs, scalar_defaults

from . import autocast, eager_fragments, lone_experts
from .checkpointed import fuse_checkpointed
from .dataflow import Dataflow
from .experts import SPLIT_LOOP, ExpertsMatch, Stack, match_experts, region_form
from .op_names import CAST_OPS, module_path, tensor_meta
from .region import NoMatch, Region, block_anchors, find_region, kept_selection_anchor, strip
from .rewrite import emit, plan_rewrite
from .routing import Flat, RouterMatch, match_router
from .sharded import sharded_reason, sharding_evidence
from .validate import concrete, live_inputs, probe

log = logging.getLogger("mok_compile.passes")

# Forms that are reported, never fused: pieces of a block that Dynamo split across graphs.
REPORT_ONLY_FORMS = (eager_fragments.FORM, lone_experts.FORM)


class MoeFusionError(RuntimeError):
    """Raised by `fuse_moe(strict=True)` for a candidate block that was not fused."""


@dataclass
class BlockReport:
    name: str
    fused: bool
    reason: str
    form: str
    num_experts: int | None = None
    top_k: int | None = None
    hidden: int | None = None
    intermediate: int | None = None
    routing: RoutingSpec | None = None
    experts: ExpertSpec | None = None
    dtype: torch.dtype | None = None
    given_ids: bool = False  # the expert ids come from outside the block (hash routing): the op's expert_ids
    # The top-k's choice stays in the graph (the op cannot make it, e.g. AXK2's 0-filled groups), its ids given.
    kept_selection: bool = False
    expert_scale: bool = False  # the weights are multiplied by a per-expert tensor (Gemma 4): the op's expert_scale
    router_rounded: bool = False  # the router's weight (or bias) is an input rounded in the block (Ergo's fp32 one)
    # The probe had no memory for a copy of the weights and proved the block on the model's own ones, a weaker proof
    # where its grown inputs saturate the router before they reach a clamp (`validate.OWN_WEIGHTS_SCALES`).
    probed_on_own_weights: bool = False
    # In an activation-checkpointed region (`checkpointed`): the backward runs the block's forward again.
    checkpointed: bool = False
    # The autocasts the block's nodes run under, as (device, dtype) pairs (`passes.autocast`); empty where none.
    autocast: tuple = ()


@dataclass
class FuseReport:
    blocks: list[BlockReport] = field(default_factory=list)

    @property
    def fused(self) -> list[BlockReport]:
        return [b for b in self.blocks if b.fused]

    @property
    def rejected(self) -> list[BlockReport]:
        return [b for b in self.blocks if not b.fused]

    def __str__(self):
        lines = [f"mok: {len(self.fused)} MoE block(s) fused, {len(self.rejected)} left unchanged"]
        for b in self.blocks:
            what = "fused" if b.fused else f"NOT fused: {b.reason}"
            lines.append(f"  {b.name} [{b.form}] E={b.num_experts} K={b.top_k} H={b.hidden} I={b.intermediate}: {what}")
        return "\n".join(lines)


def block_name(region: Region) -> str:
    """Module path common to the block's nodes (from nn_module_stack), e.g. "model.layers.0.mlp"."""
    paths = [p.split(".") for n in region.nodes if (p := module_path(n)) is not None]
    if not paths:
        return region.anchor.name
    common = []
    for parts in zip(*paths):
        if any(p != parts[0] for p in parts):
            break
        common.append(parts[0])
    return ".".join(p for p in common if p) or "<compiled module>"


def _ensure_meta(gm: fx.GraphModule, example_inputs):
    """Dynamo graphs carry fake values; other graphs get them from `example_inputs`."""
    if any(tensor_meta(n) is not None for n in gm.graph.nodes):
        return
    if example_inputs is None:
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    fake_mode = torch._guards.detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, fake_mode).propagate(*example_inputs)


def _int(v):
    try:
        return concrete(v)
    except TypeError:
        return None


def _minimal_kwargs(routing: RoutingSpec, experts: ExpertSpec) -> dict:
    """Op keyword arguments that differ from the schema defaults (top_k always): short graphs."""
    defaults = scalar_defaults()
    kw = op_kwargs(routing, experts)
    return {k: v for k, v in kw.items() if k == "top_k" or defaults.get(k, object()) != v}


def _roles(router: RouterMatch, experts: ExpertsMatch) -> dict:
    roles = {strip(router.weight, CAST_OPS): "router"}
    norm_weight = experts.post_norm.weight if experts.post_norm is not None else None
    for role, operand in (("router_bias", strip(router.bias, CAST_OPS)), ("selection_bias", router.selection_bias),
                          ("expert_scale", router.expert_scale), ("post_norm_weight", norm_weight),
                          ("gate_up", experts.gate_up), ("gate_up_bias", experts.gate_up_bias),
                          ("down", experts.down), ("down_bias", experts.down_bias)):
        if isinstance(operand, Stack):
            roles.update({n: role for g in operand.groups for n in g})
        elif isinstance(operand, Flat):
            roles[operand.source] = role
        elif operand is not None:
            roles[operand] = role
    return roles


def _expert_inputs(experts: ExpertsMatch) -> list[fx.Node]:
    out = []
    norm_weight = experts.post_norm.weight if experts.post_norm is not None else None
    for operand in (experts.gate_up, experts.gate_up_bias, experts.down, experts.down_bias, norm_weight):
        if isinstance(operand, Stack):
            out.extend(n for g in operand.groups for n in g)
        elif operand is not None:
            out.append(operand)
    return out


def _fuse_block(gm, flow: Dataflow, anchor, ids, validate: bool, report: BlockReport, probe_cache: dict,
                anchors, before_rewrite, live, states: dict) -> None:
    """Fuse one block, filling in `report`; raises NoMatch where it cannot. `states`: `autocast.node_states`."""
    region: Region = find_region(gm, flow, anchor, ids, anchors)
    report.autocast = autocast.block_autocast(region.nodes, states)
    report.name = block_name(region)
    report.num_experts, report.top_k = _int(region.E), region.K
    report.hidden, report.dtype = _int(region.H), tensor_meta(region.x).dtype
    report.form, report.given_ids = region_form(region), region.given_ids
    router = match_router(region)
    report.routing, report.expert_scale = router.spec, router.expert_scale is not None
    experts = match_experts(flow, region, router)
    report.form, report.intermediate = experts.form, experts.intermediate
    past = experts.past_experts  # the router's outputs past the experts: identity or zero experts, as the probe tells
    if past:
        report.num_experts = _int(region.E - past)
    # Dense weight-on-input routing (Llama4): the graph's weights are [T, E] scores, not the op's [T, K] weights;
    # if something outside the block reads them, they stay in the graph (never replaced by the op's output).
    exportable = None if router.spec.weight_on_input else router.weights
    # Logits in another dtype than the op would compute them in (a router under bf16 autocast, on fp32 weights): the
    # graph's router stays, and the op takes its logits.
    keep_logits = tensor_meta(region.logits).dtype != logits_dtype(report.dtype, router.spec.router_fp32)
    plan = plan_rewrite(flow, region, exportable, _expert_inputs(experts), keep_logits)
    routing = router.spec
    router_arg, router_bias = router.weight, router.bias
    nd_logits = tensor_meta(region.logits).dim() > 2  # [B, S, E] logits (Zaya's): the op's are [T, E]
    if plan.router_is_logits:
        routing = replace(routing, router_is_logits=True, router_fp32=False)
        router_arg, router_bias = region.logits, None
        if nd_logits:
            router_arg = Flat(region.logits, (-1, region.E))
    # The routings to prove: outputs past the experts as identity experts (LongCat-Flash), then as zero experts (Zaya).
    variants = [replace(routing, identity_experts=past), replace(routing, zero_experts=past)] if past else [routing]
    report.routing = routing = variants[0]
    operands = [region.x, router_arg, router_bias, router.selection_bias, experts.gate_up, experts.gate_up_bias,
                experts.down, experts.down_bias]
    given = {"expert_ids": region.ids} if region.given_ids else {}  # tensors the op takes as keyword arguments
    if router.expert_scale is not None:
        given["expert_scale"] = router.expert_scale
    if experts.post_norm is not None:
        given["post_norm_weight"] = experts.post_norm.weight
    chosen, failures = None, []
    if not validate:
        if past:
            raise NoMatch(f"the router's {past} outputs past the experts would be identity experts (LongCat-Flash's "
                          "zero-computation experts) or zero experts (Zaya's skip expert), which only the probe proves "
                          "and tells apart; enable validate")
        if nd_logits:
            raise NoMatch("the router's logits are computed per token in more dimensions than the experts' [T, H] "
                          "rows: that their rows meet the experts' tokens only the probe proves; enable validate")
        if experts.form == SPLIT_LOOP:
            raise NoMatch("the experts loop over the sorted rows split by their counts: which part meets which "
                          "expert's weights only the probe proves; enable validate", form=SPLIT_LOOP)
        if len(experts.specs) != 1:
            raise NoMatch(f"{len(experts.specs)} expert layouts fit the weight shapes; enable validate to choose")
        chosen = experts.specs[0]
    else:
        roles = {**_roles(router, experts), **({region.ids: "expert_ids"} if region.given_ids else {})}
        if region.router_linear is None:
            roles[region.logits] = "router_logits"
        for variant in variants:
            for spec in experts.specs:
                kw = {**op_kwargs(variant, spec), **given, "_intermediate": experts.intermediate}
                proof = {}
                why = probe(gm, flow, region, roles, operands, kw, plan.exports, cache=probe_cache, live=live,
                            proof=proof, autocast={n: states[n] for n in region.nodes})
                if why is None:
                    chosen, routing = spec, variant
                    report.probed_on_own_weights = proof["own_weights"]
                    break
                failures.append(why)
            if chosen is not None:
                break
        if chosen is None:
            if past:
                raise NoMatch(f"the router's {past} outputs past the experts were taken as {past} identity experts "
                              f"(LongCat-Flash's zero-computation experts), then as {past} zero experts (Zaya's skip "
                              f"expert), the probe disproves both: {failures[0]}; "
                              f"{failures[len(experts.specs)]}")
            raise NoMatch(failures[0])
    report.routing, report.experts = routing, chosen
    kwargs = {**_minimal_kwargs(routing, chosen), **given}
    # Floats the graph reads at run time (under dynamic=True): the op takes the nodes (`routing._weight_chain`).
    runtime = {**router.runtime, **experts.runtime}
    for name, node in runtime.items():
        kwargs[name] = node
        plan.keep |= flow.backward_slice([node], stop=lambda n: n not in region.nodes) & region.nodes
    rounded = [] if plan.router_is_logits else router.rounded_operands()
    if rounded:  # a router weight or bias rounded in the block: the op reads the rounded one, its casts stay
        plan.keep |= flow.backward_slice(rounded, stop=lambda n: n not in region.nodes) & region.nodes
        report.router_rounded = True
    if before_rewrite is not None:
        before_rewrite()
    emit(gm, flow, region, plan, operands, kwargs)
    report.fused, report.reason = True, ""


def _fuse_keeping_selection(first: NoMatch, gm, flow: Dataflow, anchor, ids, validate: bool, report: BlockReport,
                            probe_cache: dict, anchors, before_rewrite, live, states: dict) -> BlockReport:
    """A block whose top-k the op cannot compute, fused with its selection kept in the graph: the router's scores
    gathered at the top-k's ids are the anchor, and the op takes the ids as given (`region.kept_selection_anchor`).
    Raises the first attempt's NoMatch, `first` (its reason is the report's), where there is no such gather or this
    fails too."""
    gather = kept_selection_anchor(anchor, ids)
    if gather is None:
        raise first
    kept = BlockReport(name=report.name, fused=False, reason="", form="unknown", kept_selection=True)
    anchors = [(gather, ids) if a is anchor else (a, i) for a, i in anchors]
    try:
        _fuse_block(gm, flow, gather, ids, validate, kept, probe_cache, anchors, before_rewrite, live, states)
    except NoMatch:
        raise first from None
    return kept


def fuse_moe(gm: fx.GraphModule, example_inputs: Sequence | None = None, *, validate: bool = True,
             strict: bool = False, before_rewrite: Callable[[], None] | None = None) -> FuseReport:
    """Find every router+experts MoE block in `gm`, rewrite each provable one into `torch.ops.mok.fused_moe`.

    `gm` is a Dynamo torch-level graph (parameters as placeholders or get_attr). The graph is changed in place
    and recompiled. `validate=False` skips the numerical probe (structural proof only). Unmatched candidates
    are reported, not raised, unless `strict=True` (then `MoeFusionError`). `before_rewrite` is called before
    each block's rewrite, the only changes the pass makes to the graph (the backend copies the graph at the first,
    to put it back should the pass fail later: a graph without a fusable block is never copied). Blocks inside
    activation-checkpointed regions are fused in copies of their bodies (`checkpointed`), which the graph then
    calls instead.
    """
    from torch._dynamo.utils import counters

    probe_cache: dict = {}  # probe verdicts by block structure: identical layers are probed once, checkpointed or not
    report = _fuse_blocks(gm, example_inputs, validate, before_rewrite, probe_cache)
    for block in report.blocks:
        if block.fused:
            counters["mok"]["fused_moe"] += 1
            log.info("mok: fused MoE block %s (%s, E=%s, K=%s, %s)", block.name, block.form, block.num_experts,
                     block.top_k, block.dtype)
        else:
            counters["mok"]["rejected_moe"] += 1
            # Eager-experts fragments get one user warning per process from the backend, not one per compile; lone
            # experts are reported (explain, INFO), not warned about: DDP's cutting makes them too, and warns itself.
            level = logging.INFO if block.form in REPORT_ONLY_FORMS else logging.WARNING
            log.log(level, "mok: MoE block %s not fused: %s", block.name, block.reason)
    if strict and report.rejected:
        b = report.rejected[0]
        raise MoeFusionError(f"MoE block {b.name} was not fused: {b.reason}")
    return report


def _fuse_blocks(gm: fx.GraphModule, example_inputs, validate: bool, before_rewrite, probe_cache: dict,
                 outer_autocast: tuple | None = None) -> FuseReport:
    """`fuse_moe` on one graph and the checkpointed bodies it calls, uncounted. A body's nodes run under the
    autocast of the call that runs it (`outer_autocast`)."""
    _ensure_meta(gm, example_inputs)
    report = FuseReport()
    live = live_inputs(gm, example_inputs) if validate else {}  # the weights a probe short of memory runs on
    flow = Dataflow(gm.graph)
    anchors = block_anchors(gm, flow)
    states = autocast.node_states(gm.graph, outer_autocast)
    for anchor, ids in anchors:
        if getattr(anchor, "_erased", False) or getattr(ids, "_erased", False):
            continue  # erased with an earlier block
        block = BlockReport(name=module_path(anchor) or anchor.name, fused=False, reason="", form="unknown")
        if report.blocks and report.blocks[-1].fused:  # the graph as the block before this one left it
            flow = Dataflow(gm.graph, previous=flow)
        try:
            try:
                _fuse_block(gm, flow, anchor, ids, validate, block, probe_cache, anchors, before_rewrite, live,
                            states)
            except NoMatch as first:
                block = _fuse_keeping_selection(first, gm, flow, anchor, ids, validate, block, probe_cache, anchors,
                                                before_rewrite, live, states)
        except NoMatch as err:
            block.fused, block.reason = False, str(err)
            block.form = err.form or block.form
            evidence = sharding_evidence(gm, anchor, ids)
            if evidence is not None:
                block.reason = sharded_reason(evidence, block.reason)
            block.autocast = block.autocast or autocast.block_autocast([anchor], states)
            if block.autocast:
                block.reason = f"{block.reason}; {autocast.hint(block.autocast)}"
        report.blocks.append(block)
    report.blocks.extend(eager_fragments.find_eager_fragments(gm))
    report.blocks.extend(lone_experts.find_lone_experts(gm, hash_routed_only=bool(anchors),
                                                        anchored={ids for _, ids in anchors}))
    report.blocks.extend(fuse_checkpointed(
        gm, live, lambda body, inputs, call: _fuse_blocks(body, inputs, validate, None, probe_cache, states[call]),
        before_rewrite))
    if report.fused:
        gm.graph.lint()
        gm.recompile()
    return report
