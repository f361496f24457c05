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


def layout_of(target: Target | str) -> TargetLayout:
    return REGISTRY[Target(target)]


__all__ = ["REGISTRY", "Constraint", "Target", "TargetLayout", "layout_of"]
