"""FP8 (e4m3) requantization and NaN detection (SEMANTICS §3, §4, §6).

Requantizing by a fixed ratio, and rescaling NVFP4 block scales, depend only on the input byte,
so on the CPU they are a table lookup: the table is built by running the float32 formula on all
256 codes, which gives the same bytes as running it element by element (tests assert this), ten
times faster. On CUDA the formula itself runs (elementwise IEEE float32, so the same bytes again).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
NAN_CODE = 0x7F  # every table maps NaN input to +NaN, so one int8 max finds it


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """fp8(x): round-to-nearest-even, saturating at ±448 (float32 in)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _requant_formula(codes: torch.Tensor, scale: torch.Tensor, new_scale: torch.Tensor) -> torch.Tensor:
    """SEMANTICS §3: fp8(clamp(float(q) * s * (1/S), ±448)); 1/S is rounded once, on the CPU."""
    inv = torch.reciprocal(new_scale.to(torch.float32).cpu())
    x = codes.to(torch.float32)
    x.mul_(scale.to(codes.device, torch.float32)).mul_(inv.to(codes.device)).clamp_(-FP8_MAX, FP8_MAX)
    return x.to(FP8)


def _rescale_formula(codes: torch.Tensor, scale_2: torch.Tensor, new_scale_2: torch.Tensor) -> torch.Tensor:
    """SEMANTICS §6: bs' = fp8(float(bs) * s2_i / S2)."""
    dev = codes.device
    x = codes.to(torch.float32) * scale_2.to(dev, torch.float32)
    return to_fp8(x / new_scale_2.to(dev, torch.float32))


def _bits(x: torch.Tensor) -> int:
    return int(x.reshape(()).to(torch.float32).view(torch.int32))


@lru_cache(maxsize=4096)
def _table(kind: str, a_bits: int, b_bits: int) -> np.ndarray:
    """uint16 table over byte pairs: out[(hi << 8) | lo] = (f(hi) << 8) | f(lo); NaN in -> 0x7F."""
    a = torch.tensor(a_bits, dtype=torch.int32).view(torch.float32)
    b = torch.tensor(b_bits, dtype=torch.int32).view(torch.float32)
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    f = (_requant_formula if kind == "requant" else _rescale_formula)(codes, a, b).view(torch.uint8).numpy().copy()
    f[[0x7F, 0xFF]] = NAN_CODE
    pairs = np.arange(65536, dtype=np.uint32)
    return (f[pairs & 0xFF].astype(np.uint16) | (f[pairs >> 8].astype(np.uint16) << 8)).astype(np.uint16)


def _apply_table(table: np.ndarray, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    src = q.contiguous().view(torch.uint8).reshape(-1).numpy()
    res = out if out is not None else torch.empty(q.shape, dtype=FP8)
    dst = res.view(torch.uint8).reshape(-1).numpy()
    even = src.size & ~1
    np.take(table, src[:even].view(np.uint16), out=dst[:even].view(np.uint16))
    if even != src.size:  # an odd last byte: the low half of the pair table is the byte table
        dst[-1] = table[src[-1]] & 0xFF
    return res.view(q.shape)


def requantize_fp8(q: torch.Tensor, scale: torch.Tensor, new_scale: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """q' = fp8(clamp(float(q) * s * (1/S), ±448)); a shard already at S is returned unchanged.

    q: F8_E4M3 [..]; scale, new_scale: float32 0-dim (CPU); ``out``: optional CPU buffer of q's
    shape. Returns F8_E4M3 on q's device. NaN codes stay NaN (as 0x7F).
    """
    if bool(scale == new_scale):  # mocli policy: the max-scale shard is copied byte-for-byte
        return q if out is None else out.view(torch.uint8).copy_(q.view(torch.uint8)).view(FP8)
    if q.device.type != "cpu":
        return _requant_formula(q, scale, new_scale)
    return _apply_table(_table("requant", _bits(scale), _bits(new_scale)), q, out)


def rescale_block_scales(block_scale: torch.Tensor, scale_2: torch.Tensor, new_scale_2: torch.Tensor,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """bs' = fp8(float(bs) * s2_i / S2), so bs' * S2 ≈ bs * s2_i (SEMANTICS §6 mocli policy).

    block_scale: F8_E4M3 (or its U8 bytes); scales float32 0-dim (CPU). Unchanged when s2_i == S2.
    """
    bs = block_scale if block_scale.dtype == FP8 else block_scale.view(FP8)
    if bool(scale_2 == new_scale_2):
        return bs if out is None else out.view(torch.uint8).copy_(bs.view(torch.uint8)).view(FP8)
    if bs.device.type != "cpu":
        return _rescale_formula(bs, scale_2, new_scale_2)
    return _apply_table(_table("rescale", _bits(scale_2), _bits(new_scale_2)), bs, out)


def has_nan_fp8(t: torch.Tensor) -> bool:
    """Any e4m3 NaN byte (0x7F or 0xFF)? Two max reductions, no temporaries: as uint8, 0xFF is the
    largest byte; as int8, 0x7F is the largest (finite codes stop at 0x7E / 0xFE)."""
    if t.numel() == 0:
        return False
    raw = t.contiguous().view(torch.uint8).reshape(-1)
    if raw.device.type != "cpu":
        return bool(((raw & 0x7F) == 0x7F).any())
    a = raw.numpy()
    return bool(a.max() == 0xFF or a.view(np.int8).max() == 0x7F)
