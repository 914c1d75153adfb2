"""Process groups and per-rank steps for the DistributedDataParallel / FSDP tests.

A test in this process joins a one-rank group (`process_group`); a test of several ranks spawns one process
per rank (`spawn`), which runs `ddp_rank_step` there. gloo on the CPU, NCCL on CUDA.
"""

from __future__ import annotations

import contextlib
import os
import socket

import torch
import torch._inductor.config
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from mok_compile.backend import mok_backend
from mok_compile.demo import make_causal_lm
from mok_compile.hf_blocks import BlockSizes, checkpoint_layers

from .helpers import BF16_GRAD_TOL, NUM_LAYERS, assert_close_rel, token_ids

# Expert weights of 2.1 MB (gate_up) and 1 MB (down) in fp32: larger than a 1 MB DDP bucket, so DDP's cutting
# falls inside the blocks. (Dynamo's own cutting needs buckets of at least 1 MiB, its first bucket's size.)
SIZES = BlockSizes(hidden=128, intermediate=256, experts=8, top_k=2)
BUCKET_MB = 1.0
# Relative to the largest value. fp32 on the CPU differs from eager in summation order only; on the GPU inductor
# also fuses and reorders the rest of the model.
TOL = {"cpu": 1e-5, "cuda": 1e-4}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process_group(rank: int = 0, world: int = 1, port: int | None = None, device: str = "cpu"):
    """This process as `rank` of a `world`-rank group (gloo on the CPU, NCCL on CUDA), destroyed on exit."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port or free_port())
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def model(device="cpu", sizes=SIZES):
    """A two-layer fp32 Qwen3-MoE CausalLM with the same random weights on every call."""
    return make_causal_lm("qwen3_moe", sizes, num_layers=NUM_LAYERS, device=device).train()


def train_step(module, ids):
    """(loss, {name: gradient}) of one training step of `module` (DDP or not) on `ids`."""
    out = module(input_ids=ids, labels=ids)
    out.loss.backward()
    inner = getattr(module, "_orig_mod", module)  # under torch.compile
    inner = inner.module if isinstance(inner, DDP) else inner
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in inner.named_parameters() if p.grad is not None}


def assert_same_step(got, want, tol=TOL["cpu"], what=""):
    (got_loss, got_grads), (want_loss, want_grads) = got, want
    assert_close_rel(got_loss, want_loss, tol, f"{what} loss")
    assert got_grads.keys() == want_grads.keys(), f"{what}: gradients reached other parameters"
    for name, want_grad in want_grads.items():
        assert_close_rel(got_grads[name], want_grad, tol, f"{what} grad of {name}")


def ddp_rank_step(rank: int, world: int, port: int, device: str, compiler: str):
    """One rank: a training step of DDP under backend="mok" (optimize_ddp=False, 1 MB buckets) against eager DDP,
    each rank on its own tokens, so the gradients compared are the all-reduced ones."""
    from torch._dynamo.utils import counters

    with torch._dynamo.config.patch(optimize_ddp=False), process_group(rank, world, port, device):
        ids = token_ids(seed=1 + rank).to(device)
        want = train_step(DDP(model(device=device), bucket_cap_mb=BUCKET_MB), ids)
        # The backend as a callable: the GPU machine runs a checkout without the installed entry point.
        compiled = torch.compile(DDP(model(device=device), bucket_cap_mb=BUCKET_MB), backend=mok_backend,
                                 options={"compiler": compiler})
        # Without inductor's graph cache, whose hits skip the post-grad pass that the counter below counts.
        with torch._inductor.config.patch(fx_graph_cache=False):
            got = train_step(compiled, ids)
        assert counters["mok"]["fused_moe"] == NUM_LAYERS, dict(counters["mok"])
        assert counters["mok"]["ddp_pieces"] > 1, dict(counters["mok"])
        if compiler == "inductor":  # each piece's compiled backward writes dh over the saved h, as eager does
            assert counters["mok"]["backward_consume"] == NUM_LAYERS, dict(counters["mok"])
        assert_same_step(got, want, TOL[device], f"rank {rank}")


def fsdp2_rank_step(rank: int, world: int, port: int, device: str, compiler: str, compiled: str,
                    checkpointed: bool = False, mixed_precision: bool = False):
    """One rank: a training step of FSDP2 (`fully_shard` on each decoder layer and on the model, over all ranks)
    with each layer compiled under backend="mok" (`compiled="per_layer"`) or the whole model (`"whole"`: Dynamo
    breaks the graph at FSDP's hooks), against eager FSDP2, each rank on its own tokens; the full gradients are
    compared. `checkpointed`: every decoder layer activation-checkpointed (inside FSDP's hooks, as transformers
    places it). Dynamo may then compile one layer graph and run it for every layer, so a second compiled step's
    backward runs of the op are counted (torch.profiler), one per layer, rather than the blocks fused at compile
    time. `mixed_precision`: fp32 weights that FSDP2 hands the layers in bf16 (`MixedPrecisionPolicy`), gradients
    reduced in fp32; compared within bf16's rounding (`BF16_GRAD_TOL`)."""
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options = {"compiler": compiler}
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed_precision else MixedPrecisionPolicy()

    def sharded(compile_it):
        m = model(device=device)
        if checkpointed:
            checkpoint_layers(m)
        mesh = init_device_mesh(device, (world,))
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
            if compile_it and compiled == "per_layer":
                layer.compile(backend=mok_backend, options=options)
        m = fully_shard(m, mesh=mesh, mp_policy=policy)
        return torch.compile(m, backend=mok_backend, options=options) if compile_it and compiled == "whole" else m

    def step(m):
        loss, grads = train_step(m, token_ids(seed=1 + rank).to(device))
        return loss, {n: g.full_tensor() for n, g in grads.items()}

    with process_group(rank, world, port, device), \
            torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=checkpointed):
        want = step(sharded(False))
        compiled_model = sharded(True)
        got = step(compiled_model)
        if checkpointed:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                step(compiled_model)
            backwards = sum(e.name == "mok::fused_moe_backward" for e in prof.events())
            assert backwards == NUM_LAYERS and counters["mok"]["fused_moe"] >= 1, (backwards, dict(counters["mok"]))
        else:
            assert counters["mok"]["fused_moe"] == NUM_LAYERS, dict(counters["mok"])
        assert_same_step(got, want, BF16_GRAD_TOL if mixed_precision else TOL[device], f"rank {rank}")


