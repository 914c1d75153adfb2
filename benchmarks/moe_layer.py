"""One MoE layer on the GPU: mok's fused op against transformers' own block, eager and compiled.

    python -m benchmarks.moe_layer --out DIR [--shapes qwen3,mixtral,deepseek_v3,deepseek_v2,gpt_oss,ernie,llama4,
                                              deepseek_v4,deepseek_v4_hash,longcat,inkling2,phimoe]
        [--tokens 256,4096] [--mode reduce-overhead]

For each shape and token count T, in bf16 with random weights (std 0.02):
  hf        transformers' block, experts_implementation="grouped_mm" (its default), eager
  hf+comp   the same block under torch.compile (inductor, static shapes)
  mok       torch.ops.mok.fused_moe called on the block's own weights (routing included; a shared
            expert, as DeepSeek-V3 has, is computed outside the op, as HF does)
  mok+comp  the user's path: transformers' block under torch.compile(backend="mok") (static shapes),
            which must fuse the block into the op (checked; the run stops otherwise)
forward (no_grad) and forward+backward (loss = mean(out^2), x and all weights require grad),
medians of triton.testing.do_bench, each column timed in --rounds rounds (default 3) after every column is
compiled and warm, the order reversed every other round; the medians over the rounds are reported.
The floor is max(FLOPs / measured bf16 matmul rate,
expert-weight bytes / measured copy bandwidth) with FLOPs = T*K*3*2*H*I (x3 for fwd+bwd) and the
weights of the experts some token is routed to read once forward (fwd+bwd: read twice, and every
expert's gradient written once: `floors`); both
ceilings are measured in the same run. Peak memory is torch.cuda.max_memory_allocated over one
fwd+bwd after two warm-up steps, minus what was allocated before it; "mok held GB" is what the op's few-token
CUDA graphs (T <= 512) hold across steps, as allocated after mok's warm-up against before it (gradients
dropped; it also takes in any workspace a library allocates on the op's first call: 0.034 GB at Qwen3 T=4096, where
no graph is made). Writes results.json and speedup.png under --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time

import torch
import transformers
from torch._dynamo.utils import counters

import mok_compile  # noqa: F401  (registers torch.ops.mok.*)
from mok_compile import hf_blocks
from mok_compile.backend import mok_backend
from mok_compile.hf_blocks import BlockSizes

# name -> (HF model type, sizes, config overrides, token counts)
SHAPES = {
    "qwen3": ("qwen3_moe", BlockSizes(hidden=2048, intermediate=768, experts=128, top_k=8), {}, (256, 4096, 16384)),
    "mixtral": ("mixtral", BlockSizes(hidden=4096, intermediate=14336, experts=8, top_k=2), {}, (256, 4096, 16384)),
    # Real DeepSeek-V3 groups its 256 experts in 8 groups and keeps the best 4.
    "deepseek_v3": ("deepseek_v3", BlockSizes(hidden=7168, intermediate=2048, experts=256, top_k=8),
                    dict(n_group=8, topk_group=4), (256, 4096)),
    "gpt_oss": ("gpt_oss", BlockSizes(hidden=2880, intermediate=2880, experts=32, top_k=4), {}, (256, 4096)),
    # DeepSeek-V2 (236B): group-limited greedy routing (the best 3 of 8 groups by their largest probability), x16.
    "deepseek_v2": ("deepseek_v2", BlockSizes(hidden=5120, intermediate=1536, experts=160, top_k=6),
                    dict(n_group=8, topk_group=3, routed_scaling_factor=16.0), (256, 4096)),
    # ERNIE-4.5-21B-A3B: a selection bias on the softmax probabilities, w / clamp(sum, 1e-12); its two shared experts
    # (one of twice the size here) run outside the op, as in HF.
    "ernie": ("ernie4_5_moe", BlockSizes(hidden=2560, intermediate=1536, experts=64, top_k=6), {}, (256, 4096)),
    # Llama4-Scout: weight on the expert input, top-1, a shared expert (outside the op, as in HF). HF's
    # own experts run densely (every token through every expert, unselected ones with weight 0).
    "llama4": ("llama4", BlockSizes(hidden=5120, intermediate=8192, experts=16, top_k=1), {}, (256, 4096)),
    # DeepSeek-V4 (transformers >= 5.25; skipped with an older one): sqrt(softplus) scores with a selection bias,
    # the SwiGLU clamped at 10, a shared expert outside the op.
    "deepseek_v4": ("deepseek_v4", BlockSizes(hidden=4096, intermediate=2048, experts=256, top_k=6), {}, (256, 4096)),
    # Its first layers' hash routing: each token's 6 experts looked up by its id (a random table of distinct experts
    # over the real vocabulary), weighted by the scores there; the op takes the looked-up ids (`expert_ids`).
    "deepseek_v4_hash": ("deepseek_v4", BlockSizes(hidden=4096, intermediate=2048, experts=256, top_k=6),
                         dict(mlp_layer_types=["hash_moe", "hash_moe"], vocab_size=129280), (256, 4096)),
    # LongCat-Flash's layer at a quarter of its experts (128 of 512, and 64 of its 256 zero-computation experts: the
    # op's identity experts), its hidden and expert sizes, top-12, fp32 router, routed scale 6.
    "longcat": ("longcat_flash", BlockSizes(hidden=6144, intermediate=2048, experts=128, top_k=12), {}, (256, 4096)),
    # Inkling2 (transformers >= 5.25) at a third of its 384 experts: an fp32 sigmoid router with a selection bias, its
    # softcapped SwiGLU (the op's softcapped_swiglu), fp32 routing weights.
    "inkling2": ("inkling2", BlockSizes(hidden=4608, intermediate=2304, experts=128, top_k=8), {}, (256, 4096)),
    # Phi-3.5-MoE: 16 experts, top-2 by its sparsemixer (at inference; its threshold 2 * 0.01), bf16 weights.
    "phimoe": ("phimoe", BlockSizes(hidden=4096, intermediate=6400, experts=16, top_k=2),
               dict(router_jitter_noise=0.01), (256, 4096)),
}


def bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def measure_ceilings(time_all=None) -> dict:
    """bf16 8192^3 matmul TFLOP/s (random data) and device copy TB/s (bytes read + written). `time_all`: {name: fn}
    -> {name: ms per call} (benchmarks.power's, over seconds at the power limit); default: each one's `bench`."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    src = torch.randn(2**29, device="cuda", dtype=torch.float32)  # 2 GiB
    dst = torch.empty_like(src)
    fns = {"matmul": lambda: a @ b, "copy": lambda: dst.copy_(src)}
    ms = time_all(fns) if time_all is not None else {name: bench(fn) for name, fn in fns.items()}
    return {"matmul_tflops": 2 * 8192**3 / ms["matmul"] / 1e9, "copy_tbps": 2 * src.numel() * 4 / ms["copy"] / 1e9}


def floors(T, sizes, experts_hit, ceilings) -> tuple[float, float]:
    """(forward, forward+backward) floors in ms: max(FLOPs / matmul rate, weight bytes / copy rate).

    FLOPs = T*K*3*2*H*I (x3 for fwd+bwd). Weight bytes: the forward reads the `experts_hit` experts that some
    token was routed to (a kernel need not read the others: at a few tokens most experts get none); fwd+bwd
    reads them twice and writes the whole weight gradient, every expert's (zero where unhit)."""
    H, I, E, K = sizes.hidden, sizes.intermediate, sizes.experts, sizes.top_k
    flops = T * K * 3 * 2 * H * I
    expert_bytes = 3 * H * I * 2
    floor_f = max(flops / ceilings["matmul_tflops"], experts_hit * expert_bytes / ceilings["copy_tbps"])
    floor_fb = max(3 * flops / ceilings["matmul_tflops"],
                   (2 * experts_hit + E) * expert_bytes / ceilings["copy_tbps"])
    return floor_f / 1e9, floor_fb / 1e9


def check_expert_sizes(family, block, sizes):
    """The block's expert weights have the sizes its floors are computed from: a config can map one size onto
    another (Inkling2's intermediate_size is its moe_intermediate_size), which would silently change the work."""
    tensors, kw = hf_blocks.op_arguments(family, block)
    gate_up, down = tensors[3], tensors[5]
    H, I = (down.shape[2], down.shape[1]) if kw["transposed"] else (down.shape[1], down.shape[2])
    n_up = (2 if kw["gated"] else 1) * I
    up_shape = (H, n_up) if kw["transposed"] else (n_up, H)
    found = (gate_up.shape[0], H, I)
    if found != (sizes.experts, sizes.hidden, sizes.intermediate) or tuple(gate_up.shape[1:]) != up_shape:
        raise SystemExit(f"{family}: the block's experts are E, H, I = {found} (gate_up {tuple(gate_up.shape)}), "
                         f"not the shape's {sizes.experts}, {sizes.hidden}, {sizes.intermediate}")


def build_block(family, sizes, overrides, dtype=torch.bfloat16):
    """The HF block at real sizes, built directly on the GPU in `dtype` (no fp32 CPU copy of the weights)."""
    cfg = hf_blocks.make_config(family, sizes, **overrides)
    cfg._experts_implementation = "grouped_mm"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            block = hf_blocks.new_block(family, cfg)
    finally:
        torch.set_default_dtype(old)
    gen = torch.Generator(device="cuda").manual_seed(0)
    # A selection bias of the scale of what it is added to: sigmoid scores (DeepSeek-V3), or probabilities of about
    # 1/E each (Ernie 4.5; a bias of 0.1 there would send every token to the same few experts).
    bias_std = 0.1 / sizes.experts if family == "ernie4_5_moe" else 0.1
    with torch.no_grad():
        for name, p in list(block.named_parameters()) + list(block.named_buffers()):
            if p.is_floating_point():
                std = bias_std if name.endswith("e_score_correction_bias") else 0.02
                # Scaled in place: `randn(...) * std` held two fp32 copies of the largest weight at once (56 GiB for
                # DeepSeek-V3's gate_up), past an 80 GB GPU's memory beside the bf16 block. Same values.
                p.copy_(torch.randn(p.shape, device="cuda", generator=gen).mul_(std))
        if getattr(block, "is_hash", False):  # distinct experts per token id, as a top-k would give
            table = block.gate.tid2eid
            scores = torch.rand(table.shape[0], sizes.experts, device="cuda", generator=gen)
            table.copy_(scores.argsort(dim=-1)[:, :table.shape[1]])
    return hf_blocks.keep_fp32_parts_(family, block).eval()


def layer_routing(name, T, seed=0, block=None):
    """(x, topk_weights, topk_ids) of this benchmark's block at shape `name` for T random tokens: the routing its
    kernels see in the layer (`block`: that block, already built; else it is built here). A kernel timed alone on
    other routing need not rank as in the layer: at DeepSeek-V3 T=4096 this block's router sends tokens to 182 of 256
    experts (0-1027 rows per expert), the tuner's random router to all 256 (93-160), and the Triton and CUDA gate_ups
    swap places between the two (NOTES v31)."""
    family, sizes, overrides, _ = SHAPES[name]
    block = block if block is not None else build_block(family, sizes, overrides)
    tensors, kw = hf_blocks.op_arguments(family, block)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, sizes.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    with torch.no_grad():
        _, topk_weights, topk_ids = torch.ops.mok.fused_moe(x, *tensors, **kw, **_given_ids(block, T))
    return x, topk_weights, topk_ids


MAX_HASH_TOKENS = 65536


def _token_ids(block):
    """The [1, MAX_HASH_TOKENS] row of token ids whose first T a hash-routed block gets with T tokens (None for the
    other blocks, which take none)."""
    if not getattr(block, "is_hash", False):
        return None
    table = block.gate.tid2eid
    gen = torch.Generator(device=table.device).manual_seed(1)
    return torch.randint(0, table.shape[0], (1, MAX_HASH_TOKENS), device=table.device, generator=gen)


def _given_ids(block, T, token_ids=None) -> dict:
    """The op's `expert_ids` for a hash-routed block's first T tokens, looked up as its router does; {} for the
    others."""
    token_ids = _token_ids(block) if token_ids is None else token_ids
    return {} if token_ids is None else {"expert_ids": block.gate.tid2eid[token_ids[0, :T]]}


ROUTINGS = ("layer", "random")


def kernel_problem(name, T, routing="layer"):
    """`tune._Problem` (random weights, one kernel at a time) at shape `name`, routed as this benchmark's layer
    routes (`layer_routing`) or, with routing="random", as the tuner does; and a note of its rows per expert."""
    from mok_compile.kernels.tune import _Problem

    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    sizes = SHAPES[name][1]
    H, I, E, K = sizes.hidden, sizes.intermediate, sizes.experts, sizes.top_k
    problem = _Problem(H, I, E, K, T, routing=layer_routing(name, T) if routing == "layer" else None)
    counts = problem.disp.expert_count.tolist()
    note = f"{routing} routing: {sum(1 for c in counts if c)} of {E} experts hit, {min(counts)}-{max(counts)} rows"
    return problem, note


def block_output(out):
    """A block's output tensor: the first of a tuple (a router's logits or states beside it), else itself."""
    return out[0] if isinstance(out, tuple) else out


def make_runners(family, block, mode=None):
    """Callables x -> out for hf, hf+comp, mok and mok+comp (same weights); `mode`: torch.compile's, for
    both compiled runners (e.g. "reduce-overhead": CUDA graphs on both sides). A hash-routed block gets the first
    x.shape[1] of a fixed row of token ids, and its lookup is timed on both sides."""
    tensors, kw = hf_blocks.op_arguments(family, block)
    shared = getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None)
    token_ids = _token_ids(block)

    def tokens(x):  # the block's extra input: () or its token ids
        return () if token_ids is None else (token_ids[:, :x.shape[1]],)

    def mok(x, with_ids=False):
        x2 = x.reshape(-1, x.shape[-1])
        given = {} if token_ids is None else _given_ids(block, x.shape[1], token_ids)
        out, _, topk_ids = torch.ops.mok.fused_moe(x2, *tensors, **kw, **given)
        out = out.view_as(x)
        out = out if shared is None else out + shared(x)
        return (out, topk_ids) if with_ids else out

    def hf(x):
        return block_output(block(x, *tokens(x)))

    def hf_for_mok(x):  # its own code object: Dynamo caches per code object, one backend each
        return block_output(block(x, *tokens(x)))

    compiled = torch.compile(hf, dynamic=False, mode=mode)
    return {"hf": hf, "hf+comp": compiled, "mok": mok,
            # the backend as a callable: the checkout need not be pip-installed (entry point) on the GPU machine
            "mok+comp": torch.compile(hf_for_mok, backend=mok_backend, dynamic=False, mode=mode)}


