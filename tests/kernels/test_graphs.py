"""Few-token forwards and backwards replayed from CUDA graphs (`mok_compile.kernels.graphs`).

On the GPU: a signature's second call captures its forward and later calls replay it, with the same bits as the
launches it replaces, on fresh inputs each call; weights written in place are read, new weight tensors get their own
graph; the training forward's six outputs replay bit for bit too; so do the backward's seven gradients (its weight
gradients launched after each replay), recomputing, reading the saved tensors or consuming h, on either engine, and
whole training steps through autograd with gradients accumulated and weights updated in place; the graphs keep no
weight alive; logits given as the router argument are copied per call like x; token counts above the bound (but for
an inference forward of small work) and calls inside someone else's capture are never captured; outputs are new
tensors; under inference mode it works as outside; two threads on one stream get their own outputs. On the CPU: the
copy of x keeps the alignment the launches read, CPU tensors never take the graph path, and the cache's bookkeeping
with captures stubbed (capture on the second call, a key per weight address but not per copied tensor, nor per
tensor a call also copies, a failed capture not retried, a raising call not counted, capturing stopped after unused
evictions, graphs dropped past the byte bound).
"""

import pytest
import torch

from mok_compile.kernels import graphs
from tests.kernels.cases import generator, make_case

VARIANTS = ["qwen3", "gpt_oss", "deepseek_v3", "llama4", "mixtral"]


def _sizes(variant):
    """(H, I, E, K) of a small case: E=8 top-2 for Mixtral's form, E=16 top-4 otherwise (DeepSeek-V3's groups
    need E divisible by its 4 groups)."""
    return (128, 64, 8, 2) if variant == "mixtral" else (128, 64, 16, 4)


@pytest.fixture
def cache(monkeypatch):
    """A fresh graph cache for the forward, graphs on up to 512 tokens."""
    from mok_compile.kernels import moe

    fresh = graphs.GraphCache()
    monkeypatch.setattr(moe, "FORWARD_GRAPHS", fresh)
    monkeypatch.setattr(graphs, "max_tokens", 512)
    return fresh


@pytest.fixture
def replays(monkeypatch):
    """The CUDA graph replays run from here on."""
    seen = []
    real = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda g: seen.append(g) or real(g))
    return seen


def _forward(tensors, kw, x=None, **extra):
    from mok_compile.kernels import moe

    with torch.no_grad():
        return moe.fused_moe_forward(x if x is not None else tensors[0], *tensors[1:], **kw, **extra)


def _launched(tensors, kw, x, monkeypatch, **extra):
    """The forward on x by its launches, with graphs off."""
    with monkeypatch.context() as m:
        m.setattr(graphs, "max_tokens", 0)
        return _forward(tensors, kw, x, **extra)


def _fresh_x(tensors, seed):
    x = tensors[0]
    return (torch.randn(x.shape, device=x.device, generator=generator(seed, x.device)) * 0.5).to(x.dtype)


def _equal(got, want, n=3):
    assert len(got) == len(want) == n
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T", [1, 37, 300, 1000])  # 1000: past the token bound, an inference forward of small work
def test_replays_give_the_launches_bits_on_fresh_inputs(cache, monkeypatch, replays, variant, T):
    H, I, E, K = _sizes(variant)
    tensors, kw = make_case(variant, T=T, H=H, I=I, E=E, K=K, dtype=torch.bfloat16, device="cuda")
    for step in range(4):  # seen, captured (and replayed), then two replays
        x = _fresh_x(tensors, step)
        got = _forward(tensors, kw, x)
        assert len(replays) == max(0, step), f"step {step}: {len(replays)} replays"
        _equal(got, _launched(tensors, kw, x, monkeypatch))
    assert len(cache) == 1


@pytest.mark.gpu
def test_a_strided_x_replays_the_launches_bits(cache, monkeypatch):
    """x a column slice of a wider tensor: the launches read a fresh contiguous copy, and so does the graph."""
    tensors, kw = make_case("qwen3", T=24, H=128, I=64, E=16, K=4, dtype=torch.bfloat16, device="cuda")
    for step in range(3):
        wide = torch.cat([_fresh_x(tensors, step), _fresh_x(tensors, step + 10)], dim=1)
        x = wide[:, 64:192]
        assert not x.is_contiguous()
        _equal(_forward(tensors, kw, x), _launched(tensors, kw, x, monkeypatch))
    assert len(cache) == 1


