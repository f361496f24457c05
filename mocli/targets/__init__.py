"""Conversion targets: one registry, also the CLI's choices.

Each target is one module holding its forward transforms, their inverses (verify decodes with
them), its constraints and the extra scales its kernels take. Adding a target is one module plus
one line in ``REGISTRY``.
"""

from __future__ import annotations

from mocli.targets.base import Constraint, Target, TargetLayout
from mocli.targets.cutlass import CutlassLayout
from mocli.targets.marlin import MarlinLayout
from mocli.targets.trtllm import TrtllmLayout

REGISTRY: dict[Target, TargetLayout] = {
    Target.FLASHINFER_CUTLASS: CutlassLayout(),
    Target.FLASHINFER_TRTLLM: TrtllmLayout(),
    Target.MARLIN: MarlinLayout(),
}


def layout_of(target: Target | str, mxfp4_experts: str = "native") -> TargetLayout:
    """The target's layout; ``mxfp4_experts`` "fp8-block": its variant that re-encodes MXFP4 experts
    (``mocli.targets.experts``; refused, exit 2, for a target without FP8 block-scale experts)."""
    if mxfp4_experts == "native":
        return REGISTRY[Target(target)]
    from mocli.targets.experts import check_choice, with_fp8_block_experts

    check_choice(target, mxfp4_experts)
    return with_fp8_block_experts(REGISTRY[Target(target)])


def takes(target: Target | str, scope: str) -> str:
    """The stored schemes a target converts in ``scope`` ("linear" or "moe"), in the registry's order."""
    from mocli.schemes import SCHEMES

    return ", ".join(str(s) for s in SCHEMES if s in layout_of(target).supported[scope])


def describe(target: Target | str) -> str:
    """One line for a person (mocli convert --help, README's target table): the kernels, the GPUs, and
    the schemes taken, from the registry."""
    layout = layout_of(target)
    return f"{layout.kernels} on {layout.gpus}; linears: {takes(target, 'linear')}; experts: {takes(target, 'moe')}"


__all__ = ["REGISTRY", "Constraint", "Target", "TargetLayout", "describe", "layout_of", "takes"]
