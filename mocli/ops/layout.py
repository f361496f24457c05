"""Kernel layouts: 128x4 block-scale swizzle, trtllm row shuffles, gated-activation reorder, padding.

Forward transforms only; the targets pair each with an independently written inverse
(``mocli.targets.decode``) that verify uses. Functions take an optional ``out`` buffer so the
executor can reuse memory (first-touching fresh pages costs more than the copy itself).
"""

from __future__ import annotations

from functools import lru_cache

import torch

SWIZZLE_ROWS = 128
SWIZZLE_COLS = 4
SHUFFLE_BLOCK = 32


def roundup(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    return roundup(rows, SWIZZLE_ROWS), roundup(cols, SWIZZLE_COLS)


def swizzle_block_scales(scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[M, Kb] -> [Mp, Kp] in the 128x4 interleaved order (SEMANTICS §5), zero-padded.

    Element (m, k) lands at flat offset (m//128)*(Kp/4)*512 + (k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + k%4.
    Any 1-byte dtype; 3-D input [E, M, Kb] is swizzled per expert.
    """
    if scales.dim() == 3:
        res = out if out is not None else torch.empty((scales.shape[0], *swizzled_shape(*scales.shape[1:])),
                                                      dtype=scales.dtype, device=scales.device)
        for e in range(scales.shape[0]):
            swizzle_block_scales(scales[e], res[e])
        return res
    m, kb = scales.shape
    mp, kp = swizzled_shape(m, kb)
    raw = scales.view(torch.uint8)
    if (mp, kp) != (m, kb):
        padded = torch.zeros((mp, kp), dtype=torch.uint8, device=scales.device)
        padded[:m, :kb] = raw
        raw = padded
    res = out if out is not None else torch.empty((mp, kp), dtype=scales.dtype, device=scales.device)
    # Four consecutive k stay together (the k % 4 term), so move 4-byte words: 10x faster than bytes.
    res.view(torch.uint8).view(torch.int32).view(mp // 128, kp // 4, 32, 4).copy_(
        raw.contiguous().view(torch.int32).view(mp // 128, 4, 32, kp // 4).permute(0, 3, 2, 1))
    return res


@lru_cache(maxsize=256)
def _shuffle_rows_cpu(m: int) -> torch.Tensor:
    if m % SHUFFLE_BLOCK:
        raise ValueError(f"row count {m} is not a multiple of {SHUFFLE_BLOCK}")
    r = torch.arange(m)
    b, r = r - r % SHUFFLE_BLOCK, r % SHUFFLE_BLOCK
    return b + 4 * (r % 8) + r // 8


def shuffle_row_indices(m: int) -> torch.Tensor:
    """trtllm shuffle_matrix_a(w, 128): out[b + r] = in[b + 4*(r % 8) + r // 8], blocks of 32 rows."""
    return _shuffle_rows_cpu(m)


@lru_cache(maxsize=256)
def gated_act_row_indices(m: int) -> torch.Tensor:
    """reorder_rows_for_gated_act_gemm: out[2i] = in[i], out[2i+1] = in[M/2 + i]."""
    if m % 2:
        raise ValueError(f"row count {m} is odd")
    idx = torch.empty(m, dtype=torch.long)
    idx[0::2] = torch.arange(m // 2)
    idx[1::2] = torch.arange(m // 2, m)
    return idx


_device_index: dict[tuple[int, str], torch.Tensor] = {}


def permute_rows(t: torch.Tensor, idx: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``t[idx]`` along dim 0 (None = unchanged), into ``out`` when given. Any dtype."""
    if idx is None:
        return t
    if idx.device != t.device:
        key = (id(idx), str(t.device))
        if key not in _device_index:
            _device_index[key] = idx.to(t.device)
        idx = _device_index[key]
    if out is None:
        return t.index_select(0, idx)
    return torch.index_select(t, 0, idx, out=out)


def pad_2d(t: torch.Tensor, rows: int, cols: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Zero-pad a 2-D tensor at the end of each dim to [rows, cols] (any dtype, via bytes)."""
    r, c = t.shape
    if (r, c) == (rows, cols):
        return t
    raw = t.view(torch.uint8) if t.element_size() == 1 else t
    res = out if out is not None else torch.empty((rows, cols), dtype=t.dtype, device=t.device)
    dst = res.view(torch.uint8) if t.element_size() == 1 else res
    dst.zero_()
    dst[:r, :c] = raw
    return res
