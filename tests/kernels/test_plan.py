"""Launch plans (`mok_compile.kernels.plan`) on the CPU: a replayed forward makes, launch for launch, the same
launches with the same arguments as the normal path on the same call, and the same aten ops. Triton launches
are stubbed (every kernel counts as compiled and logs its arguments instead of running), so the forward's
Python and its torch ops run as on the GPU; the GPU tests run the real kernels with plans on."""

import pytest
import torch

from mok_compile.kernels import graphs, launch, moe, plan
from tests.kernels.cases import VARIANTS as CASE_VARIANTS, generator, make_case


class _Logged:
    """A compiled kernel stand-in: `run` logs the grid and the parameter values."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, name, log):
        self.name, self.log = name, log

    def run(self, g0, g1, g2, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *values):
        self.log.append((self.name, (g0, g1, g2), values))


@pytest.fixture
def fresh_plans(monkeypatch):
    """Plans on, empty caches; the op's CUDA graphs off (their replays would take the calls this counts:
    `test_graphs.py` tests them)."""
    monkeypatch.setattr(graphs, "max_tokens", 0)
    monkeypatch.setattr(plan, "enabled", True)
    monkeypatch.setattr(moe, "_FORWARD_PLANS", plan.PlanCache())
    monkeypatch.setattr(moe, "_BACKWARD_PLANS", plan.PlanCache())


@pytest.fixture
def stubbed(monkeypatch, fresh_plans):
    """Launches logged, not run; plans allowed on CPU tensors; fresh plan caches."""
    log = []
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(launch, "fast_launch", True)
    monkeypatch.setattr(launch, "_LAUNCHERS", {})
    monkeypatch.setattr(plan, "_plannable", lambda x: True)

    class Compiled(dict):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def get(self, key, default=None):  # every key "compiled": the direct path, logged
            return _Logged(self.name, log)

    real_init = launch.Launcher.__init__

    def init(self, fn):
        real_init(self, fn)
        self._direct = True
        self._kernels = Compiled(getattr(fn, "__name__", "kernel"))

    monkeypatch.setattr(launch.Launcher, "__init__", init)
    return log


def _labels(log, inputs):
    """The log with each tensor argument named by what it is: an input (by position) or the n-th other tensor seen,
    with its shape, strides, dtype and offset; TensorDescriptors by their base and geometry."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    seen = {}

    def name(v):
        if isinstance(v, TensorDescriptor):
            return ("desc", name(v.base), list(v.shape), list(v.strides), list(v.block_shape))
        if not isinstance(v, torch.Tensor):
            return v
        for i, t in enumerate(inputs):
            if t is not None and v is t:
                return ("input", i)
        key = v.untyped_storage().data_ptr()
        seen.setdefault(key, len(seen))
        return ("tensor", seen[key], v.storage_offset(), tuple(v.shape), v.stride(), v.dtype)

    return [(kernel, grid, [name(v) for v in values]) for kernel, grid, values in log]


VARIANTS = [("qwen3", False), ("qwen3", True), ("gpt_oss", True), ("deepseek_v3", True), ("llama4", False)]


# T=37: one routing program (64 tokens at E=8) sorts the pairs itself; T=70: two, then the scan and scatter launches.
@pytest.mark.parametrize("variant,save,T", [(v, s, 37) for v, s in VARIANTS] + [("qwen3", True, 70)])
def test_a_replayed_forward_launches_what_the_normal_path_does(stubbed, variant, save, T):
    tensors, kw = make_case(variant, T=T, H=64, I=32, E=8, K=2, dtype=torch.float16)
    log = stubbed

    def call(x):
        log.clear()
        out = moe.fused_moe_forward(x, *tensors[1:], save_gate_up=save, **kw)
        return out, _labels(log, (x, *tensors[1:]))

    for _ in range(2):  # seen once, then recorded
        call(torch.randn_like(tensors[0]))
    assert len(moe._FORWARD_PLANS._plans) == 1
    x = torch.randn_like(tensors[0])
    replayed, replayed_log = call(x)
    plan.enabled = False
    normal, normal_log = call(x)
    assert replayed_log == normal_log and len(normal_log) >= 4
    kernels = [kernel for kernel, _, _ in normal_log]
    assert ("_scan_kernel" in kernels) == ("_scatter_kernel" in kernels) == (T > 64), kernels
    assert len(replayed) == len(normal) == (7 if save else 3)
    for r, n in zip(replayed, normal):
        assert r.shape == n.shape and r.dtype == n.dtype and r.stride() == n.stride()
    if save and variant != "llama4":  # the router logits: computed on the CPU, by the replayed F.linear too
        assert torch.equal(replayed[4], normal[4])


