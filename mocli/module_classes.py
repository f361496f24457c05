"""The per-module objects ``mocli.loader`` hands out, one dataclass per converted module kind (``CLASSES``, from the kinds' cards):
what a kernel call needs, by the manifest's role names (LAYOUT.md). Tensors are torch tensors from
``load_module`` and read-only numpy views from ``module_arrays``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mocli.kinds import ModuleKind, table

if TYPE_CHECKING:
    import torch


@dataclass
class Fp8Linear:
    """FP8 per-tensor: y = (x_fp8 @ weight.T) * weight_scale * input_scale, x_fp8 = fp8(x / input_scale)."""

    name: str
    weight: torch.Tensor  # F8 [N, K]
    weight_scale: torch.Tensor  # F32 []
    input_scale: torch.Tensor  # F32 []
    n: int
    k: int
    shard_rows: list[int]
    bias: torch.Tensor | None = None


@dataclass
class Fp8ChannelLinear:
    """FP8 per-channel weights, dynamic per-token activations."""

    name: str
    weight: torch.Tensor  # F8 [N, K]
    weight_scale: torch.Tensor  # F32 [N]
    n: int
    k: int
    shard_rows: list[int]
    bias: torch.Tensor | None = None


@dataclass
class Fp8BlockLinear:
    """FP8 128x128 block weight-only; activations dynamic per 1x128 group."""

    name: str
    weight: torch.Tensor  # F8 [N, K]
    weight_scale: torch.Tensor  # F32 [N/128, K/128]
    n: int
    k: int
    shard_rows: list[int]
    bias: torch.Tensor | None = None


@dataclass
class Nvfp4Linear:
    """NVFP4: mm_fp4(fp4_quantize(x, input_scale_inv), weight, weight_scale, alpha). Target-specific layout."""

    name: str
    weight: torch.Tensor  # U8 [padded_n, padded_k/2] (cutlass) or shuffled [N, K/2] (trtllm)
    weight_scale: torch.Tensor  # F8 [roundup(N,128), roundup(K/16,4)], 128x4 interleaved
    weight_scale_2: torch.Tensor
    input_scale: torch.Tensor
    alpha: torch.Tensor  # input_scale * weight_scale_2
    input_scale_inv: torch.Tensor  # 1 / input_scale, what fp4_quantize takes
    n: int
    k: int
    shard_rows: list[int]
    padded_n: int
    padded_k: int
    bias: torch.Tensor | None = None
    pre_quant_scale: torch.Tensor | None = None  # NVFP4_AWQ: BF16 [K], x * it before fp4_quantize


@dataclass
class Fp8MoE:
    """FP8 per-tensor experts; w13 rows are [w3; w1] per expert (trtllm: also reordered + shuffled)."""

    name: str
    w13_weight: torch.Tensor  # F8 [E, 2I, H]
    w2_weight: torch.Tensor  # F8 [E, H, I]
    w13_weight_scale: torch.Tensor  # [E]
    w2_weight_scale: torch.Tensor  # [E]
    w13_input_scale: torch.Tensor  # [] a1
    w2_input_scale: torch.Tensor  # [] a2
    w13_input_scale_inv: torch.Tensor
    w2_input_scale_inv: torch.Tensor
    g1_alphas: torch.Tensor  # [E]
    g2_alphas: torch.Tensor  # [E]
    experts: int
    intermediate: int
    hidden: int
    naming: str
    output1_scales_scalar: torch.Tensor | None = None
    output1_scales_gate_scalar: torch.Tensor | None = None
    output2_scales_scalar: torch.Tensor | None = None
    expert_offset: int = 0  # global id of local expert 0 (expert parallel)

    def cutlass_quant_scales(self) -> list[torch.Tensor]:
        """FlashInfer cutlass_fused_moe FP8 quant_scales (SEMANTICS §4, §9): a1 folded into g1_alphas."""
        return [self.g1_alphas, self.w2_input_scale_inv, self.g2_alphas, self.w13_input_scale]


@dataclass
class Nvfp4MoE:
    """NVFP4 experts; w13 rows [w3; w1]; block scales 128x4 interleaved per expert."""

    name: str
    w13_weight: torch.Tensor  # U8 [E, 2I, H/2]
    w13_weight_scale: torch.Tensor  # F8 [E, roundup(2I,128), roundup(H/16,4)]
    w13_weight_scale_2: torch.Tensor  # [E]
    w13_input_scale: torch.Tensor  # [E]
    w2_weight: torch.Tensor  # U8 [E, H, I/2]
    w2_weight_scale: torch.Tensor  # F8 [E, roundup(H,128), roundup(I/16,4)]
    w2_weight_scale_2: torch.Tensor  # [E]
    w2_input_scale: torch.Tensor  # [E]
    g1_alphas: torch.Tensor
    g2_alphas: torch.Tensor
    a1_gscale: torch.Tensor
    a2_gscale: torch.Tensor
    experts: int
    intermediate: int
    hidden: int
    naming: str
    output1_scale_scalar: torch.Tensor | None = None
    output1_scale_gate_scalar: torch.Tensor | None = None
    output2_scale_scalar: torch.Tensor | None = None
    expert_offset: int = 0
    pre_quant_scale: torch.Tensor | None = None  # NVFP4_AWQ: BF16 [H], the layer's input * it before the experts

    def cutlass_quant_scales(self) -> list[torch.Tensor]:
        """FlashInfer cutlass_fused_moe NVFP4 quant_scales (SEMANTICS §7.5)."""
        import torch

        return [self.a1_gscale, self.w13_weight_scale.view(torch.int32), self.g1_alphas,
                self.a2_gscale, self.w2_weight_scale.view(torch.int32), self.g2_alphas]


@dataclass
class Mxfp8Linear:
    """MXFP8: e4m3 weight with an E8M0 scale (``2^(b - 127)``) per 32 values along K, 128x4-swizzled;
    activations quantized the same way at run time (SEMANTICS §14.2). trtllm: rows padded to 128 and
    shuffled (``padded_n``)."""

    name: str
    weight: torch.Tensor  # F8 [padded_n, K]
    weight_scale: torch.Tensor  # U8 [roundup(padded_n, 128), roundup(K/32, 4)], 128x4-interleaved
    n: int
    k: int
    shard_rows: list[int]
    padded_n: int
    bias: torch.Tensor | None = None


@dataclass
class Mxfp8MoE:
    """MXFP8 experts as flashinfer-trtllm's ``trtllm_fp8_block_scale_moe`` (MxFp8) takes them: I and H padded
    (``padded_intermediate``, ``padded_hidden``), fc1 rows [w3; w1], gated interleave and 32-row shuffle,
    scales 127 in the padding and 128x4-interleaved per expert (SEMANTICS §14.3)."""

    name: str
    w13_weight: torch.Tensor  # F8 [E, 2 Ip, Hp]
    w13_weight_scale: torch.Tensor  # U8 [E, 2 Ip, Hp/32]
    w2_weight: torch.Tensor  # F8 [E, Hp, Ip]
    w2_weight_scale: torch.Tensor  # U8 [E, Hp, Ip/32]
    experts: int
    intermediate: int
    hidden: int
    naming: str
    padded_intermediate: int
    padded_hidden: int
    expert_offset: int = 0


@dataclass
class Fp8BlockMoE:
    """FP8 128x128-block experts (SEMANTICS §18.2): fc1 rows [w3; w1], float32 block scales clamped to 1e-10;
    flashinfer-cutlass (``cutlass_fused_moe(use_deepseek_fp8_block_scale=True)``, sm_90) as stored,
    flashinfer-trtllm (``trtllm_fp8_block_scale_moe`` DeepSeekFp8, sm_100) 16-row shuffled and BlockMajorK."""

    name: str
    w13_weight: torch.Tensor  # F8 [E, 2I, H] (cutlass) or [E, H/128, 2I, 128] (trtllm)
    w13_weight_scale: torch.Tensor  # F32 [E, 2I/128, H/128]
    w2_weight: torch.Tensor  # F8 [E, H, I] or [E, I/128, H, 128]
    w2_weight_scale: torch.Tensor  # F32 [E, H/128, I/128]
    experts: int
    intermediate: int
    hidden: int
    naming: str
    block: list[int]
    reencoded_from: str | None = None  # "mxfp4": re-encoded from MXFP4 experts (SEMANTICS §19.7)
    expert_offset: int = 0


@dataclass
class MarlinLinear:
    """NVFP4 weights in vLLM's Marlin layout, BF16 activations (SEMANTICS §13.5): what vLLM's
    ``apply_fp4_marlin_linear(x, weight, weight_scale, weight_global_scale, workspace, n, k, bias)`` takes."""

    name: str
    weight: torch.Tensor  # I32 [padded_k/16, 2 padded_n], gptq_marlin_repack
    weight_scale: torch.Tensor  # F8 [padded_k/16, padded_n]: permuted, E5M3 bytes of scale * scale_factor
    weight_global_scale: torch.Tensor  # F32 []: S2 * 2^119 / scale_factor
    n: int
    k: int
    shard_rows: list[int]
    padded_n: int
    padded_k: int
    scale_factor: float
    act_dtype: str
    input_global_scale: torch.Tensor | None = None  # a W4A4 source's input scale (Marlin does not use it)
    bias: torch.Tensor | None = None  # [padded_n], permuted (marlin_permute_bias)


@dataclass
class Mxfp4MarlinLinear:
    """MXFP4 weights in vLLM's Marlin layout, BF16 activations (SEMANTICS §19.5): what vLLM's
    ``apply_fp4_marlin_linear(x, weight, weight_scale, None, workspace, n, k, bias)`` takes."""

    name: str
    weight: torch.Tensor  # I32 [padded_k/16, 2 padded_n], gptq_marlin_repack (as NVFP4's)
    weight_scale: torch.Tensor  # U8 E8M0 codes [padded_k/32, padded_n]: permuted, values unchanged
    n: int
    k: int
    shard_rows: list[int]
    padded_n: int
    padded_k: int
    act_dtype: str
    bias: torch.Tensor | None = None  # [padded_n], permuted (marlin_permute_bias)


@dataclass
class Mxfp4MarlinMoE:
    """MXFP4 experts in vLLM's Marlin layout (SEMANTICS §19.5), [w1; w3] halves (``w13_rows`` "halves"), SiLU:
    what ``fused_marlin_moe`` takes as w1/w2 and their E8M0 scales (no global scales)."""

    name: str
    w13_weight: torch.Tensor  # I32 [E, H/16, 4 Ip]
    w13_weight_scale: torch.Tensor  # U8 E8M0 [E, H/32, 2 Ip]
    w2_weight: torch.Tensor  # I32 [E, Ip/16, 2 H]
    w2_weight_scale: torch.Tensor  # U8 E8M0 [E, Ip/32, H]
    experts: int
    intermediate: int
    hidden: int
    naming: str
    padded_intermediate: int
    act_dtype: str
    activation: str
    w13_rows: str  # "halves" ([w1; w3], silu) or "interleaved" (gpt-oss's (gate, up) rows, swigluoai)
    expert_offset: int = 0
    padded_hidden: int | None = None  # gpt-oss: Hp = roundup(H, 256), the w13 K and w2 N vLLM's parameters have
    scale_pad: int = 0  # the padding's E8M0 code (Quark's parameters start at 1)
    w13_bias: torch.Tensor | None = None  # BF16 [E, 2 Ip], interleaved, marlin_permute_bias'd
    w2_bias: torch.Tensor | None = None  # BF16 [E, Hp], zeros on TP ranks other than 0
    swiglu_alpha: float | None = None
    swiglu_beta: float | None = None
    swiglu_limit: float | None = None


@dataclass
class MarlinMoE:
    """NVFP4 experts in vLLM's Marlin layout (SEMANTICS §13.6): w13 rows [w1; w3], each half padded to
    padded_intermediate; what ``fused_marlin_moe`` takes as w1/w2, their scales and global scales."""

    name: str
    w13_weight: torch.Tensor  # I32 [E, H/16, 4 Ip]
    w13_weight_scale: torch.Tensor  # F8 [E, H/16, 2 Ip]
    w13_weight_scale_2: torch.Tensor  # F32 [E]: max(w1, w3) * 2^119 / scale_factor_w13
    w2_weight: torch.Tensor  # I32 [E, Ip/16, 2H]
    w2_weight_scale: torch.Tensor  # F8 [E, Ip/16, H]
    w2_weight_scale_2: torch.Tensor  # F32 [E]
    experts: int
    intermediate: int
    hidden: int
    naming: str
    padded_intermediate: int
    scale_factor_w13: float
    scale_factor_w2: float
    act_dtype: str
    w13_input_scale: torch.Tensor | None = None  # [E], a W4A4 source's (unused by Marlin)
    w2_input_scale: torch.Tensor | None = None
    expert_offset: int = 0


@dataclass
class Mxfp4MoE:
    """MXFP4 experts as flashinfer-trtllm's ``trtllm_fp4_block_scale_moe`` takes them (SEMANTICS §19.6): I and H
    padded (``padded_intermediate``, ``padded_hidden``), fc1 rows interleaved (up_i, gate_i) pairs, weights, E8M0
    scales and float32 biases 32-row shuffled, scales 128x4-interleaved per expert; ``activation`` ``swigluoai``
    (gpt-oss: ``swiglu_alpha``, ``swiglu_beta``, ``swiglu_limit``) or ``silu``; ``activation_dtype`` vLLM's default
    activation variant (the bytes serve both)."""

    name: str
    w13_weight: torch.Tensor  # U8 [E, 2 Ip, Hp/2]
    w13_weight_scale: torch.Tensor  # U8 [E, 2 Ip, Hp/32], E8M0 codes
    w2_weight: torch.Tensor  # U8 [E, Hp, Ip/2]
    w2_weight_scale: torch.Tensor  # U8 [E, Hp, Ip/32]
    experts: int
    intermediate: int
    hidden: int
    naming: str
    padded_intermediate: int
    padded_hidden: int
    activation: str
    activation_dtype: str
    scale_pad: int
    w13_bias: torch.Tensor | None = None  # F32 [E, 2 Ip]
    w2_bias: torch.Tensor | None = None  # F32 [E, Hp]: zeros on TP ranks other than 0
    swiglu_alpha: float | None = None
    swiglu_beta: float | None = None
    swiglu_limit: float | None = None
    expert_offset: int = 0


# Module kind -> its dataclass (its card's, ``mocli.kinds``: every class above is defined by now)
CLASSES: dict[ModuleKind, type] = table("stored")
ConvertedModule = (Fp8Linear | Fp8ChannelLinear | Fp8BlockLinear | Nvfp4Linear | Mxfp8Linear | Fp8MoE | Nvfp4MoE
                   | Mxfp8MoE | Fp8BlockMoE | MarlinLinear | MarlinMoE | Mxfp4MarlinLinear | Mxfp4MarlinMoE | Mxfp4MoE)
