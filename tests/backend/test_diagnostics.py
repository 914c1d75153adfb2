"""explain(), the eager-experts warning, logging, strict and validate, on tiny HF CausalLMs."""

import logging
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import mok_compile
from mok_compile import diagnostics

from tests.passes.helpers import weights_out_of_memory

from .helpers import NUM_LAYERS, assert_close_rel, forward, tiny_model, token_ids

AOT = {"compiler": "aot_eager"}


@pytest.fixture(autouse=True)
def _fresh_warning_state(monkeypatch):
    monkeypatch.setitem(diagnostics._warned, "eager_fragment", False)


def eager_experts_model():
    model = tiny_model("qwen3_moe")
    model.set_experts_implementation("eager")
    return model


def test_explain_lists_every_fused_block(capsys):
    report = mok_compile.explain(tiny_model("qwen3_moe"), token_ids())
    printed = capsys.readouterr().out
    assert printed.strip() == str(report).strip()
    assert len(report.fused) == NUM_LAYERS and not report.rejected
    assert report.graph_count == 1 and report.graph_break_count == 0
    for layer, block in enumerate(report.fused):
        assert f"layers.{layer}" in block.name
        assert (block.num_experts, block.top_k, block.hidden, block.intermediate) == (8, 2, 64, 32)
        assert block.routing.routing == "softmax_topk" and block.routing.renormalize
        assert block.experts.activation == "silu" and block.dtype == torch.float32
        assert f"FUSED     {block.name}: E=8 top_k=2 H=64 I=32 softmax_topk(renorm" in printed
    assert "silu float32" in printed
    assert "NOT FUSED" not in printed and "graph breaks:" not in printed and "DistributedDataParallel" not in printed
    # explain compiles nothing and leaves no Dynamo state behind
    assert counters["mok"]["fused_moe"] == NUM_LAYERS


def test_explain_shows_eager_fragments_with_the_fix_and_graph_breaks(capsys):
    report = mok_compile.explain(eager_experts_model(), token_ids())
    printed = capsys.readouterr().out
    assert not report.fused and report.rejected
    assert all(b.form == "eager_fragment" for b in report.rejected), [b.form for b in report.rejected]
    assert report.graph_break_count > 0 and report.break_reasons
    assert "NOT FUSED" in printed and "reason:" in printed
    assert 'fix: model.set_experts_implementation("grouped_mm")' in printed
    assert "graph breaks:" in printed


