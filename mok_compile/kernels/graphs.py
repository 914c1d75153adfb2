"""Few-token forwards replayed from CUDA graphs.

At a few hundred tokens and fewer the forward's GPU time (47 us for one Qwen3-30B-A3B token, 0.34 ms for 256) is
below the host time of its nine launches and the Python around them, even replayed from a launch plan (`plan.py`;
benchmarks/NOTES-gpu.md v20-v23, v49): a caller that runs the op eagerly, or compiled in inductor's default mode,
waits on the host. `GraphCache` captures the forward of one call signature in a CUDA graph and replays it: x
copied into the graph's own input, one replay, the outputs copied out into new tensors. The graph holds the
same kernels with the same configs as the launches it replaces, so the outputs are the same bits.

A graph reads every tensor at the address it had at capture, so its key is a launch plan's signature
(`plan.signature`: shapes, strides, dtypes, options, switches) plus the address of every tensor but x (weights
updated in place, as by an optimizer step, are read as they are then; a new tensor gets a new graph) and the
stream (a replay runs on its capture's stream). The inference forward and the training forward (whose h, logits
and layout for the backward are copied out too: K * 2I elements per token) are captured; the backward is not: its
full-size weight gradients would have to be copied out of the graph's memory.

Where: CUDA, 1 to `max_tokens` tokens (MOK_GRAPH_TOKENS, default 512; 0 turns graphs off), Triton's fast launch
path usable (no profiler hooks), and no capture under way on this stream: `mode="reduce-overhead"` captures the op
in inductor's own graph. A signature is captured on its second call; one whose capture failed is not tried
again. Memory: the graphs of one device and stream share one pool, so their intermediates take the largest
graph's (tens of MB at 512 tokens), not the sum; each graph also keeps its input and outputs (T rows of x, of the
output and of the routing). The cache keeps the 64 most recently used graphs; once 16 graphs have left it never
replayed (more distinct token counts than it holds, each seen twice), it stops capturing.
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
_MAX_GRAPHS = 64
_MAX_UNUSED = 16  # graphs evicted unused (no call after the capturing one) before the cache stops capturing
_MAX_SEEN = 1024
_ALIGN = 256  # bytes: the most alignment cuBLAS's heuristics look at


class _Graph:
    """One captured forward: its input buffer, its graph and the outputs the graph writes."""

    __slots__ = ("x", "graph", "outputs", "hits")

    def __init__(self, run, tensors, stream, pool):
        x = tensors[0]
        current = torch.cuda.current_stream(x.device)
        # Plain tensors even under inference_mode: the buffers are written on every replay, which an inference
        # tensor allows only inside inference mode.
        with torch.inference_mode(False), torch.no_grad():
            self.x = _like_aligned(x)
            self.x.copy_(x)
            args = (self.x, *tensors[1:])
            stream.wait_stream(current)
            with torch.cuda.stream(stream):  # warm-up on the capture stream (cuBLAS's per-stream workspace)
                run(*args)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                self.outputs = run(*args)
            current.wait_stream(stream)
        self.hits = 0  # calls served after the capturing one

    def replay(self, x):
        self.x.copy_(x)
        self.graph.replay()
        return tuple([t.clone() for t in self.outputs])


def _alignment(x) -> int:
    """The address modulo 256 bytes of the x the forward's GEMMs read: x's own, or a fresh contiguous copy's (0)."""
    return x.data_ptr() % _ALIGN if x.is_contiguous() else 0


def _like_aligned(x):
    """A contiguous tensor of x's shape and dtype at `_alignment(x)`: cuBLAS picks the router GEMM's algorithm by
    its operands' alignment, so the graph's copy of x must keep what the launches would read to give their bits."""
    pad = _ALIGN // x.element_size()
    buf = torch.empty(x.numel() + pad, dtype=x.dtype, device=x.device)
    offset = (_alignment(x) - buf.data_ptr()) % _ALIGN // x.element_size()
    return buf[offset:offset + x.numel()].view(x.shape)


def eligible(x) -> bool:
    """Whether a forward on `x` may be replayed from a graph (see the module docstring)."""
    return (0 < x.shape[0] <= max_tokens and x.is_cuda and x.get_device() == torch._C._cuda_getDevice()
            and launch.fast_launch and not launch._hooks_set() and not torch.cuda.is_current_stream_capturing())


class GraphCache:
    """Captured forwards of one entry point, by key (see the module docstring)."""

    def __init__(self, max_graphs: int = _MAX_GRAPHS):
        self._graphs = collections.OrderedDict()
        self._seen = collections.OrderedDict()  # key -> True (seen once) or False (its capture failed)
        self._pools = {}
        self._streams = {}
        self._max = max_graphs
        self._lock = threading.Lock()
        self.unused = 0  # graphs evicted before serving a call after their capture

    def call(self, run, tensors, options):
        """`run(*tensors)`, the forward over `tensors` (x first; None for absent ones) with `options`
        (hashable: everything else it takes), or its graph's replay."""
        x = tensors[0]
        if not eligible(x):
            return run(*tensors)
        try:
            stream = torch._C._cuda_getCurrentRawStream(x.device.index)
            key = (plan.signature(tensors, options), _alignment(x),
                   tuple([None if t is None else t.data_ptr() for t in tensors[1:]]), stream)
            graph = self._graphs.get(key)
        except TypeError:  # an unhashable option: no graph
            return run(*tensors)
        if graph is not None:
            with self._lock:  # two threads on one stream would otherwise interleave their copies and replays
                if key in self._graphs:  # (not evicted by another thread since)
                    self._graphs.move_to_end(key)
                graph.hits += 1
                return graph.replay(x)
        seen = self._seen.get(key)
        if seen is None or seen is False or self.unused >= _MAX_UNUSED:
            out = run(*tensors)
            if seen is None:  # (after the call: a call that raises is not a signature worth capturing)
                plan._remember(self._seen, key, True, _MAX_SEEN)
            return out
        with self._lock:
            try:
                graph = _Graph(run, tensors, self._stream(x.device), self._pool(x.device, stream))
            except Exception as err:  # never fails the call: it runs unrecorded, as before
                log.warning("mok_compile: a forward of %d tokens could not be captured in a CUDA graph (%s: %s); "
                            "that signature runs without one", x.shape[0], type(err).__name__, err)
                self._seen[key] = False
                return run(*tensors)
            self._graphs[key] = graph
            while len(self._graphs) > self._max:
                _, old = self._graphs.popitem(last=False)
                self.unused += old.hits == 0
            if self.unused >= _MAX_UNUSED:
                log.info("mok_compile: %d CUDA graphs left the cache unreplayed; no more forwards are captured",
                         self.unused)
            return graph.replay(x)

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

    def clear(self):
        """Drop every graph (their memory returns to PyTorch's allocator) and what was seen."""
        self._graphs.clear()
        self._seen.clear()
        self._pools.clear()
        self.unused = 0
