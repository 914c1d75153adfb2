"""The Triton weight gradient's launch options (`moe._wgrad`): tiles stored through TMA (`TMA`) and a persistent
grid (`PROGRAMS_PER_SM`).

Every option sums each expert's rows in the same sorted order, so all of them must give the same bits as the plain
launch, close to an fp32 reference, with zeros for experts without rows and a bias gradient where asked. Interpreted
on the CPU (fp16: TMA needs 16-bit tensors; the interpreter has no SM count, `configs.sm_count` gives 2 programs per
unit there, so a persistent program runs several tiles), and in bf16 on a Hopper GPU, where it must also equal
CUTLASS's grouped GEMM, repeat bit for bit, and replay from a CUDA graph.
"""

import pytest
import torch

from tests.kernels.interpreted import background, run_interpreted, script_argv

# name -> extra config keys on top of the table's tile
OPTIONS = {"plain": {}, "tma": {"TMA": True}, "persistent": {"PROGRAMS_PER_SM": 3},
           "tma_persistent": {"TMA": True, "PROGRAMS_PER_SM": 1}}

# (T, H, P, E, K, routing, gathered side, bias): partial tiles in both dimensions, experts without rows, one
# expert with every token (several K steps), the bias sum (dW1's operands carry no bias: P gathered, as dW2's)
CPU_CASES = [
    (13, 40, 24, 4, 2, None, "q", False),
    (13, 40, 24, 4, 2, None, "p", True),
    (9, 24, 40, 6, 2, "few_experts", "q", False),
    (21, 16, 32, 3, 2, "one_expert", "p", True),
]

_SCRIPT = r'''
import json, torch
from mok_compile.kernels import configs, moe
from tests.kernels.test_wgrad_triton import CPU_CASES, OPTIONS, run_case

made = []
make = moe._output_descriptor
moe._output_descriptor = lambda *a, **k: made.append(make(*a, **k)) or made[-1]
results = []
for case in CPU_CASES:
    made.clear()
    res = run_case(*case, device="cpu", dtype=torch.float16, tile=configs.config("wgrad", torch.float16, 1, "cpu"))[0]
    res["descriptors"] = sum(d is not None for d in made)
    results.append(res)
print(json.dumps(results))
'''


def _routing(T, E, K, mode, g):
    if mode == "one_expert":  # every token on experts 0..K-1
        return torch.arange(K).repeat(T, 1)
    if mode == "few_experts":  # K of the first K + 1 experts: the others get no rows
        return torch.stack([torch.randperm(K + 1, generator=g)[:K] for _ in range(T)])
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])


