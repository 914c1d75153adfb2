"""mok's passes on inductor's post-grad graphs (`post_grad_custom_post_pass`), then the user's own pass.

- `unsaved_forward`: a forward's training op whose saved tensors no backward reads runs as the inference op;
- `backward_consume`: a backward writes dh over the saved h it reads last (not under CUDA graphs, which do not
  capture a graph that mutates its inputs).
Both see the graphs after aot_autograd, forward and backward alike; each leaves a graph without its op unchanged.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .backward_consume import consume_saved_gate_up
from .unsaved_forward import inference_where_unsaved

_SOURCES = tuple(str(Path(__file__).with_name(name)) for name in ("post_grad.py", "backward_consume.py",
                                                                     "unsaved_forward.py"))


class MokPostGradPass(CustomGraphPass):
    """The passes above as one inductor custom pass; `consume=False` leaves out `backward_consume`."""

    def __init__(self, consume: bool = True, then=None):
        self.consume = consume
        self.then = then

    def __call__(self, graph: fx.Graph) -> None:
        inference_where_unsaved(graph)
        if self.consume:
            consume_saved_gate_up(graph)
        if self.then is not None:
            self.then(graph)

    def uuid(self):
        """Inductor's FX graph cache key: these passes' sources and `consume`, the mok ops' schemas, and the user's
        pass's key (None, which makes inductor skip its cache, where the user's pass has none). Inductor's cached
        code spells out every argument of an op call from its schema: without the schemas in the key, code cached
        before a schema changed ran on after it (v74: a bool read as a dtype, in an interim schema)."""
        from mok_compile.ops import library

        schemas = hashlib.sha256("\n".join(library.SCHEMAS).encode()).hexdigest()
        ours = (get_hash_for_files(_SOURCES), self.consume, schemas)
        if self.then is None:
            return ours
        then = self.then.uuid() if isinstance(self.then, CustomGraphPass) else None
        return (*ours, then) if then else None
