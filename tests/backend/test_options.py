"""Backend options: parsing, errors naming the bad option, and what reaches the pass and the inner compiler."""

import pytest
import torch

import mok_compile.passes
from mok_compile import backend
from mok_compile.config import BackendOptions, parse_options


def test_defaults():
    opts = parse_options(None)
    assert opts == BackendOptions(compiler="inductor", validate=True, strict=False)
    assert opts.inductor_patches() == {}


def test_unknown_option_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['compilr'\].*'compiler', 'validate', 'strict'"):
        parse_options({"compilr": "eager"})


@pytest.mark.parametrize("options, match", [
    ({"compiler": "tensorrt"}, "'compiler'='tensorrt' is not one of"),
    ({"validate": "yes"}, "'validate' must be a bool"),
    ({"strict": 1}, "'strict' must be a bool"),
    ({"ddp_buckets": "off"}, "'ddp_buckets' must be a bool"),
    ({"inductor_config": ["max_autotune"]}, "'inductor_config' must be a dict"),
    ({"compiler": "aot_eager", "inductor_config": {"max_autotune": True}}, "only apply to compiler='inductor'"),
])
def test_bad_values_name_the_option(options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        parse_options(options)


def test_mode_becomes_inductor_patches_and_inductor_config_overrides_it():
    opts = parse_options({"inductor_config": {"triton.cudagraphs": False}}, mode="reduce-overhead")
    assert opts.inductor_patches() == {"triton.cudagraphs": False}
    assert parse_options(None, mode="max-autotune").inductor_patches()["max_autotune"] is True
    with pytest.raises(ValueError, match="only apply to compiler='inductor'"):
        parse_options({"compiler": "eager"}, mode="max-autotune")


def test_backend_is_found_by_name(monkeypatch):
    """Installed, the name is the entry point's `mok_backend`; from a plain checkout on PYTHONPATH (the GPU machine's
    runs) it is the stand-in the package registers, which hands each call to `mok_backend`."""
    from importlib.metadata import entry_points

    from torch._dynamo.backends.registry import list_backends, lookup_backend

    assert "mok" in list_backends(exclude_tags=())
    found = lookup_backend("mok")
    if entry_points(group="torch_dynamo_backends", name="mok"):
        assert found is backend.mok_backend
    else:
        calls = []
        monkeypatch.setattr(backend, "mok_backend", lambda gm, inputs, **kw: calls.append((gm, inputs, kw)) or "fn")
        assert found("gm", ["x"], options={"compiler": "eager"}) == "fn"
        assert calls == [("gm", ["x"], {"options": {"compiler": "eager"}})]


_WITHOUT_ENTRY_POINT = """
import importlib.metadata, json, sys
import torch
real = importlib.metadata.entry_points
# A plain checkout on PYTHONPATH (as on the GPU machine): no installed distribution declares the backend.
none = importlib.metadata.EntryPoints(())
importlib.metadata.entry_points = lambda **kw: none if kw.get("group") == "torch_dynamo_backends" else real(**kw)
if sys.argv[1] == "import":
    import mok_compile
at_import = "mok_compile.backend" in sys.modules
try:
    f = torch.compile(lambda x: torch.relu(x) + 1, backend="mok", options={"compiler": "eager"})
    print(json.dumps({"ok": f(torch.tensor([-1.0, 2.0])).tolist() == [1.0, 3.0], "loaded_at_import": at_import,
                      "loaded_by_compile": "mok_compile.backend" in sys.modules}))
except Exception as err:
    print(json.dumps({"error": type(err).__name__}))
"""


@pytest.mark.parametrize("import_package", [True, False])
def test_backend_is_found_by_name_from_a_plain_checkout(import_package):
    """Where no entry point declares "mok", importing the package registers the name (the backend module still
    loads only when a compile calls it); without the import the name stays unknown, the near miss."""
    import json
    import subprocess
    import sys

    arg = "import" if import_package else "no-import"
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_ENTRY_POINT, arg], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    want = {"ok": True, "loaded_at_import": False, "loaded_by_compile": True} if import_package else {
        "error": "InvalidBackend"}
    assert got == want, got


def test_unknown_option_through_torch_compile_is_a_clear_error():
    f = torch.compile(lambda x: x + 1, backend="mok", options={"validat": False})
    with pytest.raises(Exception, match=r"unknown option\(s\) \['validat'\]"):
        f(torch.ones(3))


