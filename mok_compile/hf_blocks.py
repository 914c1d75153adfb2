"""Tiny Hugging Face MoE blocks with random weights, and their `mok.fused_moe` arguments.

Used by tests, benchmarks and the demo to compare the op against transformers'
own modules. The family -> spec table below is written by hand from the HF
sources; the compiler pass never uses it (it reads the graph's structure).
Needs `transformers` (the `test` extra).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .ops.spec import ExpertSpec, RoutingSpec


@dataclass(frozen=True)
class BlockSizes:
    hidden: int = 64
    intermediate: int = 32
    experts: int = 8
    top_k: int = 2


FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "granitemoe", "ernie4_5_moe")
# Families whose block the op covers with weight_on_input=True (the routing weight scales the expert's input:
# Llama4's dense MoE, where every expert runs on every token and unrouted ones get a zero input). Kept apart
# from FAMILIES, whose tests exercise transformers' experts_implementation forms (grouped_mm, batched_mm):
# Llama4's experts are plain bmm's; its own pass and backend tests cover it.
WEIGHT_ON_INPUT_FAMILIES = ("llama4",)
# DeepSeek-V2's block (group-limited greedy routing: groups ranked by their largest probability) for the pass tests
# and the layer benchmark; its tiny models' MLA attention does not trace in the backend tests.
OTHER_FAMILIES = ("deepseek_v2",)
# Families the op covers at inference only: PhiMoE's sparsemixer samples its routing at random in training (the
# op computes its inference form), so its training step is eager's own and stays unfused.
INFERENCE_FAMILIES = ("phimoe",)
ALL_FAMILIES = FAMILIES + WEIGHT_ON_INPUT_FAMILIES + OTHER_FAMILIES + INFERENCE_FAMILIES
# Families of transformers newer than the oldest supported (5.17), kept out of ALL_FAMILIES: DeepSeek-V4 (5.25),
# whose learned-router layers (past its hash-routed ones) the op fuses, and Inkling2 (5.25: its softcapped SwiGLU).
NEWER_FAMILIES = ("deepseek_v4", "inkling2")
# LongCat-Flash: its router ranks its experts and half as many zero-computation experts again (the op's
# `identity_experts`: a token sent to one passes through, weighted). Its own pass, backend and layer-benchmark
# entries; its tiny models' MLA attention has a shape of its own. Its experts take transformers' experts
# implementations (grouped_mm) from 5.25 on; 5.17's loop over them calls `.item()` (no whole graph).
IDENTITY_FAMILIES = ("longcat_flash",)
# Zaya (transformers 5.25): an MLP router on a projection of the tokens (carried from layer to layer) ranks the
# experts and a skip expert, which adds nothing (the op's `zero_experts`); its logits, [batch, seq, E + 1], are the
# op's router argument. Whole models (`make_causal_lm`) and its block in the pass tests.
ZERO_FAMILIES = ("zaya",)
# The first transformers whose form of a family the op and the pass cover, where it is not the oldest supported.
_SINCE = {"longcat_flash": (5, 25), "zaya": (5, 25), "axk2": (5, 25)}
# Families whose router and experts are separate modules of the decoder layer, with no MoE block class: whole models
# only (`make_causal_lm`). Gemma 4 (its router's per-expert weight scale is the op's `expert_scale`).
LAYER_FAMILIES = ("gemma4",)
# Families whose experts normalise each output row before its routing weight (the op's post_norm; transformers 5.25):
# Muse Spark (an input-scaled RMSNorm; its router's logits are scaled and its experts run on a projection of the
# tokens, so the logits are the op's router argument) and Ergo (an RMSNorm per expert; in bf16 its routing weights are
# rounded to bf16 and widened again: the op's round_weights). Blocks and text models.
POST_NORM_FAMILIES = ("muse_spark", "ergo")
# Families whose top-k the op cannot compute, fused with the selection kept in the graph (the op takes its ids,
# `passes.region.kept_selection_anchor`): AXK2 (transformers 5.25) fills the groups its group-limited selection drops
# with 0 under a selection bias. Whole models, the pass tests and `benchmarks.compiled_blocks`; the op alone cannot
# be called on its block (tests/ops, `benchmarks.moe_layer`).
KEPT_SELECTION_FAMILIES = ("axk2",)
# Families whose router HF keeps in fp32 in a bf16 model (`_keep_in_fp32_modules_strict`), selection bias included.
FP32_ROUTER_FAMILIES = ("deepseek_v3", "ernie4_5_moe", "deepseek_v2", "inkling2", "ergo", "axk2")
# Families whose selection bias alone HF keeps in fp32 in a bf16 model.
FP32_SELECTION_BIAS_FAMILIES = ("deepseek_v4",)


def available(families) -> tuple:
    """Those of `families` that this transformers has, in the form the op covers (`_SINCE`)."""
    import importlib.util

    import transformers

    version = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    return tuple(f for f in families if importlib.util.find_spec(f"transformers.models.{f}") is not None
                 and version >= _SINCE.get(f, (0, 0)))


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError("mok_compile.hf_blocks needs transformers: pip install 'mok-compile[test]'") from err


def make_config(family: str, sizes: BlockSizes = BlockSizes(), num_layers: int = 2, **overrides):
    """A tiny config of `family` (a transformers model type) with the given MoE sizes."""
    _require_transformers()
    import transformers as tf

    H, I, E, K = sizes.hidden, sizes.intermediate, sizes.experts, sizes.top_k
    common = dict(hidden_size=H, num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=128, max_position_embeddings=256, num_experts_per_tok=K)
    if family == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=I, num_local_experts=E, **common)
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(intermediate_size=2 * I, moe_intermediate_size=I, shared_expert_intermediate_size=I,
                                num_experts=E, norm_topk_prob=False, **common)
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(intermediate_size=2 * I, moe_intermediate_size=I, num_experts=E, norm_topk_prob=True,
                                head_dim=H // 4, **common)
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(intermediate_size=I, num_experts=E, norm_topk_prob=False, **common)
    elif family == "deepseek_v3":
        cfg = tf.DeepseekV3Config(intermediate_size=2 * I, moe_intermediate_size=I, n_routed_experts=E,
                                  n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                  norm_topk_prob=True, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16,
                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                  # MLA has as many key/value heads as query heads; fewer breaks dynamic shapes
                                  **{**common, "num_key_value_heads": common["num_attention_heads"]})
    elif family == "deepseek_v2":
        cfg = tf.DeepseekV2Config(intermediate_size=2 * I, moe_intermediate_size=I, n_routed_experts=E,
                                  n_shared_experts=1, topk_method="group_limited_greedy", n_group=4, topk_group=1,
                                  routed_scaling_factor=2.5, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16,
                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                  **{**common, "num_key_value_heads": common["num_attention_heads"]})
    elif family == "gpt_oss":
        cfg = tf.GptOssConfig(intermediate_size=I, num_local_experts=E, head_dim=H // 4, sliding_window=64,
                              layer_types=["sliding_attention", "full_attention"][:num_layers] * max(1, num_layers // 2),
                              **common)
    elif family == "granitemoe":
        cfg = tf.GraniteMoeConfig(intermediate_size=I, num_local_experts=E, **common)
    elif family == "ernie4_5_moe":
        # Every layer MoE, one shared expert (outside the op); moe_k / moe_num_experts are what the aliases set.
        cfg = tf.Ernie4_5_MoeConfig(intermediate_size=2 * I, moe_intermediate_size=I, moe_num_experts=E,
                                    moe_num_shared_experts=1, moe_layer_start_index=0, **common)
    elif family == "deepseek_v4":
        # Its experts and shared expert both take intermediate_size; every layer routed by its learned router.
        cfg = tf.DeepseekV4Config(intermediate_size=I, moe_intermediate_size=I, num_local_experts=E,
                                  mlp_layer_types=["moe"] * num_layers, **common)
    elif family == "gemma4":
        # Every layer has a dense MLP (intermediate_size) beside the routed experts; tied embeddings, no per-layer
        # inputs.
        cfg = tf.Gemma4TextConfig(intermediate_size=2 * I, moe_intermediate_size=I, num_experts=E, top_k_experts=K,
                                  enable_moe_block=True, head_dim=H // 4, hidden_size_per_layer_input=0,
                                  layer_types=["sliding_attention", "full_attention"] * (num_layers // 2)
                                  + ["full_attention"] * (num_layers % 2),
                                  sliding_window=32, pad_token_id=0, **common)
    elif family == "inkling2":
        # An fp32 sigmoid router with a selection bias; its softcapped SwiGLU (caps 4 and 25). Its config maps
        # intermediate_size onto moe_intermediate_size (one size for both): only the latter is given.
        cfg = tf.Inkling2TextConfig(moe_intermediate_size=I, n_routed_experts=E, num_local_experts=E, **common)
    elif family == "longcat_flash":
        # Half as many zero-computation experts as experts (LongCat-Flash: 512 and 256), its routed scale 6; each
        # layer holds two attention sublayers, two dense MLPs (ffn_hidden_size) and one MoE block.
        cfg = tf.LongcatFlashConfig(
            hidden_size=H, ffn_hidden_size=2 * I, expert_ffn_hidden_size=I, n_routed_experts=E,
            zero_expert_num=max(1, E // 2), moe_topk=K, routed_scaling_factor=6.0, num_layers=num_layers,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, head_dim=8, v_head_dim=16, vocab_size=128, max_position_embeddings=256)
    elif family == "zaya":
        # One skip expert past the experts (Zaya1: 16 and top-1, the only top-k ZayaConfig takes); its router's MLP
        # at router_hidden_size.
        cfg = tf.ZayaConfig(moe_intermediate_size=I, num_experts=E, router_hidden_size=H // 2, head_dim=H // 4,
                            pad_token_id=0, bos_token_id=None, eos_token_id=None,
                            **{**common, "num_experts_per_tok": 1})
    elif family == "muse_spark":
        # Its experts run at moe_hidden_size (the block projects the tokens down to it and back up).
        cfg = tf.MuseSparkTextConfig(intermediate_size=2 * I, moe_intermediate_size=I, moe_hidden_size=3 * H // 4,
                                     num_local_experts=E, head_dim=H // 4, sliding_window=32, bos_token_id=None,
                                     eos_token_id=None, **common)
    elif family == "ergo":
        # Every layer MoE (no leading dense layers), a shared expert of size I.
        cfg = tf.ErgoConfig(moe_intermediate_size=I, shared_intermediate_size=I, first_dense_intermediate_size=2 * I,
                            num_dense_blocks=0, num_experts=E, head_dim=H // 4, sliding_window=32, **common)
    elif family == "axk2":
        # Group-limited selection (4 groups, the best 2 unless overridden), MLA and a sparse-attention indexer at tiny
        # sizes, every layer sparse, one shared expert (outside the op).
        cfg = tf.AXK2Config(
            hidden_size=H, intermediate_size=2 * I, moe_intermediate_size=I, n_routed_experts=E, n_group=4,
            topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, num_hidden_layers=num_layers,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, head_dim=8, index_topk=8, index_head_dim=16, index_n_heads=2,
            mlp_layer_types=["sparse"] * num_layers, vocab_size=128, max_position_embeddings=256,
            num_experts_per_tok=K, bos_token_id=1, eos_token_id=2)
    elif family == "phimoe":
        # Its sparsemixer's threshold 2 * router_jitter_noise at 0.1 rather than PhiMoE's 0.01, so that each round's
        # softmax keeps some other experts (and the router a gradient) at tiny random weights, and drops others.
        cfg = tf.PhimoeConfig(intermediate_size=I, num_local_experts=E, router_jitter_noise=0.1, input_jitter_noise=0.0,
                              **common)
    elif family == "llama4":
        # Text-only (Llama4ForCausalLM), every layer MoE (gated shared expert of size I, outside the op);
        # dense layers (none here) would use intermediate_size_mlp.
        cfg = tf.Llama4TextConfig(intermediate_size=I, intermediate_size_mlp=2 * I, num_local_experts=E,
                                  head_dim=H // 4, interleave_moe_layer_step=1, moe_layers=list(range(num_layers)),
                                  no_rope_layers=[1] * num_layers, attention_chunk_size=64, **common)
    else:
        known = (ALL_FAMILIES + NEWER_FAMILIES + LAYER_FAMILIES + IDENTITY_FAMILIES + ZERO_FAMILIES + POST_NORM_FAMILIES
                 + KEPT_SELECTION_FAMILIES)
        raise ValueError(f"unknown family {family!r}; choose from {known}")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def new_block(family: str, cfg):
    """`family`'s MoE block built from `cfg` (DeepSeek-V4's takes its layer's index: the last one, past the
    hash-routed layers; Zaya's too: the first, whose router reads no previous layer's router states)."""
    if family == "deepseek_v4":
        return _block_class(family)(cfg, layer_idx=cfg.num_hidden_layers - 1)
    if family == "zaya":
        return _block_class(family)(cfg, layer_idx=0)
    return _block_class(family)(cfg)


def keep_fp32_parts_(family: str, block):
    """Put back in fp32 what HF keeps in fp32 in a 16-bit model: the router (`FP32_ROUTER_FAMILIES`) or the
    selection bias (`FP32_SELECTION_BIAS_FAMILIES`; a hash-routed DeepSeek-V4 block's router has none)."""
    if family in FP32_ROUTER_FAMILIES:
        block.gate.float()
    elif family in FP32_SELECTION_BIAS_FAMILIES and hasattr(block.gate, "e_score_correction_bias"):
        block.gate.e_score_correction_bias = block.gate.e_score_correction_bias.float()
    return block


def _block_class(family: str):
    import importlib

    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    names = {
        "mixtral": "MixtralSparseMoeBlock",
        "qwen2_moe": "Qwen2MoeSparseMoeBlock",
        "qwen3_moe": "Qwen3MoeSparseMoeBlock",
        "olmoe": "OlmoeSparseMoeBlock",
        "deepseek_v3": "DeepseekV3MoE",
        "axk2": "AXK2MoE",
        "gpt_oss": "GptOssMLP",
        "granitemoe": "GraniteMoeMoE",
        "llama4": "Llama4TextMoe",
        "ernie4_5_moe": "Ernie4_5_MoeSparseMoeBlock",
        "deepseek_v2": "DeepseekV2Moe",
        "deepseek_v4": "DeepseekV4SparseMoeBlock",
        "longcat_flash": "LongcatFlashMoE",
        "inkling2": "Inkling2SparseMoeBlock",
        "phimoe": "PhimoeSparseMoeBlock",
        "muse_spark": "MuseSparkMoE",
        "ergo": "ErgoMoE",
        "zaya": "ZayaSparseMoeBlock",
    }
    return getattr(mod, names[family])


def checkpoint_layers(model, reentrant: bool = False) -> None:
    """transformers' activation checkpointing of every decoder layer (`activation_checkpointing_enable` from 5.25 on,
    `gradient_checkpointing_enable` before). Under torch.compile, transformers' hub-kernel layers set a context
    variable inside each checkpointed layer, on which Dynamo gives the region up unless
    `torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint` is set (`mok_compile.explain` says so)."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def init_moe_weights_(module: torch.nn.Module, std: float = 0.02, seed: int = 0):
    """Random weights for every parameter and float buffer (HF leaves some at torch.empty)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if not p.is_floating_point():
                continue
            scale = 0.1 if name.endswith("e_score_correction_bias") else std
            p.copy_((torch.randn(p.shape, generator=gen) * scale).to(p.dtype))
    return module


class LoraDelta(torch.nn.Module):
    """A LoRA delta on stacked expert weights [E, rows, cols] as a parametrization: W + B @ A per expert, with
    factors A [E, rank, cols] and B [E, rows, rank] drawn at `std` (B too, unlike LoRA's zeros, so that the delta
    and every gradient are non-zero), in W's dtype and on its device."""

    def __init__(self, weight: torch.Tensor, rank: int, std: float, generator: torch.Generator):
        super().__init__()
        E, rows, cols = weight.shape

        def draw(*shape):
            return torch.nn.Parameter((torch.randn(*shape, generator=generator) * std).to(weight.device, weight.dtype))

        self.A, self.B = draw(E, rank, cols), draw(E, rows, rank)

    def forward(self, weight):
        return weight + self.B @ self.A


def add_expert_lora_(module: torch.nn.Module, rank: int = 4, std: float = 0.1, seed: int = 0) -> int:
    """Registers a `LoraDelta` (`torch.nn.utils.parametrize`) on both stacked weights (`gate_up_proj`, `down_proj`) of
    every experts module in `module`, as parametrization-based LoRA fine-tuning does; returns how many modules."""
    from torch.nn.utils import parametrize

    gen = torch.Generator().manual_seed(seed)
    experts = [m for m in module.modules() if isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter)
               and getattr(m, "gate_up_proj").dim() == 3]
    for m in experts:
        for name in ("gate_up_proj", "down_proj"):
            parametrize.register_parametrization(m, name, LoraDelta(getattr(m, name), rank, std, gen))
    return len(experts)


