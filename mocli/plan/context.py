"""The inputs every part of the convert planner shares."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mocli.census import Census, Module
from mocli.io.safetensors_file import TensorReader
from mocli.parallel import Heads, ParallelLayout
from mocli.plan.core import ConvertPlan
from mocli.targets import TargetLayout


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

    def scale(self, m: Module, suffix: str) -> np.ndarray:
        return self.scales[m.tensors[suffix].name].reshape(())
