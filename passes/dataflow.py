"""Data dependencies of an FX graph, including the ones in-place ops hide.

FX edges only say which node object is passed where. After ``t.index_add_(...)``
or ``t[perm] = v`` a later reader of ``t`` depends on the writer too, although
no edge says so. `Dataflow` adds those edges (a reader of ``t`` depends on
every writer of ``t`` placed before it), so slices computed here include the
writes that give a tensor its value, and the pass never cuts a region in the
middle of a sequence of mutations.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

import torch.fx as fx

from .op_names import mutated_input


class Dataflow:
    def __init__(self, graph: fx.Graph, previous: Dataflow | None = None):
        """`previous`: this graph's Dataflow before a rewrite (which inserts and erases nodes and rewires
        arguments, never changes what a node computes): whether each node writes in place is taken from it, so
        that a pass over a deep model does not ask every node's op again after each block."""
        known = previous.is_writer if previous is not None else {}
        self.order: dict[fx.Node, int] = {}
        self.is_writer: dict[fx.Node, bool] = {}
        self.writers: dict[fx.Node, list[fx.Node]] = defaultdict(list)
        for i, n in enumerate(graph.nodes):
            self.order[n] = i
            writes = known.get(n)
            target = mutated_input(n) if writes is None or writes else None
            self.is_writer[n] = target is not None
            if target is not None:
                self.writers[target].append(n)

    def inputs(self, node: fx.Node) -> list[fx.Node]:
        """Nodes whose values `node` reads: its arguments and the earlier writers of those arguments."""
        deps = list(node.all_input_nodes)
        pos = self.order[node]
        for a in node.all_input_nodes:
            deps.extend(w for w in self.writers.get(a, ()) if self.order[w] < pos and w is not node)
        return deps

    def readers(self, node: fx.Node) -> list[fx.Node]:
        """Nodes that read the value `node` produced (or, for a writer, the tensor state it left)."""
        out = list(node.users)
        target = mutated_input(node)
        if target is not None:
            pos = self.order[node]
            out.extend(u for u in target.users if self.order[u] > pos)
        return out

    def backward_slice(self, roots, stop) -> set[fx.Node]:
        """Every node the values of `roots` depend on, not walking past nodes for which `stop(n)` is true."""
        return closure(roots, lambda n: () if stop(n) else self.inputs(n))

    def forward_slice(self, roots, within=None) -> set[fx.Node]:
        """Every node that reads (transitively) a value of `roots`, restricted to `within` when given."""
        return closure(roots, lambda n: (u for u in self.readers(n) if within is None or u in within))

    def first_reached(self, root: fx.Node, found) -> tuple[fx.Node | None, set[fx.Node]]:
        """The first node in graph order that `root` reaches (itself included) for which `found(node)` holds, or
        None, with every node it reaches before that one: the forward slice is walked in order and left there, so
        the rest of the graph is never visited."""
        node_at, pending, reached = {self.order[root]: root}, [self.order[root]], set()
        while pending:
            n = node_at[heapq.heappop(pending)]
            reached.add(n)
            if found(n):
                return n, reached
            for u in self.readers(n):
                if self.order[u] not in node_at:
                    node_at[self.order[u]] = u
                    heapq.heappush(pending, self.order[u])
        return None, reached

    def sorted(self, nodes) -> list[fx.Node]:
        return sorted(nodes, key=self.order.__getitem__)


def closure(roots, step) -> set[fx.Node]:
    """`roots` and every node reachable from them through `step(node)` (an iterable of next nodes)."""
    seen: set[fx.Node] = set()
    work = list(roots)
    while work:
        n = work.pop()
        if n in seen:
            continue
        seen.add(n)
        work.extend(step(n))
    return seen