@pytest.mark.gpu
def test_weights_written_in_place_are_read_and_new_weights_get_their_own_graph(cache, monkeypatch):
    tensors, kw = make_case("qwen3", T=20, H=128, I=64, E=16, K=4, dtype=torch.bfloat16, device="cuda")
    for _ in range(2):
        _forward(tensors, kw)
    assert len(cache) == 1
    with torch.no_grad():
        tensors[4].mul_(1.5)  # gate_up_proj, as an optimizer step writes it
        tensors[1].add_(0.25)  # the router
    x = _fresh_x(tensors, 7)
    _equal(_forward(tensors, kw, x), _launched(tensors, kw, x, monkeypatch))
    assert len(cache) == 1
    other = list(tensors)
    other[6] = tensors[6].clone() * 2  # down_proj: a new tensor at another address
    for _ in range(2):
        got = _forward(other, kw, x)
    assert len(cache) == 2
    _equal(got, _launched(other, kw, x, monkeypatch))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["qwen3", "gpt_oss", "deepseek_v3"])
def test_training_forward_replays_give_the_launches_bits_for_every_output(cache, monkeypatch, variant):
    """The training forward (`save_gate_up`): out, weights, ids and what the backward reads (h, logits, layout, and
    a post norm's input, [0, H] here)."""
    tensors, kw = make_case(variant, T=45, H=128, I=64, E=16, K=4, dtype=torch.bfloat16, device="cuda")
    for step in range(3):
        x = _fresh_x(tensors, step)
        _equal(_forward(tensors, kw, x, save_gate_up=True),
               _launched(tensors, kw, x, monkeypatch, save_gate_up=True), n=7)
    assert len(cache) == 1


@pytest.fixture
def backward_cache(monkeypatch):
    """A fresh graph cache for the backward, graphs on up to 512 tokens."""
    from mok_compile.kernels import moe

    fresh = graphs.GraphCache(copied=moe.BACKWARD_GRAPHS._copied)
    monkeypatch.setattr(moe, "BACKWARD_GRAPHS", fresh)
    monkeypatch.setattr(graphs, "max_tokens", 512)
    return fresh


def _backward_calls(tensors, kw, seed, form, monkeypatch):
    """(per-call arguments, kwargs) of a backward after a training forward on fresh x (by its launches), with fresh
    grad_out and grad_topk_weights; `form`: "recompute" (no saved tensors), "saved" or "consume" (h overwritten)."""
    x = _fresh_x(tensors, seed)
    out, w, ids, h, logits, layout, _ = _launched(tensors, kw, x, monkeypatch, save_gate_up=True)
    g = generator(seed + 100, "cuda")
    go = torch.randn(out.shape, device="cuda", generator=g).to(out.dtype)
    gw = torch.randn(w.shape, device="cuda", generator=g).to(w.dtype)
    extra = {} if form == "recompute" else dict(gate_up_out=h, router_logits=logits, routing_layout=layout,
                                                overwrite_gate_up_out=form == "consume")
    return (go, gw, x, w, ids), extra


def _backward(tensors, kw, calls):
    from mok_compile.kernels import moe

    (go, gw, x, w, ids), extra = calls
    extra = {k: v.clone() if k == "gate_up_out" else v for k, v in extra.items()}  # (consumed: each call its own)
    return moe.fused_moe_backward(go, gw, x, *tensors[1:], w, ids, **kw, **extra)


