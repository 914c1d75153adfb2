"""MoE variants and random inputs shared by the kernel tests (GPU and CPU interpreter)."""

from __future__ import annotations

import contextlib

import torch

from mok_compile.ops import reference
from mok_compile.ops.spec import ExpertSpec, RoutingSpec, op_kwargs, with_defaults

# name -> (RoutingSpec without top_k, ExpertSpec, has router bias, has expert biases, has selection bias)
VARIANTS = {
    "qwen3": (dict(renormalize=True, weights_fp32=False), ExpertSpec(), False, False, False),
    "mixtral": (dict(renormalize=True), ExpertSpec(), False, False, False),
    "olmoe_no_renorm": (dict(weights_fp32=False), ExpertSpec(), False, False, False),
    "softmax_low_precision": (dict(softmax_fp32=False, renormalize=True), ExpertSpec(), False, False, False),
    "deepseek_v3": (dict(routing="sigmoid_grouped_topk", router_fp32=True, renormalize=True, renorm_eps=1e-20,
                         routed_scale=2.5, n_group=4, topk_group=2), ExpertSpec(), False, False, True),
    "sigmoid_ungrouped": (dict(routing="sigmoid_grouped_topk", routed_scale=1.5), ExpertSpec(), False, False, False),
    # LFM2-MoE: sigmoid in the router's dtype, a selection bias, renormalised (+1e-6), weights in the input dtype.
    "lfm2": (dict(routing="sigmoid_grouped_topk", softmax_fp32=False, renormalize=True, renorm_eps=1e-6,
                  weights_fp32=False), ExpertSpec(), False, False, True),
    # DeepSeek-V2's group-limited greedy: fp32 softmax, the best 2 of 4 groups by their largest probability, scaled.
    "deepseek_v2": (dict(router_fp32=True, routed_scale=2.5, n_group=4, topk_group=2, group_top=1), ExpertSpec(), False,
                    False, False),
    # Mistral4: softmax in the router's dtype, the best 2 of 4 groups by the sum of their top 2, renormalised (+1e-20),
    # scaled, weights in the input dtype.
    "mistral4": (dict(softmax_fp32=False, renormalize=True, renorm_eps=1e-20, routed_scale=2.5, n_group=4,
                      topk_group=2, weights_fp32=False), ExpertSpec(), False, False, False),
    # AFMoE: sigmoid scores of a router in the model's dtype, one group, selection bias, renormalised and scaled.
    "afmoe": (dict(routing="sigmoid_grouped_topk", renormalize=True, renorm_eps=1e-20, routed_scale=2.5), ExpertSpec(),
              False, False, True),
    "gpt_oss": (dict(routing="topk_softmax", softmax_fp32=False, weights_fp32=False),
                ExpertSpec(activation="clamped_silu", interleaved=True, transposed=True, alpha=1.702, limit=7.0),
                True, True, False),
    "granite": (dict(routing="topk_softmax", weights_fp32=False), ExpertSpec(), False, False, False),
    # Inkling2: an fp32 router's sigmoid scores, a selection bias, renormalised (+1e-20), scaled; its softcapped SwiGLU,
    # tanh(g / alpha) * alpha * sigmoid(g) * tanh(u / limit) * limit in fp32, with caps unit-scale activations feel.
    "inkling2": (dict(routing="sigmoid_grouped_topk", router_fp32=True, renormalize=True, renorm_eps=1e-20,
                      routed_scale=2.5), ExpertSpec(activation="softcapped_swiglu", alpha=0.8, limit=1.5), False, False,
                 True),
    # Beam: DeepSeek-V3's routing, its SwiGLU in fp32 and rounded once (the op's silu_fp32).
    "beam": (dict(routing="sigmoid_grouped_topk", router_fp32=True, renormalize=True, renorm_eps=1e-20,
                  routed_scale=2.5), ExpertSpec(activation="silu_fp32"), False, False, True),
    # OpenAI's privacy filter: an fp32 router with a bias, the softmax of the top-k logits / top_k, GPT-OSS's clamped
    # SwiGLU on gate and up halves (not interleaved), [E, H, 2I] experts with biases.
    "privacy_filter": (dict(routing="topk_softmax", router_fp32=True, routed_scale=0.5),
                       ExpertSpec(activation="clamped_silu", transposed=True, alpha=1.702, limit=7.0), True, True, False),
    "gelu_tanh_glu": (dict(renormalize=True), ExpertSpec(activation="gelu_tanh"), False, True, False),
    "relu2": (dict(), ExpertSpec(activation="relu2", gated=False), False, False, False),
    "relu": (dict(), ExpertSpec(activation="relu", gated=False, transposed=True), False, True, False),
    "silu_mlp": (dict(), ExpertSpec(activation="silu", gated=False), False, False, False),
    "gelu_mlp": (dict(), ExpertSpec(activation="gelu", gated=False), False, False, False),
    "gelu_tanh_mlp": (dict(), ExpertSpec(activation="gelu_tanh", gated=False), False, False, False),
    "router_logits": (dict(router_is_logits=True, renormalize=True), ExpertSpec(), False, False, False),
    # Llama4: top-k of the logits, fp32 sigmoid cast to the input dtype, weight on the expert input,
    # unweighted sum; [E, H, 2I] / [E, I, H] experts.
    "llama4": (dict(routing="topk_sigmoid", weights_fp32=False, weight_on_input=True), ExpertSpec(transposed=True),
               False, False, False),
    # The same routing with renormalisation, scale and fp32 weights, biases everywhere (down bias: no
    # d(weights) term when the weight is on the input), F.linear layout.
    "topk_sigmoid_renorm_bias": (dict(routing="topk_sigmoid", renormalize=True, routed_scale=1.5, weight_on_input=True),
                                 ExpertSpec(activation="gelu_tanh"), True, True, False),
    # Gated experts in the transposed layout ([E, H, 2I]) with gate and up as column blocks, biases.
    "glu_transposed": (dict(renormalize=True), ExpertSpec(transposed=True), False, True, False),
    # topk_sigmoid with the usual weighted combine (weight_on_input off), sigmoid in the logits' dtype.
    "topk_sigmoid_out": (dict(routing="topk_sigmoid", softmax_fp32=False, renormalize=True), ExpertSpec(), False,
                         False, False),
    # Ernie 4.5: fp32 router, a selection bias on the probabilities, w / clamp(sum, min). Its min is 1e-12; 0.3 here
    # holds the sum at the clamp for some tokens (top-2 of 8 probabilities), so both sides of it are checked.
    "ernie": (dict(router_fp32=True, renormalize=True, renorm_min=0.3, weights_fp32=False), ExpertSpec(), False, False,
              True),
    # DeepSeek-V4: sqrt(softplus(logits)) in the router's dtype, a selection bias, renormalised (+1e-20) and scaled,
    # weights in the input dtype; its clamped SwiGLU, silu(min(g, limit)) * clamp(u, -limit, limit), with a limit that
    # unit-scale activations cross.
    "deepseek_v4": (dict(routing="sqrtsoftplus_topk", softmax_fp32=False, renormalize=True, renorm_eps=1e-20,
                         routed_scale=1.5, weights_fp32=False), ExpertSpec(activation="clamped_swiglu", limit=0.75),
                    False, False, True),
    # Kolibri1: fp32 router, a selection bias on the logits, sigmoid of the unbiased chosen logits, renormalised.
    "kolibri": (dict(routing="topk_sigmoid", router_fp32=True, renormalize=True), ExpertSpec(), False, False, True),
    # PhiMoE at inference: the sparsemixer in the router's dtype, weights in the input dtype; a threshold (2 * 0.1)
    # that keeps some other experts in each round's softmax and drops others (PhiMoE's 2 * 0.01 keeps near ties).
    "phimoe": (dict(routing="sparsemixer", softmax_fp32=False, weights_fp32=False, jitter_eps=0.1), ExpertSpec(),
               False, False, False),
    "sparsemixer_renorm": (dict(routing="sparsemixer", renormalize=True, routed_scale=1.5, jitter_eps=0.15),
                           ExpertSpec(), True, False, False),
}

