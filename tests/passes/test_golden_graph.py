"""The rewritten graph of one block, spelled out, so that any change to the rewrite shows in review."""

import expecttest
import torch

from mok_compile.passes import fuse_moe

from . import models
from .helpers import capture, run


class TestGoldenGraph(expecttest.TestCase):
    def test_stacked_bmm_block(self):
        torch.manual_seed(0)
        module = models.StackedGatherMoE(hidden=16, inter=8, experts=4).eval()
        x = torch.randn(6, 16)
        (graph,), eager = capture(module, x)
        gm, example = graph
        fuse_moe(gm, example)
        torch.testing.assert_close(run(gm, example)[0], eager, atol=1e-5, rtol=1e-5)
        self.assertExpectedInline(gm.code.strip(), """\
def forward(self, L_x_ : torch.Tensor, L_self_parameters_router_ : torch.nn.parameter.Parameter, L_self_parameters_choice_bias_ : torch.nn.parameter.Parameter, L_self_parameters_w_in_ : torch.nn.parameter.Parameter, L_self_parameters_w_out_ : torch.nn.parameter.Parameter):
    l_x_ = L_x_
    l_self_parameters_router_ = L_self_parameters_router_
    l_self_parameters_choice_bias_ = L_self_parameters_choice_bias_
    l_self_parameters_w_in_ = L_self_parameters_w_in_
    l_self_parameters_w_out_ = L_self_parameters_w_out_
    fused_moe_default = torch.ops.mok.fused_moe.default(l_x_, l_self_parameters_router_, None, l_self_parameters_choice_bias_, l_self_parameters_w_in_, None, l_self_parameters_w_out_, None, top_k = 2, routing = 'sigmoid_grouped_topk', renormalize = True, routed_scale = 1.5);  l_x_ = l_self_parameters_router_ = l_self_parameters_choice_bias_ = l_self_parameters_w_in_ = l_self_parameters_w_out_ = None
    getitem_6 = fused_moe_default[0];  fused_moe_default = None
    return (getitem_6,)""")