def _equal_grads(got, want):
    assert len(got) == len(want) == 9
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T", [1, 37, 300])
@pytest.mark.parametrize("form", ["recompute", "saved", "consume"])
def test_backward_replays_give_the_launches_bits_for_every_gradient(backward_cache, monkeypatch, replays, variant, T,
                                                                     form):
    H, I, E, K = _sizes(variant)
    tensors, kw = make_case(variant, T=T, H=H, I=I, E=E, K=K, dtype=torch.bfloat16, device="cuda")
    for step in range(4):  # seen, captured (and replayed), then two replays
        calls = _backward_calls(tensors, kw, step, form, monkeypatch)
        got = _backward(tensors, kw, calls)
        assert len(replays) == max(0, step), f"step {step}: {len(replays)} replays"
        with monkeypatch.context() as m:
            m.setattr(graphs, "max_tokens", 0)
            _equal_grads(got, _backward(tensors, kw, calls))
    assert len(backward_cache) == 1
    (graph,) = backward_cache._graphs.values()
    assert graph.finish is not None and graph.plan  # the weight gradients, replayed from a launch plan


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["cutlass", "gathered=triton,sorted=cutlass,wgrad=cutlass"])
def test_backward_replays_on_the_cutlass_engine(backward_cache, monkeypatch, engine):
    """The CUTLASS weight gradients read the graph's sorted copies of go (and x, where h is recomputed)."""
    monkeypatch.setenv("MOK_GEMM_ENGINE", engine)
    tensors, kw = make_case("qwen3", T=40, H=128, I=64, E=16, K=4, dtype=torch.bfloat16, device="cuda")
    for form in ("recompute", "saved"):
        for step in range(3):
            calls = _backward_calls(tensors, kw, step, form, monkeypatch)
            got = _backward(tensors, kw, calls)
            with monkeypatch.context() as m:
                m.setattr(graphs, "max_tokens", 0)
                _equal_grads(got, _backward(tensors, kw, calls))
    assert len(backward_cache) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["qwen3", "gpt_oss"])
def test_training_steps_through_autograd_equal_the_launches(backward_cache, cache, monkeypatch, variant):
    """Two models with the same weights, the op's graphs on in one and off in the other: three optimizer steps of
    two accumulated micro-batches each (the second adds the replay's gradients to .grad) give the same bits."""
    H, I, E, K = _sizes(variant)
    tensors, kw = make_case(variant, T=24, H=H, I=I, E=E, K=K, dtype=torch.bfloat16, device="cuda")
    sides = {on: [None if t is None else torch.nn.Parameter(t.clone()) for t in tensors[1:]] for on in (True, False)}
    for step in range(3):
        for micro in range(2):
            x = _fresh_x(tensors, 10 * step + micro)
            for on, params in sides.items():
                with monkeypatch.context() as m:
                    m.setattr(graphs, "max_tokens", 512 if on else 0)
                    out, w, _ = torch.ops.mok.fused_moe(x.clone().requires_grad_(), *params, **kw)
                    (out.float().square().mean() + w.float().sum() * 0.1).backward()
        for a, b in zip(sides[True], sides[False]):
            if a is not None and a.grad is not None:
                assert torch.equal(a.grad, b.grad)
        with torch.no_grad():
            for params in sides.values():
                for p in params:
                    if p is not None and p.grad is not None:
                        p.sub_(p.grad.to(p.dtype) * 0.5)
                        p.grad = None
    assert len(cache) == 1 and len(backward_cache) == 1


def _with_fresh_logits(tensors, seed, kept):
    """`tensors` of a `router_logits` case with new logits (the router argument) at a new address: `kept` holds the
    earlier ones alive."""
    logits = torch.randn(tensors[1].shape, device="cuda", generator=generator(seed + 50, "cuda")).to(tensors[1].dtype)
    kept.append(logits)
    return (tensors[0], logits, *tensors[2:])


@pytest.mark.gpu
def test_logits_as_the_router_are_copied_into_the_forward_graph(cache, monkeypatch, replays):
    """Where the router argument is the call's logits (Zaya's block), they are a per-call tensor like x: fresh
    logits at a new address each call replay the same graph, with the launches' bits (keyed by their address, a
    graph would serve only calls that happen to reuse it)."""
    tensors, kw = make_case("router_logits", T=40, H=128, I=64, E=16, K=4, dtype=torch.bfloat16, device="cuda")
    kept = []
    for step in range(4):
        call = _with_fresh_logits(tensors, step, kept)
        x = _fresh_x(tensors, step)
        for save in (False, True):
            _equal(_forward(call, kw, x, save_gate_up=save), _launched(call, kw, x, monkeypatch, save_gate_up=save),
                   n=7 if save else 3)
    assert len(cache) == 2 and len(replays) == 6


