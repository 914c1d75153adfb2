"""Block sizes of the grouped kernels: tuned values as data (`configs.json`), a heuristic otherwise.

A config is chosen from (kernel, dtype, rows per expert) only, never by timing at
call time, so the first call costs nothing extra and CUDA-graph capture never
sees a benchmark. `configs.json` maps device name -> "kernel/dtype/bucket" -> config
(a GPU without a table of its own takes one of its compute capability's, `_table`);
the buckets follow the mean number of rows an expert gets (T * top_k / E),
which decides whether a GEMM is weight-bandwidth bound (few rows) or
matrix-unit bound (many rows).
"""

from __future__ import annotations

import functools
import json
import os

import torch

_JSON = os.path.join(os.path.dirname(__file__), "configs.json")
BUCKETS = (("m4", 4), ("m16", 16), ("m64", 64), ("m256", 256), ("m1024", 1024), ("mbig", float("inf")))
# A bucket without a tuned entry of its own takes this one's: m4 (a decode step's at most 4 rows per expert) is
# tuned in the committed tables for the forward's GEMMs only, and its backward kernels take m16's. m4's narrow
# tiles beat m16's up to 4 rows per expert and lose at 8 with GPT-OSS's transposed weights (NOTES v26).
_FALLBACK = {"m4": "m16"}

# Heuristic defaults (bf16/fp16), by kernel and bucket; fp32 halves the tiles (shared memory).
_DEFAULTS = {
    "gate_up": {
        "m16": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
        "m64": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
        "m256": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
        "m1024": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
        "mbig": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    },
    "down": {
        "m16": dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4),
        "m64": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
        "m256": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
        "m1024": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
        "mbig": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
    },
    "bwd_gate_up": {
        "m16": dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
        "m64": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
        "m256": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
        "m1024": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3),
        "mbig": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3),
    },
    "wgrad": {
        "m16": dict(BLOCK_P=64, BLOCK_Q=64, BLOCK_R=32, num_warps=4, num_stages=3),
        "m64": dict(BLOCK_P=128, BLOCK_Q=64, BLOCK_R=32, num_warps=4, num_stages=3),
        "m256": dict(BLOCK_P=128, BLOCK_Q=128, BLOCK_R=64, num_warps=8, num_stages=3),
        "m1024": dict(BLOCK_P=128, BLOCK_Q=128, BLOCK_R=64, num_warps=8, num_stages=3),
        "mbig": dict(BLOCK_P=128, BLOCK_Q=128, BLOCK_R=64, num_warps=8, num_stages=3),
    },
}
_DEFAULTS["dgrad"] = _DEFAULTS["down"]
_DEFAULTS["bwd_g2"] = _DEFAULTS["down"]
# fp32 without tuned entries (a GPU of another architecture): small tiles, sized when fp32 ran on Triton's FMA dot.
# On Hopper the tuned fp32 entries (`tune --dtype fp32`, for the tf32x3 dot) take 64- and 128-row tiles: an fp32
# layer ran 1.5-1.7x faster with them than with these (NOTES v75).
_FP32_GEMM = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)
_FP32_DEFAULT = {
    **dict.fromkeys(("gate_up", "down", "dgrad", "bwd_g2"), _FP32_GEMM),
    "bwd_gate_up": {**_FP32_GEMM, "BLOCK_N": 32},
    "wgrad": dict(BLOCK_P=64, BLOCK_Q=64, BLOCK_R=32, num_warps=4, num_stages=2),
}
# Small tiles for the CPU interpreter (tests): its cost grows with tile size, not program count.
_INTERPRET = {
    **dict.fromkeys(("gate_up", "down", "dgrad", "bwd_gate_up", "bwd_g2"),
                    dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=1, num_stages=1)),
    "wgrad": dict(BLOCK_P=16, BLOCK_Q=16, BLOCK_R=16, num_warps=1, num_stages=1),
}

