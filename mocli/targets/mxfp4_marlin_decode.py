"""The marlin layout of MXFP4 weights read back (SEMANTICS §19.5): what verify and the serving
emulation decode an ``mxfp4_marlin_*`` module with.

The weight words are NVFP4's Marlin repack (``marlin_decode.decode_weight``). The scales are E8M0 codes
[Kp/32, Np], each run of 64 along Np in the order of the 8x8 transpose and the [0, 2, 1, 3] swap
(``marlin_decode._natural_rows``, written from §13.5's description, not from ``mocli.ops``); a code is
the source's own byte, padding code 0. Dequantization: ``e2m1(q) * 2^(c - 127)``.
"""

from __future__ import annotations

import numpy as np

from mocli.targets.decode import LayoutError
from mocli.targets.marlin_decode import (
    _natural_rows,
    c_takes_scales,
    decode_bias,
    decode_weight,
    halves,
    scales_in_c,
    weight_matches,
)

GROUP = 32
_IDENTITY = np.arange(256, dtype=np.uint8)  # a code is the source's own byte


def decode_scales(stored: np.ndarray, n: int, kb: int, what: str, fill: int = 0) -> np.ndarray:
    """Marlin E8M0 bytes [Kp/32, Np] -> the source's codes uint8 [n, kb]; padding must be code ``fill``."""
    raw = np.ascontiguousarray(stored).view(np.uint8)
    fault = f"{what}: Marlin scale padding is not code {fill}"
    if c_takes_scales(raw, n, kb):  # in C where it is built (the same bytes)
        return scales_in_c(raw, n, kb, _IDENTITY, fill, fault)
    back = np.take(np.ascontiguousarray(raw.T), _natural_rows(raw.shape[1]), axis=0)  # [Np, Kp/32]
    if bool((back[n:] != fill).any()) or bool((back[:n, kb:] != fill).any()):
        raise LayoutError(fault)
    return np.ascontiguousarray(back[:n, :kb])


_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def dequant(packed: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """uint8 [n, k/2] (low nibble first) and E8M0 codes [n, k/32] -> float32 [n, k] (exact)."""
    n = packed.shape[0]
    vals = np.stack([_E2M1[packed & 0x0F], _E2M1[packed >> 4]], axis=-1).reshape(n, -1, GROUP)
    scale = np.ldexp(np.float32(1), codes.astype(np.int32) - 127).astype(np.float32)
    return (vals * scale[..., None]).reshape(n, -1)


__all__ = ["decode_bias", "decode_scales", "decode_weight", "dequant", "halves", "weight_matches"]
