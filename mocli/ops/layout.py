"""Kernel layouts: 128x4 block-scale swizzle, trtllm row shuffles, gated-activation reorder, padding."""

from __future__ import annotations

import torch

SWIZZLE_ROWS = 128
SWIZZLE_COLS = 4


def roundup(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    return roundup(rows, SWIZZLE_ROWS), roundup(cols, SWIZZLE_COLS)


def swizzle_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """[M, Kb] -> [Mp, Kp] in the 128x4 interleaved order (SEMANTICS §5), zero-padded.

    Element (m, k) lands at flat offset (m//128)*(Kp/4)*512 + (k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + k%4.
    Any 1-byte dtype; 3-D input [E, M, Kb] is swizzled per expert.
    """
    if scales.dim() == 3:
        return torch.stack([swizzle_block_scales(s) for s in scales])
    m, kb = scales.shape
    mp, kp = swizzled_shape(m, kb)
    raw = scales.view(torch.uint8)
    padded = torch.zeros((mp, kp), dtype=torch.uint8, device=scales.device)
    padded[:m, :kb] = raw
    out = padded.reshape(mp // 128, 4, 32, kp // 4, 4).permute(0, 3, 2, 1, 4).contiguous()
    return out.reshape(mp, kp).view(scales.dtype)


def unswizzle_block_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of swizzle_block_scales: [Mp, Kp] -> [rows, cols] (padding dropped)."""
    if swizzled.dim() == 3:
        return torch.stack([unswizzle_block_scales(s, rows, cols) for s in swizzled])
    mp, kp = swizzled.shape
    raw = swizzled.view(torch.uint8).reshape(mp // 128, kp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return raw.reshape(mp, kp)[:rows, :cols].contiguous().view(swizzled.dtype)


def shuffle_row_indices(m: int, block: int = 32) -> torch.Tensor:
    """trtllm shuffle_matrix_a(w, 128): out[b + r] = in[b + 4*(r % 8) + r // 8], blocks of 32 rows."""
    if m % block:
        raise ValueError(f"row count {m} is not a multiple of {block}")
    r = torch.arange(m)
    b, r = r - r % block, r % block
    return b + 4 * (r % 8) + r // 8


def gated_act_row_indices(m: int) -> torch.Tensor:
    """reorder_rows_for_gated_act_gemm: out[2i] = in[i], out[2i+1] = in[M/2 + i]."""
    if m % 2:
        raise ValueError(f"row count {m} is odd")
    idx = torch.empty(m, dtype=torch.long)
    idx[0::2] = torch.arange(m // 2)
    idx[1::2] = torch.arange(m // 2, m)
    return idx


def invert_permutation(idx: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(idx.numel(), device=idx.device)
    return inv


def pad_2d(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D tensor at the end of each dim to [rows, cols] (any dtype, via bytes)."""
    r, c = t.shape
    if (r, c) == (rows, cols):
        return t
    raw = t.view(torch.uint8) if t.element_size() == 1 else t
    out = torch.zeros((rows, cols), dtype=raw.dtype, device=t.device)
    out[:r, :c] = raw
    return out.view(t.dtype)
