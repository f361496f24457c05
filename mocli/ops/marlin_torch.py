"""vLLM's Marlin layout of NVFP4 weights as torch ops, for a GPU (``convert --device cuda``).

The same bytes as ``mocli.ops.marlin``'s numpy byte moves, computed another way: straight from the
layout's index formula (SEMANTICS §13.5; ``mocli.ops.marlin``'s docstring). With k = 16kt + 8h + 2b + l
and n = 64c + 16j + 8blk + a, output row kt holds the 32-bit words (c, a, b, j) and nibble 4l + 2blk + h
of a word is code (k, n); little-endian, byte 2l + blk of the word holds the codes h = 0 (low nibble) and
h = 1 (high). So: unpack the codes, one permute of their eight axes, pack h back into bytes. Every step
is an elementwise op or one copy, cheap on a GPU (on a CPU the numpy version is faster: it stays in cache).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mocli.ops.marlin import GROUP, _scale_rows

if TYPE_CHECKING:
    import numpy as np
    import torch


def repack(w: torch.Tensor, np_: int, kp: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``mocli.ops.marlin.repack`` on a uint8 [N, K/2] tensor (any device): uint8 [Kp/16, 8 Np] on w's
    device, or written into ``out`` (a [Kp/16, 8 Np] view, e.g. one half of an expert's w13)."""
    import torch

    n, half = w.shape
    if (n, half) != (np_, kp // 2):  # zero padding to [Np, Kp]
        padded = torch.zeros((np_, kp // 2), dtype=torch.uint8, device=w.device)
        padded[:n, :half] = w
        w = padded
    # the byte at (n, 8kt + 4h + b) holds codes l = 0 (low nibble) and l = 1 (high) of k = 16kt + 8h + 2b + l
    v = w.reshape(np_ // 64, 4, 2, 8, kp // 16, 2, 4)  # c j blk a kt h b (a copy where w is a strided slice)
    lo, hi = v & 0x0F, v >> 4  # l = 0, l = 1
    # per h, the codes as (c j blk a kt b l), then in the output bytes' order (kt c a b j l blk)
    h0, h1 = (torch.stack([lo.select(5, h), hi.select(5, h)], dim=-1).permute(4, 0, 3, 5, 1, 6, 2) for h in (0, 1))
    res = (h0 | (h1 << 4)).reshape(kp // 16, 8 * np_)  # kt | c a b j l blk
    if out is None:
        return res
    out.copy_(res)
    return out


def permute_scales(codes: torch.Tensor, np_: int, kp: int, table: np.ndarray | torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``mocli.ops.marlin.permute_scales`` on a uint8 [N, K/16] tensor: zero-padded to [Np, Kp/16], each
    code through ``table`` (``marlin.scale_table``), rows in Marlin's run order, transposed."""
    import torch

    n, kb = codes.shape
    src = torch.zeros((np_, kp // GROUP), dtype=torch.uint8, device=codes.device)
    src[:n, :kb] = codes
    lut = torch.as_tensor(table, dtype=torch.uint8).to(codes.device)
    rows = torch.from_numpy(_scale_rows(np_)).to(codes.device)
    res = lut[src.index_select(0, rows).long()].T
    if out is None:
        return res.contiguous()
    out.copy_(res)
    return out