def graphed(step):
    """`step` captured in a CUDA graph (the op has no host sync, so it captures), or None if capture fails.

    The replay function holds `step`: a graph reads its inputs at the addresses they had at capture, so whatever
    `step` holds (e.g. a cloned input that nothing else references) must stay allocated as long as the graph may
    be replayed. Returning the bare `graph.replay` let configs_ab's clone be freed and its memory be reused, and
    its fwd+bwd timings then ran on whatever was written there (NOTES v36 (1))."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    except Exception as err:  # report, never hide: the row then shows nan
        print(f"  CUDA graph capture failed: {type(err).__name__}: {err}", flush=True)
        if isinstance(err, torch.OutOfMemoryError) and "expandable_segments" not in os.environ.get(
                "PYTORCH_CUDA_ALLOC_CONF", ""):
            # DeepSeek-V3's fwd+bwd at T=4096 on an 80 GB card: the free memory sits in partly used segments of the
            # caching allocator, which expandable segments let it use (NOTES v78 (2))
            print("  (the caching allocator's free memory is fragmented: run with "
                  "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)", flush=True)
        return None

    def replay():
        graph.replay()

    replay.step = step  # keeps what the graph reads allocated
    return replay


def profile(fn, x, params, label):
    """Where the CPU and the GPU spend one mok fwd+bwd (torch.profiler, 5 steps after warm-up)."""
    from torch.profiler import ProfilerActivity, profile as prof

    step = fwd_bwd(fn, x, params)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        step()
    cpu_ms = (time.perf_counter() - t0) / 20 * 1e3  # host time per step (launches are asynchronous)
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    ka = p.key_averages()
    print(f"--- {label}: host time per fwd+bwd step {cpu_ms:.3f} ms", flush=True)
    print(host_profile(step)[-4000:], flush=True)
    print(ka.table(sort_by="self_cpu_time_total", row_limit=14), flush=True)
    print(ka.table(sort_by="self_device_time_total", row_limit=18), flush=True)


def host_profile(step, steps=10, rows=15) -> str:
    """cProfile of `steps` calls of `step` (host time: launches are asynchronous), top rows by own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(rows)
    return buf.getvalue()