@pytest.mark.gpu
def test_logits_as_the_router_are_copied_into_the_backward_graph(backward_cache, monkeypatch, replays):
    tensors, kw = make_case("router_logits", T=40, H=128, I=64, E=16, K=4, dtype=torch.bfloat16, device="cuda")
    kept = []
    for step in range(4):
        call = _with_fresh_logits(tensors, step, kept)
        calls = _backward_calls(call, kw, step, "saved", monkeypatch)
        got = _backward(call, kw, calls)
        with monkeypatch.context() as m:
            m.setattr(graphs, "max_tokens", 0)
            _equal_grads(got, _backward(call, kw, calls))
    assert len(backward_cache) == 1 and len(replays) == 3  # captured (and replayed) at step 1, then two replays


@pytest.mark.gpu
def test_graphs_keep_no_weight_alive(backward_cache, cache):
    """A model's weights are freed with the model, not kept by its graphs: the backward's weight gradients read each
    call's weights (NOTES v51: its graphs held the weights of their capture, and counted their bytes as their own,
    1.2 GB a Qwen3-30B-A3B layer, which pushed every other graph out of the 1 GiB bound)."""
    import gc
    import weakref

    tensors, kw = make_case("qwen3", T=24, H=128, I=64, E=16, K=4, dtype=torch.bfloat16, device="cuda")
    params = [None if t is None else torch.nn.Parameter(t.clone()) for t in tensors[1:]]
    for step in range(3):  # seen, captured, replayed
        out, w, _ = torch.ops.mok.fused_moe(_fresh_x(tensors, step).requires_grad_(), *params, **kw)
        (out.float().square().mean() + w.float().sum()).backward()
    assert len(cache) == 1 and len(backward_cache) == 1
    (graph,) = backward_cache._graphs.values()
    assert graph.hits == 1 and graph.nbytes < sum(p.nbytes for p in params if p is not None)
    refs = [weakref.ref(p) for p in params if p is not None]
    del params, out, w
    gc.collect()
    assert all(ref() is None for ref in refs)


@pytest.mark.gpu
def test_more_tokens_than_the_bound_are_not_captured(cache, monkeypatch):
    """Past `max_tokens`, an inference forward of at most `max_inference_macs` is captured, a training forward never."""
    tensors, kw = make_case("qwen3", T=40, H=128, I=64, E=16, K=4, dtype=torch.bfloat16, device="cuda")
    macs = 40 * 4 * 128 * 64  # T * K * H * I
    monkeypatch.setattr(graphs, "max_tokens", 39)
    monkeypatch.setattr(graphs, "max_inference_macs", macs - 1)
    for _ in range(3):
        _forward(tensors, kw)
        _forward(tensors, kw, save_gate_up=True)
    assert len(cache) == 0
    monkeypatch.setattr(graphs, "max_inference_macs", macs)
    for _ in range(2):
        _forward(tensors, kw)
        _forward(tensors, kw, save_gate_up=True)
    assert len(cache) == 1
    monkeypatch.setattr(graphs, "max_tokens", 40)
    for _ in range(2):
        _forward(tensors, kw, save_gate_up=True)
    assert len(cache) == 2
    monkeypatch.setattr(graphs, "max_tokens", 0)  # off: no graph serves, whatever the work
    calls = len(cache._seen)
    for _ in range(2):
        _forward(tensors, kw, x=_fresh_x(tensors, 3))
    assert len(cache._seen) == calls


