"""`python -m mok_compile.demo`: compile a small Hugging Face MoE model with `backend="mok"`.

Builds a random-weight CausalLM from a tiny config (no download), prints what
was fused (`mok_compile.explain`), checks the compiled output against eager,
and times `backend="mok"` against `backend="inductor"` (both compiled, median
of timed runs after warm-up). Needs transformers (`pip install 'mok-compile[test]'`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Small enough to compile in well under a minute on 2 CPU cores; big enough on a GPU for the experts to matter.
DEFAULT_SIZES = {
    "cpu": dict(hidden=64, intermediate=32, experts=8, top_k=2, batch=2, seq=32),
    "cuda": dict(hidden=1024, intermediate=512, experts=32, top_k=4, batch=8, seq=512),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m mok_compile.demo", description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen3_moe", help="model family from mok_compile.hf_blocks.FAMILIES")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    for name in ("hidden", "intermediate", "experts", "top_k", "batch", "seq"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help="default depends on the device")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--iters", type=int, default=None, help="timed runs per block, 5 blocks each (default: 20 on cpu, 50 on cuda)")
    args = p.parse_args(argv)
    device_kind = torch.device(args.device).type
    if device_kind not in DEFAULT_SIZES:
        p.error(f"--device {args.device!r}: use cpu or cuda")
    for name, value in DEFAULT_SIZES[device_kind].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.dtype = DTYPES[args.dtype or ("bf16" if device_kind == "cuda" else "fp32")]
    args.iters = args.iters or (50 if device_kind == "cuda" else 20)
    return args


def make_causal_lm(family: str, sizes=None, num_layers: int = 2, dtype=torch.float32, device="cpu", seed: int = 0,
                   **config_overrides):
    """A random-weight CausalLM of `family`; router/expert biases and per-expert weight scales randomised too (HF
    inits them to zeros and ones)."""
    import transformers

    from .hf_blocks import BlockSizes, make_config

    cfg = make_config(family, sizes or BlockSizes(), num_layers=num_layers, **config_overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and ("experts" in name or "router" in name or "gate" in name):
                p.normal_(0, 0.02)
            if name.endswith("per_expert_scale"):  # Gemma 4's (ones at init)
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model.to(device=device, dtype=dtype).eval()


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_times_ms(fns: dict, device, iters: int, rounds: int = 5) -> dict:
    """Median wall time (ms) of each `fns[name]()` over `rounds` x `iters` calls.

    The functions take turns in blocks of `iters` calls, so machine-load drift hits each alike. Not call by
    call: two compiles of one model share Dynamo's cache for its `forward`, and alternating calls would make
    each pay a failed guard check of the other's entry. The first call of each block is a warm-up.
    """
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            for _ in range(iters):
                _sync(device)
                start = time.perf_counter()
                fn()
                _sync(device)
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _logits_error(logits, eager) -> str:
    diff = (logits.float() - eager.float()).norm() / eager.float().norm()
    same_top1 = (logits.argmax(-1) == eager.argmax(-1)).float().mean()
    return f"relative error {diff.item():.2e}, same top-1 token {100 * same_top1.item():.1f}%"


def main(argv=None) -> int:
    args = parse_args(argv)
    import mok_compile

    from .hf_blocks import BlockSizes

    sizes = BlockSizes(hidden=args.hidden, intermediate=args.intermediate, experts=args.experts, top_k=args.top_k)
    model = make_causal_lm(args.family, sizes, args.layers, args.dtype, args.device)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=args.device)
    print(f"model: {type(model).__name__} ({args.layers} layers, H={args.hidden}, I={args.intermediate}, "
          f"E={args.experts}, top_k={args.top_k}), {str(args.dtype).replace('torch.', '')} on {args.device}, "
          f"input {args.batch}x{args.seq}\n")

    with torch.no_grad():
        report = mok_compile.explain(model, ids)
        eager = model(ids).logits

        mok_model = torch.compile(model, backend="mok")
        out = mok_model(ids).logits
        # Compile times are not compared here: the second compile reuses kernels cached by the first
        # (benchmarks/compile_overhead.py measures them in fresh processes).
        inductor_model = torch.compile(model, backend="inductor")
        ref = inductor_model(ids).logits
        print()
        # In bf16 a token whose top-k experts nearly tie can route differently under any change of
        # summation order, so inductor's own distance from eager is printed as the yardstick.
        for name, logits in (("mok", out), ("inductor", ref)):
            print(f"{name:>8} vs eager: {_logits_error(logits, eager)}")
        medians = median_times_ms({"mok": lambda: mok_model(ids), "inductor": lambda: inductor_model(ids)},
                                  args.device, args.iters)
    t_mok, t_ind = medians["mok"], medians["inductor"]
    print(f"median of {5 * args.iters} forward calls (5 alternating blocks): mok {t_mok:.3f} ms, inductor {t_ind:.3f} ms "
          f"-> mok is {t_ind / t_mok:.2f}x the speed of inductor")
    if not report.fused:
        print("note: no MoE block was fused, so both compiles run the same code")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
