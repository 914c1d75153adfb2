"""Whole tiny HF CausalLMs through `backend="mok"` (aot_eager inner compiler): every MoE layer fused,
logits, loss and every parameter gradient equal to eager.

Tolerances (max |mok - eager| / max |eager|, per tensor), with what was measured on torch 2.13 CPU:
- fp32: logits 2e-6 (seen <= 2.7e-7), gradients 1e-5 (seen <= 6.9e-7). The fused op changes summation order only.
- bf16: logits bitwise: the op's forward reproduces HF bitwise and the rest of the graph runs the same aten ops.
  Gradients 3e-2 (seen 0.9e-2..1.8e-2): the op's backward computes in fp32 and rounds once, eager autograd
  rounds every bf16 intermediate, so they differ by a few bf16 ulps of the largest gradient.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from mok_compile import hf_blocks
from mok_compile.hf_blocks import add_expert_lora_, available, checkpoint_layers, init_moe_weights_
from tests.kernels.cases import generator, rel_err

from .helpers import BF16_GRAD_TOL, FAMILIES, NUM_LAYERS, assert_close_rel, forward, tiny_llama4, tiny_model, token_ids

AOT = {"compiler": "aot_eager"}
TOL = {torch.float32: dict(logits=2e-6, grads=1e-5), torch.bfloat16: dict(logits=0.0, grads=BF16_GRAD_TOL)}


def _check_step(model, dtype, train, aux_loss=False, device="cpu", tol=None):
    ids = token_ids().to(device)
    want_logits, want_loss, want_grads = forward(model, ids, train=train, aux_loss=aux_loss)
    got_logits, got_loss, got_grads = forward(model, ids, backend="mok", train=train, options=AOT, aux_loss=aux_loss)
    tol = tol or TOL[dtype]
    assert counters["mok"]["fused_moe"] == NUM_LAYERS, dict(counters["mok"])
    assert counters["mok"]["rejected_moe"] == 0, dict(counters["mok"])
    assert_close_rel(got_logits, want_logits, tol["logits"], "logits")
    if train:
        assert_close_rel(got_loss, want_loss, tol["logits"], "loss")
        assert got_grads.keys() == want_grads.keys()
        for name, want in want_grads.items():
            assert_close_rel(got_grads[name], want, tol["grads"], f"grad of {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_inference(family, dtype):
    _check_step(tiny_model(family, dtype), dtype, train=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_training(family, dtype):
    _check_step(tiny_model(family, dtype), dtype, train=True)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_training_with_router_aux_loss(family):
    """output_router_logits=True: the router logits leave the block (aux loss), the rewrite must keep them."""
    model = tiny_model(family, output_router_logits=True, router_aux_loss_coef=0.1)
    _check_step(model, torch.float32, train=True, aux_loss=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_llama4_dense_moe_fused(train, dtype):
    """Llama4's dense weight-on-input MoE: every layer fused (routing topk_sigmoid, weight_on_input), the shared
    expert and its in-place add of the routed sum left outside; logits, loss and every gradient as eager."""
    _check_step(tiny_llama4(dtype), dtype, train=train)


def _step_where_used(model, ids, fn):
    """(logits, loss, gradients) of one training step of `model` run by `fn`, as `forward` but with the gradients of
    the parameters that got one only (a model whose parts go unused at this size)."""
    model.zero_grad(set_to_none=True)
    model.train()
    out = fn(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {
        n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_deepseek_v4_trains_fused():
    """DeepSeek-V4 (transformers >= 5.25) with a hash-routed first layer (its table naming some expert twice in a
    row) and two learned-router layers: all three fused, the hash layer with its looked-up ids as the op's
    expert_ids; logits, loss and every gradient as eager's. In fp64 (batched_mm experts:
    grouped_mm has no fp64), where they agree to 1e-15: in fp32 its hyper-connections amplify rounding, and the
    gradient of one layer's `ffn_hc.scale` moved 6e-5 with the op's summation order (eager's own fp32 error there:
    7e-6; the op's blocks are checked in fp32 and bf16 in tests/ops and tests/passes). Its compile takes ~40 s."""
    pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from mok_compile.demo import make_causal_lm

    model = make_causal_lm("deepseek_v4", num_layers=3, dtype=torch.float64, mlp_layer_types=["hash_moe", "moe", "moe"])
    model.set_experts_implementation("batched_mm")
    with torch.no_grad():
        table = torch.randint(0, 8, (128, 2), generator=torch.Generator().manual_seed(0))
        table[::4, 1] = table[::4, 0]  # every fourth token id: one expert twice
        model.model.layers[0].mlp.gate.tid2eid.copy_(table)
    ids = token_ids()
    assert (table[ids.flatten(), 0] == table[ids.flatten(), 1]).any()

    # At 16 tokens the attention's compressor (and its weights) is not used.
    want_logits, want_loss, want_grads = _step_where_used(model, ids, model)
    got_logits, got_loss, got_grads = _step_where_used(model, ids, torch.compile(model, backend="mok", options=AOT))
    assert (counters["mok"]["fused_moe"], counters["mok"]["rejected_moe"]) == (3, 0), dict(counters["mok"])
    assert sum(".mlp.experts." in n or ".mlp.gate." in n for n in want_grads) == 9  # every layer's router and experts
    assert torch.equal(got_logits, want_logits) and torch.equal(got_loss, want_loss)
    # The compiled step gives zeros where eager gives None: the attention's compressor, on an empty slice at 16 tokens.
    assert want_grads.keys() <= got_grads.keys()
    assert all(not got_grads[n].any() for n in got_grads.keys() - want_grads.keys())
    for name, want in want_grads.items():
        err = ((got_grads[name] - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()
        assert err <= 1e-13, f"grad of {name}: relative max error {err:.3g}"


def test_axk2_trains_fused_keeping_its_selection():
    """AXK2 (transformers >= 5.25) with group-limited routing whose dropped groups are filled with 0, under a selection
    bias that makes kept choice values negative, so that dropped experts are picked: each layer fused with its
    selection kept in the graph (the op takes its ids); logits, loss and every gradient (the router's through the op's
    d(logits)) as eager's, in fp32."""
    if not available(["axk2"]):
        pytest.skip("AXK2 is in transformers from 5.25 on")
    from mok_compile.demo import make_causal_lm

    model = make_causal_lm("axk2", num_layers=NUM_LAYERS)
    model.set_experts_implementation("grouped_mm")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1 - 0.6)
    ids = token_ids()

    # The attention's indexer, which only selects keys, gets no gradient.
    want_logits, want_loss, want_grads = _step_where_used(model, ids, model)
    got_logits, got_loss, got_grads = _step_where_used(model, ids, torch.compile(model, backend="mok", options=AOT))
    assert (counters["mok"]["fused_moe"], counters["mok"]["rejected_moe"]) == (NUM_LAYERS, 0), dict(counters["mok"])
    assert sum(".mlp.experts." in n or ".mlp.gate." in n for n in want_grads) == 3 * NUM_LAYERS
    assert_close_rel(got_logits, want_logits, TOL[torch.float32]["logits"], "logits")
    assert_close_rel(got_loss, want_loss, TOL[torch.float32]["logits"], "loss")
    assert got_grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        assert_close_rel(got_grads[name], want, TOL[torch.float32]["grads"], f"grad of {name}")


def _lora_parametrized(model):
    assert add_expert_lora_(model) == NUM_LAYERS
    return model


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_parametrized_expert_weights_train_fused(family):
    """Expert weights computed in the graph from parameters (a LoRA delta registered with
    `torch.nn.utils.parametrize`): the computation stays in the graph and the op takes its result, so every layer
    fuses; logits, loss and every gradient (the original weights' and both LoRA factors') as eager's."""
    _check_step(_lora_parametrized(tiny_model(family)), torch.float32, train=True)


@pytest.mark.gpu
def test_parametrized_expert_weights_train_fused_on_the_gpu():
    """The same in bf16 on CUDA (the Triton kernels, whose few-token graphs read the computed weights at their
    addresses): within bf16 rounding of eager's step."""
    model = _lora_parametrized(tiny_model("qwen3_moe", torch.bfloat16)).cuda()
    _check_step(model, torch.bfloat16, train=True, device="cuda", tol=dict(logits=1e-2, grads=BF16_GRAD_TOL))


@pytest.mark.gpu
def test_compiled_lora_backward_frees_the_computed_weights(monkeypatch):
    """backend="mok" (inductor) on transformers' Qwen3-MoE block with a LoRA parametrization on both expert weights
    (computed each call, saved for the backward alone): the compiled backward frees them once read, so that a training
    step's peak memory is below what it is without (by one down weight at least) and not above eager HF's; the
    gradients as eager's, and the parameters intact (a second step gives the same gradients)."""
    from mok_compile.backend import mok_backend
    from mok_compile.passes import backward_consume

    monkeypatch.delenv("MOK_SPENT_WEIGHTS", raising=False)  # on by default
    sizes = hf_blocks.BlockSizes(hidden=512, intermediate=256, experts=32, top_k=4)
    block = hf_blocks.make_block("qwen3_moe", sizes, dtype=torch.bfloat16, device="cuda").train()
    hf_blocks.add_expert_lora_(block, rank=4)
    params = [p for p in block.parameters() if p.requires_grad]
    down_bytes = sizes.experts * sizes.hidden * sizes.intermediate * 2

    def step(fn, x):
        for p in params:
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn(x)
        (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, [p.grad.clone() for p in params]

    for T in (64, 600):  # a few-token graph's replay, and launch plans
        x = torch.randn(1, T, sizes.hidden, device="cuda", dtype=torch.bfloat16, generator=generator(T, "cuda"))
        step(block, x)
        eager_peak, want = step(block, x)
        peaks = {}
        for spend in (False, True):
            torch._dynamo.reset()
            before = counters["mok"]["spent_weights"]
            with torch._inductor.config.patch(fx_graph_cache=False), \
                    torch._functorch.config.patch(enable_autograd_cache=False), pytest.MonkeyPatch.context() as mp:
                if not spend:  # the same compile with no weight spent
                    mp.setattr(backward_consume, "_spent_weight", lambda value: False)
                compiled = torch.compile(block, backend=mok_backend)
                step(compiled, x)
            assert counters["mok"]["spent_weights"] == before + (2 if spend else 0)
            for _ in range(2):  # (the graph's capture, then its replay; plans record, then replay)
                step(compiled, x)
            peaks[spend], got = step(compiled, x)
            for a, b in zip(got, want):
                assert rel_err(a, b) < 2e-2
        assert peaks[True] <= peaks[False] - down_bytes, (T, peaks, eager_peak)
        assert peaks[True] <= eager_peak, (T, peaks, eager_peak)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemma4_trains_fused(dtype):
    """Gemma 4: each layer's router (on its own normalisation of the residual) and experts are separate modules,
    and the router multiplies the weights by a learned per-expert scale. Every layer fused, the scale as the op's
    expert_scale; logits, loss and every gradient (the scale's included) as eager's."""
    pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    model = tiny_model("gemma4", dtype)
    model.set_experts_implementation("grouped_mm")
    assert sum(n.endswith("per_expert_scale") for n, _ in model.named_parameters()) == NUM_LAYERS
    _check_step(model, dtype, train=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_longcat_flash_trains_fused(dtype):
    """LongCat-Flash: half as many zero-computation experts as experts (a token sent to one passes through,
    weighted), the op's identity_experts. Every layer's MoE block fused; logits, loss and every gradient as eager's."""
    if not available(["longcat_flash"]):
        pytest.skip("LongCat-Flash's experts take transformers' experts implementations from 5.25 on")
    model = tiny_model("longcat_flash", dtype)
    model.set_experts_implementation("grouped_mm")
    assert model.config.zero_expert_num == model.config.n_routed_experts // 2
    _check_step(model, dtype, train=True)


@pytest.mark.parametrize("train", [True, False], ids=["training", "inference"])
def test_zaya_fused(train):
    """Zaya (transformers >= 5.25): an MLP router on a projection of the tokens carried from layer to layer ranks the
    experts and a skip expert (the op's zero_experts; the logits, [batch, seq, E + 1], its router argument), and a
    residual scaling follows the block. Every layer fused; training in fp32, logits, loss and every gradient as
    eager's; inference in bf16, logits bitwise eager's. Some tokens choose the skip expert in each layer."""
    if not available(["zaya"]):
        pytest.skip("Zaya is in transformers from 5.25 on")
    dtype = torch.float32 if train else torch.bfloat16
    model = tiny_model("zaya", dtype)
    skipped, hooks = [], []
    for layer in model.model.layers:
        # A router that tells tokens apart (HF's init gives every token nearly the same logits), and a selection
        # bias that sends some to the skip expert (HF's -1 keeps every token off it).
        init_moe_weights_(layer.mlp.gate, std=0.3)
        layer.mlp.gate.balancing_biases.zero_()[-1] = 0.1
        hooks.append(layer.mlp.gate.register_forward_hook(
            lambda m, a, out: skipped.append(int((out[1] == 0).sum()))))  # a skip pair's weight is 0
    with torch.no_grad():
        model(token_ids())
    for hook in hooks:
        hook.remove()
    assert len(skipped) == NUM_LAYERS and all(0 < n < 32 for n in skipped), skipped
    _check_step(model, dtype, train=train)


def test_inkling2_trains_fused():
    """Inkling2 (transformers >= 5.25): an fp32 sigmoid router with a selection bias and the softcapped SwiGLU
    (`tanh(g / 4) * 4 * sigmoid(g) * tanh(u / 25) * 25`, the op's softcapped_swiglu), between its hybrid attention
    layers. Every layer's MoE block fused; logits, loss and every gradient as eager's (fp32)."""
    configuration = pytest.importorskip("transformers.models.inkling2.configuration_inkling2")
    import transformers

    config = configuration.Inkling2TextConfig(
        hidden_size=64, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8, num_local_experts=8,
        num_experts_per_tok=2, num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.set_experts_implementation("grouped_mm")
    _check_step(model, torch.float32, train=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_phimoe_inference_fused(dtype):
    """PhiMoE at inference: every layer's sparsemixer-routed block fused, logits as eager's."""
    _check_step(tiny_model("phimoe", dtype), dtype, train=False)


def test_phimoe_eval_mode_gradients_fused():
    """PhiMoE in eval mode with gradients (its sparsemixer then routes as at inference and autograd runs through
    it; the masks are computed under no_grad, which Dynamo writes as grad-mode switches around them): every layer
    fused, the loss and every gradient as eager's (fp32)."""
    model = tiny_model("phimoe")
    ids = token_ids()

    def step(fn):
        model.zero_grad(set_to_none=True)
        out = fn(ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_loss, want_grads = step(model)
    got_loss, got_grads = step(torch.compile(model, backend="mok", options=AOT))
    assert (counters["mok"]["fused_moe"], counters["mok"]["rejected_moe"]) == (NUM_LAYERS, 0), dict(counters["mok"])
    assert_close_rel(got_loss, want_loss, TOL[torch.float32]["logits"], "loss")
    assert got_grads.keys() == want_grads.keys() and sum(".router." in n for n in got_grads) == NUM_LAYERS
    for name, want in want_grads.items():
        assert_close_rel(got_grads[name], want, TOL[torch.float32]["grads"], f"grad of {name}")


def test_phimoe_training_left_unfused():
    """PhiMoE in training mode samples its routing at random: every layer's block left to eager's ops (reported;
    torch 2.11's Dynamo breaks its graphs there, so the rejected blocks come in more pieces), and the step runs."""
    model = tiny_model("phimoe").train()
    torch.compile(model, backend="mok", options=AOT)(token_ids(), labels=token_ids()).loss.backward()
    assert counters["mok"]["fused_moe"] == 0 and counters["mok"]["rejected_moe"] >= NUM_LAYERS, dict(counters["mok"])


def test_openai_privacy_filter_trains_fused():
    """OpenAI's privacy filter (an encoder; routing weights divided by top_k, the experts' sum multiplied by it after
    the block): every layer fused under backend="mok", its output and every parameter gradient as eager's (fp32)."""
    modeling = pytest.importorskip("transformers.models.openai_privacy_filter.modeling_openai_privacy_filter")
    config = modeling.OpenAIPrivacyFilterConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, vocab_size=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=1)
    grads = _check_encoder_step(init_moe_weights_(modeling.OpenAIPrivacyFilterModel(config), std=0.1))
    assert any("experts" in n for n in grads)


def _check_encoder_step(model):
    """An encoder (grouped_mm experts) under backend="mok": every layer fused, its output and every parameter
    gradient (of the output's mean square) as eager's (fp32). Returns the gradients."""
    model.set_experts_implementation("grouped_mm")
    ids = token_ids()

    def step(fn):
        model.zero_grad(set_to_none=True)
        out = fn(input_ids=ids).last_hidden_state
        out.square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_out, want_grads = step(model)
    got_out, got_grads = step(torch.compile(model, backend="mok", options=AOT))
    assert counters["mok"]["fused_moe"] == NUM_LAYERS and counters["mok"]["rejected_moe"] == 0, dict(counters["mok"])
    assert_close_rel(got_out, want_out, TOL[torch.float32]["logits"], "output")
    assert got_grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        assert_close_rel(got_grads[name], want, TOL[torch.float32]["grads"], f"grad of {name}")
    return got_grads


def test_jetmoe_trains_fused_with_scalar_outputs_captured():
    """JetMoE: its MoE block reads each expert's token count back to the host (`.tolist()`) to split the sorted
    rows. With torch._dynamo.config.capture_scalar_outputs = True the block stays in one graph: every layer's MoE
    fused, its attention experts (MoA: the router's experts project heads, not an MLP) reported and left as they
    are; logits, loss and every gradient as eager's (fp32)."""
    modeling = pytest.importorskip("transformers.models.jetmoe.modeling_jetmoe")
    config = modeling.JetMoeConfig(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                   kv_channels=16, num_key_value_heads=4, num_hidden_layers=NUM_LAYERS, vocab_size=128,
                                   max_position_embeddings=256)
    model = init_moe_weights_(modeling.JetMoeForCausalLM(config), std=0.1)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        want_logits, want_loss, want_grads = forward(model, token_ids(), train=True)
        got_logits, got_loss, got_grads = forward(model, token_ids(), backend="mok", train=True, options=AOT)
    assert counters["mok"]["fused_moe"] == NUM_LAYERS, dict(counters["mok"])
    assert counters["mok"]["rejected_moe"] == NUM_LAYERS, dict(counters["mok"])  # the attention experts
    assert_close_rel(got_logits, want_logits, TOL[torch.float32]["logits"], "logits")
    assert_close_rel(got_loss, want_loss, TOL[torch.float32]["logits"], "loss")
    assert got_grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        assert_close_rel(got_grads[name], want, TOL[torch.float32]["grads"], f"grad of {name}")


def test_diffusion_gemma_encoder_trains_fused():
    """DiffusionGemma's encoder text model (transformers >= 5.25): Gemma 4's router (on its own normalisation, a
    per-expert weight scale) and experts in each layer. Every layer fused; its output and every parameter gradient
    (the scale's included) as eager's (fp32)."""
    modeling = pytest.importorskip("transformers.models.diffusion_gemma.modeling_diffusion_gemma")
    config = modeling.DiffusionGemmaConfig().text_config
    for name, value in dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                            top_k_experts=2, num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, vocab_size=128, hidden_size_per_layer_input=0, sliding_window=32).items():
        setattr(config, name, value)
    grads = _check_encoder_step(init_moe_weights_(modeling.DiffusionGemmaEncoderTextModel(config), std=0.1))
    assert sum(n.endswith("per_expert_scale") for n in grads) == NUM_LAYERS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_muse_spark_trains_fused(dtype):
    """Muse Spark's text model (transformers >= 5.25; it has no CausalLM): each layer's router scales its logits and
    its experts run on the tokens projected and normalised (the logits are the op's router argument), and normalise
    each output row with an input-scaled RMSNorm (the op's scaled_rms). Every layer fused; its output and every
    gradient (the post-norm weights' included) as eager's."""
    modeling = pytest.importorskip("transformers.models.muse_spark.modeling_muse_spark")
    from mok_compile.hf_blocks import init_moe_weights_, make_config

    model = init_moe_weights_(modeling.MuseSparkTextModel(make_config("muse_spark", num_layers=NUM_LAYERS)), std=0.1)
    model = model.to(dtype)
    model.set_experts_implementation("grouped_mm")
    ids = token_ids()

    def step(fn):
        model.zero_grad(set_to_none=True)
        model.train()
        out = fn(ids).last_hidden_state
        out.float().square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_out, want_grads = step(model)
    got_out, got_grads = step(torch.compile(model, backend="mok", options=AOT))
    assert counters["mok"]["fused_moe"] == NUM_LAYERS and counters["mok"]["rejected_moe"] == 0, dict(counters["mok"])
    assert_close_rel(got_out, want_out, TOL[dtype]["logits"], "output")
    assert got_grads.keys() == want_grads.keys()
    assert sum(n.endswith("post_expert_norm.weight") for n in got_grads) == NUM_LAYERS
    for name, want in want_grads.items():
        assert_close_rel(got_grads[name], want, TOL[dtype]["grads"], f"grad of {name}")


def _tiny_ergo(dtype):
    """Ergo (transformers >= 5.25), every layer MoE, its per-expert post-norm weights drawn away from their ones, its
    routers kept in fp32 as HF keeps them in a 16-bit model (each rounds its weight to 16 bits for its GEMM)."""
    if not available(["ergo"]):
        pytest.skip("Ergo comes with transformers 5.25")
    model = tiny_model("ergo", dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("post_expert_norm.weight"):
                p.uniform_(0.5, 1.5)
    for layer in model.model.layers:
        layer.mlp.gate.float()
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ergo_trains_fused(dtype):
    """Ergo: each route's rows normalised with its expert's row of an [E, H] weight (the op's rms) before the routing
    weights, which in bf16 it rounds to bf16 and widens again (the op's round_weights). Every layer fused; logits,
    loss and every gradient (the post-norm weights' included) as eager's."""
    model = _tiny_ergo(dtype)
    _check_step(model, dtype, train=True)
    if dtype == torch.bfloat16:  # the fp32 router weights' gradients come through their rounding to bf16, as HF's do
        grads = [layer.mlp.gate.linear.weight.grad for layer in model.model.layers]
        assert all(g.dtype == torch.float32 and torch.equal(g.bfloat16().float(), g) for g in grads)


@pytest.fixture
def dynamo_traces_checkpoints():
    """transformers' hub-kernel layers set a context variable inside each checkpointed layer, a side effect on which
    Dynamo gives the region up (and runs it eagerly) unless told that the backward need not replay it."""
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        yield


@pytest.mark.usefixtures("dynamo_traces_checkpoints")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_training_checkpointed(family, dtype):
    """Every decoder layer checkpointed: each MoE block is fused inside its layer's checkpointed region, and the
    loss and every gradient are eager's (which runs each layer twice as well)."""
    model = tiny_model(family, dtype)
    checkpoint_layers(model)
    _check_step(model, dtype, train=True)


@pytest.mark.usefixtures("dynamo_traces_checkpoints")
def test_training_checkpointed_reentrant():
    model = tiny_model("qwen3_moe")
    checkpoint_layers(model, reentrant=True)
    _check_step(model, torch.float32, train=True)


@pytest.mark.gpu
@pytest.mark.usefixtures("dynamo_traces_checkpoints")
def test_training_checkpointed_on_cuda_with_inductor():
    """fp32 on the GPU (in bf16, inductor's own rounding of the rest of the layer moves these tiny gradients by ~10%
    from eager's, with or without the op), inductor, every layer checkpointed: each block fused; the forward runs the
    inference op (its saved tensors would go unread: passes.unsaved_forward) and the backward the training op again;
    logits, loss and every gradient as eager's."""
    model = tiny_model("qwen3_moe").cuda()
    checkpoint_layers(model)
    ids = token_ids().cuda()
    want_logits, want_loss, want_grads = forward(model, ids, train=True)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        got_logits, got_loss, got_grads = forward(model, ids, backend="mok", train=True)
    assert counters["mok"]["fused_moe"] == NUM_LAYERS and counters["mok"]["unsaved_forward"] == NUM_LAYERS, \
        dict(counters["mok"])
    assert_close_rel(got_logits, want_logits, 1e-4, "logits")
    assert_close_rel(got_loss, want_loss, 1e-5, "loss")
    for name, want in want_grads.items():
        assert_close_rel(got_grads[name], want, 1e-3, f"grad of {name}")


@pytest.mark.parametrize("weights", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_training_under_autocast(family, weights):
    """bf16 autocast around a bf16 model, or around an fp32 one (HF Trainer's `bf16=True`: the router's linear in
    bf16, left in the graph, and the experts in fp32, the op's round_weights_to): each block fused, the step as eager's
    under the same autocast."""
    model = tiny_model(family, weights)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _check_step(model, torch.bfloat16, train=True)


def test_near_miss_bmm_experts_on_fp32_weights_under_autocast_are_left_unfused_and_say_why(caplog):
    """fp32 weights under bf16 autocast with transformers' batched_mm experts, whose bmm's autocast runs in bf16: the
    op runs fp32 experts on fp32 weights, so nothing is fused, the logits are eager's, and the warning tells the user
    what to do."""
    model, ids = tiny_model("qwen3_moe"), token_ids()
    model.set_experts_implementation("batched_mm")
    with torch.autocast("cpu", dtype=torch.bfloat16), caplog.at_level("WARNING", logger="mok_compile"):
        want, _, _ = forward(model, ids)
        got, _, _ = forward(model, ids, backend="mok", options=AOT)
    assert counters["mok"]["fused_moe"] == 0 and counters["mok"]["rejected_moe"] == NUM_LAYERS
    assert "autocast (cpu, bfloat16) is on around this block" in caplog.text
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_training_under_cuda_autocast(weights):
    """CUDA's autocast casts more ops than the CPU's (softmax and sums to fp32): bf16 or fp32 weights under it, each
    block fused, the step within bf16 rounding of eager's under the same autocast."""
    model = tiny_model("qwen3_moe", weights).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _check_step(model, torch.bfloat16, train=True, device="cuda", tol=dict(logits=1e-2, grads=BF16_GRAD_TOL))
