"""Few-token forwards and backwards, and small inference forwards, replayed from CUDA graphs.

At a few hundred tokens and fewer the forward's GPU time (47 us for one Qwen3-30B-A3B token, 0.34 ms for 256) is
below the host time of its nine launches and the Python around them, even replayed from a launch plan (`plan.py`;
benchmarks/NOTES-gpu.md v20-v23, v49), and so is a training step's: a caller that runs the op eagerly, or compiled
in inductor's default mode, waits on the host. `GraphCache` captures one call signature in a CUDA graph and replays
it: the call's per-call tensors (x, any given expert ids, and the logits where the router argument is the logits
rather than a weight; for the backward also grad_out, the routing and the saved h, logits and layout) copied into
the graph's own buffers, one replay, the outputs copied out into new tensors. The graph holds the
same kernels with the same configs as the launches it replaces, so the outputs are the same bits.

A graph reads every tensor at the address it had at capture, so its key is a launch plan's signature
(`plan.signature`: shapes, strides, dtypes, options, switches) plus the address of every tensor not copied
(weights updated in place, as by an optimizer step, are read as they are then; a new tensor gets a new graph) and
the stream (a replay runs on its capture's stream). The inference and training forwards are captured whole (the
training forward's h, logits and layout for the backward are copied out too: K * 2I elements per token). The
backward's weight gradients are new full-size tensors each call, which a graph cannot write without copying them
out (or handing out its own buffers, which the next replay would overwrite): its graph captures the rest, and
`finish` launches the weight gradients after each replay from the graph's dh and w * act(h) and the call's weights,
through a launch plan (NOTES v50). A graph keeps none of the caller's tensors (NOTES v51).

Where: CUDA, 1 to `max_tokens` tokens (MOK_GRAPH_TOKENS, default 512; 0 turns graphs off), and past that an
inference forward of at most 4096 tokens whose expert work T * K * H * I is at most `max_inference_macs`
multiply-adds (MOK_GRAPH_INFERENCE_MACS, default 2^34: Zaya's or Granite-MoE's experts up to 4096 tokens,
Qwen3-30B-A3B's up to 1365). Such a forward takes less GPU time than its launches take the host, and its graph keeps
only copies of x and the output (2 * T * H elements). A training forward's graph would keep h too and its backward's
more, per layer (about 280 MB a Granite-MoE layer at 4096 tokens), so those stay at few tokens
(benchmarks/NOTES-gpu.md v67). Also: Triton's fast launch path usable (no profiler hooks), and no capture under way
on this stream: `mode="reduce-overhead"` captures the op in inductor's own graph. A signature is captured on its
second call; one whose capture failed is not tried again. Memory: the graphs of one device and stream share one
pool, so their intermediates take the largest graph's (tens of MB at 512 tokens), not the sum; each graph also keeps
its buffers of its own (the per-call tensors, the outputs, and for the backward what its weight gradients read but
the weights). The cache keeps at most 512 graphs within 1 GiB of those buffers. A model's layers call it in turn,
one graph each, so a model with more layers than fit would, with least-recently-used eviction, evict every graph
before its next call and never replay one. So a graph makes room only by evicting graphs gone stale (no call in the
last 4 * 512 calls); while the graphs in use fill the cache, the other calls run from launch plans. Once 16 graphs
have left it never replayed (more distinct token counts than it holds, each seen twice), it stops capturing.
"""

from __future__ import annotations

import collections
import logging
import os
import threading

import torch

from . import launch, plan

log = logging.getLogger("mok_compile.graphs")

DEFAULT_TOKENS = 512
max_tokens = int(os.environ.get("MOK_GRAPH_TOKENS", DEFAULT_TOKENS))
# Past max_tokens, an inference forward whose expert work T * K * H * I is at most this many multiply-adds (about
# 0.2 ms of GPU time on an H100, less than its launches' host time; NOTES-gpu.md v67).
DEFAULT_INFERENCE_MACS = 1 << 34
max_inference_macs = int(os.environ.get("MOK_GRAPH_INFERENCE_MACS", DEFAULT_INFERENCE_MACS))
# ... and of at most this many tokens: the copies of x and the output grow with T * H, which the work bound alone
# would let grow without limit as the experts shrink (4096: the most measured, NOTES v67).
MAX_INFERENCE_TOKENS = 4096
_MAX_GRAPHS = 512  # a graph per layer and token count: Qwen3-235B has 94 layers
_STALE = 4  # a graph no call has used in the last _STALE * max_graphs calls may be evicted for another
_MAX_UNUSED = 16  # graphs evicted unused (no call after the capturing one) before the cache stops capturing
_MAX_SEEN = 4096  # keys seen once (a key is captured on its second call): room for 8 per graph kept
_MAX_BYTES = 1 << 30  # what a cache's graphs keep of their own (inputs, outputs, the tensors `finish` holds)
_ALIGN = 256  # bytes: the most alignment cuBLAS's heuristics look at