def make_block(family: str, sizes: BlockSizes = BlockSizes(), dtype=torch.float32, device="cpu",
               experts_implementation: str = "grouped_mm", seed: int = 0):
    """One transformers MoE block of `family` with random weights, in eval mode."""
    cfg = make_config(family, sizes)
    cfg._experts_implementation = experts_implementation
    block = new_block(family, cfg)
    init_moe_weights_(block, seed=seed)
    return keep_fp32_parts_(family, block.to(device=device, dtype=dtype).eval())


def routed_parts(family: str, block):
    """(router module, experts module, RoutingSpec, ExpertSpec) of an HF block; shared experts stay outside."""
    cfg = block.experts.config if hasattr(block.experts, "config") else None
    K = getattr(cfg, "num_experts_per_tok", None)
    if family == "llama4":
        # Llama4Router: topk on the logits, sigmoid of the chosen ones in fp32 cast back to the model dtype;
        # the score multiplies the expert's input. Experts [E, H, 2I] / [E, I, H], up * silu(gate).
        spec = RoutingSpec(top_k=block.top_k, routing="topk_sigmoid", softmax_fp32=True, weights_fp32=False,
                           weight_on_input=True)
        return block.router, block.experts, spec, ExpertSpec(transposed=True)
    if family == "mixtral":
        return block.gate, block.experts, RoutingSpec(top_k=K, renormalize=True, weights_fp32=True), ExpertSpec()
    if family in ("qwen2_moe", "qwen3_moe", "olmoe"):
        spec = RoutingSpec(top_k=K, renormalize=bool(cfg.norm_topk_prob), weights_fp32=False)
        return block.gate, block.experts, spec, ExpertSpec()
    if family == "deepseek_v3":
        spec = RoutingSpec(top_k=K, routing="sigmoid_grouped_topk", router_fp32=True, renormalize=bool(cfg.norm_topk_prob),
                           renorm_eps=1e-20, routed_scale=float(cfg.routed_scaling_factor), n_group=cfg.n_group,
                           topk_group=cfg.topk_group, weights_fp32=True)
        return block.gate, block.experts, spec, ExpertSpec()
    if family == "gpt_oss":
        spec = RoutingSpec(top_k=K, routing="topk_softmax", softmax_fp32=False, weights_fp32=False)
        experts = ExpertSpec(activation="clamped_silu", interleaved=True, transposed=True,
                             alpha=float(block.experts.alpha), limit=float(block.experts.limit))
        return block.router, block.experts, spec, experts
    if family == "granitemoe":
        spec = RoutingSpec(top_k=K, routing="topk_softmax", softmax_fp32=True, weights_fp32=False)
        return block.router, block.experts, spec, ExpertSpec()
    if family == "deepseek_v2":
        # DeepseekV2TopkRouter: fp32 softmax; group_limited_greedy keeps the best topk_group groups by their max.
        grouped = cfg.topk_method == "group_limited_greedy"
        spec = RoutingSpec(top_k=K, router_fp32=True, routed_scale=float(cfg.routed_scaling_factor),
                           n_group=cfg.n_group if grouped else 1, topk_group=cfg.topk_group if grouped else 1,
                           group_top=1 if grouped else 2)
        return block.gate, block.experts, spec, ExpertSpec()
    if family == "deepseek_v4":
        # DeepseekV4TopKRouter: sqrt(softplus) of the logits in their dtype, a selection bias, the scores gathered
        # at the chosen experts, renormalised (+1e-20), scaled; experts silu(min(g, L)) * clamp(u, -L, L).
        spec = RoutingSpec(top_k=block.gate.top_k, routing="sqrtsoftplus_topk", softmax_fp32=False, renormalize=True,
                           renorm_eps=1e-20, routed_scale=float(block.gate.routed_scaling_factor), weights_fp32=False)
        experts = ExpertSpec(activation="clamped_swiglu", limit=float(block.experts.limit))
        return block.gate, block.experts, spec, experts
    if family == "inkling2":
        # Inkling2TopKRouter: fp32 sigmoid scores, a selection bias, the chosen scores renormalised (+1e-20) and
        # scaled; fp32 weights. Inkling2SoftcappedSwiGLU: tanh(g / a) * a * sigmoid(g) * tanh(u / b) * b in fp32.
        spec = RoutingSpec(top_k=K, routing="sigmoid_grouped_topk", router_fp32=True, renormalize=True,
                           renorm_eps=1e-20, routed_scale=float(block.gate.routed_scaling_factor))
        act = block.experts.act_fn
        experts = ExpertSpec(activation="softcapped_swiglu", alpha=float(act.gate_softcap.softcap),
                             limit=float(act.up_softcap.softcap))
        return block.gate, block.experts, spec, experts
    if family == "longcat_flash":
        # LongcatFlashTopkRouter: fp32 logits and softmax over the experts and the zero-computation experts, a
        # selection bias, the chosen probabilities scaled; a pair sent to a zero-computation expert passes through.
        spec = RoutingSpec(top_k=K, router_fp32=True, routed_scale=float(block.router.routed_scaling_factor),
                           identity_experts=block.zero_expert_num)
        return block.router, block.experts, spec, ExpertSpec()
    if family == "phimoe":
        # PhimoeTopKRouter (eval): the sparsemixer in the logits' dtype, its weights in that dtype.
        spec = RoutingSpec(top_k=K, routing="sparsemixer", softmax_fp32=False, weights_fp32=False,
                           jitter_eps=float(block.router.router_jitter_noise))
        return block.router, block.experts, spec, ExpertSpec()
    if family == "ernie4_5_moe":
        # Ernie4_5_MoeTopKRouter: fp32 softmax, a selection bias on the probabilities, w / clamp(sum, min), cast.
        spec = RoutingSpec(top_k=K, router_fp32=True, renormalize=True, renorm_min=float(block.gate.norm_min),
                           weights_fp32=False)
        return block.gate, block.experts, spec, ExpertSpec()
    raise ValueError(f"unknown family {family!r}")


def _selection_bias(router):
    """The router's selection bias as [E] (Ernie 4.5 keeps it [1, E] in `moe_statics`), or None."""
    bias = getattr(getattr(router, "moe_statics", router), "e_score_correction_bias", None)
    return None if bias is None else bias.reshape(-1)


def op_arguments(family: str, block):
    """Positional tensors and keyword scalars of `mok.fused_moe` equal to `block`'s routed experts."""
    router, experts, routing, expert_spec = routed_parts(family, block)
    linear = getattr(router, "classifier", router)  # LongCat-Flash's router holds its linear
    tensors = (
        linear.weight,
        getattr(linear, "bias", None),
        _selection_bias(router),
        experts.gate_up_proj,
        getattr(experts, "gate_up_proj_bias", None),
        experts.down_proj,
        getattr(experts, "down_proj_bias", None),
    )
    return tensors, {**dataclasses.asdict(routing), **dataclasses.asdict(expert_spec)}