# CPU-interpreter checks (variant, T, H, I, E, K, dtype): small odd sizes, T not a multiple of any block.
EVERY_VARIANT_FP32 = [(v, 19, 40, 24, 8, 2, torch.float32) for v in VARIANTS]
INTERPRET_CASES = EVERY_VARIANT_FP32 + [
    ("qwen3", 1, 24, 20, 6, 3, torch.float32),
    ("qwen3", 70, 24, 20, 8, 2, torch.float32),  # two routing programs (64 tokens each at E=8): the sort launches
    ("deepseek_v3", 23, 32, 16, 16, 4, torch.float32),
    ("qwen3", 29, 40, 24, 8, 2, torch.float16),
    ("gpt_oss", 17, 32, 24, 4, 2, torch.float16),
    ("llama4", 21, 40, 24, 8, 1, torch.float32),
    ("llama4", 19, 40, 24, 8, 1, torch.float16),
    ("llama4", 25, 48, 24, 16, 3, torch.float16),
    ("topk_sigmoid_renorm_bias", 23, 32, 16, 8, 3, torch.float16),
    ("lfm2", 19, 40, 24, 8, 2, torch.float16),
    ("inkling2", 19, 40, 24, 8, 2, torch.float16),  # the softcapped SwiGLU's one rounding from fp32
    ("beam", 19, 40, 24, 8, 2, torch.float16),  # the fp32 SwiGLU's one rounding
    ("phimoe", 19, 40, 24, 8, 2, torch.float16),  # the sparsemixer's masks and softmax rounded to the logits' dtype
    ("sparsemixer_renorm", 70, 32, 16, 16, 3, torch.float32),  # two routing programs, three rounds
]