class _Graph:
    """One captured call: its input buffers, its graph, the outputs the graph writes, and what runs after each
    replay (`finish`: launches that write new tensors, the backward's weight gradients)."""

    __slots__ = ("inputs", "copied", "graph", "outputs", "finish", "plan", "nbytes", "hits", "last")

    def __init__(self, capture, tensors, copied, stream, pool):
        current = torch.cuda.current_stream(tensors[0].device)
        # Plain tensors even under inference_mode: the buffers are written on every replay, which an inference
        # tensor allows only inside inference mode.
        with torch.inference_mode(False), torch.no_grad():
            self.copied = [i for i in copied if tensors[i] is not None]
            args = list(tensors)
            for i in self.copied:
                args[i] = _like_aligned(tensors[i])
                args[i].copy_(tensors[i])
            self.inputs = [args[i] for i in self.copied]
            stream.wait_stream(current)
            with torch.cuda.stream(stream):  # warm-up on the capture stream (cuBLAS's per-stream workspace)
                capture(*args)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                self.outputs, self.finish = capture(*args)
            current.wait_stream(stream)
        self.plan = None
        kept = [*self.inputs, *self.outputs, *(self.finish[1] if self.finish else ())]
        self.nbytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                           for t in kept if t is not None}.values())
        self.hits = 0  # calls served after the capturing one
        self.last = 0  # the cache's call count at its last use

    def replay(self, tensors):
        for i, buf in zip(self.copied, self.inputs):
            buf.copy_(tensors[i])
        self.graph.replay()
        out = tuple([None if t is None else t.clone() for t in self.outputs])
        if self.finish is None:
            return out
        fn, held, reads = self.finish
        args = [*held, *[tensors[i] for i in reads]]  # this call's own weights: the graph keeps no caller tensor
        if self.plan is None:  # recorded on the first replay (plan.py), so later ones skip its Python
            recorded, result = plan.Plan.record(lambda: fn(*args), args) if plan.enabled else (False, fn(*args))
            self.plan = recorded or False
            return out + tuple(result)
        return out + tuple(self.plan.replay(args) if self.plan else fn(*args))


def _alignment(x) -> int:
    """The address modulo 256 bytes of what the launches read for a per-call tensor x: x's own, or a fresh contiguous
    copy's (0)."""
    return x.data_ptr() % _ALIGN if x.is_contiguous() else 0


def _like_aligned(x):
    """A contiguous tensor of x's shape and dtype at `_alignment(x)`: cuBLAS picks the router GEMMs' algorithms by
    their operands' alignment, so the graph's copy of a per-call tensor (x, grad_out, ...) must keep what the
    launches would read to give their bits."""
    pad = _ALIGN // x.element_size()
    buf = torch.empty(x.numel() + pad, dtype=x.dtype, device=x.device)
    offset = (_alignment(x) - buf.data_ptr()) % _ALIGN // x.element_size()
    return buf[offset:offset + x.numel()].view(x.shape)


def eligible(x, macs=None) -> bool:
    """Whether a call whose first tensor is `x` may be replayed from a graph (see the module docstring); `macs`: its
    expert work where it is an inference forward."""
    return (within_bounds(x.shape[0], macs) and x.is_cuda and x.get_device() == torch._C._cuda_getDevice()
            and launch.fast_launch and not launch._hooks_set() and not torch.cuda.is_current_stream_capturing())


def within_bounds(T: int, macs=None) -> bool:
    """The size rule of `eligible`: 1 to `max_tokens` tokens (none when it is 0), or past that an inference forward
    (`macs`, its T * K * H * I, given) of at most `MAX_INFERENCE_TOKENS` tokens and `max_inference_macs`."""
    if T <= 0 or max_tokens <= 0:
        return False
    return T <= max_tokens or (macs is not None and T <= MAX_INFERENCE_TOKENS and macs <= max_inference_macs)


