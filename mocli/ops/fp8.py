"""FP8 (e4m3) requantization (SEMANTICS §3, §4)."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """fp8(x): round-to-nearest-even, saturating at ±448 (float32 in)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def requantize_fp8(q: torch.Tensor, scale: torch.Tensor, new_scale: torch.Tensor) -> torch.Tensor:
    """q' = fp8(clamp(float(q) * s * (1/S), ±448)); a shard already at S is returned unchanged.

    q: F8_E4M3 [..]; scale, new_scale: float32 0-dim (CPU). Returns F8_E4M3 on q's device.
    """
    if bool(scale == new_scale):
        return q  # mocli policy: the max-scale shard is copied byte-for-byte
    inv = torch.reciprocal(new_scale.to(torch.float32).cpu())  # 1/S on the CPU: one rounding, any device
    x = q.to(torch.float32)
    x.mul_(scale.to(q.device, torch.float32)).mul_(inv.to(q.device)).clamp_(-FP8_MAX, FP8_MAX)
    return x.to(FP8)

