"""Expert activations as Triton device functions, forward and derivative.

The forward rounds to the storage dtype after each elementwise op exactly where
Hugging Face's bf16 module rounds (``silu(gate)`` is a bf16 tensor before it is
multiplied by ``up``), so the kernel's expert output matches HF's op by op (the
fp32 activations, `spec.FP32_ACTIVATIONS`, round once); in fp32 every rounding is
the identity. The derivative is computed in fp32 without
rounding, like the reference backward.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

# Activation codes passed to kernels as constexpr (0 = none).
ACTIVATION_CODES = {
    (True, "silu"): 1,
    (True, "gelu_tanh"): 2,
    (True, "clamped_silu"): 3,
    (True, "clamped_swiglu"): 9,
    (True, "softcapped_swiglu"): 10,
    (True, "silu_fp32"): 11,
    (False, "relu2"): 4,
    (False, "relu"): 5,
    (False, "silu"): 6,
    (False, "gelu"): 7,
    (False, "gelu_tanh"): 8,
}

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def activation_code(activation: str, gated: bool) -> int:
    return ACTIVATION_CODES[(bool(gated), activation)]


@triton.jit
def _r(x, DT: tl.constexpr):
    """Round fp32 `x` to the storage dtype DT (as a bf16/fp16 tensor op would) and back to fp32."""
    return x.to(DT).to(tl.float32)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    # tanh(x) = 2 sigmoid(2x) - 1, written to stay finite for large |x|.
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _gelu_tanh(x):
    return 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


@triton.jit
def _gelu_tanh_grad(x):
    c = 0.7978845608028654
    t = _tanh(c * (x + 0.044715 * x * x * x))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)


@triton.jit
def act_forward(g, u, alpha, limit, ACT: tl.constexpr, DT: tl.constexpr):
    """Activation of the (already rounded) gate_up output; `u` is ignored for ungated codes."""
    if ACT == 1:  # silu(g) * u
        return _r(_r(g * _sigmoid(g), DT) * u, DT)
    elif ACT == 2:  # gelu_tanh(g) * u
        return _r(_r(_gelu_tanh(g), DT) * u, DT)
    elif ACT == 3:  # GPT-OSS: (clamp(u) + 1) * g * sigmoid(alpha * g), g = min(g, limit)
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        glu = _r(gc * _r(_sigmoid(_r(gc * alpha, DT)), DT), DT)
        return _r(_r(uc + 1.0, DT) * glu, DT)
    elif ACT == 9:  # DeepSeek-V4: silu(min(g, limit)) * clamp(u, -limit, limit)
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        return _r(_r(gc * _sigmoid(gc), DT) * uc, DT)
    elif ACT == 11:  # Beam: silu(g) * u in fp32, rounded once
        return _r(g * _sigmoid(g) * u, DT)
    elif ACT == 10:  # Inkling2: cap(g, alpha) * sigmoid(g) * cap(u, limit), cap(v, c) = tanh(v / c) * c, in fp32
        return _r(_tanh(g / alpha) * alpha * _sigmoid(g) * (_tanh(u / limit) * limit), DT)
    elif ACT == 4:  # relu(h)^2
        r = tl.maximum(g, 0.0)
        return _r(r * r, DT)
    elif ACT == 5:
        return tl.maximum(g, 0.0)
    elif ACT == 6:
        return _r(g * _sigmoid(g), DT)
    elif ACT == 7:  # exact gelu
        return _r(0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476)), DT)
    else:  # 8: gelu_tanh
        return _r(_gelu_tanh(g), DT)


@triton.jit
def act_value_fp32(g, u, alpha, limit, ACT: tl.constexpr):
    """The activation in fp32 with no intermediate rounding (what the fp32 reference backward sees)."""
    return act_forward(g, u, alpha, limit, ACT, tl.float32)


@triton.jit
def act_backward(g, u, da, alpha, limit, ACT: tl.constexpr):
    """(d gate, d up) from d(activation output); for ungated codes d up is zero and unused."""
    if ACT == 1 or ACT == 11:
        sg = _sigmoid(g)
        return da * u * sg * (1.0 + g * (1.0 - sg)), da * g * sg
    elif ACT == 2:
        return da * u * _gelu_tanh_grad(g), da * _gelu_tanh(g)
    elif ACT == 3:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        s = _sigmoid(alpha * gc)
        dg = tl.where(g <= limit, da * (uc + 1.0) * (s + alpha * gc * s * (1.0 - s)), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), da * gc * s, 0.0)
        return dg, du
    elif ACT == 9:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        s = _sigmoid(gc)
        dg = tl.where(g <= limit, da * uc * s * (1.0 + gc * (1.0 - s)), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), da * gc * s, 0.0)
        return dg, du
    elif ACT == 10:  # d cap(v, c) / dv = 1 - tanh(v / c)^2
        tg = _tanh(g / alpha)
        tu = _tanh(u / limit)
        s = _sigmoid(g)
        dg = da * (tu * limit) * ((1.0 - tg * tg) * s + tg * alpha * s * (1.0 - s))
        du = da * (tg * alpha) * s * (1.0 - tu * tu)
        return dg, du
    elif ACT == 4:
        return da * 2.0 * tl.maximum(g, 0.0), da * 0.0
    elif ACT == 5:
        return tl.where(g > 0.0, da, 0.0), da * 0.0
    elif ACT == 6:
        s = _sigmoid(g)
        return da * s * (1.0 + g * (1.0 - s)), da * 0.0
    elif ACT == 7:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        pdf = tl.exp(-0.5 * g * g) * 0.3989422804014327
        return da * (cdf + g * pdf), da * 0.0
    else:
        return da * _gelu_tanh_grad(g), da * 0.0