class GraphCache:
    """Captured calls of one entry point, by key (see the module docstring). `copied`: the positions of the
    call's per-call tensors (x for the forward), copied into the graph's own buffers on each replay; every other
    tensor is read where it was at capture and keys the graph by its address."""

    def __init__(self, copied=(0,), max_graphs: int = _MAX_GRAPHS, max_bytes: int = _MAX_BYTES):
        self._copied = tuple(copied)
        self._graphs = collections.OrderedDict()
        self._seen = collections.OrderedDict()  # key -> True (seen once) or False (its capture failed)
        self._sizes = collections.OrderedDict()  # signature -> the bytes its last capture kept
        self._pools = {}
        self._streams = {}
        self._max, self._max_bytes, self._bytes = max_graphs, max_bytes, 0
        self._calls = 0  # eligible calls so far: the clock that tells a stale graph
        self._lock = threading.Lock()
        self.unused = 0  # graphs evicted before serving a call after their capture

    def call(self, run, tensors, options, capture=None, also_copied=(), macs=None):
        """`run(*tensors)`, the entry point over `tensors` (its tensor arguments, None for absent ones; the first
        fixes the token count) with `options` (hashable: everything else it takes), or its graph's replay.
        `also_copied`: positions of more per-call tensors this call has (which `options` must tell apart), copied
        like the cache's own (a router argument that is the call's logits rather than a weight). `macs`: the
        call's expert work (T * K * H * I) where it is an inference forward, which may take a graph past
        `max_tokens` tokens (`eligible`).
        `capture(*tensors)`, where given, is what a graph records instead: (outputs, finish), finish None or
        (fn, held, reads): `fn(*held, *(the call's tensors at positions reads))` launched after each replay for the
        rest of the outputs (new tensors). `held` are the graph's own tensors; `reads` name tensors not copied (the
        weights), which the graph must not keep: a model's weights are freed with the model, not with its graphs."""
        x = tensors[0]
        if not eligible(x, macs):
            return run(*tensors)
        self._calls += 1
        try:
            stream = torch._C._cuda_getCurrentRawStream(x.device.index)
            copied = self._copied + tuple(also_copied)
            key = (plan.signature(tensors, options),
                   tuple([None if tensors[i] is None else _alignment(tensors[i]) for i in copied]),
                   tuple([None if t is None or i in copied else t.data_ptr() for i, t in enumerate(tensors)]),
                   stream)
            graph = self._graphs.get(key)
        except TypeError:  # an unhashable option: no graph
            return run(*tensors)
        if graph is not None:
            with self._lock:  # two threads on one stream would otherwise interleave their copies and replays
                if key in self._graphs:  # (not evicted by another thread since)
                    self._graphs.move_to_end(key)
                graph.hits += 1
                graph.last = self._calls
                return graph.replay(tensors)
        seen = self._seen.get(key)
        if seen is None or seen is False or self.unused >= _MAX_UNUSED:
            out = run(*tensors)
            if seen is None:  # (after the call: a call that raises is not a signature worth capturing)
                plan._remember(self._seen, key, True, _MAX_SEEN)
            return out
        with self._lock:
            if not self._make_room(1, self._sizes.get(key[0], 0)):  # the graphs in use fill the cache
                return run(*tensors)
            try:
                graph = _Graph(capture or (lambda *t: (run(*t), None)), tensors, copied, self._stream(x.device),
                               self._pool(x.device, stream))
            except Exception as err:  # never fails the call: it runs unrecorded, as before
                log.warning("mok_compile: a call of %d tokens could not be captured in a CUDA graph (%s: %s); "
                            "that signature runs without one", x.shape[0], type(err).__name__, err)
                self._seen[key] = False
                return run(*tensors)
            plan._remember(self._sizes, key[0], graph.nbytes, _MAX_SEEN)
            graph.last = self._calls
            self._graphs[key] = graph
            self._bytes += graph.nbytes
            if not self._make_room(0, 0):  # larger than the room made for it: not kept (its signature's size is
                self._bytes -= self._graphs.pop(key).nbytes  # known now, so the next such call is not captured)
            if self.unused >= _MAX_UNUSED:
                log.info("mok_compile: %d CUDA graphs left the cache unreplayed; no more calls are captured",
                         self.unused)
            return graph.replay(tensors)

    def _make_room(self, graphs: int, nbytes: int) -> bool:
        """Evict stale graphs, least recently used first, until `graphs` more graphs of `nbytes` in all fit (one
        graph alone always does); False where a graph in use would have to go."""
        while self._graphs and (len(self._graphs) + graphs > self._max
                                or self._bytes + nbytes > self._max_bytes and len(self._graphs) + graphs > 1):
            key, oldest = next(iter(self._graphs.items()))
            if self._calls - oldest.last <= _STALE * self._max:
                return False
            self._evict(key)
        return True

    def _evict(self, key):
        graph = self._graphs.pop(key)
        self._bytes -= graph.nbytes
        self.unused += graph.hits == 0

    def _stream(self, device):
        """The side stream captures run on, one per device."""
        stream = self._streams.get(device.index)
        if stream is None:
            stream = self._streams[device.index] = torch.cuda.Stream(device)
        return stream

    def _pool(self, device, stream):
        """The memory pool shared by the graphs replayed on `stream` of `device`: they run one after another,
        so intermediates freed at the end of one capture may serve the next."""
        pool = self._pools.get((device.index, stream))
        if pool is None:
            pool = self._pools[device.index, stream] = torch.cuda.graph_pool_handle()
        return pool

    def __len__(self):
        return len(self._graphs)

    @property
    def nbytes(self) -> int:
        """The bytes the cached graphs keep of their own (their pool's intermediates not counted)."""
        return self._bytes

    def clear(self):
        """Drop every graph (their memory returns to PyTorch's allocator) and what was seen."""
        self._graphs.clear()
        self._bytes = 0
        self._seen.clear()
        self._sizes.clear()
        self._pools.clear()
        self.unused = 0
