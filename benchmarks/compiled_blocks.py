"""MoE blocks the layer benchmark cannot call the op for directly, timed as a user runs them: compiled by inductor
against `backend="mok"`, on the GPU.

    python -m benchmarks.compiled_blocks [--families muse_spark,ergo,zaya,granitemoe,axk2,qwen3_moe]
        [--tokens 256,4096] [--rounds 3] [--mode reduce-overhead] [--lora-rank R | --peft-rank R]

`benchmarks.moe_layer`'s "mok" column calls the op on the block's own router weight; these blocks have more around
the op than it computes: Muse Spark's and Ergo's a post-expert RMSNorm (the op's `post_norm`), each from transformers
>= 5.25 at a quarter of its experts (64 of 256, top-8), H=4096 (Muse Spark's experts at its moe_hidden_size, 3/4 of
that), I=2048, the norm weights around their identity; Zaya's an MLP router (on a 256-wide projection of the
tokens) whose logits the op takes, at Zaya1's sizes (H=2048, I=2048, 16 experts and its skip expert, top-1); and,
as the small-experts case among the blocks the layer benchmark does time, Granite-MoE's at Granite-3.0-1B-A400M's
sizes (H=1024, I=512, 32 experts, top-8), where the op's host time exceeds its GPU time past 512 tokens too; and
AXK2's (transformers >= 5.25; H=2048, I=512, 128 experts, top-8, the best 4 of 8 groups), whose top-k stays in the
graph with the op taking its ids (a choice the op cannot make: dropped groups filled with 0 under a selection bias);
and Qwen3-30B-A3B's, for --lora-rank: a LoRA delta on every block's expert weights, registered with
`torch.nn.utils.parametrize` as parametrization-based LoRA fine-tuning does, which both sides compute in each call
(the op takes the computed weights); or, for --peft-rank, PEFT's LoRA on both expert weights
(`LoraConfig(target_parameters=...)`, base weights frozen, as PEFT fine-tuning trains), where the compiled baseline
runs PEFT as it ships (its graph breaks, counted) and `backend="mok"` the forward `mok_compile.peft_experts` traces
(one graph, fused). bf16, grouped_mm experts, random weights (std 0.02). Forward (no_grad) and
forward+backward (loss = mean(out^2); x and every parameter requiring grad), medians of `do_bench` over --rounds
rounds, the order reversed every other round, and the same for calls back to back ("loop": 20 calls between two CUDA
events, as a training loop runs them; where a step's host time exceeds its GPU time that is the host's time, which
`do_bench`'s cache flush before each call partly hides); printed as ms and the compiled baseline's time over mok's
(x), with mok's and the compiled baseline's relative errors (norms) against HF's eager output (forward rows) and
gradients (fwd+bwd rows: the largest over x and the parameters), and the peak memory of one forward+backward
(`moe_layer.peak_bytes`, GB above what was allocated before it) of HF's eager block, the compiled baseline and mok;
then the op's own CUDA graphs that T left cached (`mok_compile.kernels.graphs`) and the buffers they keep, memory the
peak does not show. --mode is torch.compile's for both compiled columns: "reduce-overhead" replays CUDA graphs on both
sides, which takes most of the host's time out where the block's GPU work is less than it (Zaya's at top-1).
"""

import argparse
import statistics

import torch
from torch._dynamo.utils import counters

import mok_compile  # noqa: F401  (registers torch.ops.mok.*)
from benchmarks.moe_layer import block_output, build_block, fwd_bwd, peak_bytes, time_in_rounds
from benchmarks.power import ms_per_call
from mok_compile import hf_blocks, peft_experts
from mok_compile.backend import mok_backend
from mok_compile.config import parse_options
from mok_compile.kernels import moe

POST_NORM_SIZES = hf_blocks.BlockSizes(hidden=4096, intermediate=2048, experts=64, top_k=8)
# family -> (sizes, config overrides)
FAMILIES = {
    "muse_spark": (POST_NORM_SIZES, {}),
    "ergo": (POST_NORM_SIZES, {}),
    "zaya": (hf_blocks.BlockSizes(hidden=2048, intermediate=2048, experts=16, top_k=1), {"router_hidden_size": 256}),
    "granitemoe": (hf_blocks.BlockSizes(hidden=1024, intermediate=512, experts=32, top_k=8), {}),
    # Qwen3-30B-A3B's layer, which `benchmarks.moe_layer` times too: here for --lora-rank (LoRA fine-tuning).
    "qwen3_moe": (hf_blocks.BlockSizes(hidden=2048, intermediate=768, experts=128, top_k=8), {}),
    # AXK2's default sizes with its group-limited selection on (8 groups, the best 4): the op takes the ids of the
    # selection kept in the graph.
    "axk2": (hf_blocks.BlockSizes(hidden=2048, intermediate=512, experts=128, top_k=8),
             {"n_group": 8, "topk_group": 4}),
}


