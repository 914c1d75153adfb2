"""The rewritten graph of one block, spelled out, so that any change to the rewrite shows in review.

The graph is printed with canonical names (placeholders by their parameter or input name, other values v0, v1,
...), not with Dynamo's generated code: Dynamo's spelling of placeholder names (``L_self_parameters_router_``
here, other prefixes in other torch versions) and its name counters (``getitem_6``) are not the pass's output.
"""

import re

import pytest
import torch
import torch.fx as fx

from mok_compile.passes import fuse_moe

from . import models
from .helpers import capture, run

# The [test] extra installs it (CI); the GPU machine has none: there the golden graphs are skipped, not an error.
expecttest = pytest.importorskip("expecttest")


def canonical_code(gm: fx.GraphModule) -> str:
    names, lines = {}, []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            base = re.sub(r"^[lL]_", "", n.target).strip("_")
            base = re.sub(r"^self_", "", base)
            names[n] = re.sub(r"(?:^|_)(?:parameters|modules|buffers)_", "_", base).strip("_")
            continue
        show = lambda a: fx.node.map_arg(a, lambda m: names[m])  # noqa: E731
        if n.op == "output":
            lines.append(f"return {show(n.args[0])!r}".replace("'", ""))
            continue
        names[n] = f"v{len(names) - sum(m.op == 'placeholder' for m in names)}"
        target = n.target if n.op == "call_method" else fx.node._get_qualified_name(n.target)
        args = ", ".join([str(show(a)) for a in n.args] + [f"{k}={show(v)!r}" for k, v in n.kwargs.items()])
        lines.append(f"{names[n]} = {target}({args})")
    params = ", ".join(names[n] for n in gm.graph.nodes if n.op == "placeholder")
    return "\n".join([f"inputs: {params}", *lines])


class TestGoldenGraph(expecttest.TestCase):
    def test_stacked_bmm_block(self):
        torch.manual_seed(0)
        module = models.StackedGatherMoE(hidden=16, inter=8, experts=4).eval()
        x = torch.randn(6, 16)
        (graph,), eager = capture(module, x)
        gm, example = graph
        fuse_moe(gm, example)
        torch.testing.assert_close(run(gm, example)[0], eager, atol=1e-5, rtol=1e-5)
        self.assertExpectedInline(canonical_code(gm), """\
inputs: x, router, choice_bias, w_in, w_out
v0 = torch.ops.mok.fused_moe.default(x, router, None, choice_bias, w_in, None, w_out, None, top_k=2, routing='sigmoid_grouped_topk', renormalize=True, routed_scale=1.5)
v1 = _operator.getitem(v0, 0)
return (v1,)""")
