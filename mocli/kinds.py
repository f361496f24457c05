"""Kernel-facing module kinds and tensor roles, and one card per kind: the one declaration planner,
loader, serving, verify and the targets derive their per-kind tables from.

A converted module has a kind (what kernel it feeds) and a set of tensors, each with a role. The
loader's dataclasses, the manifest, the verify checks and the consistency rules all key on these.

A ``Card`` says everything a kind is: the stored scheme it converts, its roles, its thresholds, the
transform each target's weights record, and its four pieces of code (planner, stored-tensor class,
serving kernel, verify check). Those live in layers above this one (``plan``, ``module_classes``,
``serve``, ``verify.kinds``), some need torch, and verify must never load the converter's or serving's
code: so a card names each by its path (a ``Part``), and each package resolves only its own parts
into its table (``plan.PLANNERS``, ``module_classes.CLASSES``, ``serve.KERNELS``,
``verify.kinds.CHECKS``; ``verify.results.THRESHOLDS`` and ``TargetLayout.weight_transforms`` take
data). ``tests/test_architecture.py`` holds every card complete and every table derived from them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from mocli.schemes import FP8, FP8_BLOCK, FP8_CHANNEL, MXFP4, MXFP8, NVFP4, NVFP4_AWQ, W4A16_NVFP4, Scheme


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
    # MXFP4 experts as flashinfer-trtllm's trtllm_fp4_block_scale_moe takes them (SEMANTICS §19.6)
    MXFP4_MOE = "mxfp4_moe"
    # vLLM's Marlin layout of MXFP4 weights (weight-only, BF16 activations: SEMANTICS §19.5)
    MXFP4_MARLIN_LINEAR = "mxfp4_marlin_linear"
    MXFP4_MARLIN_MOE = "mxfp4_marlin_moe"


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
    # expert biases (gpt-oss): float32 in flashinfer-trtllm's MXFP4 layout (SEMANTICS §19.6)
    W13_BIAS = "w13_bias"
    W2_BIAS = "w2_bias"
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
class Part:
    """A card's piece of code, by path (``"mocli.plan.dense:_Fp8TensorDense"``): imported only by the
    package it lives in, when that package builds its table (``load``)."""

    path: str

    @property
    def module(self) -> str:
        return self.path.partition(":")[0]

    def load(self) -> Any:
        module, _, name = self.path.partition(":")
        return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Thresholds:
    """Relative-error thresholds of one kind of module verify reports (README "Thresholds" derives
    them): ``kept`` where the source's bits are kept, ``unified`` for shards or experts whose scales
    were unified; MoE: ``gemm2`` for GEMM2 fed with the kernel's own intermediate. Each is a few times
    what the format allows and far below the smallest real fault (a 2x scale error is 0.5-1.0, a w1/w3
    swap 0.3)."""

    kept: float
    unified: float
    gemm2: float | None = None


@dataclass(frozen=True)
class Card:
    """One module kind, declared once (see the module docstring)."""

    kind: ModuleKind
    scheme: Scheme  # the stored scheme it converts (``mocli.schemes``); also ``also``'s
    moe: bool
    roles: frozenset[Role]  # the tensors every target writes for it (LAYOUT.md), a bias aside
    planner: Part  # mocli.plan: called as planner(context, kind, name, modules or MoE layer).plan()
    stored: Part  # mocli.module_classes: the dataclass ``mocli.loader`` hands out
    kernel: Part  # mocli.serve: the Kernel class that runs it
    check: Part  # mocli.verify.kinds: the module whose ``check(name, infos, ctx)`` verifies it
    check_torch: bool  # whether that check needs torch (else numpy alone: an NVFP4 verify never imports it)
    thresholds: Thresholds
    also: tuple[Scheme, ...] = ()  # other stored schemes that convert to it
    optional: frozenset[Role] = frozenset()  # roles some sources give it (an NVFP4 source's input scales)
    # target -> the transform every weight of this kind records there, which tells its layout from another
    # that shares its shapes (``TargetLayout.weight_transforms``; a target absent: none required)
    transforms: tuple[tuple[str, str], ...] = ()

    @property
    def schemes(self) -> tuple[Scheme, ...]:
        return (self.scheme, *self.also)

    def parts(self) -> dict[str, Part]:
        return {"planner": self.planner, "stored": self.stored, "kernel": self.kernel, "check": self.check}


def _code(planner: str, stored: str, kernel: str, check: str, torch: bool) -> dict[str, Any]:
    """A card's code parts: ``planner`` under mocli.plan, ``stored`` in mocli.module_classes, ``kernel``
    under mocli.serve, ``check`` a module of mocli.verify.kinds."""
    return {"planner": Part(f"mocli.plan.{planner}"), "stored": Part(f"mocli.module_classes:{stored}"),
            "kernel": Part(f"mocli.serve.{kernel}"), "check": Part(f"mocli.verify.kinds.{check}:check"),
            "check_torch": torch}


_FP8_MOE_ROLES = (Role.W13_WEIGHT, Role.W2_WEIGHT, Role.W13_WEIGHT_SCALE, Role.W2_WEIGHT_SCALE, Role.W13_INPUT_SCALE,
                  Role.W2_INPUT_SCALE, Role.W13_INPUT_SCALE_INV, Role.W2_INPUT_SCALE_INV, Role.G1_ALPHAS, Role.G2_ALPHAS)
_NVFP4_MOE_ROLES = (Role.W13_WEIGHT, Role.W2_WEIGHT, Role.W13_WEIGHT_SCALE, Role.W2_WEIGHT_SCALE, Role.W13_WEIGHT_SCALE_2,
                    Role.W2_WEIGHT_SCALE_2, Role.W13_INPUT_SCALE, Role.W2_INPUT_SCALE, Role.G1_ALPHAS, Role.G2_ALPHAS,
                    Role.A1_GSCALE, Role.A2_GSCALE)
_BLOCK_MOE_ROLES = (Role.W13_WEIGHT, Role.W13_WEIGHT_SCALE, Role.W2_WEIGHT, Role.W2_WEIGHT_SCALE)
REPACK = "gptq_marlin_repack"  # the transform every Marlin weight records
BLOCK_MAJOR_K = "block_major_k_128"  # trtllm's BlockMajorK layout of FP8 block-scale experts (SEMANTICS §18.2)

CARDS: tuple[Card, ...] = (
    # requantizing non-max shards to the shared scale rounds each of their weights once more: half an
    # e4m3 step, 2^-4..2^-3 relative, rms <= 3.6% on those rows (real Llama export: 1.4-2.0%)
    Card(ModuleKind.FP8_LINEAR, FP8, False, frozenset({Role.WEIGHT, Role.WEIGHT_SCALE, Role.INPUT_SCALE}),
         **_code("dense:_Fp8TensorDense", "Fp8Linear", "dense:Fp8LinearKernel", "fp8_linear", torch=True),
         thresholds=Thresholds(0.05, 0.05)),
    # bit-identical weights: only BF16 output rounding (2^-9) and summation order remain
    Card(ModuleKind.FP8_CHANNEL_LINEAR, FP8_CHANNEL, False, frozenset({Role.WEIGHT, Role.WEIGHT_SCALE}),
         **_code("dense:_Fp8ScaledDense", "Fp8ChannelLinear", "dense:Fp8ChannelLinearKernel", "fp8_linear", torch=True),
         thresholds=Thresholds(0.01, 0.01)),
    Card(ModuleKind.FP8_BLOCK_LINEAR, FP8_BLOCK, False, frozenset({Role.WEIGHT, Role.WEIGHT_SCALE}),
         **_code("dense:_Fp8ScaledDense", "Fp8BlockLinear", "dense:Fp8BlockLinearKernel", "fp8_linear", torch=True),
         thresholds=Thresholds(0.01, 0.01)),
    # NVFP4_AWQ converts as NVFP4, with its pre_quant_scale (SEMANTICS §15.3) where the source kept one.
    # Shards whose weight_scale_2 was unified: one e4m3 rounding of each block scale, <= 2^-4 relative
    # per block (rms ~2.5%; measured 0.022-0.025), so a worst case of 2^-4 plus output rounding
    Card(ModuleKind.NVFP4_LINEAR, NVFP4, False, frozenset({Role.WEIGHT, Role.WEIGHT_SCALE, Role.WEIGHT_SCALE_2,
                                                           Role.INPUT_SCALE, Role.ALPHA, Role.INPUT_SCALE_INV}),
         **_code("dense:_Nvfp4Dense", "Nvfp4Linear", "dense:Nvfp4LinearKernel", "nvfp4_linear", torch=False),
         thresholds=Thresholds(0.01, 0.08), also=(NVFP4_AWQ,), optional=frozenset({Role.PRE_QUANT_SCALE})),
    # MoE GEMM1 (x @ [w3; w1]) as the dense kinds; GEMM2 on the kernel's own intermediate: bit-identical
    # w2, output rounding only
    Card(ModuleKind.FP8_MOE, FP8, True, frozenset(_FP8_MOE_ROLES),
         **_code("moe:_Fp8Moe", "Fp8MoE", "moe:Fp8MoeKernel", "fp8_moe", torch=True),
         thresholds=Thresholds(0.05, 0.05, gemm2=0.01)),
    Card(ModuleKind.NVFP4_MOE, NVFP4, True, frozenset(_NVFP4_MOE_ROLES),
         **_code("moe:_Nvfp4Moe", "Nvfp4MoE", "moe:Nvfp4MoeKernel", "nvfp4_moe", torch=False),
         thresholds=Thresholds(0.01, 0.08, gemm2=0.01), also=(NVFP4_AWQ,), optional=frozenset({Role.PRE_QUANT_SCALE})),
    # bit-identical weights and scales, the same activation quantization: summation order and rounding only
    Card(ModuleKind.MXFP8_LINEAR, MXFP8, False, frozenset({Role.WEIGHT, Role.WEIGHT_SCALE}),
         **_code("mxfp8:_Mxfp8Dense", "Mxfp8Linear", "dense:Mxfp8LinearKernel", "mxfp8_linear", torch=False),
         thresholds=Thresholds(0.01, 0.01)),
    Card(ModuleKind.MXFP8_MOE, MXFP8, True, frozenset(_BLOCK_MOE_ROLES),
         **_code("mxfp8:_Mxfp8Moe", "Mxfp8MoE", "moe:Mxfp8MoeKernel", "mxfp8_moe", torch=False),
         thresholds=Thresholds(0.01, 0.01, gemm2=0.01)),
    # FP8 block-scale experts: trtllm shuffles them otherwise (16-row blocks) and stores them BlockMajorK
    # (SEMANTICS §18.2)
    Card(ModuleKind.FP8_BLOCK_MOE, FP8_BLOCK, True, frozenset(_BLOCK_MOE_ROLES),
         **_code("fp8_block_moe:_Fp8BlockMoe", "Fp8BlockMoE", "moe:Fp8BlockMoeKernel", "fp8_block_moe", torch=False),
         thresholds=Thresholds(0.01, 0.01, gemm2=0.01), transforms=(("flashinfer-trtllm", BLOCK_MAJOR_K),)),
    # weight-only, BF16 activations on both sides: exact products, so summation order, blocks flushed
    # under 2^-6 (a few ulps of the layer) and, where S2 was unified, the rescaled block scales
    Card(ModuleKind.NVFP4_MARLIN_LINEAR, NVFP4, False,
         frozenset({Role.WEIGHT, Role.WEIGHT_SCALE, Role.WEIGHT_GLOBAL_SCALE}),
         **_code("marlin:_MarlinDense", "MarlinLinear", "marlin:MarlinLinearKernel", "marlin_linear", torch=False),
         thresholds=Thresholds(0.01, 0.08), also=(W4A16_NVFP4,), optional=frozenset({Role.INPUT_GLOBAL_SCALE}),
         transforms=(("marlin", REPACK),)),
    Card(ModuleKind.NVFP4_MARLIN_MOE, NVFP4, True,
         frozenset({Role.W13_WEIGHT, Role.W2_WEIGHT, Role.W13_WEIGHT_SCALE, Role.W2_WEIGHT_SCALE,
                    Role.W13_WEIGHT_SCALE_2, Role.W2_WEIGHT_SCALE_2}),
         **_code("marlin:_MarlinMoe", "MarlinMoE", "marlin:MarlinMoeKernel", "marlin_moe", torch=False),
         thresholds=Thresholds(0.01, 0.08, gemm2=0.01), also=(W4A16_NVFP4,),
         optional=frozenset({Role.W13_INPUT_SCALE, Role.W2_INPUT_SCALE}), transforms=(("marlin", REPACK),)),
    # weight-only, BF16 activations: the source's weights and E8M0 scales bit for bit (only moved), exact
    # products, so summation order and output rounding only
    Card(ModuleKind.MXFP4_MARLIN_LINEAR, MXFP4, False, frozenset({Role.WEIGHT, Role.WEIGHT_SCALE}),
         **_code("mxfp4_marlin:_Mxfp4MarlinDense", "Mxfp4MarlinLinear", "mxfp4_marlin:Mxfp4MarlinLinearKernel",
                 "mxfp4_marlin_linear", torch=False),
         thresholds=Thresholds(0.01, 0.01), transforms=(("marlin", REPACK),)),
    Card(ModuleKind.MXFP4_MARLIN_MOE, MXFP4, True,
         frozenset({Role.W13_WEIGHT, Role.W2_WEIGHT, Role.W13_WEIGHT_SCALE, Role.W2_WEIGHT_SCALE}),
         **_code("mxfp4_marlin:moe_planner", "Mxfp4MarlinMoE", "mxfp4_marlin:Mxfp4MarlinMoeKernel",
                 "mxfp4_marlin_moe", torch=False),
         thresholds=Thresholds(0.01, 0.01, gemm2=0.01), optional=frozenset({Role.W13_BIAS, Role.W2_BIAS}),
         transforms=(("marlin", REPACK),)),
    # flashinfer-trtllm's MXFP4 experts: the source's e2m1 codes and E8M0 scales bit for bit (only moved),
    # BF16 activations (vLLM's default variant for gpt-oss): exact products, summation order and rounding only
    Card(ModuleKind.MXFP4_MOE, MXFP4, True, frozenset(_BLOCK_MOE_ROLES),
         **_code("mxfp4_moe:_Mxfp4TrtllmMoe", "Mxfp4MoE", "mxfp4_moe:Mxfp4MoeKernel", "mxfp4_moe", torch=False),
         thresholds=Thresholds(0.01, 0.01, gemm2=0.01), optional=frozenset({Role.W13_BIAS, Role.W2_BIAS})),
)
KINDS: dict[ModuleKind, Card] = {c.kind: c for c in CARDS}
# The kinds the FlashInfer targets write (marlin writes its own: ``targets.marlin``)
FLASHINFER_KINDS = frozenset({ModuleKind.FP8_LINEAR, ModuleKind.FP8_CHANNEL_LINEAR, ModuleKind.FP8_BLOCK_LINEAR,
                              ModuleKind.NVFP4_LINEAR, ModuleKind.FP8_MOE, ModuleKind.NVFP4_MOE, ModuleKind.MXFP8_LINEAR,
                              ModuleKind.MXFP8_MOE, ModuleKind.FP8_BLOCK_MOE})


def table(part: str) -> dict[ModuleKind, Any]:
    """``{kind: card's part loaded}`` for one code part ("planner", "stored", "kernel", "check"): how a
    package builds its per-kind table from the cards."""
    return {c.kind: c.parts()[part].load() for c in CARDS}


def kind_for(scheme: Scheme, moe: bool, among: frozenset[ModuleKind] = FLASHINFER_KINDS) -> ModuleKind | None:
    """The module kind (of those ``among``: a target's) a stored scheme converts to (None: no kernel path)."""
    return next((k for k, s in KINDS.items() if k in among and scheme in s.schemes and s.moe is moe), None)