def _eager(block):
    """x -> the block's output (Zaya's block also returns its router states)."""
    return lambda x: block_output(block(x))


def _runners(block, mode=None, peft_as_shipped=False):
    def hf(x):
        return block_output(block(x))

    def hf_for_mok(x):  # its own code object: Dynamo caches per code object, one backend each
        return block_output(block(x))

    base = torch.compile(hf, dynamic=False, mode=mode)
    return {"hf+comp": _with_peft_as_shipped(base) if peft_as_shipped else base,
            "mok+comp": torch.compile(hf_for_mok, backend=mok_backend, dynamic=False, mode=mode)}


def _with_peft_as_shipped(fn):
    """`fn` run with PEFT's own `ParamWrapper.forward` (what a user without mok compiles), the traced one put back
    after each call for the `backend="mok"` column."""
    def run(x):
        with peft_experts.shipped_forward():
            return fn(x)
    return run


def add_peft_expert_lora(block, rank):
    """PEFT's LoRA of `rank` on the block's stacked expert weights, the base weights frozen (PEFT fine-tuning); B
    random, not PEFT's zeros, so that the delta is not 0."""
    import peft

    for p in block.parameters():
        p.requires_grad_(False)
    torch.manual_seed(0)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                             target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    block = peft.inject_adapter_in_model(config, block)
    if not peft_experts.install():
        raise SystemExit(f"peft {peft.__version__}: mok_compile.peft_experts does not know its LoRA layers")
    return block


def _norm_weights_near_identity_(block):
    """The post-norm's weight near its identity (Ergo's 1, Muse Spark's 0 under its 1 + w), not build_block's 0.02."""
    norm = block.experts.post_expert_norm
    with torch.no_grad():
        norm.weight.copy_(torch.randn_like(norm.weight) * 0.1 + (1.0 if norm.weight.dim() == 2 else 0.0))


def run_family(family, tokens, rounds, mode=None, lora_rank=0, peft_rank=0):
    torch._dynamo.reset()
    sizes, overrides = FAMILIES[family]
    block = build_block(family, sizes, overrides)
    post = family in hf_blocks.POST_NORM_FAMILIES
    if post:
        _norm_weights_near_identity_(block)
    if lora_rank:
        hf_blocks.add_expert_lora_(block, lora_rank, std=0.02)
    if peft_rank:
        block = add_peft_expert_lora(block, peft_rank)
    eager = _eager(block)
    params = [p for p in block.parameters() if p.requires_grad]
    runners = _runners(block, mode, peft_as_shipped=bool(peft_rank))
    # the backend's own test: under CUDA graphs it leaves the saved h unconsumed, by design
    graphed = parse_options(None, mode).inductor_patches().get("triton.cudagraphs")
    for T in tokens:
        for cache in (moe.FORWARD_GRAPHS, moe.BACKWARD_GRAPHS):  # this T's graphs only, for the line below
            cache.clear()
        x = torch.randn(1, T, sizes.hidden, device="cuda", dtype=torch.bfloat16)
        fused_before = counters["mok"]["fused_moe"]
        with torch.no_grad():
            ref = eager(x).float()
            breaks = [sum(counters["graph_break"].values())]
            got = runners["mok+comp"](x).float()
            breaks.append(sum(counters["graph_break"].values()))
            base_got = runners["hf+comp"](x).float()
            breaks.append(sum(counters["graph_break"].values()))
        if counters["mok"]["fused_moe"] == fused_before:
            raise SystemExit(f"{family}: backend='mok' fused no MoE block (see mok_compile.diagnostics.explain)")
        if peft_rank:
            print(f"{'':>17} graph breaks of this T's compile: mok+comp {breaks[1] - breaks[0]}, "
                  f"hf+comp {breaks[2] - breaks[1]}")
        errors = {"fwd": [_rel(out, ref) for out in (got, base_got)]}
        want = _gradients(eager, x, params)
        peak, timed, grads = {"eager": peak_bytes(fwd_bwd(eager, x.clone().requires_grad_(), params)) / 1e9}, [], {}
        for name, fn in runners.items():
            def forward(fn=fn):
                with torch.no_grad():
                    fn(x)

            consumed = counters["mok"]["backward_consume"]
            grads[name] = _gradients(fn, x, params)  # compiled and warm before timing
            if name == "mok+comp" and counters["mok"]["backward_consume"] == consumed and not graphed:
                print(f"{family}: the compiled backward does not consume the saved h" + (" (and y)" if post else ""))
            step = fwd_bwd(fn, x.clone().requires_grad_(), params)
            step()
            settle(step)
            peak[name] = peak_bytes(step) / 1e9
            timed += [(("fwd", name), forward), (("fwd+bwd", name), step)]
        for _, fn in timed:
            settle(fn)
        errors["fwd+bwd"] = [max(_rel(a, b) for a, b in zip(grads[n], want)) for n in ("mok+comp", "hf+comp")]
        times = time_in_rounds(timed, rounds)
        loops = time_in_rounds(timed, rounds, timer=back_to_back)
        for phase in ("fwd", "fwd+bwd"):
            base, mok = (statistics.median(times[phase, n]) for n in ("hf+comp", "mok+comp"))
            base_loop, mok_loop = (statistics.median(loops[phase, n]) for n in ("hf+comp", "mok+comp"))
            err, base_err = errors[phase]
            memory = "" if phase == "fwd" else "".join(f" {peak[n]:>8.2f}" for n in ("eager", "hf+comp", "mok+comp"))
            print(f"{family:>10} {T:>6} {phase:>8} {base:>9.3f} {mok:>9.3f} {base / mok:>6.2f} {base_loop:>9.3f} "
                  f"{mok_loop:>9.3f} {base_loop / mok_loop:>6.2f} {err:>9.1e} {base_err:>9.1e}{memory}")
        print("{:>17} the op's graphs: {} forward, {:.0f} MB; {} backward, {:.0f} MB".format(
            "", len(moe.FORWARD_GRAPHS), moe.FORWARD_GRAPHS.nbytes / 1e6, len(moe.BACKWARD_GRAPHS),
            moe.BACKWARD_GRAPHS.nbytes / 1e6))


