"""What a per-expert weight scale (`expert_scale`, Gemma 4's `per_expert_scale`) costs the op on the GPU.

    python -m benchmarks.expert_scale [--tokens 256,4096,16384] [--rounds 3]

At Qwen3-MoE's layer sizes (H=2048, I=768, 128 experts, top-8; Gemma 4's MoE also routes to 8 of 128), bf16,
random weights: `torch.ops.mok.fused_moe` with and without a bf16 scale, forward (no_grad) and forward+backward
(loss = mean(out^2), x, the weights and the scale requiring grad), medians of `do_bench` over --rounds rounds, the
order reversed every other round. The scale adds a multiply to the routing kernel, a store to its backward and one
launch summing each expert's pairs; printed as time with / without.
"""

import argparse
import statistics

import torch

import mok_compile  # noqa: F401  (registers torch.ops.mok.*)
from benchmarks.moe_layer import fwd_bwd, time_in_rounds

H, I, E, K = 2048, 768, 128, 8


def _op(tensors, kw, scale):
    def run(x):
        return torch.ops.mok.fused_moe(x, *tensors, **kw, **({} if scale is None else {"expert_scale": scale}))[0]

    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="256,4096,16384")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, std):
        return (torch.randn(shape, device="cuda", generator=gen) * std).to(torch.bfloat16).requires_grad_()

    router, w1, w2 = rnd(E, H, std=0.02), rnd(E, 2 * I, H, std=0.02), rnd(E, H, I, std=0.02)
    scale = (torch.rand(E, device="cuda", generator=gen) + 0.5).to(torch.bfloat16).requires_grad_()
    tensors, kw = (router, None, None, w1, None, w2, None), dict(top_k=K, renormalize=True, activation="gelu_tanh")
    print(f"expert_scale cost, H={H} I={I} E={E} K={K} bf16 (ms, medians of {args.rounds} rounds)")
    print(f"{'T':>6} {'pass':>9} {'without':>9} {'with':>9} {'with/without':>13}")
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
        timed = []
        for name, s in (("without", None), ("with", scale)):
            fn = _op(tensors, kw, s)
            params = [router, w1, w2] + ([scale] if s is not None else [])

            def forward(fn=fn):
                with torch.no_grad():
                    fn(x)

            timed += [(("fwd", name), forward), (("fwd+bwd", name), fwd_bwd(fn, x, params))]
        for _, fn in timed:  # compiled and warm before timing
            fn()
        times = time_in_rounds(timed, args.rounds)
        for phase in ("fwd", "fwd+bwd"):
            a, b = (statistics.median(times[phase, n]) for n in ("without", "with"))
            print(f"{T:>6} {phase:>9} {a:>9.3f} {b:>9.3f} {b / a:>13.3f}")


if __name__ == "__main__":
    main()
