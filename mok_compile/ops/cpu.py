"""CPU kernel of `mok::fused_moe` (C++ in csrc/, built on first use). Being written."""