def spawn(fn, world: int, *args):
    """Run `fn(rank, world, port, *args)` in `world` fresh processes; a failing rank fails the call."""
    torch.multiprocessing.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


# Qwen3-MoE's tensor-parallel plan for its experts in transformers 5.17-5.24. 5.25 took it out of the models' own
# plans and deprecated its `moe_tp_experts` style (to go in 5.28) for expert parallelism; while the style exists a
# user can still ask for it, and the test does.
EXPERTS_TP_PLAN = {"layers.*.mlp.experts.gate_up_proj": "packed_colwise", "layers.*.mlp.experts.down_proj": "rowwise",
                   "layers.*.mlp.experts": "moe_tp_experts"}


def experts_tensor_parallel_exists() -> bool:
    """Whether this transformers can still shard a block's experts by tensor parallelism (`moe_tp_experts`)."""
    from transformers.distributed import tensor_parallel

    styles = getattr(tensor_parallel, "ALL_PARALLEL_STYLES", None)
    return styles is None or "moe_tp_experts" in styles


def sharded_model(world: int, how: str, device: str = "cpu"):
    """`model()` with its experts sharded over `world` ranks by transformers' own plans: `how` is "ep" (the
    model's expert-parallel plan: each rank's experts on the whole batch, summed by an all-reduce),
    "ep_all_to_all" (the same plan, tokens sent to their experts' ranks and back: transformers 5.21+) or "tp"
    (the experts entries of its tensor-parallel plan: each expert's columns split, partial outputs all-reduced).
    transformers 5.21+ applies plans with `apply_expert_parallelism` / `apply_tensor_parallelism(model, mesh,
    plan)`; 5.17-5.20 read the plan off the model (`enable_expert_parallel` picks the EP one)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed import tensor_parallel

    m = model(device=device)
    mesh = init_device_mesh(device, (world,))
    try:
        from transformers.distributed.expert_parallel import apply_expert_parallelism
    except ImportError:  # transformers < 5.21
        from transformers.distributed import DistributedConfig

        m.config.distributed_config = DistributedConfig(enable_expert_parallel=how == "ep")
        if how == "tp":
            m._tp_plan = {key: style for key, style in m.tp_plan.items() if ".experts" in key}
        return tensor_parallel.apply_tensor_parallelism(m, mesh)
    source = m.config.base_model_ep_plan if how.startswith("ep") else m.config.base_model_tp_plan
    if how == "tp" and not any(".experts" in key for key in source):
        source = EXPERTS_TP_PLAN  # transformers 5.25+: no longer among the model's own plans
    plan = {f"model.{key.replace('*', str(i))}": style for key, style in source.items() if ".experts" in key
            for i in range(len(m.model.layers))}
    if how.startswith("ep"):
        apply_expert_parallelism(m, mesh, mesh, plan, ep_implementation="all_to_all" if how == "ep_all_to_all"
                                 else "all_reduce")
    else:
        tensor_parallel.apply_tensor_parallelism(m, mesh, plan)
    return m


def sharded_rank_step(rank: int, world: int, port: int, how: str, train: bool):
    """One rank: `sharded_model` under backend="mok" left unfused, with the reason naming the sharding, and the
    same logits (and, when training, loss and gradients) as eager."""
    from torch._dynamo.utils import counters

    import mok_compile
    from mok_compile.passes import lone_experts, sharded

    with process_group(rank, world, port):
        ids = token_ids(seed=1)
        m = sharded_model(world, how).train(train)
        report = mok_compile.explain(m, input_ids=ids)
        assert len(report.rejected) == NUM_LAYERS and not report.fused, str(report)
        for block in report.rejected:
            if how == "ep_all_to_all":  # the all-to-all's host read breaks the graph between router and experts
                assert block.form == lone_experts.FORM, block
                # named by module path, or where there is none (the experts' bound forward) by source line
                assert block.name.endswith(".experts") or ".py:" in block.name, block
            else:
                assert block.reason.startswith(sharded.REASON), block.reason
                assert "DTensor.to_local" in block.reason and ".mlp.experts" in block.reason, block.reason
        counters.clear()  # explain's pass counted too
        compiled = torch.compile(m, backend=mok_backend, options={"compiler": "aot_eager"})
        if train:
            want = _local(train_step(m, ids))
            m.zero_grad(set_to_none=True)
            got = _local(train_step(compiled, ids))
        else:
            with torch.no_grad():
                want, got = m(input_ids=ids).logits, compiled(input_ids=ids).logits
        # >=: transformers 5.17's tensor-parallel training step breaks into 12 graphs (so under backend="aot_eager"
        # too), several of which hold a rejected block
        mok = dict(counters["mok"])
        assert mok.get("fused_moe", 0) == 0 and mok.get("rejected_moe", 0) >= NUM_LAYERS, mok
        if train:
            assert_same_step(got, want, TOL["cpu"], f"rank {rank}")
        else:
            assert_close_rel(got, want, TOL["cpu"], f"rank {rank} logits")


def _local(step):
    """A `train_step` result with this rank's shard of each DTensor gradient."""
    loss, grads = step
    return loss, {n: g.to_local() if hasattr(g, "to_local") else g for n, g in grads.items()}