# (variant, reading the training forward's h, logits and layout, writing dh over h and freeing it)
BACKWARD_VARIANTS = [("qwen3", True, False), ("qwen3", True, True), ("qwen3", False, False), ("gpt_oss", True, True),
                     ("deepseek_v3", True, False), ("llama4", False, False)]


@pytest.mark.parametrize("variant,saved,overwrite", BACKWARD_VARIANTS)
def test_a_replayed_backward_launches_what_the_normal_path_does(stubbed, variant, saved, overwrite):
    T, E, K = 37, 8, 2
    tensors, kw = make_case(variant, T=T, H=64, I=32, E=E, K=K, dtype=torch.float16)
    log = stubbed
    _, _, _, h0, logits, layout, _ = moe.fused_moe_forward(*tensors, save_gate_up=True, **kw)  # shapes (stubbed)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # read by a CPU gather (GPT-OSS)
    w = torch.rand(T, K, generator=g)

    def call(go, h):
        log.clear()
        saved_kw = dict(gate_up_out=h, router_logits=logits, routing_layout=layout,
                        overwrite_gate_up_out=overwrite) if saved else {}
        grads = moe.fused_moe_backward(go, None, *tensors, w, ids, **kw, **saved_kw)
        inputs = (go, None, *tensors, w, ids, *((h, logits, layout) if saved else ()))
        return grads, _labels(log, inputs), h.untyped_storage().size() == 0

    def fresh():
        return torch.randn(T, tensors[0].shape[1]).half(), torch.randn_like(h0)

    for _ in range(2):  # seen once, then recorded
        call(*fresh())
    assert len(moe._BACKWARD_PLANS._plans) == 1
    go, h = fresh()
    replayed, replayed_log, replayed_freed = call(go, h.clone())
    plan.enabled = False
    normal, normal_log, normal_freed = call(go, h.clone())
    assert replayed_log == normal_log and len(normal_log) >= 5
    assert replayed_freed == normal_freed == overwrite
    assert len(replayed) == len(normal) == 9
    for r, n in zip(replayed, normal):
        assert (r is None) == (n is None) and (r is None or (r.shape, r.dtype) == (n.shape, n.dtype))


def test_each_signature_has_its_own_plan(stubbed, monkeypatch):
    tensors, kw = make_case("qwen3", T=16, H=64, I=32, E=8, K=2, dtype=torch.float16)
    for x in (tensors[0], tensors[0][:9], tensors[0]):
        for _ in range(2):
            moe.fused_moe_forward(x.clone(), *tensors[1:], **kw)
    monkeypatch.setenv("MOK_TMA", "0")
    for _ in range(2):
        moe.fused_moe_forward(tensors[0].clone(), *tensors[1:], **kw)
    # T=16, T=9, and T=16 again under another switch; an input 2 bytes off 16-byte alignment: one more
    misaligned = torch.empty(16 * 64 + 1, dtype=torch.float16)[1:].view(16, 64)
    for _ in range(2):
        moe.fused_moe_forward(misaligned, *tensors[1:], **kw)
    assert len(moe._FORWARD_PLANS._plans) == 4


