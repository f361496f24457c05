"""Kernel-facing module kinds and tensor roles: the one definition planner, loader and verify share.

A converted module has a kind (what kernel it feeds) and a set of tensors, each with a role. The
loader's dataclasses, the manifest, the verify checks and the consistency rules all key on these.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from mocli.schemes import FP8, FP8_BLOCK, FP8_CHANNEL, MXFP8, NVFP4, NVFP4_AWQ, W4A16_NVFP4, Scheme


class ModuleKind(StrEnum):
    FP8_LINEAR = "fp8_linear"
    FP8_CHANNEL_LINEAR = "fp8_channel_linear"
    FP8_BLOCK_LINEAR = "fp8_block_linear"
    NVFP4_LINEAR = "nvfp4_linear"
    FP8_MOE = "fp8_moe"
    NVFP4_MOE = "nvfp4_moe"
    # vLLM's Marlin layout of NVFP4 weights (weight-only GEMMs, BF16/FP16 activations: SEMANTICS §13)
    NVFP4_MARLIN_LINEAR = "nvfp4_marlin_linear"
    NVFP4_MARLIN_MOE = "nvfp4_marlin_moe"
    # MXFP8 (e4m3 weights, an E8M0 scale per 32 along K; activations quantized the same way at run time: §14)
    MXFP8_LINEAR = "mxfp8_linear"
    MXFP8_MOE = "mxfp8_moe"
    # FP8 128x128-block experts (compressed-tensors FP8_BLOCK, vLLM's own block fp8: SEMANTICS §18)
    FP8_BLOCK_MOE = "fp8_block_moe"


class Role(StrEnum):
    # dense linears
    WEIGHT = "weight"
    WEIGHT_SCALE = "weight_scale"
    WEIGHT_SCALE_2 = "weight_scale_2"
    INPUT_SCALE = "input_scale"
    ALPHA = "alpha"
    INPUT_SCALE_INV = "input_scale_inv"
    BIAS = "bias"
    # NVFP4_AWQ: the activation multiplier [K] (dense) or [H] (a MoE layer's, shared by its experts), applied in
    # the activation dtype before quantization (SEMANTICS §15)
    PRE_QUANT_SCALE = "pre_quant_scale"
    # fused MoE
    W13_WEIGHT = "w13_weight"
    W2_WEIGHT = "w2_weight"
    W13_WEIGHT_SCALE = "w13_weight_scale"
    W2_WEIGHT_SCALE = "w2_weight_scale"
    W13_WEIGHT_SCALE_2 = "w13_weight_scale_2"
    W2_WEIGHT_SCALE_2 = "w2_weight_scale_2"
    W13_INPUT_SCALE = "w13_input_scale"
    W2_INPUT_SCALE = "w2_input_scale"
    W13_INPUT_SCALE_INV = "w13_input_scale_inv"
    W2_INPUT_SCALE_INV = "w2_input_scale_inv"
    G1_ALPHAS = "g1_alphas"
    G2_ALPHAS = "g2_alphas"
    A1_GSCALE = "a1_gscale"
    A2_GSCALE = "a2_gscale"
    # flashinfer-trtllm extras (FlashInfer spells the FP8 and NVFP4 names differently)
    OUTPUT1_SCALES_SCALAR = "output1_scales_scalar"
    OUTPUT1_SCALES_GATE_SCALAR = "output1_scales_gate_scalar"
    OUTPUT2_SCALES_SCALAR = "output2_scales_scalar"
    OUTPUT1_SCALE_SCALAR = "output1_scale_scalar"
    OUTPUT1_SCALE_GATE_SCALAR = "output1_scale_gate_scalar"
    OUTPUT2_SCALE_SCALAR = "output2_scale_scalar"
    # marlin (vLLM's names after process_weights_after_loading)
    WEIGHT_GLOBAL_SCALE = "weight_global_scale"
    INPUT_GLOBAL_SCALE = "input_global_scale"


@dataclass(frozen=True)
class KindSpec:
    kind: ModuleKind
    scheme: Scheme  # the stored scheme it converts (``mocli.schemes``); also ``also``'s
    moe: bool
    roles: frozenset[Role]  # the tensors every target writes for it (LAYOUT.md), a bias aside
    also: tuple[Scheme, ...] = ()  # other stored schemes that convert to it
    optional: frozenset[Role] = frozenset()  # roles some sources give it (an NVFP4 source's input scales)

    @property
    def schemes(self) -> tuple[Scheme, ...]:
        return (self.scheme, *self.also)


_FP8_MOE_ROLES = (Role.W13_WEIGHT, Role.W2_WEIGHT, Role.W13_WEIGHT_SCALE, Role.W2_WEIGHT_SCALE, Role.W13_INPUT_SCALE,
                  Role.W2_INPUT_SCALE, Role.W13_INPUT_SCALE_INV, Role.W2_INPUT_SCALE_INV, Role.G1_ALPHAS, Role.G2_ALPHAS)
_NVFP4_MOE_ROLES = (Role.W13_WEIGHT, Role.W2_WEIGHT, Role.W13_WEIGHT_SCALE, Role.W2_WEIGHT_SCALE, Role.W13_WEIGHT_SCALE_2,
                    Role.W2_WEIGHT_SCALE_2, Role.W13_INPUT_SCALE, Role.W2_INPUT_SCALE, Role.G1_ALPHAS, Role.G2_ALPHAS,
                    Role.A1_GSCALE, Role.A2_GSCALE)


def _spec(kind: ModuleKind, scheme: Scheme, moe: bool, *roles: Role) -> KindSpec:
    return KindSpec(kind, scheme, moe, frozenset(roles))


KINDS: dict[ModuleKind, KindSpec] = {k.kind: k for k in (
    _spec(ModuleKind.FP8_LINEAR, FP8, False, Role.WEIGHT, Role.WEIGHT_SCALE, Role.INPUT_SCALE),
    _spec(ModuleKind.FP8_CHANNEL_LINEAR, FP8_CHANNEL, False, Role.WEIGHT, Role.WEIGHT_SCALE),
    _spec(ModuleKind.FP8_BLOCK_LINEAR, FP8_BLOCK, False, Role.WEIGHT, Role.WEIGHT_SCALE),
    # NVFP4_AWQ converts as NVFP4, with its pre_quant_scale (SEMANTICS §15.3) where the source kept one
    KindSpec(ModuleKind.NVFP4_LINEAR, NVFP4, False, frozenset({Role.WEIGHT, Role.WEIGHT_SCALE, Role.WEIGHT_SCALE_2,
                                                              Role.INPUT_SCALE, Role.ALPHA, Role.INPUT_SCALE_INV}),
             also=(NVFP4_AWQ,), optional=frozenset({Role.PRE_QUANT_SCALE})),
    _spec(ModuleKind.FP8_MOE, FP8, True, *_FP8_MOE_ROLES),
    KindSpec(ModuleKind.NVFP4_MOE, NVFP4, True, frozenset(_NVFP4_MOE_ROLES), also=(NVFP4_AWQ,),
             optional=frozenset({Role.PRE_QUANT_SCALE})),
    _spec(ModuleKind.MXFP8_LINEAR, MXFP8, False, Role.WEIGHT, Role.WEIGHT_SCALE),
    _spec(ModuleKind.MXFP8_MOE, MXFP8, True, Role.W13_WEIGHT, Role.W13_WEIGHT_SCALE, Role.W2_WEIGHT, Role.W2_WEIGHT_SCALE),
    _spec(ModuleKind.FP8_BLOCK_MOE, FP8_BLOCK, True, Role.W13_WEIGHT, Role.W13_WEIGHT_SCALE, Role.W2_WEIGHT,
          Role.W2_WEIGHT_SCALE),
    KindSpec(ModuleKind.NVFP4_MARLIN_LINEAR, NVFP4, False,
             frozenset({Role.WEIGHT, Role.WEIGHT_SCALE, Role.WEIGHT_GLOBAL_SCALE}), also=(W4A16_NVFP4,),
             optional=frozenset({Role.INPUT_GLOBAL_SCALE})),
    KindSpec(ModuleKind.NVFP4_MARLIN_MOE, NVFP4, True,
             frozenset({Role.W13_WEIGHT, Role.W2_WEIGHT, Role.W13_WEIGHT_SCALE, Role.W2_WEIGHT_SCALE,
                        Role.W13_WEIGHT_SCALE_2, Role.W2_WEIGHT_SCALE_2}), also=(W4A16_NVFP4,),
             optional=frozenset({Role.W13_INPUT_SCALE, Role.W2_INPUT_SCALE})),
)}
# The kinds the FlashInfer targets write (marlin writes its own: ``targets.marlin``)
FLASHINFER_KINDS = frozenset({ModuleKind.FP8_LINEAR, ModuleKind.FP8_CHANNEL_LINEAR, ModuleKind.FP8_BLOCK_LINEAR,
                              ModuleKind.NVFP4_LINEAR, ModuleKind.FP8_MOE, ModuleKind.NVFP4_MOE, ModuleKind.MXFP8_LINEAR,
                              ModuleKind.MXFP8_MOE, ModuleKind.FP8_BLOCK_MOE})


def kind_for(scheme: Scheme, moe: bool, among: frozenset[ModuleKind] = FLASHINFER_KINDS) -> ModuleKind | None:
    """The module kind (of those ``among``: a target's) a stored scheme converts to (None: no kernel path)."""
    return next((k for k, s in KINDS.items() if k in among and scheme in s.schemes and s.moe is moe), None)
