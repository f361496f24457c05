"""Pure byte transforms of a conversion, in numpy on the CPU: no I/O, no torch.

``fp8``: e4m3 codes and the per-byte requantize / rescale tables; ``nvfp4``: the block-scale swizzle,
row permutations and padding; ``rows``: the trtllm row orders. Scalar scale arithmetic is done by the
planners in numpy float32. The shape arithmetic planners need is here.
"""

from __future__ import annotations

SWIZZLE_ROWS = 128
SWIZZLE_COLS = 4
SHUFFLE_BLOCK = 32

__all__ = ["SHUFFLE_BLOCK", "SWIZZLE_COLS", "SWIZZLE_ROWS", "roundup", "swizzled_shape"]


def roundup(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """Shape of [rows, cols] block scales in the 128x4 swizzled layout (zero-padded)."""
    return roundup(rows, SWIZZLE_ROWS), roundup(cols, SWIZZLE_COLS)