def test_the_tf32_setting_is_in_the_signature(stubbed):
    """The router GEMM's cuBLAS call reads it: a plan recorded under one setting must not replay under the other."""
    tensors, kw = make_case("qwen3", T=16, H=64, I=32, E=8, K=2, dtype=torch.float16)
    matmul, before = torch.backends.cuda.matmul, torch.backends.cuda.matmul.allow_tf32
    try:
        for allow in (False, True):
            matmul.allow_tf32 = allow
            for _ in range(2):
                moe.fused_moe_forward(tensors[0].clone(), *tensors[1:], **kw)
    finally:
        matmul.allow_tf32 = before
    assert len(moe._FORWARD_PLANS._plans) == 2


def test_cuda_autocast_is_in_the_signature(stubbed, monkeypatch):
    """Autocast changes the dtypes of the torch ops inside (the router's F.linear), which the kernels after them
    are specialised on: a plan recorded outside it must not replay inside, nor one of another dtype."""
    tensors, kw = make_case("qwen3", T=16, H=64, I=32, E=8, K=2, dtype=torch.float16)
    for state in (None, torch.float16, torch.bfloat16):
        monkeypatch.setattr(torch._C, "_is_any_autocast_enabled", lambda: state is not None)
        monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type=None: state is not None)
        monkeypatch.setattr(torch, "get_autocast_dtype", lambda device_type: state)
        for _ in range(2):
            moe.fused_moe_forward(tensors[0].clone(), *tensors[1:], **kw)
    assert len(moe._FORWARD_PLANS._plans) == 3


def test_a_path_that_reads_a_value_on_the_host_is_not_planned(stubbed, monkeypatch):
    tensors, kw = make_case("qwen3", T=16, H=64, I=32, E=8, K=2, dtype=torch.float16)
    real_logits = moe._logits

    def logits_and_a_host_read(x, *args):
        float(x.abs().sum())  # the recording cannot replay a value read on the host
        return real_logits(x, *args)

    monkeypatch.setattr(moe, "_logits", logits_and_a_host_read)
    recordings = []
    record = plan.Plan.record.__func__
    monkeypatch.setattr(plan.Plan, "record", classmethod(lambda cls, *a: recordings.append(1) or record(cls, *a)))
    for _ in range(6):
        out = moe.fused_moe_forward(tensors[0], *tensors[1:], **kw)
        assert len(out) == 3
    assert not moe._FORWARD_PLANS._plans
    assert len(recordings) == plan._MAX_FAILURES  # then the signature is left unplanned: recording costs time


def test_no_plan_while_a_launch_hook_is_set(stubbed, monkeypatch):
    tensors, kw = make_case("qwen3", T=16, H=64, I=32, E=8, K=2, dtype=torch.float16)
    monkeypatch.setattr(launch, "_hooks_set", lambda: True)
    monkeypatch.setattr(launch.Launcher, "run", lambda self, grid, args, kwargs: None)  # Triton's path, skipped
    for _ in range(3):
        moe.fused_moe_forward(tensors[0], *tensors[1:], **kw)
    assert not moe._FORWARD_PLANS._plans and not moe._FORWARD_PLANS._seen


def test_every_switch_the_kernels_read_per_call_is_in_the_signature():
    """A MOK_* variable read per call but missing from `plan.SWITCHES` would let a plan replay what another
    setting of it would not launch."""
    import pathlib
    import re

    root = pathlib.Path(moe.__file__).parent
    read = set()
    for path in [*root.glob("*.py"), root.parent / "ops" / "library.py"]:
        read |= set(re.findall(r"os\.environ\.get\(\"([A-Z_]+)\"", path.read_text()))
    # read once, into module variables the plan and graph caches check
    at_import = {"MOK_FAST_LAUNCH", "MOK_LAUNCH_PLAN", "MOK_DIRECT_LAUNCH", "MOK_CPP_REPLAY", "MOK_GRAPH_TOKENS",
                 "MOK_GRAPH_INFERENCE_MACS"}
    at_import.add("MOK_BUILD_DIR")  # where gate_up_sm90.py builds its library, once: no launch depends on it
    assert read - at_import <= set(plan.SWITCHES), read - at_import - set(plan.SWITCHES)
    assert "MOK_TMA" in read  # the pattern finds them


