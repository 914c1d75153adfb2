"""mok-compile: `torch.compile(model, backend="mok")` fuses every MoE block into one op.

Importing the package registers `torch.ops.mok.*` (cheap: no kernel is built or
compiled until first use). Optional dependencies (triton, torch-mlir,
transformers) are imported only by the features that need them.
"""

from pathlib import Path as _Path

# `mok_compile.passes` lives in the top-level folder `passes/` (the layout the project asked for); an
# install maps it into the package. Run from a plain checkout (PYTHONPATH=., as on the GPU machine),
# nothing maps it, so the checkout's root joins the package's search path for that one folder.
_IN_CHECKOUT = (_Path(__file__).parent.parent / "passes" / "__init__.py").exists()
if _IN_CHECKOUT:
    __path__.append(str(_Path(__file__).parent.parent))

from .ops import ExpertSpec, RoutingSpec, fused_moe

__all__ = ["ExpertSpec", "RoutingSpec", "fused_moe", "explain", "export_mlir"]
__version__ = "0.1.0"


def _register_backend_name():
    """`backend="mok"` by name from a plain checkout too. torch finds a third-party backend's name only through
    an installed distribution's `torch_dynamo_backends` entry point, which a checkout on PYTHONPATH lacks; there
    the name is registered here, and the backend module is still imported only when a compile first calls it."""
    from importlib.metadata import entry_points

    if entry_points(group="torch_dynamo_backends", name="mok"):
        return
    from torch._dynamo import list_backends, register_backend

    if "mok" in list_backends(exclude_tags=()):
        return

    def mok(gm, example_inputs, **kwargs):
        from .backend import mok_backend

        return mok_backend(gm, example_inputs, **kwargs)

    register_backend(mok, name="mok")


if _IN_CHECKOUT:  # an install (editable or not) declares the entry point
    _register_backend_name()

# PEFT's LoRA on expert weights traced with its router (`peft_experts`; a no-op unless PEFT's LoRA layers are
# imported). At import: `torch.compile(..., backend="mok")` imports this package through the entry point before
# Dynamo traces (in a checkout, the user's own import registered the name); each backend call installs it too.
from . import peft_experts as _peft_experts  # noqa: E402

_peft_experts.install()


def __getattr__(name):
    # Lazy so that `import mok_compile` stays cheap and never needs an optional dependency.
    if name == "explain":
        from .diagnostics import explain

        return explain
    if name == "export_mlir":
        from .export import export_mlir

        return export_mlir
    raise AttributeError(f"module 'mok_compile' has no attribute {name!r}")