@pytest.fixture
def pass_calls(monkeypatch):
    """Record the arguments the backend gives the real pass."""
    calls = []
    real = mok_compile.passes.fuse_moe

    def spy(gm, example_inputs, *, validate=True, strict=False, before_rewrite=None):
        calls.append(dict(validate=validate, strict=strict, graph=gm))
        return real(gm, example_inputs, validate=validate, strict=strict, before_rewrite=before_rewrite)

    monkeypatch.setattr(mok_compile.passes, "fuse_moe", spy)
    return calls


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
@pytest.mark.parametrize("validate, strict", [(True, False), (False, True)])
def test_options_reach_the_pass_and_the_inner_compiler(pass_calls, monkeypatch, compiler, validate, strict):
    inner = []
    real_inner = backend.compile_inner
    monkeypatch.setattr(backend, "compile_inner",
                        lambda gm, ex, opts: inner.append(opts.compiler) or real_inner(gm, ex, opts))
    x = torch.randn(4, 8)
    f = torch.compile(lambda x: torch.relu(x) * 2, backend="mok",
                      options={"compiler": compiler, "validate": validate, "strict": strict})
    torch.testing.assert_close(f(x), torch.relu(x) * 2, rtol=0, atol=0)
    assert [(c["validate"], c["strict"]) for c in pass_calls] == [(validate, strict)]
    assert inner == [compiler]


def test_a_crash_in_the_pass_compiles_the_graph_unfused(monkeypatch, caplog):
    def broken(gm, example_inputs, *, validate=True, strict=False, before_rewrite=None):
        before_rewrite()  # as the pass announces a rewrite
        for node in list(gm.graph.nodes):
            if node.op == "call_function":
                node.target = torch.sub  # half-rewritten graph, then a crash
        raise RuntimeError("bug in the pass")

    monkeypatch.setattr(mok_compile.passes, "fuse_moe", broken)
    x = torch.randn(5)
    with caplog.at_level("WARNING", logger="mok_compile"):
        # aot_eager: AOT autograd reads Dynamo's own node attributes (`_dynamo_source`), which the restore must keep
        out = torch.compile(lambda x: torch.add(x, 1), backend="mok", options={"compiler": "aot_eager"})(x)
    torch.testing.assert_close(out, x + 1, rtol=0, atol=0)
    assert "the MoE pass failed" in caplog.text

    torch._dynamo.reset()
    strict = torch.compile(lambda x: torch.add(x, 1), backend="mok", options={"compiler": "eager", "strict": True})
    with pytest.raises(Exception, match="bug in the pass"):
        strict(x)


def test_a_crash_before_any_rewrite_copies_nothing(monkeypatch, caplog):
    """The graph is copied only when the pass is about to change it: a crash before that compiles the graph as it
    is, and a graph without MoE (no rewrite) is never copied."""
    copies = []
    real_snapshot = backend.snapshot_graph
    monkeypatch.setattr(backend, "snapshot_graph", lambda graph: copies.append(graph) or real_snapshot(graph))
    x = torch.randn(5)
    out = torch.compile(lambda x: torch.add(x, 1), backend="mok", options={"compiler": "aot_eager"})(x)
    torch.testing.assert_close(out, x + 1, rtol=0, atol=0)
    assert copies == []

    def broken(gm, example_inputs, *, validate=True, strict=False, before_rewrite=None):
        raise RuntimeError("bug in the pass")

    monkeypatch.setattr(mok_compile.passes, "fuse_moe", broken)
    torch._dynamo.reset()
    with caplog.at_level("WARNING", logger="mok_compile"):
        out = torch.compile(lambda x: torch.add(x, 2), backend="mok", options={"compiler": "aot_eager"})(x)
    torch.testing.assert_close(out, x + 2, rtol=0, atol=0)
    assert "the MoE pass failed" in caplog.text and copies == []


def test_a_crash_after_a_rewrite_puts_the_whole_graph_back(monkeypatch, caplog):
    """The real pass rewrites the first block, then fails on the second: the graph compiled is the one Dynamo gave,
    with no fused op, and it computes what eager does."""
    import importlib

    from .helpers import tiny_model, token_ids

    fuse_moe_module = importlib.import_module("mok_compile.passes.fuse_moe")  # the package exports its function

    real_emit, emitted, compiled = fuse_moe_module.emit, [], []

    def emit_once(*args, **kwargs):
        if emitted:
            raise RuntimeError("bug in the second rewrite")
        emitted.append(True)
        return real_emit(*args, **kwargs)

    real_inner = backend.compile_inner
    monkeypatch.setattr(fuse_moe_module, "emit", emit_once)
    monkeypatch.setattr(backend, "compile_inner",
                        lambda gm, ex, opts: compiled.append(backend._has_fused_moe(gm)) or real_inner(gm, ex, opts))
    model, ids = tiny_model("qwen3_moe"), token_ids()
    with torch.no_grad(), caplog.at_level("WARNING", logger="mok_compile"):
        want = model(ids).logits
        got = torch.compile(model, backend="mok", options={"compiler": "aot_eager"})(ids).logits
    assert emitted == [True] and compiled == [False]
    assert "bug in the second rewrite" in caplog.text
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6 * want.abs().max().item())
