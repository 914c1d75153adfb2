"""CPU kernel of `mok::fused_moe` and its backward: C++ in csrc/fused_moe_cpu.cpp.

The C++ source is compiled with `torch.utils.cpp_extension.load` (ninja) the
first time the op runs on CPU, not at import, so `import mok_compile` stays
cheap and needs no compiler. The build is cached in torch's extension directory
(or `$MOK_BUILD_DIR`); ninja rebuilds it when the source changes. The library
registers `torch.ops.mok_cpu.fused_moe` / `fused_moe_backward`; this module
routes the CPU dispatch key of the public ops to them.

Without a compiler or ninja, or if the build fails, the CPU key falls back to
the reference (`reference.py`) with one warning naming the cause: slower, same
results.
"""

from __future__ import annotations

import os
import shutil
import threading
import warnings
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: builds are not guarded against a dead build's lock
    fcntl = None

import torch

from . import library, reference

EXTENSION_NAME = "mok_fused_moe_cpu"
_SOURCE_NAME = "fused_moe_cpu.cpp"

# {"loaded": bool, "error": str}; filled by the first call of `extension_loaded()`.
_state: dict = {}
_lock = threading.Lock()


def source_path(name: str = _SOURCE_NAME) -> Path:
    """csrc/<name> (this kernel's source by default) of the repository, or the copy shipped inside the package."""
    here = Path(__file__).resolve()
    candidates = (here.parents[2] / "csrc" / name, here.parents[1] / "csrc" / name)
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(f"C++ source {name} not found (looked in {', '.join(map(str, candidates))})")


