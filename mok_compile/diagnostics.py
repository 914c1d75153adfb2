"""What the `mok` backend did and why: logging set-up, user warnings, `explain`.

Logging: every decision goes to the `mok_compile` logger (the pass logs under
`mok_compile.passes`). Nothing is printed by default except warnings; set
``MOK_LOG_LEVEL=INFO`` (or ``DEBUG``) to see each fused / rejected block, the
way ``TORCH_LOGS`` works for torch.

`explain(model, *inputs)` runs Dynamo once with a backend that only records
the graphs, runs the MoE pass on a copy of each and executes the original graph
eagerly, then prints which MoE blocks would be fused, which not and why, and
the graph breaks Dynamo produced.
"""

from __future__ import annotations

import collections
import copy
import logging
import os
import warnings
from dataclasses import dataclass, field

import torch

from . import ddp, peft_experts
from .passes.eager_fragments import FORM as EAGER_FRAGMENT_FORM

LOGGER_NAME = "mok_compile"
LOG_LEVEL_ENV = "MOK_LOG_LEVEL"
log = logging.getLogger("mok_compile.diagnostics")

EAGER_FRAGMENT_FIX = (
    'model.set_experts_implementation("grouped_mm")  '
    '(or from_pretrained(..., experts_implementation="grouped_mm"))'
)