@pytest.mark.gpu
def test_no_capture_inside_another_capture(cache, monkeypatch):
    """`mode="reduce-overhead"` captures the op in its own graph: the op's launches go into that graph, and the
    replayed outer graph computes what the launches compute."""
    tensors, kw = make_case("gpt_oss", T=16, H=128, I=64, E=16, K=4, dtype=torch.bfloat16, device="cuda")
    x = tensors[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _forward(tensors, kw, x)
    torch.cuda.current_stream().wait_stream(side)
    assert len(cache) == 1  # the warm-up's own graph, on the side stream
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        for _ in range(3):
            out = _forward(tensors, kw, x)
    assert len(cache) == 1
    x.copy_(_fresh_x(tensors, 3))
    outer.replay()
    _equal(out, _launched(tensors, kw, x, monkeypatch))


@pytest.mark.gpu
def test_outputs_are_new_tensors_and_inference_mode_works(cache, monkeypatch):
    tensors, kw = make_case("deepseek_v3", T=9, H=128, I=64, E=16, K=4, dtype=torch.bfloat16, device="cuda")
    with torch.inference_mode():
        first = [_forward(tensors, kw, _fresh_x(tensors, s)) for s in range(3)]
    kept = [t.clone() for t in first[1]]
    second = _forward(tensors, kw, _fresh_x(tensors, 5))  # outside inference mode, same graph
    assert len(cache) == 1
    for a, b, c in zip(first[1], first[2], second):
        assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3
    _equal(first[1], kept)  # not overwritten by later replays
    x = _fresh_x(tensors, 5)
    _equal(second, _launched(tensors, kw, x, monkeypatch))


@pytest.mark.gpu
def test_threads_on_one_stream_each_get_their_own_output(cache, monkeypatch):
    """Replays share the graph's input and outputs: two threads calling on the same stream must not interleave
    one's copy of x with the other's replay."""
    from concurrent.futures import ThreadPoolExecutor

    tensors, kw = make_case("qwen3", T=12, H=128, I=64, E=16, K=4, dtype=torch.bfloat16, device="cuda")
    xs = [_fresh_x(tensors, s) for s in range(8)]
    want = [_launched(tensors, kw, x, monkeypatch) for x in xs]
    for _ in range(2):
        _forward(tensors, kw)
    assert len(cache) == 1

    def calls(offset):
        return [_forward(tensors, kw, xs[i]) for _ in range(10) for i in range(offset, 8, 2)]

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(calls, (0, 1)))
    for offset, got in enumerate(results):
        for n, out in enumerate(got):
            _equal(out, want[offset + 2 * (n % 4)])


@pytest.mark.gpu
def test_capturing_stops_once_graphs_leave_the_cache_unused(monkeypatch):
    """More distinct token counts than the cache holds, each seen twice: a capture makes room by evicting a graph
    gone stale (no call in the last 4 * max_graphs calls), and after `_MAX_UNUSED` of those left never replayed
    the cache captures no more."""
    from mok_compile.kernels import moe

    small = graphs.GraphCache(max_graphs=1)
    monkeypatch.setattr(moe, "FORWARD_GRAPHS", small)
    monkeypatch.setattr(graphs, "_MAX_UNUSED", 2)
    for T in range(1, 9):
        tensors, kw = make_case("qwen3", T=T, H=64, I=32, E=8, K=2, dtype=torch.bfloat16, device="cuda")
        for _ in range(2):
            _forward(tensors, kw)
    assert small.unused == 2 and len(small) == 1  # T=1 and 4 evicted unused, T=7 kept; the others not captured


def test_the_copy_of_x_keeps_the_alignment_the_launches_read():
    """x's own address modulo 256 bytes; for a non-contiguous x, that of the fresh contiguous copy the forward
    makes (0)."""
    base = torch.empty(4096, dtype=torch.bfloat16)
    for offset in (0, 8, 72, 130):
        x = base[offset:offset + 512].view(4, 128)
        copy = graphs._like_aligned(x)
        assert copy.shape == x.shape and copy.dtype == x.dtype and copy.is_contiguous()
        assert (copy.data_ptr() - x.data_ptr()) % graphs._ALIGN == 0
        strided = base[offset:offset + 1024].view(4, 256)[:, :128]
        copy = graphs._like_aligned(strided)
        assert copy.is_contiguous() and copy.shape == strided.shape and copy.data_ptr() % graphs._ALIGN == 0


def test_cpu_tensors_never_take_the_graph_path():
    x = torch.randn(4, 8)
    assert not graphs.eligible(x)
    cache = graphs.GraphCache()
    calls = []
    for _ in range(3):
        cache.call(lambda *t: calls.append(t) or t[0], (x, None), ("options",))
    assert len(calls) == 3 and len(cache) == 0


class _StubGraph:
    """A capture that records what it was given and replays by returning a marker (the cache's bookkeeping on the
    CPU; the GPU tests above capture for real)."""

    made = []
    nbytes = 100

    def __init__(self, capture, tensors, copied, stream, pool):
        self.hits, self.tensors = 0, tensors
        _StubGraph.made.append(self)
        capture(*tensors)  # (the stub's runs raise where a capture would fail)

    def replay(self, tensors):
        return ("replayed", tensors[0])


