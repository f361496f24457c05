"""FP8 (e4m3) requantization and NaN detection in torch (SEMANTICS §3, §4): the FP8 paths.

Requantizing by a fixed ratio depends only on the input byte, so on the CPU it is a table lookup:
the table is built by running the float32 formula on all 256 codes, which gives the same bytes as
running it element by element (tests assert this), ten times faster. On CUDA the formula itself runs
(elementwise IEEE float32, so the same bytes again). NVFP4's block-scale rescale is ``ops.nvfp4``'s.
"""

from __future__ import annotations

import threading
from functools import lru_cache

import numpy as np
import torch

from mocli.ops import nvfp4

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


def _bits(x: torch.Tensor) -> int:
    return int(x.reshape(()).to(torch.float32).view(torch.int32))


@lru_cache(maxsize=4096)
def _table(a_bits: int, b_bits: int) -> torch.Tensor:
    """Table over byte pairs (int16 bits of a uint16): out[(hi << 8) | lo] = (f(hi) << 8) | f(lo);
    NaN in -> 0x7F."""
    a = torch.tensor(a_bits, dtype=torch.int32).view(torch.float32)
    b = torch.tensor(b_bits, dtype=torch.int32).view(torch.float32)
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    f = _requant_formula(codes, a, b).view(torch.uint8).numpy().copy()
    f[[0x7F, 0xFF]] = NAN_CODE
    pairs = np.arange(65536, dtype=np.uint32)
    table = (f[pairs & 0xFF].astype(np.uint16) | (f[pairs >> 8].astype(np.uint16) << 8)).astype(np.uint16)
    return torch.from_numpy(table.view(np.int16))


CHUNK_PAIRS = 1 << 18  # 512 KiB of bytes per step: the indices stay in L2
_scratch = threading.local()


def _apply_table(lut: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """out[byte pair] = table[byte pair]. torch.index_select with int32 indices, a chunk at a time,
    measured 2.4x faster than numpy.take (which casts every index to int64)."""
    src = q.contiguous().view(torch.uint8).reshape(-1)
    res = out if out is not None else torch.empty(q.shape, dtype=FP8)
    dst = res.view(torch.uint8).reshape(-1)
    even = src.numel() & ~1
    idx = getattr(_scratch, "idx", None)
    if idx is None:
        idx = _scratch.idx = torch.empty(CHUNK_PAIRS, dtype=torch.int32)
    pairs_in, pairs_out = src[:even].view(torch.int16), dst[:even].view(torch.int16)
    for a in range(0, pairs_in.numel(), CHUNK_PAIRS):
        b = min(a + CHUNK_PAIRS, pairs_in.numel())
        ix = idx[: b - a]
        ix.copy_(pairs_in[a:b])
        ix.bitwise_and_(0xFFFF)  # int16 -> the unsigned pair value
        torch.index_select(lut, 0, ix, out=pairs_out[a:b])
    if even != src.numel():  # an odd last byte: the low half of the pair table is the byte table
        dst[-1] = int(lut[int(src[-1])]) & 0xFF
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
    return _apply_table(_table(_bits(scale), _bits(new_scale)), q, out)


def has_nan_fp8(t: torch.Tensor) -> bool:
    """Any e4m3 NaN byte (0x7F or 0xFF)? On the CPU ``nvfp4.has_nan_fp8`` on the bytes (two max
    reductions, no temporaries)."""
    if t.numel() == 0:
        return False
    raw = t.contiguous().view(torch.uint8).reshape(-1)
    if raw.device.type != "cpu":
        return bool(((raw & 0x7F) == 0x7F).any())
    return nvfp4.has_nan_fp8(raw.numpy())
