"""PEFT's LoRA on expert weights (`LoraConfig(target_parameters=...)`) through `backend="mok"` (aot_eager inner
compiler): traced in one graph with its router (`mok_compile.peft_experts`), every MoE layer fused, logits, loss and
every gradient (PEFT's LoRA factors') as PEFT's eager step. Near misses: PEFT's own forward (`MOK_TRACE_PEFT=0`)
breaks the graph and fuses nothing; adapters disabled run the base model, fused as it is."""

import pytest
import torch
from torch._dynamo.utils import counters

from mok_compile import peft_experts
from mok_compile.hf_blocks import checkpoint_layers

from .helpers import BF16_GRAD_TOL, NUM_LAYERS, assert_close_rel, forward, tiny_llama4, tiny_model, token_ids
from .test_hf_models import AOT, TOL, _check_step

peft = pytest.importorskip("peft")

TARGETS = {"qwen3_moe": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
           "gpt_oss": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
           "mixtral": ["mlp.experts.down_proj"],
           "llama4": ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]}


def lora_model(family, dtype=torch.float32, adapters=("default",), modules=()):
    """A tiny CausalLM of `family` with PEFT LoRA (rank 4, random B so that the delta is not 0) on its expert weights
    and on the linear layers named in `modules`, every adapter in `adapters` active."""
    model = tiny_llama4(dtype) if family == "llama4" else tiny_model(family, dtype)
    config = dict(r=4, lora_alpha=8, target_modules=list(modules), target_parameters=TARGETS[family],
                  init_lora_weights=False)
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(**config), adapter_name=adapters[0])
    for name in adapters[1:]:
        model.add_adapter(name, peft.LoraConfig(**config))
    model.base_model.set_adapter(list(adapters))
    return model


@pytest.fixture(autouse=True)
def _installed():
    """`backend="mok"`'s import installed the traced forward once PEFT was imported; the tests start from that."""
    assert peft_experts.install()
    yield
    peft_experts.install()  # (after a test's monkeypatch has put the environment back)


@pytest.mark.parametrize("family,dtype", [("qwen3_moe", torch.float32), ("gpt_oss", torch.float32),
                                          ("mixtral", torch.float32), ("llama4", torch.float32),
                                          ("qwen3_moe", torch.bfloat16)],
                         ids=["qwen3_moe-fp32", "gpt_oss-fp32", "mixtral-fp32", "llama4-fp32", "qwen3_moe-bf16"])
def test_peft_expert_lora_trains_fused(family, dtype):
    """One graph, no break; each layer's LoRA'd experts fused with their router (gate_up and down, or down alone);
    logits, loss and the gradient of every LoRA factor as PEFT's eager step (`_check_step` counts the fused
    blocks and asserts none rejected)."""
    model = lora_model(family, dtype)
    assert sum(p.requires_grad for p in model.parameters()) == 2 * NUM_LAYERS * len(TARGETS[family])
    _check_step(model, dtype, train=True, tol=None if dtype == torch.float32 else dict(logits=0.0,
                                                                                       grads=BF16_GRAD_TOL))
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_lora_on_the_router_weight_too_trains_fused():
    """LoRA on the router's weight as well (`target_parameters` takes a 2-D weight: one more ParamWrapper around the
    router, not the experts): the traced forward computes it too, the op takes the computed router weight; fused, every
    factor's gradient as eager's."""
    model = tiny_model("qwen3_moe")
    torch.manual_seed(1)
    targets = ["mlp.gate.weight", *TARGETS["qwen3_moe"]]
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_parameters=targets,
                                                       init_lora_weights=False))
    assert sum(p.requires_grad for p in model.parameters()) == 2 * NUM_LAYERS * 3
    _check_step(model, torch.float32, train=True)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_two_active_adapters_train_fused():
    """Two adapters active at once: PEFT sums their deltas onto the weight (its other proxy); fused, as eager."""
    _check_step(lora_model("qwen3_moe", adapters=("default", "second")), torch.float32, train=True)


def test_lora_on_attention_and_experts_trains_fused():
    """The usual fine-tuning config: LoRA on attention projections (PEFT's LoRA Linear, which Dynamo traces as it is)
    beside the experts' weights: one graph, every layer fused, every factor's gradient as eager's."""
    model = lora_model("qwen3_moe", modules=("q_proj", "v_proj"))
    assert sum(p.requires_grad for p in model.parameters()) == 2 * NUM_LAYERS * 4
    _check_step(model, torch.float32, train=True)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_checkpointed_layers_train_fused():
    """Every decoder layer activation-checkpointed (Dynamo traces the regions, `hf_blocks.checkpoint_layers`): the
    traced forward runs inside each region's body, every layer fused, gradients as eager's. (PEFT's hook that makes
    the embeddings' output require grad for checkpointing still breaks the graph, outside the blocks.)"""
    model = lora_model("qwen3_moe")
    checkpoint_layers(model.base_model.model)
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        _check_step(model, torch.float32, train=True)