def training_step_case(variant):
    """(inputs(seed), step(tensors)) of the GPU bit-equality tests: fresh inputs of one signature, each seed another
    routing; a step runs the forward (inference and training) and the backward (recomputing, reading the saved
    tensors, consuming h) and returns (every output, the size of h's storage after)."""
    T, H, I, E, K = 300, 192, 96, 16, 4
    _, kw = make_case(variant, T=T, H=H, I=I, E=E, K=K, dtype=torch.bfloat16, device="cuda")

    def inputs(seed):
        return make_case(variant, T=T, H=H, I=I, E=E, K=K, dtype=torch.bfloat16, device="cuda", seed=seed)[0]

    def step(tensors):
        out = moe.fused_moe_forward(*tensors, **kw)
        tout, tw, tids, h, logits, layout, _ = moe.fused_moe_forward(*tensors, save_gate_up=True, **kw)
        go = torch.randn(tout.shape, dtype=tout.dtype, device="cuda", generator=generator(1, "cuda"))
        recomputed = moe.fused_moe_backward(go, None, *tensors, tw, tids, **kw)
        saved = moe.fused_moe_backward(go, None, *tensors, tw, tids, gate_up_out=h.clone(), router_logits=logits,
                                       routing_layout=layout, **kw)
        consumed = moe.fused_moe_backward(go, None, *tensors, tw, tids, gate_up_out=h, router_logits=logits,
                                          routing_layout=layout, overwrite_gate_up_out=True, **kw)
        return [*out, tout, tw, tids, *recomputed, *saved, *consumed], h.untyped_storage().size()

    return inputs, step


