"""End to end: a 4-layer Qwen3-MoE at the 30B-A3B layer sizes, backend="mok" vs backend="inductor".

    python -m benchmarks.e2e_qwen3 --out DIR [--seq 4096 --batch 2] [--ddp] [--model gemma4]
    python -m benchmarks.e2e_qwen3 --out DIR --decode 1,8,64
    python -m benchmarks.e2e_qwen3 --out DIR --seq 256 --batch 1 --mode reduce-overhead
    python -m benchmarks.e2e_qwen3 --out DIR --checkpoint     # every decoder layer activation-checkpointed
    python -m benchmarks.e2e_qwen3 --out DIR --peft-rank 16   # PEFT LoRA fine-tuning (attention and experts)
    torchrun --nproc-per-node 2 -m benchmarks.e2e_qwen3 --out DIR --ddp     # DDP over two GPUs

Random weights (std 0.02), bf16, experts_implementation="grouped_mm" (transformers' default).
Measures one training step (forward + loss + backward, no optimizer) and one prefill forward
(no_grad) and reports tokens/s: every variant is compiled and warm first, then each step is timed once per round
(triton.testing.do_bench's median; with --ddp the mean of 10 back-to-back calls, as many on every rank) in --rounds
rounds, the order reversed every other round, and the median over the rounds is reported. (Timed one variant after
the other instead, the second read about 1.3x slower at a few hundred tokens, where a step waits on the host:
NOTES v52.)
--profile adds, per backend, the GPU time of one training step inside the `mok::` ops (torch.profiler)
and the rest, and from them the best training speedup any MoE kernel could give: inductor's step over
(mok's step without its MoE time + every layer's MoE at the fwd+bwd floor, `moe_layer`'s definition).
--ddp wraps the model in DistributedDataParallel (NCCL; one rank unless started by torchrun) and times
inductor and mok under Dynamo's default DDP graph cutting (which cuts the MoE blocks: mok fuses nothing) and mok
with `optimize_ddp=False` (mok fuses every block, then cuts the graph into DDP's buckets, `mok_compile.ddp`), and
that without the cutting (`ddp_buckets=False`: all-reduce starts after the whole backward).
--mode sets torch.compile's mode for both backends: at a few hundred tokens a step in default mode waits on the
host on both sides (NOTES v52), and "reduce-overhead" replays each compiled graph from a CUDA graph.
--checkpoint checkpoints every decoder layer (transformers' activation checkpointing, non-reentrant; Dynamo told to
trace the regions, `hf_blocks.checkpoint_layers`) for both backends: the backward runs each layer again. Every run
reports the training step's peak memory above what was allocated before it (gradients of the step before dropped).
--decode B,... times, per batch size B, a decode-shaped forward instead (B sequences of one token, no KV cache,
no_grad; the MoE layers see T = B tokens), in default mode: inductor, mok, and mok with the op's few-token CUDA
graphs off (`mok_compile.kernels.graphs`, NOTES v49), in alternating rounds.
--peft-rank R fine-tunes with PEFT's LoRA of rank R, as a PEFT user does: `get_peft_model` with LoRA on the attention
projections (q/k/v/o_proj) and on the expert weights (`target_parameters`), the base weights frozen. Three variants:
inductor with PEFT's forward as it ships (its registration of a parametrization on each call breaks the graph in
every MoE layer), inductor with the forward `mok_compile.peft_experts` traces (one graph; that module is installed
for any backend once mok_compile is imported), and mok (that graph, each block fused).
--model gemma4 runs a Gemma 4 text model instead, every layer with a dense MLP and an MoE block beside it (its router
on its own normalisation of the residual, weights times a learned per-expert scale: the op's `expert_scale`), at
sizes chosen here: hidden 2816, 128 experts top-8 of intermediate 704, dense MLP 2112, 16 heads of 256 (8 KV),
three sliding-window layers (1024) and a global one, vocabulary 262144 (tied).
--model longcat (transformers >= 5.25) runs a LongCat-Flash model: each layer two MLA attention sublayers, two dense
MLPs (4096) and one MoE block whose router ranks 64 experts (1024, top-12) and 32 zero-computation experts (the op's
`identity_experts`), hidden 2048, 16 heads, vocabulary 131072.
--model granitemoe runs a Granite-MoE model at Granite-3.0-1B-A400M's sizes (its 24 layers with --layers 24): hidden
1024, 32 experts top-8 of intermediate 512, 16 heads (8 KV), vocabulary 49155, its embedding, residual, attention and
logits multipliers; experts this small leave a step waiting on the host at a few thousand tokens.
Each run ends with the op's own CUDA graphs left cached (`mok_compile.kernels.graphs`) and the memory they keep.
The mok backend is passed as a callable so that no installed entry point is needed (a plain
checkout on PYTHONPATH works: mok_compile maps passes/ itself).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import time

import torch


# The MoE layer's (H, I, E, K) of each --model.
MOE_SIZES = {"qwen3": (2048, 768, 128, 8), "gemma4": (2816, 704, 128, 8), "longcat": (2048, 1024, 64, 12),
             "granitemoe": (1024, 512, 32, 8)}
# Router choices past the experts (identity experts, which compute nothing) of each --model that has them.
IDENTITY_EXPERTS = {"longcat": 32}


def _config(model, layers, seq):
    import transformers as tf

    if model == "longcat":
        return tf.LongcatFlashConfig(
            hidden_size=2048, ffn_hidden_size=4096, expert_ffn_hidden_size=1024, n_routed_experts=64,
            zero_expert_num=IDENTITY_EXPERTS[model], moe_topk=12, routed_scaling_factor=6.0, num_layers=layers,
            num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768, kv_lora_rank=256, qk_nope_head_dim=64,
            qk_rope_head_dim=32, head_dim=32, v_head_dim=64, vocab_size=131072, max_position_embeddings=max(seq, 4096))
    if model == "granitemoe":
        return tf.GraniteMoeConfig(
            hidden_size=1024, intermediate_size=512, num_local_experts=32, num_experts_per_tok=8,
            num_attention_heads=16, num_key_value_heads=8, vocab_size=49155, embedding_multiplier=12.0,
            logits_scaling=6.0, residual_multiplier=0.22, attention_multiplier=0.015625, num_hidden_layers=layers,
            max_position_embeddings=max(seq, 4096))
    if model == "gemma4":
        return tf.Gemma4TextConfig(
            hidden_size=2816, intermediate_size=2112, moe_intermediate_size=704, num_experts=128, top_k_experts=8,
            enable_moe_block=True, num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=262144,
            hidden_size_per_layer_input=0, sliding_window=1024, num_hidden_layers=layers,
            layer_types=["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)],
            max_position_embeddings=max(seq, 4096))
    return tf.Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                             num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32,
                             num_key_value_heads=4, head_dim=128, vocab_size=151936, num_hidden_layers=layers,
                             max_position_embeddings=max(seq, 4096))


def build_model(layers, seq, model="qwen3"):
    """`model`'s CausalLM, bf16 on the GPU, random weights (std 0.02; norms and Gemma 4's router input scale 1,
    its per-expert weight scales uniform in [0.5, 1.5])."""
    import transformers as tf

    cfg = _config(model, layers, seq)
    cfg._experts_implementation = "grouped_mm"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            lm = tf.AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(old)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "norm" in name or name.endswith("router.scale"):
                p.fill_(1.0)
            elif name.endswith("per_expert_scale"):
                p.copy_(torch.rand(p.shape, device="cuda", generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, device="cuda", generator=gen) * 0.02)
    return lm.train()


def with_peft_lora(model, rank):
    """`model` fine-tuned as PEFT does it: LoRA of `rank` (alpha 2 * rank, B random rather than PEFT's zeros, so that
    the delta is not 0) on the attention projections and both expert weights, the base weights frozen."""
    import peft

    torch.manual_seed(0)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    model = peft.get_peft_model(model, config)
    from mok_compile import peft_experts

    if not peft_experts.install():
        raise SystemExit(f"peft {peft.__version__}: mok_compile.peft_experts does not know its LoRA layers")
    return model


def own_inductor(gm, example_inputs, mode=None):
    """inductor as a backend Dynamo does not take for the "inductor" string's: it reuses the frames compiled for an
    equal backend, and every torch.compile(backend="inductor") of one mode is equal to the others, so a second
    inductor variant of one model would run the first one's code (PEFT as shipped, for the traced variant)."""
    return torch._TorchCompileInductorWrapper(mode, None, None)(gm, example_inputs)


