"""Options of the `mok` backend, parsed and checked in one place.

`torch.compile(model, backend="mok", options={...}, mode=...)` hands `options`
and `mode` to the backend as keyword arguments (torch's `_TorchCompileWrapper`,
the same on torch 2.11 and 2.13). A typo in an option name must not silently
compile something else, so unknown names and wrong types raise at once, listing
what is valid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

COMPILERS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class BackendOptions:
    """What `backend="mok"` does after the MoE rewrite.

    compiler: the inner compiler the rewritten graph is handed to: ``inductor``
        (default), ``aot_eager`` (AOT autograd without codegen: debugging and
        fast tests) or ``eager`` (the rewritten graph as is, no AOT autograd).
    validate: run each candidate block once on its example inputs, old subgraph
        against the fused op, before rewriting it (`fuse_moe(validate=...)`).
        Costs a little compile time; catches a pattern proof gone wrong.
    strict: raise instead of leaving a block unfused (or, for a bug inside the
        pass, instead of compiling the untouched graph).
    inductor_config: inductor config patches (``torch._inductor.config`` names),
        what ``options`` would hold for ``backend="inductor"``.
    ddp_buckets: under DistributedDataParallel with ``torch._dynamo.config.optimize_ddp = False``, cut each
        graph at DDP's bucket boundaries after fusing, as Dynamo's default would have before, so all-reduce
        overlaps the backward (`mok_compile.ddp`). False: hand graphs on whole.
    mode: the ``torch.compile`` mode, applied to inductor as it would be for
        ``backend="inductor"``.
    """

    compiler: str = "inductor"
    validate: bool = True
    strict: bool = False
    inductor_config: dict = field(default_factory=dict)
    ddp_buckets: bool = True
    mode: str | None = None

    def __post_init__(self):
        if self.compiler not in COMPILERS:
            raise ValueError(f"mok backend: option 'compiler'={self.compiler!r} is not one of {COMPILERS}")
        for name in ("validate", "strict", "ddp_buckets"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"mok backend: option {name!r} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.inductor_config, dict):
            raise TypeError(f"mok backend: option 'inductor_config' must be a dict, got {self.inductor_config!r}")
        if self.compiler != "inductor" and (self.inductor_config or self.mode not in (None, "default")):
            raise ValueError(
                f"mok backend: 'inductor_config' and mode={self.mode!r} only apply to compiler='inductor', "
                f"got compiler={self.compiler!r}"
            )

    def inductor_patches(self) -> dict:
        """The config patches inductor gets: those of `mode` overridden by `inductor_config`."""
        patches = {}
        if self.mode not in (None, "default"):
            from torch._inductor import list_mode_options

            patches.update(list_mode_options(self.mode))
        patches.update(self.inductor_config)
        return patches


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(BackendOptions) if f.name != "mode")


def parse_options(options: dict | None = None, mode: str | None = None) -> BackendOptions:
    """`BackendOptions` from the `options` dict given to `torch.compile`; unknown names raise."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise ValueError(
            f"mok backend: unknown option(s) {unknown}; valid options are {list(OPTION_NAMES)} "
            "(inductor settings go inside options={'inductor_config': {...}})"
        )
    return BackendOptions(**options, mode=mode)