def bucket(rows_per_expert: float) -> str:
    for name, bound in BUCKETS:
        if rows_per_expert <= bound:
            return name
    return BUCKETS[-1][0]


@functools.cache
def _tuned() -> dict:
    try:
        with open(_JSON) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


# A table tuned on one GPU also serves the other GPUs of its compute capability until they are tuned themselves
# (an H100 or H800 takes the H200's): the same SM (shared memory, tensor cores, TMA), so the same tiles fit and
# the heuristic above is the worse guess (on the H200, in one process, the op's forward at DeepSeek-V3's T=4096
# took 9.8 ms with the heuristic's tiles against 7.5 with tuned ones; Qwen3's at T=2048 0.62 against 0.48 ms:
# NOTES v23). Measured on the H200 only.
_TABLE_CAPABILITY = {"NVIDIA H200": (9, 0)}


def _table(device: torch.device) -> dict:
    """The tuned entries for `device`: its own table, else one of a GPU of the same compute capability."""
    tuned = _tuned()
    return tuned.get(table_name(tuned, device)) or {}


def table_name(tables: dict, device: torch.device) -> str | None:
    """The name of the table in `tables` (device name -> entries) that `device` reads: its own where there is one,
    else that of a GPU of its compute capability, else None (the tuner's `merge` writes into the same one)."""
    name = _device_name(device)
    if name in tables or device.type != "cuda":
        return name
    cap = capability(device)
    return next((n for n, c in _TABLE_CAPABILITY.items() if c == cap and n in tables), None)


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@functools.cache
def capability(device: torch.device) -> tuple:
    return torch.cuda.get_device_capability(device)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a persistent grid's unit); 2 elsewhere (the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def config(kernel: str, dtype: torch.dtype, rows_per_expert: float, device: torch.device) -> dict:
    """Block sizes and launch options for `kernel` (gate_up, down, bwd_g2, bwd_gate_up, dgrad, wgrad).
    `TMA`: B tiles through a TMA descriptor where the weights allow it (grouped GEMMs), the gradient's tiles
    stored through one (wgrad); MOK_TMA=0|1 overrides the table (tests, benchmarks). `GROUP_M` (grouped GEMMs,
    the kernels' default 8 where absent): row blocks per group of the tile order; MOK_GROUP_M=n overrides it
    (benchmarks). `PROGRAMS_PER_SM` (wgrad): a persistent grid of that many programs per SM, while each program
    runs at most `MAX_TILES_PER_PROGRAM` tiles where given (`moe._wgrad_programs`)."""
    cfg = _config(kernel, dtype, rows_per_expert, device)
    forced = os.environ.get("MOK_TMA")
    if forced in ("0", "1") and kernel != "bwd_gate_up":
        cfg["TMA"] = forced == "1"
    group = os.environ.get("MOK_GROUP_M")
    if group and kernel != "wgrad":
        cfg["GROUP_M"] = int(group)
    return cfg


def half_tail(block_m: int) -> bool:
    """Whether a grouped GEMM runs row blocks of at most BLOCK_M // 2 rows at that height (`HALF_TAIL`):
    from BLOCK_M = 128 on (a 64-row half still fills Hopper's 64-row wgmma; smaller halves fall back to
    mma.sync, not measured to pay); MOK_HALF_TAIL=0 turns it off, =1 on wherever the half tile has
    >= 16 rows (tests: the interpreter's 32-row blocks)."""
    forced = os.environ.get("MOK_HALF_TAIL")
    if forced == "0":
        return False
    return block_m // 2 >= 16 if forced == "1" else block_m >= 128


def dtype_key(dtype: torch.dtype) -> str:
    """A table key's dtype part: "fp32", else "16bit" (bf16 and fp16 share tiles: same bytes, same tensor-core
    rate)."""
    return "fp32" if dtype == torch.float32 else "16bit"


