"""marlin: vLLM's Marlin layout of NVFP4 and W4A16_NVFP4 weights (SEMANTICS §13.5-§13.6), the one vLLM
runs for NVFP4 on sm_75-sm_90 GPUs (Hopper included), where FlashInfer's FP4 kernels do not; FP8 layers
beside them in the FP8 layout every target shares.

Weight-only: activations stay BF16 (the default; FP16 gives other scale bytes), a W4A4 source's input
scales are kept as metadata only. The forward byte moves are ``mocli.ops.marlin``'s, the inverses
``mocli.targets.marlin_decode``'s (numpy: this module is imported by every command, and stays light).
"""

from __future__ import annotations

from mocli.kinds import REPACK, ModuleKind
from mocli.schemes import FP8, FP8_BLOCK, FP8_CHANNEL, MXFP4, MXFP8, NVFP4, W4A16_NVFP4
from mocli.targets.base import SHARED_CONSTRAINTS, Constraint, Target, TargetLayout

MARLIN_KINDS = frozenset({ModuleKind.NVFP4_MARLIN_LINEAR, ModuleKind.NVFP4_MARLIN_MOE, ModuleKind.MXFP4_MARLIN_LINEAR,
                          ModuleKind.MXFP4_MARLIN_MOE})
# FP8 layers (a MIXED_PRECISION checkpoint's, beside W4A16 or NVFP4 ones) keep the plain FP8 layout the
# FlashInfer targets share: Hopper's FP8 tensor cores (torch._scaled_mm, grouped GEMMs) run it as it is.
# MXFP8 linears likewise keep flashinfer-cutlass's layout (weight as stored, scales 128x4): sm_90 has no MX
# tensor cores, mocli's kernel decodes it (vLLM's own W8A16 Marlin MXFP8 layout is not written)
FP8_KINDS = frozenset({ModuleKind.FP8_LINEAR, ModuleKind.FP8_CHANNEL_LINEAR, ModuleKind.FP8_BLOCK_LINEAR,
                       ModuleKind.FP8_MOE, ModuleKind.MXFP8_LINEAR})


class MarlinLayout(TargetLayout):
    target = Target.MARLIN
    kernels = ("vLLM's Marlin kernels, weight-only with BF16 activations (FP8 and MXFP8 linears keep the layout "
               "the FlashInfer targets share)")
    gpus = "sm_75-sm_90 (T4 ... A100, L40S, H100, H200)"
    kinds = MARLIN_KINDS | FP8_KINDS
    supported = {"linear": frozenset({FP8, FP8_CHANNEL, FP8_BLOCK, NVFP4, W4A16_NVFP4, MXFP8, MXFP4}),
                 "moe": frozenset({FP8, NVFP4, W4A16_NVFP4, MXFP4})}
    constraints = tuple(c for c in SHARED_CONSTRAINTS
                                                     if c.scheme is FP8 or c.scheme is MXFP8 and c.scope == "linear") + tuple(
        # prepare_nvfp4_moe_layer_for_marlin: the hidden size must be a whole number of 64-wide tiles
        Constraint("moe", s, "H", 64, "Marlin's MoE kernel tiles H by 64 (SEMANTICS §13.6)") for s in (NVFP4, W4A16_NVFP4)) + (
        # a row-parallel MXFP4 linear's rank keeps whole 32-value scale blocks along K (SEMANTICS §19.3)
        Constraint("linear", MXFP4, "K", 32, "MXFP4 scales blocks of 32 along each rank's K (SEMANTICS §19.1)"),
        # prepare_moe_fp4_layer_for_marlin pads nothing: w13 (n = 2I, k = H) and w2 (n = H, k = I) must each fit
        # one of Marlin's tile families as they are
        Constraint("moe", MXFP4, "2I", 128, "Marlin's MXFP4 MoE takes the rank's I unpadded: I % 64 == 0 (SEMANTICS §19.5)"),
        Constraint("moe", MXFP4, "H", 128, "Marlin's MXFP4 MoE takes H unpadded: H % 128 == 0 (SEMANTICS §19.5)"))

    def moe_refusal(self, layer) -> str | None:
        """compressed-tensors' gpt-oss experts (gate/up halves with biases, clamped SwiGLU: SEMANTICS §19.2) are
        not written for Marlin yet; gpt-oss's interleaved ones and biasless [w1; w3] SiLU experts are."""
        first = next(iter(layer.experts.values()), None)
        if MXFP4 in layer.schemes and not layer.interleaved and first is not None and first.gate is not None \
                and "bias" in first.gate.tensors:
            return ("marlin does not write gpt-oss experts split into gate/up halves with biases (llm-compressor's "
                    "export) yet: gpt-oss's native and Quark exports (interleaved gate_up) and biasless [w1; w3] "
                    "experts only (SEMANTICS §19.5)")
        return None


__all__ = ["FP8_KINDS", "MARLIN_KINDS", "REPACK", "MarlinLayout"]  # REPACK: the Marlin planner records it
