"""Pure tensor transforms: no I/O, same bytes on CPU and CUDA.

Scalar scale arithmetic is done by the callers in float32 on the CPU and passed in as Python-free
0-dim float32 tensors, so that device math is only elementwise IEEE float32 and exact casts.

The torch transforms (``ops.fp8``, ``ops.layout``) are reached as attributes of this package, which
imports each on first use, so a plan is made before torch is loaded. NVFP4's byte moves and
block-scale tables (``ops.nvfp4``) and the row orders (``ops.rows``) are numpy, and the engine never
loads torch for a plan made only of them. The shape arithmetic planners need is here, torch-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mocli.ops import fp8, layout

SWIZZLE_ROWS = 128
SWIZZLE_COLS = 4
SHUFFLE_BLOCK = 32

__all__ = ["SHUFFLE_BLOCK", "SWIZZLE_COLS", "SWIZZLE_ROWS", "fp8", "layout", "roundup", "swizzled_shape"]


def roundup(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """Shape of [rows, cols] block scales in the 128x4 swizzled layout (zero-padded)."""
    return roundup(rows, SWIZZLE_ROWS), roundup(cols, SWIZZLE_COLS)


def __getattr__(name: str):
    if name in ("fp8", "layout"):
        return importlib.import_module(f"mocli.ops.{name}")
    raise AttributeError(f"module 'mocli.ops' has no attribute {name!r}")