def _config(kernel, dtype, rows_per_expert, device):
    if os.environ.get("TRITON_INTERPRET") == "1":
        return dict(_INTERPRET[kernel])
    b = bucket(rows_per_expert)
    dname = dtype_key(dtype)
    table = _table(device)
    tuned = table.get(f"{kernel}/{dname}/{b}")
    if tuned is None and b in _FALLBACK:
        tuned = table.get(f"{kernel}/{dname}/{_FALLBACK[b]}")
    if tuned is not None:
        return dict(tuned)
    if dtype == torch.float32:
        return dict(_FP32_DEFAULT[kernel])
    return dict(_DEFAULTS[kernel][_FALLBACK.get(b, b)])


# ----------------------------------------------------------------------------- GEMM engine per stage
# Which engine runs each kind of expert GEMM: our Triton kernels (gather and activation fused into
# the GEMM) or PyTorch's CUTLASS grouped GEMM (`cutlass_gemm.py`, faster tiles but unfused).
#   gathered  forward gate_up, backward g2 and the h recompute (CUTLASS pays a row gather + an activation pass)
#   down      forward down; dgrad: backward d(pair inputs) (A already in sorted order: nothing extra to pay)
#   wgrad     both weight gradients (CUTLASS pays the gathers of x and grad_out)
# CUTLASS is used from this many mean rows per expert (T * top_k / E) on; measured on an H200 with
# `python -m benchmarks.engines` (table in benchmarks/NOTES-gpu.md): Triton wins at few rows per
# expert (weight-bandwidth bound, and its fused gather saves a pass), CUTLASS from ~512 rows on for
# the sorted GEMMs and the gathered ones of wide experts (below), and in the weight gradients from ~64.
# The weight gradients' 64 was rechecked with the 2-stage tiles of buckets m16 and m64 (NOTES v36 (3)): in the op's
# fwd+bwd, Triton at 64 rows per expert was 1.027x at Qwen3 but 0.95x at DeepSeek-V3 and 0.97x at Mixtral.
# The sorted GEMMs' bound was 256 until the tuned Triton tiles (128 x 256, B through TMA) won there: at 256
# rows per expert, bit for bit the same, the forward ran 1.015-1.04x faster on Triton at Qwen3 (three runs),
# 1.02x at GPT-OSS and DeepSeek-V3, and Mixtral's was a wash (1.03x, 0.98x); at 512 rows (Qwen3) 0.997x
# (`python -m benchmarks.configs_ab engine:sorted=cutlass engine:auto`, alternating rounds; NOTES v27).
# MOK_GEMM_ENGINE=triton|cutlass forces every stage (tests, benchmarks), or per stage:
# MOK_GEMM_ENGINE=gathered=triton,down=cutlass,wgrad=cutlass ("sorted=" sets down and dgrad; "gate_up=" the
# forward gate_up alone, which may also take "sm90": `gate_up_engine`). The weight gradients may also take "sm90",
# the Hopper CUDA kernel (csrc/wgrad_sm90.cu, gathers in-kernel), only when asked for: bit for bit CUTLASS's result
# but 0.79-0.84x its fwd+bwd in the layer (NOTES v29; `python -m benchmarks.configs_ab engine:wgrad=cutlass
# engine:wgrad=sm90`).
# With transposed weights ([E, in, out], GPT-OSS) the Triton weight gradient is slow (measured at GPT-OSS
# T=256, 32 rows per expert: 1.30 ms against CUTLASS's 0.64), so CUTLASS takes it at any size.
# Rechecked with the 2-stage tiles (NOTES v36 (6)): the op's fwd+bwd at GPT-OSS T=128 / 256 ran 0.92x / 0.82x on Triton.
# The gathered stage takes CUTLASS only for wide experts (H * I from _GATHERED_CUTLASS_MIN_SIZE): since the
# Triton gate_up reads gate and up through one TMA box and walks its tiles in row-block groups (NOTES v13),
# it is faster at Qwen3's 1024 rows per expert (T=16384: graph forward 2.51 against 3.02 ms) and GPT-OSS's
# 512 (1.71 against 1.81), and ties Mixtral's 1024 (5.04 against 5.01, whose activation and gather passes
# are small next to its GEMMs).
STAGES = ("gathered", "down", "dgrad", "wgrad")
_CUTLASS_FROM_ROWS = {"gathered": 512, "down": 512, "dgrad": 512, "wgrad": 64}
_CUTLASS_FROM_ROWS_TRANSPOSED = {**_CUTLASS_FROM_ROWS, "wgrad": 0}
_GATHERED_CUTLASS_MIN_SIZE = 1 << 24  # H * I: Mixtral 4096 * 14336 takes CUTLASS; GPT-OSS 2880^2, Qwen3 do not


