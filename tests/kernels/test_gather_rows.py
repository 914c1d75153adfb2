"""`cutlass_gemm.gather_rows` (each x row spread to its K expert-sorted positions, optionally scaled per pair)
against the gather it replaces, `index_select` on the sorted tokens, bit for bit. Run under TRITON_INTERPRET=1
in a subprocess (the variable must be set before Triton is imported)."""

import pytest

from tests.kernels.interpreted import background, run_interpreted, script_argv

pytest.importorskip("triton")

_SCRIPT = r"""
import json
import torch
from mok_compile.kernels import cutlass_gemm
from mok_compile.kernels.dispatch import Dispatch

res = []
# (T, H, E, K, dtype, scaled): H past one 512-column block and not a multiple of it; T not a multiple of the
# rows per program; one token; no tokens.
for T, H, E, K, dtype, scaled in [(1, 24, 4, 2, torch.float32, False), (37, 72, 8, 4, torch.float16, True),
                                  (50, 600, 16, 8, torch.float32, True), (9, 40, 3, 3, torch.float16, False),
                                  (0, 16, 4, 2, torch.float32, False)]:
    g = torch.Generator().manual_seed(T * 131 + H)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K)
    ids = ids.to(torch.int32)
    scale = torch.rand(T * K, generator=g) if scaled else None
    disp = Dispatch.from_ids(ids, E)
    got = cutlass_gemm.gather_rows(x, disp, scale=scale)
    want = x.index_select(0, (disp.sorted_pair // K).long())
    if scaled:
        want = (want.float() * scale.index_select(0, disp.sorted_pair.long()).float()[:, None]).to(dtype)
    res.append(dict(case=[T, H, E, K, str(dtype), scaled], shape=list(got.shape), dtype=str(got.dtype),
                    equal=bool(torch.equal(got, want)), nonzero=bool(T == 0 or got.abs().sum() > 0)))
print(json.dumps(res))
"""


@background(script_argv(_SCRIPT))
def test_spread_equals_index_select_bitwise():
    results = run_interpreted(_SCRIPT)
    assert len(results) == 5
    for r in results:
        T, H, E, K, dtype, _ = r["case"]
        assert r["shape"] == [T * K, H] and r["dtype"] == dtype, r
        assert r["equal"] and r["nonzero"], r


@pytest.mark.gpu
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("T,H,E,K", [(4096, 2048, 128, 8), (333, 2880, 32, 4), (1, 64, 8, 2)])
def test_spread_equals_index_select_on_the_gpu(T, H, E, K, scaled):
    import torch

    from mok_compile.kernels import cutlass_gemm
    from mok_compile.kernels.dispatch import Dispatch

    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(T, E, device="cuda").topk(K, dim=1).indices.to(torch.int32)
    scale = torch.rand(T * K, device="cuda", dtype=torch.bfloat16) if scaled else None
    disp = Dispatch.from_ids(ids, E)
    want = x.index_select(0, (disp.sorted_pair // K).long())
    if scaled:
        want = (want.float() * scale.index_select(0, disp.sorted_pair.long()).float()[:, None]).to(x.dtype)
    assert torch.equal(cutlass_gemm.gather_rows(x, disp, scale=scale), want)
