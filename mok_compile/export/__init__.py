"""Export to MLIR through torch-mlir, with each MoE block as one `mok.fused_moe` or decomposed.

`export_mlir` needs torch-mlir (``pip install 'mok-compile[mlir]'``); the
decomposition (`decompose`) and the shape/dtype library (`abstract_interp`) do
not, so other exporters can reuse them.
"""

from .abstract_interp import abstract_interp_library
from .decompose import EXPERTS_FORMS, decompose_fused_moe, fused_moe_decomposed
from .mlir import MlirExport, export_mlir

__all__ = ["EXPERTS_FORMS", "MlirExport", "abstract_interp_library", "decompose_fused_moe", "export_mlir",
           "fused_moe_decomposed"]
