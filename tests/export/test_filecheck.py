"""The FileCheck helper must reject what it should, or the MLIR checks prove nothing."""

import pytest

from .filecheck import count_matches, filecheck

TEXT = """\
module {
  func.func @main(%arg0: !torch.vtensor<[?,16],f32>) -> !torch.vtensor<[?,16],f32> {
    %0 = torch.aten.mm %arg0, %w : a
    %1 = torch.operator "torch.mok.fused_moe"(%0) : b
    %2 = torch.operator "torch.mok.fused_moe"(%1) : c
    return %2 : !torch.vtensor<[?,16],f32>
  }
}
"""


def test_accepts_matching_text():
    filecheck(TEXT, """
        CHECK-LABEL: func.func @main(%arg0: !torch.vtensor<[?,{{[0-9]+}}],f32>)
        CHECK: torch.aten.mm
        CHECK-NEXT: torch.operator "torch.mok.fused_moe"
        CHECK-NOT: torch.aten
        CHECK: return
    """)
    filecheck(TEXT, "CHECK-COUNT-2: torch.operator \"torch.mok.fused_moe\"")
    assert count_matches(TEXT, 'torch.operator "torch.mok.{{fused_moe}}"') == 2


@pytest.mark.parametrize("checks", [
    "CHECK: torch.aten.bmm",  # absent
    "CHECK: return\nCHECK: torch.aten.mm",  # out of order
    "CHECK: torch.aten.mm\nCHECK-NEXT: return",  # not the next line
    "CHECK: torch.aten.mm\nCHECK-NOT: torch.operator\nCHECK: return",  # forbidden in between
    "CHECK-COUNT-3: torch.mok.fused_moe",  # only two
    "CHECK: @main(%arg0: !torch.vtensor<[{{[0-9]+}},16],f32>)",  # the dim is dynamic
])
def test_rejects_mismatch(checks):
    with pytest.raises(AssertionError):
        filecheck(TEXT, checks)


def test_rejects_malformed_directives():
    with pytest.raises(ValueError, match="not a CHECK directive"):
        filecheck(TEXT, "CHEKC: main")