# The same through the CUTLASS engine (MOK_GEMM_ENGINE=cutlass; H and I multiples of 8): every
# activation, both layouts, interleaved, biases, one token, most experts empty; weight on input
# (only its weight gradients take CUTLASS).
CUTLASS_INTERPRET_CASES = EVERY_VARIANT_FP32 + [
    ("qwen3", 1, 24, 16, 6, 3, torch.float32),
    ("deepseek_v3", 23, 32, 16, 16, 4, torch.float32),
    ("gpt_oss", 17, 32, 24, 4, 2, torch.float16),
    ("qwen3", 29, 40, 24, 8, 2, torch.float16),
]

# The Triton GEMMs with B through TMA descriptors (MOK_TMA=1; 16-bit weights whose strides are multiples
# of 8): gate and up as column blocks (one 4-d box, both weight layouts; I = 24 leaves a partial N tile)
# or interleaved, non-gated, biases.
TMA_INTERPRET_CASES = [(v, 19, 40, 24, 8, 2, torch.float16)
                       for v in ("qwen3", "glu_transposed", "gpt_oss", "relu", "relu2", "gelu_tanh_glu", "granite")]
TMA_INTERPRET_CASES += [("deepseek_v3", 23, 32, 16, 16, 4, torch.float16)]

# Half-height tails (HALF_TAIL): run with the GEMM configs at this BLOCK_M (half: 16 rows) on inputs whose
# experts end in row blocks of both heights (~32 rows per expert): gated (STORE_H through the saved h),
# interleaved + bias + transposed, gate/up column blocks (B_BLOCKED), weight on input, and B through TMA.
HALF_TAIL_BLOCK_M = 32
HALF_TAIL_INTERPRET_CASES = [
    ("qwen3", 64, 40, 24, 4, 2, torch.float32),
    ("gpt_oss", 64, 32, 24, 4, 2, torch.float16),
    ("glu_transposed", 64, 40, 24, 4, 2, torch.float32),
    ("llama4", 64, 40, 24, 4, 2, torch.float32),
]
HALF_TAIL_TMA_INTERPRET_CASES = [
    ("gpt_oss", 64, 32, 24, 4, 2, torch.float16),
    ("qwen3", 64, 40, 24, 4, 2, torch.float16),
    ("llama4", 64, 40, 24, 4, 2, torch.float16),
]


# Added to every seed below. tests/conftest.py sets it to the run's seed (MOK_TEST_SEED, fresh each pytest run) while a
# @pytest.mark.gpu test runs, so that the GPU tests draw new inputs each run, and back to 0 for the CPU tests, which
# keep fixed inputs (the interpreter checks draw their own, `interpret_runner.check`).
SEED_OFFSET = 0


def generator(seed: int, device="cpu") -> torch.Generator:
    """A generator on `device` seeded with `seed` + SEED_OFFSET."""
    return torch.Generator(device=device).manual_seed(seed + SEED_OFFSET)


