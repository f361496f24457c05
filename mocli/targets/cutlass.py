"""flashinfer-cutlass: FlashInfer's CUTLASS GEMMs and ``cutlass_fused_moe`` (SEMANTICS §5-§7)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mocli.schemes import MXFP8
from mocli.targets.base import Minimum, Target, TargetLayout

if TYPE_CHECKING:
    import torch

# cutlass NVFP4 GEMMs take N and K padded to multiples of 32 (SEMANTICS §6).
CUTLASS_FP4_PAD = 32


class CutlassLayout(TargetLayout):
    target = Target.FLASHINFER_CUTLASS
    kernels = "FlashInfer's CUTLASS GEMMs and cutlass_fused_moe"
    gpus = "sm_100/sm_103 (B200, GB200, B300)"
    fp4_kernels = True
    # SEMANTICS §14.2: FlashInfer's CUTLASS and CuTe-DSL mm_mxfp8 decline N < 128 or K < 128
    # (vllm 0.33 kernels/linear/mxfp8/flashinfer.py :: _check_mm_mxfp8_shape); vLLM falls through to the
    # next candidate (Marlin on sm_90 and sm_100 alike)
    minimums = tuple(Minimum(MXFP8, d, 128, f"FlashInfer's mm_mxfp8 needs {d} >= 128 (_check_mm_mxfp8_shape): "
                             "vLLM runs this layer on its next MXFP8 kernel (Marlin), mocli's plugin on its "
                             "decode; the rest of the model keeps FlashInfer's (SEMANTICS §14.2)")
                     for d in ("N", "K"))

    def nvfp4_weight_shape(self, n: int, k: int) -> tuple[int, int]:
        return _roundup(n, CUTLASS_FP4_PAD), _roundup(k, CUTLASS_FP4_PAD) // 2

    def nvfp4_weight_transforms(self, n: int, k: int) -> list[str]:
        return [f"pad_to_{CUTLASS_FP4_PAD}"] if self.nvfp4_weight_shape(n, k) != (n, k // 2) else []

    def nvfp4_weight_decode(self, stored: torch.Tensor, n: int, k: int, what: str) -> torch.Tensor:
        from mocli.targets import decode

        return decode.unpad(stored, n, k // 2, what)


def _roundup(x: int, m: int) -> int:
    return (x + m - 1) // m * m
