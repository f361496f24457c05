"""The inputs every part of the convert planner shares."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mocli.census import Census, Module
from mocli.io.safetensors_file import TensorReader
from mocli.parallel import Heads, ParallelLayout
from mocli.plan.core import ConvertPlan
from mocli.tables import INPUT_SCALE, PRE_QUANT_SCALE, WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2
from mocli.targets import TargetLayout

# the suffixes a planned module's tensors are written under (transformed or not); its others are copied
QUANT_SUFFIXES = (WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2, INPUT_SCALE, PRE_QUANT_SCALE, "bias")


@dataclass
class PlanContext:
    census: Census
    scales: dict[str, np.ndarray]  # float32, as read (mocli.scales)
    layout: TargetLayout
    parallel: ParallelLayout
    heads: Heads | None
    plan: ConvertPlan = field(default_factory=ConvertPlan)
    consumed: set[str] = field(default_factory=set)
    # tensors a planner must look into (the marlin target's block-scale maxima); closed after planning
    reader: TensorReader = field(default_factory=TensorReader)
    # False: the plan is only judged (validate's SCL006 in ``computed_aside``), never run: the expert units, a
    # ~30k-unit MoE checkpoint's bulk, are not made (``_Moe.expert_unit``)
    units: bool = True

    def consume(self, mods) -> None:
        """The quantized tensors of ``mods`` (None skipped) are planned: the rest is copied as it is. A plan only
        judged copies nothing (``build_plan``), so nothing is marked (~94k names of a large MoE checkpoint)."""
        if self.units:
            self.consumed.update(e.name for m in mods if m is not None for s, e in m.tensors.items()
                                 if s in QUANT_SUFFIXES)

    def scale(self, m: Module, suffix: str) -> np.ndarray:
        return self.scales[m.tensors[suffix].name].reshape(())

    def inverse_of_max(self, mods: list[Module], suffix: str) -> np.float32:
        """1 / max over ``mods`` of their scale ``suffix``: the stored divisor of the module holding the max
        where the source stores divisors (vLLM's compressed-tensors linear keeps it, SEMANTICS §17.3), else
        the float32 reciprocal."""
        top = max(mods, key=lambda m: float(self.scale(m, suffix)))
        name = top.tensors[suffix].name
        inverse = getattr(self.scales, "inverse", None)
        return inverse(name) if inverse is not None else np.reciprocal(np.float32(self.scale(top, suffix)))