def assert_replay_equals_plans_off(step, tensors):
    """`step(tensors)` (`training_step_case`) replayed, then with plans off: the same bits, h freed in both."""
    replayed, replayed_h = step(tensors)
    plan.enabled = False
    normal, normal_h = step(tensors)
    assert replayed_h == normal_h == 0  # the consuming backward freed h in both
    for r, n in zip(replayed, normal, strict=True):
        assert (r is None) == (n is None)
        if r is not None:
            assert r.shape == n.shape and r.dtype == n.dtype and r.stride() == n.stride()
            assert torch.equal(r, n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", sorted(CASE_VARIANTS))
def test_a_replayed_training_step_equals_the_normal_path_bit_for_bit(fresh_plans, monkeypatch, variant):
    """On the GPU, real kernels: the third call of a signature (a replay, in Python) gives what plans off give on
    the same inputs (`training_step_case`), each call on fresh inputs of the same signature with another routing."""
    from mok_compile.kernels import plan_cpp

    monkeypatch.setattr(plan_cpp, "enabled", False)  # (test_plan_cpp.py: the C++ replay)
    inputs, step = training_step_case(variant)
    for seed in (1, 2):  # seen once, then recorded
        step(inputs(seed))
    assert len(moe._FORWARD_PLANS._plans) == 2 and len(moe._BACKWARD_PLANS._plans) == 3
    launches = [s[1] for c in (moe._FORWARD_PLANS, moe._BACKWARD_PLANS) for p in c._plans.values() for s in p.steps
                if s[0] == plan._LAUNCH]
    # every Triton launch replays through the C launch function directly (`plan._DirectLaunch`), where the installed
    # Triton's launcher is one it launches directly (3.6's; 3.7-3.9's when asked, MOK_DIRECT_LAUNCH_37=1)
    direct = plan.launch_layout() == "flat" or plan.launch_layout() == "tuple" and plan.tuple_layout
    assert launches and [s.kernel.name for s in launches if s.direct is None] == ([] if direct else
                                                                                 [s.kernel.name for s in launches])
    assert_replay_equals_plans_off(step, inputs(3))


def test_a_detach_the_call_returns_stays_a_detach(stubbed):
    """Replays run a detach as an alias of its input, except where the call returns it: the caller must not get
    the input's autograd state back."""
    cache = plan.PlanCache()
    x = torch.randn(4, requires_grad=True)
    outs = [cache.call(lambda: (x.detach(), x.detach() * 2), (x,), ()) for _ in range(3)]
    assert len(cache._plans) == 1
    assert all(not t.requires_grad and t._base is None or t._base is not x for out in outs for t in out)
    assert torch.equal(outs[2][0], x.detach()) and outs[2][0] is not x


_TEST_LIB = torch.library.Library("mok_plan_test", "DEF")
_TEST_LIB.define("scale_into(Tensor x, Tensor(a!) out, float s) -> ()")  # returns nothing, as mok_sm90.gate_up
def _scale_into(x, out, s):
    out.copy_(x * s)


_TEST_LIB.impl("scale_into", _scale_into, "CompositeExplicitAutograd")


def test_an_op_that_only_writes_its_arguments_is_recorded_and_replayed(stubbed):
    """An op returning None (`-> ()`, writing an output argument) is a step like any other: before, its None
    return failed the recording ("returned a non-tensor"), so the CUDA gate_up's calls were never planned."""
    cache = plan.PlanCache()

    def call(x):
        out = torch.empty_like(x)
        torch.ops.mok_plan_test.scale_into(x, out, 3.0)
        return (out,)

    xs = [torch.randn(5) for _ in range(3)]
    outs = [cache.call(lambda x=x: call(x), (x,), ()) for x in xs]
    assert len(cache._plans) == 1  # recorded on the second call, replayed on the third
    for x, (out,) in zip(xs, outs):
        assert torch.equal(out, x * 3.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_replay_under_autocast_equals_the_normal_path(fresh_plans):
    """A plan recorded outside autocast is not replayed inside it; inside, the replay equals the normal path."""
    tensors, kw = make_case("qwen3", T=300, H=192, I=96, E=16, K=4, dtype=torch.bfloat16, device="cuda")
    outside = [moe.fused_moe_forward(*tensors, **kw) for _ in range(2)]
    with torch.autocast("cuda", dtype=torch.float16):
        replayed = [moe.fused_moe_forward(*tensors, **kw) for _ in range(3)][-1]
        assert len(moe._FORWARD_PLANS._plans) == 2
        plan.enabled = False
        normal = moe.fused_moe_forward(*tensors, **kw)
    for r, n in zip(replayed, normal, strict=True):
        assert r.dtype == n.dtype and torch.equal(r, n)
    assert all(o.dtype == n.dtype for o, n in zip(outside[1], normal))


def test_bad_inputs_are_still_refused_once_a_plan_exists(stubbed):
    """The forward checks its inputs on the normal path only (a plan's signature fixes all the check reads): an
    input the check refuses has another signature, so it is checked, however many plans exist."""
    tensors, kw = make_case("qwen3", T=16, H=64, I=32, E=8, K=2, dtype=torch.float16)
    for _ in range(3):
        moe.fused_moe_forward(*tensors, **kw)
    assert len(moe._FORWARD_PLANS._plans) == 1
    bad = list(tensors)
    bad[4] = tensors[4][:, :, :-1]  # gate_up_proj one column short of H
    for _ in range(3):
        with pytest.raises(ValueError, match="gate_up_proj has shape"):
            moe.fused_moe_forward(*bad, **kw)
    assert len(moe._FORWARD_PLANS._plans) == 1


def test_a_replay_drops_each_tensor_after_its_last_read(stubbed, monkeypatch):
    """No tensor outlives its last read in a replay: a local of the replay loop once kept the last op's arguments
    alive into the next allocation (at T=4096 the backward's peak memory rose by one [T*K, H] buffer)."""
    import weakref

    cache = plan.PlanCache()
    x = torch.randn(64)

    def run():
        a = x + 1
        b = a * 2  # a's last read
        del a
        return b, torch.empty(64)  # allocated once a is dead

    for _ in range(2):
        cache.call(run, (x,), ())
    (recorded,) = cache._plans.values()
    mul = next(s[1] for s in recorded.steps if s[0] == "op" and s[1].func is torch.ops.aten.mul.Tensor)
    seen, real_mul, real_empty = [], mul.func, torch.empty

    def mul_and_watch(a, *args, **kwargs):
        seen.append(weakref.ref(a))
        return real_mul(a, *args, **kwargs)

    def empty_once_a_is_dead(*args, **kwargs):
        assert seen and seen[-1]() is None, "the replay kept a tensor alive past its last read"
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(mul, "func", mul_and_watch)
    monkeypatch.setattr(torch, "empty", empty_once_a_is_dead)
    b, _ = cache.call(run, (x,), ())
    assert len(seen) == 1 and torch.equal(b, (x + 1) * 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("engine", ["triton", "cutlass"])
def test_a_replay_peaks_no_higher_than_the_normal_path(fresh_plans, monkeypatch, engine):
    """Peak memory of the training forward and of the consuming backward, replayed against plans off, with each
    engine forced (CUTLASS's backward makes [T*K, H] sorted copies and drops them after their last use)."""
    from benchmarks.moe_layer import peak_bytes

    monkeypatch.setenv("MOK_GEMM_ENGINE", engine)
    T, H, I, E, K = 1024, 512, 256, 8, 2
    tensors, kw = make_case("qwen3", T=T, H=H, I=I, E=E, K=K, dtype=torch.bfloat16, device="cuda")
    go = torch.randn(T, H, dtype=torch.bfloat16, device="cuda")
    out, w, ids, h0, logits, layout, _ = moe.fused_moe_forward(*tensors, save_gate_up=True, **kw)

    def forward():
        moe.fused_moe_forward(*tensors, save_gate_up=True, **kw)

    def backward():
        moe.fused_moe_backward(go, None, *tensors, w, ids, **kw, gate_up_out=h0.clone(), router_logits=logits,
                               routing_layout=layout, overwrite_gate_up_out=True)

    for fn in (forward, backward):
        peaks = [peak_bytes(fn) for _ in range(4)]  # normal, recorded, replayed twice
        plan.enabled = False
        normal = peak_bytes(fn)
        plan.enabled = True
        assert max(peaks[2:]) <= normal, (fn.__name__, peaks, normal)
    assert len(moe._FORWARD_PLANS._plans) == 1 and len(moe._BACKWARD_PLANS._plans) == 1


def test_an_unhashable_option_runs_the_normal_path(stubbed):
    cache = plan.PlanCache()
    x = torch.randn(8)
    runs = []
    for _ in range(3):
        out = cache.call(lambda: runs.append(1) or x * 2, (x,), ([1, 2],))
        assert torch.equal(out, x * 2)
    assert len(runs) == 3 and not cache._plans and not cache._seen


def test_composite_ops_replay_through_their_public_functions_and_no_op_conversions_are_skipped():
    """Below autograd (where the op's kernels run) composite ops reach the recorder whole: each replays through its
    public function, one that returned its own input (a conversion to the dtype it has) is not replayed, and an
    in-place op, which also returns its input, still is."""
    x, w = torch.randn(4, 3, dtype=torch.bfloat16), torch.randn(5, 3, dtype=torch.bfloat16)

    def run():
        with torch._C._AutoDispatchBelowAutograd():
            a = x.to(torch.bfloat16).contiguous()  # both return x itself
            c = a.to(torch.float32)
            c.add_(1.0)
            return (c.transpose(0, 1).reshape(-1), x.new_empty((0, 3)), torch.matmul(c, c.t()),
                    torch.nn.functional.linear(a, w), c.view(3, 4))

    recorded, normal = plan.Plan.record(run, (x, w))
    kinds = [step[0] for step in recorded.steps]
    assert kinds.count(plan._OP) == 1 and len(kinds) == 9, kinds  # add_ as recorded; 8 ops through public functions
    for x_new in (x, torch.randn_like(x)):
        x = x_new
        replayed, again = recorded.replay((x, w)), run()
        for r, n in zip(replayed, again, strict=True):
            assert r.shape == n.shape and r.dtype == n.dtype and torch.equal(r, n)