def fwd_bwd(fn, x, params):
    def step():
        for p in params:
            p.grad = None
        x.grad = None
        fn(x).float().square().mean().backward()

    return step


def allocated_without_grads(params) -> int:
    """Bytes allocated on the GPU with the parameters' gradients dropped."""
    for p in params:
        p.grad = None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def peak_bytes(step) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def time_in_rounds(timed, rounds, timer=None) -> dict:
    """{key: [time per round]} for the (key, fn) pairs of `timed`, each timed once per round by `timer` (default
    `bench`), in the listed order in even rounds and reversed in odd ones."""
    timer = timer or bench
    times = collections.defaultdict(list)
    for r in range(rounds):
        for key, fn in (timed if r % 2 == 0 else timed[::-1]):
            times[key].append(timer(fn))
    return times


def write_json(out_dir, name, obj):
    """`obj` as `name` (indented JSON) under the folder `out_dir`, made if missing."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(obj, f, indent=1)


def with_op_graphs(fn, on: bool, grad: bool = False):
    """`fn()` with the op's few-token CUDA graphs (`mok_compile.kernels.graphs`) on, up to MOK_GRAPH_TOKENS (or
    their default bound where that turned them off), or off; the setting is restored after each call. Under
    no_grad unless `grad` (a training step: its forward is the training forward). The A/B of NOTES v49-v50, in one
    process."""
    from mok_compile.kernels import graphs

    bound = (graphs.max_tokens or graphs.DEFAULT_TOKENS) if on else 0

    def run():
        before, graphs.max_tokens = graphs.max_tokens, bound
        try:
            with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
                return fn()
        finally:
            graphs.max_tokens = before

    return run


def _no_grad(fn, x):
    def run():
        with torch.no_grad():
            return fn(x)

    return run


def run_shape(name, tokens, ceilings, log, do_profile=False, mode=None, rounds=3):
    family, sizes, overrides, default_tokens = SHAPES[name]
    torch._dynamo.reset()  # each shape compiles afresh; without this, Dynamo's recompile limit is hit and
    # the "compiled" baseline silently runs eager
    H, I, E, K = sizes.hidden, sizes.intermediate, sizes.experts, sizes.top_k
    block = build_block(family, sizes, overrides)
    check_expert_sizes(family, block, sizes)
    runners = make_runners(family, block, mode)
    params = [p for p in block.parameters() if p.requires_grad]
    rows = []
    for T in tokens or default_tokens:
        x = torch.randn(1, T, H, device="cuda", dtype=torch.bfloat16)
        row = {"shape": name, "T": T, "H": H, "I": I, "E": E, "K": K}
        with torch.no_grad():
            ref = runners["hf"](x).float()
            got, topk_ids = runners["mok"](x, with_ids=True)
            row["mok_vs_hf_rel_err"] = ((got.float() - ref).norm() / ref.norm()).item()
        row["experts_hit"] = int(torch.unique(topk_ids).numel())
        row["floor_fwd_ms"], row["floor_fwd_bwd_ms"] = floors(T, sizes, row["experts_hit"], ceilings)
        if do_profile:
            profile(runners["mok"], x.clone().requires_grad_(), params, f"{name} T={T}")
        steps, graphs = {}, {}
        for which, fn in runners.items():  # compile, warm up, peak memory; no timing yet
            t0 = time.time()
            # The previous runner's gradients (a DeepSeek-V3 layer's: 22 GB) are not this one's: dropped, then their
            # cached blocks returned (empty_cache does not change what is allocated).
            held_before = allocated_without_grads(params)
            torch.cuda.empty_cache()
            fused_before = counters["mok"]["fused_moe"]
            with torch.no_grad():
                fn(x)
            if which == "mok+comp" and counters["mok"]["fused_moe"] == fused_before:
                raise SystemExit(f"{name} T={T}: backend='mok' fused no MoE block (see "
                                 "mok_compile.diagnostics.explain); its column would time plain inductor")
            steps[which] = fwd_bwd(fn, x.clone().requires_grad_(), params)
            steps[which]()  # compile / warm up
            steps[which]()  # the op's few-token CUDA graphs are captured on a signature's second call
            row[f"{which}_fwd_bwd_peak_gb"] = peak_bytes(steps[which]) / 1e9  # (the last step's gradients in its base)
            # What the warm-up left allocated: the op's graphs (their pool and buffers) for the first runner to call
            # it ("mok"; the compiled block's calls replay the same graphs), nothing for HF.
            row[f"{which}_held_gb"] = (allocated_without_grads(params) - held_before) / 1e9
            log(f"  {name} T={T} {which}: peak {row[f'{which}_fwd_bwd_peak_gb']:.2f} GB, held after the warm-up "
                f"{row[f'{which}_held_gb']:.3f} GB "
                f"({time.time() - t0:.0f} s incl. compile)")
        # GPU time alone: the op's work replayed from CUDA graphs (no launch overhead), captured once every column is
        # compiled: the fwd+bwd graph's pool keeps its gradients (23 GB at DeepSeek-V3's sizes), and "mok+comp"'s
        # compile-time probe, which draws a copy of the layer's weights, then found no room on an 80 GB GPU.
        # A graph's pool is memory of its own, so the cached blocks are returned first (at DeepSeek-V3 T=256 on an 80
        # GB H100, 37 GiB cached and unused left the fwd+bwd graph without room).
        torch.cuda.empty_cache()
        with torch.no_grad():
            graphs["mok_graph_fwd"] = graphed(lambda mok=runners["mok"]: mok(x))
        graphs["mok_graph_fwd_bwd"] = graphed(steps["mok"])
        # Timing in rounds, the order reversed every other round, medians: the GPU's clock moves with its load
        # (a kernel timed first after an idle spell ran 10-20% faster than the same kernel later, NOTES v24 (5)),
        # so each column is timed at several points of the run instead of once.
        timed = [(f"{w}_fwd", _no_grad(fn, x)) for w, fn in runners.items()]
        timed += [(f"{w}_fwd_bwd", steps[w]) for w in runners]
        timed += [(k, g) for k, g in graphs.items() if g is not None]
        times = time_in_rounds(timed, rounds)
        for key in ("mok_graph_fwd", "mok_graph_fwd_bwd"):
            times.setdefault(key, [float("nan")])
        for key, ts in times.items():
            row[f"{key}_ms"] = statistics.median(ts)
            row[f"{key}_rounds_ms"] = ts
        del steps, graphs, timed
        for which in runners:
            log(f"  {name} T={T} {which}: fwd {row[f'{which}_fwd_ms']:.3f} ms, fwd+bwd "
                f"{row[f'{which}_fwd_bwd_ms']:.3f} ms (medians of {rounds} rounds)"
                + (f"; CUDA graph: fwd {row['mok_graph_fwd_ms']:.3f}, fwd+bwd {row['mok_graph_fwd_bwd_ms']:.3f} ms"
                   if which == "mok" else ""))
        rows.append(row)
    del block, runners
    torch.cuda.empty_cache()
    return rows


def table(rows, ceilings) -> str:
    """x = the compiled baseline's time / ours (mok: the op called eagerly; mok+comp: the block under
    torch.compile(backend="mok"), the user's path); "x at floor" = the compiled baseline's time / the floor,
    the most any kernel could reach against it in this run."""
    lines = [f"ceilings: bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s, copy {ceilings['copy_tbps']:.2f} TB/s",
             "| shape | T | hf fwd | hf+comp fwd | mok fwd | x | mok+comp fwd | x | floor/mok | x at floor | hf f+b "
             "| hf+comp f+b | mok f+b | x | mok+comp f+b | x | floor/mok | x at floor "
             "| peak GB hf / comp / mok / mok+comp | mok held GB | err vs hf | mok graph fwd / f+b |",
             "|" + "---|" * 22]
    for r in rows:
        cells = [r["shape"], r["T"]]
        for phase in ("fwd", "fwd_bwd"):
            base = r[f"hf+comp_{phase}_ms"]
            cells += [f"{r[f'hf_{phase}_ms']:.3f}", f"{base:.3f}"]
            for which in ("mok", "mok+comp"):
                cells += [f"{r[f'{which}_{phase}_ms']:.3f}", f"{base / r[f'{which}_{phase}_ms']:.2f}"]
            cells += [f"{r[f'floor_{phase}_ms'] / r[f'mok_{phase}_ms']:.2f}", f"{base / r[f'floor_{phase}_ms']:.2f}"]
        cells.append(" / ".join(f"{r[f'{w}_fwd_bwd_peak_gb']:.2f}" for w in ("hf", "hf+comp", "mok", "mok+comp")))
        cells.append(f"{r['mok_held_gb']:.3f}")
        cells += [f"{r['mok_vs_hf_rel_err']:.1e}", f"{r['mok_graph_fwd_ms']:.3f} / {r['mok_graph_fwd_bwd_ms']:.3f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["shape"] for r in rows):
        rs = [r for r in rows if r["shape"] == name]
        T = [r["T"] for r in rs]
        ax1.plot(T, [r["hf+comp_fwd_ms"] / r["mok_fwd_ms"] for r in rs], "o-", label=f"{name} fwd")
        ax1.plot(T, [r["hf+comp_fwd_bwd_ms"] / r["mok_fwd_bwd_ms"] for r in rs], "s--", label=f"{name} fwd+bwd")
        ax1.plot(T, [r["hf+comp_fwd_ms"] / r["mok+comp_fwd_ms"] for r in rs], "^:", label=f"{name} fwd, compiled")
        ax2.plot(T, [r["floor_fwd_ms"] / r["mok_fwd_ms"] for r in rs], "o-", label=f"{name} fwd")
        ax2.plot(T, [r["floor_fwd_bwd_ms"] / r["mok_fwd_bwd_ms"] for r in rs], "s--", label=f"{name} fwd+bwd")
    for ax, title in ((ax1, "speedup of mok vs HF grouped_mm + torch.compile"), (ax2, "mok: fraction of floor")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens T")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax1.axhline(1.0, color="k", lw=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="", help="comma-separated T values (default: per shape)")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables of mok fwd+bwd")
    ap.add_argument("--mode", default=None, help='torch.compile mode of both compiled columns, e.g. "reduce-overhead" '
                    "(CUDA graphs: at few tokens the eager columns time the host, not the GPU)")
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds per column, alternating order (medians)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, "moe_layer.log"), "a")

    def log(msg):
        print(msg, flush=True)
        log_file.write(msg + "\n")

    torch.manual_seed(0)
    for knob in ("recompile_limit", "cache_size_limit"):  # one compile per (shape, T, grad mode)
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    ceilings = measure_ceilings()
    log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; {ceilings}; compile mode {args.mode}")
    tokens = [int(t) for t in args.tokens.split(",") if t]
    rows = []
    for name in args.shapes.split(","):
        if not hf_blocks.available([SHAPES[name][0]]):
            log(f"{name}: skipped (this transformers, {transformers.__version__}, has no {SHAPES[name][0]})")
            continue
        rows += run_shape(name, tokens, ceilings, log, args.profile, args.mode, args.rounds)
        write_json(args.out, "results.json", {"ceilings": ceilings, "compile_mode": args.mode, "rows": rows})
    plot(rows, os.path.join(args.out, "speedup.png"))
    log(table(rows, ceilings))


if __name__ == "__main__":
    main()