def run_case(T, H, P, E, K, mode, side, bias, *, device, dtype, tile, cutlass=False):
    """(errors and checks, the plain launch's (gradient, bias gradient)): each option's gradient (and bias gradient)
    against the plain launch's bits and an fp32 reference."""
    from mok_compile.kernels import cutlass_gemm, moe
    from mok_compile.kernels.dispatch import Dispatch

    g = torch.Generator().manual_seed(T * 1000 + P)
    disp = Dispatch.from_ids(_routing(T, E, K, mode, g).to(torch.int32).to(device), E)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    rows = torch.randn(T * K, P, generator=g).to(device, dtype)
    p, q, p_gather, q_gather = (rows, x, False, True) if side == "q" else (x, rows, True, False)
    Pn, Qn = p.shape[1], q.shape[1]
    scale = torch.rand(T * K, generator=g).to(device) if bias else None

    tokens = (disp.sorted_pair // K).long()
    want, want_bias = [], []
    for e in range(E):
        lo, n = int(disp.expert_start[e]), int(disp.expert_count[e])
        r = torch.arange(lo, lo + n, device=device)
        pr = (p[tokens[r]] if p_gather else p[r]).float()
        qr = (q[tokens[r]] if q_gather else q[r]).float()
        want.append(pr.t() @ qr)
        if bias:
            want_bias.append((pr * scale[disp.sorted_pair[r].long()][:, None]).sum(0))
    want = torch.stack(want)

    outs, res = {}, {"case": f"{T},{H},{P},{E},{K},{mode},{side},{bias}"}
    for name, extra in OPTIONS.items():
        out = torch.full((E, Pn, Qn), float("nan"), device=device, dtype=dtype)
        dbias = torch.full((E, Pn), float("nan"), device=device, dtype=dtype) if bias else None
        moe._wgrad(p, q, disp, scale, out, dbias, P=Pn, Q=Qn, p_gather=p_gather, q_gather=q_gather,
                   strides_pq=(out.stride(1), 1), cfg={**tile, **extra}, precision="ieee")
        outs[name] = (out, dbias)
        res[f"{name}_err"] = ((out.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
        if bias:
            wb = torch.stack(want_bias)
            res[f"{name}_bias_err"] = ((dbias.float() - wb).abs().max() / wb.abs().max().clamp_min(1e-6)).item()
    plain = outs["plain"]
    res["bits_equal"] = {name: torch.equal(o, plain[0]) and (not bias or torch.equal(b, plain[1]))
                         for name, (o, b) in outs.items()}
    res["empty_zero"] = bool((plain[0][disp.expert_count == 0] == 0).all())
    if cutlass and not bias:
        ps = cutlass_gemm.gather_rows(p, disp) if p_gather else p
        qs = cutlass_gemm.gather_rows(q, disp) if q_gather else q
        res["cutlass_equal"] = torch.equal(plain[0], cutlass_gemm.wgrad(ps, qs, disp))
    return res, plain


@pytest.fixture(scope="module")
def cpu_results():
    pytest.importorskip("triton")
    return run_interpreted(_SCRIPT, timeout=900)


def _check(res, tol):
    for name in OPTIONS:
        assert res[f"{name}_err"] < tol, res
        assert res.get(f"{name}_bias_err", 0.0) < tol, res
    assert all(res["bits_equal"].values()), res
    assert res["empty_zero"], res


@background(script_argv(_SCRIPT))
def test_every_option_gives_the_plain_launchs_bits_interpreted(cpu_results):
    assert len(cpu_results) == len(CPU_CASES)
    for res in cpu_results:
        _check(res, 2e-3)
        # the two TMA options made a descriptor on each of their calls (16-bit, [E, P, Q] with Q contiguous)
        assert res["descriptors"] == 2, res


def test_no_descriptor_where_tma_cannot_store():
    """A transposed gradient (Q strided), a 32-bit one, or rows not 16-byte aligned: the plain store."""
    from mok_compile.kernels import moe

    out = torch.empty(4, 24, 40, dtype=torch.float16)
    moe_tma = moe._tma_device
    try:
        moe._tma_device = lambda device: True
        assert moe._output_descriptor(out, 24, 40, (40, 1), 16, 16) is not None
        assert moe._output_descriptor(out.transpose(1, 2), 40, 24, (1, 40), 16, 16) is None
        assert moe._output_descriptor(out.float(), 24, 40, (40, 1), 16, 16) is None
        odd = torch.empty(4, 24, 44, dtype=torch.float16)[:, :, :42]
        assert moe._output_descriptor(odd, 24, 42, (44, 1), 16, 16) is None
    finally:
        moe._tma_device = moe_tma


GPU_CASES = [  # (T, H, P, E, K, routing, gathered side, bias)
    (1, 64, 128, 8, 2, None, "q", False),
    (37, 200, 264, 5, 3, None, "q", False),  # H, P not multiples of the tile or of 64
    (37, 200, 264, 5, 3, None, "p", True),
    (256, 2048, 1536, 128, 8, None, "q", False),  # Qwen3's dW1 at T=256
    (256, 2048, 768, 128, 8, None, "p", False),  # and its dW2
    (513, 512, 384, 8, 2, "one_expert", "q", False),  # 513 rows on one expert: 17 K steps
    (200, 256, 256, 64, 4, "few_experts", "p", True),  # 59 of 64 experts without rows
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: ",".join(map(str, c)))
def test_every_option_gives_the_plain_launchs_bits_on_the_gpu(case):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from mok_compile.kernels import configs

    T, H, P, E, K = case[:5]
    tile = configs.config("wgrad", torch.bfloat16, T * K / E, torch.device("cuda"))
    tile = {k: v for k, v in tile.items() if k not in ("TMA", "PROGRAMS_PER_SM", "MAX_TILES_PER_PROGRAM")}
    hopper = configs.capability(torch.device("cuda"))[0] == 9
    res, plain = run_case(*case, device="cuda", dtype=torch.bfloat16, tile=tile, cutlass=hopper)
    _, again = run_case(*case, device="cuda", dtype=torch.bfloat16, tile=tile)
    _check(res, 1e-2)
    assert torch.equal(plain[0], again[0]) and (plain[1] is None or torch.equal(plain[1], again[1]))  # repeats
    assert res.get("cutlass_equal", True), res


def test_persistent_grid_only_within_its_tiles_per_program_bound():
    from mok_compile.kernels import moe

    cpu = torch.device("cpu")  # configs.sm_count: 2 units off CUDA
    assert moe._wgrad_programs(100, None, None, cpu) == 100  # one tile per program
    assert moe._wgrad_programs(100, 3, None, cpu) == 6  # 3 programs per unit
    assert moe._wgrad_programs(4, 3, None, cpu) == 4  # never more programs than tiles
    assert moe._wgrad_programs(60, 3, 10, cpu) == 6  # 10 tiles a program: within the bound
    assert moe._wgrad_programs(61, 3, 10, cpu) == 61  # past it: one tile per program


@pytest.mark.gpu
def test_cuda_graph_replay_of_the_persistent_tma_launch():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from mok_compile.kernels import configs, moe
    from mok_compile.kernels.dispatch import Dispatch

    g = torch.Generator().manual_seed(5)
    T, H, P, E, K = 300, 1024, 1024, 16, 4
    disp = Dispatch.from_ids(_routing(T, E, K, None, g).to(torch.int32).cuda(), E)
    x = torch.randn(T, H, generator=g).cuda().bfloat16()
    rows = torch.randn(T * K, P, generator=g).cuda().bfloat16()
    cfg = {**configs.config("wgrad", torch.bfloat16, T * K / E, x.device), "TMA": True, "PROGRAMS_PER_SM": 2}
    tiles = E * -(-P // cfg["BLOCK_P"]) * -(-H // cfg["BLOCK_Q"])
    assert 2 * configs.sm_count(x.device) < tiles  # so the grid is persistent: each program runs several tiles
    out = torch.empty(E, P, H, device="cuda", dtype=torch.bfloat16)

    def step():
        moe._wgrad(rows, x, disp, None, out, None, P=P, Q=H, p_gather=False, q_gather=True,
                   strides_pq=(out.stride(1), 1), cfg=cfg, precision="ieee")

    step()
    want = out.clone()
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.zero_()
    x.copy_(torch.randn(T, H, generator=g).cuda().bfloat16())
    graph.replay()
    step_out = out.clone()
    step()
    torch.cuda.synchronize()
    assert torch.equal(step_out, out) and not torch.equal(step_out, want)  # the replay read the new x


_FREE_SCRIPT = r'''
import json, os, weakref, torch
os.environ["MOK_GEMM_ENGINE"] = "triton"
from mok_compile.kernels import moe
from tests.kernels.cases import make_case

T, H, I, E, K = 24, 32, 48, 4, 2
tensors, kw = make_case("qwen3", T=T, H=H, I=I, E=E, K=K, dtype=torch.float16)
out, w, ids, h = moe.fused_moe_forward(*tensors, save_gate_up=True, **kw)[:4]
go = torch.randn(T, H, dtype=torch.float16)
calls, real = [], moe._wgrad

def watched(p, q, *args, **kwargs):
    calls.append({"inputs": [weakref.ref(p), weakref.ref(q)],
                  "earlier_inputs_alive": [[r() is not None for r in c["inputs"]] for c in calls]})
    return real(p, q, *args, **kwargs)

moe._wgrad = watched
moe.fused_moe_backward(go, None, *tensors, w, ids, gate_up_out=h, **kw)
print(json.dumps([c["earlier_inputs_alive"] for c in calls]))
'''


@background(script_argv(_FREE_SCRIPT))
def test_the_down_weight_gradients_rows_are_freed_before_the_gate_up_one():
    """The Triton weight gradients run dW2 (go, act(h) * w) and then dW1 (dh, x): act(h) * w, [T*K, I], is dead by
    the time dW1's gradient is made, as CUTLASS's path drops its sorted copies (with it alive, Mixtral T=256's
    fwd+bwd peaked 10 MB above CUTLASS's path and 8.5 MB above HF's eager block, NOTES v39 (5))."""
    pytest.importorskip("triton")
    calls = run_interpreted(_FREE_SCRIPT, timeout=600)
    assert len(calls) == 2 and calls[0] == []
    go_alive, act_alive = calls[1][0]
    assert go_alive and not act_alive, calls