def settle(fn, calls: int = 100) -> int:
    """Calls `fn` until a call compiles nothing; how many calls that took. PEFT's forward as it ships makes a new
    parametrized class on each call, on whose type Dynamo guards, so each call compiles again until Dynamo's recompile
    limit, after which those frames run eagerly: a user's steady state, which timing must not start before."""
    for n in range(1, calls + 1):
        compiled = counters["stats"]["unique_graphs"]
        fn()
        if counters["stats"]["unique_graphs"] == compiled:
            return n
    raise SystemExit(f"still compiling after {calls} calls")


def back_to_back(fn, calls: int = 20) -> float:
    """ms per call over `calls` calls back to back (after 3 more), as a training loop runs them: where the host takes
    longer than the GPU, this is the host's time, which `do_bench` (a cache flush before each call, events around
    it) partly hides."""
    for _ in range(3):
        fn()
    return ms_per_call(fn, calls)


def _rel(got, want) -> float:
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm()).item()


def _gradients(fn, x, params):
    """[d x, d params...] of one forward+backward of `fn` (the benchmark's loss), copied: under CUDA graphs a
    gradient may be a graph's output, which its next replay overwrites."""
    x = x.clone().requires_grad_()
    fwd_bwd(fn, x, params)()
    return [g.clone() for g in (x.grad, *(p.grad for p in params))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--tokens", default="256,4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", default=None, help='torch.compile mode of both compiled columns, e.g. '
                                                     '"reduce-overhead"')
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="a LoRA delta of this rank on each block's expert weights (torch.nn.utils.parametrize, "
                             "`hf_blocks.add_expert_lora_`), as LoRA fine-tuning computes them: W + B @ A each call")
    parser.add_argument("--peft-rank", type=int, default=0,
                        help="PEFT's LoRA of this rank on each block's expert weights (`target_parameters`, base "
                             "weights frozen); the compiled baseline runs PEFT's own forward")
    args = parser.parse_args(argv)
    if args.lora_rank and args.peft_rank:
        raise SystemExit("--lora-rank and --peft-rank are two ways to add LoRA; give one")
    families = args.families.split(",")
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise SystemExit(f"unknown families {sorted(unknown)}; known: {', '.join(FAMILIES)}")
    missing = set(families) - set(hf_blocks.available(families))
    if missing:
        raise SystemExit(f"{sorted(missing)} need transformers >= 5.25")
    for family in families:
        print(f"{family}: {FAMILIES[family][0]}")
    print(f"bf16 (ms, medians of {args.rounds} rounds; x = hf+comp / mok+comp; compile mode {args.mode}; "
          f"'loop' columns: back-to-back calls" + (f"; LoRA rank {args.lora_rank} on the expert weights)"
                                                   if args.lora_rank else f"; PEFT LoRA rank {args.peft_rank} on "
                                                   "the expert weights)" if args.peft_rank else ")"))
    print(f"{'family':>10} {'T':>6} {'pass':>8} {'hf+comp':>9} {'mok+comp':>9} {'x':>6} {'hf loop':>9} {'mok loop':>9}"
          f" {'x loop':>6} {'mok err':>9} {'comp err':>9} {'GB eager':>8} {'GB comp':>8} {'GB mok':>8}")
    for family in families:
        run_family(family, [int(t) for t in args.tokens.split(",")], args.rounds, args.mode, args.lora_rank,
                   args.peft_rank)


if __name__ == "__main__":
    main()
