"""FlashInfer call contracts (SEMANTICS §4, §7, §9), built from converted modules.

The builders are pure and unit-tested; the ``run_*`` functions call FlashInfer and only run where
its compiled kernels exist (NVFP4: sm_100+; fused MoE: a prebuilt module).
"""

from __future__ import annotations

from typing import Any

import torch

from mocli.loader import Fp8MoE, Nvfp4Linear, Nvfp4MoE
from mocli.numerics import FP8_MAX


def cutlass_fused_moe_fp8_args(mod: Fp8MoE, x: torch.Tensor, topk_ids: torch.Tensor,
                               topk_weights: torch.Tensor) -> dict[str, Any]:
    """cutlass_fused_moe FP8 per-tensor: the input is pre-quantized with 1/a1; a1 folded into g1_alphas."""
    xq = (x.float() * mod.w13_input_scale_inv.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {
        "input": xq,
        "token_selected_experts": topk_ids.to(torch.int32),
        "token_final_scales": topk_weights.to(torch.float32),
        "fc1_expert_weights": mod.w13_weight,  # [E, 2I, H], rows [w3; w1]
        "fc2_expert_weights": mod.w2_weight,  # [E, H, I]
        "output_dtype": torch.bfloat16,
        # [g1_alphas [E], 1/a2 (0-dim), g2_alphas [E], a1 (0-dim, LoRA only)]
        "quant_scales": mod.cutlass_quant_scales(),
    }


def cutlass_fused_moe_nvfp4_args(mod: Nvfp4MoE, x_fp4: torch.Tensor, x_sf: torch.Tensor, topk_ids: torch.Tensor,
                                 topk_weights: torch.Tensor) -> dict[str, Any]:
    """cutlass_fused_moe NVFP4: packed weights viewed as int64 and block scales as int32 (vLLM's call)."""
    return {
        "input": x_fp4,
        "input_sf": x_sf,
        "token_selected_experts": topk_ids.to(torch.int32),
        "token_final_scales": topk_weights.to(torch.float32),
        "fc1_expert_weights": mod.w13_weight.view(torch.long),
        "fc2_expert_weights": mod.w2_weight.view(torch.long),
        "output_dtype": torch.bfloat16,
        "quant_scales": mod.cutlass_quant_scales(),
    }


def mm_fp4_args(mod: Nvfp4Linear, x_fp4: torch.Tensor, x_sf: torch.Tensor) -> dict[str, Any]:
    """flashinfer.mm_fp4(a, b.T, a_sf, b_sf.T, alpha) on the cutlass layout."""
    return {"a": x_fp4, "b": mod.weight.t(), "a_descale": x_sf, "b_descale": mod.weight_scale.t(),
            "alpha": mod.alpha.reshape(1).float(), "out_dtype": torch.bfloat16}


def run_cutlass_fused_moe_fp8(mod: Fp8MoE, x, topk_ids, topk_weights) -> torch.Tensor:  # pragma: no cover - GPU
    from flashinfer.fused_moe import cutlass_fused_moe

    out = cutlass_fused_moe(**cutlass_fused_moe_fp8_args(mod, x, topk_ids, topk_weights))
    return (out[0] if isinstance(out, list | tuple) else out).float()


def run_cutlass_fused_moe_nvfp4(mod: Nvfp4MoE, x, topk_ids, topk_weights) -> torch.Tensor:  # pragma: no cover
    from flashinfer import fp4_quantize
    from flashinfer.fused_moe import cutlass_fused_moe

    x_fp4, x_sf = fp4_quantize(x.bfloat16(), mod.a1_gscale[:1].float())
    out = cutlass_fused_moe(**cutlass_fused_moe_nvfp4_args(mod, x_fp4, x_sf, topk_ids, topk_weights))
    return (out[0] if isinstance(out, list | tuple) else out).float()


def run_mm_fp4(mod: Nvfp4Linear, x) -> torch.Tensor:  # pragma: no cover - sm_100+
    from flashinfer import fp4_quantize, mm_fp4

    k = mod.padded_k
    xp = torch.nn.functional.pad(x.bfloat16(), (0, k - x.shape[1]))
    x_fp4, x_sf = fp4_quantize(xp, mod.input_scale_inv.reshape(1).float())
    return mm_fp4(**mm_fp4_args(mod, x_fp4, x_sf))[:, : mod.n].float()
