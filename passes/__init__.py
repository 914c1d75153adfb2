"""FX passes that find MoE blocks by structure and rewrite them to `torch.ops.mok.fused_moe`."""