def test_eager_fragments_warn_once_and_keep_numerics(caplog):
    model = eager_experts_model()
    ids = token_ids()
    want, _, _ = forward(model, ids)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="mok_compile"):
        warnings.simplefilter("always")
        got, _, _ = forward(model, ids, backend="mok", options=AOT)
    # The one warning is the user's message; the pass logs each fragment at INFO, not WARNING per compile.
    fragment_logs = [r for r in caplog.records if "not fused" in r.getMessage()]
    assert fragment_logs and all(r.levelno == logging.INFO for r in fragment_logs)
    ours = [w for w in caught if "experts_implementation='eager'" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    message = str(ours[0].message)
    assert "MoE block " in message and 'set_experts_implementation("grouped_mm")' in message
    assert counters["mok"]["fused_moe"] == 0 and counters["mok"]["rejected_moe"] >= 1
    assert_close_rel(got, want, 1e-6, "logits")


def test_eager_fragment_warning_is_given_once_per_process():
    from mok_compile.passes import BlockReport, FuseReport

    def fragment(name):
        return BlockReport(name=name, fused=False, reason="expert ids leave the graph", form="eager_fragment",
                           num_experts=None, top_k=None, hidden=None, intermediate=None, routing=None, experts=None,
                           dtype=None)

    fused = BlockReport(name="model.layers.1.mlp", fused=True, reason="", form="grouped_mm", num_experts=8, top_k=2,
                        hidden=64, intermediate=32, routing=None, experts=None, dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        diagnostics.warn_eager_fragments(FuseReport(blocks=[fused]))
        assert not caught
        diagnostics.warn_eager_fragments(FuseReport(blocks=[fragment("layers.0.mlp"), fragment("layers.0.mlp.gate")]))
        diagnostics.warn_eager_fragments(FuseReport(blocks=[fragment("layers.1.mlp")]))
    assert len(caught) == 1 and "MoE block layers.0.mlp " in str(caught[0].message)


def test_strict_raises_on_a_block_it_cannot_fuse():
    model = eager_experts_model()
    with pytest.raises(Exception, match="MoeFusionError: MoE block .* was not fused"):
        forward(model, token_ids(), backend="mok", options={**AOT, "strict": True})


@pytest.mark.parametrize("validate", [True, False])
def test_validate_on_and_off_fuse_the_same(validate):
    model = tiny_model("mixtral")
    ids = token_ids()
    want, _, _ = forward(model, ids)
    got, _, _ = forward(model, ids, backend="mok", options={**AOT, "validate": validate})
    assert counters["mok"]["fused_moe"] == NUM_LAYERS
    assert_close_rel(got, want, 1e-5, "logits")


def test_each_decision_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="mok_compile"):
        forward(tiny_model("olmoe"), token_ids(), backend="mok", options=AOT)
    ours = [r for r in caplog.records if r.name.startswith("mok_compile")]
    for layer in range(NUM_LAYERS):
        assert any(f"layers.{layer}" in r.getMessage() for r in ours), [r.getMessage() for r in ours]
    assert any(f"fused {NUM_LAYERS} of {NUM_LAYERS} MoE block(s)" in r.getMessage() for r in ours)


def test_log_level_switch(monkeypatch):
    logger = logging.getLogger("mok_compile")
    before = (list(logger.handlers), logger.level, logger.propagate)
    try:
        monkeypatch.setenv("MOK_LOG_LEVEL", "info")
        diagnostics.configure_logging()
        diagnostics.configure_logging()  # idempotent: one handler
        assert logger.level == logging.INFO
        assert sum(getattr(h, "_mok_handler", False) for h in logger.handlers) == 1
        monkeypatch.setenv("MOK_LOG_LEVEL", "loud")
        with pytest.raises(ValueError, match="MOK_LOG_LEVEL='LOUD'"):
            diagnostics.configure_logging()
    finally:
        logger.handlers[:], logger.propagate = before[0], before[2]
        logger.setLevel(before[1])


def test_a_probe_short_of_memory_for_a_copy_runs_on_the_models_own_weights(monkeypatch, capsys):
    """Where drawing a copy of the weights runs out of memory, the probe proves the block on the model's own
    weights (the graph's live parameters), which it leaves as they were, and the block fuses; explain says which
    blocks were proved so (the layer whose verdict was cached too)."""
    model, ids = tiny_model("qwen3_moe"), token_ids()
    report = mok_compile.explain(model, ids)
    assert not any(b.probed_on_own_weights for b in report.blocks)
    assert "probed_on_own_weights" not in capsys.readouterr().out
    weights_out_of_memory(monkeypatch)
    report = mok_compile.explain(model, ids)
    printed = capsys.readouterr().out
    assert len(report.fused) == NUM_LAYERS and all(b.probed_on_own_weights for b in report.fused)
    assert printed.count("probed_on_own_weights") == NUM_LAYERS
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    versions = {name: p._version for name, p in model.named_parameters()}
    want, _, _ = forward(model, ids)
    counters.clear()
    got, _, _ = forward(model, ids, backend="mok", options=AOT)
    assert counters["mok"]["fused_moe"] == NUM_LAYERS and counters["mok"]["rejected_moe"] == 0
    assert counters["mok"]["probe_own_weights"] == 1 and counters["mok"]["probe_cached"] == NUM_LAYERS - 1
    assert_close_rel(got, want, 1e-5, "logits")
    for name, p in model.named_parameters():
        assert p._version == versions[name] and torch.equal(p.detach(), weights[name]), name


def test_a_probe_out_of_memory_leaves_the_block_unfused_with_the_fix(monkeypatch, capsys):
    """Where the probe runs out of memory on its copy of the weights and again on the model's own, the block is left
    unfused with a reason that names the bytes and the way around it (not as a crash of the pass), and with the
    probe off the same model fuses."""
    from mok_compile.ops import reference

    weights_out_of_memory(monkeypatch)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    monkeypatch.setattr(reference, "fused_moe_reference", out_of_memory)
    model, ids = tiny_model("qwen3_moe"), token_ids()
    report = mok_compile.explain(model, ids)
    printed = capsys.readouterr().out
    assert not report.fused and len(report.rejected) == NUM_LAYERS
    assert all("probe: out of memory on cpu drawing the block's inputs" in b.reason for b in report.rejected)
    assert all("and again on the model's own weights (no copy)" in b.reason for b in report.rejected)
    assert "options={'validate': False}" in printed and "MB, a copy of its weights" in printed

    counters.clear()
    want, _, _ = forward(model, ids)
    got, _, _ = forward(model, ids, backend="mok", options=AOT)
    assert counters["mok"]["fused_moe"] == 0 and counters["mok"]["rejected_moe"] == NUM_LAYERS
    assert_close_rel(got, want, 1e-6, "logits")

    counters.clear()
    torch._dynamo.reset()
    got, _, _ = forward(model, ids, backend="mok", options={**AOT, "validate": False})
    assert counters["mok"]["fused_moe"] == NUM_LAYERS
    assert_close_rel(got, want, 1e-5, "logits")
