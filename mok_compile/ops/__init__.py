"""The fused MoE op: schema and registrations (`library`), reference, specs.

Importing this package registers `torch.ops.mok.fused_moe` and its backward;
device kernels attach themselves on import of `cpu` and `mok_compile.kernels`.
"""

from . import library  # noqa: F401  (registers the ops)
from . import cpu  # noqa: F401  (CPU kernel: C++, built on first use)
from .. import kernels  # noqa: F401  (CUDA kernels: Triton, imported on first use)
from .spec import ExpertSpec, RoutingSpec, op_kwargs, specs_from_kwargs

__all__ = ["ExpertSpec", "RoutingSpec", "op_kwargs", "specs_from_kwargs", "fused_moe"]


def fused_moe(hidden_states, router, gate_up_proj, down_proj, routing: RoutingSpec, experts: ExpertSpec = ExpertSpec(),
              *, router_bias=None, selection_bias=None, gate_up_bias=None, down_bias=None):
    """Call `torch.ops.mok.fused_moe` with specs instead of its long keyword list."""
    import torch

    return torch.ops.mok.fused_moe(hidden_states, router, router_bias, selection_bias, gate_up_proj, gate_up_bias,
                                   down_proj, down_bias, **op_kwargs(routing, experts))
