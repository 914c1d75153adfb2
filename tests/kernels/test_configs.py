"""Block-size data and its tools, on the CPU: the tuned table (`configs.json`) and which GPUs take it, the
tuner's filters and the half-height-tail switch. (The tuner's candidates may exceed shared memory: it skips those
that fail.)"""

import json

import torch

from mok_compile.kernels import configs, tune

_SMEM_BYTES = 227 * 1024  # Hopper's shared memory per block
_SM_SMEM_BYTES = 228 * 1024  # and per SM
_GATED = ("gate_up", "bwd_gate_up")


def _smem_estimate(kernel, cfg, element_bytes=2) -> int:
    """The pipelined operand tiles of one program: stages x (A tile + B tile)."""
    if kernel == "wgrad":
        tiles = cfg["BLOCK_P"] * cfg["BLOCK_R"] + cfg["BLOCK_R"] * cfg["BLOCK_Q"]
    else:
        width = cfg["BLOCK_N"] * (2 if kernel in _GATED else 1)
        tiles = cfg["BLOCK_M"] * cfg["BLOCK_K"] + cfg["BLOCK_K"] * width
    return cfg["num_stages"] * tiles * element_bytes


def _tuned_entries():
    return [(device, key, cfg) for device, table in configs._tuned().items() for key, cfg in table.items()]


def test_tuned_table_keys_and_sizes():
    entries = _tuned_entries()
    assert entries
    buckets = {name for name, _ in configs.BUCKETS}
    for device, key, cfg in entries:
        kernel, dtype, bucket = key.split("/")
        assert kernel in tune.KERNELS and dtype in ("16bit", "fp32") and bucket in buckets, (device, key)
        blocks = {k: v for k, v in cfg.items() if k.startswith("BLOCK_")}
        assert all(v >= 16 and v & (v - 1) == 0 for v in blocks.values()), (key, cfg)
        assert cfg["num_warps"] in (4, 8) and 2 <= cfg["num_stages"] <= 5, (key, cfg)
        launch = {"num_warps", "num_stages", "TMA"}
        if kernel == "wgrad":
            launch |= {"PROGRAMS_PER_SM", "MAX_TILES_PER_PROGRAM"}
        assert set(cfg) - set(blocks) <= launch, (key, cfg)
        assert _smem_estimate(kernel, cfg, 4 if dtype == "fp32" else 2) <= _SMEM_BYTES, (key, cfg)
        assert _persistent_programs_fit(kernel, cfg), (key, cfg)
        assert dtype == "16bit" or not cfg.get("TMA"), (key, cfg)  # the kernels' descriptors take 16-bit weights


def test_fp32_candidates_fit_and_keep_the_untuned_default():
    """The fp32 tuner's candidates (`tune --dtype fp32`): fp32 tiles in shared memory, BLOCK_K a 128-byte row, no
    TMA, and the heuristic's default among them (a tuned entry never loses alone to what it replaces)."""
    for kernel in tune.KERNELS:
        for name, _ in configs.BUCKETS:
            cands = tune.candidates(kernel, name, torch.float32)
            assert configs._FP32_DEFAULT[kernel] in cands, (kernel, name)
            assert len(cands) == len({tuple(sorted(c.items())) for c in cands}), (kernel, name)
            for cfg in cands:
                assert _smem_estimate(kernel, cfg, 4) <= _SMEM_BYTES, (kernel, name, cfg)
                assert "TMA" not in cfg and cfg.get("BLOCK_K", cfg.get("BLOCK_R")) == 32, (kernel, name, cfg)
    assert tune.candidates("down", "m256", torch.float32) != tune.candidates("down", "m256")


def _persistent_programs_fit(kernel, cfg) -> bool:
    """A persistent grid's programs must all fit on an SM at once (else the surplus ones run after the others)."""
    if "PROGRAMS_PER_SM" not in cfg:
        return True
    store = cfg["BLOCK_P"] * cfg["BLOCK_Q"] * 2 if cfg.get("TMA") else 0  # the TMA store's buffer
    return cfg["PROGRAMS_PER_SM"] * (_smem_estimate(kernel, cfg) + store) <= _SM_SMEM_BYTES


def test_tuner_offers_persistent_weight_gradients_only_at_17_to_64_rows_and_only_ones_that_fit():
    for name, _ in configs.BUCKETS:
        persistent = [cfg for cfg in tune.candidates("wgrad", name) if "PROGRAMS_PER_SM" in cfg]
        assert bool(persistent) == (name == "m64"), name
        assert all(_persistent_programs_fit("wgrad", cfg) and cfg["MAX_TILES_PER_PROGRAM"] for cfg in persistent)


