"""DistributedDataParallel: MoE blocks stay whole, and gradients still overlap their all-reduce.

Under DDP, Dynamo's default (``torch._dynamo.config.optimize_ddp = "ddp_optimizer"``) cuts each graph into
pieces of about DDP's bucket size (``bucket_cap_mb``, 25 MB) *before* a backend sees it, so that a bucket's
all-reduce can start while the backward of earlier pieces still runs. An MoE block's expert weights are usually
larger than a bucket, so a cut falls inside the block and no piece holds all of it: nothing can be fused.

With ``optimize_ddp = False`` Dynamo hands the backend the whole graph. The `mok` backend fuses it and then cuts
the *fused* graph at DDP's bucket boundaries itself, with torch's own `DDPOptimizer`: each fused op lands whole
in one piece (it is one node), and the overlap comes back. A graph with nothing fused is cut the same way, so it
compiles to the pieces Dynamo's default would have given inductor. ``options={"ddp_buckets": False}`` hands
every graph on whole (all-reduce then waits for the whole backward).

Under Dynamo's own cutting, the backend warns once when a cut piece holds expert GEMMs or a block it could
not finish (`cut_by_dynamo`, `cut_blocks`), naming the one-line fix.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

CUT = "under DistributedDataParallel, Dynamo cut the graph at DDP's bucket boundaries, and MoE blocks with it"
FIX = ("torch._dynamo.config.optimize_ddp = False  (mok then fuses every block and cuts the fused graph into "
       "DDP's buckets itself, so all-reduce still overlaps the backward)")


def active_module():
    """The DistributedDataParallel module whose forward is being compiled, or None."""
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel._get_active_ddp_module()


def _mode() -> str:
    from torch._dynamo.utils import get_optimize_ddp_mode

    return get_optimize_ddp_mode()


def cut_by_dynamo(gm: torch.fx.GraphModule) -> bool:
    """Whether `gm` is a piece, past the first, of a graph Dynamo cut for DDP: DDP's forward is being compiled
    under "ddp_optimizer", and some of `gm`'s inputs are another piece's outputs (placeholders without Dynamo's
    `_dynamo_source`). A graph that fit one bucket reaches the backend whole, with every input sourced."""
    if active_module() is None or _mode() != "ddp_optimizer":
        return False
    return any(n.op == "placeholder" and getattr(n, "_dynamo_source", None) is None for n in gm.graph.nodes)


def bucket_cap_to_apply() -> int | None:
    """DDP's bucket size in bytes, where the backend should cut graphs itself: DDP is running and Dynamo
    hands over whole graphs (``optimize_ddp = False``). None elsewhere, including compiled autograd's
    "python_reducer" modes, which overlap the all-reduce without cutting graphs."""
    module = active_module()
    if module is None or _mode() != "no_optimization":
        return None
    return module.bucket_bytes_cap


def compile_in_buckets(gm: torch.fx.GraphModule, example_inputs: Sequence, bucket_cap: int,
                       compile_piece: Callable) -> tuple[Callable, int]:
    """(compiled `gm` cut into DDP buckets of `bucket_cap` bytes by torch's DDPOptimizer, number of pieces);
    `compile_piece(piece, inputs)` compiles each piece."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    pieces = 0

    def counted(piece, inputs):
        nonlocal pieces
        pieces += 1
        return compile_piece(piece, inputs)

    first_cap = min(bucket_cap, torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
    compiled = DDPOptimizer(bucket_bytes_cap=bucket_cap, backend_compile_fn=counted,
                            first_bucket_cap=first_cap).compile_fn(gm, example_inputs)
    return compiled, pieces


def cut_blocks(gm: torch.fx.GraphModule, report) -> list[str]:
    """What in a piece of Dynamo's DDP cutting shows a cut MoE block: blocks the pass found but could not
    finish, and expert GEMMs (grouped_mm) left unfused."""
    from mok_compile.passes.fuse_moe import REPORT_ONLY_FORMS
    from mok_compile.passes.op_names import module_path, op_name

    blocks = report.blocks if report is not None else []
    found = [f"{b.name} ({b.reason})" for b in blocks
             if not b.fused and b.form not in REPORT_ONLY_FORMS]  # lone experts: listed below
    found += [f"an expert GEMM of {module_path(n) or n.name} alone" for n in gm.graph.nodes
              if op_name(n) == "grouped_mm"]
    return found
