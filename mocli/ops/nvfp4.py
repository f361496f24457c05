"""NVFP4: e2m1 codes (SEMANTICS §1). Block-scale rescaling is an fp8 table: ``mocli.ops.fp8``."""

from __future__ import annotations

import torch

from mocli.ops.fp8 import FP8

BLOCK = 16
# e2m1 magnitude by 3-bit index; bit 3 of a code is the sign (SEMANTICS §1).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """U8 [.., K/2] -> float32 [.., K]; the low nibble is the first element."""
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32, device=packed.device)
    lo = (packed & 0x0F).long()
    hi = (packed >> 4).long()
    return torch.stack((table[lo], table[hi]), dim=-1).flatten(-2)


def as_fp8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == FP8 else t.view(FP8)
