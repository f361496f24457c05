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


def bf16_bytes(raw, dtype: str):
    """A float vector's stored bytes (``UnitContext.array``: [n, itemsize] uint8, or the values themselves) as
    BF16 words: BF16 as it is, F32 / F16 rounded to nearest even, as torch's ``copy_`` into a BF16 parameter
    casts (the activation dtype a pre_quant_scale multiplies in, SEMANTICS §15.3). That is how a vLLM-style
    loader reads a wider file dtype: vllm 0.32.0 (CPU wheel, read) model_loader/weight_utils.py ::
    default_weight_loader does ``param.data.copy_(loaded_weight)``. Stock vLLM has no NVFP4_AWQ path
    (modelopt.py refuses the algorithm, VLL001) and no pre_quant_scale parameter; mocli's plugin loads the
    converted BF16 vector. Widening F16 to F32 is exact, so F16 is rounded once."""
    import numpy as np

    stored = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}[dtype]
    a = np.ascontiguousarray(raw)
    v = (a.view(stored) if a.dtype == np.uint8 else a.astype(stored, copy=False)).reshape(-1)
    if dtype == "BF16":
        return v
    u = v.astype(np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
