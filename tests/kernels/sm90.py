"""Compile a Triton kernel for Hopper (sm_90) on the CPU, so CI can check the code Triton builds for the
GPU (its loads, its tensor-core instructions) without one."""

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_for_sm90(fn, consts, types, aligned, **options):
    """`fn` compiled for sm_90: `types` the arguments that are not i32, `aligned` those that a real launch
    specialises as 16-divisible (pointers, strides, sizes); `options` num_warps, num_stages."""
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(types)
    sig.update({k: "constexpr" for k in consts})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned if n not in consts}
    return triton.compile(ASTSource(fn, sig, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32), options=options)