def make_case(variant, T, H, I, E, K, dtype=torch.float32, device="cpu", seed=0, logits=None):
    """(positional tensors, kwargs) of `mok.fused_moe` for `variant`, random (never zero) values.

    `logits` ([T, E]) overrides the router output (router_is_logits), e.g. to send every token
    to the same experts."""
    routing_kw, experts, router_bias, expert_bias, sel_bias = VARIANTS[variant]
    routing = RoutingSpec(top_k=K, **routing_kw)
    if logits is not None:
        routing = RoutingSpec(**{**routing.__dict__, "router_is_logits": True})
    g = generator(seed)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(shape, generator=g) * scale).to(device=device, dtype=dt)

    up = 2 if experts.gated else 1
    x = rnd(T, H)
    if routing.router_is_logits:
        router = logits.to(device=device, dtype=dtype) if logits is not None else rnd(T, E)
    else:
        router = rnd(E, H, scale=H ** -0.5, dt=torch.float32 if routing.router_fp32 else dtype)
    w1 = rnd(E, H, up * I, scale=H ** -0.5) if experts.transposed else rnd(E, up * I, H, scale=H ** -0.5)
    w2 = rnd(E, I, H, scale=I ** -0.5) if experts.transposed else rnd(E, H, I, scale=I ** -0.5)
    tensors = (
        x,
        router,
        rnd(E, scale=0.1, dt=router.dtype) if router_bias and not routing.router_is_logits else None,
        rnd(E, scale=0.1, dt=torch.float32) if sel_bias else None,
        w1,
        rnd(E, up * I, scale=0.1) if expert_bias else None,
        w2,
        rnd(E, H, scale=0.1) if expert_bias else None,
    )
    return tensors, with_defaults(op_kwargs(routing, experts))


def fp32_expert_reference(tensors, kw, topk_weights, topk_ids):
    """out computed in fp32 on upcast inputs, for the kernel's own routing decision."""
    x, _, _, _, w1, b1, w2, b2 = (None if t is None else t.float() for t in tensors)
    return reference.experts_reference(x, topk_weights.float(), topk_ids, w1, b1, w2, b2,
                                       activation=kw["activation"], gated=kw["gated"],
                                       interleaved=kw["interleaved"], transposed=kw["transposed"],
                                       alpha=kw["alpha"], limit=kw["limit"],
                                       weight_on_input=kw.get("weight_on_input", False))


@contextlib.contextmanager
def rounded_before_bias(dtype):
    """The reference with each x @ W rounded to `dtype` before its bias is added, as HF's grouped path (and the
    CUTLASS engine's gate_up) does. The GPU tests measure with it how much their inputs amplify 16-bit rounding:
    across ReLU's jump at 0 (a few pre-activations land on its other side), or in an ill-conditioned gradient."""
    fp32_order = reference._project

    def project(x, weight, bias, transposed):
        out = fp32_order(x, weight, None, transposed).to(dtype).to(x.dtype)
        return out if bias is None else out + bias

    reference._project = project
    try:
        yield
    finally:
        reference._project = fp32_order


@contextlib.contextmanager
def rounded_activation_gradient(dtype):
    """The reference with the activation's gradient dh (and its input da) rounded to `dtype`: every engine stores dh
    in the inputs' dtype between the backward's GEMMs (the CUTLASS engine g2 = da too). With weight on the expert input
    the router gradient takes <dh @ W1, x>, so this rounding, not the projections', can decide how far it moves."""
    fp32_backward = reference.activation_backward

    def backward(h, da, **kw):
        return fp32_backward(h, da.to(dtype).to(da.dtype), **kw).to(dtype).to(da.dtype)

    reference.activation_backward = backward
    try:
        yield
    finally:
        reference.activation_backward = fp32_backward


@contextlib.contextmanager
def rounded_weighted_input(dtype):
    """The reference backward with a weight-on-input block's expert input x * w rounded to `dtype`, as the forward
    (HF's `hidden_states * router_scores`) and every engine's recompute of h have it. The router gradient takes
    <dh @ W1, x> at h of that input: at one token, rounding it moved that gradient past 1e-2 in about 4% of the CPU
    draws that rounding the projections and dh moved by under 5e-3."""
    fp32_input = reference._weighted_input

    def weighted_input(x, w):
        return fp32_input(x, w).to(dtype).to(x.dtype)

    reference._weighted_input = weighted_input
    try:
        yield
    finally:
        reference._weighted_input = fp32_input


def small_layer(T, H, E, I, g, device, dtype, choices=None):
    """The op's 8 tensor arguments for the interpreted-and-GPU cases of given ids, the expert scale and identity
    experts: x, router (of `choices` rows, default E), gate_up and down weights and a down bias (no other bias),
    drawn from the CPU generator `g` in that order."""
    def draw(*shape, std):
        return (torch.randn(*shape, generator=g) * std).to(device, dtype)

    x, router = draw(T, H, std=0.5), draw(choices or E, H, std=0.3)
    w1, w2, b2 = draw(E, 2 * I, H, std=0.2), draw(E, H, I, std=0.2), draw(E, H, std=0.1)
    return (x, router, None, None, w1, None, w2, b2)


