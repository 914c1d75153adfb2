"""`torch.compile(model, backend="mok", mode="reduce-overhead")` on a GPU: the README's advice for small batches.

Inductor's cudagraph trees capture the compiled graphs, the fused op and its launch plans inside them (the op
has no host sync), and replay them with the inputs copied into static buffers. On fresh inputs every step, the
replayed logits, loss and gradients must equal, bit for bit, those of the same compile in default mode (where, at
inference, the op replays its own few-token graphs, `mok_compile.kernels.graphs`, and inside inductor's capture it
does not): a replay that read a stale input, or a launch plan recorded against another step's tensors, would differ.
Attention runs HF's eager path (matmuls and a softmax: deterministic); the one gradient compared within a tolerance
is the input embedding's, an atomic scatter-add outside the MoE layers whose order may vary between runs.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from mok_compile.backend import mok_backend
from mok_compile.demo import make_causal_lm
from mok_compile.kernels import graphs
from tests.backend.helpers import rel_err, token_ids

pytestmark = pytest.mark.gpu
STEPS = 4  # cudagraph trees warm up, record, then replay: the last steps are replays


@pytest.fixture
def replays(monkeypatch):
    """How many CUDA graph replays inductor runs (cudagraph trees replay through torch.cuda.CUDAGraph.replay); the
    op's own few-token graphs (`graphs._Graph.replay`, in the compile without CUDA graphs) are not counted."""
    count = [0]
    replay = torch.cuda.CUDAGraph.replay
    own_replay = graphs._Graph.replay
    inside_own = [False]

    def counted(graph):
        count[0] += not inside_own[0]
        return replay(graph)

    def own(self, tensors):
        inside_own[0] = True
        try:
            return own_replay(self, tensors)
        finally:
            inside_own[0] = False

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counted)
    monkeypatch.setattr(graphs._Graph, "replay", own)
    return count


def _steps(model, mode, train):
    """Per step on fresh token ids: the logits, and when training the loss and every gradient (cloned: the next
    replay overwrites the static outputs)."""
    torch._dynamo.reset()
    fused = counters["mok"]["fused_moe"]
    fn = torch.compile(model, backend=mok_backend, mode=mode)
    results = []
    for step in range(STEPS):
        ids = token_ids(batch=2, seq=40, seed=step + 1).to(model.device)
        torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(train):
            out = fn(ids, labels=ids if train else None)
            got = [out.logits.detach().clone()]
            if train:
                out.loss.backward()
                got += [out.loss.detach().clone()] + [p.grad.clone() for p in _params(model)]
        results.append(got)
    assert counters["mok"]["fused_moe"] - fused == model.config.num_hidden_layers, "not every MoE layer was fused"
    return results


def _params(model):
    """The parameters, the input embedding's last."""
    embedding = model.get_input_embeddings().weight
    return [p for p in model.parameters() if p is not embedding] + [embedding]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_reduce_overhead_replays_equal_the_plain_compile(family, train, replays):
    model = make_causal_lm(family, num_layers=2, dtype=torch.bfloat16, device="cuda",
                           _attn_implementation="eager").train(train)
    want = _steps(model, None, train)
    assert replays[0] == 0
    skips = counters["inductor"]["cudagraph_skips"]
    got = _steps(model, "reduce-overhead", train)
    assert counters["inductor"]["cudagraph_skips"] == skips, "inductor skipped CUDA graphs for the fused graph"
    assert replays[0] >= STEPS - 2, "the compiled model did not replay from CUDA graphs"
    for step, (a, b) in enumerate(zip(got, want)):
        assert len(a) == len(b)
        if train:  # the embedding's gradient, last
            assert rel_err(a.pop(), b.pop()) < 1e-2, f"step {step}: the embedding's gradient"
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {step}, output {i} differs from the compile without CUDA graphs"
