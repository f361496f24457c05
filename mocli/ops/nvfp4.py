"""Layouts in numpy, on raw bytes: the 128x4 block-scale swizzle, row permutations and padding
(SEMANTICS §5-§7). Arrays are uint8, one row per tensor row (``[rows, row bytes]``), so that the same
code moves FP4 pairs, FP8 weights and scales and any other dtype. The per-byte tables (FP8
requantization, NVFP4 block-scale rescaling) are ``mocli.ops.fp8``'s.
"""

from __future__ import annotations

import numpy as np

from mocli.ops import swizzled_shape


def swizzle_block_scales(raw: np.ndarray) -> np.ndarray:
    """[M, Kb] bytes -> [Mp, Kp] in the 128x4 interleaved order (SEMANTICS §5), zero-padded: element
    (m, k) lands at flat offset (m//128)*(Kp/4)*512 + (k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + k%4."""
    m, kb = raw.shape
    mp, kp = swizzled_shape(m, kb)
    if (mp, kp) != (m, kb):
        padded = np.zeros((mp, kp), dtype=np.uint8)
        padded[:m, :kb] = raw
        raw = padded
    # four consecutive k stay together (the k % 4 term): move 4-byte words
    words = np.ascontiguousarray(raw).view(np.int32).reshape(mp // 128, 4, 32, kp // 4)
    return np.ascontiguousarray(words.transpose(0, 3, 2, 1)).view(np.uint8).reshape(mp, kp)


def permute_rows(a: np.ndarray, idx: np.ndarray | None) -> np.ndarray:
    """``a[idx]`` along the first dim (None: ``a`` unchanged)."""
    return a if idx is None else np.take(a, idx, axis=0)


def gather_rows(parts: list[np.ndarray], idx: np.ndarray) -> np.ndarray:
    """``concatenate(parts)[idx]`` ([rows, row bytes] parts of one row size) without the concatenation:
    each part's selected rows are gathered and scattered to their places (5 GB/s on the build VM where
    concatenating first and gathering ran at 0.8; the gather makes one temporary of the part's rows)."""
    out = np.empty((len(idx), parts[0].shape[1]), dtype=np.uint8)
    base = 0
    for p in parts:
        dst = np.flatnonzero((idx >= base) & (idx < base + len(p)))
        out[dst] = p[idx[dst] - base]
        base += len(p)
    return out


def pad_2d(a: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Zero-pad [r, c] bytes at the end of each dim to [rows, cols]."""
    r, c = a.shape
    if (r, c) == (rows, cols):
        return a
    out = np.zeros((rows, cols), dtype=a.dtype)
    out[:r, :c] = a
    return out
