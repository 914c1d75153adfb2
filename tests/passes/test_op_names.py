"""`op_names.folded_number`: constants the graph computes from numbers alone (what Dynamo and aot_autograd leave of a
specialised float) read as numbers; anything that reads a graph input, or that the fold would have to guess at, is
not one."""

import operator

import torch
import torch.fx as fx

from mok_compile.passes.op_names import folded_number


def _graph():
    graph = fx.Graph()
    return graph, graph.placeholder("x")


def test_arithmetic_on_numbers_folds_as_python_computes_it():
    graph, _ = _graph()
    neg = graph.call_function(operator.neg, (7.0,))
    twice = graph.call_function(torch.mul, (2, 0.01))
    nested = graph.call_function(operator.sub, (graph.call_function(operator.truediv, (1, 3)), neg))
    assert folded_number(neg) == -7.0
    assert folded_number(twice) == 2 * 0.01
    assert folded_number(nested) == 1 / 3 - (-7.0)
    assert folded_number(0.5) == 0.5 and folded_number(3) == 3.0


def test_near_misses_are_not_numbers():
    graph, x = _graph()
    assert folded_number(graph.call_function(operator.neg, (x,))) is None  # reads a graph input
    assert folded_number(graph.call_function(torch.add, (1.0, 2.0), {"alpha": 3})) is None  # a keyword it would skip
    assert folded_number(graph.call_function(operator.truediv, (1.0, 0.0))) is None
    assert folded_number(graph.call_function(operator.pow, (2.0, 3.0))) is None  # not an op it folds
    assert folded_number(True) is None and folded_number(None) is None
