"""mok-compile: `torch.compile(model, backend="mok")` fuses every MoE block into one op.

Importing the package registers `torch.ops.mok.*` (cheap: no kernel is built or
compiled until first use). Optional dependencies (triton, torch-mlir,
transformers) are imported only by the features that need them.
"""

from pathlib import Path as _Path

# `mok_compile.passes` lives in the top-level folder `passes/` (the layout the project asked for); an
# install maps it into the package. Run from a plain checkout (PYTHONPATH=., as on the GPU machine),
# nothing maps it, so the checkout's root joins the package's search path for that one folder.
if (_Path(__file__).parent.parent / "passes" / "__init__.py").exists():
    __path__.append(str(_Path(__file__).parent.parent))

from .ops import ExpertSpec, RoutingSpec, fused_moe

__all__ = ["ExpertSpec", "RoutingSpec", "fused_moe", "explain", "export_mlir"]
__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import mok_compile` stays cheap and never needs an optional dependency.
    if name == "explain":
        from .diagnostics import explain

        return explain
    if name == "export_mlir":
        from .export import export_mlir

        return export_mlir
    raise AttributeError(f"module 'mok_compile' has no attribute {name!r}")