@pytest.fixture
def stub_cache(monkeypatch):
    """A GraphCache on CPU tensors: every call eligible, captures stubbed, one stream."""
    monkeypatch.setattr(graphs, "eligible", lambda x, macs=None: True)
    monkeypatch.setattr(graphs, "_Graph", _StubGraph)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(graphs.GraphCache, "_stream", lambda self, device: "side stream")
    monkeypatch.setattr(graphs.GraphCache, "_pool", lambda self, device, stream: "pool")
    _StubGraph.made = []
    return graphs.GraphCache()


def _run(calls):
    def run(*tensors):
        calls.append(tensors)
        return ("launched", tensors[0])
    return run


def test_a_signature_is_captured_on_its_second_call_and_replayed_after(stub_cache):
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    calls = []
    results = [stub_cache.call(_run(calls), (x, w), ("opts",)) for _ in range(4)]
    assert [r[0] for r in results] == ["launched", "replayed", "replayed", "replayed"]
    assert len(calls) == 2 and len(_StubGraph.made) == 1 and len(stub_cache) == 1  # the first call, the capture
    assert _StubGraph.made[0].hits == 2  # the calls after the capturing one
    other_w = w.clone()  # same shape, another address: another graph
    for _ in range(2):
        stub_cache.call(_run(calls), (x, other_w), ("opts",))
    assert len(stub_cache) == 2 and len(calls) == 4


def test_a_failed_capture_runs_the_launches_and_is_not_tried_again(stub_cache, caplog):
    x = torch.randn(4, 8)
    calls = []

    def fails_capture(*tensors):
        raise RuntimeError("operation not permitted when stream is capturing")

    with caplog.at_level("WARNING", logger="mok_compile.graphs"):
        results = [stub_cache.call(_run(calls), (x,), (), capture=fails_capture) for _ in range(4)]
    assert [r[0] for r in results] == ["launched"] * 4 and len(calls) == 4
    assert len(_StubGraph.made) == 1 and len(stub_cache) == 0
    assert "could not be captured" in caplog.text and "operation not permitted" in caplog.text


def test_a_call_that_raises_is_not_counted_as_seen(stub_cache):
    x = torch.randn(4, 8)

    def bad(*tensors):
        raise ValueError("mok.fused_moe: bad input")

    for _ in range(3):
        with pytest.raises(ValueError, match="bad input"):
            stub_cache.call(bad, (x,), ())
    assert not _StubGraph.made


def test_a_model_deeper_than_the_cache_keeps_the_graphs_it_has(stub_cache):
    """Ten layers (ten weights) called in turn through a cache of four graphs: the first four layers keep theirs and
    replay each step; the other six run as launched. Least-recently-used eviction would evict every graph before its
    layer's next call, replaying none."""
    cache = graphs.GraphCache(max_graphs=4)
    x, layers = torch.randn(4, 8), [torch.randn(8, 8) for _ in range(10)]
    steps = [[cache.call(_run([]), (x, w), ())[0] for w in layers] for _ in range(5)]
    assert steps[0] == ["launched"] * 10 and steps[1] == ["replayed"] * 4 + ["launched"] * 6
    assert steps[2:] == [["replayed"] * 4 + ["launched"] * 6] * 3
    assert len(_StubGraph.made) == 4 and len(cache) == 4 and cache.unused == 0


def test_the_cache_stops_capturing_after_unused_evictions(stub_cache, monkeypatch):
    """Distinct token counts, each seen twice: a graph that went stale (no call in the last 4 * max_graphs calls)
    makes room for the next capture, and after `_MAX_UNUSED` of them left never replayed the cache captures no
    more."""
    monkeypatch.setattr(graphs, "_MAX_UNUSED", 2)
    small = graphs.GraphCache(max_graphs=1)  # stale after 4 calls
    xs = {T: torch.randn(T, 8) for T in range(1, 9)}
    got = {T: [small.call(_run([]), (x,), ())[0] for _ in range(2)] for T, x in xs.items()}
    assert [T for T, r in got.items() if r[1] == "replayed"] == [1, 4, 7]  # T=4 and 7 each evict a stale graph
    assert small.unused == 2 and len(small) == 1 and len(_StubGraph.made) == 3
    assert small.call(_run([]), (xs[7],), ())[0] == "replayed"  # T=7's graph stays and still serves
    assert small.call(_run([]), (xs[8],), ())[0] == "launched"  # T=8: seen twice, never captured


