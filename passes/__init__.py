"""FX passes that find MoE blocks by structure and rewrite them to `torch.ops.mok.fused_moe`.

    from mok_compile.passes import fuse_moe
    report = fuse_moe(gm)          # gm: a Dynamo FX graph; changed in place
    print(report)                  # which blocks were fused, and why the others were not
"""

from .fuse_moe import BlockReport, FuseReport, MoeFusionError, fuse_moe

__all__ = ["BlockReport", "FuseReport", "MoeFusionError", "fuse_moe"]
