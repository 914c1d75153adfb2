"""The Triton kernels on the CPU, under TRITON_INTERPRET=1, against the reference (CI has no GPU).

fp32 and fp16 only: the interpreter's bf16 dot is unreliable. The kernels run in a subprocess so
that the variable is set before Triton and the kernel modules are first imported.
"""

import json

import pytest

from tests.kernels.interpreted import KERNEL_RUNNER, background, interpreted_stdout

pytest.importorskip("triton")
pytestmark = background(KERNEL_RUNNER)  # one run for the module's tests, queued at collection (tests/conftest.py)


@pytest.fixture(scope="module")
def interpreter_results():
    # Queued at collection by tests/conftest.py where it can be. The timeout is a guard against a hang, not a
    # speed limit: a slow 2-core CI machine takes ~10 minutes alone, longer beside the other tests.
    stdout = interpreted_stdout(KERNEL_RUNNER, timeout=2400)
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_every_case_ran(interpreter_results):
    from tests.kernels.cases import (CUTLASS_INTERPRET_CASES, HALF_TAIL_INTERPRET_CASES, HALF_TAIL_TMA_INTERPRET_CASES,
                                     INTERPRET_CASES, TMA_INTERPRET_CASES)

    assert len(interpreter_results) == (len(INTERPRET_CASES) + len(TMA_INTERPRET_CASES) + len(CUTLASS_INTERPRET_CASES)
                                        + len(HALF_TAIL_INTERPRET_CASES) + len(HALF_TAIL_TMA_INTERPRET_CASES))


def test_tma_cases_used_descriptors(interpreter_results):
    tma = [res for res in interpreter_results if res["case"].startswith("tma/")]
    assert tma and all(res["tma_descriptors"] > 0 for res in tma), tma
    # Gate and up as column blocks (both layouts) read through one 4-d box; interleaved and non-gated do not.
    from tests.kernels.cases import VARIANTS

    for res in tma:
        routing, experts = VARIANTS[res["case"].split("/")[1]][:2]
        column_blocks = experts.gated and not experts.interleaved and not routing.get("weight_on_input", False)
        assert (res["tma_gate_up_boxes"] > 0) == column_blocks, res


def test_half_tail_cases_ran_both_heights(interpreter_results):
    """HALF_TAIL at BLOCK_M = 32: every case's routing ends some experts in a block of <= 16 rows and others in a
    taller one, and the grouped GEMMs ran programs at both heights (their accuracy: the tests below)."""
    from tests.kernels.cases import HALF_TAIL_BLOCK_M

    half = [res for res in interpreter_results if res["case"].startswith("half/")]
    assert half
    for res in half:
        assert min(res["tails"]) <= HALF_TAIL_BLOCK_M // 2 < max(res["tails"]), res
        heights = res["tiles"]
        assert heights.get(str(HALF_TAIL_BLOCK_M // 2), 0) > 0 and heights.get(str(HALF_TAIL_BLOCK_M), 0) > 0, res
        assert "/tma/" not in res["case"] or res["tma_descriptors"] > 0, res


def test_half_tail_off_gives_the_same_results(interpreter_results):
    """The same inputs with MOK_HALF_TAIL=0: no half-height program, forward, h and gradients as with it on."""
    from tests.kernels.cases import HALF_TAIL_BLOCK_M

    ab = [res for res in interpreter_results if "ab_err" in res]
    assert ab
    for res in ab:
        assert list(res["ab_tiles"]) == [str(HALF_TAIL_BLOCK_M)], res
        tol = 1e-6 if res["case"].endswith("float32") else 1e-3
        assert all(err < tol for err in res["ab_err"].values()), res


def test_forward_matches_reference(interpreter_results):
    for res in interpreter_results:
        tol = 1e-5 if res["case"].endswith("float32") else 2e-3
        assert res["ids_equal"], res
        assert res["w_err"] < tol, res
        assert res["out_err"] < tol, res


def _grad_tol(case: str, name: str) -> float:
    """The fp16 backward stores d(h) and per-pair d(x) in fp16 before the fp32 reductions (and the training path
    reads h rounded to fp16). d(router bias) sums d(logits) over the tokens, terms of both signs (under softmax
    routing each token's d(logits) sums to zero): its norm is small next to its terms, so the same rounding gives it
    a larger relative error (3.2e-3 with one seed of the GPT-OSS case's saved path, at most 1.6e-3 over 40
    others); fp32 holds it to 1e-5 like the rest."""
    if case.endswith("float32"):
        return 1e-5
    return 1e-2 if name == "drouter_bias" else 3e-3


def test_backward_matches_reference(interpreter_results):
    for res in interpreter_results:
        assert not res["grad_missing"], res
        for name, err in res["grad_err"].items():
            assert err < _grad_tol(res["case"], name), (name, res)


def test_backward_from_saved_gate_up_matches_reference(interpreter_results):
    """The training path of both engines: h saved by the forward, read (not overwritten) by the backward;
    the consuming backward (autograd's last: dh written over h; its weights spent, freed once read) gives the same
    bits."""
    saved = [res for res in interpreter_results if "grad_err_saved" in res]
    assert saved
    for res in saved:
        assert res["saved_out_equal"] and res["h_unchanged"] and res["consume_equal"] and res["spent_freed"], res
        for name, err in res["grad_err_saved"].items():
            assert err < _grad_tol(res["case"], name), (name, res)


def test_deferred_weight_gradients_give_the_same_bits(interpreter_results):
    """The backward as the op's CUDA graphs run it (`_backward(defer_weight_gradients=True)`, then the weight
    gradients from what it kept and the call's weights: `graphs.py`) gives the bits of the plain backward, on both
    engines; what it keeps holds none of the weights (a graph would keep them alive)."""
    saved = [res for res in interpreter_results if "deferred_equal" in res]
    assert saved and any(res["case"].startswith("cutlass/") for res in saved)
    for res in saved:
        assert res["deferred_equal"] and res["deferred_holds_no_weight"], res


def test_backward_from_saved_routing_recomputes_none_of_it(interpreter_results):
    """With the training forward's router logits and dispatch layout, the (consuming) backward runs neither the
    router GEMM (where the router argument is a weight) nor count, scan and scatter; its gradients are the bits of
    the backward that recomputes them (`consume_equal`, above)."""
    from tests.kernels.cases import VARIANTS

    saved = [res for res in interpreter_results if "saved_routing_recomputed" in res]
    assert saved
    for res in saved:
        router_is_logits = VARIANTS[res["case"].split("/")[-3]][0].get("router_is_logits", False)
        assert res["consume_equal"], res
        assert res["saved_routing_recomputed"] == ({"logits": 1} if router_is_logits else {}), res