def test_peft_forward_breaks_the_graph_and_fuses_nothing(monkeypatch):
    """Near miss: PEFT's own forward (MOK_TRACE_PEFT=0) registers its parametrization in each call: Dynamo breaks the
    graph there, the experts arrive without their router and no block fuses; the step is still PEFT's."""
    model = lora_model("qwen3_moe")
    monkeypatch.setenv("MOK_TRACE_PEFT", "0")
    peft_experts.install()  # (what the backend's lookup does)
    assert not hasattr(peft.tuners.lora.layer.ParamWrapper.forward, "peft_forward")
    ids = token_ids()
    want = forward(model, ids, train=True)
    got = forward(model, ids, backend="mok", train=True, options=AOT)
    assert counters["mok"]["fused_moe"] == 0 and counters["graph_break"], dict(counters["mok"])
    assert not hasattr(peft.tuners.lora.layer.ParamWrapper.forward, "peft_forward")
    assert_close_rel(got[0], want[0], TOL[torch.float32]["logits"], "logits")


def test_switch_off_leaves_peft_as_it_is(monkeypatch):
    """MOK_TRACE_PEFT=0: PEFT's class as it was, from the next install on."""
    monkeypatch.setenv("MOK_TRACE_PEFT", "0")
    assert not peft_experts.install()
    assert not hasattr(peft.tuners.lora.layer.ParamWrapper.forward, "peft_forward")
    monkeypatch.delenv("MOK_TRACE_PEFT")
    assert peft_experts.install() and peft_experts.install()  # idempotent
    assert not hasattr(peft.tuners.lora.layer.ParamWrapper.forward.peft_forward, "peft_forward")


def test_adapters_disabled_run_the_base_model_fused():
    """Near miss of the traced forward: with the adapters disabled, PEFT's forward calls the experts as they are
    (no LoRA weight, no graph break): fused, the base model's logits."""
    model = lora_model("qwen3_moe")
    ids = token_ids()
    with model.disable_adapter():
        want = forward(model, ids)
        got = forward(model, ids, backend="mok", options=AOT)
    assert counters["mok"]["fused_moe"] == NUM_LAYERS and not counters["graph_break"]
    assert_close_rel(got[0], want[0], TOL[torch.float32]["logits"], "logits")
    with_lora = forward(model, ids)[0]
    assert (with_lora - want[0]).abs().max() > 1e-3  # (the adapters do change the logits)


def test_merged_adapters_run_the_merged_model_fused():
    """Adapters merged into the weights (`merge_adapter()`): PEFT's forward calls the experts as they are, fused, the
    merged model's logits (within fp32 rounding of the unmerged adapters')."""
    model = lora_model("qwen3_moe")
    ids = token_ids()
    unmerged = forward(model, ids)[0]
    model.base_model.merge_adapter()
    want = forward(model, ids)
    got = forward(model, ids, backend="mok", options=AOT)
    assert counters["mok"]["fused_moe"] == NUM_LAYERS and not counters["graph_break"]
    assert_close_rel(got[0], want[0], TOL[torch.float32]["logits"], "logits")
    assert_close_rel(want[0], unmerged, 1e-5, "merged logits")


def test_eager_calls_run_peft_forward():
    """Outside a compile the installed forward is PEFT's: the same logits bit for bit as with it uninstalled."""
    model = lora_model("qwen3_moe")
    ids = token_ids()
    installed = forward(model, ids)[0]
    peft_experts.uninstall()
    assert torch.equal(forward(model, ids)[0], installed)


@pytest.mark.gpu
def test_peft_expert_lora_trains_fused_on_the_gpu():
    """The same in bf16 on CUDA (the Triton kernels on weights PEFT's proxy computes in the graph): within bf16
    rounding of PEFT's eager step."""
    model = lora_model("qwen3_moe", torch.bfloat16).cuda()
    _check_step(model, torch.bfloat16, train=True, device="cuda", tol=dict(logits=1e-2, grads=BF16_GRAD_TOL))
    assert not counters["graph_break"], dict(counters["graph_break"])