def step_split(step) -> dict:
    """GPU kernel time of one `step` inside top-level `mok::` ops, in ms (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()

    def under_mok(ev):
        ev = ev.cpu_parent
        while ev is not None:
            if ev.name.startswith("mok::"):
                return True
            ev = ev.cpu_parent
        return False

    moe = sum(ev.device_time_total for ev in prof.events() if ev.name.startswith("mok::") and not under_mok(ev))
    return {"gpu_moe_ms": moe / 1e3}


def print_bound(results, layers, tokens, model="qwen3"):
    """The best training speedup over inductor if every MoE layer ran at its fwd+bwd floor."""
    from benchmarks.moe_layer import measure_ceilings

    ceil = measure_ceilings()
    H, I, E, K = MOE_SIZES[model]
    K = K * E / (E + IDENTITY_EXPERTS.get(model, 0))  # pairs that run an expert, at even routing
    flops = 3 * tokens * K * 3 * 2 * H * I
    weight_bytes = 3 * E * 3 * H * I * 2
    floor_ms = max(flops / ceil["matmul_tflops"] / 1e9, weight_bytes / ceil["copy_tbps"] / 1e9)
    mok = results["mok"]
    rest = mok["train_ms"] - mok["gpu_moe_ms"]
    best = results["inductor"]["train_ms"] / (rest + layers * floor_ms)
    results["moe_floor_fwd_bwd_ms_per_layer"] = floor_ms
    results["train_speedup_bound"] = best
    print(f"mok train step {mok['train_ms']:.1f} ms: MoE ops {mok['gpu_moe_ms']:.1f} ms GPU ({layers} layers, "
          f"{mok['gpu_moe_ms'] / layers:.2f} ms each; fwd+bwd floor {floor_ms:.2f} ms each), the rest {rest:.1f} ms; "
          f"with every MoE layer at its floor the step would be {rest + layers * floor_ms:.1f} ms: "
          f"at most {best:.2f}x over inductor ({results['inductor']['train_ms']:.1f} ms)", flush=True)


def decode(model, batches, out, name="qwen3"):
    """Per batch size: ms of a one-token forward of B sequences under inductor, mok, and mok without the op's
    graphs; x = inductor's time / that column's."""
    from benchmarks.moe_layer import time_in_rounds, with_op_graphs
    from mok_compile.backend import mok_backend

    torch._dynamo.reset()
    torch._dynamo.config.cache_size_limit = 64

    def for_inductor(ids):  # one code object per backend: Dynamo caches compiled frames by code object
        return model(input_ids=ids, use_cache=False)

    def for_mok(ids):
        return model(input_ids=ids, use_cache=False)

    compiled = {"inductor": torch.compile(for_inductor, dynamic=False),
                "mok": torch.compile(for_mok, backend=mok_backend, dynamic=False)}
    results = {}
    print("| B | inductor ms | mok ms | x | mok, op graphs off ms | x |\n|---|---|---|---|---|---|", flush=True)
    for B in batches:
        ids = torch.randint(0, model.config.vocab_size, (B, 1), device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(B))

        timed = [("inductor", with_op_graphs(functools.partial(compiled["inductor"], ids), False)),
                 ("mok", with_op_graphs(functools.partial(compiled["mok"], ids), True)),
                 ("mok off", with_op_graphs(functools.partial(compiled["mok"], ids), False))]
        for _, run in timed:  # compile, warm up, capture
            for _ in range(3):
                run()
        t = {k: statistics.median(v) for k, v in time_in_rounds(timed, 5).items()}
        results[B] = t
        print(f"| {B} | {t['inductor']:.3f} | {t['mok']:.3f} | {t['inductor'] / t['mok']:.2f} | {t['mok off']:.3f} "
              f"| {t['inductor'] / t['mok off']:.2f} |", flush=True)
    with open(os.path.join(out, f"e2e_{name}_decode.json"), "w") as f:
        json.dump(results, f, indent=1)


def main():
    import triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="split the training step into MoE and the rest")
    ap.add_argument("--ddp", action="store_true", help="the model in DistributedDataParallel (see the docstring)")
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds, every variant once per round")
    ap.add_argument("--mode", default=None, help='torch.compile mode of both backends, e.g. "reduce-overhead"')
    ap.add_argument("--decode", help="comma-separated batch sizes: time one-token forwards instead (docstring)")
    ap.add_argument("--model", default="qwen3", choices=sorted(MOE_SIZES), help="the model (see the docstring)")
    ap.add_argument("--checkpoint", action="store_true", help="activation-checkpoint every decoder layer")
    ap.add_argument("--peft-rank", type=int, default=0, help="PEFT LoRA fine-tuning of this rank (the docstring)")
    args = ap.parse_args()
    if args.peft_rank and (args.ddp or args.decode or args.profile):
        raise SystemExit("--peft-rank times a single-GPU training step and prefill; not with --ddp, --decode or "
                         "--profile")
    os.makedirs(args.out, exist_ok=True)
    if args.decode:
        return decode(build_model(args.layers, args.seq, args.model).eval(), [int(b) for b in args.decode.split(",")],
                      args.out, args.model)
    from benchmarks.compiled_blocks import settle
    from benchmarks.moe_layer import time_in_rounds
    from benchmarks.power import ms_per_call
    from mok_compile import peft_experts
    from mok_compile.backend import mok_backend
    from torch._dynamo.utils import counters

    rank = 0
    variants = [("inductor", "inductor", None), ("mok", mok_backend, None)]
    if args.ddp:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531"), ("RANK", "0"),
                           ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(key, value)
        rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)  # build_model's "cuda" is this rank's GPU
        dist.init_process_group("nccl")
        model = DDP(build_model(args.layers, args.seq, args.model), device_ids=[local])
        whole = functools.partial(mok_backend, options={"ddp_buckets": False})
        variants = [("inductor (DDP)", "inductor", True), ("mok (DDP, Dynamo cuts)", mok_backend, True),
                    ("mok (DDP, optimize_ddp=False)", mok_backend, False),
                    ("mok (DDP, optimize_ddp=False, uncut)", whole, False)]
    else:
        model = build_model(args.layers, args.seq, args.model)
    if args.peft_rank:
        model = with_peft_lora(model, args.peft_rank)
        variants = [("inductor (PEFT as shipped)", "inductor", None), ("inductor (PEFT traced)", own_inductor, None),
                    ("mok", mok_backend, None)]
    if args.checkpoint:
        from mok_compile.hf_blocks import checkpoint_layers

        checkpoint_layers(model.module if args.ddp else model)
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    say = print if rank == 0 else (lambda *a, **k: None)
    vocab = (model.module if args.ddp else model).config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(rank))
    tokens = args.batch * args.seq
    results, tails, steps = {}, {}, {}
    torch._dynamo.reset()
    # (--peft-rank: Dynamo's default recompile limit, which ends PEFT's recompiles (`settle`) as a user's run ends them)
    torch._dynamo.config.cache_size_limit = 8 if args.peft_rank else 64
    for name, backend, optimize_ddp in variants:
        # No reset between the variants: every compiled step stays callable, so that all are timed in alternating
        # rounds on the same heap and host state. Dynamo keys its cache entries by the backend callable, so each
        # variant gets one of its own (a partial of a shared backend is a new callable).
        counters.clear()
        own = backend if isinstance(backend, str) else functools.partial(backend)
        compiled = torch.compile(model, backend=own, mode=args.mode)
        patch = {} if optimize_ddp is None else {"optimize_ddp": optimize_ddp}

        peft_forward = peft_experts.shipped_forward if "as shipped" in name else contextlib.nullcontext

        def train_step(compiled=compiled, patch=patch, peft_forward=peft_forward):
            with torch._dynamo.config.patch(**patch), peft_forward():
                torch.compiler.cudagraph_mark_step_begin()  # (a no-op without CUDA graphs)
                model.zero_grad(set_to_none=True)
                compiled(input_ids=ids, labels=ids).loss.backward()

        def prefill(compiled=compiled, patch=patch, peft_forward=peft_forward):
            with torch._dynamo.config.patch(**patch), torch.no_grad(), peft_forward():
                torch.compiler.cudagraph_mark_step_begin()
                return compiled(input_ids=ids)

        t0 = time.time()
        train_step()
        tails[name] = prefill().logits[:, -8:].float()  # same weights and input: the backends must agree
        torch.cuda.synchronize()
        results[name] = {"compile_s": time.time() - t0, "mok_counters": dict(counters["mok"]),
                         "graph_breaks": sum(counters["graph_break"].values())}
        for _ in range(2):  # warm: the op's few-token graphs are captured on a signature's second call
            train_step()
            prefill()
        results[name]["warm_calls"] = [settle(train_step), settle(prefill)]  # PEFT as shipped: its recompiles
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        train_step()
        torch.cuda.synchronize()
        results[name]["train_peak_gb"] = (torch.cuda.max_memory_allocated() - start) / 1e9
        steps[name] = (train_step, prefill)
    gc.collect()
    timed = [(name + kind, steps[name][i]) for name in steps for i, kind in enumerate(("/train", "/prefill"))]
    if args.ddp:  # every rank the same number of calls (do_bench sizes its runs per rank): DDP's collectives match
        timer = functools.partial(ms_per_call, calls=10)
    else:
        timer = functools.partial(triton.testing.do_bench, warmup=3, rep=30, return_mode="median")
    times = time_in_rounds(timed, args.rounds, timer=timer)
    for name in steps:
        t_train, t_fwd = (statistics.median(times[name + kind]) for kind in ("/train", "/prefill"))
        results[name].update({"train_ms": t_train, "prefill_ms": t_fwd, "train_tok_s": tokens / t_train * 1e3,
                              "prefill_tok_s": tokens / t_fwd * 1e3,
                              "train_ms_rounds": times[name + "/train"], "prefill_ms_rounds": times[name + "/prefill"]})
        if args.profile:
            results[name].update(step_split(steps[name][0]))
        say(name, results[name], flush=True)
    base, *others = [name for name, _, _ in variants]
    r = results
    say("| backend | train step ms | train tok/s | train peak GB | prefill ms | prefill tok/s |\n"
        "|---|---|---|---|---|---|")
    for name in (base, *others):
        say(f"| {name} | {r[name]['train_ms']:.1f} | {r[name]['train_tok_s']:.0f} | {r[name]['train_peak_gb']:.2f} "
            f"| {r[name]['prefill_ms']:.1f} | {r[name]['prefill_tok_s']:.0f} |")
    for name in others:
        a, b = tails[base], tails[name]
        r[name]["logits_rel_err_vs_" + base.split()[0]] = err = ((a - b).norm() / a.norm()).item()
        say(f"{name} / {base}: train {r[name]['train_tok_s'] / r[base]['train_tok_s']:.2f}x, prefill "
            f"{r[name]['prefill_tok_s'] / r[base]['prefill_tok_s']:.2f}x; logits rel err {err:.1e}; "
            f"{r[name]['mok_counters']}" + (f"; graph breaks {r[name]['graph_breaks']} (the baseline's "
                                             f"{r[base]['graph_breaks']})" if args.peft_rank else ""))
    if args.profile and not args.ddp:
        print_bound(results, args.layers, tokens, args.model)
    from mok_compile.kernels import moe

    results["op_graphs"] = {name: (len(cache), cache.nbytes) for name, cache in
                            (("forward", moe.FORWARD_GRAPHS), ("backward", moe.BACKWARD_GRAPHS))}
    say("the op's graphs: " + "; ".join(f"{n} {name}, {b / 1e6:.0f} MB"
                                        for name, (n, b) in results["op_graphs"].items()))
    if rank == 0:
        name = (f"e2e_{args.model}" + ("_ddp" if args.ddp else "") + (f"_{args.mode}" if args.mode else "")
                + ("_checkpointed" if args.checkpoint else "") + (f"_peft{args.peft_rank}" if args.peft_rank else "")
                + ".json")
        results["mode"], results["checkpoint"], results["peft_rank"] = args.mode, args.checkpoint, args.peft_rank
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(results, f, indent=1)
    if args.ddp:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