def four_autograd_calls(step, T, monkeypatch):
    """`step()` -> (out, weights, ids, *grads) called four times through the op's autograd on CUDA: the first runs the
    launches, the second captures CUDA graphs at few tokens (forward and backward), the third replays them (checked:
    at least two replays where T is few enough for graphs, none otherwise), a fourth runs with the graphs off. Every
    call must give the same bits; returns the first call's results. The op's graph caches start fresh: each stops
    capturing once 16 of its graphs left it unreplayed, which the GPU tests run before this one in a worker reach."""
    from mok_compile.kernels import graphs, moe

    for name in ("FORWARD_GRAPHS", "BACKWARD_GRAPHS"):
        monkeypatch.setattr(moe, name, graphs.GraphCache(copied=getattr(moe, name)._copied))
    replays = []
    real = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda g: replays.append(g) or real(g))
    runs = []
    for call in range(4):
        if call == 3:
            monkeypatch.setattr(graphs, "max_tokens", 0)
        replays.clear()
        runs.append(step())
        if call == 2:
            assert (len(replays) >= 2) if T <= graphs.max_tokens else not replays, len(replays)
    for later in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], later))
    return runs[0]


def learned_tensor_autograd(T, H, I, E, kw, name, draw, monkeypatch, device="cuda"):
    """A bf16 layer drawn with seed T (x, router, w1, w2, then the op's keyword tensor `name` = `draw(rnd, g)`, then
    grad_out) through the op's autograd four times (`four_autograd_calls`), that tensor a leaf beside the weights:
    ((x, router, w1, w2, learned, go), (out, weights, ids, d x, d router, d w1, d w2, d learned))."""
    g = torch.Generator().manual_seed(T)

    def rnd(*shape, scale):
        return (torch.randn(shape, generator=g) * scale).to(device, torch.bfloat16)

    x, router = rnd(T, H, scale=1.0), rnd(E, H, scale=H ** -0.5)
    w1, w2 = rnd(E, 2 * I, H, scale=H ** -0.5), rnd(E, H, I, scale=I ** -0.5)
    learned = draw(rnd, g)
    go = rnd(T, H, scale=1.0)
    weights = [t.clone().requires_grad_() for t in (router, w1, w2, learned)]  # one set: graphs key them by address

    def step():
        leaves = [x.clone().requires_grad_(), *weights]
        lx, lr, l1, l2, ll = leaves
        out, w, ids = torch.ops.mok.fused_moe(lx, lr, None, None, l1, None, l2, None, **kw, **{name: ll})
        return (out, w, ids, *torch.autograd.grad((out * go).sum(), leaves))

    return (x, router, w1, w2, learned, go), four_autograd_calls(step, T, monkeypatch)


def tied_tokens(tensors, kw) -> torch.Tensor:
    """[T] bool: the tokens whose pick has an exact tie in the reference's selection, at the top-k boundary of its
    scores or, group-limited, of its group scores (16-bit scores make that likely: 1.3% of the tokens of bf16-softmax
    cases). Either pick is then right (torch.topk promises no order among equals), so engines may differ there."""
    kw = with_defaults(kw)
    x, router, router_bias, selection_bias = tensors[:4]
    T, K, E = x.shape[0], kw["top_k"], tensors[4].shape[0]
    tied = torch.zeros(T, dtype=torch.bool, device=x.device)
    if K >= E or kw["routing"] == "sparsemixer":  # its picks are torch.max's, the first of equals, as the kernel's
        return tied
    logits = reference.router_logits(x, router, router_bias, router_is_logits=kw["router_is_logits"],
                                     router_fp32=kw["router_fp32"])
    choice, _ = reference.selection_scores(logits, selection_bias, routing=kw["routing"],
                                           softmax_fp32=kw["softmax_fp32"], n_group=1, topk_group=1)
    G = kw["n_group"]
    if G > 1:
        if kw["topk_group"] < G:
            ranked = reference.group_scores(choice, G, kw["group_top"]).sort(dim=-1, descending=True).values
            tied |= ranked[:, kw["topk_group"] - 1] == ranked[:, kw["topk_group"]]
        choice = reference._grouped_choice(choice, G, kw["topk_group"], kw["group_top"])
    ranked = choice.sort(dim=-1, descending=True).values
    return tied | (ranked[:, K - 1] == ranked[:, K])


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