def fresh(*shape):
    """A new CPU tensor at an address 256-byte aligned, as the GPU's allocator gives (the key holds the alignment)."""
    buf = torch.randn(shape[0] * shape[1] + 64)
    offset = -buf.data_ptr() % graphs._ALIGN // buf.element_size()
    return buf[offset:offset + shape[0] * shape[1]].view(shape)


def test_copied_tensors_are_not_in_the_key_and_the_others_are(stub_cache):
    """A backward's per-call tensors (grad_out, saved h, ...) are copied into the graph: new ones each call replay
    the same graph. A weight at another address gets another."""
    cache = graphs.GraphCache(copied=(0, 2))
    w = fresh(8, 8)
    for _ in range(3):
        cache.call(_run([]), (fresh(4, 8), w, fresh(4, 2)), ())
    assert len(cache) == 1 and _StubGraph.made[0].hits == 1
    other_w = fresh(8, 8)
    for _ in range(2):
        cache.call(_run([]), (fresh(4, 8), other_w, fresh(4, 2)), ())
    assert len(cache) == 2
    for _ in range(2):
        cache.call(_run([]), (fresh(4, 8), w, None), ())  # an absent per-call tensor: another signature
    assert len(cache) == 3


def test_tensors_a_call_also_copies_are_not_in_the_key(stub_cache):
    """`also_copied` (the logits where they are the router argument): new ones each call replay the same graph."""
    x, w = fresh(4, 8), fresh(8, 8)
    for _ in range(3):
        stub_cache.call(_run([]), (x, fresh(4, 2), w), ("logits",), also_copied=(1,))
    assert len(stub_cache) == 1 and _StubGraph.made[0].hits == 1
    for _ in range(2):  # the same shapes, the second tensor keying the graph by its address
        stub_cache.call(_run([]), (x, fresh(4, 2), w), ("weights",))
    assert len(stub_cache) == 1


def test_a_graph_past_the_byte_bound_waits_for_a_stale_one(stub_cache):
    """The stub's graphs keep 100 bytes each, the cache 250: T=3's graph is dropped after serving its capturing call
    (its size then known, the next calls are not captured) until T=1's goes stale (no call in 12)."""
    cache = graphs.GraphCache(max_graphs=3, max_bytes=250)
    xs = [torch.randn(T, 8) for T in range(1, 4)]
    got = [cache.call(_run([]), (x,), ())[0] for x in xs for _ in range(3)]
    assert got == ["launched", "replayed", "replayed"] * 2 + ["launched", "replayed", "launched"]
    assert len(_StubGraph.made) == 3 and len(cache) == 2 and cache._bytes == 200
    got = [cache.call(_run([]), (xs[2],), ())[0] for _ in range(8)]
    assert got == ["launched"] * 6 + ["replayed"] * 2  # captured at the 16th call, in T=1's place
    assert len(_StubGraph.made) == 4 and len(cache) == 2 and cache._bytes == 200 and cache.unused == 0
    assert cache.call(_run([]), (xs[1],), ())[0] == "replayed" and cache.call(_run([]), (xs[0],), ())[0] == "launched"


def test_the_size_rule(monkeypatch):
    """1 to max_tokens tokens; past that only an inference forward (its work given) within both of its bounds; none
    at all with max_tokens 0."""
    monkeypatch.setattr(graphs, "max_tokens", 512)
    monkeypatch.setattr(graphs, "max_inference_macs", 1 << 34)
    within = graphs.within_bounds
    assert within(1) and within(512) and within(512, 1 << 40)
    assert not within(0) and not within(513) and not within(0, 1)
    assert within(513, 1 << 34) and within(graphs.MAX_INFERENCE_TOKENS, 1)
    assert not within(513, (1 << 34) + 1) and not within(graphs.MAX_INFERENCE_TOKENS + 1, 1)
    monkeypatch.setattr(graphs, "max_tokens", 0)
    assert not within(1) and not within(513, 1)