def test_tuner_filters():
    assert list(tune._jobs(("gate_up",), {"m256"})) == [((2048, 768, 128, 8, 4096), "m256", "gate_up")]
    every = list(tune._jobs())
    assert len(every) == len(tune.TUNE_SHAPES) * len(tune.KERNELS)
    assert {b for _, b, _ in every} == {name for name, _ in configs.BUCKETS}  # one tuning shape per bucket


def test_tuner_merges_into_the_table_the_gpu_reads(monkeypatch, tmp_path):
    """`tune --merge`: an H100 (no table of its own) writes into the H200's table it reads, keeping that table's other
    entries; a GPU with a table of its own writes into that one."""
    path = tmp_path / "configs.json"
    old = {"down/16bit/m16": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)}
    path.write_text(json.dumps({"NVIDIA H200": old}))
    new = {"down/fp32/m256": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=3)}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    gpu_like(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    assert tune.merge(path, new) == "NVIDIA H200"
    assert json.loads(path.read_text()) == {"NVIDIA H200": {**old, **new}}
    gpu_like(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))  # another architecture: a table of its own
    assert tune.merge(path, new) == "NVIDIA A100-SXM4-80GB"
    assert json.loads(path.read_text()) == {"NVIDIA H200": {**old, **new}, "NVIDIA A100-SXM4-80GB": new}


def test_half_tail_switch(monkeypatch):
    monkeypatch.delenv("MOK_HALF_TAIL", raising=False)
    assert configs.half_tail(128) and configs.half_tail(256)
    assert not configs.half_tail(64)  # a 32-row half would leave Hopper's 64-row wgmma
    monkeypatch.setenv("MOK_HALF_TAIL", "0")
    assert not configs.half_tail(128)
    monkeypatch.setenv("MOK_HALF_TAIL", "1")
    assert configs.half_tail(64) and configs.half_tail(32) and not configs.half_tail(16)


def gpu_like(monkeypatch, name, cap):
    """configs as on a CUDA device called `name` of compute capability `cap` (no GPU needed)."""
    monkeypatch.setattr(configs, "_device_name", lambda device: name)
    monkeypatch.setattr(configs, "capability", lambda device: cap)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for switch in ("MOK_TMA", "MOK_GROUP_M"):
        monkeypatch.delenv(switch, raising=False)
    return torch.device("cuda", 0)


def test_a_gpu_without_a_table_takes_its_architectures(monkeypatch):
    """An H100 uses the H200's tuned table (same compute capability); another architecture the heuristic."""
    h200 = configs._tuned()["NVIDIA H200"]
    dev = gpu_like(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    for kernel in tune.KERNELS:
        assert configs.config(kernel, torch.bfloat16, 256, dev) == h200[f"{kernel}/16bit/m256"], kernel
    dev = gpu_like(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    assert configs.config("gate_up", torch.bfloat16, 256, dev) == configs._DEFAULTS["gate_up"]["m256"]
    dev = gpu_like(monkeypatch, "NVIDIA H200", (9, 0))
    assert configs.config("down", torch.float16, 16, dev) == h200["down/16bit/m16"]
    assert configs.config("down", torch.float32, 16, dev) == h200["down/fp32/m16"]  # fp32: its own entries
    dev = gpu_like(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    assert configs.config("down", torch.float32, 16, dev) == configs._FP32_DEFAULT["down"]


def test_a_decode_step_takes_its_own_entries_else_the_small_batch_ones(monkeypatch):
    """At most 4 rows per expert (m4): its own tuned entry where the table has one (the forward's GEMMs), else
    the m16 entry, else the m16 heuristic."""
    dev = gpu_like(monkeypatch, "NVIDIA H200", (9, 0))
    table = {"down/16bit/m4": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
             "down/16bit/m16": dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
             "dgrad/16bit/m16": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)}
    monkeypatch.setattr(configs, "_table", lambda device: table)
    assert configs.bucket(4.0) == "m4" and configs.bucket(4.01) == "m16"
    assert configs.config("down", torch.bfloat16, 0.5, dev) == table["down/16bit/m4"]
    assert configs.config("down", torch.bfloat16, 8, dev) == table["down/16bit/m16"]
    assert configs.config("dgrad", torch.bfloat16, 0.5, dev) == table["dgrad/16bit/m16"]
    assert configs.config("gate_up", torch.bfloat16, 0.5, dev) == configs._DEFAULTS["gate_up"]["m16"]
