"""What convert's plan adds to the engine's: the manifest's modules, and the scales it unified.

The vocabulary every planner shares (output tensors, units, pieces) is the engine's
(``mocli.stream.units``); this is what only a conversion has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from mocli.stream.units import Key, Plan

if TYPE_CHECKING:
    import torch

# Plans hold scale values as numpy float32 (a plan is made before torch is loaded); units turn them
# into tensors when they run. Both round every float32 operation the same (IEEE).
F32 = np.float32


@dataclass
class ConvertedModule:
    """Manifest entry: one kernel-facing module on one rank and the output tensors that feed it."""

    name: str
    kind: str
    scheme: str
    tensors: dict[str, str]
    sources: list[str]
    meta: dict[str, Any] = field(default_factory=dict)
    group: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "scheme": self.scheme, "tensors": self.tensors,
                "sources": self.sources, "meta": self.meta}


def no_unified_scales() -> dict[str, Any]:
    return {"fp8_requantized_shards": 0, "nvfp4_rescaled_shards": 0, "nvfp4_rescaled_experts": 0,
            "nvfp4_worst_scale_2_ratio": 1.0}


@dataclass
class ConvertPlan(Plan):
    """The engine's plan plus the manifest modules, and the counts of shards whose scales were unified
    on the way (FP8 shards requantized to a shared max scale, NVFP4 weight_scale_2 rescaled)."""

    modules: list[ConvertedModule] = field(default_factory=list)
    unified_scales: dict[str, Any] = field(default_factory=no_unified_scales)
    # every scale value a planner computed rather than copied (alphas, reciprocals, merged maxima, Marlin's
    # globals), by output tensor: validate judges them before anything is written (SCL006,
    # ``mocli.validate.computed``); the engine checks them again as they are written (``check_finite``)
    computed: dict[Key, np.ndarray] = field(default_factory=dict)

    def computed_value(self, key: Key, value) -> np.ndarray:
        """``value`` as the float32 array a unit writes to ``key``, recorded in ``computed``."""
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            v = np.asarray(value, dtype=F32)
        self.computed[key] = v
        return v


def scalar(v: float | np.ndarray | np.floating) -> torch.Tensor:
    """A 0-dim float32 tensor of a plan's value (a unit's; imports torch)."""
    import torch

    return torch.from_numpy(np.array(v, dtype=F32).reshape(()))
