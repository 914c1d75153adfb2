"""Per-expert weights of an nn.ModuleList traced through a Python loop (being written)."""

from .region import NoMatch


def match_loop_experts(flow, region, router, tensors):
    raise NoMatch(f"per-expert weights ({len(tensors)} tensors) are not supported yet")
