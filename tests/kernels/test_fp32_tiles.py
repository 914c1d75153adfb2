"""fp32 experts keep fp32's accuracy whatever tile the tuned table picks (`configs.json`'s `kernel/fp32/bucket`
entries, `tune --dtype fp32`; NOTES v75). The fp32 GEMMs run as tf32x3 (`moe._precision`); the test holds each
bucket's forward and gradients, against an fp64 reference on the op's own routing, to a few times the error of the
FMA dot (MOK_FP32_DOT=ieee) on the same tiles, so that a tile whose dot loses precision fails here, not in a user's
fp32 model."""

import pytest
import torch

from mok_compile.kernels import configs
from mok_compile.ops import reference
from tests.kernels.cases import generator, make_case, rel_err

pytestmark = pytest.mark.gpu
E, K = 8, 2
BUCKET_TOKENS = {"m16": 40, "m64": 200, "m256": 800, "m1024": 3200, "mbig": 6000}  # T * K / E rows per expert
GRAD_NAMES = ("dx", "drouter", "drouter_bias", "dw1", "db1", "dw2", "db2")


def _errors(tensors, kw, seed):
    """Relative errors of the op's output and gradients against fp64 on the op's routing."""
    out, w, ids = torch.ops.mok.fused_moe(*tensors, **kw)
    g = generator(seed, "cuda")
    go, gw = torch.randn(out.shape, device="cuda", generator=g), torch.randn(w.shape, device="cuda", generator=g)
    grads = torch.ops.mok.fused_moe_backward(go, gw, *tensors, w, ids, **kw)
    wide = [None if t is None else t.double() for t in tensors]
    x, _, _, _, w1, b1, w2, b2 = wide
    ref = reference.experts_reference(x, w.double(), ids, w1, b1, w2, b2, activation=kw["activation"],
                                      gated=kw["gated"], interleaved=kw["interleaved"],
                                      transposed=kw["transposed"], alpha=kw["alpha"], limit=kw["limit"])
    r_grads = reference.fused_moe_backward_reference(go.double(), gw.double(), *wide, w.double(), ids, **kw)
    errors = {"out": rel_err(out, ref)}
    errors.update({name: rel_err(a, b) for name, a, b in zip(GRAD_NAMES, grads, r_grads) if b is not None})
    return errors


@pytest.mark.parametrize("variant", ["qwen3", "gpt_oss"])
@pytest.mark.parametrize("bucket", BUCKET_TOKENS)
def test_fp32_tiles_keep_fp32_accuracy(bucket, variant, no_tf32, monkeypatch):
    T = BUCKET_TOKENS[bucket]
    assert configs.bucket(T * K / E) == bucket
    tensors, kw = make_case(variant, T=T, H=320, I=200, E=E, K=K, dtype=torch.float32, device="cuda", seed=T)
    monkeypatch.setenv("MOK_FP32_DOT", "ieee")
    fma = _errors(tensors, kw, seed=T)
    monkeypatch.delenv("MOK_FP32_DOT")
    tf32x3 = _errors(tensors, kw, seed=T)
    worse = {name: (err, fma[name]) for name, err in tf32x3.items() if err > max(4 * fma[name], 1e-6)}
    assert not worse, f"tf32x3 against the FMA dot's error, {bucket}: {worse}"