def configure_logging(level: str | int | None = None) -> None:
    """Send `mok_compile` logs to stderr at `level` (default: ``$MOK_LOG_LEVEL``; unset: leave logging alone)."""
    source = "level"
    if level is None:
        level, source = os.environ.get(LOG_LEVEL_ENV), LOG_LEVEL_ENV
    if level in (None, ""):
        return
    if isinstance(level, str):
        name = level.strip().upper()
        level = {"+": "DEBUG"}.get(name, name)
        if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(f"{source}={name!r}: use DEBUG, INFO, WARNING, ERROR or CRITICAL")
    logger = logging.getLogger(LOGGER_NAME)
    if not any(getattr(h, "_mok_handler", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler._mok_handler = True
        handler.setFormatter(logging.Formatter("[mok] %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # our handler prints it; don't print twice through the root logger
    logger.setLevel(level)


_warned = {"eager_fragment": False, "ddp_cut": False, "checkpoint": False}

UNTRACED_CHECKPOINT = (
    "Dynamo could not trace an activation-checkpointed region (a side effect in it, such as the context variable "
    "that transformers' hub-kernel layers set), so the region runs eagerly and its MoE blocks unfused, under any "
    "backend"
)


def warn_eager_fragments(report) -> None:
    """Warn once per process when transformers' `experts_implementation="eager"` loop is seen.

    That loop (`nonzero` + a Python loop over experts) breaks the Dynamo graph
    into fragments no pass can fuse; the fix is a one-line switch of the
    experts implementation, so we tell the user instead of staying silent.
    """
    fragments = [b for b in report.blocks if b.form == EAGER_FRAGMENT_FORM and not b.fused]
    for b in fragments:
        log.info("mok: eager-experts fragment at %s not fused: %s", b.name, b.reason)
    if fragments:
        b = fragments[0]
        _warn_once("eager_fragment",
                   f"mok: MoE block {b.name} uses transformers' experts_implementation='eager' ({b.reason}); "
                   f"it is compiled unfused. Fix: {EAGER_FRAGMENT_FIX}. (Warned once; MOK_LOG_LEVEL=INFO lists "
                   "every block.)")


def warn_ddp_cuts(cut: list[str]) -> None:
    """Warn once per process when Dynamo's DDP graph cutting left MoE blocks in pieces (`mok_compile.ddp`)."""
    if not cut:
        return
    log.info("mok: a piece of Dynamo's DDP cutting holds parts of MoE blocks: %s", "; ".join(cut))
    _warn_once("ddp_cut", f"mok: {ddp.CUT} ({cut[0]}{'; ...' if len(cut) > 1 else ''}); they are compiled unfused. "
                          f"Fix: {ddp.FIX}. (Warned once; MOK_LOG_LEVEL=INFO lists every piece.)")


def checkpoint_hint(break_reasons) -> str | None:
    """Dynamo's own hint (its wording follows the torch version) for the first break reason saying that an
    activation-checkpointed region could not be traced because of a side effect, else None."""
    for reason in break_reasons:
        text = str(reason)
        if text.startswith("HOP: Unsafe side effect") and "checkpoint" in text:
            hint = next((ln.strip() for ln in text.splitlines() if ln.strip().startswith("Hint:")), "Hint: ?")
            return hint[len("Hint:"):].strip()
    return None


def warn_untraced_checkpoints() -> None:
    """Warn once per process when Dynamo has given up on an activation-checkpointed region (`checkpoint_hint`):
    the backend never sees that region, so without this the user would only see fewer blocks fused."""
    if _warned["checkpoint"]:
        return
    from torch._dynamo.utils import counters

    hint = checkpoint_hint(counters["graph_break"])
    if hint is not None:
        _warn_once("checkpoint", f"mok: {UNTRACED_CHECKPOINT}. Dynamo's hint: {hint}")


def _warn_once(key: str, message: str) -> None:
    """`message` as a UserWarning (pointing at the caller of the `warn_*` function), the first time `key` comes up in
    this process."""
    if _warned[key]:
        return
    _warned[key] = True
    warnings.warn(message, UserWarning, stacklevel=3)


# --------------------------------------------------------------------------------------------------------------------
# explain


@dataclass
class ExplainReport:
    """What `backend="mok"` would do with a model: MoE blocks found, fused or not, and Dynamo's graph breaks."""

    blocks: list = field(default_factory=list)  # BlockReport, in graph order
    graph_count: int = 0
    graph_break_count: int = 0
    break_reasons: list[str] = field(default_factory=list)
    pass_errors: list[str] = field(default_factory=list)  # the pass raised (a bug): graph left unfused
    ddp_cuts: list[str] = field(default_factory=list)  # parts of MoE blocks in pieces Dynamo cut for DDP
    checkpoint_hint: str | None = None  # Dynamo's hint where it could not trace an activation-checkpointed region

    @property
    def fused(self):
        return [b for b in self.blocks if b.fused]

    @property
    def rejected(self):
        return [b for b in self.blocks if not b.fused]

    def __str__(self) -> str:
        lines = [
            f"mok explain: {len(self.blocks)} MoE block(s) found, {len(self.fused)} fused, "
            f"{len(self.rejected)} not fused; {self.graph_count} graph(s), {self.graph_break_count} graph break(s)"
        ]
        for b in self.blocks:
            lines.append(f"  {'FUSED    ' if b.fused else 'NOT FUSED'} {b.name}: {describe_block(b)}")
            if not b.fused:
                lines.append(f"            reason: {b.reason}")
            if b.form == EAGER_FRAGMENT_FORM and not b.fused:
                lines.append(f"            fix: {EAGER_FRAGMENT_FIX}")
        for err in self.pass_errors:
            lines.append(f"  PASS ERROR (graph compiled unfused): {err}")
        if self.ddp_cuts:
            lines.append(f"{ddp.CUT}:")
            lines += [f"  - {cut}" for cut in self.ddp_cuts]
            lines.append(f"  fix: {ddp.FIX}")
        if self.break_reasons:
            lines.append("graph breaks:")
            lines += [f"  - {r}" for r in self.break_reasons]
        if self.checkpoint_hint is not None:
            lines.append(f"activation checkpointing: {UNTRACED_CHECKPOINT}")
            lines.append(f"  fix (Dynamo's hint): {self.checkpoint_hint}")
        return "\n".join(lines)


def describe_block(b) -> str:
    """One line: E, top-k, H, I, routing family, expert variant, post-norm, dtype, form."""

    sizes = (("E", b.num_experts), ("top_k", b.top_k), ("H", b.hidden), ("I", b.intermediate))
    parts = [f"{name}={value}" for name, value in sizes if value is not None]  # fragments lack some
    if b.routing is not None:
        r = b.routing
        routing = r.routing
        extras = [name for name, on in (("renorm", r.renormalize), ("logits_kept", r.router_is_logits),
                                        ("weights_rounded", r.round_weights or r.round_weights_to is not None)) if on]
        if r.routed_scale != 1.0:
            extras.append(f"scale={r.routed_scale:g}")
        if r.n_group > 1:
            extras.append(f"groups={r.topk_group}/{r.n_group}")
        if b.given_ids:
            extras.append("selection_kept" if b.kept_selection else "ids_given")
        if b.expert_scale:
            extras.append("expert_scale")
        if b.router_rounded:
            extras.append("router_rounded")
        if r.identity_experts:
            extras.append(f"identity_experts={r.identity_experts}")
        if r.zero_experts:
            extras.append(f"zero_experts={r.zero_experts}")
        if r.routing == "sparsemixer":
            extras.append(f"jitter_eps={r.jitter_eps:g}")
        parts.append(routing + (f"({', '.join(extras)})" if extras else ""))
    if b.experts is not None:
        e = b.experts
        flags = [name for name, on in (("ungated", not e.gated), ("interleaved", e.interleaved),
                                       ("transposed", e.transposed)) if on]
        parts.append(e.activation + (f"({', '.join(flags)})" if flags else ""))
        if e.post_norm != "none":  # each expert's output normalised before its weight
            offset = f", offset={e.post_norm_offset:g}" if e.post_norm_offset else ""
            parts.append(f"post_norm={e.post_norm}(eps={e.post_norm_eps:g}{offset})")
    if b.dtype is not None:
        parts.append(str(b.dtype).replace("torch.", ""))
    if b.form:
        parts.append(f"form={b.form}")
    if b.probed_on_own_weights:
        parts.append("probed_on_own_weights")
    if b.checkpointed:
        parts.append("checkpointed")
    for device, dtype in b.autocast:
        parts.append(f"autocast={device}:{str(dtype).replace('torch.', '')}")
    return " ".join(str(p) for p in parts)


def _short_reason(text: str) -> str:
    """Dynamo's break reasons run over many lines; keep the title and its explanation."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    if not lines:
        return "?"
    explanation = next((ln[len("Explanation:"):].strip() for ln in lines if ln.startswith("Explanation:")), "")
    return f"{lines[0]}: {explanation}" if explanation else lines[0]


def _break_reason_line(reason) -> str:
    where = ""
    stack = getattr(reason, "user_stack", None) or []
    if stack:
        frame = stack[-1]
        where = f" ({os.path.basename(frame.filename)}:{frame.lineno})"
    return _short_reason(reason.reason) + where


def explain(model, *example_inputs, validate: bool = True, **kwargs) -> ExplainReport:
    """Run `model(*example_inputs, **kwargs)` once through Dynamo, report what `backend="mok"` would fuse.

    Like `torch._dynamo.explain`, this resets Dynamo's caches before and after
    (the capture must see fresh graphs). The model runs eagerly: the MoE pass
    works on copies of the captured graphs, so nothing is compiled.
    """
    from torch._dynamo.utils import counters

    from mok_compile.passes import fuse_moe

    peft_experts.install()  # (as `backend="mok"` does: PEFT's LoRA on experts traced with their router)
    report = ExplainReport()
    located = []  # break reasons of the graphs we received, with the user's source line

    def capture(gm: torch.fx.GraphModule, inputs):
        report.graph_count += 1
        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is not None and getattr(reason, "graph_break", False):
            located.append(reason)
        work = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        try:
            fused = fuse_moe(work, inputs, validate=validate, strict=False)
        except Exception as err:  # a bug in the pass must not hide the rest of the report
            report.pass_errors.append(f"graph {report.graph_count}: {type(err).__name__}: {err}")
        else:
            report.blocks += fused.blocks
            if ddp.cut_by_dynamo(gm):
                report.ddp_cuts += ddp.cut_blocks(work, fused)
        return gm.forward

    torch._dynamo.reset()
    breaks_before = dict(counters["graph_break"])
    try:
        torch.compile(model, backend=capture)(*example_inputs, **kwargs)
    finally:
        torch._dynamo.reset()
    new_breaks = {r: n - breaks_before.get(r, 0) for r, n in counters["graph_break"].items()}
    new_breaks = {r: n for r, n in new_breaks.items() if n > 0}
    # Every break counts; breaks with a graph behind them also say where in the user's code they happened.
    report.graph_break_count = max(sum(new_breaks.values()), len(located))
    lines = [_break_reason_line(r) for r in located]
    seen = {_short_reason(r.reason) for r in located}
    lines += [_short_reason(r) for r in new_breaks if _short_reason(r) not in seen]
    report.break_reasons = [line if n == 1 else f"{line} (x{n})" for line, n in collections.Counter(lines).items()]
    report.checkpoint_hint = checkpoint_hint([*new_breaks, *(r.reason for r in located)])
    print(report)
    return report
