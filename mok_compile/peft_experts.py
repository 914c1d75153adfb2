"""PEFT's LoRA on expert weights, traced into one graph with its router.

PEFT's `target_parameters` (LoRA on a parameter, the way PEFT adapts MoE experts) wraps each targeted weight in a
`ParamWrapper`, whose forward registers a parametrization ``W + scaling * lhs @ rhs`` on the experts module, calls
the module, and removes the parametrization again, on every call. Dynamo cannot trace the registration (an in-place
`set_` of a parameter) and breaks the graph there, so the experts reach the backend without their router (17 graph
breaks in a 2-layer Qwen3-MoE) and no block fuses.

`install()` gives `ParamWrapper` a forward that, while Dynamo traces it, computes the same weights with PEFT's own
proxy modules (once per call, as under PEFT's `parametrize.cached()`) and calls the experts module with them
through `torch.func.functional_call`, which Dynamo traces. Router and experts then arrive in one graph, the weights
computed in it, which the pass fuses as it does any parametrization's. Eager calls run PEFT's forward unchanged.
A chain in any other state (adapters disabled or merged, a mixed-adapter batch, two wrappers of one parameter, a
layout of PEFT's this module does not know) also runs PEFT's forward, and breaks the graph as before.

Installed when PEFT's LoRA layers are imported by the time `backend="mok"` is looked up (`torch.compile(...,
backend="mok")` imports `mok_compile`), at each backend call, and by `explain`. `MOK_TRACE_PEFT=0` leaves PEFT as it is. The
patch is PEFT's class's, so a compile with another backend in the same process traces the same way.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import torch

_LAYER_MODULE = "peft.tuners.lora.layer"
_NAMES = ("ParamWrapper", "_LoraFactorsProxy", "_LoraParameterProxy", "UPCAST_DTYPES")
_UNTRACED = object()  # `traced_forward`'s answer where PEFT's own forward must run


def install() -> bool:
    """Give PEFT's `ParamWrapper` the traceable forward, if PEFT's LoRA layers are imported and laid out as this
    module expects (idempotent); with MOK_TRACE_PEFT=0, PEFT's own back. Whether it is installed."""
    if os.environ.get("MOK_TRACE_PEFT", "1") == "0":
        uninstall()
        return False
    layer = sys.modules.get(_LAYER_MODULE)
    if layer is None or not all(hasattr(layer, n) for n in _NAMES):
        return False
    wrapper = layer.ParamWrapper
    if getattr(wrapper.forward, "peft_forward", None) is not None:
        return True
    peft_forward = wrapper.forward

    @functools.wraps(peft_forward)
    def forward(self, x, *args, **kwargs):
        if torch.compiler.is_compiling():
            out = traced_forward(layer, self, x, args, kwargs)
            if out is not _UNTRACED:
                return out
        return peft_forward(self, x, *args, **kwargs)

    forward.peft_forward = peft_forward
    wrapper.forward = forward
    return True


def uninstall() -> None:
    """Give `ParamWrapper` PEFT's forward back."""
    layer = sys.modules.get(_LAYER_MODULE)
    peft_forward = getattr(getattr(getattr(layer, "ParamWrapper", None), "forward", None), "peft_forward", None)
    if peft_forward is not None:
        layer.ParamWrapper.forward = peft_forward


@contextlib.contextmanager
def shipped_forward():
    """PEFT's own forward for the code inside (what a compile without mok_compile traces: benchmarks' baselines),
    the traceable one installed again after it."""
    uninstall()
    try:
        yield
    finally:
        install()


def traced_forward(layer, wrapper, x, args, kwargs):
    """`wrapper`'s forward (and that of every ParamWrapper it wraps) as one call of the base module with the LoRA
    weights given, or `_UNTRACED` where PEFT's forward must run."""
    chain, module = [], wrapper
    while isinstance(module, layer.ParamWrapper):
        chain.append(module)
        module = module.base_layer
    names = [w.parameter_name for w in chain]
    if ("adapter_names" in kwargs or len(set(names)) != len(names) or module is not wrapper.get_base_layer()
            or any(w.disable_adapters or w.merged for w in chain)):
        return _UNTRACED
    weights = {}
    for w in chain:
        adapters = [a for a in w.active_adapters if a in w.lora_A]
        if adapters:
            weights[w.parameter_name] = lora_weight(layer, w, adapters, getattr(module, w.parameter_name))
    return torch.func.functional_call(module, weights, (x, *args), kwargs, tie_weights=False, strict=False)


def lora_weight(layer, wrapper, adapters, param):
    """The weight PEFT's `ParamWrapper._activate_lora` parametrizes `param` to, by the same proxy: the low-rank
    factors folded into one `baddbmm` for one adapter on stacked experts, else the sum of the adapters' deltas."""
    low_precision = any(getattr(torch, name, None) == param.dtype for name in layer.UPCAST_DTYPES)
    if len(adapters) == 1 and wrapper.num_experts > 1 and not low_precision:
        return layer._LoraFactorsProxy(*wrapper.get_delta_factors(adapters[0]))(param)
    delta = None
    for adapter in adapters:
        d = wrapper.get_delta_weight(adapter)
        delta = d if delta is None else delta + d
    return layer._LoraParameterProxy(delta)(param)
