"""The end-to-end benchmark's models, on the CPU (the benchmark itself needs a GPU): each `--model`'s config builds a
model whose experts have the sizes `MOE_SIZES` gives it (which its floor and its MoE-time bound are computed from)."""

import pytest
import torch

from benchmarks.e2e_qwen3 import MOE_SIZES, _config


@pytest.mark.parametrize("model", sorted(MOE_SIZES))
def test_each_model_has_the_expert_sizes_the_benchmark_computes_with(model):
    import transformers as tf

    try:
        cfg = _config(model, layers=1, seq=256)
    except AttributeError:  # (a config class this transformers lacks)
        pytest.skip(f"{model} needs a newer transformers")
    with torch.device("meta"):
        lm = tf.AutoModelForCausalLM.from_config(cfg)
    experts = [m for m in lm.modules() if isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter)]
    assert experts, model
    E, two_I, H = experts[0].gate_up_proj.shape
    assert (H, two_I // 2, E) == MOE_SIZES[model][:3], (model, experts[0].gate_up_proj.shape)
