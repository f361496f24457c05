"""flashinfer-cutlass: FlashInfer's CUTLASS GEMMs and ``cutlass_fused_moe`` (SEMANTICS §5-§7)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mocli.targets.base import Target, TargetLayout

if TYPE_CHECKING:
    import torch

# cutlass NVFP4 GEMMs take N and K padded to multiples of 32 (SEMANTICS §6).
CUTLASS_FP4_PAD = 32


class CutlassLayout(TargetLayout):
    target = Target.FLASHINFER_CUTLASS
    fp4_kernels = True

    def nvfp4_weight_shape(self, n: int, k: int) -> tuple[int, int]:
        return _roundup(n, CUTLASS_FP4_PAD), _roundup(k, CUTLASS_FP4_PAD) // 2

    def nvfp4_weight_transforms(self, n: int, k: int) -> list[str]:
        return [f"pad_to_{CUTLASS_FP4_PAD}"] if self.nvfp4_weight_shape(n, k) != (n, k // 2) else []

    def nvfp4_weight_decode(self, stored: torch.Tensor, n: int, k: int, what: str) -> torch.Tensor:
        from mocli.targets import decode

        return decode.unpad(stored, n, k // 2, what)


def _roundup(x: int, m: int) -> int:
    return (x + m - 1) // m * m