def _forced(stage: str, allowed: tuple) -> str | None:
    """The engine MOK_GEMM_ENGINE names for `stage` (all stages, or "stage=engine,..."), or None."""
    forced = os.environ.get("MOK_GEMM_ENGINE", "")
    if not forced:
        return None
    if forced in ("triton", "cutlass"):
        return forced
    parts = dict(part.split("=", 1) for part in forced.split(","))
    choice = parts.get(stage, parts.get("sorted") if stage in ("down", "dgrad") else None)
    if choice is not None and choice not in allowed:
        raise ValueError(f"MOK_GEMM_ENGINE: stage {stage!r} must be one of {', '.join(allowed)}, got {choice!r}")
    return choice


def engine(stage: str, rows_per_expert: float, transposed: bool = False, expert_size: int | None = None) -> str:
    """'cutlass' or 'triton' for `stage` (the caller has checked that CUTLASS is eligible at all), or for the
    weight gradients 'sm90' (the Hopper CUDA kernel; `moe._engines` checks that the call fits it);
    `expert_size` = H * I, where known."""
    forced = _forced(stage, ("triton", "cutlass", "sm90") if stage == "wgrad" else ("triton", "cutlass"))
    if forced is not None:
        return forced
    table = _CUTLASS_FROM_ROWS_TRANSPOSED if transposed else _CUTLASS_FROM_ROWS
    if stage == "gathered" and expert_size is not None and expert_size < _GATHERED_CUTLASS_MIN_SIZE:
        return "triton"
    return "cutlass" if rows_per_expert >= table[stage] else "triton"


# The forward gate_up may also run on the Hopper CUDA kernel (csrc/gate_up_sm90.cu: persistent, warp-specialised,
# W1 tiles multicast to a pair of CTAs; `gate_up_sm90.eligible` says which calls fit it), but only when asked for
# (MOK_GEMM_ENGINE=gate_up=sm90): it is bit for bit the Triton gate_up's output and not faster in the layer. Kernels
# alone on the tuner's random routing it ran 0.93x (Qwen3 T=4096) to 1.05-1.15x (Qwen3 T=16384, Mixtral, DeepSeek-V3
# T=4096) of the Triton kernel, but the op replayed from CUDA graphs in alternating rounds read 0.96-1.00x forward at
# those shapes (NOTES v28; measured while a threshold sent those shapes to it, as `python -m benchmarks.configs_ab
# engine:gate_up=triton engine:auto`; the same comparison now: `... engine:gate_up=triton engine:gate_up=sm90`). On
# the layer's own routing the kernel alone runs 0.93-0.98x at all four shapes (NOTES v31, `benchmarks.gate_up_kernels`).


def gate_up_engine(gathered: str) -> str:
    """Engine of the forward gate_up: what MOK_GEMM_ENGINE=...,gate_up=sm90|triton|cutlass (or a global
    MOK_GEMM_ENGINE=triton|cutlass) names, else `gathered`, the gathered stage's engine."""
    forced = _forced("gate_up", ("sm90", "triton", "cutlass"))
    return gathered if forced is None else forced
