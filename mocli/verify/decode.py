"""Decode kernel-ready layouts back to logical row-major tensors, checking padding is zero.

The 128x4 interleave is undone with SEMANTICS §5's explicit offset formula (a gather), not by
inverting the reshape/permute the converter used, so a wrong swizzle cannot cancel itself out.
"""

from __future__ import annotations

import torch

from mocli.ops.layout import gated_act_row_indices, invert_permutation, shuffle_row_indices


class LayoutError(Exception):
    """The converted bytes break a layout invariant (e.g. non-zero padding)."""


def _offsets(rows: int, cols: int, kp: int, device: torch.device) -> torch.Tensor:
    m = torch.arange(rows, device=device).repeat_interleave(cols)
    k = torch.arange(cols, device=device).repeat(rows)
    return (m // 128) * (kp // 4) * 512 + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4


def unswizzle(swizzled: torch.Tensor, rows: int, cols: int, what: str) -> torch.Tensor:
    """[Mp, Kp] 128x4-interleaved (1-byte dtype) -> uint8 [rows, cols]; padding must be zero."""
    mp, kp = swizzled.shape
    flat = swizzled.contiguous().view(torch.uint8).reshape(-1)
    off = _offsets(rows, cols, kp, flat.device)
    out = flat[off].reshape(rows, cols)
    mask = torch.ones(flat.numel(), dtype=torch.bool, device=flat.device)
    mask[off] = False
    if bool(flat[mask].any()):
        raise LayoutError(f"{what}: swizzle padding is not zero")
    return out


def unpad(t: torch.Tensor, rows: int, cols: int, what: str) -> torch.Tensor:
    raw = t.contiguous().view(torch.uint8) if t.element_size() == 1 else t
    if bool(raw[rows:].any()) or bool(raw[:, cols:].any()):
        raise LayoutError(f"{what}: padding is not zero")
    return t[:rows, :cols]


def row_order(rows: int, target: str, gated: bool) -> torch.Tensor | None:
    """Source row index of each stored row (None = identity) for the target's row permutation."""
    if target != "flashinfer-trtllm":
        return None
    idx = shuffle_row_indices(rows)
    return gated_act_row_indices(rows)[idx] if gated else idx


def unpermute(t: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Inverse of ``stored = logical[order]``."""
    return t if order is None else t[invert_permutation(order).to(t.device)]
