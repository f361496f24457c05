"""marlin: vLLM's Marlin layout of NVFP4 and W4A16_NVFP4 weights (SEMANTICS §13.5-§13.6), the one vLLM
runs for NVFP4 on sm_75-sm_90 GPUs (Hopper included), where FlashInfer's FP4 kernels do not.

Weight-only: activations stay BF16 (the default; FP16 gives other scale bytes), a W4A4 source's input
scales are kept as metadata only. The forward byte moves are ``mocli.ops.marlin``'s, the inverses
``mocli.targets.marlin_decode``'s (numpy: this module is imported by every command, and stays light).
"""

from __future__ import annotations

from mocli.kinds import ModuleKind
from mocli.schemes import NVFP4, W4A16_NVFP4
from mocli.targets.base import Constraint, Target, TargetLayout

REPACK = "gptq_marlin_repack"  # the transform every Marlin weight records


class MarlinLayout(TargetLayout):
    target = Target.MARLIN
    kinds = frozenset({ModuleKind.NVFP4_MARLIN_LINEAR, ModuleKind.NVFP4_MARLIN_MOE})
    supported = {"linear": frozenset({NVFP4, W4A16_NVFP4}), "moe": frozenset({NVFP4, W4A16_NVFP4})}
    constraints = tuple(
        # prepare_nvfp4_moe_layer_for_marlin: the hidden size must be a whole number of 64-wide tiles
        Constraint("moe", s, "H", 64, "Marlin's MoE kernel tiles H by 64 (SEMANTICS §13.6)") for s in (NVFP4, W4A16_NVFP4))
    weight_transform = REPACK