def missing_build_tool() -> str | None:
    """Why the C++ kernel cannot be built here (no ninja, no compiler), or None."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler found (looked for {compiler!r}; set CXX)"
    return None


def build_directory(name: str) -> str | None:
    """Where extension `name` builds: `$MOK_BUILD_DIR/<name>` (made if missing), else None (torch's extension
    directory). Raises RuntimeError naming what is missing where it cannot be built here."""
    missing = missing_build_tool()
    if missing:
        raise RuntimeError(missing)
    build_dir = os.environ.get("MOK_BUILD_DIR")
    if build_dir:
        build_dir = os.path.join(build_dir, name)
        os.makedirs(build_dir, exist_ok=True)
    return build_dir


def load_extension(name: str, **kwargs):
    """`torch.utils.cpp_extension.load` of extension `name` in its build directory (`build_directory`), safe
    against a build that died.

    Up to torch 2.13, torch's build lock is a plain file, `<build directory>/lock`, that a build removes when it
    ends. A build that was killed (a cancelled job, a timeout) leaves it behind, and every later load of that
    directory waits for it forever: a hang at the first CPU call of the op. So every build here first takes an OS
    lock on `<build directory>/mok.lock`, which the kernel releases when its holder dies: a `lock` file found while
    holding it is a dead build's, and is removed (ninja finishes that build). From torch 2.14 on, torch holds an OS
    lock on that file itself and leaves the file after every build: there it is left alone (`_lock_file_blocks`)."""
    from torch.utils import cpp_extension

    build_dir = build_directory(name)
    if build_dir is None and hasattr(cpp_extension, "_get_build_directory"):
        build_dir = cpp_extension._get_build_directory(name, verbose=False)  # torch's own choice, made if missing
    if fcntl is None or build_dir is None:
        return cpp_extension.load(name=name, build_directory=build_dir, **kwargs)
    with open(os.path.join(build_dir, "mok.lock"), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # waits for a live build; released at close or when this process dies
        stale = os.path.join(build_dir, "lock")
        if _lock_file_blocks(cpp_extension) and os.path.exists(stale):
            warnings.warn(f"mok_compile: removed {stale}, left by a build of {name} that did not finish",
                          RuntimeWarning, stacklevel=2)
            os.remove(stale)
        return cpp_extension.load(name=name, build_directory=build_dir, **kwargs)


def _lock_file_blocks(cpp_extension) -> bool:
    """Whether torch's build lock is a file whose existence blocks (`FileBaton`, up to torch 2.13), rather than an OS
    lock on it (`FileLock`, from 2.14 on: the file stays after a build, and a dead holder's lock is released)."""
    return hasattr(cpp_extension, "FileBaton")


def _build_and_load() -> None:
    """Compile (or reuse the cached build of) the C++ kernel and load it into this process."""
    load_extension(
        EXTENSION_NAME,
        sources=[str(source_path())],
        # -fopenmp: at::parallel_for is a header template that runs serially without it.
        # The process already holds torch's libgomp, so no second OpenMP runtime is loaded.
        extra_cflags=["-O2", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


def extension_loaded() -> bool:
    """Build/load the C++ kernel once per process; False (after one warning) if that is impossible."""
    if "loaded" not in _state:
        with _lock:
            if "loaded" not in _state:
                try:
                    _build_and_load()
                    _state.update(loaded=True, error="")
                except Exception as err:  # noqa: BLE001 - any build failure means: use the reference
                    cause = _short_cause(err)
                    _state.update(loaded=False, error=cause)
                    warnings.warn(f"mok_compile: the C++ CPU kernel of mok::fused_moe is unavailable ({cause}); "
                                  "using the slower Python reference on CPU instead", RuntimeWarning, stacklevel=3)
    return _state["loaded"]


def _short_cause(err: Exception, max_chars: int = 600) -> str:
    """The exception in one readable piece: of a long compiler log, its first error lines."""
    text = f"{type(err).__name__}: {err}".strip()
    errors = [line.strip() for line in text.splitlines() if "error" in line.lower()]
    if len(text) > max_chars and errors:
        text = " | ".join(errors)
    return text if len(text) <= max_chars else text[:max_chars] + " ..."


def kernel_name() -> str:
    """Which CPU kernel runs: 'cpp' or 'reference' (builds the extension if needed)."""
    return "cpp" if extension_loaded() else "reference"


def _fused_moe_cpu(*args, **kw):
    kw = library.checked_kwargs(args, kw)
    if not extension_loaded():
        return reference.fused_moe_reference(*args, **kw)
    return torch.ops.mok_cpu.fused_moe(*args, **kw)


def saves_gate_up(x, kw) -> bool:
    """Whether autograd runs `mok::fused_moe_train` on the CPU (see `library._saves_gate_up`): the C++ kernel,
    fp32/fp64 only. In bf16/fp16 the C++ backward recomputes h in fp32 from the upcast inputs, as the
    reference does; a saved h rounded to 16 bits would move bf16 gradients by up to a few percent
    where that recompute matches the reference to one rounding."""
    return x.dtype in (torch.float32, torch.float64) and library.may_save_gate_up(x, kw) and extension_loaded()


def _fused_moe_train_cpu(*args, **kw):
    kw = library.checked_kwargs(args, kw)
    if not saves_gate_up(args[0], kw):
        raise RuntimeError("mok::fused_moe_train is for the autograd of mok::fused_moe where "
                           "mok_compile.ops.cpu.saves_gate_up holds (C++ kernel, not weight-on-input)")
    out = torch.ops.mok_cpu.fused_moe_train(*args, **kw)
    # The C++ backward recomputes the logits, its own expert order and a post norm's input: nothing more to keep
    # (empty outputs).
    width = library.routing_width(args[4], kw)
    return (*out, *library.saved_routing_like(args[0], args[1], width, kw, kept=False),
            args[0].new_empty((0, args[0].shape[1])))


def _fused_moe_backward_cpu(grad_out, grad_topk_weights, hidden_states, router, router_bias, selection_bias,
                            gate_up_proj, gate_up_bias, down_proj, down_bias, topk_weights, topk_ids,
                            gate_up_out=None, router_logits=None, routing_layout=None, post_norm_input=None, **kw):
    """The C++ backward; it recomputes the routing and a post norm's input, so `router_logits`, `routing_layout` and
    `post_norm_input` are not read."""
    kw = library.checked_kwargs((hidden_states, router, router_bias, selection_bias, gate_up_proj, gate_up_bias,
                                 down_proj, down_bias), kw)
    args = (grad_out, grad_topk_weights, hidden_states, router, router_bias, selection_bias, gate_up_proj,
            gate_up_bias, down_proj, down_bias, topk_weights, topk_ids)
    if not extension_loaded():
        return reference.fused_moe_backward_reference(*args, **kw)
    return torch.ops.mok_cpu.fused_moe_backward(*args, **kw, gate_up_out=gate_up_out)


def _fused_moe_backward_consume_cpu(*args, **kw):
    """The backward over a saved h that is dead afterwards: the C++ kernel reads h and leaves it (nothing to
    reuse its memory for on the CPU). Registered, rather than left to the composite kernel, so that the
    eager backward calls it directly instead of through the dispatcher twice."""
    *args, gate_up_out = args
    for name in ("if_graph_freed", *library.SPENT_KWARGS):
        kw.pop(name, None)
    return _fused_moe_backward_cpu(*args, gate_up_out=gate_up_out, **kw)


library.impl_backend_kernels("CPU", {"fused_moe": _fused_moe_cpu, "fused_moe_train": _fused_moe_train_cpu,
                                     "fused_moe_backward": _fused_moe_backward_cpu,
                                     "fused_moe_backward_consume": _fused_moe_backward_consume_cpu})
