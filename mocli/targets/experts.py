"""``--mxfp4-experts``: how a FlashInfer target writes MXFP4 experts (convert and validate).

``native`` (the default) leaves each target as it is: flashinfer-trtllm writes ``mxfp4_moe`` (SEMANTICS §19.6),
flashinfer-cutlass refuses them (TGT002). ``fp8-block`` re-encodes biasless SiLU experts losslessly as 128x128
block FP8 (SEMANTICS §19.7, DeepSeek-V4's recipe for Hopper's FP8 tensor cores) and writes them as the
``fp8_block_moe`` kind of §18 on either FlashInfer target: a variant of the target's layout whose MXFP4 experts
take the FP8_BLOCK experts' kind, constraints (§18.3) and planner (``mocli.plan.REENCODED``).
"""

from __future__ import annotations

from enum import StrEnum

from mocli.errors import InputError
from mocli.kinds import ModuleKind
from mocli.schemes import FP8_BLOCK, MXFP4
from mocli.targets.base import Constraint, Target, TargetLayout


class Mxfp4Experts(StrEnum):
    NATIVE = "native"
    FP8_BLOCK = "fp8-block"


HELP = ("How MXFP4 experts are written: native (the target's own MXFP4 path, if any) or fp8-block (re-encoded "
        "losslessly as 128x128 block FP8, the fp8_block_moe kind, for Hopper's FP8 tensor cores; biasless SiLU "
        "experts on flashinfer-cutlass or flashinfer-trtllm; a block whose values do not fit one scale: TGT004; "
        "SEMANTICS §19.7).")
TAKERS = (Target.FLASHINFER_CUTLASS, Target.FLASHINFER_TRTLLM)
GPT_OSS = ("{target} --mxfp4-experts fp8-block re-encodes biasless SiLU experts only: these are gpt-oss's biased, "
           "clamped-SwiGLU (swigluoai) experts, for which vLLM 0.33 has no FP8 128x128-block FlashInfer path "
           "(SEMANTICS §18, §19.7); --mxfp4-experts native with --target flashinfer-trtllm or --target marlin "
           "serves them")


class _Fp8BlockExperts:
    """Mixed in before a FlashInfer target's layout class (``with_fp8_block_experts``)."""

    reencodes = MXFP4

    def kind_for(self, scheme, moe: bool) -> ModuleKind | None:
        if moe and scheme is MXFP4:
            return ModuleKind.FP8_BLOCK_MOE
        return super().kind_for(scheme, moe)

    def moe_refusal(self, layer) -> str | None:
        first = next(iter(layer.experts.values()), None)
        biased = first is not None and any("bias" in m.tensors for m in (first.gate, first.up, first.gate_up) if m)
        if MXFP4 in layer.schemes and (layer.interleaved or biased):
            return GPT_OSS.format(target=self.target)
        return super().moe_refusal(layer)


def with_fp8_block_experts(layout: TargetLayout) -> TargetLayout:
    """``layout`` whose MXFP4 experts convert to ``fp8_block_moe``, under the FP8_BLOCK experts' constraints."""
    cls = type(layout)
    constraints = tuple(c for c in cls.constraints if not (c.scope == "moe" and c.scheme is MXFP4)) + tuple(
        Constraint("moe", MXFP4, c.dim, c.multiple, c.why + "; MXFP4 experts re-encoded as 128x128 block FP8")
        for c in cls.constraints if c.scope == "moe" and c.scheme is FP8_BLOCK)
    variant = type(f"{cls.__name__}Fp8BlockExperts", (_Fp8BlockExperts, cls), {
        "supported": {**cls.supported, "moe": cls.supported["moe"] | {MXFP4}},
        "kinds": cls.kinds | {ModuleKind.FP8_BLOCK_MOE}, "constraints": constraints})
    return variant()


def check_choice(target: Target | str | None, experts: Mxfp4Experts | str) -> Mxfp4Experts:
    """The choice, refused (exit 2) for a target that writes no ``fp8_block_moe``."""
    experts = Mxfp4Experts(experts)
    if experts is Mxfp4Experts.FP8_BLOCK and target is not None and Target(target) not in TAKERS:
        raise InputError(f"--mxfp4-experts fp8-block with --target {target}: the re-encoded experts are the "
                         "fp8_block_moe kind, which only FlashInfer's FP8 block-scale MoE kernels take",
                         hint="use --target flashinfer-cutlass (Hopper) or --target flashinfer-trtllm, or drop "
                              "--mxfp4-experts for marlin's own MXFP4 experts")
    return experts
