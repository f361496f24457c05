"""NVFP4: e2m1 codes, block-scale rescaling, dequantization (SEMANTICS §1, §6, §7)."""

from __future__ import annotations

import torch

from mocli.ops.fp8 import FP8, to_fp8

BLOCK = 16
# e2m1 magnitude by 3-bit index; bit 3 of a code is the sign (SEMANTICS §1).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """U8 [.., K/2] -> float32 [.., K]; the low nibble is the first element."""
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32, device=packed.device)
    lo = (packed & 0x0F).long()
    hi = (packed >> 4).long()
    return torch.stack((table[lo], table[hi]), dim=-1).flatten(-2)


def rescale_block_scales(block_scale: torch.Tensor, scale_2: torch.Tensor, new_scale_2: torch.Tensor) -> torch.Tensor:
    """bs' = fp8(float(bs) * s2_i / S2), so bs' * S2 ≈ bs * s2_i (SEMANTICS §6 mocli policy).

    block_scale: F8_E4M3; scales float32 0-dim (CPU). Unchanged when s2_i == S2.
    """
    if bool(scale_2 == new_scale_2):
        return block_scale
    dev = block_scale.device
    x = block_scale.to(torch.float32) * scale_2.to(dev, torch.float32)
    x = x / new_scale_2.to(dev, torch.float32)
    return to_fp8(x)


def as_fp8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == FP8 else t.view(FP8)
